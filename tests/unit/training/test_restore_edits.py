"""A resume after the user edited the recipe (training/restore.py, training/curriculum.check_resumed_stages): the
checkpoint's stage is found by position and checked by name, a removed stage refused in one line; the LR schedule's
settings changed are named in the resume's note; `--resume checkpoints/STAGE_<i>_<name>` resumes the checkpoint the
marker names. No process group (Checkpointer's rank-0 paths run in-process)."""

from __future__ import annotations

import os
import types

import pytest

from tests.unit.training.test_checkpoint import FakeConfig, FakeEngine
from training.checkpoint import Checkpointer
from training.curriculum_resume import check_resumed_stages
from training.restore import recorded_stage_names

RECIPE = [{"name": "A128", "max_steps": 4}, {"name": "B256", "max_steps": 6}, {"name": "C256", "max_steps": 4}]


def _stages(*names):
    return [types.SimpleNamespace(index=i, name=n) for i, n in enumerate(names)]


def _saved_in_b(tmp_path, **meta):
    """The audit's run: preempted 3 steps into B (step 7 of A4 + B6 + C4), as a checkpoint of today's trainer.json."""
    ck = Checkpointer(str(tmp_path), keep=3)
    trainer = {"step": 7, "tokens": 0, "stage": 1, "model_hash": "h", "stage_name": "B256", "stage_steps": [4, 6],
               "stage_sizes": ["steps", "steps"], "config": {"stages": RECIPE}, **meta}
    ck.save(FakeEngine(), 7, trainer, {"sampler": {}}, FakeConfig())
    return ck.resume("auto", "h", "m")


@pytest.mark.parametrize("meta", [{}, {"stage_names": ["A128", "B256"]}])  # today's checkpoints; with stage_names
def test_a_stage_removed_at_or_before_the_checkpoints_is_refused_in_one_line(tmp_path, meta):
    """Dropping A resumed B's mid-stage engine, LR and data position into C (B's last 3 and C's first 3 steps never
    trained); keeping only A trained nothing and exported B's unfinished step 7 as the run's model, COMPLETE, exit 0.
    Both are refused now, naming the checkpoint's stage, the fix and the marker of its last finished stage."""
    state = _saved_in_b(tmp_path, **meta)
    assert state.stage_names == ["A128", "B256"]
    marker = os.path.join(str(tmp_path), "checkpoints", "STAGE_0_A128")
    for today, what in [(("B256", "C256"), "today's stage 0 is B256, the checkpoint's was A128"),
                        (("A128",), "today's recipe has 1 stage(s) ['A128']"),
                        (("A128", "C256"), "today's stage 1 is C256, the checkpoint's was B256")]:
        with pytest.raises(ValueError) as e:
            check_resumed_stages(_stages(*today), state)
        line = str(e.value)
        assert "\n" not in line and what in line, line
        assert "is at step 7, stage 1 (B256), 3 of its 6 steps" in line and "['A128', 'B256'] back at the start" in line
        assert line.endswith(f"export the model as stage 0 (A128) ended: python scripts/export_hf.py {marker}"), line
    # the edits that keep the checkpoint's stages pass: a later stage changed or appended, the current one's steps
    check_resumed_stages(_stages("A128", "B256", "C256"), state)
    check_resumed_stages(_stages("A128", "B256", "C512", "D1k"), state)
    check_resumed_stages(_stages("A128", "B256"), state)
    check_resumed_stages(_stages("B256"), types.SimpleNamespace(checkpoint=None, stage=0))  # a fresh start


