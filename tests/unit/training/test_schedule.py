"""The LR schedule (training/schedule.py) against the Hugging Face Trainer's, and the plan line that prints it
(training/summary.plan_lines). Audit optD: warmup here is one step ahead of the Trainer's, kept on purpose (a change
would move shipped recipes' and resumed runs' LRs) and pinned below so that a change is deliberate; the plan printed a
decay (lr=0.002->0.0002) for a `constant` stage, which trains at its peak after warmup."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from transformers import optimization as hf

from training.config import Config, StageConfig
from training.curriculum import resolve_stages
from training.schedule import lambda_scheduler, lr_at

PEAK, FLOOR, TOTAL = 2e-3, 2e-4, 10


def hf_lambda(kind: str, warmup: int, total: int = TOTAL, floor: float = FLOOR):
    """transformers' own multiplier of the peak at each optimizer step (transformers/optimization.py)."""
    if kind == "cosine":  # cosine_with_min_lr (min_lr_rate: the floor's share); the Trainer's cosine at floor 0
        return partial(hf._get_cosine_schedule_with_warmup_lr_lambda, num_warmup_steps=warmup,
                       num_training_steps=total, num_cycles=0.5, min_lr_rate=floor / PEAK)
    if kind == "linear":  # the Trainer's linear decays to 0
        return partial(hf._get_linear_schedule_with_warmup_lr_lambda, num_warmup_steps=warmup, num_training_steps=total)
    return partial(hf._get_constant_schedule_with_warmup_lr_lambda, num_warmup_steps=warmup)  # constant_with_warmup


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant"])
@pytest.mark.parametrize("warmup", [0, 1, 2, 4, 9])
def test_warmup_is_one_step_ahead_of_the_trainers(kind, warmup):
    """Step s < w trains at peak (s+1)/w here, the Trainer's HF(s + 1); from step w on, the Trainer's HF(s)
    (docs/curriculum.md, "Hugging Face and TRL names"). Changing either side of this fails here: say it in the docs."""
    floor = 0.0 if kind == "linear" else FLOOR
    theirs = hf_lambda(kind, warmup, floor=floor)
    for s in range(TOTAL):
        ours = lr_at(s, PEAK, floor, warmup, TOTAL, kind)
        want = PEAK * theirs(s + 1 if s < warmup else s)
        assert ours == pytest.approx(want, rel=1e-12, abs=1e-15), (kind, warmup, s, ours, want)
    if warmup:  # the Trainer's first step trains at 0; ours never does
        assert theirs(0) == 0.0 and lr_at(0, PEAK, floor, warmup, TOTAL, kind) == PEAK / warmup


def test_warmup_steps_1_is_no_warmup_and_the_peak_is_held_twice():
    assert lr_at(0, PEAK, FLOOR, 1, TOTAL, "cosine") == PEAK  # the Trainer's: 0, then the peak
    assert hf_lambda("cosine", 1)(0) == 0.0
    w = 4  # the peak at steps w-1 and w here; at step w only in the Trainer
    assert [lr_at(s, PEAK, FLOOR, w, TOTAL, "cosine") for s in (w - 1, w)] == [PEAK, PEAK]
    assert [hf_lambda("cosine", w)(s) for s in (w - 1, w)] == [0.75, 1.0]


def test_the_engines_scheduler_trains_step_s_at_lr_at_s():
    """The LambdaLR handed to deepspeed.initialize: the optimizer's first step is at lr_at(0), as the Trainer's first
    step is at its lambda(0) (DeepSpeed steps the scheduler after the optimizer, as the Trainer does)."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=PEAK)
    sched = lambda_scheduler(PEAK, FLOOR, 3, TOTAL, "cosine")(opt)
    seen = []
    for _ in range(TOTAL):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([lr_at(s, PEAK, FLOOR, 3, TOTAL, "cosine") for s in range(TOTAL)], rel=1e-12)
    assert seen[0] == pytest.approx(PEAK / 3)


def plan_stage_lines(tmp_path, monkeypatch, stages: list[StageConfig]) -> list[str]:
    from training.summary import plan_lines

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    cfg = Config(output_dir=str(tmp_path), stages=stages, learning_rate=PEAK, min_lr=FLOOR)
    return [x for x in plan_lines(cfg, resolve_stages(cfg, lambda sp: 1), 1, 1, False) if x.startswith("  stage ")]


def test_the_plan_line_prints_no_decay_for_a_constant_stage(tmp_path, monkeypatch):
    """optD: `lr=0.002->0.0002 constant warmup=2` for a stage that trains at 0.002 after its warmup."""
    a, b, c = plan_stage_lines(tmp_path, monkeypatch, [
        StageConfig(name="a", max_seq_length=64, max_steps=10, warmup_steps=2, lr_scheduler="constant"),
        StageConfig(name="b", max_seq_length=64, max_steps=10, warmup_steps=1),
        StageConfig(name="c", max_seq_length=64, max_steps=10, lr_scheduler="linear", learning_rate=1e-3)])
    assert " lr=0.002 constant warmup=2 " in a, a
    assert " lr=0.002->0.0002 cosine warmup=1 " in b, b
    assert " lr=0.001->0.0002 linear warmup=0 " in c, c
    assert lr_at(5, PEAK, FLOOR, 2, 10, "constant") == PEAK  # what the line now says
