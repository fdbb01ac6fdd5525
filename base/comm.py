"""The one owner of process-group communication: every collective of this project goes through here.

Why one module: on GPUs `deepspeed.init_distributed` creates an NCCL process group, and NCCL refuses what
gloo (the CPU tests' backend) forgives:
- a CPU tensor in a collective ("No backend type associated with device type cpu"): every tensor below is
  moved to `device()` (the accelerator's current device) before the collective and returned on the host;
- an object collective before `set_device`: every local rank would pick GPU 0; `init` sets the device
  from LOCAL_RANK *before* the process group exists;
- one rank doing long work while the others sit in a collective: NCCL's watchdog kills the job after the
  collective timeout. Waits that are expected to be long (rank 0 converting a checkpoint or tokenizing a
  small corpus) go through `run_on_main`, which waits in a separate gloo group on the host with
  `LONG_WAIT_S`: no GPU stream, no NCCL watchdog. The training group itself runs with `dist_timeout_s`
  (config key), which the multi-process tests lower so any unplanned wait fails a test, not a cluster job.

`tests/unit/base/test_comm.py` fails if another module calls torch.distributed collectives directly.

Every rank takes the same decision. Anything that changes control flow or what is loaded (which checkpoint to
resume, whether a stage is done, whether to stop or save now, whether the output folder is shared, which memory
features a stage runs, which data manifest is read) is taken once and handed to all ranks: by rank 0 and
broadcast (`run_on_main`), or by a collective reduction (`all_reduce` MAX of the stop votes, MIN of the memory
budgets, `all_gather_object` of every rank's report). Never from a rank's own clock, signal, directory listing
or memory reading: on a shared file system a node may list a folder as it was a minute ago, and two ranks that
decide differently run different collectives and hang, or, worse, train on two checkpoints' partitions.
`tests/multiproc/test_same_decision.py` gives the ranks different views and checks they decide the same.

A failure anywhere ends the job everywhere, within about a minute, whatever the collective timeout: the abort
channel (`Watcher`, below) runs beside the training on every rank, on its own connection to the rendezvous
store at MASTER_ADDR:MASTER_PORT. It opens at a launched rank's first line (`open_channel`: train.py,
scripts/evaluate.py), before the config, model-folder and network checks and before the process group exists:
rank 0 starts the TCPStore server there itself (`multi_tenant`, so torch's env:// rendezvous in the same process
later reuses that server rather than binding the port twice; under torchrun the agent hosts it, and with several
`launch.sh --no_ssh` nodes node 0's launcher does (base/node_store.py: a node whose ranks die before this line is
then still heard); every rank is then a client), the others connect to it, as they would at the rendezvous. A node that fails a start-up check so
reaches the nodes waiting at the rendezvous within POLL_S, not after `dist_timeout_s` (30 min).
A rank that fails writes one line to the store (`abort`); every rank's watcher polls it every `POLL_S` and
hard-exits with it (the main thread may sit in an NCCL or gloo collective, or in the rendezvous, that would
otherwise wait for `dist_timeout_s`). The failing rank then stays, at most ABORT_WAIT_S, until every other rank
has read the line (marked itself done), and so does rank 0 when its watcher stops it: rank 0's process hosts
the store, and a launcher kills a failed rank's node-mates (rank 0 among them) as soon as the failed rank exits,
so without that wait the others would find the store gone ("unreachable", LOST_STORE_S later) instead of the
reason. A rank that dies without a word (SIGKILL, SIGSTOP, node loss) stops its heartbeat: rank 0 declares it
failed after `STALL_S`; every other rank does the same for rank 0, and takes a store that stays unreachable for
`LOST_STORE_S` (rank 0's process gone) as a failure. A rank that has not joined yet (its node still starting) is
left to the rendezvous' own timeout. Clean exits (0, and 75 after a committed preemption save) first leave the
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
abort late, by at most the GIL hold. The watcher says its line on stderr first and writes the rank log (on
the shared file system, which may be what broke) for at most LOG_WRITE_S before it exits.
Cost: two `add`s and one `multi_get` per rank per `POLL_S`: at Llama-3-8B on 32 ranks, 48 store requests/s on
rank 0's store server (rank 0's multi_get carries 33 small keys), nothing on the GPU or the training group.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

LONG_WAIT_S = 6 * 3600  # rank-0-only work others may wait for: universal conversion of 8B on 32 ranks, prep
_HOST_GROUP = None  # gloo group over the same ranks, for the long waits above


def _accelerator():
    from deepspeed.accelerator import get_accelerator

    return get_accelerator()


def device() -> torch.device:
    """The device collectives run on: cuda:LOCAL_RANK on GPUs, cpu on CPU."""
    return torch.device(_accelerator().current_device_name())


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if initialized() else 0


def world() -> int:
    return dist.get_world_size() if initialized() else 1


def init(timeout_s: float) -> tuple[int, int, int]:
    """Set this process's device from LOCAL_RANK, then create the process group (nccl on GPU, gloo on CPU)
    with a `timeout_s` collective timeout, and the host-side gloo group for long waits.
    Returns (rank, world, local_rank)."""
    import deepspeed

    global _HOST_GROUP
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if initialized() and _HOST_GROUP is not None:  # already set up in this process (tests run several cases)
        return dist.get_rank(), dist.get_world_size(), local_rank
    acc = _accelerator()
    if acc.device_name() != "cpu":
        acc.set_device(local_rank)  # before any collective, object collectives included
    deepspeed.init_distributed(dist_backend=None, auto_mpi_discovery=False,
                               timeout=datetime.timedelta(seconds=timeout_s))
    _HOST_GROUP = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=LONG_WAIT_S))
    # Leave the groups on every way out (exit 75 after a preemption save included): a process group still alive
    # at interpreter teardown can abort the process ("terminate called without an active exception", -6)
    # after its work is done, and turn a clean exit code into a crash.
    atexit.register(shutdown)
    _start_watcher()
    return dist.get_rank(), dist.get_world_size(), local_rank


def shutdown() -> None:
    """Leave the abort channel, then the process group (before rank-0-only work that nobody waits for, e.g. the
    export)."""
    global _HOST_GROUP
    leave()
    if initialized():
        dist.destroy_process_group()
    _HOST_GROUP = None


def destroy_groups(groups) -> int:
    """Destroy process groups this rank is done with (a stage's SP and SP-DP groups); returns how many. Every
    member calls it at the same point (a stage's end). Dropping the references is not enough: each NCCL
    communicator keeps its GPU buffers (tens to hundreds of MB per group at 32 ranks) until destroyed, and a
    curriculum that changes the SP degree three times would keep them all."""
    n = 0
    for g in groups:
        if g is not None and g is not dist.GroupMember.NON_GROUP_MEMBER and initialized():
            dist.destroy_process_group(g)
            n += 1
    return n


_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def all_reduce(values, op: str = "sum", group=None) -> torch.Tensor:
    """Reduce a tensor (or a list of numbers, float64) over `group` (default: the world). The reduction runs
    on `device()`; the result comes back on the host. Identity on a single process."""
    t = values if torch.is_tensor(values) else torch.tensor(values, dtype=torch.float64)
    if not initialized() or world() == 1:
        return t.detach().cpu().clone()
    on_dev = t.detach().to(device(), copy=True)
    dist.all_reduce(on_dev, op=_OPS[op], group=group)
    return on_dev.cpu()


def all_reduce_(t: torch.Tensor, op: str = "sum", group=None) -> torch.Tensor:
    """In-place reduction of a tensor that already lives on `device()` (e.g. computed on it); returns it."""
    if initialized() and world() > 1:
        if t.device != device():
            raise AssertionError(f"collective on {t.device}, expected {device()}: use all_reduce() for host values")
        dist.all_reduce(t, op=_OPS[op], group=group)
    return t


def barrier() -> None:
    if initialized() and world() > 1:
        dist.barrier()


def all_gather_object(obj: Any) -> list:
    """Every rank's `obj`, in rank order (pickled through `device()`: set by `init` before any use)."""
    if not initialized() or world() == 1:
        return [obj]
    out = [None] * world()
    dist.all_gather_object(out, obj)
    return out


def subgroups(rank_lists: list[list[int]]):
    """Create one process group per list (every rank calls this with the same lists, in the same order, as
    torch.distributed requires) and return the one this rank is in (None if none)."""
    mine = None
    for ranks in rank_lists:
        g = dist.new_group(ranks)
        if rank() in ranks:
            mine = g
    return mine


class _GatherStack(torch.autograd.Function):
    """All-gather over `group` into a new leading dim [n, *shape]; backward reduce-scatters the gradient (each
    rank's tensor gets the sum over ranks of the gradient of its copy). Single collectives on `device()` tensors:
    all_gather_into_tensor and reduce_scatter_tensor, which NCCL runs natively and gloo supports on CPU."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group, n: int) -> torch.Tensor:
        ctx.group, ctx.n = group, n
        t = t.contiguous()
        out = t.new_empty((n * t.shape[0], *t.shape[1:]))  # concatenated: the form gloo and NCCL both take
        dist.all_gather_into_tensor(out, t, group=group)
        return out.view(n, *t.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = grad.new_empty(grad.shape[1:])
        dist.reduce_scatter_tensor(out, grad.view(-1, *grad.shape[2:]), group=ctx.group)
        return out, None, None


def gather_stack(t: torch.Tensor, group, n: int) -> torch.Tensor:
    """`t` from each of the `n` ranks of `group`, stacked in group-rank order: [n, *t.shape]. Differentiable
    (context parallelism's K/V gather; backward is one reduce-scatter). `t` must live on `device()`."""
    if t.device != device():
        raise AssertionError(f"collective on {t.device}, expected {device()}")
    return _GatherStack.apply(t, group, n)  # records no graph when `t` needs no gradient (position ids)


class _AllToAll(torch.autograd.Function):
    """[n, ...] -> [n, ...] over `group`: row j goes to group rank j, row i of the result came from rank i. Its own
    adjoint, so backward is the same exchange of the gradient. One all_to_all_single (NCCL native; gloo on CPU)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _AllToAll.apply(grad.contiguous(), ctx.group), None


def all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """Differentiable all-to-all of `x` [n, ...] (n = the group's size) over `group`: the linear-attention layers'
    sequence <-> head exchange (model_utils/linear_attention.py). `x` must live on `device()`."""
    if x.device != device():
        raise AssertionError(f"collective on {x.device}, expected {device()}")
    return _AllToAll.apply(x, group)


TCPStore = dist.TCPStore  # the job's store, for base/node_store.py (no other module imports torch.distributed)


def run_on_main(fn: Callable[[], Any]) -> Any:
    """Rank 0 runs `fn` while the others wait on the host (gloo group, LONG_WAIT_S); every rank returns its
    result. A ValueError raised by `fn` (bad user input) is raised on every rank with the same message; any
    other exception stops rank 0, and the abort channel stops the others within POLL_S (train.py posts it)."""
    if not initialized() or world() == 1:
        return fn()
    box: list = [None, None]
    if rank() == 0:
        try:
            box = [None, fn()]
        except ValueError as e:
            box = [str(e), None]
    dist.broadcast_object_list(box, src=0, group=_HOST_GROUP)
    if box[0] is not None:
        raise ValueError(box[0])
    return box[1]


# --- the abort channel: a failure anywhere ends the job everywhere (see the module docstring) ---

POLL_S = 2.0  # how often every rank's watcher looks at the store
STALL_S = 60.0  # a rank whose heartbeat has not advanced this long has failed (killed, hung, node lost)
LOST_STORE_S = 20.0  # the store unreachable this long: rank 0's process (which hosts it) is gone
STORE_OP_TIMEOUT_S = 10.0  # one store request (a lost node answers nothing: no TCP reset)
CONNECT_TIMEOUT_S = 60.0  # the watcher's own connection, made once at init (a connect can take seconds)
START_WAIT_S = 1800.0  # a rank's first connection to rank 0's store: as long as the rendezvous waits by default
EXIT_GRACE_S = 30.0  # a failing rank's own teardown (atexit, NCCL destroy) before it is cut short
ABORT_WAIT_S = 15.0  # a failing rank (and rank 0, stopped) waits at most this long for the others to read why
LOG_WRITE_S = 2.0  # the watcher's rank-log line before its hard exit (the log is on the shared file system)
LEAVE_WAIT_S = 600.0  # rank 0, leaving cleanly, waits at most this long for live ranks still on their way out
DONE = b"done"  # a rank's heartbeat value once it has left (cleanly, failed, or stopped by an abort)
_PREFIX = "ulysses_watch/"
_WATCHER = None
_LOG = logging.getLogger("ulysses_longtrain.rank")  # training.metrics' rank log (same logger, no import)


def _key(name: str) -> str:
    return _PREFIX + name


class _Asker:
    """One daemon thread that makes the store requests: a request to a store that never answers (rank 0's process
    stopped, its node gone without a TCP reset) blocks there, not in the caller, which gives up after `timeout`
    (TCPStore's own timeout does not bound add/multi_get/set on a silent server: measured)."""

    def __init__(self):
        self.jobs: queue.Queue = queue.Queue()
        threading.Thread(target=self._run, name="abort-store", daemon=True).start()

    def _run(self) -> None:
        while True:
            fn, box = self.jobs.get()
            try:
                box.put((True, fn()))
            except BaseException as e:  # noqa: BLE001 -- handed to the caller
                box.put((False, e))

    def __call__(self, fn, timeout: float):
        box: queue.Queue = queue.Queue(1)
        self.jobs.put((fn, box))
        try:
            ok, value = box.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no answer from the store in {timeout:.0f} s") from None
        if not ok:
            raise value
        return value


class Watcher:
    """One rank's side of the abort channel. `poll()` is one look at the store (the thread calls it every
    POLL_S); store, clock and exit are injected so tests can drive it without processes or waiting."""

    def __init__(self, store, rank: int, world: int, clock=time.monotonic, hard_exit=os._exit, say=None,
                 sleep=time.sleep, log=None, heart: int | None = None):
        self.store, self.rank, self.world = store, rank, world
        self.clock, self.hard_exit, self.say, self.sleep = clock, hard_exit, say or _say, sleep
        self.log = log or _LOG.info
        self.heart = heart  # the pid of this rank's heartbeat process (None: the thread's beat only)
        self.peers = list(range(world)) if rank == 0 else [0]  # rank 0 watches everyone, the others rank 0
        self.seen: dict[int, tuple[bytes, float]] = {}  # peer -> (last heartbeat value, when it last changed)
        self.store_lost_since: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # stop() and a hard exit never interleave
        self.stopped = False
        self._asker = _Asker()

    def ask(self, fn, timeout: float | None = None):
        """fn(store), bounded by `timeout` (STORE_OP_TIMEOUT_S) whatever the store does."""
        return self._asker(lambda: fn(self.store), STORE_OP_TIMEOUT_S if timeout is None else timeout)

    def start(self) -> Watcher:
        self.store.compare_set(_key("abort"), "", "")  # create the abort key empty (so multi_get never blocks)
        self.store.add(_key(f"hb/{self.rank}"), 1)
        for p in self.peers:  # create the peer's key if it has not started yet ("0": not joined); compare_set, not
            self.store.compare_set(_key(f"hb/{p}"), "", "0")  # add: an add on a "done" key drops the connection
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
        return [_key("abort"), *(_key(f"hb/{p}") for p in self.peers)]

    def poll(self) -> None:
        now = self.clock()
        try:
            abort, *beats = self.ask(lambda st: (st.add(_key(f"hb/{self.rank}"), 1), st.multi_get(self._keys()))[1])
        except Exception as e:  # noqa: BLE001 -- any store error: the store (rank 0's process) may be gone
            if self.store_lost_since is None:
                self.store_lost_since = now
            if now - self.store_lost_since >= LOST_STORE_S and not self.stopped:
                self._exit(1, f"stopping: the job's store (hosted by rank 0) has been unreachable for "
                              f"{now - self.store_lost_since:.0f} s: rank 0 failed or its node was lost "
                              f"({type(e).__name__}: {_one_line(e)})", mark=False)
            return
        self.store_lost_since = None
        if abort:
            code, _, reason = abort.decode().partition(" ")
            self._exit(int(code), f"stopping: {reason}")
            return
        for p, beat in zip(self.peers, beats):
            if p == self.rank or beat == b"0":  # b"0": not joined yet (the rendezvous' timeout covers it)
                continue
            last = self.seen.get(p)
            if beat == DONE or last is None or last[0] != beat:
                self.seen[p] = (beat, now)
            elif now - last[1] >= STALL_S:
                reason = (f"rank {p} stopped responding: no heartbeat for {now - last[1]:.0f} s "
                          "(killed, hung, or its node was lost)")
                reason = self.post(reason, 1)
                self._exit(1, f"stopping: {reason}")
                return

    def post(self, reason: str, code: int = 1) -> str:
        """Post `reason` ("rank R failed: ...") as the job's abort with the exit code the others take; the first
        reason posted wins. Returns the reason on record (this one, or the earlier one that caused this failure)."""
        try:
            got = self.ask(lambda st: st.compare_set(_key("abort"), "", f"{code} {_one_line(reason)}"))
            got = got.decode() if isinstance(got, bytes) else str(got)
            return got.partition(" ")[2] or reason
        except Exception:  # noqa: BLE001 -- the store is gone: the others find out through it
            return reason

    def _mark_done(self) -> None:
        try:
            self.ask(lambda st: st.set(_key(f"hb/{self.rank}"), DONE))
        except Exception:  # noqa: BLE001 -- the store may be gone already; leaving anyway
            pass

    def _exit(self, code: int, line: str, mark: bool = True) -> None:
        """Say `line`, mark this rank done (`mark`), let the others read the abort if this rank hosts the store,
        and exit. Nothing here touches the file system unbounded: stderr first, the rank log (shared FS) for at
        most LOG_WRITE_S, in a thread the exit does not wait for."""
        with self._lock:
            if self.stopped:  # this rank is leaving on its own (clean exit or its own failure): never kill it
                return
            self.say(line)
            _bounded(self.log, line, LOG_WRITE_S)
            self.heart = _stop_heartbeat(self.heart)
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
        others = [_key(f"hb/{p}") for p in range(self.world) if p != self.rank]
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


def _one_line(e: BaseException | str) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else ""


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _bounded(fn, arg, timeout_s: float) -> None:
    """fn(arg) in a daemon thread, waited for at most `timeout_s` (a write to a file system that hangs)."""
    t = threading.Thread(target=fn, args=(arg,), name="abort-log", daemon=True)
    t.start()
    t.join(timeout_s)


# --- the heartbeat process (see the module docstring: why not a thread) ---

def _start_heartbeat(addr: str, port: int, rank: int) -> int | None:
    """Fork this rank's heartbeat process; its pid (None if fork failed: the watcher thread's beat remains). Call
    before this process starts a thread or a store server: the child must not inherit a listening socket (rank 0's
    port would outlive rank 0) nor a lock held by a thread it does not have."""
    parent = os.getpid()
    try:
        pid = os.fork()
    except OSError:
        return None
    if pid:
        return pid
    code = 0
    try:
        _heartbeat(addr, port, rank, parent)
    except BaseException:  # noqa: BLE001 -- never back into the parent's code
        code = 1
    finally:
        os._exit(code)


def _heartbeat(addr: str, port: int, rank: int, parent: int) -> None:
    """The child: `add hb/RANK 1` every POLL_S while `parent` exists and is not stopped; dies with it. Signals a
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
    store = dist.TCPStore(addr, port, is_master=False, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=START_WAIT_S))
    store.set_timeout(datetime.timedelta(seconds=STORE_OP_TIMEOUT_S))
    key = _key(f"hb/{rank}")
    while os.getppid() == parent:
        if not _stopped(parent):
            try:
                store.add(key, 1)
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


def _stop_heartbeat(pid: int | None) -> None:
    """End the heartbeat process (before this rank marks itself done: an `add` on a "done" key drops the
    connection). Returns None."""
    if pid:
        try:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        except OSError:
            pass
    return None


def _watch_store():
    """A new client connection to the rendezvous TCPStore (the process group's own store, wherever the launcher
    put it): the watcher's requests never share a socket with the training's. None if the store is not TCP."""
    from torch.distributed import distributed_c10d

    store = distributed_c10d._get_default_store()
    while not isinstance(store, dist.TCPStore) and hasattr(store, "underlying_store"):
        store = store.underlying_store
    if not isinstance(store, dist.TCPStore):
        return None
    own = dist.TCPStore(store.host, store.port, is_master=False, wait_for_workers=False,
                        timeout=datetime.timedelta(seconds=CONNECT_TIMEOUT_S))
    own.set_timeout(datetime.timedelta(seconds=STORE_OP_TIMEOUT_S))
    return own


def open_channel() -> None:
    """The abort channel from a launched rank's first line (train.py, scripts/evaluate.py), before anything that
    can fail on one node (imports, config, model folder, network interface, a path a node lacks): from the
    launcher's RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT. Blocks until rank 0's store answers (START_WAIT_S,
    as the rendezvous would). Nothing for a world of one. A failure posted before this rank arrived ends it here."""
    global _WATCHER
    env = os.environ
    world_size, rank_ = int(env.get("WORLD_SIZE", "1")), int(env.get("RANK", "0"))
    addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    if _WATCHER is not None or world_size <= 1 or not addr or not port:
        return
    heart = _start_heartbeat(addr, int(port), rank_)  # first: a fork, before any thread or server exists
    try:
        if rank_ == 0 and env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            # the rendezvous store itself: torch's env:// init (multi_tenant too) reuses this server
            store = dist.TCPStore(addr, int(port), is_master=True, wait_for_workers=False, multi_tenant=True,
                                  timeout=datetime.timedelta(seconds=STORE_OP_TIMEOUT_S))
        else:
            store = dist.TCPStore(addr, int(port), is_master=False, wait_for_workers=False,
                                  timeout=datetime.timedelta(seconds=START_WAIT_S))
            store.set_timeout(datetime.timedelta(seconds=STORE_OP_TIMEOUT_S))
    except BaseException:
        _stop_heartbeat(heart)
        raise
    _WATCHER = Watcher(store, rank_, world_size, heart=heart).start()
    _WATCHER.poll()


def _start_watcher() -> None:
    global _WATCHER
    if _WATCHER is not None or world() == 1:
        return
    store = _watch_store()
    if store is None:
        _LOG.info("no TCP rendezvous store: the abort channel is off (a failure ends the job at the collective "
                  "timeout)")
        return
    _WATCHER = Watcher(store, rank(), world()).start()


def abort(reason: str, code: int = 1) -> str:
    """This rank failed: tell every rank (they exit within POLL_S), stop watching, wait (ABORT_WAIT_S at most) until
    the others have read it, and bound this process's own teardown to EXIT_GRACE_S. Returns the first failure on
    record (the cause, when this rank failed because another one did)."""
    global _WATCHER
    w = _WATCHER
    if w is None:
        return reason
    timer = threading.Timer(EXIT_GRACE_S, lambda: os._exit(code))  # first: nothing below may hang this rank
    timer.daemon = True
    timer.start()
    first = w.post(reason, code)
    w.stop()
    w.heart = _stop_heartbeat(w.heart)
    w._mark_done()
    # every failing rank, not only rank 0 (whose process hosts the store): the launcher kills this rank's node-mates,
    # rank 0 among them, as soon as this one exits
    w.peers_done(ABORT_WAIT_S)
    _WATCHER = None
    return first


def leave() -> None:
    """A clean exit (0, or 75 after a committed save): stop the watcher, mark this rank done; rank 0 then waits
    for the others' marks (LEAVE_WAIT_S at most), so its store outlives every rank still on its way out."""
    global _WATCHER
    w = _WATCHER
    if w is None:
        return
    _WATCHER = None
    w.stop()
    w.heart = _stop_heartbeat(w.heart)
    w._mark_done()
    if w.rank == 0:
        w.peers_done(LEAVE_WAIT_S)
