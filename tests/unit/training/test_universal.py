"""Universal conversions as derived state of the converting run (issue 41 item 10): written under its own
OUTPUT_DIR/universal/<source's key>/, never beside the source (a read-only or another team's checkpoint converts; an
output dir the user cannot write is refused in one line); two jobs converting one checkpoint at once never delete each
other's files (a lock with a heartbeat, per-process folders renamed into place); a gone owner's lock is taken over;
rotation, the source run's or this run's, never removes a conversion in progress. And rank 0 resumes the checkpoint
LATEST names even when its own listing is stale (tests/stubs/stale_view), looking it up by name for up to settle_s."""

from __future__ import annotations

import builtins
import contextlib
import json
import multiprocessing
import os
import runpy
import shutil
import socket
import subprocess
import tempfile
import threading
import time

import pytest

from tests.unit.training.test_checkpoint import (
    MODEL_FILE,
    LoadEngine,
    _exit_code,
    fake_converter,
    model_bytes,
    save,
    save_from_world,
)
from training import universal, universal_lock
from training.checkpoint import Checkpointer, tag_for

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
NOBODY = 65534


@contextlib.contextmanager
def shared_tmp():
    """A folder every user may enter (pytest's tmp_path is root's alone, 0700)."""
    base = tempfile.mkdtemp(prefix="universal-", dir="/tmp")
    os.chmod(base, 0o755)
    try:
        yield base
    finally:
        for dp, dns, _ in os.walk(base):
            for d in dns:
                os.chmod(os.path.join(dp, d), 0o755)
        shutil.rmtree(base, ignore_errors=True)


@contextlib.contextmanager
def as_unprivileged_user():
    """File permissions checked as a user who owns nothing here. This machine runs the tests as root, whom no chmod
    stops: the process takes the effective uid/gid of `nobody` for the block (the real ids stay root's, so it can
    switch back); as any other user nothing changes."""
    if os.geteuid() != 0:
        yield
        return
    os.setegid(NOBODY)
    os.seteuid(NOBODY)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)


def read_only(path: str) -> None:
    for dp, dns, fns in os.walk(path):
        for f in fns:
            os.chmod(os.path.join(dp, f), 0o444)
        for d in dns:
            os.chmod(os.path.join(dp, d), 0o555)
    os.chmod(path, 0o555)


def tree(path: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(dp, n), path) for dp, dns, fns in os.walk(path) for n in dns + fns)


def test_a_read_only_source_converts_into_this_runs_output_dir(monkeypatch, capsys):
    """Another team's checkpoint, read-only to this user: the conversion lands in this run's OUTPUT_DIR/universal/
    <key>/ and loads (it used to be written beside the source: PermissionError, a traceback). An output dir this user
    cannot write: exit 2 with one line naming it, no traceback."""
    calls = fake_converter(monkeypatch)
    with shared_tmp() as base:
        source = save_from_world(Checkpointer(os.path.join(base, "theirs"), keep=3), 4, world=2)
        read_only(os.path.join(base, "theirs"))
        before = tree(os.path.join(base, "theirs"))
        mine, locked = os.path.join(base, "mine"), os.path.join(base, "locked")
        os.makedirs(mine)
        os.makedirs(locked, mode=0o555)
        os.chmod(locked, 0o555)
        if os.geteuid() == 0:
            os.chown(mine, NOBODY, NOBODY)
        engine = LoadEngine()
        with as_unprivileged_user():
            Checkpointer(mine, keep=3).load(engine, source)
            code = _exit_code(monkeypatch, lambda: Checkpointer(locked, keep=3).load(LoadEngine(), source))
        assert len(calls) == 1 and engine.loaded == [(True, model_bytes(source))]
        key = universal.source_id(source)
        assert universal.record(os.path.join(mine, "universal", key))["source"] == key
        assert tree(os.path.join(base, "theirs")) == before  # nothing written beside the source
        err = capsys.readouterr().err
        assert code == 2 and "Traceback" not in err, err
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert len(lines) == 1 and "cannot write" in lines[0] and f"{locked}/universal" in lines[0], lines


