"""Checkpoint commit protocol without a process group: manifest written last, verification rejects missing,
truncated, corrupted or unlisted files, auto-resume falls back to the previous complete checkpoint, and
rotation never deletes the newest complete one; a universal conversion is keyed by its source's content and
bounded by the job's end; a file the loading rank cannot see yet is looked for again."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
import types

import pytest
import torch

from training.checkpoint import MANIFEST, POINTER, Checkpointer, tag_for


class FakeConfig:
    def to_json_string(self):
        return json.dumps({"model_type": "llama"})


class FakeEngine:
    """Writes files the way DeepSpeed's save_checkpoint does (one folder per tag)."""

    def save_checkpoint(self, root, tag, save_latest):
        assert save_latest is False  # DeepSpeed's own `latest` is never used
        with open(os.path.join(root, tag, "zero_pp_rank_0_mp_rank_00_model_states.pt"), "wb") as fh:
            fh.write(os.urandom(4096))


def save(ck, step):
    return ck.save(FakeEngine(), step, {"step": step}, {"sampler": {}}, FakeConfig())


def test_commit_writes_manifest_and_pointer(tmp_path):
    ck = Checkpointer(str(tmp_path), keep=2)
    path = save(ck, 3)
    manifest = json.loads((tmp_path / "checkpoints" / tag_for(3) / MANIFEST).read_text())
    assert set(manifest["files"]) == {"zero_pp_rank_0_mp_rank_00_model_states.pt", "state/rank00000.pt",
                                      "trainer.json", "hf_config.json"}
    assert (tmp_path / "checkpoints" / POINTER).read_text().strip() == tag_for(3)
    assert ck.verify(path) is None and ck.find_resume("auto") == path


@pytest.mark.parametrize("damage, reason", [
    (lambda p: os.remove(p / "state" / "rank00000.pt"), "missing state/rank00000.pt"),
    (lambda p: os.truncate(p / "zero_pp_rank_0_mp_rank_00_model_states.pt", 100), "has 100 bytes"),
    (lambda p: _flip_byte(p / "zero_pp_rank_0_mp_rank_00_model_states.pt"), "checksum differs"),
    (lambda p: (p / "extra.pt").write_bytes(b"x"), "files not in the manifest"),
    (lambda p: os.remove(p / MANIFEST), "no readable manifest"),
    (lambda p: (p / MANIFEST).write_text("{not json"), "no readable manifest"),
])
def test_damaged_checkpoint_is_never_loaded(tmp_path, damage, reason, capsys):
    ck = Checkpointer(str(tmp_path), keep=3)
    good = save(ck, 1)
    bad = save(ck, 2)
    damage(tmp_path / "checkpoints" / tag_for(2))
    assert reason in ck.verify(bad)
    assert ck.find_resume("auto") == good
    assert f"skipping checkpoint {bad}" in capsys.readouterr().out
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        ck.find_resume(bad)


def _flip_byte(path):
    data = bytearray(path.read_bytes())
    data[10] ^= 0xFF
    path.write_bytes(bytes(data))


def test_rotation_keeps_newest_complete(tmp_path):
    ck = Checkpointer(str(tmp_path), keep=2)
    for s in (1, 2, 3):
        save(ck, s)
    os.makedirs(tmp_path / "checkpoints" / tag_for(4))  # a partial write (killed before its manifest)
    assert ck.tags() == [tag_for(2), tag_for(3), tag_for(4)]
    assert ck.find_resume("auto").endswith(tag_for(3))
    save(ck, 5)  # commit, then rotate: 3 and 5 stay, the partial 4 is older than the new commit: removed
    assert ck.tags() == [tag_for(3), tag_for(5)]


def test_resume_none_and_empty(tmp_path):
    ck = Checkpointer(str(tmp_path), keep=2)
    assert ck.find_resume("auto") is None
    save(ck, 1)
    assert ck.find_resume("none") is None


def test_stage_end_checkpoints_survive_rotation(tmp_path):
    ck = Checkpointer(str(tmp_path), keep=2)
    ck.save(FakeEngine(), 1, {"step": 1}, {}, FakeConfig(), stage_end="STAGE_0_short")
    for s in (2, 3, 4):
        save(ck, s)
    assert ck.tags() == [tag_for(1), tag_for(3), tag_for(4)]
    assert (tmp_path / "checkpoints" / "STAGE_0_short").read_text().strip() == tag_for(1)


