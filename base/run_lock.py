"""One output folder, one live run: OUTPUT_DIR/RUN_LOCK names the run that writes there (host, pid, the process'
start time, the SLURM job and restart), and a second run that finds it held by a live run is refused in one line
(exit 2), whatever launched either of them (two sbatch jobs, an srun and a deepspeed launch, a forgotten run in a
terminal). Without it two runs resume from the same checkpoint and overwrite each other's checkpoints and metrics.

Rank 0 decides (base.comm.run_on_main: every rank raises the same line) right after the process group exists,
before anything is written in the folder; rank 0 keeps the lock fresh (its mtime, every HEARTBEAT_S, from a daemon
thread) and removes it when the run ends (training/job.py). A lock whose owner is dead is taken over:
- the same SLURM job: an earlier run of this job (another restart: a requeue; Slurm never runs two of one job at
  once); the same restart (two `srun` steps of one allocation, two tasks of one step) is judged as below;
- on this host, in this pid namespace and boot (its `pidns`, /proc/self/ns/pid, and `boot`,
  /proc/sys/kernel/random/boot_id, equal ours): its pid is gone, or is another process now (the start time in /proc
  differs);
- on this host name in another pid namespace or boot (Docker --network=host, a Kubernetes hostNetwork pod, a
  restarted container: the host name is the node's, the pid another namespace's, where it is missing or another
  process): judged as on another host below, never by its pid (a live run's lock was taken over as "pid 1, its process
  is gone"). Its cost: a container restarted outside Slurm within STALE_S of its run's death is refused until then
  (or until RUN_LOCK is removed, as the line says). A lock written before these were recorded has neither: judged by
  its pid as before;
- on another host: its job's state (`scontrol show job`) is not a live one (RUNNING, SUSPENDED, COMPLETING, ...;
  an unknown job id is gone); where no job or no scontrol says, its heartbeat is older than STALE_S. The age is
  read on the file server's clock (the lock's mtime against a probe file touched now), never this host's.
The lock records the folder it was taken for (real path, st_dev, st_ino): a copy's (`cp -a runL runL2` while runL's
run is live copies its RUN_LOCK) is taken over with a note where copied_from proves it names another folder; the same
folder under another path (another node's mount point) never is.
Cost: one small file, one `scontrol` call at most at start (only for a lock from another host), one utime a minute;
a lock naming another folder: one read of that folder's lock and a probe file.
Two runs that start within the same second on a stale lock can both take it (the replace is not atomic with the
check); every other case is decided by an atomic link.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import socket
import subprocess
import threading
import time

LOCK = "RUN_LOCK"
HEARTBEAT_S = 60.0
STALE_S = 300.0  # a lock from another host with no job state to read: dead when its heartbeat is this old (5 beats)
LIVE_STATES = {"RUNNING", "SUSPENDED", "COMPLETING", "CONFIGURING", "STAGE_OUT", "SIGNALING", "RESIZING", "STOPPED"}
# an ended job's flags over its base state while its processes are killed and its epilog runs (base/slurm_state.py):
# a job chained after it (--dependency=singleton, afterany) starts then, and read the owner of a lock its predecessor
# left (killed at its time limit) as live: refused, exit 2, the chain broken. Waited out first, up to ENDING_WAIT_S
# (KillWait up to 120 s, then the epilog), an scontrol call every ENDING_EVERY_S; still ending then: live
ENDING, ENDING_WAIT_S, ENDING_EVERY_S = {"COMPLETING", "STAGE_OUT"}, 300.0, 5.0
_HELD: list = []  # [path, token, stop event] of the lock this process holds


def _start_time(pid: int) -> str | None:
    """The process' start time (clock ticks since boot, /proc/PID/stat field 22): tells a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def pid_namespace() -> str | None:
    """This process' pid namespace ("pid:[4026531836]"), None without procfs: a pid names a process only within it."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def boot_id() -> str | None:
    """This kernel's boot id (a new one at every boot; the host's, shared by its containers), None where unreadable."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip() or None
    except OSError:
        return None


