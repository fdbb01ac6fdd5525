"""base/atomic.atomic_write's tmp name was `<path>.tmp<pid>`: two writers of one file with the same pid (two jobs'
rank 0s in containers with their own pid namespace on one shared volume) wrote the same tmp, and the second replace
failed (FileNotFoundError). It is host, pid and random now, and a failed write removes its own."""

from __future__ import annotations

import os

import pytest

from base.atomic import atomic_write


def test_two_writers_with_one_pid_keep_their_own_tmp(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "getpid", lambda: 7)
    path = tmp_path / "stage0.json"

    def first(fh):
        fh.write(b"A" * 8)
        atomic_write(str(path), b"B" * 8)  # the other job, meanwhile: same file, same pid
        fh.write(b"A" * 8)

    atomic_write(str(path), first)
    assert path.read_bytes() == b"A" * 16  # whole: the last replace's, never a mix
    assert os.listdir(tmp_path) == ["stage0.json"]


def test_a_failed_write_leaves_no_tmp(tmp_path):
    def full(fh):
        fh.write(b"x")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        atomic_write(str(tmp_path / "a.npy"), full, suffix=".npy")
    assert os.listdir(tmp_path) == []
