"""A run's health (audit 69): non-finite steps, loss spikes, a non-finite state at a save, a non-finite held-out loss.

A NaN in a weight made every later step's loss NaN while DeepSpeed skipped every update (ZeRO-3 reads an invalid norm
as an overflow in bf16 and fp32 too); the run went on to its end, saved NaN checkpoints that rotated the good ones
away, started the next stage from them and exported NaN weights, exit 0. A loss spike was never said and its
pre-spike checkpoint rotated away. A NaN in a weight no batch reads was saved and exported. metrics.jsonl held bare
NaN (not JSON: jq refuses it). Now: each non-finite step is said and nothing is saved while they last, BAD_STEPS_STOP
in a row stop in one line (exit 2) naming the first and the checkpoint before it; a spike is said and keeps the
checkpoint before it (checkpoints/PINNED); a save refuses a non-finite optimizer state, naming the rank and host; a
non-finite held-out loss refuses the next stage. training/stage.py's real loop with the real Checkpointer on a
stand-in engine (test_stop_window's stand-ins), one process: ~2 s."""

from __future__ import annotations

import json
import math
import os
import signal
import types

import pytest
import torch

from base.parallel import ParallelDims
from tests.unit.training.test_checkpoint import FakeConfig, FakeEngine
from tests.unit.training.test_stop_window import Clock, stub_data, stub_stage
from training import job, preemption, rotation
from training import stage as stage_mod
from training.checkpoint import Checkpointer, TrainState, tag_for
from training.preemption import Deadline, PreemptionFlag

NAN = float("nan")
K = 5  # training/step.BAD_STEPS_STOP
# the audit's spike_lr run (tiny-llama, lr 1e-3, the LR x1000 at step 5's update): the loss of step 6 on
SPIKE = [7.64, 7.35, 7.41, 6.85, 6.60, 74.39, 58.80, 63.32, 56.39, 31.31, 55.77, 38.73]


class Metrics:
    def __init__(self):
        self.records = []

    def log(self, record):
        self.records.append(record)

    run_id = home = None

    def begin_stage(self, end, start=None):
        pass


def _engine(state: torch.Tensor | None = None):
    """A stand-in engine whose saves write DeepSpeed-like files, with ZeRO-3's fp32 partition `state`."""
    module = torch.nn.Linear(1, 1, bias=False)
    opt = types.SimpleNamespace(fp32_partitioned_groups_flat=[torch.zeros(8) if state is None else state],
                                optimizer=types.SimpleNamespace(param_groups=[], state={}))
    return types.SimpleNamespace(get_lr=lambda: [1e-3], module=module, optimizer=opt,
                                 save_checkpoint=FakeEngine().save_checkpoint)


def train(tmp_path, monkeypatch, losses, overflow=(), steps=12, save_steps=2, keep=2, engine=None, signal_at=None,
          stages_n=1, stage_kw=None):
    """training/stage.train_stage over `steps` steps whose losses are `losses` (step i: losses[i-1]), DeepSpeed's
    skipped update at the steps in `overflow`; every rank is sent `signal_at` = (step, signal) during that step.
    Returns (checkpointer, state, flag, metrics, the checkpoints left)."""
    clock = Clock()
    monkeypatch.setattr(stage_mod, "time", clock)
    monkeypatch.setattr(preemption, "time", clock)
    monkeypatch.delenv("SLURM_JOB_END_TIME", raising=False)
    flag = PreemptionFlag(None, Deadline(0.0, now=clock.t), save_every_s=0)
    state = TrainState()

    def step(engine, micro, world, loss_fn=None):
        clock.t += 1.0
        at = state.step + 1
        if signal_at and at == signal_at[0]:
            flag._handler(signal_at[1], None)
        out = {"loss": losses[at - 1], "step_time": 1.0, "label_tokens": 1}
        return {**out, "overflow": True} if at in overflow else out

    eng = engine or _engine()
    stub_stage(monkeypatch, eng.module, train_step=step, build_engine=lambda *a, **k: eng)
    ck = Checkpointer(str(tmp_path), keep=keep)
    cfg = types.SimpleNamespace(seed=0, per_device_train_batch_size=1, gradient_accumulation_steps=1,
                                save_steps=save_steps, async_save=False, loss_weighting=None,
                                output_dir=str(tmp_path), learning_rate=1e-3)
    metrics = Metrics()
    run = stage_mod.Run(cfg, ParallelDims(world=1, sp=1, rank=0, local_rank=0), stub_data(heldout=lambda *a: None),
                        ck, metrics, flag, FakeConfig(), "sdpa", False)
    stages = [types.SimpleNamespace(index=i, name=f"s{i}", max_steps=steps, sp=1, cp=1, max_seq_length=64, rope=None,
                                    deepspeed_overrides=None, reset_optimizer=False, eval=None, memory_choice=None,
                                    steps_from="steps", **(stage_kw or {})) for i in range(stages_n)]
    try:
        stage_mod.train_stage(run, stages[0], stages, state)
    finally:
        left = rotation.tags(ck.root)
    return ck, state, flag, metrics, left


