"""Which GPU a rank drives, from what it sees (base/comm.py's `init` asks, before the process group exists).

A launcher (deepspeed, torchrun) shows every rank the node's GPUs and gives it LOCAL_RANK: the rank drives device
LOCAL_RANK. `srun python train.py` shows what srun's options give each task:
- `--gpus-per-node=G` / `--gres=gpu:G` (every task sees the node's G devices): device LOCAL_RANK, as above;
- `--gpus-per-task=1` (and `--gpu-bind=single:1`, or `--gres` under cgroup-constrained devices): each task sees one
  device, renumbered 0; LOCAL_RANK 3 on it was `invalid device ordinal` on every rank but the first. It now drives
  device 0, with one line from rank 0: NCCL cannot use NVLink / P2P between GPUs a task's device cgroup hides from
  the others (NERSC's `--gpu-bind=none` advice), so `--gpus-per-node` is faster;
- fewer devices than the local rank needs (`--gpus-per-task=2` with 4 tasks): refused in one line naming the fix;
  under a launcher (LOCAL_SIZE / LOCAL_WORLD_SIZE / LAUNCH_EXIT_DIR: deepspeed, torchrun, scripts/launch.sh) the fix is
  its GPU count (scripts/slurm.sbatch takes GPUS_PER_NODE, else SLURM_GPUS_ON_NODE, else each node's launch.sh counts
  its own GPUs); under `srun --gpu-bind=closest` (SLURMD_TRES_BIND / SLURM_TRES_BIND `gres/gpu:closest`) a task sees
  only its socket's GPUs.
Two ranks of a node on one device (several tasks given the same GPU): NCCL aborts inside deepspeed.init_distributed
(DeepSpeed passes device_id: the communicator is formed there) with "Duplicate GPU detected"; `claim` names them first,
through the rendezvous store, before the process group (base/comm.py `init`).
Ranks that disagree on WORLD_SIZE (scripts/slurm.sbatch without GPUS_PER_NODE or SLURM_GPUS_ON_NODE: each node's
`launch.sh --no_ssh` counts its own GPUs and writes N nodes of that count; a node of 4 beside nodes of 8, or one GPU
fallen off the bus): colliding rank numbers, a 300 s wait, then exit 69 naming a healthy node as lost. `same_world`
refuses them first, on every backend (`start_refusal`), in one line naming both counts.
"""

from __future__ import annotations

import os
import re
import time

FIX = ("one task per GPU: srun --ntasks-per-node=G --gpus-per-node=G (every task sees the node's GPUs), or "
       "--gpus-per-task=1")
LAUNCHED = ("LOCAL_SIZE", "LOCAL_WORLD_SIZE", "LAUNCH_EXIT_DIR")  # deepspeed's launch.py, torchrun, scripts/launch.sh
WORLD_FIX = "export GPUS_PER_NODE=N (scripts/slurm.sbatch) or give every node the same --num_gpus"
REFUSED = 1 << 40  # what a refusing rank adds to `gpu/in`: every rank waiting in `claim` stops at its next look
CLAIM_POLL_S = 0.5  # `claim`'s look at the arrivals: 1k small requests/s on rank 0's store at 512 ranks, while they come


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
                     f"{shown}): {fix_for(env, visible)}")


def fix_for(env, visible: int) -> str:
    """The fix for a rank that sees too few GPUs, for what started it (a launcher's GPU count, or srun's options)."""
    if any(env.get(k) for k in LAUNCHED):
        ranks = env.get("LOCAL_SIZE") or env.get("LOCAL_WORLD_SIZE") or "more"
        fix = (f"the launcher started {ranks} ranks on this node: give it the node's GPU count ("
               + (f"scripts/slurm.sbatch: export GPUS_PER_NODE={visible}, else it takes SLURM_GPUS_ON_NODE, else "
                  "each node's launch.sh counts its own GPUs; " if env.get("SLURM_JOB_ID") else "")
               + f"launch.sh / deepspeed: --num_gpus {visible}; torchrun: --nproc_per_node {visible})")
    else:
        fix = FIX
    bind = " ".join(env.get(k, "") for k in ("SLURMD_TRES_BIND", "SLURM_TRES_BIND"))
    if re.search(r"gpu:[^+]*closest", bind, re.I) or "closest" in env.get("SLURM_GPU_BIND", "").lower():
        fix += "; --gpu-bind=closest shows a task only its socket's GPUs: drop it (or --gpu-bind=none)"
    return fix


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
            return duplicate_line(seen[(host, uuid)], rank, host, uuid)
        seen[(host, uuid)] = rank
    return None


