"""`loss_weighting` per curriculum stage (issue 42's leftover): a recipe's stage may set token or conversation weighting
(a pretraining stage by token, then an SFT stage by conversation), the run's --loss_weighting is the default of the
stages that set none, a bad value is refused in one line naming the stage before any work, and the stage loop
(training/stage.py, the real loop on test_stop_window's stand-ins) hands the stage's setting to `collate`, also when
a run resumes in the middle of the stage. No launch, no model: < 1 s."""

from __future__ import annotations

import types

import pytest
import torch
import yaml

from base.parallel import ParallelDims
from training.config import parse_config
from training.curriculum import check_stages, resolve_stages, stage_start

RECIPE = {"max_seq_length": 64, "max_steps": 3, "stages": [
    {"name": "pretrain", "max_seq_length": 64},
    {"name": "sft", "kind": "sft", "max_seq_length": 128, "loss_weighting": "conversation"}]}


def _config(tmp_path, recipe: dict, *flags: str):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return parse_config(["--config", str(path), *flags])


def _stages(cfg):
    stages = resolve_stages(cfg, dp_of_sp=lambda sp: 1, budget=lambda: ("cpu", 1 << 40))
    return check_stages(stages, world=1, num_heads=4, num_kv_heads=4)


@pytest.mark.parametrize("flag, want", [((), ["token", "conversation"]),
                                        (("--loss_weighting", "conversation"), ["conversation", "conversation"])])
def test_a_stage_sets_its_own_weighting_and_the_flag_is_the_default(tmp_path, flag, want):
    assert [s.loss_weighting for s in _stages(_config(tmp_path, RECIPE, *flag))] == want
    token_sft = {**RECIPE, "stages": [RECIPE["stages"][0], {**RECIPE["stages"][1], "loss_weighting": "token"}]}
    got = [s.loss_weighting for s in _stages(_config(tmp_path, token_sft, "--loss_weighting", "conversation"))]
    assert got == ["conversation", "token"]  # a stage's own setting wins over the flag


@pytest.mark.parametrize("value, flags, match", [
    ("turn", (), r"^stages\[1\] \(sft\) loss_weighting 'turn': use token or conversation$"),
    ("conversation", ("--reset_position_ids", "no"),
     r"^stages\[1\] \(sft\) loss_weighting conversation finds conversations where position ids restart"),
])
def test_a_bad_stage_weighting_is_one_line_naming_the_stage(tmp_path, value, flags, match):
    recipe = {**RECIPE, "stages": [RECIPE["stages"][0], {"name": "sft", "max_seq_length": 128, "loss_weighting": value}]}
    with pytest.raises(ValueError, match=match) as e:
        _config(tmp_path, recipe, *flags)  # parse_config: before the process group, the model or the data
    assert "\n" not in str(e.value)


def test_the_stage_loop_collates_with_the_stages_weighting_after_a_resume(tmp_path, monkeypatch):
    """The real train_stage, resumed one step into the SFT stage of the recipe above (run flag: token): every micro-batch
    is collated with conversation weighting; the pretraining stage's with token. Before: the run's flag everywhere."""
    from tests.unit.training.test_stop_window import Clock, SimCheckpointer, stub_data, stub_stage
    from training import preemption
    from training import stage as stage_mod
    from training.checkpoint import TrainState
    from training.preemption import Deadline, PreemptionFlag

    cfg = _config(tmp_path, RECIPE, "--gradient_accumulation_steps", "2")
    stages = _stages(cfg)
    clock, weightings = Clock(), []
    monkeypatch.setattr(stage_mod, "time", clock)
    monkeypatch.setattr(preemption, "time", clock)
    monkeypatch.delenv("SLURM_JOB_END_TIME", raising=False)
    stub_stage(monkeypatch, torch.nn.Linear(1, 1, bias=False),
               collate=lambda samples, multiple, pad, weighting: weightings.append(weighting))
    run = stage_mod.Run(cfg, ParallelDims(world=1, sp=1, rank=0, local_rank=0), stub_data(heldout=lambda *a, **k: []),
                        SimCheckpointer(clock), types.SimpleNamespace(log=lambda r: None, run_id=None, home=None, begin_stage=lambda end, start=None: None),
                        PreemptionFlag(None, Deadline(0.0, now=clock.t), save_every_s=0), types.SimpleNamespace(),
                        "sdpa", False)
    for st in stages:
        state = TrainState()
        state.step = stage_start(stages, st.index) + (1 if st.kind == "sft" else 0)  # the SFT stage: resumed at step 1
        weightings.clear()
        stage_mod.train_stage(run, st, stages, state)
        assert weightings == [st.loss_weighting] * (2 * (st.max_steps - (1 if st.kind == "sft" else 0))), st.name
    assert [s.loss_weighting for s in stages] == ["token", "conversation"]