def test_five_non_finite_steps_in_a_row_stop_in_one_line_before_anything_is_saved(tmp_path, monkeypatch, capsys):
    """A NaN weight from step 5 on (the audit's poison_weight): the run trained on to step 12, saved NaN checkpoints
    at 6, 8, 10, 12 (rotating step_000004 away) and exited 0. Now steps 6 and 8 save nothing, step 9 stops in one line
    naming step 5 and step_000004 (the resume point, with a lower learning rate), exit 2 (bad input: not requeued)."""
    losses = [7.6, 7.3, 7.4, 6.8] + [NAN] * 8
    with pytest.raises(ValueError) as got:
        train(tmp_path, monkeypatch, losses, overflow=range(5, 13))
    line = str(got.value)
    before = os.path.join(str(tmp_path), "checkpoints", tag_for(4))
    assert line.startswith(f"steps 5-{4 + K}: {K} non-finite steps in a row"), line
    assert f"--resume {before} with a lower --learning_rate (now 0.001)" in line and "\n" not in line
    assert job._is_input_error(got.value)  # exit 2 everywhere, one line, no crash requeue (base/exits.py)
    assert rotation.tags(os.path.join(str(tmp_path), "checkpoints")) == [tag_for(2), tag_for(4)]
    out = capsys.readouterr().out
    assert out.count("non-finite step ") == K and "step 6: the save due saves nothing" in out


def test_one_non_finite_step_is_said_and_the_run_trains_and_saves_on(tmp_path, monkeypatch, capsys):
    """A bad batch (the audit's nan_loss at step 5): DeepSpeed skipped its update, the weights are as before, step 6
    trains. Said (it read "no supervised token" before), the save at 6 follows; total_tokens leaves the skipped update
    out; metrics.jsonl's loss is null with loss_nonfinite "nan" (strict JSON)."""
    losses = [7.6, 7.3, 7.4, 6.8, NAN, 6.9, 6.7, 6.6, 6.4, 5.7, 6.3, 6.1]
    ck, state, _, metrics, left = train(tmp_path, monkeypatch, losses, overflow={5})
    out = capsys.readouterr().out
    assert "step 5: loss nan, its update skipped for a non-finite gradient norm: non-finite step 1 in a row" in out
    assert "step 6: finite again after 1 non-finite step(s) from step 5" in out
    assert left == [tag_for(10), tag_for(12)] and state.step == 12 and state.bad_steps == 0
    assert state.tokens == 11 * 64  # step 5's update did not happen
    (rec,) = [r for r in metrics.records if r.get("step") == 5 and "lr" in r]
    assert rec["optimizer_skipped"] == "overflow"
    from training.metrics import strict

    line = json.dumps(strict(rec), allow_nan=False)  # before: a bare NaN
    assert '"loss": null' in line and '"loss_nonfinite": "nan"' in line


def test_a_bad_last_batch_still_saves_the_stages_end_when_the_state_is_finite(tmp_path, monkeypatch, capsys):
    """Steps 11-12 non-finite (a bad batch at the stage's end: DeepSpeed skipped both updates, the weights are step
    10's): the stage's end is saved all the same, its state checked finite by the save (a refusal otherwise, below),
    so that the next stage has its start; the save at 11 is not (the loop saves nothing while they last)."""
    losses = [7.0] * 10 + [NAN, NAN]
    ck, state, _, _, left = train(tmp_path, monkeypatch, losses, overflow={11, 12}, save_steps=1)
    assert left == [tag_for(10), tag_for(12)] and state.checkpoint.endswith(tag_for(12))
    assert open(os.path.join(ck.root, "STAGE_0_s0")).read().strip() == tag_for(12)
    assert "step 11: the save due saves nothing" in capsys.readouterr().out


