"""`memory_features: auto`: per stage, the fastest memory-feature set (and, with `sequence_parallel_size: auto`,
the smallest SP degree) that the planner (training/memory_model.py) fits in the device memory with headroom.

Candidates: tiled logits, tiled MLP, checkpointing of every K-th decoder layer (K = 1 .. L, one K per number
of checkpointed layers), with or without keeping the attention output of the checkpointed layers, checkpoint
offload (GPU only: on a CPU run it moves nothing). Settings the user wrote
(`tiled_mlp: true`, a stage's `memory_features: {checkpoint_every: 2}`) are pinned: auto only picks the rest.

Speed comes from a recompute cost model, derived in docs/memory_model.md ("Choosing the features"): one step
costs 3 forward passes of FLOPs (forward + backward = 2x forward); checkpointing ceil(L/K) of L layers adds
their forward again (less the attention kernel's with keep_attention), tiled MLP adds the MLP forward of every layer, tiled logits the LM head forward; on a GPU,
checkpoint offload adds a device->host and a host->device copy of each checkpoint at PCIE_BYTES_PER_S, on the
compute stream (not overlapped). relative_speed = time(no feature) / time(features).

    from training.auto_features import choose
    choose(load_shape("llama3-8b"), 131072, world=32, budget_bytes=72 * GiB, sp=None, sp_max=8)
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace

from training.memory_model import (
    LOGITS_TILE_BYTES,
    Features,
    GiB,
    ModelShape,
    estimate,
    flops_per_sequence,
    logits_tile_bytes,
)

HEADROOM = 0.10  # keep this fraction of the device memory free (allocator fragmentation, planner error)
GPU_RESERVED = 2 * GiB  # CUDA context, NCCL buffers, the workspace of kernels: not tensors the planner sees
# CPU runs: what the process grows by after the stages are resolved that is not a tensor the planner counts
# (DeepSpeed engine, gloo, CPU Adam): measured peak - RSS at resolution - predicted tensors was 0.059-0.082 GiB in
# the 10 auto runs of scripts/bench_peers.py --same_memory (docs/memory_model.md), so 0.10 on top of the 10%
# headroom. It was 0.15 while the planner under-counted RMSNorm's fp32 copies (that error, 0.04-0.05 GiB there,
# was in the margin), and 0.2 before that, which refused 24576 tokens where every feature on peaked at 0.87 GiB.
CPU_ENGINE_OVERHEAD = int(0.10 * GiB)
PCIE_BYTES_PER_S = 25e9  # effective host<->device bandwidth per GPU for checkpoint offload
MFU, PEAK_TFLOPS = 0.4, 989.0  # the H100 bf16 figures training/summary.py quotes
FEATURE_KEYS = ("tiled_mlp", "tiled_logits", "checkpoint_every", "offload_activations", "keep_attention")


@dataclass(frozen=True)
class Choice:
    """One stage's resolved setting: features, SP degree, predicted peak per rank and relative speed."""

    features: Features
    sp: int
    peak_bytes: int
    budget_bytes: int
    relative_speed: float  # tokens/s relative to the same stage with no memory feature (1.0: none)

    def as_dict(self) -> dict:
        """The record train.py logs (metrics) and the plan prints."""
        f = self.features
        return {"tiled_mlp": f.tiled_mlp, "tiled_logits": f.tiled_logits, "checkpoint_every": f.every,
                "offload_activations": f.offload_activations, "keep_attention": f.keep_attention, "sp": self.sp,
                "predicted_peak_gb": round(self.peak_bytes / GiB, 3), "budget_gb": round(self.budget_bytes / GiB, 3),
                "predicted_relative_speed": round(self.relative_speed, 3), "logits_tile_mb": f.logits_tile_mb}


def describe(f: Features) -> str:
    parts = [n for n in ("tiled_logits", "tiled_mlp") if getattr(f, n)]
    if f.tiled_logits and f.tile_bytes != LOGITS_TILE_BYTES:
        parts[0] += f" ({f.tile_bytes / 2**20:g} MiB tiles)"
    if f.every:
        parts.append("checkpoint every layer" if f.every == 1 else f"checkpoint 1 layer in {f.every}")
        if f.keep_attention:
            parts[-1] += " (attention kept)"
    if f.offload_activations:
        parts.append("offload checkpoints")
    return ", ".join(parts) or "none"


