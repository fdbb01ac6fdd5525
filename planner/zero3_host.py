"""ZeRO-3's host memory on a GPU run: its optimizer sub-groups, the pinned requests DeepSpeed 0.19.8 makes with
`pin_memory`, and each request as PyTorch's caching host allocator holds it. Pure arithmetic, no torch import.

planner/memory_model.estimate counts these as host terms (zero3_state_terms); scripts/plan.py reads the allocator
settings through pinned_round_limit. Derivation: docs/memory_model.md, "Host memory as the allocator holds it".

    from planner.zero3_host import zero3_subgroups, zero3_partitions
    zero3_subgroups(zero3_partitions(shape, world))  # elements of each optimizer sub-group of one rank
"""

from __future__ import annotations

from functools import lru_cache

from planner.shapes import Features, ModelShape

ZERO_SUBGROUP = 10**9  # DeepSpeed sub_group_size (its default; the optimizer step upcasts one sub-group at a time)
# PyTorch's caching host allocator (pinned memory on a CUDA run: ATen/core/CachingHostAllocator.h, torch 2.13) rounds
# every block up to a power of two (c10::llvm::PowerOf2Ceil) unless the request is above `pinned_max_round_threshold_mb`
# or `pinned_max_cached_size_mb` (PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF; both unlimited by default), and keeps a
# freed block cached for reuse (never returned to the OS) unless it is above `pinned_max_cached_size_mb`. So the host
# holds each pinned block at its rounded size for the whole run: Llama-3-8B at 5M tokens on 8 GPUs pins each offloaded
# layer checkpoint (4.77 GiB) as 8 GiB, 2,048 GiB of checkpoints per node instead of 1,221. (Setting only the round
# threshold is not safe in torch 2.13: get_free_block hands out the last cached block of the request's power-of-two
# bucket without comparing sizes, so an unrounded block can be reused for a larger request of the same bucket.)
PINNED_NO_LIMIT = 2**64 - 1  # torch's default for both options (SIZE_MAX): every pinned block is rounded


def pinned_block_bytes(nbytes: int, round_limit: int = PINNED_NO_LIMIT) -> int:
    """Bytes the caching host allocator holds for one pinned request of `nbytes` (see PINNED_NO_LIMIT): the next power
    of two, or `nbytes` itself above `round_limit` (pinned_round_limit of the run's allocator settings; torch's
    default: no limit). 4.77 GiB -> 8 GiB; 4 GiB -> 4 GiB; 3 B -> 4 B."""
    if nbytes <= 0:
        return 0
    return nbytes if nbytes > round_limit else 1 << (nbytes - 1).bit_length()


def pinned_round_limit(conf: str | None) -> int:
    """The request size above which torch's caching host allocator stops rounding pinned blocks, from an allocator
    settings string (PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF, "key:value,..."): the smaller of
    pinned_max_round_threshold_mb and pinned_max_cached_size_mb in bytes; PINNED_NO_LIMIT where neither is set."""
    limit = PINNED_NO_LIMIT
    for item in (conf or "").split(","):
        key, _, value = item.partition(":")
        if key.strip() in ("pinned_max_round_threshold_mb", "pinned_max_cached_size_mb"):
            try:
                limit = min(limit, int(float(value)) * 2**20)
            except ValueError:
                raise ValueError(f"allocator setting {item.strip()!r}: the value is a size in MiB") from None
    return limit


