"""Preemption: a signal only sets a flag; at a boundary every rank agrees through one all-reduce.

SIGTERM (schedulers, the deepspeed launcher), SIGUSR1 (SLURM `--signal`) and SIGINT (Ctrl-C). A rank
that got no signal still stops with the others, so all ranks save the same step and exit together with
EXIT_PREEMPTED, which launch scripts read as "requeue me".

A file works as a signal too (OUTPUT_DIR/PREEMPT): launchers do not forward SIGUSR1 to their children,
so scripts/slurm.sbatch traps SLURM's warning in the batch shell and touches this file on the shared
file system. Rank 0 alone looks for it (and alone removes it when a run starts): another node may still see
a removed file for up to a minute, and its vote would stop the requeued job at its first step.

The time limit is a stop reason too: a 1M-token step on 8 GPUs takes minutes, longer than SLURM's 120 s
warning, and a job killed at its limit ends TIMEOUT and is never requeued. With SLURM_JOB_END_TIME (epoch
seconds, set by SLURM) or `--time_limit_s`, a rank votes to stop when less than one measured step plus one
measured save (and a margin) remains; until a save has been measured, `SAVE_GUESS_S` stands in for it.

The time ahead of a check counts all the work before the next one: after the step that ends a stage, the
save *and the stage's evaluation*; before a stage builds its engine, the build (ZeRO-3 init, restore) and its
first step. Each is measured the first time it runs; until then an evaluation counts as one step and a build
as nothing (the first build is at the job's start).

Saves bounded by time (`save_interval_minutes`): rank 0's clock alone says when the interval has passed, and
its vote travels in the same all-reduce, so every rank saves the same step. `auto` (the default) is every 9 minutes
(a crash loses at most the interval plus one save's write: <= 10 minutes where a rank's checkpoint is written in
<= 60 s), stretched where the last save blocked the steps more than 1% of the interval (rank 0's measurement,
rank 0's decision): 100 x the blocked seconds. An asynchronous save blocks ~1 s (0.8 s projected for Llama-3-8B on
32 ranks): every 9 minutes at ~0.15%. A synchronous one blocks for its whole write (95 s projected): every 158
minutes, where every 9 would cost 18% (docs/checkpoints.md). Until a save is measured, 9 minutes.

Where the flag is checked (train.py): after every step, after every save and evaluation, and before a stage
builds its engine; each check is one all-reduce of two numbers (MAX over ranks: stop, save due), so every
rank decides the same from the collective, never from its own clock alone.
"""

from __future__ import annotations

import os
import signal
import time

from base import comm

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
SAVE_GUESS_S = 300.0  # before the first measured save (Llama-3-8B, 32 ranks: ~100 GB at a few GB/s)
AUTO_SAVE_EVERY_S = 540.0  # save_interval_minutes auto: lost work <= 9 min + one write (<= 10 min) ...
MAX_SAVE_OVERHEAD = 0.01  # ... unless the saves would then block the steps > 1% of the time
MARGIN_S = 30.0