def relative_speed(shape: ModelShape, seq_len: int, sp: int, f: Features, device: str = "cuda",
                   precision: str = "bf16", mfu: float = MFU, peak_tflops: float = PEAK_TFLOPS) -> float:
    """time(no feature) / time(f) for one step, from the recompute (and offload copy) cost model."""
    s, h, L = seq_len, shape.hidden_size, shape.num_layers
    base = flops_per_sequence(shape, s)  # 3 x forward FLOPs
    attn_fwd = 2.0 * shape.num_heads * shape.head_dim * s * s  # causal QK^T and AV
    layer_fwd = 2.0 * shape.layer_params() * s + (0.0 if f.keep_attention else attn_fwd)
    extra = 0.0
    if f.every:
        extra += math.ceil(L / f.every) * layer_fwd
    if f.tiled_mlp:
        extra += L * 2.0 * 3 * h * shape.intermediate_size * s
    if f.tiled_logits:
        extra += 2.0 * shape.vocab_size * h * s
    compute_s = (base + extra) / (sp * mfu * peak_tflops * 1e12)  # per step, the SP group shares the sequence
    copy_s = 0.0
    if f.offload_activations and f.every and device == "cuda":
        hid = math.ceil(s / sp) * h * (2 if precision == "bf16" else 4)
        copy_s = 2 * math.ceil(L / f.every) * hid / PCIE_BYTES_PER_S
    return base / (sp * mfu * peak_tflops * 1e12) / (compute_s + copy_s)


def peak_bytes(shape: ModelShape, seq_len: int, sp: int, world: int, f: Features, offloads: Features,
               precision: str, device: str) -> int:
    """Predicted peak of one rank: on a GPU the device peak; on a CPU everything shares the host RAM, so the
    ZeRO-3 CPU offloads count too (training.memory_model.predict_peak_bytes' rule)."""
    return _peaks(shape, seq_len, sp, world, f, offloads, precision, device)[0]


def _peaks(shape, seq_len, sp, world, f, offloads, precision, device) -> tuple[int, int]:
    """(peak of one rank as in peak_bytes, host bytes of one rank: offloaded states and checkpoints).
    `offloads` carries the run's settings auto does not choose: the ZeRO-3 offloads, the lean RMSNorm and MLP."""
    feats = replace(f, offload_params=offloads.offload_params, offload_optimizer=offloads.offload_optimizer,
                    lean_rmsnorm=offloads.lean_rmsnorm, lean_mlp=offloads.lean_mlp)
    est = estimate(shape, seq_len, sp, world, feats, precision)
    host = sum(est.cpu_per_rank.values())
    return est.gpu_peak + (host if device == "cpu" else 0), host


def candidates(num_layers: int, pinned: Mapping, device: str) -> list[Features]:
    """Every feature set that honours `pinned` ({name: value} the user wrote). One K per count of
    checkpointed layers (the smallest K that gives it); offload only with checkpointing, and on GPU."""
    ks, counts = [], set()
    for k in range(1, num_layers + 1):
        if math.ceil(num_layers / k) not in counts:
            counts.add(math.ceil(num_layers / k))
            ks.append(k)
    opts = {"tiled_logits": [False, True], "tiled_mlp": [False, True], "checkpoint_every": [0, *ks],
            "offload_activations": [False, True] if device == "cuda" else [False], "keep_attention": [False, True]}
    for key, value in pinned.items():
        opts[key] = [int(value) if key == "checkpoint_every" else bool(value)]
    out = []
    for tl, tm, k0, off, keep in itertools.product(*(opts[n] for n in ("tiled_logits", "tiled_mlp", "checkpoint_every",
                                                                       "offload_activations", "keep_attention"))):
        k = k0
        if (off or keep) and not k:
            if pinned.get("offload_activations") or pinned.get("keep_attention"):  # pinned on: they imply K=1
                k = 1
            else:
                continue
        out.append(Features(tiled_logits=tl, tiled_mlp=tm, checkpoint_every=k, offload_activations=off,
                            keep_attention=keep))
    return list(dict.fromkeys(out))


def sp_degrees(shape: ModelShape, world: int, seq_len: int, sp_max: int) -> list[int]:
    """SP degrees possible on `world` ranks (training/parallel.check_layout's rule), at most sp_max (a node)."""
    from training.parallel import check_layout

    ok = []
    for sp in range(1, min(world, sp_max) + 1):
        try:
            check_layout(world, sp, shape.num_heads, shape.num_kv_heads, seq_len)
            ok.append(sp)
        except ValueError:
            pass
    return ok


