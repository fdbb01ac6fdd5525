"""The lock of a universal conversion (training/universal.py): `<key>.lock`, taken by an atomic mkdir, its OWNER file
(job id, requeue count, host, pid, pid namespace, boot id) and a heartbeat thread; `gone` says when an owner's lock may
be taken over (a stale heartbeat, its process exited (on this host, in this pid namespace and boot), an earlier run of
this job, or its job ended by Slurm's word), and `to_trash` moves a converter's partial folder out of the way without
an inline rmtree. Its own file: who may convert is a question apart from how a conversion is made and bounded, and
training/universal.py uses it through `Lock`, `gone` and `to_trash`.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time

from base.log import print0
from base.run_lock import LIVE_STATES, boot_id, job_state, pid_namespace
from training.checkpoint_files import atomic_write, read_json

OWNER = "OWNER"  # in <key>.lock/: who converts
HEARTBEAT_S = 30.0  # the lock's owner touches it this often while it converts
STALE_S = 600.0  # a lock untouched this long is taken over: 20 missed heartbeats, far above NFS's 60 s attribute
# cache and clock skew between nodes; a suspended job (scontrol suspend) past it loses the lock, not its files
JOB_LATE_S = 2 * HEARTBEAT_S  # a heartbeat this late: Slurm is asked whether the owner's (other) job still runs
JOB_ASK_S = 30.0  # at most one `scontrol show job` per owner job this often (a wait looks every WAIT_EVERY_S)


def _me() -> dict:
    return {"job": os.environ.get("SLURM_JOB_ID"), "restart": int(os.environ.get("SLURM_RESTART_COUNT") or 0),
            "host": socket.gethostname(), "pid": os.getpid(), "cluster": os.environ.get("SLURM_CLUSTER_NAME", ""),
            "pidns": pid_namespace(), "boot": boot_id()}


_ASKED: dict[str, tuple[float, str | None]] = {}  # owner job -> (when asked, its JobState): JOB_ASK_S apart


def _job_ended(owner: dict, me: dict) -> str | None:
    """The state of the owner's Slurm job when it is another job of this cluster that has ended (PENDING after a
    requeue, COMPLETED, CANCELLED, TIMEOUT, ...; GONE: slurmctld forgot it), else None (live, this job, no job, no
    scontrol, another cluster's: its job ids answer "Invalid job id" here, live ones too). One `scontrol show job` per
    JOB_ASK_S at most."""
    job = owner.get("job")
    if not job or job == me["job"] or owner.get("cluster", me["cluster"]) != me["cluster"]:
        return None
    asked, state = _ASKED.get(str(job), (-JOB_ASK_S, None))
    if time.monotonic() - asked >= JOB_ASK_S:
        state = job_state(str(job))
        _ASKED[str(job)] = (time.monotonic(), state)
    return None if state is None or state in LIVE_STATES else state


def _tmp(out: str, owner: dict) -> str:
    return f"{out}.tmp.{owner.get('host')}.{owner.get('pid')}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def gone(lock: str, now: float | None = None) -> str | None:
    """Why the owner of `lock` is gone (its lock may be taken over), or None while it may still be converting. Rank 0's
    alone (`prepare` runs in comm.run_on_main, `bound` in rank 0's rotation): every rank gets its outcome."""
    try:
        age = (time.time() if now is None else now) - os.stat(lock).st_mtime
    except FileNotFoundError:
        return "released"
    owner, me = read_json(os.path.join(lock, OWNER)).get("json") or {}, _me()
    if age > STALE_S:
        return f"its heartbeat is {age:.0f} s old"
    # its pid names a process here only in our pid namespace and boot (base/run_lock.py: a container on this host name
    # is another namespace's pid 1); an OWNER from before they were recorded: taken to be. Else: its heartbeat decides
    same_pids = all(owner[k] == me[k] for k in ("pidns", "boot") if k in owner)
    if owner.get("host") == me["host"] and same_pids and isinstance(owner.get("pid"), int) and not _alive(owner["pid"]):
        return f"its process {owner['pid']} on this host has exited"
    if me["job"] and owner.get("job") == me["job"] and int(owner.get("restart") or 0) < me["restart"]:
        return f"it was an earlier run of this job {me['job']} (requeued since)"
    ended = _job_ended(owner, me) if age > JOB_LATE_S else None  # a live owner beats every HEARTBEAT_S: not asked
    if ended:
        return f"its job {owner['job']} is {ended} (scontrol) and its heartbeat is {age:.0f} s old"
    return None


class Lock:
    """`<key>.lock`: an atomic mkdir, an OWNER file and a heartbeat thread while held (training/universal.py's docstring)."""

    def __init__(self, out: str):
        self.out, self.path, self.owner = out, out + ".lock", _me()
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def acquire(self) -> dict | None:
        """Take the lock: None once held, else the live owner's record (it converts; wait for its DONE)."""
        while True:
            try:
                os.mkdir(self.path)
            except FileExistsError:
                why = gone(self.path)
                if why is None:
                    return read_json(os.path.join(self.path, OWNER)).get("json") or {}
                self._take_over(why)
                continue
            atomic_write(os.path.join(self.path, OWNER), json.dumps(self.owner))
            self._beat = threading.Thread(target=self._heartbeat, name="universal-lock", daemon=True)
            self._beat.start()
            return None

    def _take_over(self, why: str) -> None:
        """Move a gone owner's lock out of the way (a rename: of two takers, one wins) and drop its partial folder."""
        owner = read_json(os.path.join(self.path, OWNER)).get("json") or {}
        grave = f"{self.path}.stale.{self.owner['host']}.{self.owner['pid']}.{time.time_ns()}"
        try:
            os.rename(self.path, grave)
        except OSError:  # another job took it over first (or this node's view of it is stale): look again
            time.sleep(0.5)
            return
        print0(f"taking over the universal conversion lock {self.path} of job {owner.get('job')} on "
               f"{owner.get('host')} (pid {owner.get('pid')}): {why}")
        if owner.get("host") and owner.get("pid"):
            to_trash(_tmp(self.out, owner))
        shutil.rmtree(grave, ignore_errors=True)

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:  # taken over (we were judged gone) or the file system is away: the rename still guards
                return

    def release(self) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
        if (read_json(os.path.join(self.path, OWNER)).get("json") or {}) == self.owner:  # still ours
            shutil.rmtree(self.path, ignore_errors=True)


def to_trash(path: str) -> None:
    """Rank 0: a converter's folder renamed into OUTPUT_DIR/checkpoints/.trash, deleted there by a daemon thread (a
    stop leaves the rest to the next job's, training/rotation.py), not here: a killed conversion at 512 ranks left
    up to params x 3 x world fragments (447k at 8B), minutes of rmtree on NFS, every GPU waiting. No rename: here."""
    if not os.path.lexists(path):
        return
    trash = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(path))), "checkpoints", ".trash")
    dest = os.path.join(trash, f"{os.path.basename(path)}.{time.time_ns()}")
    try:
        os.makedirs(trash, exist_ok=True)
        os.rename(path, dest)
    except OSError:
        return shutil.rmtree(path, ignore_errors=True)
    threading.Thread(target=shutil.rmtree, args=(dest, True), name="universal-trash", daemon=True).start()