def duplicate_line(first: int, rank: int, host: str, uuid: str) -> str:
    return f"gpus: ranks {first} and {rank} on {host} would drive the same GPU ({uuid}), which NCCL refuses: {FIX}"


def _text(got) -> str:
    return got.decode() if isinstance(got, bytes) else str(got)


def local_world(env=None) -> str:
    """The ranks on this node as its launcher says (LOCAL_WORLD_SIZE: torchrun; LOCAL_SIZE: deepspeed), else "?"."""
    env = os.environ if env is None else env
    return env.get("LOCAL_WORLD_SIZE") or env.get("LOCAL_SIZE") or "?"


def same_world(ask, rank: int, world: int, host: str, local: str = "?") -> str | None:
    """The refusal (the first line posted: the same on every rank that refuses) when this rank's WORLD_SIZE is not
    the first rank's, else None: one compare_set of `world` (the first writer's "WORLD LOCAL RANK HOST" stays). The
    line is posted where `claim` reads it and `gpu/in` jumps by REFUSED,
    so the ranks that agree, waiting in `claim`, stop with it too (without `claim`, on CPU, the refusing rank's
    ValueError reaches them on the abort channel). Only WORLD_SIZE is compared: uneven nodes (hostfile slots 8/4/4)
    agree on it and are a job (base/host.py node_size_agreement). Cost: one request a rank, three when refused."""
    from base.watcher import key

    first = _text(ask(lambda st: st.compare_set(key("world"), "", f"{world} {local} {rank} {host}"))).split(" ", 3)
    if int(first[0]) == world:
        return None
    on = [f"rank {r} ({h}" + (f", {n} ranks on its node)" if n != "?" else ")") for n, r, h in
          ((local, rank, host), tuple(first[1:]))]
    line = (f"gpus: WORLD_SIZE {world} on {on[0]}, but {first[0]} on {on[1]}: the nodes' launchers counted different "
            f"GPUs (a node with fewer, or one fallen off the bus); {WORLD_FIX}")
    line = _text(ask(lambda st: st.compare_set(key("gpu/duplicate"), "", line)))  # the first posted: one line for all
    ask(lambda st: st.add(key("gpu/in"), REFUSED))
    return line


def start_refusal(ask, rank: int, world: int, host: str, uuid: str | None, wait_s: float,
                  poll_s: float = CLAIM_POLL_S) -> str | None:
    """The one line every rank refuses the start with (`same_world`, then `claim` where the GPU's UUID is known), or
    None; base/comm.py `init` raises it before the process group, on every backend."""
    line = same_world(ask, rank, world, host, local_world())
    return line or (claim(ask, rank, world, host, uuid, wait_s, poll_s) if uuid else None)


def refusal_or_end(w, host: str, uuid: str | None, wait_s: float, abort) -> str | None:
    """`start_refusal` over the abort channel `w` (base/comm.py `init`). Where its wait cannot end well, the job ends
    as a peer loss (exit 69, one line, no crash record: never an exception into training/job.py's _fail): ranks that
    never came to `claim` (`never_came`), or the job's store gone under the wait (rank 0's process, which hosts it,
    killed: "Broken pipe"; base/host_wait.py `gone` lets the watcher decide)."""
    from base import host_wait

    try:
        return start_refusal(w.ask, w.rank, w.world, host, uuid, wait_s, CLAIM_POLL_S)
    except NeverCame as e:
        never_came(e, w, abort)
    except (RuntimeError, OSError, TimeoutError) as e:  # torch's DistNetworkError / DistStoreError, the ask's bound
        host_wait.gone("the GPU claim before the process group", w.rank, e, w, abort)
    return None


