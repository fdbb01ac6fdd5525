"""A kill inside a commit, after the manifest and before the pointers (training/checkpoint.py _commit), leaves LATEST
and DeepSpeed's `latest` naming the checkpoint before. The resume takes the newest complete checkpoint by listing
(training/restore.py find_resume) and now points both at it before training on; scripts/evaluate.py RUN loads what
that resume takes, and scripts/export_hf.py RUN exports it as the run's hf_model. Before: the resumed run finished
without another commit and kept the stale pointers for good: evaluate.py RUN scored the older checkpoint, export_hf.py
RUN wrote hf_model_step_N, zero_to_fp32 without a tag converted the older one. A branch's choice is left as it is.
One process, no engine (the fake engine writes the files)."""

from __future__ import annotations

import importlib.util
import os

import pytest

from tests.conftest import ROOT
from tests.unit.training.test_resume_branch import FakeConfig, FakeEngine
from training.checkpoint import POINTER, Checkpointer, tag_for
from training.checkpoint_files import point


def save(ck, step: int) -> str:
    return ck.save(FakeEngine(), step, {"step": step, "tokens": 0, "stage": 0, "model_hash": "h"}, {"sampler": {}},
                   FakeConfig())


def pointers(run) -> tuple[str | None, str | None]:
    got = [(run / "checkpoints" / n) for n in (POINTER, "latest")]
    return tuple(f.read_text().strip() if f.exists() else None for f in got)


def killed_in_commit(run, steps=(2, 4)) -> Checkpointer:
    """Checkpoints `steps` committed; the last one's pointers never written (killed after its manifest)."""
    ck = Checkpointer(str(run), keep=3, settle_s=0)
    for s in steps:
        save(ck, s)
    point(str(run / "checkpoints"), tag_for(steps[-2]))
    return ck


def test_the_resume_points_latest_at_the_newer_checkpoint_it_takes(tmp_path, capsys):
    ck = killed_in_commit(tmp_path)
    assert pointers(tmp_path) == (tag_for(2), tag_for(2))
    state = ck.resume("auto", "h", "m")
    assert state.checkpoint == str(tmp_path / "checkpoints" / tag_for(4))
    assert pointers(tmp_path) == (tag_for(4), tag_for(4))
    assert "LATEST and `latest` name it now" in capsys.readouterr().out
    ck.resume("auto", "h", "m")  # in step: nothing written, nothing said
    assert "name it now" not in capsys.readouterr().out
    # a first commit killed the same way: no pointer at all
    run = tmp_path / "first"
    ck = Checkpointer(str(run), keep=3, settle_s=0)
    save(ck, 2)
    point(str(run / "checkpoints"), None)
    assert ck.resume("auto", "h", "m").checkpoint.endswith(tag_for(2)) and pointers(run) == (tag_for(2), tag_for(2))


def test_an_older_choice_and_a_branch_keep_their_pointers(tmp_path):
    """A newer checkpoint that fails verification is skipped (the resume takes the one before) and LATEST is left on
    it (its saves replace it); a branch from step 4 with step 6 newer: the branch's point, not the newest."""
    ck = Checkpointer(str(tmp_path / "a"), keep=3, settle_s=0)
    save(ck, 2)
    newest = save(ck, 4)
    os.truncate(os.path.join(newest, "zero_pp_rank_0_mp_rank_00_model_states.pt"), 10)
    assert ck.resume("auto", "h", "m").checkpoint.endswith(tag_for(2))
    assert pointers(tmp_path / "a") == (tag_for(4), tag_for(4))
    run = tmp_path / "b"
    ck = Checkpointer(str(run), keep=4, settle_s=0)
    for s in (2, 4, 6):
        save(ck, s)
    branch = str(run / "checkpoints" / tag_for(4))
    assert ck.resume(branch, "h", "m").checkpoint == branch
    assert pointers(run) == (tag_for(4), tag_for(4)) and os.path.isdir(run / "checkpoints" / "abandoned" / tag_for(6))
    save(ck, 5)
    save(ck, 6)  # on the branch, killed inside this commit:
    point(str(run / "checkpoints"), tag_for(5))
    assert ck.resume(branch, "h", "m").checkpoint.endswith(tag_for(6))  # the requeue continues the branch
    assert pointers(run) == (tag_for(6), tag_for(6))


