"""The abort channel's protocol: a failure anywhere ends the job everywhere, within about a minute, whatever the
collective timeout. The channel (`Watcher`) runs beside the training on every rank, on its own connection to the
rendezvous store at MASTER_ADDR:MASTER_PORT. base/comm.py opens it (`open_channel`) at a launched rank's first
line (train.py, scripts/evaluate.py), before the config, model-folder and network checks and before the process
group exists: rank 0 starts the TCPStore server there itself (`multi_tenant`, so torch's env:// rendezvous in the
same process later reuses that server rather than binding the port twice; under torchrun the agent hosts it, and
with several `launch.sh --no_ssh` nodes node 0's launcher does (base/node_store.py: a node whose ranks die before
this line is then still heard); every rank is then a client), the others connect to it, as they would at the
rendezvous. A node that fails a start-up check so reaches the nodes waiting at the rendezvous within POLL_S, not
after `dist_timeout_s` (30 min).
A rank that fails writes one line to the store (base/comm.py's `abort`); every rank's watcher polls it every `POLL_S` and
hard-exits with it (the main thread may sit in an NCCL or gloo collective, or in the rendezvous, that would
otherwise wait for `dist_timeout_s`). The failing rank then stays, at most ABORT_WAIT_S, until every other rank
has read the line (marked itself done), and so does rank 0 when its watcher stops it: rank 0's process hosts
the store, and a launcher kills a failed rank's node-mates (rank 0 among them) as soon as the failed rank exits,
so without that wait the others would find the store gone ("unreachable", LOST_STORE_S later) instead of the
reason. A rank that dies without a word (SIGKILL, SIGSTOP, node loss) stops its heartbeat: rank 0 declares it
failed after `STALL_S`; every other rank does the same for rank 0, and takes a store that stays unreachable for
`LOST_STORE_S` (rank 0's process gone) as a failure. A rank that has not joined yet (its node still starting:
"0") is not silent; one still missing START_WAIT_S after the watcher started (stuck on a hung mount before
train.py's first line, a node never launched) ends the job with EXIT_PEER_LOST, named with its node's host where
a node-mate arrived; a rank whose store never answers its first connection exits the same way (base/comm.py).
Clean exits (0, and 75 after a committed preemption save) first leave the
channel (`leave`): the rank marks itself done and stops its watcher, and rank 0, which hosts the store, waits for
the others' marks before it goes, so no rank ever sees the store vanish under a clean exit.

The heartbeat does not depend on the GIL: a forked helper process per rank posts it (`_heartbeat`) while the
rank's process exists and is not stopped (/proc state T). DeepSpeed's CPU Adam (`adam_update`) holds the GIL for
a whole sub-group (1e9 parameters by default): with 8 ranks on one core, as a one-CPU srun step leaves them, a
heartbeat thread can starve past STALL_S and a healthy job was aborted. Why a process and not a stall limit
that adapts to measured step times: the first optimizer step has no measurement yet, and k x a 1M-token step
(minutes) would delay the detection of a truly lost node by as much; the helper keeps STALL_S at 60 s for
death, SIGSTOP and node loss, and costs one fork (copy-on-write pages, no import) and one `add` per POLL_S.
What it gives up: a rank hung with the GIL held forever is no longer "silent" (the collective timeout still
ends it); a busy rank is never declared dead. The watcher thread itself may still be starved: it then reads an
abort late, by at most the GIL hold. Before its hard exit the watcher says its line on stderr for at most SAY_S
(stderr may be a full pipe into slurm-%j.out on a hung file system: an unbounded write would block os._exit) and
writes the rank log (on the shared file system, which may be what broke) for at most LOG_WRITE_S.

A suspended job goes on: `scontrol suspend` and gang scheduling SIGSTOP every process and SIGCONT them later, node
by node, in any order; the monotonic clock runs on meanwhile. A watcher that wakes SUSPENDED_S late (it was
stopped, or starved) restarts its peers' stall clocks, the store's grace and the start-up wait (`poll`).

What a user waits, with the defaults:
| event | every rank stops after | exit |
|---|---|---|
| a rank posts its failure (an exception, a failed check) | POLL_S (2 s; 2.0 s max over 510 ranks measured) | its code |
| a rank or node goes silent (SIGKILL, SIGSTOP alone, node lost) | STALL_S (60 s; 60.1 s measured) + POLL_S | 69 |
| rank 0's process (the store) gone | LOST_STORE_S (20 s) + up to STORE_OP_TIMEOUT_S (10 s) | 69 |
| a rank never arrives at the store | START_WAIT_S (300 s) after the watcher started | 69 |
| the store never answers a rank's first connection | START_WAIT_S (300 s) | 69 |
| the store's host cannot hold 3 descriptors per rank | at once, one line, before any work | 2 |
| the whole job suspended and resumed | never (a rank still silent after the resume: STALL_S) | - |
(measured: bench/control_plane.py, docs/results/control_plane.md.)

Cost at 512 ranks (64 nodes x 8 GPUs): per rank two `add`s and one `multi_get` per POLL_S (rank 0's carries 513
keys): 768 store requests/s on the store's server, measured 2% of one core on this 2-core machine with 512
watcher and heartbeat threads beside it; 3 x 512 connections + the server's own: 1555 descriptors open, 1664
budgeted (STORE_FDS_*), past the common soft limit of 1024, which base/comm.py raises; the abort reaches every
rank within POLL_S (2.0 s max measured); nothing on the GPU or the training group. At 32 ranks: 48 requests/s.

base/comm.py creates the stores and calls this module; this module never touches the process group. Its bounded
store requests and writes, and the text of its lines: base/watch_io.py.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from base.exits import EXIT_PEER_LOST
from base.fd_limit import (  # noqa: F401  (re-exported: base/comm.py and node_store.py call them through here)
    RANK_FDS_MARGIN,
    STORE_FDS_MARGIN,
    STORE_FDS_PER_RANK,
    fd_refusal,
    raise_fd_limit,
    raise_fd_limit_of,
    rank_fds,
    store_fds,
    store_host_pid,
)
from base.watch_io import LOG_WRITE_S, _Asker, _bounded, _hostname, _ranges, _say, one_line, tell_launcher

POLL_S = 2.0  # how often every rank's watcher looks at the store
STALL_S = 60.0  # a rank whose heartbeat has not advanced this long has failed (killed, hung, node lost)
LOST_STORE_S = 20.0  # the store unreachable this long: rank 0's process (which hosts it) is gone
STORE_OP_TIMEOUT_S = 10.0  # one store request (a lost node answers nothing: no TCP reset)
CONNECT_TIMEOUT_S = 60.0  # the watcher's own connection, made once at init (a connect can take seconds)
# the start-up wait: a rank's first connection to the store, and every rank's arrival at it (train.py's first line)
# counted from when its watcher started; a rank stuck before that (a hung mount, a node that never launched) ends
# the job with EXIT_PEER_LOST after this, naming it. 5 min: 512 ranks importing torch from a cold shared file system
# arrive within about a minute of each other; ULYSSES_START_WAIT_S sets it where nodes start slower
START_WAIT_S = float(os.environ.get("ULYSSES_START_WAIT_S", "300"))
SUSPENDED_S = 10.0  # a watcher that wakes this much later than it should was itself stopped (or starved): see poll()
EXIT_GRACE_S = 30.0  # a failing rank's own teardown (atexit, NCCL destroy) before it is cut short
ABORT_WAIT_S = 15.0  # a failing rank (and rank 0, stopped) waits at most this long for the others to read why
SAY_S = 2.0  # the watcher's stderr line before its hard exit (a full pipe into slurm-%j.out on a hung file system)
LEAVE_WAIT_S = 600.0  # rank 0, leaving cleanly, waits at most this long for live ranks still on their way out
DONE = b"done"  # a rank's heartbeat value once it has left (cleanly, failed, or stopped by an abort)
_PREFIX = "ulysses_watch/"  # + the run's identity once `use_run` (base/run_identity.py): another run's ranks on this
LOG = logging.getLogger("ulysses_longtrain.rank")  # store (a shared port) then never write this run's keys


def use_run(digest: str) -> None:
    """Put this process's keys under the run `digest` (base/comm.py open_channel, base/node_store.py): before the
    heartbeat's fork, which inherits it."""
    global _PREFIX
    _PREFIX = f"ulysses_watch/{digest}/"