class NeverCame(TimeoutError):
    """`claim` waited `wait_s` and ranks `missing` never counted themselves in."""

    def __init__(self, came: int, world: int, wait_s: float, missing: list[int]):
        super().__init__(f"only {came} of {world} ranks reached the process group's start in {wait_s:.0f} s "
                         "(--dist_timeout_s): the others are stuck after train.py's first line")
        self.came, self.world, self.wait_s, self.missing = came, world, wait_s, missing


def claim(ask, rank: int, world: int, host: str, uuid: str, wait_s: float, poll_s: float = CLAIM_POLL_S) -> str | None:
    """The duplicate line (the first one posted) or None, the same on every rank, from the job's store before any
    process group: each rank claims (host, uuid) with one compare_set (the first rank's number stays: a later rank
    finds it, and posts its line), then counts itself in (its rank appended to `gpu/who`, `gpu/in` + 1) and waits
    until all `world` have; `ask(fn)` runs fn(store) (the abort channel's connection, base/watcher.py). Cost: 5
    requests a rank, plus one per CLAIM_POLL_S while ranks arrive (imports finishing at different times). NeverCame
    (a TimeoutError naming the missing ranks, read from `gpu/who`: one `get`) after `wait_s` (the run's
    dist_timeout_s: what torch's own rendezvous would have waited) when some rank never comes."""
    from base.watcher import key

    first = int(_text(ask(lambda st: st.compare_set(key(f"gpu/{host}/{uuid}"), "", str(rank)))))
    if first != rank:
        ask(lambda st: st.compare_set(key("gpu/duplicate"), "", duplicate_line(first, rank, host, uuid)))
    ask(lambda st: (st.append(key("gpu/who"), f"{rank} "), st.add(key("gpu/in"), 1)))
    end = time.monotonic() + wait_s
    while (came := ask(lambda st: st.add(key("gpu/in"), 0))) < world:
        if time.monotonic() > end:
            here = {int(r) for r in _text(ask(lambda st: st.get(key("gpu/who")))).split()}
            raise NeverCame(came, world, wait_s, [r for r in range(world) if r not in here])
        time.sleep(poll_s)
    return _text(ask(lambda st: st.compare_set(key("gpu/duplicate"), "", ""))) or None  # "": none was posted


def never_came(e: NeverCame, w, abort) -> None:
    """Ranks that reached the job's store (train.py's first line: their watcher published `host/R`) but never the
    claim in --dist_timeout_s (stuck after it: a hung import, GPU driver or mount on their node): one line naming them
    and their hosts, their nodes (ranks by node from LOCAL_SIZE / LOCAL_WORLD_SIZE, contiguous as every launcher here
    places them) named lost in LAUNCH_LOST_FILE, exit 69 (base/host_wait.py `end_job`: the first rank to give up
    prints; nothing on the healthy waiting ranks' nodes, which the old TimeoutError gave a crash record). A missing
    rank without `host/R` never reached the store: the watcher's START_WAIT_S rule (and node 0's `absent`) decide
    its node, not this. Cost: one `check` per missing rank and a `get` per named one (8 at most), once."""
    from base import host_wait
    from base.watcher import key

    per_node = int(os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or 0)

    def hosts(st) -> dict[int, str | None]:
        return {r: _text(st.get(key(f"host/{r}"))) if st.check([key(f"host/{r}")]) else None for r in e.missing}

    try:
        where = w.ask(hosts)
    except Exception:  # noqa: BLE001 -- named without their hosts, no node named
        where = {}
    named = ", ".join(f"rank {r} ({where.get(r) or 'host unknown'})" for r in e.missing[:8])
    more = f" and {len(e.missing) - 8} more" if len(e.missing) > 8 else ""
    nodes = sorted({r // per_node for r in e.missing if where.get(r)}) if per_node > 0 else []
    told = f"; node(s) {' '.join(map(str, nodes))} named lost" if nodes else ""
    host_wait.end_job(f"only {e.came} of {e.world} ranks reached the process group's start in {e.wait_s:.0f} s "
                      f"(--dist_timeout_s): {named}{more} stuck after train.py's first line (a hung import, mount or "
                      f"GPU driver there?){told} (rank {w.rank} waited)", w, abort, nodes)


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
