"""The one owner of process-group communication: every collective of this project goes through here.

Why one module: on GPUs `deepspeed.init_distributed` creates an NCCL process group, and NCCL refuses what
gloo (the CPU tests' backend) forgives:
- a CPU tensor in a collective ("No backend type associated with device type cpu"): every tensor below is
  moved to `device()` (the accelerator's current device) before the collective and returned on the host;
- an object collective before `set_device`: every local rank would pick GPU 0; `init` sets the device
  from LOCAL_RANK (or the one GPU an srun task sees: base/devices.py) *before* the process group exists;
- one rank doing solo work while the others sit in a collective: NCCL's watchdog kills the job after the
  collective timeout. Rank 0's solo work goes through `run_on_main`, whose others wait in a gloo group on the host
  (no GPU stream, no NCCL watchdog) at most `dist_timeout_s` (LONG_WAIT_S for known-long work: base/host_wait.py).
  The training group runs with `dist_timeout_s` (config key), which the multi-process tests lower;
- two ranks on one GPU: NCCL aborts inside `deepspeed.init_distributed` (device_id: an eager communicator); `init`
  names them first, and ranks that disagree on WORLD_SIZE, through the rendezvous store (base/devices.py).

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
channel runs beside the training on every rank, on its own connection to the rendezvous store. This module holds
it and makes the store connections (`open_channel` at a launched rank's first line, `init`, `abort`, `leave`);
base/comm_channel.py opens and leaves it; base/watcher.py is its protocol (the watcher thread, the heartbeat
process, the timings) and says why.
"""

from __future__ import annotations

import atexit
import datetime
import os
import pickle
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from base import comm_channel, connect, devices, host_wait, watcher
from base.host_wait import LONG_WAIT_S
from base.store_limits import fd_refusal, publish_agent_fd_limit, publish_fd_limit  # noqa: F401  (re-exported)

_HOST_GROUP = None  # gloo group over the same ranks (timeout LONG_WAIT_S), for the waits on rank 0 (run_on_main)
_WAIT_S: float | None = None  # the run's dist_timeout_s (init): how long `run_on_main`'s short calls wait


def _accelerator():
    from deepspeed.accelerator import get_accelerator

    return get_accelerator()


def device() -> torch.device:
    """The device collectives run on: cuda:LOCAL_RANK on GPUs, cpu on CPU."""
    return torch.device(_accelerator().current_device_name())


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank(group=None) -> int:
    """This process's rank in `group` (default: the world); 0 without a process group."""
    return dist.get_rank(group) if initialized() else 0


def world(group=None) -> int:
    """The size of `group` (default: the world); 1 without a process group."""
    return dist.get_world_size(group) if initialized() else 1


def init(timeout_s: float) -> tuple[int, int, int]:
    """Set this process's device from LOCAL_RANK, then create the process group (nccl on GPU, gloo on CPU) with a
    `timeout_s` collective timeout, and the host-side gloo group (run_on_main). Returns (rank, world, local_rank)."""
    import deepspeed

    global _HOST_GROUP, _WAIT_S
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if initialized() and _HOST_GROUP is not None:  # already set up in this process (tests run several cases)
        return dist.get_rank(), dist.get_world_size(), local_rank
    acc = _accelerator()
    gpu = acc.device_name() != "cpu"
    if gpu:  # LOCAL_RANK of the node's devices, or the one device an srun task sees (base/devices.py)
        index = devices.device_index(local_rank, acc.device_count())
        # DeepSpeed takes LOCAL_RANK as the device's index (the engine's device, zero.Init's local_device): a task
        # that sees one GPU says 0; its node-local rank stays in ULYSSES_LOCAL_RANK (training/job.py's once-a-node)
        if index != local_rank:
            os.environ["ULYSSES_LOCAL_RANK"], os.environ["LOCAL_RANK"] = str(local_rank), str(index)
        acc.set_device(index)  # before any collective, object collectives included
    _claim_device(index if gpu else None, timeout_s)  # before init_distributed (NCCL's communicator: device_id)
    deepspeed.init_distributed(dist_backend=None, auto_mpi_discovery=False,
                               timeout=datetime.timedelta(seconds=timeout_s))
    # every later group without its own timeout (`subgroups`, DeepSpeed's SP and SP-DP groups: ZeRO-3, Ulysses) takes
    # the run's: NCCL's default 10 min would end a first step's hang (20 min, base/progress.py) before it is named
    c10d = dist.distributed_c10d
    c10d.default_pg_timeout = c10d.default_pg_nccl_timeout = datetime.timedelta(seconds=timeout_s)
    _HOST_GROUP = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=LONG_WAIT_S))
    _WAIT_S = timeout_s
    # Leave the groups on every way out (exit 75 included): a process group alive at interpreter teardown can abort
    # the process ("terminate called without an active exception", -6), a clean exit code turned into a crash
    atexit.register(shutdown)
    _start_watcher()
    if gpu:
        _check_devices(index, acc.device_count())
    return dist.get_rank(), dist.get_world_size(), local_rank


