"""base/run_lock.py: one output folder, one live run. A live owner (this host: its pid alive with the same start
time; another host: its job RUNNING, or a fresh heartbeat where no job state can be read) refuses a second run in
one line; a dead one (pid gone or reused, job ended or unknown to Slurm, heartbeat stale, the same job's earlier
run) is taken over."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from base import run_lock
from base.run_lock import LOCK, STALE_S, acquire, release, verdict

MINE = {"host": "gpu001", "pid": 4242, "start": "100", "job": "900", "restart": "0", "step": "0", "since": "now"}


@pytest.mark.parametrize("lock, age, alive, state, live", [
    ({"host": "gpu001", "pid": 7, "start": "5", "job": ""}, 1.0, True, None, True),  # this host, alive
    ({"host": "gpu001", "pid": 7, "start": "5", "job": ""}, 1.0, False, None, False),  # this host, pid gone/reused
    ({"host": "gpu002", "pid": 7, "job": "800"}, 9999.0, True, "RUNNING", True),  # another host, job running
    ({"host": "gpu002", "pid": 7, "job": "800"}, 1.0, True, "CANCELLED", False),  # ... job ended
    ({"host": "gpu002", "pid": 7, "job": "800"}, 1.0, True, "GONE", False),  # ... unknown to slurmctld
    ({"host": "gpu002", "pid": 7, "job": "800"}, 1.0, True, None, True),  # no scontrol: a fresh heartbeat
    ({"host": "gpu002", "pid": 7, "job": ""}, STALE_S + 1, True, None, False),  # no job, a stale heartbeat
    ({"host": "gpu002", "pid": 7, "job": "900"}, 1.0, True, "RUNNING", False),  # this job's earlier run (requeue)
    ({"host": "gpu002", "pid": 7, "job": "900", "restart": "0", "step": "1"}, 1.0, True, "RUNNING", True),  # another
    # step of this same run, running now on another host (two srun steps of one allocation): its fresh heartbeat
    ({"host": "gpu002", "pid": 7, "job": "900", "restart": "0", "step": "1"}, STALE_S + 1, True, "RUNNING", False),
    # another task of this very step (`srun -N2 scripts/launch.sh` without --no_ssh: two one-node worlds, one folder):
    # was taken over as "an earlier run of this job"; judged by its heartbeat, or its pid on this host
    ({"host": "gpu002", "pid": 7, "job": "900", "restart": "0", "step": "0"}, 1.0, True, "RUNNING", True),
    ({"host": "gpu002", "pid": 7, "job": "900", "restart": "0", "step": "0"}, STALE_S + 1, True, "RUNNING", False),
    ({"host": "gpu001", "pid": 7, "job": "900", "restart": "0", "step": "0"}, 1.0, True, "RUNNING", True),
    ({"host": "gpu001", "pid": 7, "job": "900", "restart": "0", "step": "0"}, 1.0, False, "RUNNING", False),
    # a run of another cluster sharing the file system: this cluster's scontrol knows its job id not (GONE) or as
    # another job of the same id; it was taken over. Judged by its heartbeat alone
    ({"host": "b03", "pid": 7, "job": "800", "cluster": "b"}, 1.0, True, "GONE", True),
    ({"host": "b03", "pid": 7, "job": "900", "restart": "1", "cluster": "b"}, 1.0, True, "RUNNING", True),
    ({"host": "b03", "pid": 7, "job": "800", "cluster": "b"}, STALE_S + 1, True, "RUNNING", False),
])
def test_the_owner_is_alive_or_dead_as_its_host_job_or_heartbeat_says(lock, age, alive, state, live):
    assert verdict(lock, MINE, age, alive=lambda pid, start: alive, state=lambda job: state)[0] is live


def test_a_second_run_is_refused_in_one_line_and_the_first_releases(tmp_path):
    sleeper = subprocess.Popen(["sleep", "60"])  # a live "first run" on this host
    try:
        owner = {**run_lock.me(), "pid": sleeper.pid, "start": run_lock._start_time(sleeper.pid), "job": "1"}
        (tmp_path / LOCK).write_text(json.dumps(owner))
        with pytest.raises(ValueError, match=rf"output folder {tmp_path} is held by a live run: host \S+ pid "
                                             rf"{sleeper.pid}, job 1, since .*its process is alive on this host") as e:
            acquire(str(tmp_path), {**run_lock.me(), "job": "2"})
        assert "\n" not in str(e.value)
    finally:
        sleeper.kill()
        sleeper.wait()
    line = acquire(str(tmp_path), {**run_lock.me(), "job": "2"})  # its owner is gone now: taken over
    assert "taken over" in line and "its process is gone" in line
    assert json.loads((tmp_path / LOCK).read_text())["pid"] == os.getpid()
    release()
    assert not (tmp_path / LOCK).exists() and sorted(os.listdir(tmp_path)) == []


def test_a_predecessor_still_ending_is_waited_for_not_taken_as_live(tmp_path, monkeypatch):
    """A job chained after another (--dependency=singleton, afterany) starts while its predecessor, killed at its time
    limit, is COMPLETING (its processes being killed, its epilog running) and left its lock: it was read as live and
    refused (exit 2, the chain broken). Its end is waited out: taken over once ended; refused while still ending."""
    monkeypatch.setattr(run_lock, "ENDING_EVERY_S", 0.0)
    other = {"host": "elsewhere", "pid": 1, "job": "800", "since": "then"}
    seen = []

    def ending(n):
        return lambda job: seen.append(job) or ("COMPLETING" if len(seen) <= n else "TIMEOUT")

    (tmp_path / LOCK).write_text(json.dumps(other))
    assert "its job 800 is TIMEOUT" in acquire(str(tmp_path), {**run_lock.me(), "job": "900"}, state=ending(3))
    assert seen == ["800"] * 4
    release()
    (tmp_path / LOCK).write_text(json.dumps(other))
    monkeypatch.setattr(run_lock, "ENDING_WAIT_S", 0.05)
    with pytest.raises(ValueError, match="held by a live run: host elsewhere pid 1, job 800, .*its job 800 is COMPLETING"):
        acquire(str(tmp_path), {**run_lock.me(), "job": "900"}, state=lambda job: "COMPLETING")


def test_a_jobs_state_is_its_own_records_not_a_siblings(monkeypatch):
    """The lock of an array's last task names the array's id (its SLURM_JOB_ID), for which `scontrol show job` lists
    every task left: the first record's state (a sibling pending or running) was taken for it, live, when it had timed
    out or was purged. Its own record's state; none of its own: GONE."""
    shown = ("JobId=4250 ArrayJobId=4242 ArrayTaskId=5 JobName=x\n   UserId=u JobState=PENDING Reason=None\n\n"
             "JobId=4251 ArrayJobId=4242 ArrayTaskId=6 JobName=x\n   JobState=RUNNING Reason=None\n")
    said = {"out": shown}
    monkeypatch.setattr(run_lock.subprocess, "run",
                        lambda *a, **k: subprocess.CompletedProcess(a, 0, stdout=said["out"], stderr=""))
    assert run_lock.job_state("4242") == "GONE" and run_lock.job_state("4251") == "RUNNING"
    said["out"] = shown + "\nJobId=4242 ArrayJobId=4242 ArrayTaskId=3 JobName=x\n   JobState=TIMEOUT Reason=None\n"
    assert run_lock.job_state("4242") == "TIMEOUT"


