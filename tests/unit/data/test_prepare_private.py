"""The in-job preparation's private folder was named by pid only (`<key>.tmp<pid>`): two jobs whose rank 0 has the
same pid (containers with their own pid namespace on one shared cache, a sweep) removed and wrote each other's folder,
and both died. Its name is now host, pid and random (base/atomic.tmp_name); a killed job's folder is removed by a
later one when no process holds it and it is old (data/prepare.remove_stale), never another live job's."""

from __future__ import annotations

import json
import os
import shutil
import time

from data import output_lock, prepare_data
from data import prepare as in_job
from data.store import Prepared


def _rows(tmp_path) -> str:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"input_ids": list(range(1, 30 + i))}) + "\n" for i in range(10)))
    return str(path)


def test_two_jobs_with_one_pid_keep_their_own_folders(tmp_path, monkeypatch):
    monkeypatch.setattr(in_job, "CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(os, "getpid", lambda: 7)  # both rank 0s are pid 7 in their containers
    rows, real, folders = _rows(tmp_path), prepare_data.prepare, []

    def prepare(inputs, output, *args, **kw):
        folders.append(output)
        result = real(inputs, output, *args, **kw)
        if len(folders) == 1:  # job A's folder written, not yet renamed: job B starts and finishes meanwhile
            assert in_job.prepare_in_job(rows, None, 1000)[0]
            assert os.path.isfile(os.path.join(output, "manifest.json")), "job B removed job A's folder"
        return result

    monkeypatch.setattr(prepare_data, "prepare", prepare)
    out, _ = in_job.prepare_in_job(rows, None, 1000)
    assert len(folders) == 2 and folders[0] != folders[1]
    assert len(Prepared(out).lens) == 10 and Prepared(out).verify() == []
    assert os.listdir(tmp_path / "cache" / "prepared") == [os.path.basename(out)]  # A's own removed: B's came first


def test_a_killed_jobs_folder_is_removed_by_a_later_job_but_not_a_live_ones(tmp_path, monkeypatch):
    monkeypatch.setattr(in_job, "CACHE", str(tmp_path / "cache"))
    rows = _rows(tmp_path)
    out, _ = in_job.prepare_in_job(rows, None, 1000)
    shutil.rmtree(out)  # prepared again below, with these left around it
    old = time.time() - 2 * in_job.STALE_S

    def folder(name, lock=False, when=old):
        os.makedirs(p := f"{out}.{name}")
        with open(os.path.join(p, "tokens-s00000-c000000.bin"), "wb") as fh:
            fh.write(b"\0" * 8)
        fd = output_lock.try_lock(os.path.join(p, f"{output_lock.LOCK}-s00000")) if lock else None
        for f in [*(os.path.join(p, n) for n in os.listdir(p)), p]:
            os.utime(f, (when, when))
        return p, fd

    killed, _ = folder("tmp.node-3.4242.5a1f")  # a SIGKILLed job on another node: a requeue has another name
    before, _ = folder("tmp4242")  # the name before host + random
    live, fd = folder("tmp.node-5.17.beef", lock=True)  # a job preparing now (suspended: nothing written for long)
    fresh, _ = folder("tmp.node-6.18.cafe", when=time.time())  # between its mkdir and its lock
    try:
        assert in_job.prepare_in_job(rows, None, 1000)[0] == out
        assert not os.path.exists(killed) and not os.path.exists(before)
        assert os.path.isdir(live) and os.path.isdir(fresh)
    finally:
        os.close(fd)


def test_a_killed_jobs_folder_goes_once_the_input_is_prepared(tmp_path, monkeypatch):
    """A preparation SIGTERMed before the handler is installed leaves its folder; the requeue ~2 min later finds it
    young, prepares the input itself, and every later start found `out` prepared and never looked again: the folder
    stayed in the cache for good. A later start now removes it once it is STALE_S old; a young one stays."""
    monkeypatch.setattr(in_job, "CACHE", str(tmp_path / "cache"))
    rows = _rows(tmp_path)
    out, _ = in_job.prepare_in_job(rows, None, 1000)
    old = time.time() - 2 * in_job.STALE_S
    for name, when in (("tmp.node-3.4242.5a1f", old), ("tmp.node-4.77.9c0d", time.time())):
        os.makedirs(p := f"{out}.{name}")
        with open(os.path.join(p, "tokens-s00000-c000000.bin"), "wb") as fh:
            fh.write(b"\0" * 8)
        for f in (os.path.join(p, "tokens-s00000-c000000.bin"), p):
            os.utime(f, (when, when))
    assert in_job.prepare_in_job(rows, None, 1000)[0] == out
    assert sorted(os.listdir(tmp_path / "cache" / "prepared")) == sorted([os.path.basename(out),
                                                                          os.path.basename(out) + ".tmp.node-4.77.9c0d"])


def test_demo_chats_and_token_stream_leave_another_writers_tmp_alone(tmp_path, monkeypatch):
    """The demo chats (data/chat_demo.py) and the packed-stream cache (data/packing.py) wrote `<file>.tmp<pid>`:
    a second job's rank 0 with the same pid (its own container) truncated and renamed away the first's half-written
    file. Each write's tmp is now its own (base/atomic.tmp_name)."""
    from data import packing
    from data.chat import build_demo_chats

    monkeypatch.setattr(os, "getpid", lambda: 7)
    chats = tmp_path / "chats.jsonl"
    other = tmp_path / "chats.jsonl.tmp7"  # job B's rank 0 (pid 7 too) is half-way through its own write
    other.write_text("half of job B's file")
    build_demo_chats(str(chats), 5, seed=1)
    assert other.read_text() == "half of job B's file" and len(chats.read_text().splitlines()) == 5
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"input_ids": [1, 2, 3 + i]}) + "\n" for i in range(4)))
    cache = tmp_path / "cache"
    cache.mkdir()
    key = packing.cache_key(packing.file_stats(packing.list_files(str(docs))), None, 100)
    theirs = cache / f"tokens-{key}.npy.tmp7.npy"
    theirs.write_bytes(b"job B's")
    tok, starts = packing.build_token_stream(str(docs), None, 100, str(cache))
    assert theirs.read_bytes() == b"job B's"
    assert len(packing.np.load(tok)) == 12 and list(packing.np.load(starts)) == [0, 3, 6, 9]