def _claim_device(index: int | None, timeout_s: float) -> None:
    """Ranks that disagree on WORLD_SIZE (any backend), then two ranks of a node on one GPU: one line, before NCCL
    aborts in `deepspeed.init_distributed`, through the abort channel's store (base/devices.py `refusal_or_end`)."""
    w, uuid = _WATCHER, None if index is None else devices.uuid_of(index)
    line = w and devices.refusal_or_end(w, socket.gethostname(), uuid, timeout_s, abort)
    if line:
        raise ValueError(line)


def _check_devices(index: int, visible: int) -> None:
    """Every rank's (host, GPUs it sees, its GPU's UUID, the UUIDs it sees) over the host group: rank 0's line where each
    task sees one GPU or GPUs idle; duplicates (`_claim_device` names them first). ~100-400 bytes a rank, once."""
    readings: list = [None] * dist.get_world_size()
    dist.all_gather_object(readings, (socket.gethostname(), visible, devices.uuid_of(index),
                                      devices.uuids_seen(visible) if visible > 1 else ()), group=_HOST_GROUP)
    line = devices.duplicates(readings)
    if line:
        raise ValueError(line)
    for note in (devices.one_each_line(readings), devices.idle_line(readings)):
        if note and dist.get_rank() == 0:
            print(f"warning: {note}", flush=True)


def shutdown() -> None:
    """Leave the abort channel, then the process group (before rank-0-only work that nobody waits for, e.g. the
    export)."""
    global _HOST_GROUP
    leave()
    if initialized():
        dist.destroy_process_group()
        # DeepSpeed's own references to the groups (deepspeed/utils/groups.py: _WORLD_GROUP, the ZeRO data-parallel
        # group) outlive torch's: an engine built later in this process (a test's second train.main) failed "Group
        # ... is not registered". deepspeed.comm.destroy_process_group releases them so; only where it is loaded
        ds_groups = sys.modules.get("deepspeed.utils.groups")
        if ds_groups is not None and hasattr(ds_groups, "_release_process_group_references"):
            ds_groups._release_process_group_references(None)
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
        # summed in fp32, as the ring path accumulates (model_utils/ring_attention.py): NCCL's ring rounds a bf16 sum at
        # every hop (1.55x fp32's error at cp 4, 2.2x at cp 8). Costs, for bf16 / fp16: twice this collective's bytes,
        # and an fp32 copy of the gathered gradient [cp, ...] (2x its bytes) while it runs
        wide = grad.contiguous() if grad.dtype in (torch.float32, torch.float64) else grad.float().contiguous()
        out = wide.new_empty(wide.shape[1:])
        dist.reduce_scatter_tensor(out, wide.view(-1, *wide.shape[2:]), group=ctx.group)
        return out.to(grad.dtype), None, None


def gather_stack(t: torch.Tensor, group, n: int) -> torch.Tensor:
    """`t` from each of the `n` ranks of `group`, stacked in group-rank order: [n, *t.shape]. Differentiable
    (context parallelism's K/V gather; backward is one reduce-scatter). `t` must live on `device()`."""
    if t.device != device():
        raise AssertionError(f"collective on {t.device}, expected {device()}")
    return _GatherStack.apply(t, group, n)  # records no graph when `t` needs no gradient (position ids)


class RingShift:
    """One step of a ring over `group`: the tensors `ts` go to the next group rank while the previous one's tensors
    of the same shapes and dtypes arrive (batch_isend_irecv: NCCL send/recv on GPUs, gloo on CPU), in flight until
    `wait()`, which returns them. Context parallelism's ring of K/V blocks (model_utils/ring_attention.py) starts the
    next block's shift before computing on the current one. Every rank of the group must shift the same shapes in
    the same order: NCCL does not check that a receive matches its send, so the CPU tests compare each rank's `log`."""

    def __init__(self, ts: list[torch.Tensor], group, log: list | None = None):
        n, me = dist.get_world_size(group), dist.get_rank(group)
        nxt, prv = dist.get_global_rank(group, (me + 1) % n), dist.get_global_rank(group, (me - 1) % n)
        self.sent = [t.contiguous() for t in ts]
        self.recv = [torch.empty_like(t) for t in self.sent]
        ops = []
        for s, r in zip(self.sent, self.recv):
            if s.device != device():
                raise AssertionError(f"send/recv on {s.device}, expected {device()}")
            if log is not None:
                log.append((tuple(s.shape), str(s.dtype)))
            ops += [dist.P2POp(dist.isend, s, nxt, group), dist.P2POp(dist.irecv, r, prv, group)]
        self._reqs = dist.batch_isend_irecv(ops)

    def wait(self) -> list[torch.Tensor]:
        for r in self._reqs:
            r.wait()
        self.sent = self._reqs = None  # the sent buffers may be freed now
        return self.recv


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


