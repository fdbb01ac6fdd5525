"""Learning-rate schedules as pure functions of the step (warmup, then cosine / linear decay to min_lr)."""

from __future__ import annotations

import math


def lr_at(step: int, peak: float, min_lr: float, warmup: int, total: int, kind: str) -> float:
    """LR used by optimizer step `step` (0-based) of a schedule lasting `total` steps.

    Warmup is one step ahead of the Hugging Face Trainer's (transformers/optimization.py,
    `_get_cosine_schedule_with_warmup_lr_lambda` and its linear / constant twins: peak * step / warmup): step s < warmup
    trains here at peak * (s + 1) / warmup, there at peak * s / warmup; from step `warmup` on the two are equal. So the
    first step is at peak / warmup (theirs at 0), the peak is held at steps warmup - 1 and warmup, and `warmup_steps: 1`
    is no warmup. Kept on purpose: a change would move the LRs of shipped recipes and of runs resumed across it
    (docs/curriculum.md, "Hugging Face and TRL names"; pinned by tests/unit/training/test_schedule.py)."""
    if warmup > 0 and step < warmup:
        return peak * (step + 1) / warmup
    if kind == "constant" or total <= warmup:
        return peak
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    if kind == "linear":
        return min_lr + (peak - min_lr) * (1.0 - frac)
    return min_lr + (peak - min_lr) * 0.5 * (1.0 + math.cos(math.pi * frac))


def lambda_scheduler(peak: float, min_lr: float, warmup: int, total: int, kind: str):
    """A factory for `deepspeed.initialize(lr_scheduler=...)`: LambdaLR over optimizer steps."""
    import torch

    def make(optimizer):
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: lr_at(s, peak, min_lr, warmup, total, kind) / peak)

    return make