def _slow_converter(monkeypatch, log: str, hold_s: float, during=None):
    """ds_to_universal as it uses its output folder: fragments written into OUTPUT/tmp, read back `hold_s` later
    and merged (a fragment another job removed meanwhile fails it, as it fails the real one); `during` runs between
    (another job's commit and rotation); each start appended to `log`."""
    real_run = subprocess.run

    def run(cmd, *args, **kwargs):
        if "deepspeed.checkpoint.ds_to_universal" not in cmd:
            return real_run(cmd, *args, **kwargs)
        src, out = cmd[cmd.index("--input_folder") + 1], cmd[cmd.index("--output_folder") + 1]
        with open(log, "a") as fh:
            fh.write(f"{os.getpid()}\n")
        os.makedirs(os.path.join(out, "tmp"), exist_ok=True)
        shutil.copy2(os.path.join(src, MODEL_FILE), os.path.join(out, "tmp", "fragment"))
        if during is not None:
            during()
        time.sleep(hold_s)
        shutil.copy2(os.path.join(out, "tmp", "fragment"), os.path.join(out, MODEL_FILE))
        shutil.rmtree(os.path.join(out, "tmp"))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(subprocess, "run", run)


def _job(output_dir: str, source: str, delay_s: float, result: str) -> None:
    """One job's rank 0 resuming `source` at another world size (a forked process)."""
    time.sleep(delay_s)
    engine = LoadEngine()
    Checkpointer(output_dir, keep=3).load(engine, source)
    with open(result, "wb") as fh:
        fh.write(engine.loaded[0][1])


def test_two_jobs_converting_one_checkpoint_at_once(tmp_path, monkeypatch):
    """Two processes (two jobs of one output dir: a requeue whose earlier run still converts, a branch started
    twice) resume one checkpoint at another world size, the second 0.5 s after the first: the first converts, the
    second waits for its DONE; both load it. Without the lock the second emptied the first's folder mid-conversion
    and one of them failed."""
    log = str(tmp_path / "starts")
    _slow_converter(monkeypatch, log, hold_s=1.5)
    monkeypatch.setattr(universal, "WAIT_EVERY_S", 0.1, raising=False)
    source = save_from_world(Checkpointer(str(tmp_path / "src"), keep=3), 4, world=2)
    out = str(tmp_path / "run")
    fork = multiprocessing.get_context("fork")
    jobs = [fork.Process(target=_job, args=(out, source, 0.5 * i, str(tmp_path / f"loaded{i}"))) for i in range(2)]
    for j in jobs:
        j.start()
    for j in jobs:
        j.join(60)
    assert [j.exitcode for j in jobs] == [0, 0]
    for i in range(2):
        assert (tmp_path / f"loaded{i}").read_bytes() == model_bytes(source)
    assert len(open(log).read().split()) == 1  # converted once: the other job waited for it
    home = os.path.join(out, "universal")
    key = universal.source_id(source)
    assert sorted(os.listdir(home)) == sorted([key, universal.RATE])  # no lock, no partial folder left
    done = universal.record(os.path.join(home, key))
    assert done["files"] == {MODEL_FILE: len(model_bytes(source))}


def test_a_conversion_in_progress_survives_rotation(tmp_path, monkeypatch):
    """While run B converts run A's step 4, A commits a save (its rotation used to drop universal/step_4, which had
    no DONE yet: the conversion failed) and another job of B commits one (B's rotation leaves a locked conversion
    alone). Once finished, B's next commit drops the conversion of a source that is not one of B's checkpoints."""
    ck_a, ck_b = Checkpointer(str(tmp_path / "a"), keep=3), Checkpointer(str(tmp_path / "b"), keep=1)
    source = save_from_world(ck_a, 4, world=2)
    save(ck_b, 1)

    def commits():
        save(ck_a, 6)  # the source run goes on: its rotation runs
        save(ck_b, 2)  # a job of this run commits: its rotation runs

    _slow_converter(monkeypatch, str(tmp_path / "starts"), hold_s=0.2, during=commits)
    engine = LoadEngine()
    ck_b.load(engine, source)
    assert engine.loaded == [(True, model_bytes(source))]
    home, key = str(tmp_path / "b" / "universal"), universal.source_id(source)
    assert universal.record(os.path.join(home, key))["source"] == key
    assert not (tmp_path / "a" / "checkpoints" / "universal").exists()
    save(ck_b, 3)
    assert key not in os.listdir(home)  # bounded: not a source of any checkpoint B keeps


