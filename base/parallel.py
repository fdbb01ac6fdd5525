"""The parallel layout of a run, built once and passed down: world = sp x dp, and sp = ulysses x cp.

SP groups are consecutive ranks; rank r has sp_rank = r % sp and dp_rank = r // sp. Inside an SP group the
Ulysses groups are consecutive too (sp_rank = cp_rank * ulysses + ulysses_rank), so on a cluster the heads'
all-to-all stays inside a node (NVLink) and the context-parallel factor spans nodes (one K/V all-gather per
layer over InfiniBand). Different SP groups read different samples; ZeRO-3 partitions over the whole world.
The SP group itself is DeepSpeed's `parallel_state_sp` (the `mpu` handed to `deepspeed.initialize`, same
consecutive layout); the Ulysses and context-parallel subgroups are built in model_utils/ulysses.py.

Under context parallelism (cp > 1) a sample is laid out in zigzag order before it is sliced: the sequence is cut
into 2 * cp chunks and cp rank c holds chunks c and 2cp - 1 - c, so every cp rank does the same causal attention
work (an early and a late chunk: (c + 1/2) + (2cp - c - 1/2) = 2cp chunk-rows of keys). `zigzag_chunks` is that
order, shared by the data sharding and the attention (they may not import each other).
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelDims:
    world: int
    sp: int
    rank: int
    local_rank: int
    cp: int = 1  # context-parallel factor of sp (the Ulysses factor is sp // cp)

    @property
    def ulysses(self) -> int:
        return self.sp // self.cp

    @property
    def cp_rank(self) -> int:
        return self.sp_rank // self.ulysses

    @property
    def seq_multiple(self) -> int:
        """Samples are padded to a multiple of this: sp tokens, or 2 * sp under context parallelism (zigzag)."""
        return self.sp * (2 if self.cp > 1 else 1)

    @property
    def dp(self) -> int:
        return self.world // self.sp

    @property
    def sp_rank(self) -> int:
        return self.rank % self.sp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.sp

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def kv_compatible(num_kv_heads: int, ulysses: int) -> bool:
    """DeepSpeed's Ulysses splits KV heads over the group or replicates them: ulysses | kv or kv | ulysses."""
    return num_kv_heads % ulysses == 0 or ulysses % num_kv_heads == 0


def ulysses_options(sp: int, num_heads: int, num_kv_heads: int, gpus_per_node: int | None = None) -> list[int]:
    """The Ulysses factors u (ascending) that make sp = u x cp possible: u | sp, u | query heads, KV-compatible,
    and (on a cluster) u | gpus_per_node so no Ulysses group straddles two nodes. u = 1 (pure context
    parallelism) is always one of them."""
    return [u for u in range(1, sp + 1) if sp % u == 0 and num_heads % u == 0 and kv_compatible(num_kv_heads, u)
            and (not gpus_per_node or gpus_per_node % u == 0)]


