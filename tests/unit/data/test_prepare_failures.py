"""prepare_data under what a cluster does to it, each a one-line refusal (exit 2) instead of a hang, a traceback or
wrong advice: a pool worker killed by the out-of-memory killer (data/prepare_pool.py), a full disk or quota
(data/prepare_checks.refusal), an unfinished prepared folder given as the input (data/output_lock.unfinished), srun's
tasks without their own --shard (data/prepare_checks.shard_of)."""

from __future__ import annotations

import errno
import json
import os
import signal

import pytest

from data import output_lock, prepare_pool, store
from data import prepare_data as pd
from data.prepare_checks import shard_of
from data.store import Prepared

ROWS = 40


class Hung(Exception):
    pass


def _rows(tmp_path) -> str:
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"input_ids": [i + 1, i + 2]}) + "\n" for i in range(ROWS)))
    return str(path)


def _args(rows: str, out: str, *extra: str) -> list[str]:
    return ["--input", rows, "--output", out, "--vocab_size", "100", "--eos_id", "0", "--chunk_tokens", "6",
            "--batch_docs", "1", *extra]


def _ids(out: str) -> list[int]:
    p = Prepared(out)
    return p.tokens.read(0, len(p.tokens)).tolist()


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: ") and "Traceback" not in err, err
    return err


def test_a_killed_worker_ends_the_run_in_one_line_and_the_same_command_resumes(tmp_path, monkeypatch, capsys):
    """A worker SIGKILLed on its 3rd batch (the cgroup's OOM killer): its batch never finished and get() waited
    forever, the shard's lock held (the auditor's oomworker.py). Now: exit 2 within a poll, then the same command
    (here without the killer) finishes every row, in order."""
    rows, out = _rows(tmp_path), str(tmp_path / "out")
    real, n = pd._tokenize_batch, [0]

    def killer(items):
        n[0] += 1  # per worker process (each forked with its own count)
        if n[0] == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(items)

    killer.__module__, killer.__qualname__ = "data.prepare_data", "_tokenize_batch"  # pickled by name to the workers
    monkeypatch.setattr(pd, "_tokenize_batch", killer)
    monkeypatch.setattr(prepare_pool, "POLL_S", 0.05)

    def hung(*_):
        raise Hung("prepare_data still waiting on a dead worker's batch after 20 s")

    old = signal.signal(signal.SIGALRM, hung)
    signal.setitimer(signal.ITIMER_REAL, 20)
    try:
        rc = pd.main(_args(rows, out, "--workers", "2"))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    err = _one_line(capsys)
    assert rc == 2 and "a tokenizer worker was killed (signal 9, SIGKILL: likely out of memory with 2 workers)" in err
    assert "--workers" in err and "committed chunk(s)" in err, err
    monkeypatch.setattr(pd, "_tokenize_batch", real)
    assert pd.main(_args(rows, out, "--workers", "0")) == 0
    assert _ids(out) == [t for i in range(ROWS) for t in (i + 1, i + 2, 0)]


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_a_full_disk_or_quota_is_one_line_naming_output(tmp_path, monkeypatch, capsys, code):
    """A chunk's write refused for room: a traceback and exit 1 before (a second one at shutdown). Now one line naming
    --output and that the same command resumes; freed, it does."""
    rows, out = _rows(tmp_path), str(tmp_path / "out")
    real, saves = store.save_npy_atomic, [0]

    def save(path, arr):
        saves[0] += 1
        if saves[0] > 4:  # two chunks committed, the third's write refused
            raise OSError(code, os.strerror(code))
        real(path, arr)

    monkeypatch.setattr(store, "save_npy_atomic", save)
    assert pd.main(_args(rows, out, "--workers", "0")) == 2
    err = _one_line(capsys)
    assert f"({errno.errorcode[code]}) writing a file under --output {out}" in err and "resumes" in err, err
    assert ("quota -s" in err) == (code == errno.EDQUOT) and ("df -h" in err) == (code == errno.ENOSPC)
    monkeypatch.setattr(store, "save_npy_atomic", real)
    assert pd.main(_args(rows, out, "--workers", "0")) == 0
    assert "resuming shard 0/1 after 2 committed chunk(s)" in capsys.readouterr().out
    assert _ids(out) == [t for i in range(ROWS) for t in (i + 1, i + 2, 0)]


