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
abort channel (the first poster prints it), exit EXIT_PEER_LOST (69). Node 0 is named in LAUNCH_LOST_FILE (a requeue
without it) only when rank 0's heartbeat has stalled too (STALL_S, the watcher's rule): a rank 0 alive but slow is
usually a shared file system stalled for every node, and excluding node 0 would shrink the pool for nothing; then
slurm.sbatch requeues on the same nodes (69 without a lost file), at most ULYSSES_MAX_STALLED_REQUEUES (3) times in a
row without a newer checkpoint.
A wait that fails early (gloo's "Connection closed by peer": rank 0 killed, by a SIGTERM before the preemption handler
is installed or a SIGKILL, or its node lost) is not this rank's failure: it waits for the abort channel's verdict
(`gone`: the watcher sees the heartbeats and the store) and never raises into training/job.py's _fail, whose crash
record `first` on this healthy node made slurm.sbatch skip a preemption's requeue and exclude the node (or, past 2
nodes, fail the job). Cost: none while waiting (one async broadcast instead of broadcast_object_list's two blocking
ones); at the stop, a `get` on the store. No torch.distributed here (base/comm.py owns it).
"""

from __future__ import annotations

import datetime
import os
import re
import sys
import time
from collections.abc import Callable

LONG_WAIT_S = 6 * 3600  # rank-0-only work others may wait for: universal conversion of 8B on 32 ranks, prep
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
hard_exit = os._exit  # the tests replace it
VERDICT_TICK_S = 0.5  # `gone`'s look at the clock while the watcher decides


def wait(work, wait_s: float, fn: Callable, rank: int, long: bool, w, abort: Callable) -> None:
    """Wait for `work` (the host group's broadcast of rank 0's answer to `fn`) at most `wait_s`, capped at the group's
    own timeout (LONG_WAIT_S: a --dist_timeout_s above 6 h, HF's --ddp_timeout 180000), else `stalled`; rank 0 gone
    before that: `gone`. `w`: this rank's watcher (None: no abort channel); `abort`: base/comm.py's."""
    if wait_s >= LONG_WAIT_S:
        wait_s, long = LONG_WAIT_S, True
    t0 = time.monotonic()
    try:
        work.wait(timeout=datetime.timedelta(seconds=wait_s))
    except RuntimeError as e:  # gloo's "Operation timed out!"; anything sooner: rank 0's connection closed
        waited = time.monotonic() - t0
        if waited < wait_s * 0.99 and not timed_out(e):
            gone(describe(fn), rank, e, w, abort)
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


def beat_age(w) -> float | None:
    """Seconds since rank 0's heartbeat last moved, as this rank's watcher saw it (its `seen`: every rank's watcher
    watches rank 0's); None where unknown (no abort channel, no poll yet, rank 0 marked done)."""
    from base.watcher import DONE

    last = (getattr(w, "seen", None) or {}).get(0)
    if last is None or last[0] == DONE:
        return None
    return max(w.clock() - last[1], 0.0)


def stalled_line(host: str, what: str, waited_s: float, rank: int, long: bool, age: float | None = None) -> str:
    """The stop's line: rank 0 alive (its heartbeat moved within STALL_S: `age`) but its call unanswered, or hung."""
    from base.watcher import STALL_S

    bound = "LONG_WAIT_S" if long else "--dist_timeout_s"
    if age is not None and age < STALL_S:
        return (f"rank 0 ({host}) is alive (heartbeat {age:.0f} s ago) but its {what} has not answered in "
                f"{waited_s:.0f} s ({bound}; rank {rank} waited): a stalled shared file system? exit 69, requeued on "
                "the same nodes (slurm.sbatch; ULYSSES_MAX_STALLED_REQUEUES)")
    beat = f", no heartbeat for {age:.0f} s" if age is not None else ""
    return (f"rank 0 ({host}) hung: no answer for {waited_s:.0f} s ({bound}) from {what}, which it runs for every rank "
            f"(rank {rank} waited{beat}; a hung file system on its node?)")


def stalled(fn: Callable, waited_s: float, rank: int, long: bool, w, abort: Callable) -> None:
    """This rank gave up waiting for rank 0's `fn`: end the job as the hang monitor does (module docstring); node 0
    named lost only where rank 0's heartbeat has stalled (STALL_S) too. Never returns."""
    from base.watcher import STALL_S

    age = beat_age(w)
    line = stalled_line(main_host(w), describe(fn), waited_s, rank, long, age)
    end_job(line, w, abort, [0] if age is not None and age >= STALL_S else [])


def verdict_s() -> float:
    """How long `gone` leaves the watcher to decide: the store unreachable (LOST_STORE_S) or rank 0 silent (STALL_S),
    each within a poll or a request of its bound (read at the call: a harness may scale the watcher's timings)."""
    from base import watcher

    return watcher.LOST_STORE_S + watcher.STALL_S


def gone(what: str, rank: int, e: BaseException, w, abort: Callable) -> None:
    """Rank 0 (or the store's host) went away while this rank waited for it in `what`: a signal before the preemption
    handler, a SIGKILL, a lost node. Not this rank's failure (no exception into _fail: no traceback, no crash record):
    the abort channel decides, its watcher's thread ending this process (os._exit) with its verdict within
    `verdict_s()`: another rank's reason on record, rank 0 silent (69), the store gone (69). Without one by then, exit
    EXIT_PEER_LOST with one line, naming no node as lost (node 0's launcher names the nodes whose heartbeats stopped;
    a TERM is slurm.sbatch's to read). Never returns."""
    if w is not None and not getattr(w, "stopped", False):
        end = time.monotonic() + verdict_s()
        while time.monotonic() < end:
            time.sleep(VERDICT_TICK_S)
    end_job(f"rank 0 ({main_host(w)}) went away while rank {rank} waited for it in {what} ({short(e)}): killed, or "
            "its node lost; not a crash of this rank", w, abort, [])


def short(e: BaseException) -> str:
    """An error's first sentence without gloo's source location: "[.../pair.cc:553] Connection closed by peer
    [ip]:port. This is typically caused by..." -> "Connection closed by peer [ip]:port"."""
    text = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return re.sub(r"^\[[^\]]*\]\s*", "", text).split(". ")[0][:120] or type(e).__name__


def end_job(line: str, w, abort: Callable, nodes: list[int]) -> None:
    """Post `line` on the abort channel (exit 69 everywhere); the first poster prints it and names `nodes` in
    LAUNCH_LOST_FILE (a requeue without them). Never returns."""
    from base.exits import EXIT_PEER_LOST
    from base.watcher import one_line

    first = w.post(line, EXIT_PEER_LOST) if w is not None else line
    if first in (line, one_line(line)):  # the first waiting rank to give up speaks for all (512 ranks: one line)
        print(f"error: {line}", file=sys.stderr, flush=True)
        name_nodes(os.environ.get("LAUNCH_LOST_FILE"), nodes)
    abort(line, EXIT_PEER_LOST)
    hard_exit(EXIT_PEER_LOST)


def name_nodes(path: str | None, nodes: list[int]) -> bool:
    """`nodes` (indices) where scripts/slurm.sbatch reads the lost nodes (LAUNCH_LOST_FILE, node 0's), one a line,
    written whole (base/progress.py record_node names a hung rank's through it). Nothing for none; whether it wrote."""
    if not (path and nodes):
        return False
    try:
        with open(f"{path}.wait.{os.getpid()}", "w") as fh:
            fh.write("".join(f"{k}\n" for k in sorted(set(nodes))))
        os.replace(f"{path}.wait.{os.getpid()}", path)
        return True
    except OSError:
        return False