def test_a_stale_heartbeat_from_another_host_is_taken_over(tmp_path):
    (tmp_path / LOCK).write_text(json.dumps({"host": "elsewhere", "pid": 1, "job": "", "since": "then"}))
    old = os.stat(tmp_path / LOCK).st_mtime - STALE_S - 60
    os.utime(tmp_path / LOCK, (old, old))
    assert "heartbeat is" in acquire(str(tmp_path), run_lock.me())
    release()
    (tmp_path / LOCK).write_text(json.dumps({"host": "elsewhere", "pid": 1, "job": "", "since": "then"}))
    with pytest.raises(ValueError, match="held by a live run: host elsewhere pid 1, since then"):
        acquire(str(tmp_path), run_lock.me())  # fresh: refused


def test_an_output_dir_that_cannot_be_written_is_refused_in_one_line(tmp_path, monkeypatch):
    """A read-only --output_dir (or one under a file) ended in os.makedirs' traceback; now one line naming it."""
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"--output_dir .*file/run: cannot write there \(Not a directory\)") as e:
        acquire(str(tmp_path / "file" / "run"), run_lock.me())
    assert "\n" not in str(e.value)
    # a node's mount failing (ESTALE, EIO) is no user error: raised as it is, a crash of that node (requeued without
    # it), never exit 2 ending the job chain (the second review)
    import errno

    def stale(*a, **k):
        raise OSError(errno.ESTALE, "Stale file handle")

    with monkeypatch.context() as m:
        m.setattr(os, "makedirs", stale)
        with pytest.raises(OSError, match="Stale file handle"):
            acquire(str(tmp_path / "nfs"), run_lock.me())
    if os.geteuid() == 0:  # root writes through a mode of 0500
        return
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    try:
        for folder in (ro, ro / "run"):  # the lock's temp file, the folder itself
            with pytest.raises(ValueError, match=r"cannot write there \(Permission denied\)"):
                acquire(str(folder), run_lock.me())
    finally:
        ro.chmod(0o700)