def test_a_plain_run_extended_by_a_named_recipe_resumes(capsys):
    """A finished run without stages (its one stage is `main`) extended by a recipe naming its stages, or a recipe
    that ran unnamed (stage<i>) named now: the same stages at the same positions, resumed with a note (the review:
    refused, "put ['main'] back", a name the user never wrote). A default name found at another position, or a
    named stage replaced, still refused."""
    plain = types.SimpleNamespace(checkpoint="/o/checkpoints/step_5", stage=0, step=5, stage_names=["main"],
                                  stage_steps=[5])
    check_resumed_stages(_stages("s32k", "s128k"), plain)
    unnamed = types.SimpleNamespace(checkpoint="/o/checkpoints/step_9", stage=1, step=9,
                                    stage_names=["stage0", "stage1"], stage_steps=[4, 6])
    check_resumed_stages(_stages("s8k", "s16k", "s32k"), unnamed)
    assert "stage(s) main -> s32k renamed" in capsys.readouterr().out
    for today in (("s8k", "stage0", "s32k"), ("s8k",)):
        with pytest.raises(ValueError):
            check_resumed_stages(_stages(*today), unnamed)
    named = types.SimpleNamespace(checkpoint="/o/checkpoints/step_9", stage=1, step=9, stage_names=["a", "b"],
                                  stage_steps=[4, 6])
    with pytest.raises(ValueError, match="today's stage 1 is b2, the checkpoint's was b"):
        check_resumed_stages(_stages("a", "b2"), named)


def test_the_names_a_checkpoint_recorded(tmp_path):
    """stage_names when written (training/stage.py), else the config's stages (a name, or stage<i>; `main` for a run
    without stages) up to the checkpoint's, its stage_name last; unknown (None, not compared) where neither says."""
    assert recorded_stage_names({"stage": 1, "stage_names": ["x", "y"], "config": {"stages": RECIPE}}) == ["x", "y"]
    assert recorded_stage_names({"stage": 1, "stage_name": "stage1", "config": {"stages": [{}, {"name": None}]}}) == \
        ["stage0", "stage1"]
    assert recorded_stage_names({"stage": 0, "stage_name": "main", "config": {"stages": []}}) == ["main"]
    assert recorded_stage_names({"stage": 2, "stage_name": "c"}) == [None, None, "c"]
    old = types.SimpleNamespace(checkpoint="/r/checkpoints/step_000009", stage=2, step=9, stage_steps=None,
                                stage_names=[None, None, "c"])
    check_resumed_stages(_stages("p", "q", "c"), old)  # only what it recorded is compared
    with pytest.raises(ValueError, match=r"stage 2 \(c\), and today's stage 2 is d, the checkpoint's was c: put"):
        check_resumed_stages(_stages("p", "q", "d"), old)


def test_a_finished_run_whose_last_stage_was_removed_names_that_stages_marker(tmp_path):
    """All three stages ran (step 14); C dropped from the recipe: refused, pointing at C's own end marker."""
    state = types.SimpleNamespace(checkpoint="/r/checkpoints/step_000014", stage=2, step=14, stage_steps=[4, 6, 4],
                                  stage_names=["A128", "B256", "C256"])
    with pytest.raises(ValueError, match=r"4 of its 4 steps, and today's recipe has 2 stage\(s\).*export_hf.py "
                                         r"/r/checkpoints/STAGE_2_C256$"):
        check_resumed_stages(_stages("A128", "B256"), state)


def test_a_resume_names_a_changed_lr_schedule(tmp_path, capsys):
    """--lr_scheduler, --warmup_steps, --warmup_ratio and --min_lr changed on resume applied without a word; they are
    named in the resume's note now, as the learning rate is."""
    ck = Checkpointer(str(tmp_path), keep=2)
    old = {"learning_rate": 1e-5, "lr_scheduler": "cosine", "warmup_steps": 10, "warmup_ratio": 0.0, "min_lr": 0.0}
    ck.save(FakeEngine(), 5, {"step": 5, "tokens": 0, "stage": 0, "model_hash": "h", "config": old}, {"sampler": {}},
            FakeConfig())
    ck.resume("auto", "h", "m", {**old, "lr_scheduler": "linear", "warmup_steps": 0, "warmup_ratio": 0.1,
                                 "min_lr": 1e-6})
    assert "whose lr_scheduler, warmup_steps, warmup_ratio, min_lr differed" in capsys.readouterr().out