@pytest.mark.parametrize("owner, age_s, env", [
    ({"host": socket.gethostname(), "pid": "dead"}, 0, {}),  # its process on this host has exited
    ({"host": "node-9", "pid": 4242}, universal_lock.STALE_S + 60, {}),  # its heartbeat stopped
    ({"host": "node-9", "pid": 4242, "job": "77", "restart": 0}, 0, {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "1"}),
], ids=["process_exited", "heartbeat_stale", "earlier_run_of_this_job"])
def test_a_gone_owners_lock_is_taken_over(tmp_path, monkeypatch, capsys, owner, age_s, env):
    """A job killed mid-conversion leaves its lock and partial folder: the next converter takes the lock over and
    removes that folder (no one else's), then converts."""
    calls = fake_converter(monkeypatch)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    if owner["pid"] == "dead":
        p = subprocess.Popen(["true"])
        p.wait()
        owner = {**owner, "pid": p.pid}
    source = save_from_world(Checkpointer(str(tmp_path / "src"), keep=3), 4, world=2)
    out = universal.folder(source, str(tmp_path / "run"))
    os.makedirs(out + ".lock")
    (tmp_path / "owner").write_text(json.dumps(owner))
    shutil.move(str(tmp_path / "owner"), os.path.join(out + ".lock", universal_lock.OWNER))
    partial = f"{out}.tmp.{owner['host']}.{owner['pid']}"
    other = f"{out}.tmp.node-3.17"  # a live converter's folder: not the gone owner's
    for d in (partial, other):
        os.makedirs(os.path.join(d, tag_for(4)))
    old = time.time() - age_s
    os.utime(out + ".lock", (old, old))
    got = universal.prepare(source, 2, 1, str(tmp_path / "run"))
    assert got["dir"] == out and len(calls) == 1
    assert "taking over the universal conversion lock" in capsys.readouterr().out
    assert not os.path.exists(partial) and os.path.isdir(other) and not os.path.exists(out + ".lock")


def _lock_of(out: str, owner: dict, age_s: float) -> str:
    os.makedirs(out + ".lock")
    with open(os.path.join(out + ".lock", universal_lock.OWNER), "w") as fh:
        json.dump(owner, fh)
    old = time.time() - age_s
    os.utime(out + ".lock", (old, old))
    return out + ".lock"


def test_a_lock_of_another_job_that_slurm_says_ended_is_taken_over_in_a_minute(tmp_path, monkeypatch, capsys):
    """A conversion killed with its job, then a NEW sbatch (another job id, other hosts): its lock was waited on for
    STALE_S (10 min of the whole allocation idle); now taken over once its heartbeat is late and scontrol says the job
    ended. A live, suspended, unknown (no scontrol) or other cluster's job, or a fresh heartbeat, is waited for."""
    asked: list[str] = []
    states = {"81": "CANCELLED", "82": "PENDING", "83": "RUNNING", "84": "SUSPENDED", "85": None, "86": "GONE"}
    monkeypatch.setattr(universal_lock, "job_state", lambda job: asked.append(job) or states[job])
    monkeypatch.setattr(universal_lock, "_ASKED", {})
    monkeypatch.setenv("SLURM_JOB_ID", "99")
    monkeypatch.setenv("SLURM_CLUSTER_NAME", "c1")
    late = universal_lock.JOB_LATE_S + 30
    for job, ended in (("81", True), ("82", True), ("83", False), ("84", False), ("85", False), ("86", True)):
        lock = _lock_of(str(tmp_path / f"k{job}"), {"host": "node-9", "pid": 4242, "job": job, "restart": 0}, late)
        why = universal_lock.gone(lock)
        assert (why is not None) == ended and (not ended or f"its job {job} is {states[job]}" in why), (job, why)
    assert asked == ["81", "82", "83", "84", "85", "86"]
    universal_lock.gone(str(tmp_path / "k83.lock"))
    assert asked[-1] == "86"  # asked again only JOB_ASK_S later (a wait looks every WAIT_EVERY_S)
    lock = _lock_of(str(tmp_path / "fresh"), {"host": "node-9", "pid": 1, "job": "81"}, universal_lock.HEARTBEAT_S / 2)
    assert universal_lock.gone(lock) is None  # its heartbeat is on time: a live owner, Slurm not asked
    lock = _lock_of(str(tmp_path / "other"), {"host": "node-9", "pid": 1, "job": "87", "cluster": "c2"}, late)
    assert universal_lock.gone(lock) is None and "87" not in asked  # another cluster's job id: not this cluster's to say
    source = save_from_world(Checkpointer(str(tmp_path / "src"), keep=3), 4, world=2)  # the whole path: converted
    calls = fake_converter(monkeypatch)
    out = universal.folder(source, str(tmp_path / "run"))
    _lock_of(out, {"host": "node-9", "pid": 4242, "job": "81", "restart": 0, "cluster": "c1"}, late)
    assert universal.prepare(source, 2, 1, str(tmp_path / "run"))["dir"] == out and len(calls) == 1
    assert "its job 81 is CANCELLED (scontrol)" in capsys.readouterr().out