class Deadline:
    """When the job must be out: SLURM_JOB_END_TIME, else start + time_limit_s, else never."""

    def __init__(self, time_limit_s: float = 0.0, now: float | None = None):
        now = time.time() if now is None else now
        end = os.environ.get("SLURM_JOB_END_TIME")
        self.end = float(end) if end else (now + time_limit_s if time_limit_s > 0 else None)
        self.step_s = 0.0  # longest step measured
        self.save_s: float | None = None  # longest save measured
        self.build_s = 0.0  # longest engine build + restore measured
        self.eval_s: float | None = None  # longest stage evaluation measured

    def record_step(self, seconds: float) -> None:
        self.step_s = max(self.step_s, seconds)

    def record_save(self, seconds: float) -> None:
        self.save_s = max(self.save_s or 0.0, seconds)

    def record_build(self, seconds: float) -> None:
        self.build_s = max(self.build_s, seconds)

    def record_eval(self, seconds: float) -> None:
        self.eval_s = max(self.eval_s or 0.0, seconds)

    def evaluation_s(self) -> float:
        """A stage evaluation's time: measured, else one step's (a few forward passes at the stage's length)."""
        return self.step_s if self.eval_s is None else self.eval_s

    def saving_s(self) -> float:
        """A save's time: the longest measured (a background one: snapshot to commit), else SAVE_GUESS_S."""
        return SAVE_GUESS_S if self.save_s is None else self.save_s

    def ahead_s(self, stage_ends: bool, write_in_flight: bool) -> float:
        """Work after a step, before the next check, beyond the step and the stop's own save: the stage's
        evaluation when the step ends the stage, and a background write in flight (the stop's save waits for it;
        before the first one commits, nothing is measured: SAVE_GUESS_S stands in, as for the stop's save)."""
        return (self.evaluation_s() if stage_ends else 0.0) + (self.saving_s() if write_in_flight else 0.0)

    def needed_s(self, ahead_s: float = 0.0) -> float:
        """One step, one save, the margin, and `ahead_s` of other work before the next check."""
        return self.step_s + self.saving_s() + MARGIN_S + ahead_s

    def near(self, now: float | None = None, ahead_s: float = 0.0) -> bool:
        if self.end is None:
            return False
        return (self.end - (time.time() if now is None else now)) < self.needed_s(ahead_s)


def auto_save_every_s(blocked_s: float | None) -> float:
    """`save_interval_minutes: auto` in seconds, from the last save's blocked time (None: none measured yet)."""
    return AUTO_SAVE_EVERY_S if blocked_s is None else max(AUTO_SAVE_EVERY_S, blocked_s / MAX_SAVE_OVERHEAD)


class PreemptionFlag:
    def __init__(self, stop_file: str | None = None, deadline: Deadline | None = None,
                 save_every_s: float | str = 0.0):
        self.received: int | str | None = None  # what this rank saw
        self.stopping = False  # what all ranks agreed at the last check
        self.save_due = False  # ... and whether save_every_s has passed since the last save (rank 0's clock)
        self.stop_file = stop_file
        self.deadline = deadline or Deadline()
        self.auto_interval = save_every_s == "auto"
        self.save_every_s = auto_save_every_s(None) if self.auto_interval else float(save_every_s)
        self._last_save = time.monotonic()
        self._previous = {}

    def install(self) -> PreemptionFlag:
        for s in SIGNALS:
            self._previous[s] = signal.signal(s, self._handler)
        return self

    def _handler(self, signum, frame) -> None:  # no I/O, no collectives: just remember it
        self.received = signum

    def agreed(self, ahead_s: float = 0.0) -> bool:
        """True on every rank when any rank got a signal, rank 0 saw the stop file, or a rank is near the time
        limit with `ahead_s` of work before the next check; also sets `save_due` the same on every rank
        (a collective: call it on all ranks at the same points)."""
        if self.received is None and self.stop_file and comm.rank() == 0 and os.path.exists(self.stop_file):
            self.received = "stop file"
        if self.received is None and self.deadline.near(ahead_s=ahead_s):
            self.received = "time limit"
        due = comm.rank() == 0 and self.save_every_s > 0 and time.monotonic() - self._last_save >= self.save_every_s
        votes = comm.all_reduce([1.0 if self.received is not None else 0.0, float(due)], op="max")
        self.stopping, self.save_due = bool(votes[0].item()), bool(votes[1].item())
        return self.stopping

    def saved(self, blocked_s: float | None = None) -> None:
        """A save was made (committed, or snapshotted for a background write): the save interval starts again.
        `blocked_s`: how long it held the steps, for the `auto` interval (rank 0's reading decides, as `due` does;
        None: keep the last measurement, for a save unlike the periodic ones, e.g. a stage's synchronous end)."""
        self._last_save = time.monotonic()
        self.save_due = False
        if self.auto_interval and blocked_s is not None:
            self.save_every_s = auto_save_every_s(blocked_s)

    def uninstall(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