def test_resume_from_a_stage_marker_takes_the_checkpoint_it_names(tmp_path, monkeypatch):
    """`--resume checkpoints/STAGE_0_main` (a stage's marker, as scripts/export_hf.py takes it) was refused as "no
    readable manifest": the marker is a file naming its checkpoint. Relative to the working folder or --output_dir."""
    ck = Checkpointer(str(tmp_path / "run"), keep=3)
    for step in (4, 8):
        ck.save(FakeEngine(), step, {"step": step, "tokens": 0, "stage": 0, "model_hash": "h"}, {"sampler": {}},
                FakeConfig(), stage_end="STAGE_0_main" if step == 4 else None)
    monkeypatch.chdir(tmp_path)
    state = ck.resume("checkpoints/STAGE_0_main", "h", "m")
    assert state.step == 4 and state.checkpoint == os.path.join(str(tmp_path / "run"), "checkpoints", "step_000004")
    again = Checkpointer(str(tmp_path / "run"), keep=3)  # the same command started again: the branch continues
    assert again.find_resume(os.path.join("run", "checkpoints", "STAGE_0_main")) == state.checkpoint


def test_a_finished_stage_lowered_keeps_its_steps_and_says_why(tmp_path, capsys):
    """A finished stage's max_steps edited keeps what it ran; the note said "its steps over another world, batch or
    accumulation" (the wording of a max_tokens / epochs stage), now what it is."""
    from training.config import parse_config
    from training.curriculum import resolve_stages
    from training.curriculum_resume import keep_stage_steps

    recipe = tmp_path / "r.yaml"
    recipe.write_text("stages:\n  - {name: a, max_seq_length: 256, max_steps: 3}\n"
                      "  - {name: b, max_seq_length: 512, max_steps: 9}\n")
    today = resolve_stages(parse_config(["--config", str(recipe)]), dp_of_sp=lambda sp: 1)
    kept = keep_stage_steps(today, types.SimpleNamespace(stage=1, step=6, stage_steps=[4, 9], stage_sizes=None))
    assert [s.max_steps for s in kept] == [4, 9]
    assert "stage 0 (a) keeps the 4 steps it ran with (today's settings give 3: a finished stage keeps what it ran)" \
        in capsys.readouterr().out


def test_the_stage_check_comes_before_a_universal_conversion(tmp_path, monkeypatch):
    """A resume on another world size with an edited recipe was converted first (up to ~45 min at 8B), then refused."""
    _saved_in_b(tmp_path)
    converted = []
    monkeypatch.setattr(Checkpointer, "_universal", lambda self, path: converted.append(path))
    with pytest.raises(ValueError, match="today's stage 0 is B256"):
        Checkpointer(str(tmp_path), keep=3).resume("auto", "h", "m", check=lambda st: check_resumed_stages(
            _stages("B256", "C256"), st))
    assert converted == []


def test_a_resume_across_a_packing_change_says_so():
    """An SFT stage's samples packed another way (the permuted packing of 2026-11-30): the same count, so nothing was
    said, while the sampler's saved indices named other conversations (the third review: 574 of ~1,500 the same)."""
    import numpy as np

    from data.packing import ConvPack
    from data.sampler import ResumableSampler
    from training.restore import data_moved

    lens = np.random.default_rng(0).integers(100, 4000, 400)
    pack = ConvPack(None, None, np.concatenate([[0], np.cumsum(lens)[:-1]]), lens, 16 << 10, pad_id=0)
    now = ResumableSampler(len(pack), 1, 0, 1, seed=0)
    now.packing = pack.state_dict()["packing"]
    before = {k: v for k, v in now.state_dict().items() if k != "packing"}  # a checkpoint of the code before
    assert data_moved(before, now.state_dict()) == [
        "packing best-fit-decreasing in stream order -> best-fit-decreasing, permuted (the same indices name other "
        "samples)"]
    assert data_moved(now.state_dict(), now.state_dict()) == []
    assert data_moved({"num_samples": 5}, {"num_samples": 5}) == []  # text stages carry no packing
