"""Fault injection for tests/e2e/test_failure.py: on PYTHONPATH (ahead of the project) only in the runs that ask.

FAULT="RANK:WHERE:STEP" makes rank RANK raise at step STEP (1-based): WHERE is `before` (at the start of the
step, before its first collective), `during` (inside the step, after the forward pass, while the other ranks
go on into backward's collectives) or `after` (once the step is done, while the others log it).
The failing rank then hangs in its teardown (an atexit sleep that runs before the process group is left), as
an NCCL rank with pending work can: its sockets stay open, so the others' gloo collectives do not fail by
themselves and only the abort channel can stop them; the rank's own exit timer (EXIT_GRACE_S) ends it.
WATCH="POLL_S:STALL_S:LOST_STORE_S[:EXIT_GRACE_S]" shortens the abort channel's timings (base.comm).
LINGER="RANK:SECONDS[,RANK:SECONDS]" makes a rank slow on its clean way out (MetricsLogger.close, after the agreed
stop, before the rank leaves the abort channel), as a W&B sync can be.
"""

import os

_rank = os.environ.get("RANK")


def _install() -> None:
    fault, watch, linger = os.environ.get("FAULT"), os.environ.get("WATCH"), os.environ.get("LINGER")
    if watch:
        from base import comm

        names = ("POLL_S", "STALL_S", "LOST_STORE_S", "EXIT_GRACE_S")
        for name, value in zip(names, watch.split(":")):
            setattr(comm, name, float(value))
    lingers = dict(x.split(":") for x in linger.split(",")) if linger else {}
    if _rank in lingers:
        import time

        from training import metrics

        close = metrics.MetricsLogger.close

        def slow_close(self):
            time.sleep(float(lingers[_rank]))
            close(self)

        metrics.MetricsLogger.close = slow_close
    if not fault or fault.split(":")[0] != _rank:
        return
    _, where, at = fault.split(":")
    at = int(at)
    import atexit
    import time

    from training import step

    def fail(msg):
        atexit.register(time.sleep, 3600)  # runs first (last registered): a teardown that hangs
        raise RuntimeError(msg)

    real = step.train_step
    calls = [0]

    def train_step(engine, micro_batches, world, loss_fn=step.loss_sum, before_step=None):
        calls[0] += 1
        if calls[0] != at:
            return real(engine, micro_batches, world, loss_fn=loss_fn, before_step=before_step)
        if where == "before":
            fail(f"injected fault before step {at}")
        if where == "during":
            def failing_loss(engine, mb):
                loss_fn(engine, mb)
                fail(f"injected fault during step {at}")

            return real(engine, micro_batches, world, loss_fn=failing_loss, before_step=before_step)
        real(engine, micro_batches, world, loss_fn=loss_fn, before_step=before_step)
        fail(f"injected fault after step {at}")

    step.train_step = train_step


if _rank is not None and (os.environ.get("FAULT") or os.environ.get("WATCH") or os.environ.get("LINGER")):
    _install()
