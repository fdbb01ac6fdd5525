"""Fault injection for tests/e2e/test_failure.py: on PYTHONPATH (ahead of the project) only in the runs that ask.

FAULT="RANK:WHERE:STEP" makes rank RANK raise at step STEP (1-based): WHERE is `before` (at the start of the
step, before its first collective), `during` (inside the step, after the forward pass, while the other ranks
go on into backward's collectives) or `after` (once the step is done, while the others log it).
The failing rank then hangs in its teardown (an atexit sleep that runs before the process group is left), as
an NCCL rank with pending work can: its sockets stay open, so the others' gloo collectives do not fail by
themselves and only the abort channel can stop them; the rank's own exit timer (EXIT_GRACE_S) ends it.
`hang` ("1:hang:3") makes the rank stop at the start of step STEP for an hour, before its first collective (a hung
host-side read or kernel launch), no exception, its process alive.
A fourth field `quick` ("0:after:2:quick") makes the opposite: the process is gone as soon as train.py has
reported the failure (an atexit `os._exit(1)`, before any teardown), as when its launcher kills it.
HOLD="RANK:SECONDS:STEP" makes rank RANK hold the GIL for SECONDS inside its optimizer step at step STEP (a
CPU-bound loop under a 1000 s switch interval, so no other thread of the rank runs: what DeepSpeed's CPU Adam
`adam_update` does for a whole sub-group).
BROKEN="RANK" makes rank RANK die at interpreter start-up, before train.py's first line (before the abort channel
opens), as an import error does on a node whose venv or mount is broken: it prints the ImportError and exits 1.
BROKEN_NODE="K" makes every Python started on node K (SLURM_NODEID, as srun sets it for every process of a node's
task) exit at once, whatever it is (node 0's job store, the deepspeed launcher, the ranks): a node whose venv, torch
or mount is broken, the job's store host included.
CPUS="0" confines the rank to those CPUs (os.sched_setaffinity, what `taskset -c 0` does), as a one-CPU srun
step confines every rank of a node.
WATCH="POLL_S:STALL_S:LOST_STORE_S[:EXIT_GRACE_S]" shortens the abort channel's timings (base.watcher).
SLOW_POST="K:SECONDS" makes node K's launcher slow to post its exit to the job's store (`python -m base.node_store
post`, launch.sh after its ranks exit): it sleeps SECONDS before its first line, as a torch import from a cold shared
file system can, so Slurm's SIGTERM and node 0's store going away both come first.
LINGER="RANK:SECONDS[,RANK:SECONDS]" makes a rank slow on its clean way out (MetricsLogger.close, after the agreed
stop, before the rank leaves the abort channel), as a W&B sync can be.
"""

import os

_rank = os.environ.get("RANK")


def _install() -> None:
    fault, watch, linger = os.environ.get("FAULT"), os.environ.get("WATCH"), os.environ.get("LINGER")
    if os.environ.get("CPUS"):
        os.sched_setaffinity(0, {int(c) for c in os.environ["CPUS"].split(",")})
    if os.environ.get("HOLD") and os.environ["HOLD"].split(":")[0] == _rank:
        _hold_gil(*os.environ["HOLD"].split(":")[1:])
    if watch:
        from base import watcher

        names = ("POLL_S", "STALL_S", "LOST_STORE_S", "EXIT_GRACE_S")
        for name, value in zip(names, watch.split(":")):
            setattr(watcher, name, float(value))
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
    _, where, at, *how = fault.split(":")
    at = int(at)
    import atexit
    import time

    from training import step

    def fail(msg):
        # runs first (last registered): a teardown that hangs, or none at all
        atexit.register(*((os._exit, 1) if how == ["quick"] else (time.sleep, 3600)))
        raise RuntimeError(msg)

    real = step.train_step
    calls = [0]

    def train_step(engine, micro_batches, world, loss_fn=step.loss_sum, before_step=None):
        calls[0] += 1
        if calls[0] != at:
            return real(engine, micro_batches, world, loss_fn=loss_fn, before_step=before_step)
        if where == "before":
            fail(f"injected fault before step {at}")
        if where == "hang":  # stuck at the step's start, before its first collective: no exception, no exit
            time.sleep(3600)
        if where == "during":
            def failing_loss(engine, mb):
                loss_fn(engine, mb)
                fail(f"injected fault during step {at}")

            return real(engine, micro_batches, world, loss_fn=failing_loss, before_step=before_step)
        real(engine, micro_batches, world, loss_fn=loss_fn, before_step=before_step)
        fail(f"injected fault after step {at}")

    step.train_step = train_step


def _hold_gil(seconds: str, at: str) -> None:
    import sys
    import time

    from training import step

    real, calls = step.train_step, [0]

    def train_step(engine, *args, **kwargs):
        calls[0] += 1
        if calls[0] != int(at):
            return real(engine, *args, **kwargs)
        optimizer_step = engine.step

        def held_step(*a, **k):
            interval = sys.getswitchinterval()
            sys.setswitchinterval(1000.0)  # a thread that wants the GIL now waits 1000 s before asking for it
            time.sleep(0.1)  # (threads already waiting under the old interval take their turn first)
            end = time.perf_counter() + float(seconds)
            while time.perf_counter() < end:  # CPU-bound, GIL held: no other thread of this rank runs
                pass
            sys.setswitchinterval(interval)
            return optimizer_step(*a, **k)

        engine.step = held_step
        try:
            return real(engine, *args, **kwargs)
        finally:
            del engine.step

    step.train_step = train_step


if os.environ.get("BROKEN_NODE") is not None and os.environ.get("BROKEN_NODE") == os.environ.get("SLURM_NODEID"):
    import sys

    print(f"ImportError: libcudart.so.12: cannot open shared object file (injected: tests/stubs/faults BROKEN_NODE, "
          f"node {os.environ['BROKEN_NODE']}: {' '.join(getattr(sys, 'argv', []))[:120]})", file=sys.stderr, flush=True)
    os._exit(1)
if os.environ.get("SLOW_POST", ":").split(":")[0] == os.environ.get("SLURM_NODEID") and _rank is None:
    with open("/proc/self/cmdline", "rb") as _fh:
        if b"base.node_store\0post\0" in _fh.read():
            import time

            time.sleep(float(os.environ["SLOW_POST"].split(":")[1]))
if _rank is not None and os.environ.get("BROKEN") == _rank:
    import sys

    print("ImportError: libcudart.so.12: cannot open shared object file (injected: tests/stubs/faults BROKEN)",
          file=sys.stderr, flush=True)
    os._exit(1)
if _rank is not None and any(os.environ.get(k) for k in ("FAULT", "WATCH", "LINGER", "HOLD", "CPUS")):
    _install()
