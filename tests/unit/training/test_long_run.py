"""What grows over a long run (100+ requeues, 512 ranks) and must not cost every start or every save in proportion:
metrics.jsonl is cut in place at a resume, never read whole and rewritten; a killed universal conversion's fragments
(params x 3 x world files) leave through the checkpoints' trash, never an inline rmtree while every GPU waits, and the
room check at each save never walks them; a stage end's conversion is not kept for good; each start's part of a rank
log says which host, process, job and requeue wrote it."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import threading

import pytest

from training import rotation, universal, universal_lock
from training.checkpoint import Checkpointer
from training.metrics import MetricsLogger


def _records(path, steps) -> list[str]:
    lines = [json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in steps]
    path.write_text("".join(lines))
    return lines


# ---------------------------------------------------------------- 1: metrics.jsonl at a resume


def test_metrics_are_cut_in_place_at_a_resume_reading_only_the_tail(tmp_path, monkeypatch):
    """_truncate read, parsed and rewrote all of metrics.jsonl at every start (80k lines, 60 MB: ~2 s, every rank
    waiting), with no fsync after its rename. Now: nothing past the resumed step leaves the file untouched; steps past
    it are cut off in place (same inode, fsynced), reading only the tail; a torn last line goes with them."""
    import training.metrics as metrics

    path = tmp_path / "metrics.jsonl"
    lines = _records(path, range(1, 100_001))  # ~4 MB
    before = os.stat(path)
    read, real_open, synced = [0], open, []

    class Counted:
        def __init__(self, fh):
            self.fh = fh

        def read(self, *a):
            got = self.fh.read(*a)
            read[0] += len(got)
            return got

        def __getattr__(self, name):
            return getattr(self.fh, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.fh.close()

        def __iter__(self):
            for ln in self.fh:
                read[0] += len(ln)
                yield ln

    monkeypatch.setattr(metrics, "open", lambda *a, **kw: Counted(real_open(*a, **kw)), raising=False)
    monkeypatch.setattr(metrics.os, "fsync", lambda fd: synced.append(fd))
    MetricsLogger(str(tmp_path), True, "none", None, None, {}, 10**6, False, resume_step=100_000).close()
    after = os.stat(path)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
    assert synced == [] and read[0] < 0.05 * before.st_size, read  # untouched, a block of its tail read

    with real_open(path, "a") as fh:
        fh.write('{"step": 100001, "loss": 0.')  # a job killed mid-write
    read[0] = 0
    MetricsLogger(str(tmp_path), True, "none", None, None, {}, 10**6, False, resume_step=99_990).close()
    assert path.read_text() == "".join(lines[:99_990])
    assert os.stat(path).st_ino == before.st_ino and len(synced) == 1 and read[0] < 0.05 * before.st_size


def test_a_kept_last_record_without_its_newline_gets_one(tmp_path):
    """A record whole but for its newline (killed between the two) is kept, and the next record starts a line."""
    path = tmp_path / "metrics.jsonl"
    lines = _records(path, (1, 2, 3))
    path.write_text("".join(lines)[:-1])
    m = MetricsLogger(str(tmp_path), True, "none", None, None, {}, 10, False, resume_step=3)
    m.log({"event": "memory_choice", "step": 4})
    m.close()
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2, 3, 4]


# ---------------------------------------------------------------- 2: a killed conversion's fragments


def _partial(out: str, owner: dict, files: int = 50) -> str:
    tmp = f"{out}.tmp.{owner['host']}.{owner['pid']}"
    frag = os.path.join(tmp, "step_000004", "tmp", "model.layers.0.w")
    os.makedirs(frag)
    for j in range(files):
        with open(os.path.join(frag, f"exp_avg.{j:03d}"), "wb") as fh:
            fh.write(b"x" * 100)
    return tmp


def _no_inline_rmtree(monkeypatch) -> list[str]:
    """shutil.rmtree recorded when rank 0's own thread runs it on a converter's folder (the others still delete)."""
    inline, real = [], universal.shutil.rmtree

    def rmtree(path, ignore_errors=False, *a, **kw):
        if ".tmp." in str(path) and os.path.exists(path) and threading.current_thread() is threading.main_thread():
            inline.append(str(path))
        return real(path, ignore_errors, *a, **kw)

    monkeypatch.setattr(universal.shutil, "rmtree", rmtree)
    return inline


def test_a_taken_over_conversions_fragments_go_to_the_trash_not_an_inline_rmtree(tmp_path, monkeypatch):
    """The next job's take-over of a killed converter's lock rmtree'd its partial folder inside run_on_main (447k files
    at 8B and 512 ranks: minutes, inside the conversion's time budget, every GPU waiting). Now a rename into
    checkpoints/.trash; a thread deletes it."""
    inline = _no_inline_rmtree(monkeypatch)
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "4")
    out = str(tmp_path / "universal" / ("ab" * 12))
    owner = {"job": "777", "restart": 3, "host": "nodeA", "pid": 4242, "cluster": ""}
    os.makedirs(out + ".lock")
    with open(os.path.join(out + ".lock", universal_lock.OWNER), "w") as fh:
        json.dump(owner, fh)
    tmp = _partial(out, owner)
    lock = universal_lock.Lock(out)
    assert lock.acquire() is None
    lock.release()
    assert inline == [] and not os.path.exists(tmp)
    assert os.path.isdir(tmp_path / "checkpoints" / ".trash")


def test_a_failed_conversions_fragments_go_to_the_trash(tmp_path, monkeypatch):
    """convert()'s failure path (the time limit's stop, a kill) rmtree'd its own fragments before the exit 75."""
    inline = _no_inline_rmtree(monkeypatch)
    out = str(tmp_path / "universal" / ("cd" * 12))
    os.makedirs(os.path.dirname(out))
    ckpt = tmp_path / "checkpoints" / "step_000004"
    ckpt.mkdir(parents=True)
    me = {"host": socket.gethostname(), "pid": os.getpid()}

    def run(cmd, *a, **kw):
        _partial(out, me)
        raise subprocess.TimeoutExpired(cmd, 5)

    monkeypatch.setattr(universal.subprocess, "run", run)
    with pytest.raises(subprocess.TimeoutExpired):
        universal.convert(str(ckpt), out, "cd" * 12, 10**9, timeout=5)
    assert inline == [] and not os.path.exists(universal_lock._tmp(out, me))
    assert universal.record(os.path.dirname(out), universal.RATE)["finished"] is False