def test_a_converter_in_another_pid_namespace_is_judged_by_its_heartbeat(tmp_path):
    """A converter in a container on this host name (Docker --network=host: another pid namespace, its pid missing here
    or another process) was taken over as "its process on this host has exited" while it converted; its heartbeat
    decides now. In our namespace, or an OWNER from before they were recorded: its pid, as before."""
    from base.run_lock import boot_id, pid_namespace

    dead = subprocess.Popen(["true"])
    dead.wait()
    other = {"host": socket.gethostname(), "pid": dead.pid, "pidns": "pid:[4026532999]", "boot": boot_id()}
    assert universal_lock.gone(_lock_of(str(tmp_path / "a"), other, 1.0)) is None
    assert "heartbeat" in universal_lock.gone(_lock_of(str(tmp_path / "b"), other, universal_lock.STALE_S + 60))
    for i, owner in enumerate(({**other, "pidns": pid_namespace()}, {"host": other["host"], "pid": dead.pid})):
        assert "has exited" in universal_lock.gone(_lock_of(str(tmp_path / f"c{i}"), owner, 1.0))


def test_a_live_owners_lock_is_waited_for(tmp_path, monkeypatch):
    """A lock whose owner (another node) beats: never taken over; its conversion, once renamed into place, is loaded
    without converting again."""
    calls = fake_converter(monkeypatch)
    monkeypatch.setattr(universal, "WAIT_EVERY_S", 0.1, raising=False)
    source = save_from_world(Checkpointer(str(tmp_path / "src"), keep=3), 4, world=2)
    out = universal.folder(source, str(tmp_path / "run"))
    os.makedirs(out + ".lock")
    with open(os.path.join(out + ".lock", universal_lock.OWNER), "w") as fh:
        json.dump({"host": "node-9", "pid": 4242, "job": "5", "restart": 0}, fh)

    def finish():  # the other node's converter completes: its folder renamed into place, its lock released
        theirs = f"{out}.tmp.node-9.4242"
        os.makedirs(os.path.join(theirs, tag_for(4)))
        shutil.copy2(os.path.join(source, MODEL_FILE), os.path.join(theirs, tag_for(4), MODEL_FILE))
        with open(os.path.join(theirs, universal.DONE), "w") as fh:
            json.dump({"source": universal.source_id(source), "files": {MODEL_FILE: 4096}}, fh)
        os.rename(theirs, out)
        shutil.rmtree(out + ".lock")

    t = threading.Timer(1.0, finish)
    t.start()
    got = universal.prepare(source, 2, 1, str(tmp_path / "run"))
    t.join()
    assert got == {"dir": out, "files": {MODEL_FILE: 4096}} and calls == []


# --- rank 0's view of a just-committed checkpoint (tests/stubs/stale_view) ---


