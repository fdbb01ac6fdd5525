"""An output folder partly written by another user (a requeue in a root container, then a run as this user; seen with
/tmp/containers' runR: uid 12345 resuming a folder root had written). DeepSpeed copies its recovery scripts over the
old ones at every save (deepspeed/runtime/engine.py _copy_recovery_script: shutil.copyfile, open(dst, 'wb')): a
PermissionError at the first save of every restart, a save interval lost each time. check_room (at start, before
step 1) now removes the ones this user cannot write, or refuses in one line. os.access is faked: root writes through
any mode. One process, a stub engine."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from training import checkpoint as ck


class Engine:
    """DeepSpeed's save as far as the recovery script: open(dst, 'wb') as this user, then stop."""

    def __init__(self):
        self.module = torch.nn.Linear(10, 1, bias=False)

    def save_checkpoint(self, root, tag, save_latest):
        dst = os.path.join(root, "zero_to_fp32.py")
        if os.path.exists(dst) and not os.access(dst, os.W_OK):  # another user's 0644 file: EACCES, as in runR
            raise PermissionError(13, "Permission denied", dst)
        with open(dst, "w"):
            pass
        raise RuntimeError("stop here: the save was written")


def foreign(monkeypatch, *paths) -> None:
    """`paths` are another user's, not writable by this one."""
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: str(p) not in map(str, paths) and real(p, mode))


def test_another_users_recovery_script_is_removed_before_step_1(tmp_path, monkeypatch, capsys):
    root = tmp_path / "checkpoints"
    root.mkdir()
    script = root / "zero_to_fp32.py"
    script.write_text("# root's copy\n")
    foreign(monkeypatch, script)
    c = ck.Checkpointer(str(tmp_path), keep=2, settle_s=0)
    c.check_room(None, 10, 1)
    assert not script.exists() and "note: removed" in capsys.readouterr().out
    with pytest.raises(RuntimeError, match="stop here"):  # the first save gets past DeepSpeed's copy
        c.save(Engine(), 5, {}, {}, None)
    assert script.exists()


def test_a_recovery_script_it_cannot_remove_or_a_folder_it_cannot_write_is_refused_in_one_line(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    root.mkdir()
    script = root / "zero_to_torch.py"
    script.write_text("")
    foreign(monkeypatch, script)

    def sticky(path, *a, **k):  # a sticky-bit folder (/tmp-like): only the file's owner removes it
        raise PermissionError(1, "Operation not permitted", path)

    with monkeypatch.context() as m:
        m.setattr(os, "remove", sticky)
        with pytest.raises(ValueError, match=r"zero_to_torch.py: another user's file .* \(Operation not permitted\), "
                                             r"which DeepSpeed rewrites at every save: remove it") as e:
            ck.Checkpointer(str(tmp_path), keep=2, settle_s=0).check_room(None, 10, 1)
        assert "\n" not in str(e.value)
    shutil.rmtree(root)
    (root / ".trash").mkdir(parents=True)
    foreign(monkeypatch, root / ".trash")  # rotation renames into it after every commit
    with pytest.raises(ValueError, match=rf"{root}/.trash: this user \(uid \d+\) cannot write there .*chown -R"):
        ck.Checkpointer(str(tmp_path), keep=2, settle_s=0).check_room(None, 10, 1)