def test_the_room_check_counts_the_trash_without_walking_it_at_every_save(tmp_path, monkeypatch):
    """_space walked all of checkpoints/.trash at every save: a killed conversion's fragments there (447k files at
    512 ranks) cost minutes per save on NFS. Now a killed job's leftover is walked once and counted; a partial
    conversion is never walked (counted 0); a discarded checkpoint is counted from its manifest."""
    ck = Checkpointer(str(tmp_path), keep=2)
    monkeypatch.setattr(ck.trash, "empty", lambda: None)  # nothing deleted meanwhile
    trash = tmp_path / "checkpoints" / ".trash"
    left = trash / "step_000001.123"
    left.mkdir(parents=True)
    (left / "optim.pt").write_bytes(b"x" * 30_000)
    _partial(str(trash / ("ef" * 12)), {"host": "nodeA", "pid": 4242})
    walked, real_walk = [], os.walk

    def walk(top, *a, **kw):
        walked.append(os.path.basename(str(top)))
        return real_walk(top, *a, **kw)

    monkeypatch.setattr(os, "walk", walk)
    for _ in range(3):
        ck._space(lambda: None)
    assert walked == ["step_000001.123"], walked  # once, the partial never
    assert ck.trash.bytes() == 30_000
    ckpt = tmp_path / "checkpoints" / "step_000002"
    ckpt.mkdir()
    (ckpt / "MANIFEST.json").write_text(json.dumps({"files": {"a.pt": {"size": 10**12, "crc32": 1}}}))
    ck.trash.discard(str(ckpt))
    assert ck.trash.bytes() == 30_000 + 10**12 and walked == ["step_000001.123"]


# ---------------------------------------------------------------- 3: a stage end's conversion


def test_a_stage_ends_conversion_is_not_kept_for_good(tmp_path):
    """Rotation kept a conversion of every checkpoint still here, so every stage end's (kept for good) stayed: ~100 GB
    a stage at 8B. Now: the newest `keep` checkpoints' and the resumed one's only."""
    root = tmp_path / "checkpoints"

    def ckpt(step, stage_end=None):
        p = root / f"step_{step:06d}"
        p.mkdir(parents=True)
        (p / "MANIFEST.json").write_text(json.dumps({"step": step, "world": 64, "stage_end": stage_end,
                                                     "files": {"a.pt": {"size": 10, "crc32": step}}}))
        return str(p)

    def converted(path):
        key = universal.source_id(path)
        conv = tmp_path / "universal" / key
        (conv / os.path.basename(path)).mkdir(parents=True)
        (conv / universal.DONE).write_text(json.dumps({"source": key, "files": {}}))
        return conv

    end = converted(ckpt(1000, "STAGE_0_s128k"))
    (root / "STAGE_0_s128k").write_text("step_001000\n")
    rotation.rotate(str(root), keep=2, keep_tag="step_001000")  # the start that resumed it (check_room)
    assert end.is_dir()
    ckpt(1100)
    rotation.rotate(str(root), keep=2, keep_tag="step_001100")
    assert end.is_dir()  # still one of the newest two: a requeue now resumes step_001100, no conversion
    ckpt(1200)
    rotation.rotate(str(root), keep=2, keep_tag="step_001200")
    assert not end.exists() and (root / "step_001000").is_dir()  # the checkpoint stays; its conversion can be made again
    newest = converted(str(root / "step_001200"))
    ckpt(1300)
    rotation.rotate(str(root), keep=2, keep_tag="step_001300")
    assert newest.is_dir()


# ---------------------------------------------------------------- 5: whose part of a rank log


def test_each_starts_part_of_a_rank_log_names_its_host_pid_job_and_restart(tmp_path, monkeypatch):
    """One file per rank, appended by every start: nothing said which node or requeue wrote a part."""
    from deepspeed.utils import logger as ds_logger

    from base import log

    before = list(log._RANK_LOG.handlers), list(ds_logger.handlers)
    try:
        monkeypatch.delenv("SLURM_JOB_ID", raising=False)
        monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
        path = log.open_rank_log(str(tmp_path), 3)
        monkeypatch.setenv("SLURM_JOB_ID", "777")
        monkeypatch.setenv("SLURM_RESTART_COUNT", "4")
        log.open_rank_log(str(tmp_path), 3)
    finally:
        for lg, kept in zip((log._RANK_LOG, ds_logger), before):
            for h in [h for h in lg.handlers if h not in kept]:
                lg.removeHandler(h)
                h.close()
    heads = [ln.split(" rank3 INFO ", 1)[1] for ln in open(path).read().splitlines() if "start:" in ln]
    me = f"start: host {socket.gethostname()} pid {os.getpid()}"
    assert heads[0] == me and heads[-1] == f"{me} SLURM_JOB_ID 777 SLURM_RESTART_COUNT 4", heads
    assert logging.getLogger("ulysses_longtrain.rank").handlers == before[0]
