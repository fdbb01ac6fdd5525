"""Which GPU a rank drives, from what it sees (base/comm.py's `init` asks, before the process group exists).

A launcher (deepspeed, torchrun) shows every rank the node's GPUs and gives it LOCAL_RANK: the rank drives device
LOCAL_RANK. `srun python train.py` shows what srun's options give each task:
- `--gpus-per-node=G` / `--gres=gpu:G` (every task sees the node's G devices): device LOCAL_RANK, as above;
- `--gpus-per-task=1` (and `--gpu-bind=single:1`, or `--gres` under cgroup-constrained devices): each task sees one
  device, renumbered 0; LOCAL_RANK 3 on it was `invalid device ordinal` on every rank but the first. It now drives
  device 0, with one line from rank 0: NCCL cannot use NVLink / P2P between GPUs a task's device cgroup hides from
  the others (NERSC's `--gpu-bind=none` advice), so `--gpus-per-node` is faster;
- fewer devices than the local rank needs (`--gpus-per-task=2` with 4 tasks): refused in one line naming the fix.
Two ranks of a node on one device (several tasks given the same GPU): NCCL aborts at its first collective ("Duplicate
GPU detected"); `duplicates` names them first, from every rank's (host, device UUID), gathered on the host group.
"""

from __future__ import annotations

import os

FIX = ("one task per GPU: srun --ntasks-per-node=G --gpus-per-node=G (every task sees the node's GPUs), or "
       "--gpus-per-task=1")


def device_index(local_rank: int, visible: int, env=None) -> int:
    """The index, among the devices this process sees, of the one it drives; ValueError (one line) where it cannot
    pick one."""
    env = os.environ if env is None else env
    if visible == 1:
        return 0
    if 0 <= local_rank < visible:
        return local_rank
    shown = env.get("CUDA_VISIBLE_DEVICES", "unset")
    raise ValueError(f"LOCAL_RANK {local_rank}, but this process sees {visible} GPU(s) (CUDA_VISIBLE_DEVICES="
                     f"{shown}): {FIX}")


def one_each_line(readings: list[tuple[str, int, str | None]]) -> str | None:
    """Rank 0's line where ranks of a node each see a single GPU (srun --gpus-per-task=1): it works, slower; None
    otherwise. `readings`: every rank's (host, devices it sees, its device's UUID)."""
    hosts = [h for h, _, _ in readings]
    shared = [h for h in set(hosts) if hosts.count(h) > 1]
    if shared and all(n == 1 for h, n, _ in readings if h in shared):
        return ("gpus: each rank sees one GPU (srun --gpus-per-task=1?): NCCL cannot use NVLink/P2P between GPUs a "
                "task's device cgroup hides from the others; srun --gpus-per-node=G (every task sees the node's "
                "GPUs) is faster")
    return None


def idle_line(readings: list[tuple[str, int, str | None]]) -> str | None:
    """Rank 0's line where a node's ranks are fewer than the GPUs each of them sees (`srun python train.py` under
    --gpus-per-node=8 without --ntasks-per-node=8: one task a node, 7 GPUs idle the whole run); None otherwise."""
    for host in dict.fromkeys(h for h, _, _ in readings):
        seen = [n for h, n, _ in readings if h == host]
        if min(seen) > len(seen):
            return (f"gpus: {host} runs {len(seen)} rank(s), each seeing {min(seen)} GPUs: {min(seen) - len(seen)} "
                    f"idle; srun --ntasks-per-node={min(seen)} (or the launcher's --num_gpus) uses them all")
    return None


def duplicates(readings: list[tuple[str, int, str | None]]) -> str | None:
    """One line naming ranks that would drive the same GPU (same host, same device UUID), None when each has its
    own (or no UUID is known)."""
    seen: dict[tuple[str, str], int] = {}
    for rank, (host, _, uuid) in enumerate(readings):
        if uuid is None:
            continue
        if (host, uuid) in seen:
            return (f"gpus: ranks {seen[(host, uuid)]} and {rank} on {host} would drive the same GPU ({uuid}), "
                    f"which NCCL refuses: {FIX}")
        seen[(host, uuid)] = rank
    return None


def uuid_of(index: int) -> str | None:
    """The UUID of CUDA device `index` (None where torch does not say)."""
    import torch

    if not torch.cuda.is_available():  # another accelerator: NCCL's own check stands
        return None
    u = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return str(u) if u is not None else None