def key(name: str) -> str:
    return _PREFIX + name


class Watcher:
    """One rank's side of the abort channel. `poll()` is one look at the store (the thread calls it every
    POLL_S); store, clock and exit are injected so tests can drive it without processes or waiting."""

    def __init__(self, store, rank: int, world: int, clock=time.monotonic, hard_exit=os._exit, say=None,
                 sleep=time.sleep, log=None, heart: int | None = None):
        self.store, self.rank, self.world = store, rank, world
        self.clock, self.hard_exit, self.say, self.sleep = clock, hard_exit, say or _say, sleep
        self.log = log or LOG.info
        self.heart = heart  # the pid of this rank's heartbeat process (None: the thread's beat only)
        self.peers = list(range(world)) if rank == 0 else [0]  # rank 0 watches everyone, the others rank 0
        self.seen: dict[int, tuple[bytes, float]] = {}  # peer -> (last heartbeat value, when it last changed)
        self.store_lost_since: float | None = None
        self.last = clock()  # when the last poll ended (a much later next one: this process was stopped)
        self.join_by = self.last + START_WAIT_S  # a peer not joined ("0") by then never arrived
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # stop() and a hard exit never interleave
        self.stopped = False
        self.on_record: str | None = None  # the job's abort reason as the store answered it (read or posted here)
        self._asker = _Asker()

    def ask(self, fn, timeout: float | None = None):
        """fn(store), bounded by `timeout` (STORE_OP_TIMEOUT_S) whatever the store does."""
        return self._asker(lambda: fn(self.store), STORE_OP_TIMEOUT_S if timeout is None else timeout)

    def start(self) -> Watcher:
        self.store.compare_set(key("abort"), "", "")  # create the abort key empty (so multi_get never blocks)
        self.store.add(key(f"hb/{self.rank}"), 1)
        self.store.set(key(f"host/{self.rank}"), _hostname())  # names this rank's node if a node-mate never arrives
        for p in self.peers:  # create the peer's key if it has not started yet ("0": not joined); compare_set, not
            self.store.compare_set(key(f"hb/{p}"), "", "0")  # add: an add on a "done" key drops the connection
        self._thread = threading.Thread(target=self._run, name="abort-watcher", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            self.poll()

    def stop(self) -> None:
        """No more polls; after this returns the watcher will never exit the process."""
        with self._lock:
            self.stopped = True
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=STORE_OP_TIMEOUT_S + 1)

    def _keys(self) -> list[str]:
        return [key("abort"), *(key(f"hb/{p}") for p in self.peers)]

    def poll(self) -> None:
        """One look at the store: an abort posted, a peer's heartbeat stalled STALL_S, a peer never arrived
        START_WAIT_S, the store unreachable LOST_STORE_S.

        A suspended job (`scontrol suspend`, gang scheduling: SIGSTOP to every process, SIGCONT later, node by node
        in any order) must go on: every clock here is this process's monotonic time, which runs on while it is
        stopped, so after a resume every peer's heartbeat looks minutes old, or the store (stopped rank 0, or node 0's
        launcher) unreachable since before the stop. This watcher cannot tell a peer that was stopped with it from
        one that died meanwhile, so when it finds itself late (it woke SUSPENDED_S after it should have, or a
        request bounded by STORE_OP_TIMEOUT_S returned that much later) it restarts what it measures: every peer gets
        STALL_S again from now, the store LOST_STORE_S, a peer not joined yet the rest of its START_WAIT_S. Any
        order of SIGCONT is then safe: a peer resumed later than this rank beats within STALL_S; a store resumed
        later answers within LOST_STORE_S; a peer still stopped (or dead) is declared STALL_S after the resume. The
        same holds when this thread was starved (the GIL held by CPU Adam for longer than SUSPENDED_S): detection
        is late by the starved time, never early. Cost per poll at 512 ranks: one `add` and one `multi_get` (rank 0:
        513 keys, the others 2), two clock reads; naming a rank that never arrived: a few `get`s, once."""
        start = self.clock()
        error: Exception | None = None
        try:
            abort, *beats = self.ask(lambda st: (st.add(key(f"hb/{self.rank}"), 1), st.multi_get(self._keys()))[1])
        except Exception as e:  # noqa: BLE001 -- any store error: the store (rank 0's process) may be gone
            error = e
        now = self.clock()
        late = max(start - self.last - POLL_S, now - start - STORE_OP_TIMEOUT_S)
        self.last = now
        if late >= SUSPENDED_S:
            self._resumed(now, late)
        if error is not None:
            if self.store_lost_since is None:
                self.store_lost_since = now
            if now - self.store_lost_since >= LOST_STORE_S and not self.stopped:
                self._exit(EXIT_PEER_LOST, f"stopping: the job's store (hosted by rank 0) has been unreachable for "
                              f"{now - self.store_lost_since:.0f} s: rank 0 failed or its node was lost "
                              f"({type(error).__name__}: {one_line(error)})", mark=False)
            return
        self.store_lost_since = None
        if abort:
            code, _, reason = abort.decode().partition(" ")
            self.on_record = reason
            self._exit(int(code), f"stopping: {reason}")
            return
        missing = []
        for p, beat in zip(self.peers, beats):
            if p == self.rank:
                continue
            if beat == b"0":  # not joined yet: waited for START_WAIT_S from this watcher's start
                missing.append(p)
                continue
            last = self.seen.get(p)
            if beat == DONE or last is None or last[0] != beat:
                self.seen[p] = (beat, now)
            elif now - last[1] >= STALL_S:
                reason = (f"rank {p} stopped responding: no heartbeat for {now - last[1]:.0f} s "
                          "(killed, hung, or its node was lost)")
                reason = self.post(reason, EXIT_PEER_LOST)
                self._exit(EXIT_PEER_LOST, f"stopping: {reason}")
                return
        if missing and now >= self.join_by and not self.stopped:
            reason = self.post(self._never_arrived(missing), EXIT_PEER_LOST)
            self._exit(EXIT_PEER_LOST, f"stopping: {reason}")

    def _resumed(self, now: float, late: float) -> None:
        """This process was stopped (or starved) for about `late` s: what it measured meanwhile is stale."""
        self.seen = {p: (beat, now) for p, (beat, _) in self.seen.items()}
        self.store_lost_since = None
        self.join_by += late
        _bounded(self.log, f"abort channel: this rank was stopped or starved for {late:.0f} s (a suspended job?): "
                           "its peers' heartbeat clocks restart", LOG_WRITE_S)

    def _never_arrived(self, missing: list[int]) -> str:
        """"ranks 8-15 never arrived ...", with the host of each missing rank's node where a node-mate arrived (ranks
        by node from this rank's LOCAL_SIZE / LOCAL_WORLD_SIZE, contiguous as every launcher here places them)."""
        per_node = int(os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or 0)
        where = []
        if per_node > 0:
            gone = set(missing)
            for node in sorted({p // per_node for p in missing})[:4]:
                mates = [r for r in range(node * per_node, min((node + 1) * per_node, self.world)) if r not in gone]
                host = "none of its ranks arrived"
                if mates:
                    try:
                        got = self.ask(lambda st, m=mates[0]: st.get(key(f"host/{m}")))
                        host = f"host {got.decode() if isinstance(got, bytes) else got}"
                    except Exception:  # noqa: BLE001 -- named without its host
                        host = "host unknown"
                where.append(f"node {node}: {host}")
        at = f" ({'; '.join(where)})" if where else ""
        return (f"{_ranges(missing)} never arrived{at}: not at the job's store {START_WAIT_S:.0f} s after rank "
                f"{self.rank} was (stuck before train.py's first line: a hung mount, a node that never launched; "
                "ULYSSES_START_WAIT_S sets this wait)")

    def post(self, reason: str, code: int = 1) -> str:
        """Post `reason` ("rank R failed: ...") as the job's abort with the exit code the others take; the first
        reason posted wins. Returns the reason on record (this one, or the earlier one that caused this failure)."""
        try:
            got = self.ask(lambda st: st.compare_set(key("abort"), "", f"{code} {one_line(reason)}"))
            got = got.decode() if isinstance(got, bytes) else str(got)
            self.on_record = got.partition(" ")[2] or one_line(reason)
            return self.on_record
        except Exception:  # noqa: BLE001 -- the store is gone: the others find out through it
            return reason

    def _mark_done(self) -> None:
        try:
            self.ask(lambda st: st.set(key(f"hb/{self.rank}"), DONE))
        except Exception:  # noqa: BLE001 -- the store may be gone already; leaving anyway
            pass

    def _exit(self, code: int, line: str, mark: bool = True) -> None:
        """Say `line`, mark this rank done (`mark`), let the others read the abort if this rank hosts the store,
        and exit. Nothing here touches the file system unbounded: stderr first, the rank log (shared FS) for at
        most LOG_WRITE_S, in a thread the exit does not wait for."""
        with self._lock:
            if self.stopped:  # this rank is leaving on its own (clean exit or its own failure): never kill it
                return
            _bounded(self.say, line, SAY_S)  # stderr may be a full pipe nobody drains (slurm-%j.out on a hung FS)
            _bounded(self.log, line, LOG_WRITE_S)
            if self.on_record is not None:
                tell_launcher(self.rank, f"abort {self.on_record}")
            elif not mark:  # the store unreachable for LOST_STORE_S: nothing left to post to
                tell_launcher(self.rank, "gone")
            self.heart = stop_heartbeat(self.heart)
            if mark:
                self._mark_done()
                if self.rank == 0:
                    self.peers_done(ABORT_WAIT_S)
            self.hard_exit(code)

    def peers_done(self, deadline_s: float) -> None:
        """Wait until every other rank has marked itself done (having read an abort, or left cleanly) or its
        heartbeat has stalled for STALL_S, at most `deadline_s`: rank 0 leaving (the store lives in its process, and
        a rank still finishing its own exit must not see it vanish), and any rank that failed (until the others have
        read its reason: its launcher then kills its node-mates, rank 0 among them)."""
        end, tick = self.clock() + deadline_s, min(0.2, POLL_S)
        others = [key(f"hb/{p}") for p in range(self.world) if p != self.rank]
        first: dict[int, tuple[bytes, float]] = {}
        for _ in range(int(deadline_s / tick) + 1):  # also bounded if the clock stands still (tests)
            if not others or self.clock() >= end:
                return
            try:
                beats = self.ask(lambda st: st.multi_get(others))
            except Exception:  # noqa: BLE001
                return
            now = self.clock()
            waiting = []
            for i, b in enumerate(beats):
                if b == DONE:
                    continue
                last = first.get(i)
                if last is None or last[0] != b:
                    first[i] = (b, now)
                if now - first[i][1] < STALL_S:
                    waiting.append(i)
            if not waiting:
                return
            self.sleep(tick)


# --- the heartbeat process (see the module docstring: why not a thread) ---

def start_heartbeat(connect, rank: int, verify=None) -> int | None:
    """Fork this rank's heartbeat process; its pid (None if fork failed: the watcher thread's beat remains). Call
    before this process starts a thread or a store server: the child must not inherit a listening socket (rank 0's
    port would outlive rank 0) nor a lock held by a thread it does not have. `verify(store)`: whether the store is
    this run's (base/run_identity.py); the child writes nothing into one that is not."""
    parent = os.getpid()
    try:
        pid = os.fork()
    except OSError:
        return None
    if pid:
        return pid
    code = 0
    try:
        _heartbeat(connect, rank, parent, verify)
    except BaseException:  # noqa: BLE001 -- never back into the parent's code
        code = 1
    finally:
        os._exit(code)


def _heartbeat(connect, rank: int, parent: int, verify=None) -> None:
    """The child: `add hb/RANK 1` every POLL_S on its own `connect()`ion while `parent` exists and is not stopped;
    dies with it. Signals a
    launcher or SLURM send the whole job are ignored (the rank may be saving: its beat must go on)."""
    import signal

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: gone when the rank is gone
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        return
    store = connect()
    if verify is not None and not verify(store):  # another run's store: its rank says so (base/comm.py)
        return
    beat = key(f"hb/{rank}")
    while os.getppid() == parent:
        if not _stopped(parent):
            try:
                store.add(beat, 1)
            except Exception:  # noqa: BLE001 -- the store may be gone: the rank's watcher decides, not this
                pass
        time.sleep(POLL_S)


def _stopped(pid: int) -> bool:
    """Whether `pid` is stopped (SIGSTOP, a debugger): its heartbeat must stop too."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rpartition(")")[2].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def stop_heartbeat(pid: int | None) -> None:
    """End the heartbeat process (before this rank marks itself done: an `add` on a "done" key drops the
    connection). Returns None."""
    if pid:
        try:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        except OSError:
            pass
    return None