def test_under_fp16_a_skipped_update_with_a_finite_loss_is_the_loss_scaler_not_a_bad_step():
    """fp16's dynamic loss scale halves on each overflow (several in a row at a start): not counted; a NaN loss is."""
    from training.step import bad_step

    assert bad_step({"loss": 6.5, "overflow": True}) and not bad_step({"loss": 6.5, "overflow": True}, fp16=True)
    assert bad_step({"loss": NAN}, fp16=True) and bad_step({"loss": math.inf}) and not bad_step({"loss": 6.5})


def test_a_preemption_during_non_finite_steps_saves_nothing_and_exits_75(tmp_path, monkeypatch, capsys):
    """SIGUSR1 at step 7 with steps 5-7 non-finite: the stop's save is skipped (a NaN checkpoint would be the newest
    and the requeue's resume point); the stop still returns as agreed (train.py: exit 75), step_000004 the resume
    point."""
    losses = [7.6, 7.3, 7.4, 6.8] + [NAN] * 8
    ck, state, flag, _, left = train(tmp_path, monkeypatch, losses, overflow=range(5, 13),
                                     signal_at=(7, signal.SIGUSR1))
    assert flag.stopping and state.step == 7 and state.checkpoint.endswith(tag_for(4))
    assert left == [tag_for(2), tag_for(4)]
    assert "step 7: the stop saves nothing: non-finite steps since step 5" in capsys.readouterr().out


def test_a_loss_spike_is_said_and_keeps_the_checkpoint_before_it(tmp_path, monkeypatch, capsys):
    """The audit's spike_lr: step 6's loss 74 against ~7 was never said, and step_000004 (the last before the LR
    spike's update at step 5) rotated away under save_total_limit 2. Now one line at step 6, step_000004 kept
    (PINNED) through the saves at 6-12; the divergence that follows is the same spike (one line)."""
    ck, state, _, metrics, left = train(tmp_path, monkeypatch, SPIKE)
    root = os.path.join(str(tmp_path), "checkpoints")
    assert left == [tag_for(4), tag_for(10), tag_for(12)]  # before: [10, 12]
    assert open(os.path.join(root, rotation.PINNED)).read().strip() == tag_for(4)
    out = capsys.readouterr().out
    assert out.count("x the median") == 1
    assert "step 6: loss 74.39 is 10.1x the median 7.35 of this stage's last 5 steps" in out
    assert f"{os.path.join(root, tag_for(4))} is kept against rotation" in out
    (ev,) = [r for r in metrics.records if r.get("event") == "loss_spike"]
    assert ev["step"] == 6 and ev["kept"] == os.path.join(root, tag_for(4))


def test_the_spike_keeps_a_checkpoint_two_steps_before_it():
    """A spike at step N is the loss of the weights step N-1's update made: step_N-1 may hold the divergence."""
    from training.step import LossWatch

    watch = LossWatch()
    assert [watch.spike(x) for x in SPIKE[:5]] == [None] * 5
    assert watch.spike(SPIKE[5]) == pytest.approx(7.35) and watch.spike(SPIKE[6]) is None  # the same spike
    assert watch.spike(7.0) is None and watch.spike(40.0) is not None  # back, then a new one


def test_a_save_refuses_a_non_finite_optimizer_state_naming_the_rank_and_host(tmp_path, capsys):
    """A NaN in a weight no batch reads (the audit's poison_embed: embed_tokens row 0): every loss finite, the NaN
    saved at 6, 8, 10, 12 and exported. Now the save is refused before a byte is written, naming the rank and host;
    LATEST stays step_000004."""
    ck = Checkpointer(str(tmp_path), keep=2)
    good = ck.save(_engine(), 4, {"step": 4}, {}, FakeConfig())
    bad = torch.zeros(1000)
    bad[3] = NAN
    with pytest.raises(ValueError) as got:
        ck.save(_engine(bad), 6, {"step": 6}, {}, FakeConfig())
    import socket

    assert f"checkpoint {tag_for(6)} not written" in str(got.value) and f"rank 0 on {socket.gethostname()}" in str(got.value)
    assert f"the newest checkpoint, {good}, stays the resume point" in str(got.value) and job._is_input_error(got.value)
    assert rotation.tags(ck.root) == [tag_for(4)] and ck.find_resume("auto") == good


