"""How long a rank waits on the host for rank 0's solo work (base/comm.py `run_on_main`), and how it ends when rank 0
never answers.

Every rank-0 decision goes through `run_on_main`, most of them tiny reads (a manifest, the run lock, a listing). The
others wait on the host gloo group (base/comm.py `_HOST_GROUP`: gloo on every backend, so no GPU stream and no NCCL
watchdog), whose own timeout is LONG_WAIT_S (6 h) for the few known-long callers (a universal conversion, tokenizing
a small corpus in the job, counting an epoch's samples, the attention probe: they pass `long=True`). A short call
waits at most the run's `--dist_timeout_s` instead: the broadcast is posted asynchronously and gloo's
`Work.wait(timeout)` gives up then ("Operation timed out!", measured with torch 2.13; the work itself stays posted).
A `--dist_timeout_s` above LONG_WAIT_S (HF's `--ddp_timeout 180000`) waits LONG_WAIT_S: the group's own timeout
would end the wait first, and that error ("Timed out waiting ...ms for recv") is taken as the same stall, not
re-raised as a gloo traceback after 6 h.
Before, a hung NFS read on rank 0 at start-up (before the first progress mark starts the hang monitor,
base/progress.py) held every GPU for 6 h with no line.

A waiting rank that gives up ends the job as the hang monitor does (base/progress.py, RESTORE_S): one line naming
rank 0's host (from the abort channel's store: `host/0`) and what it runs (the function, file:line), posted on the
abort channel (the first poster prints it and names node 0 in LAUNCH_LOST_FILE: a requeue without that node), exit
EXIT_PEER_LOST (69). Cost: none while waiting (one async broadcast instead of broadcast_object_list's two blocking
ones); at the stop, a `get` on the store. No torch.distributed here (base/comm.py owns it).
"""

from __future__ import annotations

import datetime
import os
import sys
import time
from collections.abc import Callable

LONG_WAIT_S = 6 * 3600  # rank-0-only work others may wait for: universal conversion of 8B on 32 ranks, prep
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
hard_exit = os._exit  # the tests replace it


def wait(work, wait_s: float, fn: Callable, rank: int, long: bool, w, abort: Callable) -> None:
    """Wait for `work` (the host group's broadcast of rank 0's answer to `fn`) at most `wait_s`, capped at the group's
    own timeout (LONG_WAIT_S: a --dist_timeout_s above 6 h, HF's --ddp_timeout 180000), else `stalled`. `w`: this
    rank's watcher (None: no abort channel); `abort`: base/comm.py's."""
    if wait_s >= LONG_WAIT_S:
        wait_s, long = LONG_WAIT_S, True
    t0 = time.monotonic()
    try:
        work.wait(timeout=datetime.timedelta(seconds=wait_s))
    except RuntimeError as e:  # gloo's "Operation timed out!"; anything sooner (rank 0 gone) is the abort channel's
        waited = time.monotonic() - t0
        if waited < wait_s * 0.99 and not timed_out(e):
            raise
        # the group's own timeout ("Timed out waiting Nms for recv"), which may come first: a stall alike
        stalled(fn, wait_s if waited >= wait_s * 0.99 else waited, rank, long or waited < wait_s * 0.99, w, abort)


def timed_out(e: BaseException) -> bool:
    """gloo's words for a timeout (the host group's own, or Work.wait's), not a peer gone ("Connection closed")."""
    return "timed out" in str(e).lower()


def describe(fn: Callable) -> str:
    """What rank 0 runs, as a reader finds it: "training/restore.py:158 (Restore._read.<locals>.<lambda>)"."""
    code = getattr(fn, "__code__", None) or getattr(getattr(fn, "__func__", None), "__code__", None)
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    if code is None:
        return name
    path = code.co_filename
    if path.startswith(ROOT + os.sep):
        path = os.path.relpath(path, ROOT)
    return f"{path}:{code.co_firstlineno} ({name})"


def main_host(w) -> str:
    """Rank 0's host as its watcher wrote it into the store (`host/0`); 'host unknown' without one."""
    if w is not None:
        from base.watcher import key

        try:
            got = w.ask(lambda st: st.get(key("host/0")))
            return got.decode() if isinstance(got, bytes) else str(got)
        except Exception:  # noqa: BLE001 -- named without its host
            pass
    return "host unknown"


def stalled_line(host: str, what: str, waited_s: float, rank: int, long: bool) -> str:
    bound = "LONG_WAIT_S" if long else "--dist_timeout_s"
    return (f"rank 0 ({host}) hung: no answer for {waited_s:.0f} s ({bound}) from {what}, which it runs for every rank "
            f"(rank {rank} waited; a hung file system on its node?)")


def stalled(fn: Callable, waited_s: float, rank: int, long: bool, w, abort: Callable) -> None:
    """This rank gave up waiting for rank 0's `fn`: end the job as the hang monitor does (module docstring). Never
    returns."""
    from base.exits import EXIT_PEER_LOST

    line = stalled_line(main_host(w), describe(fn), waited_s, rank, long)
    first = w.post(line, EXIT_PEER_LOST) if w is not None else line
    if first == line:  # the first waiting rank to give up speaks for all (512 ranks: one line, not 511)
        print(f"error: {line}", file=sys.stderr, flush=True)
        name_node_0(os.environ.get("LAUNCH_LOST_FILE"))
    abort(line, EXIT_PEER_LOST)
    hard_exit(EXIT_PEER_LOST)


def name_node_0(path: str | None) -> None:
    """Rank 0's node (0) where scripts/slurm.sbatch reads the lost nodes, as base/progress.py record_node writes a
    hung rank's (not imported: progress imports comm, which imports this)."""
    if path:
        try:
            with open(f"{path}.wait.{os.getpid()}", "w") as fh:
                fh.write("0\n")
            os.replace(f"{path}.wait.{os.getpid()}", path)
        except OSError:
            pass
