"""A stage finished before the resumed checkpoint's, its evaluation not on record (eval/stage{i}.json missing: a
run folder copied without eval/, a branch into a new folder from a later stage's checkpoint): training/stage.py
evaluates it from its own end, the checkpoint its marker checkpoints/STAGE_<i>_<name> names, at that step, or not at
all with one note. It used to load the resumed checkpoint (a later model) and record it as that stage's evaluation at
the resumed step (scripts/eval_summary.py then compared a later model as "before"). The real stage loop on
test_stop_window's stand-ins and the real Checkpointer (its load replaced: no engine), one process: < 1 s."""

from __future__ import annotations

import os
import types

import pytest
import torch

from base.parallel import ParallelDims
from tests.unit.training.test_checkpoint import FakeConfig, FakeEngine
from training.checkpoint import Checkpointer, TrainState, tag_for


def _stage(index: int, steps: int, length: int):
    return types.SimpleNamespace(index=index, name=f"s{index}", max_steps=steps, sp=1, cp=1, max_seq_length=length,
                                 rope=None, deepspeed_overrides=None, reset_optimizer=False, eval=None,
                                 memory_choice=None, steps_from="steps")


def _run(tmp_path, marker: str | None, world: int = 1):
    """A two-stage run (3 + 3 steps) saved to step 5, 2 steps into stage 1; stage 0's end (step 3) under `marker`,
    saved by `world` ranks."""
    ck = Checkpointer(str(tmp_path), keep=5)
    for s in range(1, 6):
        stage = 0 if s <= 3 else 1
        ck.save(FakeEngine(), s, {"step": s, "tokens": 0, "stage": stage, "world": world}, {"sampler": {}}, FakeConfig(),
                stage_end=marker if s == 3 and marker else None)
    state = TrainState(step=5, stage=1, checkpoint=os.path.join(str(tmp_path), "checkpoints", tag_for(5)),
                       optimizer_groups=2)
    return ck, state


def _train_stage0(monkeypatch, ck, state):
    """train_stage(stage 0) as train.py calls it for a finished stage without eval/stage0.json; returns (what was
    loaded, the steps recorded as evaluated, whether an engine was built)."""
    from tests.unit.training.test_stop_window import Clock, stub_data, stub_stage
    from training import preemption
    from training import stage as stage_mod
    from training.preemption import Deadline, PreemptionFlag

    clock, loaded, evaluated, built = Clock(), [], [], []
    monkeypatch.setattr(stage_mod, "time", clock)
    monkeypatch.setattr(preemption, "time", clock)
    monkeypatch.delenv("SLURM_JOB_END_TIME", raising=False)
    monkeypatch.setattr(ck, "load", lambda engine, path, **k: loaded.append(path) or {})
    module = torch.nn.Linear(1, 1, bias=False)
    stub_stage(monkeypatch, module, evaluate_stage=lambda engine, stage, dims, heldout, tok, m, step, *a: evaluated.append(
        step), build_engine=lambda *a, **k: built.append(1) or types.SimpleNamespace(get_lr=lambda: [1e-3], module=module))
    cfg = types.SimpleNamespace(seed=0, per_device_train_batch_size=1, gradient_accumulation_steps=1, save_steps=0,
                                async_save=False, loss_weighting=None, output_dir=os.path.dirname(ck.root))
    metrics = types.SimpleNamespace(log=lambda r: None, run_id=None, home=None, begin_stage=lambda end, start=None: None)
    run = stage_mod.Run(cfg, ParallelDims(world=1, sp=1, rank=0, local_rank=0), stub_data(heldout=lambda *a: None),
                        ck, metrics, PreemptionFlag(None, Deadline(0.0, now=clock.t), save_every_s=0),
                        types.SimpleNamespace(), "sdpa", False)
    stages = [_stage(0, 3, 64), _stage(1, 3, 128)]
    stage_mod.train_stage(run, stages[0], stages, state)
    assert state.step == 5 and state.checkpoint.endswith(tag_for(5))  # nothing trained, the resume point unchanged
    return loaded, evaluated, bool(built)


@pytest.mark.parametrize("marker", ["STAGE_0_s0", "STAGE_0_main"])  # the second: the stage renamed since
def test_an_unevaluated_finished_stage_is_evaluated_from_its_own_end(tmp_path, monkeypatch, marker):
    """The folder's checkpoints/ copied without eval/: stage 0 was evaluated from step 5 (stage 1's weights) and
    recorded as stage 0 at step 5, although STAGE_0 -> step_000003 was there."""
    ck, state = _run(tmp_path, marker)
    loaded, evaluated, built = _train_stage0(monkeypatch, ck, state)
    assert loaded == [os.path.join(str(tmp_path), "checkpoints", tag_for(3))] and evaluated == [3] and built


@pytest.mark.parametrize("why", ["no marker", "its checkpoint gone"])
def test_a_finished_stage_whose_end_is_not_in_the_folder_is_not_evaluated(tmp_path, monkeypatch, capsys, why):
    """A branch into a new folder from a mid-stage-1 checkpoint: stage 0's end is another folder's. Skipped with one
    note, no engine built; never the resumed checkpoint recorded as stage 0 at step 5."""
    ck, state = _run(tmp_path, None if why == "no marker" else "STAGE_0_s0")
    if why != "no marker":
        import shutil

        shutil.rmtree(os.path.join(ck.root, tag_for(3)))
    loaded, evaluated, built = _train_stage0(monkeypatch, ck, state)
    assert (loaded, evaluated, built) == ([], [], False)
    assert "note: stage 0's end is not in this folder: not evaluated" in capsys.readouterr().out


def test_a_finished_stage_saved_by_another_world_is_not_converted_to_be_evaluated(tmp_path, monkeypatch, capsys):
    """A review: its load would convert it to a universal checkpoint (~45 min and twice its disk at 8B) only to
    evaluate an old stage inside a training job: skipped with a note naming scripts/evaluate.py."""
    ck, state = _run(tmp_path, "STAGE_0_s0", world=4)
    assert _train_stage0(monkeypatch, ck, state) == ([], [], False)
    out = capsys.readouterr().out
    assert "was saved by 4 ranks, this job has 1: not evaluated here (scripts/evaluate.py" in out, out