def test_a_copied_folders_lock_is_taken_over_and_the_originals_kept(tmp_path):
    """`cp -a runL runL2` while runL's run is live copies its RUN_LOCK: runL2 was refused as "held by a live run ...
    stop that run", though that run writes runL. The lock records its folder (real path, st_dev, st_ino); a copy's is
    taken over with one note, the original (and the same folder under another path) still refused."""
    import shutil

    sleeper = subprocess.Popen(["sleep", "60"])  # runL's live run, on this host
    try:
        run = tmp_path / "runL"
        run.mkdir()
        owner = {**run_lock.me(), "pid": sleeper.pid, "start": run_lock._start_time(sleeper.pid), "token": "t1",
                 **run_lock.folder_identity(str(run))}
        (run / LOCK).write_text(json.dumps(owner))
        shutil.copytree(run, tmp_path / "runL2")
        line = acquire(str(tmp_path / "runL2"), run_lock.me())
        assert "\n" not in line and f"taken over: {owner['host']} pid {sleeper.pid}, a copy of {run}'s lock" in line
        lock = json.loads((tmp_path / "runL2" / LOCK).read_text())
        assert lock["pid"] == os.getpid() and lock["folder"] == str(tmp_path / "runL2")
        assert lock["ino"] == os.stat(tmp_path / "runL2").st_ino
        release()
        (tmp_path / "via").symlink_to(run)  # runL itself under another path: its live run's
        for path in (run, tmp_path / "via"):
            with pytest.raises(ValueError, match="held by a live run.*its process is alive on this host"):
                acquire(str(path), run_lock.me())
        # another host's lock: a copy only where the recorded folder is seen here holding the same lock
        other = {**owner, "host": "elsewhere", "job": ""}
        (run / LOCK).write_text(json.dumps(other))
        (tmp_path / "runL2" / LOCK).write_text(json.dumps(other))
        assert "a copy of" in acquire(str(tmp_path / "runL2"), run_lock.me())
        release()
        for where in (str(tmp_path / "not_mounted_here" / "runL"),  # its path on that node is not seen here
                      str(tmp_path / "via")):  # this very folder through another mount path
            (run / LOCK).write_text(json.dumps({**other, "folder": where}))
            with pytest.raises(ValueError, match="held by a live run: host elsewhere"):
                acquire(str(run), run_lock.me())
    finally:
        sleeper.kill()
        sleeper.wait()


OTHER_NS = {"pidns": "pid:[4026532999]", "boot": "b0"}  # another container's pid namespace on this host name


