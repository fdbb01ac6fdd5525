"""Preemption: a signal only sets a flag; at a step boundary every rank agrees through one all-reduce.

SIGTERM (schedulers, the deepspeed launcher), SIGUSR1 (SLURM `--signal`) and SIGINT (Ctrl-C). A rank
that got no signal still stops with the others, so all ranks save the same step and exit together with
EXIT_PREEMPTED, which launch scripts read as "requeue me".
"""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class PreemptionFlag:
    def __init__(self):
        self.received: int | None = None
        self._previous = {}

    def install(self) -> PreemptionFlag:
        for s in SIGNALS:
            self._previous[s] = signal.signal(s, self._handler)
        return self

    def _handler(self, signum, frame) -> None:  # no I/O, no collectives: just remember it
        self.received = signum

    def agreed(self) -> bool:
        """True on every rank when any rank got a signal (a collective: call it on all ranks)."""
        t = torch.tensor([1 if self.received is not None else 0], dtype=torch.int32)
        if dist.is_initialized():
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def uninstall(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
