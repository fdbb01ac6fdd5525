"""Asynchronous saves and the commit off the step path, without a process group: the step loop waits only for the
snapshot (the next step's in-place update never reaches the files), nothing is committed before every write is
durable, a failed or SIGKILLed write leaves nothing a resume takes, `finish(timeout_s)` commits only a durable
write; rotation's deletions run in rank 0's background thread through checkpoints/.trash (a killed job's trash is
emptied by the next commit). The synchronous commit protocol is tests/unit/training/test_checkpoint.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time

import pytest
import torch

from tests.unit.training.test_checkpoint import FakeConfig, save
from training.checkpoint import MANIFEST, POINTER, Checkpointer, tag_for


# ---------------------------------------------------------------- asynchronous saves (issue 35)
class TorchEngine:
    """Saves through DeepSpeed's torch checkpoint engine, as engine.save_checkpoint does under ZeRO-3: a live tensor
    (the optimizer's fp32 partition) that the next step changes in place."""

    def __init__(self):
        from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

        self.checkpoint_engine = TorchCheckpointEngine.__new__(TorchCheckpointEngine)
        self.checkpoint_engine.zipfile_serialization = True
        self.weights = torch.arange(1 << 16, dtype=torch.float32)

    def save_checkpoint(self, root, tag, save_latest):
        self.checkpoint_engine.save({"fp32": self.weights}, os.path.join(root, tag, "zero_pp_rank_0_optim_states.pt"))


class Gate:
    """Holds the background writer at its first file until opened (or kills the process there)."""

    def __init__(self, monkeypatch):
        import training.async_save as a

        self.at_write, self.open = threading.Event(), threading.Event()
        real = a.write_durable

        def held(path, data):
            self.at_write.set()
            assert self.open.wait(30)
            return real(path, data)

        monkeypatch.setattr(a, "write_durable", held)


def test_background_save_commits_only_once_its_write_is_durable(tmp_path, monkeypatch):
    """The step loop waits only for the snapshot: the next step's in-place update does not reach the files; until
    the write is done the checkpoint has no manifest, a resume takes the previous one, and poll() commits nothing."""
    ck, eng = Checkpointer(str(tmp_path), keep=3), TorchEngine()
    first = ck.save(eng, 1, {"step": 1}, {"sampler": {}}, FakeConfig())
    gate = Gate(monkeypatch)
    assert ck.save(eng, 2, {"step": 2}, {"sampler": {"pos": 2}}, FakeConfig(), background=True) is None
    assert gate.at_write.wait(30)
    eng.weights += 1.0  # the next step, while the write is held
    path = str(tmp_path / "checkpoints" / tag_for(2))
    assert ck.poll() is None and not os.path.exists(os.path.join(path, MANIFEST))
    assert "no readable manifest" in ck.verify(path)
    assert ck.find_resume("auto") == first
    gate.open.set()
    got = ck.finish()
    assert got[0] == path and got[1] >= 0 and ck.pending is None
    assert ck.verify(path) is None and ck.find_resume("auto") == path
    assert (tmp_path / "checkpoints" / POINTER).read_text().strip() == tag_for(2)
    saved = torch.load(os.path.join(path, "zero_pp_rank_0_optim_states.pt"))["fp32"]
    assert torch.equal(saved, torch.arange(1 << 16, dtype=torch.float32))  # the snapshot, not the next step's
    assert torch.load(os.path.join(path, "state", "rank00000.pt"))["sampler"] == {"pos": 2}
    assert json.loads((tmp_path / "checkpoints" / tag_for(2) / "trainer.json").read_text()) == {"step": 2}


def test_poll_commits_when_the_write_is_done(tmp_path):
    """poll() commits a finished write; the next background save reuses the host memory (the arena) and each
    checkpoint holds its own step's state."""
    ck, eng = Checkpointer(str(tmp_path), keep=2), TorchEngine()
    for step in (1, 2):
        ck.save(eng, step, {"step": step}, {}, FakeConfig(), background=True)
        ck.pending.snapshot.wait()
        path, _ = ck.poll()
        assert ck.pending is None and ck.verify(path) is None
        eng.weights += 1.0
    for step in (1, 2):
        got = torch.load(str(tmp_path / "checkpoints" / tag_for(step) / "zero_pp_rank_0_optim_states.pt"))["fp32"]
        assert torch.equal(got, torch.arange(1 << 16, dtype=torch.float32) + (step - 1))


def test_failed_background_write_is_never_committed(tmp_path, monkeypatch):
    import training.async_save as a

    def full(path, data):  # (a full disk is a one-line refusal instead: test_disk_full.py)
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(a, "write_durable", full)
    ck = Checkpointer(str(tmp_path), keep=2)
    ck.save(TorchEngine(), 1, {"step": 1}, {}, FakeConfig(), background=True)
    with pytest.raises(RuntimeError, match="background checkpoint write .* failed: OSError"):
        ck.finish()
    assert not (tmp_path / "checkpoints" / tag_for(1) / MANIFEST).exists() and ck.pending is None
    assert ck.find_resume("auto") is None


_KILLED_WRITER = """
import os, signal, sys, threading, json
import training.async_save as a
from tests.unit.training.test_checkpoint import FakeConfig
from tests.unit.training.test_checkpoint_async import TorchEngine
from training.checkpoint import Checkpointer
real = a.write_durable
n = {"files": 0}
def write(path, data):  # SIGKILL the whole process after the first file of the background write is on disk
    out = real(path, data)
    n["files"] += 1
    if n["files"] == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return out
a.write_durable = write
ck = Checkpointer(sys.argv[1], keep=3)
ck.save(TorchEngine(), 1, {"step": 1}, {}, FakeConfig())
ck.save(TorchEngine(), 2, {"step": 2}, {}, FakeConfig(), background=True)
ck.finish()
"""


def test_sigkill_during_the_background_write_leaves_nothing_a_resume_takes(tmp_path):
    from tests.distributed import ROOT

    proc = subprocess.run([os.path.join(ROOT, ".venv/bin/python"), "-c", _KILLED_WRITER, str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr[-2000:]
    partial = tmp_path / "checkpoints" / tag_for(2)
    assert partial.is_dir() and any(partial.rglob("*.pt")) and not (partial / MANIFEST).exists()
    ck = Checkpointer(str(tmp_path), keep=3)
    assert ck.find_resume("auto") == str(tmp_path / "checkpoints" / tag_for(1))


def test_the_step_loop_only_copies_the_writer_thread_serializes(tmp_path, monkeypatch):
    """The snapshot on the training thread is a memory copy; torch.save (the zip writer: a CRC32 per record and
    Python write calls, ~250 MB/s here, what the step loop used to wait for) runs in the writer thread."""
    import training.checkpoint_files as cf

    callers, real = [], torch.save

    def recording(*args, **kwargs):
        callers.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "save", recording)
    monkeypatch.setattr(cf.torch, "save", recording)
    ck, eng = Checkpointer(str(tmp_path), keep=2), TorchEngine()
    ck.save(eng, 1, {"step": 1}, {"sampler": {}}, FakeConfig(), background=True)
    ck.finish()
    assert callers == ["checkpoint-writer"] * 2, callers  # the optimizer file and the rank state, none in this thread


def test_staged_state_saves_the_same_bytes_and_reuses_its_memory(tmp_path):
    """stage() of a state dict with views of one storage, a Parameter and param groups: torch.save writes the same
    bytes as of the original at snapshot time; later in-place updates do not reach it; the second snapshot of the
    same shapes reuses every host buffer."""
    from collections import OrderedDict

    from training.async_save import Staging, stage

    flat = torch.arange(12, dtype=torch.float32)
    state = {"model": OrderedDict(w=torch.nn.Parameter(torch.ones(3, 2)), b=torch.zeros(2)),
             "optim": {"flat": flat, "views": [flat[:4], flat[4:].view(2, 4)], "param_groups": [{"lr": 1e-3}]},
             "step": 7}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    torch.save(state, tmp_path / "a" / "s.pt")  # (the zip's folder name comes from the file's)
    staging = Staging()
    snap = stage(state, staging)
    flat += 1.0
    state["optim"]["param_groups"][0]["lr"] = 5.0
    state["model"]["w"].data.mul_(3)
    torch.save(snap, tmp_path / "b" / "s.pt")
    assert (tmp_path / "b" / "s.pt").read_bytes() == (tmp_path / "a" / "s.pt").read_bytes()
    views = snap["optim"]["views"]
    assert views[0].untyped_storage().data_ptr() == snap["optim"]["flat"].untyped_storage().data_ptr()
    assert staging.nbytes == (6 + 2 + 12) * 4 and len(staging.buffers) == 3
    ptrs = [b.data_ptr() for b in staging.buffers]
    staging.reset()
    again = stage(state, staging)
    assert [b.data_ptr() for b in staging.buffers] == ptrs and torch.equal(again["optim"]["flat"], flat)
    assert torch.equal(snap["optim"]["flat"], flat)  # the first snapshot's memory was reused, as documented


# ---------------------------------------------------------------- the commit off the step path (issue 41 items 2, 11)
def test_rotation_deletes_off_the_step_path(tmp_path, monkeypatch):
    """A deletion that takes long (a ~100 GB checkpoint on a loaded file system) no longer holds the commit, where
    every other rank waits at its barrier: the dropped checkpoint leaves the listing at once (a rename into
    checkpoints/.trash, so a half-deleted folder never looks like a checkpoint) and rank 0's thread deletes it; the
    newest complete one is found all along. Before: the commit returned only after the deletion."""
    import training.rotation as rotation

    held, release, real = threading.Event(), threading.Event(), shutil.rmtree

    def slow_rmtree(path, ignore_errors=False):
        held.set()
        assert release.wait(30)
        real(path, ignore_errors=ignore_errors)

    ck = Checkpointer(str(tmp_path), keep=2)
    for s in (1, 2):
        save(ck, s)
    monkeypatch.setattr(rotation.shutil, "rmtree", slow_rmtree)
    done = threading.Thread(target=save, args=(ck, 3))
    done.start()
    done.join(10)
    assert not done.is_alive(), "the commit waited for the deletion"
    assert held.wait(10)  # the deletion runs meanwhile, in the background
    assert ck.tags() == [tag_for(2), tag_for(3)] and ck.find_resume("auto").endswith(tag_for(3))
    trash = tmp_path / "checkpoints" / ".trash"
    assert [p.name.split(".")[0] for p in trash.iterdir()] == [tag_for(1)]
    release.set()
    ck.close(timeout_s=30)
    assert list(trash.iterdir()) == []


def test_a_killed_jobs_trash_is_emptied_by_the_next_commit(tmp_path):
    ck = Checkpointer(str(tmp_path), keep=2)
    left = tmp_path / "checkpoints" / ".trash" / f"{tag_for(7)}.123"
    (left / "state").mkdir(parents=True)
    (left / "state" / "rank00000.pt").write_bytes(b"x" * 100)
    save(ck, 8)
    ck.close(timeout_s=30)
    assert list((tmp_path / "checkpoints" / ".trash").iterdir()) == [] and ck.tags() == [tag_for(8)]


def test_finish_with_a_timeout_commits_only_a_durable_write(tmp_path, monkeypatch):
    """The SIGTERM stop's bounded wait: a write still running when the time is up is not committed and stays
    pending (no manifest: a resume takes the previous checkpoint); once durable, finish() commits it."""
    ck, eng = Checkpointer(str(tmp_path), keep=3), TorchEngine()
    first = ck.save(eng, 1, {"step": 1}, {}, FakeConfig())
    gate = Gate(monkeypatch)
    ck.save(eng, 2, {"step": 2}, {}, FakeConfig(), background=True)
    assert gate.at_write.wait(30)
    t0 = time.monotonic()
    assert ck.finish(timeout_s=0.3) is None and time.monotonic() - t0 < 10
    assert ck.pending is not None and ck.find_resume("auto") == first
    gate.open.set()
    path, _ = ck.finish(timeout_s=30)
    assert path.endswith(tag_for(2)) and ck.pending is None and ck.verify(path) is None


def test_a_partial_leftover_at_the_same_step_is_moved_aside_not_loaded(tmp_path):
    """A killed run's partial folder at the step being saved again leaves through the trash (deleted in the
    background) and the new save commits in its place."""
    ck = Checkpointer(str(tmp_path), keep=2)
    partial = tmp_path / "checkpoints" / tag_for(5)
    (partial / "state").mkdir(parents=True)
    (partial / "state" / "rank00007.pt").write_bytes(b"old")
    path = save(ck, 5)
    assert not (partial / "state" / "rank00007.pt").exists() and ck.verify(path) is None
    ck.close(timeout_s=30)
    assert list((tmp_path / "checkpoints" / ".trash").iterdir()) == []


def test_a_save_is_progress_while_its_bytes_move(tmp_path, monkeypatch):
    """The hang detector's `save` phase was bounded by the async snapshots it measured (~1 s: the 300-s floor), and a
    stage end's wait for the background write plus its own synchronous save (Llama-3-8B on 32 ranks at 150 MB/s a
    node: ~322 s) was declared a hang (exit 69). A synchronous write ticks this rank's progress as it writes; a wait
    for the background write ticks while its bytes move, and not while it is stuck."""
    import threading

    import torch

    from base import progress
    from training import async_save
    from training.checkpoint_files import save_torch

    ticks = []
    monkeypatch.setattr(progress, "tick", lambda: ticks.append(threading.current_thread().name))
    save_torch({"w": torch.zeros(1000)}, str(tmp_path / "sync.pt"))
    assert ticks and set(ticks) == {threading.main_thread().name}
    ticks.clear()
    real = async_save.write_durable
    monkeypatch.setattr(async_save, "write_durable", lambda path, data: (time.sleep(0.3), real(path, data))[1])
    snap = async_save.Snapshot(str(tmp_path))  # a write that outlasts the wait's start
    snap.add_torch(str(tmp_path / "bg.pt"), {"w": torch.zeros(1000)})
    snap.start()
    assert snap.wait() and ticks and set(ticks) == {threading.main_thread().name}  # the writer thread never ticks
    ticks.clear()
    stuck = threading.Event()
    monkeypatch.setattr(async_save, "write_durable", lambda path, data: stuck.wait())
    snap = async_save.Snapshot(str(tmp_path))
    snap.add_bytes(str(tmp_path / "stuck.bin"), b"x" * 100)
    snap.start()
    assert not snap.wait(timeout_s=0.3) and ticks == []
    stuck.set()
    snap.wait()


@pytest.mark.parametrize("how", ["save_torch", "write_durable"])
def test_a_files_dirty_bytes_are_flushed_as_it_is_written_so_no_flush_goes_without_a_tick(tmp_path, monkeypatch, how):
    """torch.save's writes land in the page cache: the file's one fsync at the end drained all of it without a tick
    (Qwen2.5-7B on one node of 8: ~84 GB dirty, ~564 s at 149 MB/s, past a `save` phase's 300-s bound: a false hang
    at every stage end). The dirty bytes are now flushed every SYNC_EVERY, a tick after each: no stretch between two
    flushes, the last fsync's included, holds more than two SYNC_EVERY (a write handed over whole is split). Before,
    no flush until the end: the whole file."""
    from base import progress
    from training import async_save
    from training import checkpoint_files as cf

    every = 1 << 20
    monkeypatch.setattr(cf, "SYNC_EVERY", every, raising=False)  # (raising=False: the old code shows its failure)
    marks, real = [], os.fsync
    monkeypatch.setattr(os, "fdatasync", lambda fd: marks.append(("sync", cf.WRITTEN[0])))
    monkeypatch.setattr(os, "fsync", lambda fd: (marks.append(("fsync", cf.WRITTEN[0])), real(fd)))
    ticks = []
    monkeypatch.setattr(progress, "tick", lambda: ticks.append(cf.WRITTEN[0]))
    weights = torch.arange(2_500_000, dtype=torch.float32)  # 10 MB, in one write call
    path, start = str(tmp_path / "f.pt"), cf.WRITTEN[0]
    if how == "save_torch":
        entry = cf.save_torch({"w": weights}, path)
        assert torch.equal(torch.load(path)["w"], weights)
    else:
        entry = async_save.write_durable(path, weights.numpy().tobytes())
        assert open(path, "rb").read() == weights.numpy().tobytes()
    assert entry == {"size": os.path.getsize(path), "crc32": cf.crc32(path)}
    at = [start] + [w for _, w in marks]
    assert marks[-1][0] == "fsync" and sum(k == "sync" for k, _ in marks) >= 4, marks
    assert max(b - a for a, b in zip(at, at[1:])) < 2 * every, marks
    assert all(any(t >= w for t in ticks) for k, w in marks if k == "sync"), (marks, ticks[-3:])