def stale_view(monkeypatch, **regexes: str) -> None:
    """This process becomes the stale-view rank of tests/stubs/stale_view for the rest of the test (its patches of
    os and open are undone with monkeypatch's): the stub a multi-process test puts on PYTHONPATH, run in-process."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("STALE_VIEW_RANK", "0")
    for k, v in regexes.items():
        monkeypatch.setenv(f"STALE_VIEW_{k}", v)
    for mod, name in ((os, "listdir"), (os, "stat"), (builtins, "open"), (os.path, "exists"), (os.path, "isfile"),
                      (os.path, "isdir")):
        monkeypatch.setattr(mod, name, getattr(mod, name))  # recorded: restored at teardown
    runpy.run_path(os.path.join(ROOT, "tests", "stubs", "stale_view", "sitecustomize.py"))


def test_rank0_resumes_the_checkpoint_latest_names_though_its_view_is_stale(tmp_path, monkeypatch, capsys):
    """The job before committed step 4 on another node; this node's listing of checkpoints/ is older (no step_4) and
    its cached negative lookup hides step_4's manifest for 2 s more. Rank 0 reads LATEST, looks step_4 up by name
    until it appears and resumes it (it used to resume step 2 without a word)."""
    ck = Checkpointer(str(tmp_path), keep=3, settle_s=20)
    save(ck, 2)
    newest = save(ck, 4)
    stale_view(monkeypatch, UNLISTED=r"checkpoints/step_000004$", LATE=r"checkpoints/step_000004/MANIFEST\.json$",
               LATE_S="2")
    t0 = time.monotonic()
    assert ck.find_resume("auto") == newest
    assert 1.5 < time.monotonic() - t0 < 15
    assert "became visible here after" in capsys.readouterr().out


def test_rank0_falls_back_with_a_warning_when_latest_stays_unseen(tmp_path, monkeypatch, capsys):
    """LATEST names step 4, whose manifest this node never sees within settle_s: one warning line naming it, then
    the newest checkpoint it can verify."""
    ck = Checkpointer(str(tmp_path), keep=3, settle_s=1)
    older = save(ck, 2)
    save(ck, 4)
    stale_view(monkeypatch, UNLISTED=r"checkpoints/step_000004$", MISSING=r"checkpoints/step_000004/MANIFEST\.json$")
    assert ck.find_resume("auto") == older
    warned = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("warning")]
    assert len(warned) == 1 and "LATEST names step_000004" in warned[0], warned


def test_the_conversion_is_never_judged_a_hang_and_the_load_is(tmp_path, monkeypatch):
    """A resume on another world size: rank 0 converts for up to ~45 min at 8B while the others wait, with no tick.
    The restore phase (judged at RESTORE_S, base/progress.py) is left for the conversion (`build`, never judged)
    and taken again for the shards' reads: judged through it, a requeue on fewer nodes was declared hung at 1500 s
    and requeued again, forever (the review of the restore phase)."""
    from base import progress

    marks = []
    monkeypatch.setattr(progress, "mark", lambda step, phase: marks.append(phase))
    calls = fake_converter(monkeypatch)
    source = save_from_world(Checkpointer(str(tmp_path / "theirs"), keep=3), 4, world=2)
    real = universal.prepare
    monkeypatch.setattr(universal, "prepare", lambda *a, **k: (marks.append("converting"), real(*a, **k))[1])
    Checkpointer(str(tmp_path / "mine"), keep=3).load(LoadEngine(), source)
    assert len(calls) == 1 and marks == ["build", "converting", "restore"], marks


@pytest.mark.parametrize("cpus, free_gb, want", [(192, 2000, (8, 4)), (2, 24, (2, 1)), (64, 10, (2, 4)),
                                                 (64, 4, (1, 4))])
def test_the_converters_workers_are_sized_for_the_node(tmp_path, monkeypatch, cpus, free_gb, want):
    """ds_to_universal ran with 2 extract workers and 1 merge worker (DeepSpeed's serial "unit testing" pass) on any
    node: at 64 ranks every GPU waited 30-45 min while rank 0 merged Llama-3-8B's parameters one at a time. Now half
    the node's CPUs (<= 8) extract, each within half the free host memory for twice one rank's optimizer file (1 GiB
    here), and a CPU in 16 (<= 4) merge."""
    import base.host

    ckpt = tmp_path / "step_000010"
    ckpt.mkdir()
    with open(ckpt / "zero_pp_rank_0_mp_rank_00_optim_states.pt", "wb") as fh:
        fh.truncate(1 << 30)  # sparse: its size is what counts
    monkeypatch.setattr(base.host, "usable_cpus", lambda: list(range(cpus)))
    monkeypatch.setattr(base.host, "job_memory_available", lambda: free_gb << 30)
    seen = []

    def run(cmd, *args, **kwargs):
        seen.append((int(cmd[cmd.index("--num_extract_workers") + 1]), int(cmd[cmd.index("--num_merge_workers") + 1])))
        raise subprocess.CalledProcessError(1, cmd)

    monkeypatch.setattr(subprocess, "run", run)
    with pytest.raises(subprocess.CalledProcessError):
        universal.convert(str(ckpt), str(tmp_path / "out"), None, 1 << 30)
    assert seen == [want]


BUSY_CONVERTER = """import os, sys, time
open(os.environ["CONVERTER_PID"], "w").write(str(os.getpid()))
while time.process_time() < 0.5:  # half a second of running: a frozen second is not one
    pass
out = sys.argv[sys.argv.index("--output_folder") + 1]
os.makedirs(out)
open(os.path.join(out, "mp_rank_00_model_states.pt"), "w").write("converted")
"""


def test_a_suspend_during_a_conversion_is_left_out_of_its_recorded_time(tmp_path, monkeypatch):
    """The job frozen (scontrol suspend, PreemptMode=SUSPEND: SIGSTOP to the rank and its converter) during a
    conversion: RATE.json recorded the frozen time as converting time (time.time() - t0), so the next allocation's
    estimate took a 2 h suspend for 2 h of conversion and could refuse the job (exit 2, "more than this job's whole
    allocation"). The recorded seconds are now the running ones (base/stopped.py; its thresholds scaled down here)."""
    from base import stopped

    (tmp_path / "busy_converter.py").write_text(BUSY_CONVERTER)
    monkeypatch.setattr(universal, "CONVERTER", "busy_converter")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), ROOT]))
    pid = tmp_path / "converter.pid"
    monkeypatch.setenv("CONVERTER_PID", str(pid))
    monkeypatch.setattr(stopped, "LATE_S", 0.5)
    own = stopped.COUNTER  # this worker's own counter, whose thread (if a test started it) sees the stop too: its
    kept = (own.total_s, list(own.stops))  # count is put back after, else later tests' times lose ~1.5 s
    counter = stopped.StopCounter(tick_s=0.1)
    monkeypatch.setattr(stopped, "COUNTER", counter)
    (tmp_path / "step_000010").mkdir()
    (tmp_path / "universal").mkdir()
    # the freezer, outside this process: the rank and its converter stopped 1.5 s, mid-conversion
    freezer = subprocess.Popen(["bash", "-c", f'until [ -s {pid} ]; do sleep 0.05; done; sleep 0.2; c=$(cat {pid}); '
                                f'kill -STOP {os.getpid()} "$c"; sleep 1.5; kill -CONT {os.getpid()} "$c"'],
                               start_new_session=True)
    try:
        t0 = time.monotonic()
        done = universal.convert(str(tmp_path / "step_000010"), str(tmp_path / "universal" / "k"), "k", 10**9)
        wall = time.monotonic() - t0
    finally:
        freezer.wait(timeout=30)
        counter.tick_s = 3600.0  # its thread sleeps from now on
        with own._lock:
            own.total_s, own.stops = kept[0], type(own.stops)(kept[1], maxlen=own.stops.maxlen)
            own._last, own._last_cpu = own.clock(), own.cpu()
    rate = json.loads((tmp_path / "universal" / universal.RATE).read_text())
    assert wall > 1.9 and rate["finished"] and done["source"] == "k", (wall, rate)
    assert rate["seconds"] < wall - 1.0 and done["seconds"] < wall - 1.0, (wall, rate, done)  # ~1 s of ~2.5
