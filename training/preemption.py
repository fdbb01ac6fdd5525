"""Preemption: a signal only sets a flag; at a step boundary every rank agrees through one all-reduce.

SIGTERM (schedulers, the deepspeed launcher), SIGUSR1 (SLURM `--signal`) and SIGINT (Ctrl-C). A rank
that got no signal still stops with the others, so all ranks save the same step and exit together with
EXIT_PREEMPTED, which launch scripts read as "requeue me".

A file works as a signal too (OUTPUT_DIR/PREEMPT): launchers do not forward SIGUSR1 to their children,
so scripts/slurm.sbatch traps SLURM's warning in the batch shell and touches this file on the shared
file system; every rank checks it at the step boundary.
"""

from __future__ import annotations

import os
import signal

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class PreemptionFlag:
    def __init__(self, stop_file: str | None = None):
        self.received: int | str | None = None
        self.stop_file = stop_file
        self._previous = {}

    def install(self) -> PreemptionFlag:
        for s in SIGNALS:
            self._previous[s] = signal.signal(s, self._handler)
        return self

    def _handler(self, signum, frame) -> None:  # no I/O, no collectives: just remember it
        self.received = signum

    def agreed(self) -> bool:
        """True on every rank when any rank got a signal (a collective: call it on all ranks)."""
        if self.received is None and self.stop_file and os.path.exists(self.stop_file):
            self.received = "stop file"
        t = torch.tensor([1 if self.received is not None else 0], dtype=torch.int32)
        if dist.is_initialized():
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def uninstall(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