def test_verification_is_dealt_by_bytes():
    """Files to ranks by bytes, largest first to the least-loaded rank: the 32 large optimizer partitions of a
    32-rank save land one per rank (by count, rank r got files r, r + 32, ...: all large ones on half the ranks)."""
    from training.checkpoint import deal_by_bytes

    sizes = {f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt": 3_000 for r in range(32)}
    sizes.update({f"zero_pp_rank_{r}_mp_rank_00_model_states.pt": 500 for r in range(32)})
    deal = deal_by_bytes(sizes, 32)
    assert sorted(f for part in deal for f in part) == sorted(sizes)
    assert {sum(sizes[f] for f in part) for part in deal} == {3_500}
    by_count = [sorted(sizes)[r::32] for r in range(32)]
    assert max(sum(sizes[f] for f in part) for part in by_count) == 6_000  # what counting files gave
    assert deal_by_bytes(sizes, 32) == deal  # the same deal on every rank


def test_side_folders_are_bounded(tmp_path, monkeypatch):
    """universal/ keeps finished conversions of the checkpoints still kept, of their content now (a branch's new
    step_N under an old name makes the old conversion stale: dropped); abandoned/ keeps its newest `keep` and their
    stage pointers."""
    from training import universal

    fake_converter(monkeypatch)
    ck = Checkpointer(str(tmp_path), keep=2)
    root = tmp_path / "checkpoints"

    def convert(step):
        p = str(root / tag_for(step))
        universal.convert(p, universal.folder(p, str(tmp_path)), universal.source_id(p), 0)

    for t in (1, 2, 3, 4, 5):
        (root / "abandoned" / tag_for(10 + t)).mkdir(parents=True)
    (root / "abandoned" / "STAGE_0_a").write_text(tag_for(11) + "\n")
    (root / "abandoned" / "STAGE_1_b").write_text(tag_for(15) + "\n")
    for s in (1, 2, 3):
        save(ck, s)  # rotation drops step 1, and with it its conversion
        if s < 3:
            convert(s)
    kept = sorted(["RATE.json", universal.source_id(str(root / tag_for(2)))])  # OUTPUT_DIR/universal/<its key>
    assert sorted(os.listdir(tmp_path / "universal")) == kept
    assert sorted(os.listdir(root / "abandoned")) == ["STAGE_1_b", tag_for(14), tag_for(15)]
    convert(3)
    save(ck, 3)  # a branch's own step 3: the conversion of the old one is stale
    assert sorted(os.listdir(tmp_path / "universal")) == kept


# --- loading: universal conversions (issue 32 item 3) and files a rank cannot see yet (item 8) ---

MODEL_FILE = "zero_pp_rank_0_mp_rank_00_model_states.pt"


class LoadEngine:
    """What Checkpointer.load uses of a DeepSpeed engine; records the bytes of the model file it loaded (from the
    checkpoint itself, or from the universal conversion it was pointed at)."""

    def __init__(self):
        self._config = types.SimpleNamespace(load_universal_checkpoint=False)
        self.optimizer = types.SimpleNamespace(state={}, param_groups=[])
        self.lr_scheduler = None
        self.loaded: list[tuple[bool, bytes]] = []

    def load_checkpoint(self, load_dir, tag, load_optimizer_states, load_lr_scheduler_states):
        with open(os.path.join(load_dir, tag, MODEL_FILE), "rb") as fh:  # FileNotFoundError if not seen, as torch.load
            self.loaded.append((self._config.load_universal_checkpoint, fh.read()))
        return os.path.join(load_dir, tag), {}


def fake_converter(monkeypatch) -> list:
    """`python -m deepspeed.checkpoint.ds_to_universal` replaced by a copy of the model file (ds_to_universal copies
    the model-states files into its output too); returns the list of conversions started."""
    calls, real_run = [], subprocess.run

    def run(cmd, *args, **kwargs):
        if "deepspeed.checkpoint.ds_to_universal" not in cmd:
            return real_run(cmd, *args, **kwargs)
        src, out = cmd[cmd.index("--input_folder") + 1], cmd[cmd.index("--output_folder") + 1]
        calls.append(src)
        os.makedirs(out, exist_ok=True)
        shutil.copy2(os.path.join(src, MODEL_FILE), os.path.join(out, MODEL_FILE))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(subprocess, "run", run)
    return calls


def save_from_world(ck, step: int, world: int) -> str:
    """A checkpoint as `world` ranks would have committed it (the manifest says who wrote it)."""
    path = save(ck, step)
    manifest = json.loads(open(os.path.join(path, MANIFEST)).read())
    manifest["world"] = world
    with open(os.path.join(path, MANIFEST), "w") as fh:
        json.dump(manifest, fh)
    return path


def model_bytes(path) -> bytes:
    with open(os.path.join(path, MODEL_FILE), "rb") as fh:
        return fh.read()


def test_universal_conversion_is_keyed_by_its_source(tmp_path, monkeypatch):
    """A branch writes a new step_4 under the old name: a resume at another world size converts the new one
    (the old conversion, of another step_4, must never be loaded); the same content is converted once."""
    calls = fake_converter(monkeypatch)
    ck = Checkpointer(str(tmp_path), keep=3)
    path = save_from_world(ck, 4, world=2)
    engine = LoadEngine()
    ck.load(engine, path)
    ck.load(engine, path)
    assert len(calls) == 1 and engine.loaded == [(True, model_bytes(path))] * 2  # converted once, then reused
    save_from_world(ck, 2, world=2)
    branch = save_from_world(ck, 4, world=2)  # the branch's own step_4: other bytes, same name
    ck.load(engine, branch)
    assert len(calls) == 2, "the branch's step_4 was loaded through the old step_4's conversion"
    assert engine.loaded[-1] == (True, model_bytes(branch))


def test_offline_conversion_is_the_one_a_resume_uses(tmp_path, monkeypatch, capsys):
    """`python -m training.universal CHECKPOINT` (the fix a refusal names) converts it with no deadline; a resume at
    another world size then loads that conversion without converting again."""
    from training import universal

    calls = fake_converter(monkeypatch)
    ck = Checkpointer(str(tmp_path), keep=3)
    path = save_from_world(ck, 4, world=2)
    assert universal.main([path]) == 0 and len(calls) == 1
    assert universal.main([path]) == 0 and "already holds" in capsys.readouterr().out
    engine = LoadEngine()
    ck.load(engine, path)
    assert len(calls) == 1 and engine.loaded == [(True, model_bytes(path))]
    assert universal.main([str(tmp_path)]) == 2  # not a checkpoint: usage, exit 2


def _exit_code(monkeypatch, fn) -> int:
    from training.job import run_job

    monkeypatch.setenv("RANK", "0")  # a world of one: run_job leaves the environment alone
    return run_job(lambda: fn() or 0)


def test_conversion_that_cannot_finish_before_the_job_ends_is_not_started(tmp_path, monkeypatch, capsys):
    """A job that starts 60 s before its end (SLURM_JOB_END_TIME) does not start a conversion it cannot finish
    (killed at the limit, it was redone from scratch on every requeue): exit 75 (requeue) in one line, before it."""
    calls = fake_converter(monkeypatch)
    monkeypatch.setenv("SLURM_JOB_START_TIME", str(int(time.time() - 3600)))
    monkeypatch.setenv("SLURM_JOB_END_TIME", str(int(time.time() + 60)))
    ck = Checkpointer(str(tmp_path), keep=3)
    path = save_from_world(ck, 4, world=2)
    code = _exit_code(monkeypatch, lambda: ck.load(LoadEngine(), path))
    assert calls == [], "the conversion was started 60 s before the job's end"
    assert code == 75
    assert "requeue" in capsys.readouterr().err


def test_conversion_longer_than_a_whole_allocation_is_refused(tmp_path, monkeypatch, capsys):
    """A job whose whole allocation (SLURM_JOB_END_TIME - SLURM_JOB_START_TIME) cannot hold the conversion would be
    requeued for ever: refused as bad input (exit 2), naming the offline conversion as the fix."""
    calls = fake_converter(monkeypatch)
    monkeypatch.setenv("SLURM_JOB_START_TIME", str(int(time.time() - 5)))
    monkeypatch.setenv("SLURM_JOB_END_TIME", str(int(time.time() + 100)))
    ck = Checkpointer(str(tmp_path), keep=3)
    path = save_from_world(ck, 4, world=2)
    code = _exit_code(monkeypatch, lambda: ck.load(LoadEngine(), path))
    assert calls == [] and code == 2
    assert "python -m training.universal" in capsys.readouterr().err


def test_conversion_that_overruns_its_estimate_is_stopped_before_the_job_ends(tmp_path, monkeypatch, capsys):
    """A conversion that fits by its estimate still runs under a timeout that leaves a step, a save and the margin
    before SLURM_JOB_END_TIME; stopped there, its time is recorded as unfinished and the job exits 75."""
    from training import universal

    seen = []

    def run(cmd, *args, timeout=None, **kwargs):
        seen.append(timeout)
        raise subprocess.TimeoutExpired(cmd, timeout)

    monkeypatch.setattr(subprocess, "run", run)
    monkeypatch.setenv("SLURM_JOB_END_TIME", str(int(time.time() + 600)))
    ck = Checkpointer(str(tmp_path), keep=3)
    path = save_from_world(ck, 4, world=2)
    assert _exit_code(monkeypatch, lambda: ck.load(LoadEngine(), path)) == 75
    assert len(seen) == 1 and 200 < seen[0] < 600 - 300  # ends before the job does, with a save's time to spare
    rate = json.loads((tmp_path / "universal" / universal.RATE).read_text())
    assert rate["finished"] is False and "was stopped after" in capsys.readouterr().err


def test_a_file_the_loading_rank_cannot_see_yet_is_looked_for_again(tmp_path):
    """The rank that loads a file looks it up again by name (a stale view of its node) as the verifying rank does:
    files that appear 1.5 s late are loaded; a file that never appears fails in one line naming it."""
    ck = Checkpointer(str(tmp_path), keep=2, settle_s=8)
    path = save(ck, 2)
    late = [os.path.join(path, "state", "rank00000.pt"), os.path.join(path, MODEL_FILE)]
    for f in late:
        os.rename(f, f + ".away")
    timers = [threading.Timer(1.5, os.rename, (f + ".away", f)) for f in late]
    for t in timers:
        t.start()
    engine = LoadEngine()
    assert ck.load(engine, path) == {"sampler": {}}
    assert engine.loaded == [(False, model_bytes(path))]

    os.remove(late[0])
    ck.settle_s = 1
    with pytest.raises(RuntimeError, match="state/rank00000.pt"):
        ck.load(LoadEngine(), path)


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

    def full(path, data):
        raise OSError(28, "No space left on device")

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
from tests.unit.training.test_checkpoint import FakeConfig, TorchEngine
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
