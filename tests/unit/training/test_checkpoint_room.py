"""A save the output folder's file system cannot hold is refused in one line before any byte is written (the GPU
check's ladder of 2026-11-28 died in torch.save with 'unexpected pos' when its 64 GiB disk filled with kept stage-end
checkpoints). One process, a stub engine: the decision is the checkpointer's, not DeepSpeed's."""

from __future__ import annotations

import json
import os
import shutil
from collections import namedtuple

import pytest
import torch

from training import checkpoint as ck

Usage = namedtuple("Usage", "total used free")


class Engine:
    def __init__(self, n: int):
        self.module = torch.nn.Linear(n, 1, bias=False)  # n parameters
        self.saved = 0

    def save_checkpoint(self, root, tag, save_latest):
        self.saved += 1
        raise RuntimeError("stop here: the save was started")


def free(monkeypatch, nbytes: int) -> None:
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10**15, 0, nbytes))


def test_a_save_the_disk_cannot_hold_is_refused_before_writing(tmp_path, monkeypatch):
    c = ck.Checkpointer(str(tmp_path), keep=2)
    engine = Engine(1000)  # first checkpoint: 1000 x 14 B = 14 kB
    free(monkeypatch, 10_000)
    with pytest.raises(ValueError, match=r"^checkpoint step_000005 needs ~0\.0 GB in .*, 0\.0 GB free there: free space"):
        c.save(engine, 5, {}, {}, None)
    assert engine.saved == 0 and not os.path.exists(tmp_path / "checkpoints" / "step_000005")
    free(monkeypatch, 20_000)  # room for 14 kB + 5%: the save starts
    with pytest.raises(RuntimeError, match="stop here"):
        c.save(engine, 5, {}, {}, None)
    assert engine.saved == 1


def test_later_saves_need_what_the_newest_checkpoint_took(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    (root / "step_000003").mkdir(parents=True)
    (root / "step_000003" / ck.MANIFEST).write_text(json.dumps({"files": {"a": {"size": 60_000}, "b": {"size": 40_000}}}))
    (root / ck.POINTER).write_text("step_000003\n")
    c = ck.Checkpointer(str(tmp_path), keep=2)
    engine = Engine(10)  # its estimate (140 B) would fit: the measured 100 kB does not
    free(monkeypatch, 100_000)
    with pytest.raises(ValueError, match="needs ~0.0 GB"):
        c.save(engine, 6, {}, {}, None)
    assert c._newest_size() == 100_000 and engine.saved == 0
    free(monkeypatch, 106_000)
    with pytest.raises(RuntimeError, match="stop here"):
        c.save(engine, 6, {}, {}, None)


def test_the_trash_a_killed_job_left_counts_as_room(tmp_path, monkeypatch):
    """A job killed while its background deletion ran leaves a rotated checkpoint in checkpoints/.trash/, which only a
    commit emptied: the next job's first save was refused for the room it held (exit 2, never requeued). The trash's
    bytes count as free, and its deletion starts at once."""
    trash = tmp_path / "checkpoints" / ".trash" / "step_000001.123"
    trash.mkdir(parents=True)
    (trash / "optim.pt").write_bytes(b"x" * 30_000)
    c = ck.Checkpointer(str(tmp_path), keep=2)
    engine = Engine(1000)  # 14 kB needed, 10 kB free, 30 kB in the trash
    free(monkeypatch, 10_000)
    with pytest.raises(RuntimeError, match="stop here"):
        c.save(engine, 5, {}, {}, None)
    c.trash.wait()
    assert engine.saved == 1 and not trash.exists()