def split_sp(sp: int, num_heads: int, num_kv_heads: int, gpus_per_node: int | None = None,
             cp: int | str | None = "auto") -> tuple[int, int]:
    """(ulysses, cp) for an SP degree. `cp` auto: Ulysses as large as the heads and the node allow (it costs one
    all-to-all inside the node per layer; cp adds a K/V all-gather that may cross nodes), the rest context
    parallel. An explicit cp is checked; a refusal is one line naming the valid values."""
    options = ulysses_options(sp, num_heads, num_kv_heads, gpus_per_node)
    valid_cp = [sp // u for u in reversed(options)]
    if cp in (None, "auto"):
        return options[-1], sp // options[-1]
    if not isinstance(cp, int) or isinstance(cp, bool) or cp < 1 or sp % cp:
        raise ValueError(f"context_parallel_size={cp!r} does not divide sequence_parallel_size={sp}: use one of "
                         f"{valid_cp} or auto")
    if sp // cp not in options:
        node = f", divide gpus_per_node {gpus_per_node} (a Ulysses group stays in a node)" if gpus_per_node else ""
        raise ValueError(f"context_parallel_size={cp} with sequence_parallel_size={sp} leaves a Ulysses factor of "
                         f"{sp // cp}, which must divide the {num_heads} query heads, suit the {num_kv_heads} KV "
                         f"heads{node}: use context_parallel_size one of {valid_cp} or auto")
    return sp // cp, cp


def check_layout(world: int, sp: int, num_heads: int, num_kv_heads: int, seq_len: int, cp: int = 1,
                 gpus_per_node: int | None = None) -> None:
    """One-line ValueError naming the numbers and the fix when the layout (sp = ulysses x cp) cannot work."""
    if sp < 1 or world % sp:
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        raise ValueError(f"sequence_parallel_size={sp} does not divide world size {world}: use one of {divisors} "
                         f"or launch a multiple of {sp} processes")
    if cp == 1 and num_heads % sp:
        ok = [d for d in range(1, num_heads + 1) if num_heads % d == 0 and world % d == 0]
        raise ValueError(f"the model has {num_heads} attention heads, not divisible by sequence_parallel_size={sp}: "
                         f"use one of {ok}, or context_parallel_size auto (or a factor of {sp}) to split the rest "
                         "of the sequence across Ulysses groups")
    if cp == 1 and not kv_compatible(num_kv_heads, sp):
        raise ValueError(f"the model has {num_kv_heads} KV heads: sequence_parallel_size={sp} must divide it or be "
                         "a multiple of it (KV heads are then replicated), or use context_parallel_size auto")
    split_sp(sp, num_heads, num_kv_heads, gpus_per_node, cp)  # the Ulysses factor sp / cp is possible
    if cp == 1 and seq_len < sp:
        raise ValueError(f"max_seq_length={seq_len} is shorter than sequence_parallel_size={sp}: each SP rank needs "
                         "at least one token; raise the length or lower SP")
    if cp > 1 and seq_len < 2 * sp:
        raise ValueError(f"max_seq_length={seq_len} is shorter than 2 x sequence_parallel_size={sp}: under context "
                         "parallelism each SP rank holds two zigzag chunks of at least one token; raise the length "
                         "or lower SP")


def zigzag_chunks(cp: int) -> list[int]:
    """The natural chunk indices (of 2 * cp equal chunks) in the order the SP ranks hold them: cp rank c holds
    chunks c and 2cp - 1 - c, so the order is [0, 2cp-1, 1, 2cp-2, ...]."""
    return [i for c in range(cp) for i in (c, 2 * cp - 1 - c)]


def init_distributed(sp: int, timeout_s: float = 1800.0, cp: int = 1) -> ParallelDims:
    """Set the device and initialise torch.distributed through `base.comm` (gloo on CPU, nccl on GPU) with
    a `timeout_s` collective timeout; return the dims. The node size is agreed here, once, before anything is laid
    out (base.host.agree_ranks_per_node: one all_gather_object of a few bytes per rank, milliseconds at 512
    ranks): every later reader (the curriculum's Ulysses split, the planner's choice, the plan, evaluate.py)
    takes that one value (base.host.job_ranks_per_node), never its own launcher's variable."""
    from base import comm
    from base.host import agree_ranks_per_node

    rank, world, local_rank = comm.init(timeout_s)
    agree_ranks_per_node()
    release_shm_buffer(rank)
    return ParallelDims(world=world, sp=sp, rank=rank, local_rank=local_rank, cp=cp)


def shm_buffer_path(rank: int) -> str:
    """Where DeepSpeed's CPU shared-memory all-reduce (op ShareMemComm, csrc/cpu/comm/shm.cpp) puts this
    rank's 66 MB workspace: /dev/shm/deepspeed_allreduce_buffer_{uid}_{MASTER_ADDR}_{MASTER_PORT}_{rank}."""
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    return f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{rank}"


def release_shm_buffer(rank: int) -> str | None:
    """Unlink this rank's shared-memory all-reduce workspace name once every rank has mapped it.

    When all ranks are on one machine (LOCAL_SIZE == world, as under the deepspeed launcher on a CPU box),
    DeepSpeed creates one POSIX shm segment per rank and never unlinks it: every launch, clean exit or
    killed, left 66 MB per rank in /dev/shm, which is RAM (306 segments, 20 GiB, after a day of benchmarks
    on the 24 GiB dev box, and the next compile was OOM-killed). Each rank maps all the others' segments
    inside deepspeed.init_distributed, so after a barrier the names are no longer needed: unlinking keeps
    every mapping valid and the kernel frees the memory when the last rank exits, however it exits.
    Returns the unlinked path, or None where there was no segment (GPU, multi-node, the op not built).
    """
    from base import comm

    comm.barrier()
    path = shm_buffer_path(rank)
    try:
        os.unlink(path)
    except FileNotFoundError:
        return None
    return path


FS_SETTLE_S = 60.0  # NFS's default attribute-cache ceiling (acdirmax/acregmax): how late a node may see a new file


def unseen(names: list[str], settle_s: float, every_s: float = 1.0) -> list[str]:
    """The `names` (paths) this process still cannot see after looking again every `every_s` for up to `settle_s`.
    Looked up one by one, by name, never through a directory listing: a node's cached listing of a folder can
    lag a minute behind what other nodes wrote into it."""
    import time

    give_up = time.monotonic() + settle_s
    while True:
        missing = [n for n in names if not os.path.exists(n)]
        if not missing or time.monotonic() >= give_up:
            return missing
        time.sleep(every_s)
        names = missing


def check_shared_output(output_dir: str, settle_s: float = FS_SETTLE_S) -> None:
    """Every rank writes a probe file in `output_dir`; every rank must see every other rank's probe. Checkpoints
    (each rank writes its shards, rank 0 the manifest), metrics, the PREEMPT stop file and the in-job token cache
    all assume one file system every node mounts. A node-local output dir would save, resume and export wrong
    checkpoints; this stops with one line naming the hosts instead. Collective, and one verdict for all: every
    rank reports what it could not see after `settle_s`, and the gathered reports decide. Costs one small file
    per rank; a shared folder answers at once, a node-local one after `settle_s`."""
    import socket
    import uuid

    from base import comm

    os.makedirs(output_dir, exist_ok=True)
    run_id = comm.all_gather_object(uuid.uuid4().hex[:12])[0]  # one name per launch: stale probes never count
    probe_dir = os.path.join(output_dir, f".probe-{run_id}")
    os.makedirs(probe_dir, exist_ok=True)
    host = socket.gethostname()
    with open(os.path.join(probe_dir, f"rank{comm.rank():05d}"), "w") as fh:
        fh.write(host)
    comm.barrier()
    world = comm.world()
    probes = [os.path.join(probe_dir, f"rank{r:05d}") for r in range(world)]
    missing = sorted(probes.index(p) for p in unseen(probes, settle_s))
    reports = comm.all_gather_object((host, missing))
    comm.barrier()
    if comm.rank() == 0:
        import shutil

        shutil.rmtree(probe_dir, ignore_errors=True)
    blind = [(h, m) for h, m in reports if m]
    if blind:
        host, missing = blind[0]
        writers = sorted({reports[r][0] for r in missing})
        raise ValueError(f"--output_dir {output_dir} is not shared: on {host} the files written there by "
                         f"{', '.join(writers)} (ranks {missing[:4]}{'...' if len(missing) > 4 else ''}) are not "
                         "visible; point --output_dir at a file system every node mounts (checkpoints, metrics "
                         "and the PREEMPT file live there)")
