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

`tests/test_comm.py` fails if another module calls torch.distributed collectives directly.
"""

from __future__ import annotations

import atexit
import datetime
import os
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
    return dist.get_rank(), dist.get_world_size(), local_rank


def shutdown() -> None:
    """Leave the process group (before rank-0-only work that nobody waits for, e.g. the export)."""
    global _HOST_GROUP
    if initialized():
        dist.destroy_process_group()
    _HOST_GROUP = None


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


def run_on_main(fn: Callable[[], Any]) -> Any:
    """Rank 0 runs `fn` while the others wait on the host (gloo group, LONG_WAIT_S); every rank returns its
    result. A ValueError raised by `fn` (bad user input) is raised on every rank with the same message; any
    other exception stops rank 0, and the others fail when the host group sees it exit."""
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
