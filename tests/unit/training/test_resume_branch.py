"""`--resume PATH` / `none` start a branch once (training/checkpoint.py: find_resume, BRANCHES.json): the same
command started again (a SLURM requeue, a re-run after a crash) continues from the run's own newest complete
checkpoint, also after the branch point was rotated away; a stale COMPLETE leaves with the line it described; a
branch is known by its source's content, not its name. One process, no engine (tests/unit/training/test_checkpoint.py's
fake engine writes the files)."""

from __future__ import annotations

import json
import os
import shutil

from training.checkpoint import BRANCHES, POINTER, Checkpointer, tag_for


class FakeConfig:
    def to_json_string(self):
        return json.dumps({"model_type": "llama"})


class FakeEngine:
    def save_checkpoint(self, root, tag, save_latest):
        with open(os.path.join(root, tag, "zero_pp_rank_0_mp_rank_00_model_states.pt"), "wb") as fh:
            fh.write(os.urandom(256))


def save(ck, step, stage_end=None):
    return ck.save(FakeEngine(), step, {"step": step}, {"sampler": {}}, FakeConfig(), stage_end=stage_end)


def test_a_requeued_branch_continues_after_its_branch_point_rotated_away(tmp_path):
    ck = Checkpointer(str(tmp_path), keep=2)
    for s in (2, 4):
        save(ck, s)
    save(ck, 6, stage_end="STAGE_0_main")
    (tmp_path / "COMPLETE").write_text("6\n")  # the original line finished
    (tmp_path / "eval").mkdir()
    for name in ("stage0.json", "summary.md"):  # its evaluation of stage 0 (the branch's stage 0 is not evaluated yet)
        (tmp_path / "eval" / name).write_text("{}")
    point = str(tmp_path / "checkpoints" / tag_for(4))
    assert ck.find_resume(point) == point  # first start: the branch
    aside = tmp_path / "checkpoints" / "abandoned"
    assert sorted(os.listdir(aside)) == ["COMPLETE", "STAGE_0_main", "eval", tag_for(6)]
    # left in eval/, a kill between the branch's stage end and its evaluation took the old line's numbers as the
    # branch's (its stage was skipped as evaluated)
    assert os.listdir(tmp_path / "eval") == [] and sorted(os.listdir(aside / "eval")) == ["stage0.json", "summary.md"]
    assert not (tmp_path / "COMPLETE").exists()  # a preempted branch is requeued, not taken for finished
    assert (tmp_path / "checkpoints" / POINTER).read_text().strip() == tag_for(4)
    assert ck.find_resume(point) == point  # requeued before its first save: the branch point is its newest
    assert sorted(os.listdir(aside)) == ["COMPLETE", "STAGE_0_main", "eval", tag_for(6)]  # nothing moved twice
    save(ck, 6)
    save(ck, 8)  # rotation (keep 2) removes the branch point
    assert not os.path.exists(point)
    # the requeue (same --resume): the branch's own newest, not "not a complete checkpoint" (exit 2)
    assert ck.find_resume(point) == str(tmp_path / "checkpoints" / tag_for(8))
    assert ck.find_resume("auto") == str(tmp_path / "checkpoints" / tag_for(8))
    record = json.loads((tmp_path / "checkpoints" / BRANCHES).read_text())["branches"]
    assert len(record) == 1 and record[0]["source"] == os.path.realpath(point) and record[0]["moved"] == [tag_for(6)]


def test_resume_none_starts_over_once(tmp_path):
    ck = Checkpointer(str(tmp_path), keep=3)
    for s in (1, 2, 3):
        save(ck, s)
    assert ck.find_resume("none") is None
    assert ck.tags() == [] and not (tmp_path / "checkpoints" / POINTER).exists()
    save(ck, 1)
    # re-run with --resume none after a crash: continues (it restarted at step 0 on every requeue), and never
    # from the old line's step 3 (left in checkpoints/ it was newer than the new line's saves)
    assert ck.find_resume("none") == str(tmp_path / "checkpoints" / tag_for(1))
    assert ck.find_resume("auto") == str(tmp_path / "checkpoints" / tag_for(1))


def test_a_branch_from_another_run(tmp_path):
    other = Checkpointer(str(tmp_path / "a"), keep=2)
    source = save(other, 3)
    ck = Checkpointer(str(tmp_path / "b"), keep=2)
    save(ck, 5)  # this folder's own older line: not on the branch
    assert ck.find_resume(source) == source
    assert ck.tags() == [] and os.listdir(tmp_path / "b" / "checkpoints" / "abandoned") == [tag_for(5)]
    assert ck.find_resume(source) == source  # no save of its own yet: from the source again
    save(ck, 4)
    assert ck.find_resume(source) == str(tmp_path / "b" / "checkpoints" / tag_for(4))


def test_a_new_checkpoint_under_a_branched_name_is_a_new_branch_point(tmp_path):
    """Content, not name: branch from step 4, then from step 2, whose line writes a new step 4; --resume step_4
    now means that new checkpoint: a branch (step 6 moved aside), not "continue"."""
    ck = Checkpointer(str(tmp_path), keep=5)
    for s in (2, 4):
        save(ck, s)
    four, two = (str(tmp_path / "checkpoints" / tag_for(s)) for s in (4, 2))
    assert ck.find_resume(four) == four
    assert ck.find_resume(two) == two  # moves the first branch's step 4 aside
    for s in (4, 6):
        save(ck, s)
    assert ck.find_resume(four) == four
    assert ck.tags() == [tag_for(2), tag_for(4)]
    assert ck.find_resume(four) == four and ck.tags() == [tag_for(2), tag_for(4)]  # and taken once


def test_a_moved_run_folder_continues_its_branch(tmp_path):
    """BRANCHES.json records the source's real path: after the run folder was moved (a re-mount, an rsync to other
    storage) the same `--resume .../step_2` took the branch again and moved the branch's own newer checkpoints to
    abandoned/ (retrained). The branch is known by its source's content now, and by its name in checkpoints/ once the
    branch's own saves rotated it away."""
    ck = Checkpointer(str(tmp_path / "a"), keep=3)
    for s in (2, 4):
        save(ck, s)
    assert ck.find_resume(str(tmp_path / "a" / "checkpoints" / tag_for(2))) == str(tmp_path / "a" / "checkpoints" /
                                                                                  tag_for(2))
    for s in (3, 4):  # the branch's own saves
        save(ck, s)
    shutil.move(str(tmp_path / "a"), str(tmp_path / "b"))
    moved = Checkpointer(str(tmp_path / "b"), keep=3)
    point = str(tmp_path / "b" / "checkpoints" / tag_for(2))
    assert moved.find_resume(point) == str(tmp_path / "b" / "checkpoints" / tag_for(4))  # the requeue: continues
    assert moved.tags() == [tag_for(s) for s in (2, 3, 4)]
    save(moved, 5)  # rotates the branch point away
    assert not os.path.exists(point)
    assert moved.find_resume(point) == str(tmp_path / "b" / "checkpoints" / tag_for(5))
    assert moved.tags() == [tag_for(s) for s in (3, 4, 5)]
    assert len(json.loads((tmp_path / "b" / "checkpoints" / BRANCHES).read_text())["branches"]) == 1
