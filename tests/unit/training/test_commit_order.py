"""The order a commit's writes land in, and the stop's save sizing, each in one process: a file's bytes are synced
before its rename and its folder after it (base/atomic.py), a background write syncs its folders before it is done,
the pointers (LATEST, DeepSpeed's `latest`) move only after the manifest, the tidy before a save never moves aside the
folder LATEST names, and a SIGTERM's save is started only when the agreed save time fits the window less the exit
margin (training/stage.py _stop_in_window). Each case is a mutant that passed the suite before (mutation audit mutC)."""

from __future__ import annotations

import os

import pytest

from base import comm
from tests.unit.training.test_checkpoint import FakeConfig, save
from tests.unit.training.test_checkpoint_async import TorchEngine
from tests.unit.training.test_stop_window import simulate
from training import preemption
from training.checkpoint import MANIFEST, Checkpointer, tag_for
from training.preemption import EXIT_MARGIN_S, KILL_WINDOW_S


def watch(monkeypatch) -> list[tuple[str, str]]:
    """Every os.fsync (the path its descriptor names) and os.replace (the new name), in order."""
    events, fsync, replace = [], os.fsync, os.replace

    def synced(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return fsync(fd)

    def renamed(src, dst, **kw):
        events.append(("replace", os.fspath(dst)))
        return replace(src, dst, **kw)

    monkeypatch.setattr(os, "fsync", synced)
    monkeypatch.setattr(os, "replace", renamed)
    return events


def test_an_atomic_write_syncs_its_bytes_before_the_rename_and_its_folder_after(tmp_path, monkeypatch):
    """M01/M02: the tmp file fsynced, then renamed over LATEST, then its folder fsynced (the new name durable): a crash
    after the rename never leaves a LATEST of zero bytes, nor the old name after a power loss."""
    from base.atomic import atomic_write

    events = watch(monkeypatch)
    atomic_write(str(tmp_path / "LATEST"), b"step_000002\n")
    i = events.index(("replace", str(tmp_path / "LATEST")))
    assert any(k == "fsync" and os.path.basename(p).startswith("LATEST.tmp.") for k, p in events[:i]), events
    assert ("fsync", str(tmp_path)) in events[i + 1:], events


def test_a_background_write_syncs_its_folders_before_it_is_done(tmp_path, monkeypatch):
    """M04: the background writer fsyncs the folders it wrote into (the checkpoint's and its state/) before it says
    done: the commit that follows names files whose entries are durable."""
    events = watch(monkeypatch)
    ck = Checkpointer(str(tmp_path), keep=3)
    ck.save(TorchEngine(), 2, {"step": 2}, {"sampler": {}}, FakeConfig(), background=True)
    ck.pending.snapshot.wait()
    before_commit = {p for k, p in events if k == "fsync"}
    path, _ = ck.finish()
    assert {path, os.path.join(path, "state")} <= before_commit, events


def test_a_failed_manifest_write_leaves_both_pointers_on_the_previous_checkpoint(tmp_path, monkeypatch):
    """M05: LATEST and DeepSpeed's `latest` move only after the manifest is written: a manifest write that fails (a
    full disk) leaves both naming the previous committed checkpoint (zero_to_fp32 without a tag reads `latest`)."""
    ck = Checkpointer(str(tmp_path), keep=3)
    save(ck, 1)
    replace = os.replace

    def full(src, dst, **kw):
        if os.fspath(dst).endswith(MANIFEST):
            raise OSError(28, "No space left on device")
        return replace(src, dst, **kw)

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(OSError):
        save(ck, 2)
    root = tmp_path / "checkpoints"
    assert (root / "LATEST").read_text().strip() == tag_for(1)
    assert (root / "latest").read_text() == tag_for(1)


def test_the_tidy_at_a_start_keeps_the_folder_latest_names_while_its_manifest_is_not_seen(tmp_path, monkeypatch):
    """M10: a requeue whose rank 0 does not see the newest manifest yet (a shared file system's cache; LATEST names
    it): the start's tidy (check_room) moves partial folders aside, never that one (the run's newest committed
    checkpoint), whichever checkpoint this start resumes."""
    ck = Checkpointer(str(tmp_path), keep=3)
    older = save(ck, 1)
    newest = save(ck, 2)
    os.makedirs(tmp_path / "checkpoints" / tag_for(3))  # a killed save's partial folder: moved aside
    hidden, exists = os.path.join(newest, MANIFEST), os.path.exists
    monkeypatch.setattr(os.path, "exists", lambda p: False if os.fspath(p) == hidden else exists(p))
    for resumed in (None, older):
        ck = Checkpointer(str(tmp_path), keep=3)
        ck.check_room(resumed, 1000, 1)
        ck.trash.wait(30)
        assert exists(hidden), sorted(os.listdir(tmp_path / "checkpoints"))
    assert not exists(tmp_path / "checkpoints" / tag_for(3))


def test_the_window_stop_keeps_its_exit_margin(monkeypatch):
    """M19: a SIGTERM 50 s into a 60 s step leaves 20 s of the 30 s window at the check; a save measured at 17 s fits
    20 s but not 20 - EXIT_MARGIN_S: not started (the commit, the engine's release and the exit need the margin)."""
    clock, ckpt, flag, state, term = simulate(monkeypatch, save_every_s=0, signal_at=(5, 50.0), save_s=17.0,
                                              ckpt_kw={"sync_s": 17.0})
    assert flag.window_left_s is not None and 17.0 > flag.window_left_s - EXIT_MARGIN_S
    assert ckpt.started == [], ckpt.started
    assert clock.t <= term + KILL_WINDOW_S - EXIT_MARGIN_S


def test_the_window_stop_sizes_its_save_by_the_agreed_time(monkeypatch):
    """M18: another rank's save takes longer (its guess or measurement: the stop's all-reduce takes the MAX): the stop's
    save is started on no rank, whatever this rank's own time (3 s) says."""
    real, seen = comm.all_reduce, []

    def other_rank_slower(values, op="sum", **kw):
        got = real(values, op=op, **kw)
        if len(values) == 4 and op == "max":  # PreemptionFlag.agreed's votes: stop, save due, window, save time
            seen.append(values)
            got[3] = max(float(got[3]), 100.0)
        return got

    monkeypatch.setattr(preemption.comm, "all_reduce", other_rank_slower)
    clock, ckpt, flag, state, term = simulate(monkeypatch, save_every_s=0, signal_at=(5, 50.0), save_s=3.0,
                                              ckpt_kw={"sync_s": 3.0})
    assert seen and flag.save_need_s == 100.0, seen  # the vote is where this test puts the other rank's time
    assert ckpt.started == [], ckpt.started