def test_evaluate_loads_what_the_resume_takes(tmp_path):
    """scripts/evaluate.py RUN (main: Checkpointer(RUN).evaluated(), then describe): the newest complete checkpoint,
    not LATEST as written; a checkpoint is itself, verified; an HF folder itself; a run folder with none: one line."""
    from scripts.evaluate import describe

    killed_in_commit(tmp_path)
    got = Checkpointer(str(tmp_path), keep=2, settle_s=0).evaluated()
    assert got == str(tmp_path / "checkpoints" / tag_for(4))
    assert describe(got, None)["path"] == got and describe(got, None)["step"] == 4
    older = str(tmp_path / "checkpoints" / tag_for(2))
    assert Checkpointer(older, keep=2, settle_s=0).evaluated() == older
    os.truncate(os.path.join(older, "state", "rank00000.pt"), 3)
    with pytest.raises(ValueError, match=f"^{older}: not a complete checkpoint .*: name another one$"):
        Checkpointer(older, keep=2, settle_s=0).evaluated()
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert Checkpointer(str(hf), keep=2, settle_s=0).evaluated() == str(hf)
    empty = tmp_path / "empty"
    (empty / "checkpoints").mkdir(parents=True)
    (empty / "checkpoints" / POINTER).write_text("step_000009\n")
    with pytest.raises(ValueError, match=f"^{empty}: no complete checkpoint in {empty}/checkpoints: name another one$"):
        Checkpointer(str(empty), keep=2, settle_s=0).evaluated()


def test_export_of_the_run_is_its_hf_model(tmp_path, monkeypatch):
    """scripts/export_hf.py RUN exports the newest complete checkpoint (find_resume's) as RUN/hf_model, whatever LATEST
    says; an older checkpoint named goes to hf_model_<tag> though LATEST names it (it replaced the run's hf_model)."""
    spec = importlib.util.spec_from_file_location("export_hf", os.path.join(ROOT, "scripts", "export_hf.py"))
    export = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(export)
    killed_in_commit(tmp_path)
    seen = []
    monkeypatch.setattr(export, "export_hf", lambda src, out, *a, **k: seen.append((src, out)) or out)
    assert export.main([str(tmp_path), "--tokenizer", "none", "--source", "none"]) == 0
    assert seen[-1] == (str(tmp_path / "checkpoints" / tag_for(4)), str(tmp_path / "hf_model"))
    older = str(tmp_path / "checkpoints" / tag_for(2))
    assert export.main([str(tmp_path), "--checkpoint", older, "--tokenizer", "none", "--source", "none"]) == 0
    assert seen[-1] == (older, str(tmp_path / f"hf_model_{tag_for(2)}"))
    assert export.main([str(tmp_path / "checkpoints" / tag_for(4)), "--tokenizer", "none", "--source", "none"]) == 0
    assert seen[-1][1] == str(tmp_path / "hf_model")


def test_the_evaluations_stop_check_keeps_only_the_margin_for_the_time_limit():
    """Inside a stage's evaluation nothing is left to save (its end is committed): the time limit stops it only within
    the margin. With the step loop's budget (a 296 s step and a 190 s save ahead) it was abandoned 400 s before the
    end, and each resume evaluated again."""
    from training.preemption import MARGIN_S, Deadline, StopChecked

    class Flag:
        def __init__(self, left):
            self.deadline = Deadline(time_limit_s=left)
            self.deadline.step_s, self.deadline.save_s = 296.0, 190.0

        def agreed(self, ahead_s=0.0):  # PreemptionFlag.agreed's time-limit vote, on one rank
            return self.deadline.near(ahead_s=ahead_s)

    forwards = []
    StopChecked(lambda **kw: forwards.append(kw), Flag(400.0))(x=1)
    assert forwards == [{"x": 1}]
    with pytest.raises(Exception) as e:
        StopChecked(lambda **kw: forwards.append(kw), Flag(MARGIN_S / 2))(x=2)
    assert type(e.value).__name__ == "EvalStopped" and len(forwards) == 1