def run_on_main(fn: Callable[[], Any], long: bool = False) -> Any:
    """Rank 0 runs `fn` while the others wait on the host gloo group: at most the run's dist_timeout_s, or LONG_WAIT_S
    with `long` (known-long work); then one line naming rank 0's host and `fn` (base/host_wait.py). Every rank returns
    `fn`'s result. A ValueError raised by `fn` (bad user input) is raised on every rank with the same message; any
    other exception stops rank 0, and the abort channel stops the others within POLL_S (train.py posts it)."""
    if not initialized() or world() == 1:
        return fn()
    size = torch.zeros(1, dtype=torch.int64)
    if rank() == 0:
        try:
            box = [None, fn()]
        except ValueError as e:
            box = [str(e), None]
        data = torch.frombuffer(bytearray(pickle.dumps(box)), dtype=torch.uint8)
        size[0] = data.numel()
        dist.broadcast(size, src=0, group=_HOST_GROUP)
        dist.broadcast(data, src=0, group=_HOST_GROUP)
    else:
        work = dist.broadcast(size, src=0, group=_HOST_GROUP, async_op=True)
        host_wait.wait(work, LONG_WAIT_S if long or _WAIT_S is None else _WAIT_S, fn, rank(), long, _WATCHER, abort)
        data = torch.empty(int(size[0]), dtype=torch.uint8)
        dist.broadcast(data, src=0, group=_HOST_GROUP)  # sent right after the size: no wait
        box = pickle.loads(data.numpy().tobytes())
    if box[0] is not None:
        raise ValueError(box[0])
    return box[1]


# --- the abort channel (its protocol: base/watcher.py) ---

_WATCHER = None


def _client(addr: str, port: int, wait_s: float):
    """A client connection to the store at addr:port, waiting up to `wait_s` for it; requests time out after
    STORE_OP_TIMEOUT_S. Unbounded beyond that by torch itself: see `_connect`."""
    store = dist.TCPStore(addr, port, is_master=False, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=wait_s))
    store.set_timeout(datetime.timedelta(seconds=watcher.STORE_OP_TIMEOUT_S))
    return store


def _connect(addr: str, port: int, deadline: float):
    """A client connection to the store at addr:port by `deadline` (monotonic), or TimeoutError: one bounded wait
    (base/connect.py says why torch's own timeout is not one)."""
    connect.wait_for_port(addr, port, deadline)
    return connect.by_deadline(lambda: _client(addr, port, max(deadline - time.monotonic(), 0.5)), deadline,
                               "the port accepted a connection but the store never answered its handshake")


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
                        timeout=datetime.timedelta(seconds=watcher.CONNECT_TIMEOUT_S))
    own.set_timeout(datetime.timedelta(seconds=watcher.STORE_OP_TIMEOUT_S))
    return own


def open_channel() -> None:
    """The abort channel from a launched rank's first line (train.py, scripts/evaluate.py), before anything that can
    fail on one node: base/comm_channel.py (start-up bounded, descriptors checked, another run's store refused, each
    in one line). Nothing when it is open already, or for a world of one."""
    if _WATCHER is None:
        comm_channel.open_channel(_connect, _host_store, _watch)


def _host_store(addr: str, port: int):
    """The rendezvous store itself, on its host: torch's env:// init (multi_tenant too) reuses this server."""
    return dist.TCPStore(addr, port, is_master=True, wait_for_workers=False, multi_tenant=True,
                         timeout=datetime.timedelta(seconds=watcher.STORE_OP_TIMEOUT_S))


def _watch(store, rank_: int, world_size: int, heart):
    """This rank's watcher, started on `store`: from here `abort` reaches every rank."""
    global _WATCHER
    _WATCHER = watcher.Watcher(store, rank_, world_size, heart=heart).start()
    return _WATCHER


def _start_watcher() -> None:
    global _WATCHER
    if _WATCHER is not None or world() == 1:
        return
    store = _watch_store()
    if store is None:
        watcher.LOG.info("no TCP rendezvous store: the abort channel is off (a failure ends the job at the collective "
                         "timeout)")
        return
    _WATCHER = watcher.Watcher(store, rank(), world()).start()


def abort(reason: str, code: int = 1) -> str:
    """This rank failed: tell every rank (they exit within POLL_S) and wait until they have read it (base/comm_channel.py).
    Returns the first failure on record (the cause, when this rank failed because another one did)."""
    global _WATCHER
    w = _WATCHER
    if w is None:
        return reason
    first = comm_channel.abort(w, reason, code)
    _WATCHER = None
    return first


def leave() -> None:
    """A clean exit (0, or 75 after a committed save): this rank marked done; rank 0 waits for the others' marks
    (base/comm_channel.py)."""
    global _WATCHER
    w = _WATCHER
    if w is None:
        return
    _WATCHER = None
    comm_channel.leave(w)