def test_the_state_check_reads_zero3s_partition_and_adams_moments():
    """training/step.nonfinite_state: the fp32 partition, the inner optimizer's moments; a float32 sum of finite
    values that overflows is no fault."""
    from training.step import nonfinite_state

    eng = _engine(torch.full((4,), 3e38))  # sums to inf in float32, every value finite
    assert nonfinite_state(eng) == 0
    eng.optimizer.optimizer.state = {0: {"exp_avg": torch.tensor([1.0, math.inf]), "step": 3}}
    assert nonfinite_state(eng) == 1


def test_a_non_finite_held_out_loss_refuses_the_next_stage(monkeypatch):
    """The audit's two-stage run: stage 0's end evaluated heldout_loss nan and stage 1 started from it. Now one line
    naming the checkpoint before; eval/stage0.json is not written (the stage stays unevaluated: a re-run evaluates it
    again instead of going on), the record goes to metrics.jsonl."""
    import training.evaluation as ev
    from tests.unit.training.test_eval_counts import _heldout_at, _stage
    from tests.unit.training.test_heldout_chat import DIMS1, TokenEngine

    real = ev.sample_stats

    def poisoned(*a, **k):
        out = real(*a, **k)
        out[:, 0] = NAN
        return out

    monkeypatch.setattr(ev, "sample_stats", poisoned)
    logged, recorded = [], []
    metrics = types.SimpleNamespace(log=logged.append, log_eval=lambda *a: recorded.append(a),
                                    log_table=lambda *a, **k: None)
    stages = [_stage(0, 8, "text", 2), _stage(1, 16, "text", 2)]
    with pytest.raises(ValueError) as got:
        ev.evaluate_stage(TokenEngine(64), stages[0], DIMS1, _heldout_at(8, 2), None, metrics, 6, 1, 0, stages,
                          _heldout_at, before="/run/checkpoints/step_000004")
    line = str(got.value)
    assert line.startswith("stage 0 (s0) at step 6: held-out loss not finite (heldout_loss nan") and \
        "stage 1 (s1) is not started from them" in line and "--resume /run/checkpoints/step_000004" in line
    assert recorded == [] and logged[0]["event"] == "eval" and job._is_input_error(got.value)


def test_the_extension_demo_has_no_loss_spike_and_one_divergence_is_one(tmp_path):
    """The review: `make demo` (recipes/tiny_cpu_extend.yaml) said 33 spikes: its passkey steps (loss ~0.001 on the
    answer, ~80% of the steps) set the median and every text step (~3.2) was 3x it. The stage loop now judges a step
    among its kind (`full`: half its tokens supervised, by label_tokens) and by an excess of SPIKE_NATS too. The demo's
    mix (its shipped losses' values, bench/results/demo_extend) judged as one kind spikes; per kind, none; the LR x1000
    divergence is still one spike, said once."""
    import random

    from training.step import LossWatch

    rng = random.Random(0)
    steps = [("full", rng.uniform(3.1, 3.7)) if rng.random() < 0.2 else ("part", rng.uniform(0.0002, 0.09))
             for _ in range(180)]
    one, per = LossWatch(), LossWatch()
    assert sum(one.spike(loss) is not None for _, loss in steps) > 10  # as it was: the text steps "spike"
    assert [i for i, (kind, loss) in enumerate(steps) if per.spike(loss, kind) is not None] == []
    diverged = LossWatch()
    for loss in [6.9, 6.8, 6.7, 6.7, 6.6, 6.6]:
        assert diverged.spike(loss) is None
    assert diverged.spike(74.4) == 6.7 and diverged.spike(58.8) is None
    near_zero = LossWatch()  # 0.0037 against a median of 0.0005: 7x, yet no divergence
    for loss in [0.0005, 0.0004, 0.0006, 0.0005, 0.0005]:
        near_zero.spike(loss, "part")
    assert near_zero.spike(0.0037, "part") is None
