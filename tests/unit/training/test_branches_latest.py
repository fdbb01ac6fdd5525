"""DeepSpeed's own `latest` pointer follows LATEST through a branch (training/branches.py start): a `--resume PATH`
from one of this run's checkpoints points both at it, a branch from nothing or from another run's checkpoint removes
both. Left behind, `latest` named a checkpoint moved to abandoned/: a user's engine.load_checkpoint(checkpoints) and
zero_to_fp32 without a tag went to a folder no longer there. One process, no engine (test_resume_branch.py's fake
engine writes the files)."""

from __future__ import annotations

import os

from tests.unit.training.test_resume_branch import save
from training.checkpoint import POINTER, Checkpointer, tag_for


def pointers(tmp_path) -> tuple[str | None, str | None]:
    got = []
    for name in (POINTER, "latest"):
        f = tmp_path / "checkpoints" / name
        got.append(f.read_text().strip() if f.exists() else None)
    return got[0], got[1]


def test_a_branch_from_this_runs_checkpoint_points_latest_at_it(tmp_path):
    ck = Checkpointer(str(tmp_path), keep=3)
    for s in (2, 4, 6):
        save(ck, s)
    assert pointers(tmp_path) == (tag_for(6), tag_for(6))
    point = str(tmp_path / "checkpoints" / tag_for(4))
    assert ck.find_resume(point) == point
    assert os.path.isdir(tmp_path / "checkpoints" / "abandoned" / tag_for(6))
    assert pointers(tmp_path) == (tag_for(4), tag_for(4))
    save(ck, 5)
    assert pointers(tmp_path) == (tag_for(5), tag_for(5))


def test_a_branch_from_nothing_or_elsewhere_removes_both(tmp_path):
    other = Checkpointer(str(tmp_path / "other"), keep=2)
    src = save(other, 3)
    for i, resume in enumerate(("none", src)):
        run = tmp_path / f"run{i}"
        ck = Checkpointer(str(run), keep=2)
        save(ck, 2)
        assert pointers(run) == (tag_for(2), tag_for(2))
        ck.find_resume(resume)
        assert pointers(run) == (None, None)


def test_a_branch_lets_go_of_a_pin_it_moves_aside(tmp_path):
    """The review: checkpoints/PINNED (a loss spike's kept checkpoint) stayed after a `--resume PATH` before it: the
    pinned step_N went to abandoned/, and the branch's own step_N of that name was kept against rotation in its place.
    A pin on the branch (at or before PATH) stays."""
    ck = Checkpointer(str(tmp_path), keep=3)
    for s in (2, 4, 6):
        save(ck, s)
    pinned = tmp_path / "checkpoints" / "PINNED"
    pinned.write_text(tag_for(6) + "\n")
    ck.find_resume(str(tmp_path / "checkpoints" / tag_for(4)))
    assert not pinned.exists() and (tmp_path / "checkpoints" / "abandoned" / "PINNED").read_text() == tag_for(6) + "\n"
    ck2 = Checkpointer(str(tmp_path / "b"), keep=3)
    for s in (2, 4, 6):
        save(ck2, s)
    kept = tmp_path / "b" / "checkpoints" / "PINNED"
    kept.write_text(tag_for(2) + "\n")
    ck2.find_resume(str(tmp_path / "b" / "checkpoints" / tag_for(4)))
    assert kept.read_text() == tag_for(2) + "\n"