def zero3_partitions(shape: ModelShape, world: int) -> list[int]:
    """Elements of one rank's partition of each parameter, in the param group's order: ceil(numel / world) each
    (ZeRO-3 pads every parameter to a multiple of the world)."""
    return [-(-n // world) for n in shape.param_numels()]


def zero3_subgroups(partition_numels: list[int], sub_group_size: int | None = None) -> list[int]:
    """Elements of each ZeRO-3 optimizer sub-group as DeepSpeed 0.19.8 forms them (stage3._create_fp16_sub_groups):
    parameter by parameter in the param group's order (`partition_numels`, zero3_partitions), a sub-group closing
    once it holds >= sub_group_size (default ZERO_SUBGROUP) elements or at the last parameter; one group when the
    whole partition is within sub_group_size. Each sub-group is one flat fp32 tensor of master weights, one of Adam's
    m and one of v (what a checkpoint of the rank holds, and what the async save's snapshot copies), one fp32
    gradient buffer when the optimizer is offloaded, and the optimizer step's fp32 gradient copy. Llama-3-8B's width
    with 2 layers on one GPU (1.487e9 elements): one sub-group, not [1e9, 0.487e9]."""
    size = sub_group_size or ZERO_SUBGROUP
    if size >= sum(partition_numels):
        return [sum(partition_numels)] if partition_numels else []
    groups, acc = [], 0
    for i, n in enumerate(partition_numels):
        acc += n
        if acc >= size or i == len(partition_numels) - 1:
            groups.append(acc)
            acc = 0
    return groups


def zero3_pinned_requests(shape: ModelShape, world: int, b: int, offload_params: bool, offload_optimizer: bool,
                          grad_accum_bytes: int | None = None, sub_group_size: int | None = None) -> list[int]:
    """The pinned host requests (bytes, in the order DeepSpeed 0.19.8 makes them) of one rank's ZeRO-3 offloads with
    `pin_memory` (ds_configs/zero3_offload.json), each a block the caching host allocator rounds (pinned_block_bytes)
    and keeps for the run:
    - offload_params: every parameter's partition pinned as zero.Init creates it (partition_parameters.py, one
      request per parameter), then one flat block of the param group (stage3._create_param_groups_fp16_flat_cpu_memory)
      into which the partitions move; the per-parameter blocks are then free but stay cached (never returned);
    - offload_optimizer: one fp32 gradient buffer per optimizer sub-group (`subgroup_gradient_buffer`,
      zero3_subgroups), then the flat gradient-accumulation buffer of all partitions (`grad_partitions_flat_buffer`,
      `grad_accum_bytes` per element: the model's dtype unless data_types.grad_accum_dtype says fp32).
    A partition is ceil(numel / world) elements. Measured on the H200 (2026-11-27, Llama-3-8B width, 2 layers, optimizer
    offloaded): 12 GiB held in blocks of 8 + 4 GiB, where the planner counted one 8 GiB block; tests/unit/planner/
    test_pinned_requests.py checks this list against a real DeepSpeed engine's requests byte for byte."""
    parts = zero3_partitions(shape, world)
    out: list[int] = []
    if offload_params:
        out += [n * b for n in parts] + [sum(parts) * b]
    if offload_optimizer:  # the sub-groups' fp32 buffers (initialize_optimizer_states) come before the flat one
        out += [4 * g for g in zero3_subgroups(parts, sub_group_size)]
        out.append(sum(parts) * (grad_accum_bytes or b))
    return out


ACCUM_NAMES = {"torch.float32": "fp32", "float32": "fp32", "float": "fp32", "torch.float16": "fp16", "float16": "fp16",
               "half": "fp16", "torch.bfloat16": "bf16", "bfloat16": "bf16"}  # DeepSpeed's DtypeEnum spellings


def grad_accum_dtype(ds_config: dict) -> str | None:
    """A DeepSpeed config's data_types.grad_accum_dtype as the planner names it (fp32 / bf16 / fp16; DeepSpeed's
    DtypeEnum also takes "float32", "bfloat16", "torch.float32"...: the start-up memory checks skipped such a config as
    unreadable); None: absent, DeepSpeed then takes the model's dtype."""
    got = (ds_config.get("data_types") or {}).get("grad_accum_dtype")
    return ACCUM_NAMES.get(got, got) if isinstance(got, str) else got


def zero3_state_terms(shape: ModelShape, world: int, b: int, f: Features, gpu_run: bool, pinned_offloads: bool,
                      pinned_limit: int, async_save: bool, host_arena: bool,
                      accum: int | None = None) -> tuple[dict[str, int], dict[str, int]]:
    """(GPU terms, host terms) of one rank's ZeRO-3 model states, partitioned over the whole world (SP ranks
    included), for memory_model.estimate (whose arguments these are). On a GPU run a pinned request is held as
    pinned_block_bytes(bytes, pinned_limit); `pinned_offloads`: ZeRO-3's offload buffers are pinned (DeepSpeed's
    `pin_memory`); `host_arena`: the async save's copy of GPU-resident states is page-locked at its exact size
    (memory_model.HOST_ARENA). They depend on `f` only through its two offloads: cached on those (a search calling
    estimate for ~500 feature sets per length spent ~80% of its time here, rebuilding the same request lists).
    `accum`: bytes per element of ZeRO-3's gradient partition buffer (data_types.grad_accum_dtype; None: `b`), on
    the GPU or, with the optimizer offloaded, pinned on the host: fp32 under bf16 is +2 B per parameter / world
    (Llama-3-8B on 32 ranks: +0.5 GB a rank)."""
    gpu, cpu = _state_terms(shape, world, b, f.offload_params, f.offload_optimizer, gpu_run, pinned_offloads,
                            pinned_limit, async_save, host_arena, accum or b)
    return dict(gpu), dict(cpu)


@lru_cache(maxsize=256)
def _state_terms(shape: ModelShape, world: int, b: int, offload_params: bool, offload_optimizer: bool, gpu_run: bool,
                 pinned_offloads: bool, pinned_limit: int, async_save: bool,
                 host_arena: bool, accum: int) -> tuple[tuple[tuple[str, int], ...], tuple[tuple[str, int], ...]]:
    f = Features(offload_params=offload_params, offload_optimizer=offload_optimizer)
    n = shape.num_params()
    gpu: dict[str, int] = {}
    cpu: dict[str, int] = {}
    pin = (lambda nbytes: pinned_block_bytes(nbytes, pinned_limit)) if gpu_run else (lambda nbytes: nbytes)
    pinned = gpu_run and pinned_offloads
    pin_state = pin if pinned_offloads else (lambda nbytes: nbytes)
    # ZeRO-3's host buffers with pin_memory, request by request as DeepSpeed makes them (zero3_pinned_requests), each
    # block as the caching host allocator holds it; pageable (pinned_offloads False, or a CPU run): their bytes
    n_param = len(zero3_pinned_requests(shape, world, b, True, False)) if f.offload_params else 0
    zero_pins = [pin_state(x) for x in zero3_pinned_requests(shape, world, b, f.offload_params, f.offload_optimizer,
                                                             accum)]
    if f.offload_params:  # every partition pinned at zero.Init (cached once moved) + the param group's flat block
        cpu["params (partition)"] = sum(zero_pins[:n_param]) if pinned else n * b // world
    else:
        gpu["params (partition)"] = n * b // world
    if f.offload_optimizer:  # fp32 gradients per optimizer sub-group + the flat gradient-accumulation buffer (`accum`
        # bytes): measured on the H200, 2026-11-27 (bf16), 12 GiB (8 + 4) held where one fp32 buffer (8) was counted
        cpu["grads fp32 (partition)"] = sum(zero_pins[n_param:]) if pinned else \
            sum(zero3_pinned_requests(shape, world, b, False, True, accum))
        cpu["optimizer fp32 master+Adam m,v"] = 12 * n // world  # pageable: CPU Adam's own tensors
    else:  # the gradient partition buffer (stage3's grad_partitions_flat_buffer) in the accumulation dtype
        gpu["grads (partition)"] = n * accum // world
        gpu["optimizer fp32 master+Adam m,v"] = 12 * n // world
    if async_save:  # what ZeRO-3 saves per rank: fp32 master + Adam m, v (Llama-3-8B on 32 ranks: 3.0 GB, 24 GB/node).
        # Staging page-locks a buffer per storage copied from the GPU (the optimizer there): per sub-group, master, m
        # and v, exact in the host arena (as pinned blocks, the fallback, rounded: Llama-3-8B on 8 ranks 3 x 3.73 ->
        # 3 x 4 GiB, +7%); from host states (offloaded) a pageable copy.
        groups = zero3_subgroups(zero3_partitions(shape, world))
        snap = pin if not (f.offload_optimizer or host_arena) else (lambda nbytes: nbytes)  # arena: exact bytes
        cpu["async save: host copy of the rank's checkpoint"] = 3 * sum(snap(4 * g) for g in groups)
    return tuple(gpu.items()), tuple(cpu.items())