def me(env=None) -> dict:
    """This process as a lock's owner."""
    env = os.environ if env is None else env
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": _start_time(os.getpid()),
            "pidns": pid_namespace(), "boot": boot_id(),
            "job": env.get("SLURM_JOB_ID", ""), "restart": env.get("SLURM_RESTART_COUNT", "0"),
            "cluster": env.get("SLURM_CLUSTER_NAME", ""),
            "step": env.get("SLURM_STEP_ID", env.get("SLURM_STEPID", "")),
            "since": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def pid_alive(pid: int, start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: alive
    now = _start_time(pid)
    return start is None or now is None or now == start


def job_state(job: str) -> str | None:
    """The job's JobState as slurmctld says it ("GONE" for a job it no longer knows); None where it cannot say."""
    try:
        p = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    # the record whose JobId is `job`: an array's id (its last task's SLURM_JOB_ID) lists every task left of the
    # array, a het leader's every component; the first record's state was taken, a sibling's (a pending task: "live")
    # where this one is purged or ended. Other records only: GONE
    states = {m.group(1): m.group(2) for m in re.finditer(r"(?:^|\n)\s*JobId=(\d+)\b.*?\bJobState=(\w+)", p.stdout, re.S)}
    if states:
        return states.get(str(job), "GONE")
    m = re.search(r"JobState=(\w+)", p.stdout)
    if m:
        return m.group(1)
    return "GONE" if "Invalid job id" in p.stderr else None


def settled_state(job: str, state=job_state) -> str | None:
    """The job's state (`state`: job_state) once it is no longer ending (ENDING), or still ending after ENDING_WAIT_S.
    Cost: at most 60 scontrol calls, by rank 0, only where a lock names another job that is ending."""
    deadline = time.monotonic() + ENDING_WAIT_S
    s = state(job)
    while s in ENDING and time.monotonic() < deadline:
        time.sleep(ENDING_EVERY_S)
        s = state(job)
    return s


def verdict(lock: dict, mine: dict, age_s: float | None, alive=pid_alive, state=job_state) -> tuple[bool, str]:
    """(whether the lock's owner is alive, why). Pure given its readers: tests give it any cluster."""
    # a job id names a job of one cluster: another cluster sharing the file system answers "Invalid job id" (GONE)
    # for a live run there, or its own job of the same id (taken for an earlier run of this job)
    same_cluster = lock.get("cluster", mine.get("cluster", "")) == mine.get("cluster", "")  # a lock from before: ours
    same_job = same_cluster and bool(lock.get("job")) and lock["job"] == mine.get("job")
    if same_job and lock.get("restart") != mine.get("restart"):
        return False, f"an earlier run of this job ({lock['job']})"  # a requeue: Slurm runs one restart at a time
    # the same restart: another step of this allocation, or another task of this very step (`srun -N2 launch.sh`
    # without --no_ssh: two one-node worlds), running now, or this step's earlier start: judged as any other run,
    # by its process or its heartbeat (the job's state says nothing: it is this one's)
    # its pid means a process here only in our pid namespace and boot (a lock from before they were recorded: taken
    # to be); in another (a container on this host name) it is judged by its job or heartbeat, as another host's
    same_pids = all(lock[k] == mine.get(k) for k in ("pidns", "boot") if k in lock)
    if lock.get("host") == mine["host"] and same_pids:
        if int(lock.get("pid", 0)) == mine["pid"]:
            return False, "this process' own (an earlier run in it)"
        if alive(int(lock.get("pid", 0)), lock.get("start")):
            return True, "its process is alive on this host"
        return False, "its process is gone"
    if lock.get("job") and not same_job and same_cluster:
        s = state(lock["job"])
        if s is not None:
            return s in LIVE_STATES, f"its job {lock['job']} is {s}"
    if age_s is not None and age_s > STALE_S:
        return False, f"its heartbeat is {age_s:.0f} s old"
    where = "on another host" if lock.get("host") != mine["host"] else "in another pid namespace (container) here"
    return True, "its heartbeat is " + ("unknown" if age_s is None else f"{age_s:.0f} s old") + \
        f" (at most {STALE_S:.0f} s for a live run {where})"


def folder_identity(folder: str) -> dict:
    """What `folder` is, recorded in its lock: its real path, st_dev and st_ino (copied_from compares them)."""
    st = os.stat(folder)
    return {"folder": os.path.realpath(folder), "dev": st.st_dev, "ino": st.st_ino}


def copied_from(lock: dict, folder: str, mine: dict) -> str | None:
    """The folder whose lock `folder` holds a copy of (`cp -a runL runL2` while runL's run is live), None where the
    lock may be `folder`'s own. The rule, safe on shared file systems (a live lock of this very folder is never taken
    over; where it cannot tell, the lock is judged as any other):
    - the lock records no folder (taken before they were recorded) or names this real path: its own;
    - lock taken on this host: the same (st_dev, st_ino) is this folder under another path (a symlink, a bind mount);
    - otherwise (another host, where the same folder may have another real path (/scratch vs /mnt/lustre) and another
      st_dev; or this host with two NFS mounts of one export, each its own st_dev) a copy only when proved: the
      recorded path, seen from here, holds the same lock (its token), has another st_ino than this folder (one folder
      has one inode number on every client of NFS, Lustre, GPFS), and a probe file written here is not seen there.
    A recorded path this host does not see (another mount layout) proves nothing: judged as before."""
    where = lock.get("folder")
    if not where or not lock.get("token"):
        return None
    try:
        here = folder_identity(folder)
    except OSError:
        return None
    if where == here["folder"]:
        return None
    if lock.get("host") == mine["host"] and (lock.get("dev"), lock.get("ino")) == (here["dev"], here["ino"]):
        return None
    try:
        with open(os.path.join(where, LOCK)) as fh:
            if json.load(fh).get("token") != lock["token"] or os.stat(where).st_ino == here["ino"]:
                return None
        with _probe(folder, f"copy.{socket.gethostname()}.{os.getpid()}.{time.time_ns()}") as probe:
            return None if os.path.exists(os.path.join(where, os.path.basename(probe))) else where
    except (OSError, ValueError, AttributeError, TypeError):  # gone, torn, or not a lock
        return None


@contextlib.contextmanager
def _probe(folder: str, name: str):
    """An empty file `.RUN_LOCK.<name>` written in `folder` for the block (its path), removed after it."""
    probe = os.path.join(folder, f".{LOCK}.{name}")
    try:
        with open(probe, "w"):
            pass
        yield probe
    finally:
        try:
            os.remove(probe)
        except OSError:
            pass


def file_age(path: str, folder: str) -> float | None:
    """Seconds since `path` was touched, on the file server's clock: its mtime against a probe file written now."""
    try:
        with _probe(folder, f"probe.{socket.gethostname()}.{os.getpid()}") as probe:
            return os.stat(probe).st_mtime - os.stat(path).st_mtime
    except OSError:
        return None


def acquire(folder: str, mine: dict | None = None, alive=pid_alive, state=job_state) -> str:
    """Take `folder`'s lock for this process (one line saying so), or raise ValueError naming the live owner."""
    mine = me() if mine is None else mine
    path = os.path.join(folder, LOCK)
    token = f"{mine['host']}:{mine['pid']}:{time.time_ns()}"
    tmp = f"{path}.{mine['host']}.{mine['pid']}"
    try:  # the first write in the folder: a read-only or foreign one is the user's to fix, in one line
        os.makedirs(folder, exist_ok=True)
        with open(tmp, "w") as fh:
            json.dump({**mine, "token": token, **folder_identity(folder)}, fh)
    except OSError as e:  # another error (ESTALE, EIO: a node's mount) is a crash of that node, requeued without it
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise ValueError(f"--output_dir {folder}: no room ({e.strerror}): free space or quota there, or use "
                             "another folder") from None
        if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EEXIST):
            raise ValueError(f"--output_dir {folder}: cannot write there ({e.strerror}): use a folder this user can "
                             "write") from None
        raise
    took_over = ""
    try:
        for _ in range(3):
            try:
                os.link(tmp, path)  # atomic, also on NFS: exactly one of two racing runs gets it
                break
            except FileExistsError:
                pass
            try:
                with open(path) as fh:
                    lock = json.load(fh)
            except (OSError, ValueError):
                lock = {}  # torn or vanished: a writer died mid-write (or just released it)
            copy = copied_from(lock, folder, mine) if lock else None
            if copy:  # its run writes the folder it was copied from, not this one
                live, why = False, f"a copy of {copy}'s lock: its run writes there, not here"
            else:
                live, why = verdict(lock, mine, file_age(path, folder), alive, lambda job: settled_state(job, state)) \
                    if lock else (False, "unreadable")
            if live:
                job = f", job {lock['job']}" if lock.get("job") else ""
                raise ValueError(f"output folder {folder} is held by a live run: host {lock.get('host')} pid "
                                 f"{lock.get('pid')}{job}, since {lock.get('since')} ({why}); two runs there would "
                                 f"overwrite each other's checkpoints and metrics: stop that run or use another "
                                 f"--output_dir (a lock its owner left when it died: remove {path})")
            took_over = f" (taken over: {lock.get('host')} pid {lock.get('pid')}, {why})"
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
        else:
            raise ValueError(f"output folder {folder}: could not take {path} (another run keeps taking it)")
    finally:
        os.remove(tmp)
    _HELD[:] = [path, token, _beat(path)]
    return f"run lock: {path} held by {mine['host']} pid {mine['pid']}{took_over}"


def _beat(path: str) -> threading.Event:
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(HEARTBEAT_S):
            try:
                os.utime(path)
            except OSError:
                pass

    threading.Thread(target=run, name="run-lock-heartbeat", daemon=True).start()
    return stop


def hold(folder: str) -> str:
    """Collective: rank 0 takes `folder`'s lock (acquire), every rank gets its line or raises its refusal."""
    from base import comm

    return comm.run_on_main(lambda: acquire(folder))


def release() -> None:
    """Remove the lock this process holds (if it is still ours)."""
    if not _HELD:
        return
    path, token, stop = _HELD
    _HELD.clear()
    stop.set()
    try:
        with open(path) as fh:
            if json.load(fh).get("token") == token:
                os.remove(path)
    except (OSError, ValueError):
        pass