def test_another_os_error_is_not_taken_for_a_users_input(tmp_path, monkeypatch):
    rows = _rows(tmp_path)
    monkeypatch.setattr(store, "save_npy_atomic", lambda *_: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error")))
    with pytest.raises(OSError, match="I/O error"):
        pd.main(_args(rows, str(tmp_path / "out"), "--workers", "0"))


def test_an_unfinished_prepared_folder_given_as_input_is_refused_with_how_to_finish_it(tmp_path, monkeypatch, capsys):
    """Before: its chunk records were read as rows ("not valid JSON" / "expected ...", "--skip_bad_rows"), and that
    advice prepared them. Both entry points: prepare_data --input and train.py's --dataset_path (prepare_in_job)."""
    from data import prepare as in_job

    rows, out = str(tmp_path / "rows"), str(tmp_path / "prep")
    os.makedirs(rows)
    for k in range(2):  # a shard's share is whole files
        os.rename(_rows(tmp_path), os.path.join(rows, f"part{k}.jsonl"))
    pd.prepare([rows], out, vocab_size=100, eos_id=0, chunk_tokens=6, workers=0, shard=(0, 2), log=lambda *_: None)
    assert pd.main(_args(out, str(tmp_path / "again"), "--workers", "0")) == 2
    err = _one_line(capsys)
    assert f"--input {out}: a preparation not finished (no manifest.json: shard(s) [0] finished of 2)" in err, err
    assert "--shard i/N) again to resume them, then --merge" in err
    monkeypatch.setattr(in_job, "CACHE", str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=r"^--dataset_path .*: a preparation not finished"):
        in_job.prepare_in_job(out, None, 1000)
    pd.prepare([rows], out, vocab_size=100, eos_id=0, chunk_tokens=6, workers=0, shard=(1, 2), log=lambda *_: None)
    with pytest.raises(ValueError, match=r"shard\(s\) \[0, 1\] finished of 2\): --merge it \(python scripts/"):
        in_job.prepare_in_job(out, None, 1000)
    assert pd.main(["--output", out, "--merge"]) == 0 and in_job.prepare_in_job(out, None, 1000)[0] == out

    one = str(tmp_path / "one")  # one shard, preempted after its records, before its manifest
    pd.prepare([rows], one, vocab_size=100, eos_id=0, chunk_tokens=6, workers=0, log=lambda *_: None)
    os.remove(os.path.join(one, store.MANIFEST))
    with pytest.raises(ValueError, match=r"\(no manifest.json: stopped before its end\): run the same prepare_data"):
        in_job.prepare_in_job(one, None, 1000)
    output_lock.unfinished(str(tmp_path), "--input")  # a data folder: nothing said
    (tmp_path / "plan-s00000.json").write_text('{"text": "a row of a file of that name"}\n')
    output_lock.unfinished(str(tmp_path), "--input")


@pytest.mark.parametrize("argv, rank, tasks, expect", [
    ([], "5", "64", "no --shard in a SLURM step of 64 tasks"),  # srun -n 64 without --shard: 64 copies of 0/1
    ([], "0", "64", "no --shard"),
    (["--shard", "0/64"], "5", "64", "--shard 0/64 in task 5"),  # $SLURM_PROCID expanded by the batch shell
    (["--shard", "5/64"], "5", "64", (5, 64)),  # srun bash -c '... --shard $SLURM_PROCID/$SLURM_NTASKS'
    (["--shard=0/64"], "0", "64", (0, 64)),
    (["--shard", "0/1"], "0", "64", (0, 1)),  # all of it in one task, on purpose
    (["--shard", "13/128"], "5", "64", (13, 128)),  # another layout (an array job's offset): not refused
    ([], "0", "1", (0, 1)),  # srun -n 1
    ([], None, None, (0, 1)),  # no SLURM step
])
def test_srun_tasks_without_their_own_shard_are_refused(argv, rank, tasks, expect):
    env = {"SLURM_PROCID": rank, "SLURM_STEP_NUM_TASKS": tasks} if rank else {}
    value = next((a.split("=", 1)[1] if "=" in a else argv[k + 1] for k, a in enumerate(argv) if a.startswith("--sh")),
                 "0/1")
    if isinstance(expect, tuple):
        assert shard_of(value, argv, env) == expect
        return
    with pytest.raises(ValueError, match=expect) as e:
        shard_of(value, argv, env)
    assert "srun bash -c 'python scripts/prepare_data.py ... --shard $SLURM_PROCID/$SLURM_NTASKS'" in str(e.value)


def test_srun_without_shard_is_refused_by_the_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "4")
    monkeypatch.setenv("SLURM_PROCID", "2")
    assert pd.main(_args(_rows(tmp_path), str(tmp_path / "out"), "--workers", "0")) == 2
    assert "no --shard in a SLURM step of 4 tasks" in _one_line(capsys)
    assert not os.path.exists(tmp_path / "out")  # refused before anything is written