def choose(shape: ModelShape, seq_len: int, world: int, budget_bytes: int, *, sp: int | None,
           sp_max: int | None = None, pinned: Mapping | None = None, offloads: Features | None = None,
           precision: str = "bf16", device: str = "cuda", headroom: float = HEADROOM,
           host_bytes_per_rank: int | None = None) -> Choice:
    """The fastest candidate whose predicted peak, plus `headroom` of the budget, fits in budget_bytes; at `sp`,
    or (sp=None) at the smallest degree <= sp_max where anything fits. Ties: the smaller peak. On a GPU,
    `host_bytes_per_rank` (CPU memory of a node / its ranks, less the runtime) also bounds what the ZeRO-3 and
    checkpoint offloads put in host memory. One-line ValueError when nothing fits. Tiled logits run tiles of
    `pinned["logits_tile_mb"]` MiB when given, else of training.memory_model.logits_tile_bytes(budget_bytes)."""
    pinned = dict(pinned or {})
    tile_mb = int(pinned.pop("logits_tile_mb", 0) or 0) or logits_tile_bytes(budget_bytes) // 2**20
    cands = [replace(f, logits_tile_mb=tile_mb) if f.tiled_logits else f
             for f in candidates(shape.num_layers, pinned, device)]
    usable = budget_bytes * (1 - headroom)
    degrees = [sp] if sp else sp_degrees(shape, world, seq_len, sp_max or world)
    least = None
    for d in degrees:
        scored = []
        for f in cands:
            peak, host = _peaks(shape, seq_len, d, world, f, offloads or Features(), precision, device)
            least = peak if least is None else min(least, peak)
            if peak <= usable and (device == "cpu" or host_bytes_per_rank is None or host <= host_bytes_per_rank):
                scored.append((-relative_speed(shape, seq_len, d, f, device, precision), peak, f))
        if scored:
            speed, peak, f = min(scored, key=lambda t: (t[0], t[1]))
            return Choice(f, d, peak, budget_bytes, -speed)
    where = f"sp={sp}" if sp else f"any sp <= {sp_max or world}"
    raise ValueError(f"memory_features auto: nothing fits {seq_len} tokens at {where} in {budget_bytes / GiB:.1f} GiB "
                     f"per rank less {headroom:.0%} headroom (the leanest set needs {(least or 0) / GiB:.2f} GiB)")


ALL_FEATURES = Features(tiled_mlp=True, tiled_logits=True, checkpoint_every=1, offload_activations=True)  # ALST


def device_budget(gpu_mem_gb: float, mem_cap_gb: float) -> tuple[str, int]:
    """(device, bytes per rank the tensors may use): the GPU's memory (given, or detected) less GPU_RESERVED;
    on a CPU run, the --mem_cap_gb cap less this process' peak RSS so far (interpreter and libraries) and
    CPU_ENGINE_OVERHEAD. CPU peak RSS follows the tensors only with MALLOC_MMAP_THRESHOLD_=65536 (glibc otherwise
    keeps freed blocks: +0.2 GiB measured at 8192 tokens), as scripts/bench_memory.py runs."""
    if gpu_mem_gb > 0:
        return "cuda", int(gpu_mem_gb * GiB) - GPU_RESERVED
    import torch

    if torch.cuda.is_available():
        return "cuda", torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory - GPU_RESERVED
    if mem_cap_gb > 0:
        from training.metrics import peak_rss_bytes

        rss = peak_rss_bytes()
        return "cpu", int(mem_cap_gb * GiB) - rss - CPU_ENGINE_OVERHEAD
    raise ValueError("memory_features auto / sequence_parallel_size auto need the memory per rank: --gpu_mem_gb "
                     "(detected on a GPU) or --mem_cap_gb on a CPU run")


def zero_offloads(ds_path: str, overrides: Mapping) -> dict:
    """{offload_params, offload_optimizer} of the DeepSpeed JSON with a stage's overrides merged in."""
    from training.ds_config import _load, _merge

    zero = _merge(_load(ds_path), dict(overrides)).get("zero_optimization", {})
    return {"offload_params": zero.get("offload_param", {}).get("device") == "cpu",
            "offload_optimizer": zero.get("offload_optimizer", {}).get("device") == "cpu"}


def gpus_per_node(cfg) -> int:
    return cfg.gpus_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or 0
