"""One writer per shard of a prepared folder: `scripts/prepare_data.py` holds an exclusive lock on
`--output/.prepare.lock-s<i>` while it writes shard i (the whole folder is shard 0 of 1), so a second run into the same
folder and shard (`srun` of one command on N tasks without --shard, a second terminal, an array job) is refused in one
line instead of "resuming" the first one's unfinished chunk: it deleted the open chunk and its tmp files, then both
wrote the same names. Shards of one preparation (--shard i/N) take different locks and run at once. The plan a shard is written under is
checked here too (check_plan; a merge's shards by check_rules), the tokenization rules' version included.

The lock is flock(2) (Python's fcntl.flock calls it) on an open file: the kernel drops it when the process dies, however
it dies (no stale lock to remove; a pid reused in another container does not hold it). Shared file systems:
- NFS: Linux emulates flock with a whole-file byte-range lock (NLM on v3, the protocol's own locks on v4): it holds
  across clients; a crashed client's lock lasts until its v4 lease expires (~90 s) or, on v3, until it reboots. Mounted
  with `nolock` / `local_lock=flock`: a lock of this node only.
- Lustre: across clients with `-o flock` (a crashed client's lock goes with its eviction), this node only with
  `-o localflock`; under `noflock` (the default of older releases) flock fails with ENOSYS.
- where a file system cannot lock at all (ENOLCK, EOPNOTSUPP, ENOSYS, EINVAL: FUSE mounts, NFS without a lock daemon),
  or this user may not (EACCES / EPERM: another user's lock file), the run goes on after one note, unguarded as
  before, and is never refused for that. A lost node's lock (NFS v3, Lustre) stays until the server lets it go: the
  refusal names the file to delete.
Cost: one small file per shard, one open + flock at start (a round trip to the server on NFS / Lustre)."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
import weakref

from data import packing, store

LOCK = ".prepare.lock"
UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL, errno.EACCES, errno.EPERM}
# (EACCES / EPERM: another user's lock file in a group folder, or an NFS lock it may not take: a note, not a refusal)
# locks this process holds, by lock file: a second prepare() of the same shard in this process (a test, a retry after
# a refusal) takes the one it holds instead of refusing itself (flock conflicts between two opens of one process)
_HELD: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


class Held:
    """An open lock file holding its flock; closed (the lock released) when dropped, or by the kernel at exit."""

    def __init__(self, fd: int | None, path: str):
        self.fd, self.path = fd, path

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    __del__ = release


def lock_path(output: str, shard: int) -> str:
    return os.path.join(output, f"{LOCK}-s{shard:05d}")


def holder(path: str) -> str:
    """Who holds the lock at `path`, as its holder wrote it ("host:pid, started ..."), or "unknown"."""
    try:
        with open(path) as fh:
            h = json.load(fh)
        return f"{h['host']}:{h['pid']}, started {h['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "unknown"


def try_lock(path: str) -> int | None:
    """An fd of `path` holding an exclusive flock; None where the file system cannot lock. BlockingIOError where
    another open file (another process) holds it."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as e:  # another user's lock file (0644 under the usual umask), a read-only folder
        if e.errno in UNSUPPORTED:
            return None
        raise
    try:
        if os.fstat(fd).st_uid == os.getuid():
            os.fchmod(fd, 0o664)  # the group's next user of a shared folder may lock it too
    except OSError:
        pass
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in UNSUPPORTED:
            return None
        raise
    return fd


def hold(output: str, shard: int, n_shards: int, log=print) -> Held:
    """Take shard `shard`'s lock of `output` (made if missing) for as long as the returned object lives (prepare()
    keeps it until it returns; the kernel releases it if the process dies). ValueError (one line) where another process
    holds it; where the file system cannot lock, one note and an unguarded run."""
    os.makedirs(output, exist_ok=True)
    path = lock_path(output, shard)
    key = os.path.realpath(path)
    if (held := _HELD.get(key)) is not None:
        return held
    try:
        fd = try_lock(path)
    except BlockingIOError:
        which = f" (shard {shard})" if n_shards > 1 else ""
        raise ValueError(f"--output {output}{which} is being written by another process ({holder(path)}): wait for it, "
                         f"or give each task --shard i/N (if that process is gone with a lost node, whose lock an NFS v3 "
                         f"or Lustre server keeps until the node is back or evicted, delete {path})") from None
    if fd is None:
        log(f"note: {output}: its lock file cannot be locked here (the file system, or another user's file): "
            "nothing stops a second run from writing this shard at the same time (give each task --shard i/N)")
    else:  # who holds it, for the refusal of another run (written after the lock is ours: never torn by a second one)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                  "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}).encode(), 0)
    _HELD[key] = held = Held(fd, path)
    return held


def is_held(folder: str) -> bool:
    """Whether a live process holds a lock of `folder` now (False where none is held or locks are unsupported)."""
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        if name.startswith(LOCK):
            try:
                fd = try_lock(os.path.join(folder, name))
            except BlockingIOError:
                return True
            except OSError:
                continue
            if fd is not None:
                os.close(fd)
    return False


def check_plan(output: str, shard: int, plan_path: str, plan: dict, finished: bool, log=print) -> None:
    """The shard's recorded plan against this command's `plan`: another preparation refused (one line); the
    tokenization rules' version (packing.RULES) compared only for an unfinished shard, whose chunks a continuation
    would write under other rules (a shard killed on one checkout and continued on another mixed both); a finished
    shard under older rules is said, and `plan["rules"]` takes the shard's own (None: begun before it was recorded),
    so its record and a merge see what it holds. A new shard's plan is written."""
    if not os.path.exists(plan_path):
        store.write_json_atomic(plan_path, plan)
        return
    old = store.read_json(plan_path)
    differs = sorted(k for k in plan if k != "rules" and old.get(k) != plan[k])
    if differs:
        raise ValueError(f"--output {output} holds shard {shard} of another preparation (differs in {differs}): "
                         "use another --output, or --overwrite to start this shard again")
    had = old.get("rules")
    if had == plan["rules"]:
        return
    plan["rules"] = had
    if had is not None and not finished:
        raise ValueError(f"--output {output}: shard {shard} was begun under other tokenization rules ({had}, today "
                         f"{packing.RULES}): continuing would mix them in one shard: --overwrite to start it again")
    log(f"note: {output}: shard {shard} was " + ("prepared" if finished else "begun") + " by an older version "
        + ("" if finished else "(rows read differently since, e.g. a top-level system_prompt, may differ between its "
           "chunks) ") + "; today's rules read some rows differently: --overwrite redoes it")


def check_rules(output: str, rules: list, log=print) -> None:
    """A merge's shards under one tokenization rules' version: known versions that differ refused, naming the shards
    not under today's; a shard begun before versions were recorded (None) said."""
    known = {r for r in rules if r is not None}
    if len(known) > 1:
        old = [i for i, r in enumerate(rules) if r is not None and r != packing.RULES]
        raise ValueError(f"{output}: shards were prepared under different tokenization rules ({sorted(known)}): redo "
                         f"shard(s) {old} with --overwrite (today's rules: {packing.RULES})")
    if None in rules:
        log(f"note: {output}: shard(s) {[i for i, r in enumerate(rules) if r is None]} were prepared before the rules' "
            "version was recorded: a row read differently since may differ between shards")
