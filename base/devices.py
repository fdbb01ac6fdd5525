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
    hosts = [r[0] for r in readings]
    shared = [h for h in set(hosts) if hosts.count(h) > 1]
    if shared and all(r[1] == 1 for r in readings if r[0] in shared):
        return ("gpus: each rank sees one GPU (srun --gpus-per-task=1?): NCCL cannot use NVLink/P2P between GPUs a "
                "task's device cgroup hides from the others; srun --gpus-per-node=G (every task sees the node's "
                "GPUs) is faster")
    return None


def idle_line(readings: list[tuple]) -> str | None:
    """Rank 0's line where a node's ranks are fewer than the GPUs each of them sees (`srun python train.py` under
    --gpus-per-node=8 without --ntasks-per-node=8: one task a node, 7 GPUs idle the whole run), or where ranks that
    see several GPUs each see different ones (--gpus-per-task=2 --ntasks-per-node=2: GPUs {a,b} and {c,d}, the ranks
    drive a and d, b and c idle); None otherwise. `readings`: (host, devices seen, its device's UUID[, the UUIDs it
    sees]); without the last, only the first case is told."""
    for host in dict.fromkeys(r[0] for r in readings):
        mine = [r for r in readings if r[0] == host]
        seen = [r[1] for r in mine]
        sets = [frozenset(r[3]) for r in mine if len(r) > 3 and r[3]]
        if max(seen) > 1 and len(sets) == len(mine) and len(set(sets)) > 1:
            idle = len(frozenset().union(*sets) - {r[2] for r in mine})
            if idle:
                return (f"gpus: {host}'s {len(mine)} ranks each see other GPUs ({max(seen)} at most, "
                        f"{len(frozenset().union(*sets))} in all; srun --gpus-per-task={max(seen)}?): {idle} idle; "
                        f"{FIX} uses them all")
        if min(seen) > len(seen):
            return (f"gpus: {host} runs {len(seen)} rank(s), each seeing {min(seen)} GPUs: {min(seen) - len(seen)} "
                    f"idle; srun --ntasks-per-node={min(seen)} (or the launcher's --num_gpus) uses them all")
    return None


def duplicates(readings: list[tuple[str, int, str | None]]) -> str | None:
    """One line naming ranks that would drive the same GPU (same host, same device UUID), None when each has its
    own (or no UUID is known)."""
    seen: dict[tuple[str, str], int] = {}
    for rank, (host, _, uuid, *_) in enumerate(readings):
        if uuid is None:
            continue
        if (host, uuid) in seen:
            return (f"gpus: ranks {seen[(host, uuid)]} and {rank} on {host} would drive the same GPU ({uuid}), "
                    f"which NCCL refuses: {FIX}")
        seen[(host, uuid)] = rank
    return None


def uuids_seen(visible: int) -> tuple[str, ...]:
    """The UUIDs of every device this process sees (empty where torch does not say)."""
    got = tuple(uuid_of(i) for i in range(visible))
    return () if None in got else got  # type: ignore[return-value]


def uuid_of(index: int) -> str | None:
    """The UUID of CUDA device `index` (None where torch does not say)."""
    import torch

    if not torch.cuda.is_available():  # another accelerator: NCCL's own check stands
        return None
    u = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return str(u) if u is not None else None
