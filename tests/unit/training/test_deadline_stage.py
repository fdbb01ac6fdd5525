"""training/preemption.py's time-limit check at a stage change: before a longer stage builds its engine, the check
counts that stage's step, not the shorter stage's measured one (Llama-3-8B on 32 ranks, 512k -> 1M: 102 s counted for
a ~387 s step, so the job built, restored and stepped into its time limit). The real stage loop (training/stage.py,
on test_stop_window's stand-ins) scales the measured step and evaluation by the planner's step-time model, else by
the model's FLOPs at each length; the next stage's first measurement replaces the estimate. No model: < 1 s."""

from __future__ import annotations

import types

import pytest
import torch

from base.parallel import ParallelDims
from planner.presets import PRESETS
from training.preemption import MARGIN_S, Deadline
from training.stage import step_cost_ratio

K = 1024


def stage(index: int, length: int, sp: int = 8, predicted: float | None = None, steps: int = 2):
    return types.SimpleNamespace(index=index, name=f"s{index}", max_steps=steps, sp=sp, cp=1, max_seq_length=length,
                                 rope=None, deepspeed_overrides=None, reset_optimizer=False, eval=None,
                                 memory_choice={"predicted_step_s": predicted} if predicted else None,
                                 steps_from="steps")


def llama3_8b():
    """What step_cost_ratio reads of the run's Hugging Face config: its to_dict() (the planner's preset, Llama-3-8B)."""
    return types.SimpleNamespace(to_dict=lambda: dict(PRESETS["llama3-8b"]))


@pytest.mark.parametrize("left, stops", [(600, True), (690, True), (720, False)])
def test_the_check_before_a_longer_stage_counts_its_step(left, stops):
    """The auditor's figures (recipes/llama3_8b_128k_to_1m.yaml, 32 ranks): build + restore 120 s, save 161 s, the
    512k step 102 s, the 1M step ~387 s. With 600 or 690 s left the 1M stage no longer builds (the job was killed
    mid-step or mid-save at the limit: TIMEOUT, never requeued); with 720 s it does, and its step and save fit."""
    d = Deadline(time_limit_s=left, now=0.0)
    d.record_build(120.0), d.record_step(102.0), d.record_save(161.0), d.record_eval(200.0)
    d.next_stage(step_cost_ratio(None, stage(0, 512 * K, predicted=102.0), stage(1, 1024 * K, predicted=387.0)))
    assert d.step_s == pytest.approx(387.0) and d.evaluation_s() == pytest.approx(200.0 * 387 / 102)
    assert d.near(now=0.0, ahead_s=d.build_s) == stops  # train.py, before the stage builds its engine
    assert (left - (120 + 387 + 161 + MARGIN_S) < 0) == stops


def test_the_next_stages_first_measurement_replaces_the_estimate():
    d = Deadline()
    d.record_step(102.0), d.record_eval(50.0)
    d.next_stage(4.0)
    d.record_step(300.0), d.record_eval(150.0)  # shorter than the estimate (408 s, 200 s): measured wins
    assert (d.step_s, d.eval_s) == (300.0, 150.0)
    d.record_step(250.0), d.record_eval(100.0)  # then the longest of the stage, as before
    assert (d.step_s, d.eval_s) == (300.0, 150.0)


def test_the_cost_ratio_without_the_planners_prediction():
    """No memory_choice (memory_features manual): the model's FLOPs per sequence over each SP degree (Llama-3-8B,
    512k -> 1M at sp 8: x3.80, the planner's 387/102 = 3.79); a halved SP degree doubles it. A config the planner
    cannot read: all attention for a longer stage (x4), the length ratio for a shorter one."""
    cfg = llama3_8b()
    assert step_cost_ratio(cfg, stage(0, 512 * K), stage(1, 1024 * K)) == pytest.approx(3.80, abs=0.01)
    assert step_cost_ratio(cfg, stage(0, 512 * K), stage(1, 1024 * K, sp=4)) == pytest.approx(7.61, abs=0.01)
    assert step_cost_ratio(cfg, stage(0, 64 * K), stage(1, 128 * K, predicted=9.0)) > 2  # one prediction: FLOPs
    assert step_cost_ratio(types.SimpleNamespace(), stage(0, 512 * K), stage(1, 1024 * K)) == 4.0
    assert step_cost_ratio(types.SimpleNamespace(), stage(0, 1024 * K), stage(1, 512 * K)) == 0.5


def test_the_stage_loop_scales_the_step_for_the_next_stage(monkeypatch):
    """The real train_stage of a 512k stage (102 s steps) followed by a 1M one: after its end the deadline counts the
    1M stage's step (~387 s), and the 1M stage's own first step (here 380 s) replaces that estimate."""
    from tests.unit.training.test_stop_window import Clock, SimCheckpointer, stub_data, stub_stage
    from training import preemption
    from training import stage as stage_mod
    from training.checkpoint import TrainState
    from training.preemption import PreemptionFlag

    clock, step_s = Clock(), [102.0]
    monkeypatch.setattr(stage_mod, "time", clock)
    monkeypatch.setattr(preemption, "time", clock)
    monkeypatch.delenv("SLURM_JOB_END_TIME", raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)

    def step(*a, **k):
        clock.t += step_s[0]
        return {"loss": 1.0, "step_time": step_s[0], "label_tokens": 1}

    stub_stage(monkeypatch, torch.nn.Linear(1, 1, bias=False), train_step=step)
    cfg = types.SimpleNamespace(seed=0, per_device_train_batch_size=1, gradient_accumulation_steps=1, save_steps=0,
                                async_save=False, loss_weighting=None, output_dir="/unused")
    flag, begun = PreemptionFlag(None, Deadline(0.0, now=clock.t), save_every_s=0), []
    metrics = types.SimpleNamespace(log=lambda r: None, run_id=None, home=None, begin_stage=lambda end, start=None: begun.append(
        (start, end)))
    run = stage_mod.Run(cfg, ParallelDims(world=32, sp=8, rank=0, local_rank=0), stub_data(heldout=lambda *a: None),
                        SimCheckpointer(clock), metrics, flag, llama3_8b(), "sdpa", False)
    stages, state = [stage(0, 512 * K), stage(1, 1024 * K)], TrainState()
    stage_mod.train_stage(run, stages[0], stages, state)
    assert flag.deadline.step_s == pytest.approx(102.0 * 3.80, rel=0.01)
    step_s[0] = 380.0
    stage_mod.train_stage(run, stages[1], stages, state)
    assert flag.deadline.step_s == 380.0 and state.step == 4
    assert begun == [(0, 2), (2, 4)]  # each stage's bar from its first step (a resumed stage's too: training/metrics)