@pytest.mark.parametrize("lock, age, live", [
    # Docker --network=host, a hostNetwork pod: the host name is the node's, the pid another namespace's (pid 1 there
    # is missing here, or another process): judged by its heartbeat, never by its pid
    ({"host": "gpu001", "pid": 1, "job": "", **OTHER_NS}, 1.0, True),
    ({"host": "gpu001", "pid": 1, "job": "", **OTHER_NS}, STALE_S + 1, False),
    ({"host": "gpu001", "pid": 4242, "job": "", **OTHER_NS}, 1.0, True),  # our own pid number, another process
    ({"host": "gpu001", "pid": 7, "job": "", "pidns": "pid:[1]", "boot": "b1"}, 1.0, True),  # another boot (a VM's
    # kernel of its own, or this host rebooted within STALE_S): its heartbeat decides too
    ({"host": "gpu001", "pid": 7, "job": "", "pidns": "pid:[1]", "boot": "b0"}, 1.0, False),  # ours: its pid, gone
    ({"host": "gpu001", "pid": 7, "job": ""}, 1.0, False),  # a lock from before they were recorded: its pid, as before
])
def test_a_lock_from_another_pid_namespace_is_judged_by_its_heartbeat(lock, age, live):
    mine = {**MINE, "pidns": "pid:[1]", "boot": "b0"}
    assert verdict(lock, mine, age, alive=lambda pid, start: False, state=lambda job: None)[0] is live


def test_a_live_containers_lock_is_not_taken_over_from_another_namespace(tmp_path):
    """`unshare -p -f --mount-proc python lockA.py DIR` (a container on this host name), then a second acquire: taken
    over as "vm pid 1, its process is gone" while that run was live. Its lock, written there, names a pid namespace
    not ours and a pid that does not exist here: refused while its heartbeat is fresh."""
    pid = 4_194_000  # above every pid_max default (4194304 is the most Linux allows): no process here
    while run_lock._start_time(pid) is not None:
        pid -= 1
    owner = {**run_lock.me(), "pid": pid, "start": "5", "pidns": "pid:[4026532999]", "token": "t"}
    (tmp_path / LOCK).write_text(json.dumps(owner))
    with pytest.raises(ValueError, match=rf"held by a live run: host \S+ pid {pid}, since .*its heartbeat is \d+ s "
                                         r"old \(at most 300 s for a live run in another pid namespace"):
        acquire(str(tmp_path), run_lock.me())
    old = os.stat(tmp_path / LOCK).st_mtime - STALE_S - 60  # its container died: the heartbeat stops
    os.utime(tmp_path / LOCK, (old, old))
    assert "its heartbeat is" in acquire(str(tmp_path), run_lock.me())
    lock = json.loads((tmp_path / LOCK).read_text())
    assert lock["pidns"] == run_lock.pid_namespace() and lock["boot"] == run_lock.boot_id()
    release()


def test_a_run_in_a_new_pid_namespace_keeps_its_lock(tmp_path):
    """The same, for real where this user may create a pid namespace (`unshare -p -f --mount-proc`; skipped
    elsewhere): the first run is pid 1 in its namespace, and a second run here is refused."""
    import shutil
    import sys

    unshare = ["unshare", "-p", "-f", "--mount-proc", "--kill-child"]  # its namespace ends with it
    if not shutil.which("unshare") or subprocess.run([*unshare, "true"], capture_output=True).returncode:
        pytest.skip("unshare -p (a new pid namespace) is not permitted here")
    code = f"import time; from base.run_lock import acquire; print(acquire({str(tmp_path)!r}), flush=True); time.sleep(60)"
    first = subprocess.Popen([*unshare, sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                             cwd=os.path.dirname(os.path.dirname(os.path.abspath(run_lock.__file__))))
    try:
        assert "held by" in first.stdout.readline() and json.loads((tmp_path / LOCK).read_text())["pid"] == 1
        with pytest.raises(ValueError, match="held by a live run: host .* pid 1, .*another pid namespace"):
            acquire(str(tmp_path), run_lock.me())
    finally:
        first.kill()
        first.wait()
