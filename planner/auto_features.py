"""`memory_features: auto`: per stage, the fastest memory-feature set (and, with `sequence_parallel_size: auto`,
the smallest SP degree) that the planner (planner/memory_model.py) fits in the device memory with headroom.

Candidates: tiled logits, tiled MLP, checkpointing of every K-th decoder layer (K = 1 .. L, one K per number
of checkpointed layers), with or without keeping the attention output of the checkpointed layers, checkpoint
offload (GPU only: on a CPU run it moves nothing). Settings the user wrote
(`tiled_mlp: true`, a stage's `memory_features: {checkpoint_every: 2}`) are pinned: auto only picks the rest.

Speed comes from a recompute cost model, derived in docs/memory_model.md ("Choosing the features"): one step
costs 3 forward passes of FLOPs (forward + backward = 2x forward); checkpointing ceil(L/K) of L layers adds
their forward again (less the attention kernel's with keep_attention), tiled MLP adds the MLP forward of every layer, tiled logits the LM head forward; on a GPU,
checkpoint offload adds a device->host and a host->device copy of each checkpoint at PCIE_BYTES_PER_S, on the
compute stream (not overlapped). relative_speed = time(no feature) / time(features).

ZeRO-3 offloads (GPU runs): the DeepSpeed JSON's `offload_param` / `offload_optimizer` with `"device": "cpu"` is
what auto may use at most: auto keeps it on a stage only where it pays, and never turns on an offload the JSON
leaves off (host and pinned memory are what the user provisioned for). An offload a stage's `deepspeed_overrides`
names (`zero_optimization.offload_param.device`, ...) is pinned: auto leaves it as written. A CPU run keeps the
config's setting (offload moves nothing between memories there). The cost of an offload (`offload_seconds`), per
rank and optimizer step: optimizer offload runs Adam on the host, N/W parameters x ADAM_BYTES_PER_PARAM bytes
touched at CPU_ADAM_BYTES_PER_S shared by the node's ranks, and copies the gradient partition device->host (every
micro-step) and the updated parameters host->device at PCIE_BYTES_PER_S; parameter offload copies the rank's
partition host->device for every forward, backward and recompute pass. The compute time of a step comes from the
FLOP model (planner.flops.flops_per_sequence at MFU x PEAK_TFLOPS). An offload is chosen when nothing
fits without it (needed), or where it pays: the fastest fitting set carries it, because the recompute it lets
auto drop costs more than the offload (free, net of what it saves). The ranking counts the offloads' cost twice,
since CPU_ADAM_BYTES_PER_S is an estimate: an offload wins on speed only if it would still win were CPU Adam half
as fast. The fastest fitting set wins; at equal speed the one with fewer offloads. `choose(...,
free_offloads=...)` names the offloads auto may turn off; the others stay as `offloads` has them.

    from planner.auto_features import choose
    choose(load_shape("llama3-8b"), 131072, world=32, budget_bytes=72 * GiB, sp=None, sp_max=8)
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from base.parallel import check_layout, split_sp
from planner.attention_sp import check_head_chunks, chunk_heads, head_chunk_choices
from planner.comm_model import all_to_all_seconds, members_per_node
from planner.flops import flops_per_sequence
from planner.memory_model import (
    DTYPE_BYTES,
    GRAD_ACCUM_DEFAULT,
    LOGITS_TILE_BYTES,
    Features,
    GiB,
    ModelShape,
    estimate,
    logits_tile_bytes,
)

HEADROOM = 0.10  # keep this fraction of the device memory free (allocator fragmentation, planner error)
GPU_RESERVED = 2 * GiB  # CUDA context, NCCL buffers, the workspace of kernels: not tensors the planner sees
# CPU runs: what the process grows by after the stages are resolved that is not a tensor the planner counts
# (DeepSpeed engine, gloo, CPU Adam): measured peak - RSS at resolution - predicted tensors was 0.059-0.082 GiB in
# the 10 auto runs of bench/peers.py --same_memory (docs/memory_model.md), so 0.10 on top of the 10%
# headroom. It was 0.15 while the planner under-counted RMSNorm's fp32 copies (that error, 0.04-0.05 GiB there,
# was in the margin), and 0.2 before that, which refused 24576 tokens where every feature on peaked at 0.87 GiB.
CPU_ENGINE_OVERHEAD = int(0.10 * GiB)
PCIE_BYTES_PER_S = 25e9  # effective host<->device bandwidth per GPU for checkpoint and ZeRO offload
# CPU Adam (DeepSpeed's DeepSpeedCPUAdam, AVX-512/AVX2) streams memory: per parameter it reads the fp32 master,
# gradient, m and v (16 B), writes master, m and v (12 B) and the compute-dtype copy sent to the device (b B).
ADAM_BYTES_PER_PARAM = 28
# Bytes/s CPU Adam sustains per node, shared by the node's ranks: an ESTIMATE, not measured here (no GPU node):
# half the ~200 GB/s a 2-socket server streams. The order agrees with the ZeRO-Offload paper (Ren et al., ATC'21:
# CPU-Adam updates ~1B parameters in well under a second on a DGX-2 host) and with DeepSpeed PR #7474 (Qwen2.5-3B
# fully offloaded on 2 A100s + 128 cores: 2.4 s per whole step, so >= 3B x 30 B / 2.4 s = 38 GB/s of Adam).
CPU_ADAM_BYTES_PER_S = 100e9
OFFLOAD_KEYS = {"offload_params": "offload_param", "offload_optimizer": "offload_optimizer"}  # Features -> DS key
MFU, PEAK_TFLOPS = 0.4, 989.0  # the H100 bf16 figures training/summary.py quotes
FEATURE_KEYS = ("tiled_mlp", "tiled_logits", "checkpoint_every", "offload_activations", "keep_attention",
                "attention_head_chunks")
# Head chunks (model_utils/head_chunks.py) launch each Ulysses all-to-all n times instead of once. What one launch
# costs beyond its bytes: an ESTIMATE (not measured here, no GPU node): NCCL's small-message all-to-all on 8 NVLink
# GPUs takes a few tens of microseconds; counted exposed (not overlapped with the attention kernel).
A2A_LAUNCH_S = 30e-6


@dataclass(frozen=True)
class Choice:
    """One stage's resolved setting: features, SP degree, predicted peak per rank and relative speed."""

    features: Features  # the memory features (ZeRO offloads: the fields below)
    sp: int
    peak_bytes: int
    budget_bytes: int
    relative_speed: float  # tokens/s relative to the same stage with no memory feature and no offload (1.0)
    offload_params: bool = False  # the ZeRO-3 offloads the stage runs with (chosen, pinned or the config's)
    offload_optimizer: bool = False
    offload_why: str = ""  # why: "needed: ...", "free: ...", "fits: ...", "pinned ...", "the DeepSpeed config ..."
    offload_step_s: float = 0.0  # predicted seconds per step the ZeRO offloads add (CPU Adam + PCIe copies)
    step_s: float = 0.0  # predicted seconds per step in all (FLOP model + recompute + copies + offloads)
    cp: int = 1  # context-parallel factor of sp (the Ulysses factor is sp // cp)

    def as_dict(self) -> dict:
        """The record train.py logs (metrics) and the plan prints."""
        f = self.features
        return {"tiled_mlp": f.tiled_mlp, "tiled_logits": f.tiled_logits, "checkpoint_every": f.every,
                "offload_activations": f.offload_activations, "keep_attention": f.keep_attention, "sp": self.sp,
                "predicted_peak_gb": round(self.peak_bytes / GiB, 3), "budget_gb": round(self.budget_bytes / GiB, 3),
                "predicted_relative_speed": round(self.relative_speed, 3), "logits_tile_mb": f.logits_tile_mb,
                "offload_params": self.offload_params, "offload_optimizer": self.offload_optimizer,
                "offload_why": self.offload_why, "offload_step_s": round(self.offload_step_s, 3),
                "predicted_step_s": round(self.step_s, 3), "cp": self.cp, "ulysses": self.sp // self.cp,
                "attention_head_chunks": f.attention_head_chunks, "ring_attention": f.ring_attention}


def describe_offloads(params: bool, optimizer: bool) -> str:
    """'optimizer', 'params', 'params, optimizer' or 'none': the ZeRO-3 CPU offloads a stage runs with."""
    return ", ".join(n for n, on in (("params", params), ("optimizer", optimizer)) if on) or "none"


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
    if f.attention_head_chunks > 1:
        parts.append(f"attention in {f.attention_head_chunks} head chunks")
    if f.ring_attention:
        parts.append("context-parallel K/V in a ring")
    return ", ".join(parts) or "none"


def offload_seconds(shape: ModelShape, world: int, f: Features, device: str = "cuda", precision: str = "bf16",
                    ranks_per_node: int = 8, accum: int = 1) -> float:
    """Seconds per optimizer step (of `accum` micro-steps) that the ZeRO-3 CPU offloads in `f` add to one GPU rank
    (0 on a CPU run: nothing moves). See the module docstring for the terms."""
    if device != "cuda" or not (f.offload_params or f.offload_optimizer):
        return 0.0
    b, n = DTYPE_BYTES[precision], shape.num_params() / world  # the rank's partition
    t = 0.0
    if f.offload_optimizer:
        t += n * (ADAM_BYTES_PER_PARAM + b) / (CPU_ADAM_BYTES_PER_S / max(1, ranks_per_node))  # CPU Adam
        t += accum * n * b / PCIE_BYTES_PER_S  # the reduced gradient partition to the host, every micro-step
    if f.offload_params:
        L = shape.num_layers
        passes = 2 + (math.ceil(L / f.every) / L if f.every else 0)  # forward, backward, recompute of ckpt layers
        t += accum * passes * n * b / PCIE_BYTES_PER_S
    if f.offload_optimizer != f.offload_params:  # the updated parameters cross once: to the device or to the host
        t += n * b / PCIE_BYTES_PER_S
    return t


def head_chunk_seconds(shape: ModelShape, seq_len: int, sp: int, f: Features, precision: str = "bf16",
                       mfu: float = MFU, peak_tflops: float = PEAK_TFLOPS, cp: int = 1, ranks_per_node: int = 8) -> float:
    """Seconds per sequence that running attention in f.attention_head_chunks chunks adds (0 for 1 chunk), on one
    rank (model_utils/head_chunks.py's cost notes):
    - backward recomputes each chunk's q/k/v projections (2 s h d (nh + 2 n hkv) FLOPs per layer), and a chunk
      narrower than a GQA group projects its KV head once per chunk (forward + backward of n hkv - nkv extra heads);
    - under Ulysses (u > 1) the chunk's q/k/v all-to-all and the output's all-to-all back run once more in
      backward (comm_model.all_to_all_seconds of the rank's bytes), and every all-to-all is launched n times,
      each 1/n the bytes: 6n - 4 launches more per layer (forward 2, backward 2 + the re-sent 2, per chunk), 2(n - 1)
      more in a checkpointed layer's recompute, A2A_LAUNCH_S each. Counted exposed (not overlapped)."""
    n = f.attention_head_chunks
    if n <= 1:
        return 0.0
    s, h, d, L = seq_len, shape.hidden_size, shape.head_dim, shape.num_layers
    hq, hkv = chunk_heads(shape.num_heads, shape.num_kv_heads, n)
    flops = 2.0 * s * h * d * (shape.num_heads + 2 * n * hkv) + 3 * 2.0 * s * h * d * 2 * max(0, n * hkv - shape.num_kv_heads)
    t = L * flops / (sp * mfu * peak_tflops * 1e12)
    u = sp // cp
    if u > 1:
        b, tokens = DTYPE_BYTES[precision], math.ceil(s / sp)
        per_node = members_per_node(u, 1, ranks_per_node)
        qkv = n * tokens * (hq + 2 * max(hkv, u if u > hkv else 0)) * d * b
        out = tokens * shape.num_heads * d * b
        launches = L * (6 * n - 4) + (math.ceil(L / f.every) * 2 * (n - 1) if f.every else 0)
        t += L * (all_to_all_seconds(qkv, u, per_node) + all_to_all_seconds(out, u, per_node)) + launches * A2A_LAUNCH_S
    return t


def recompute_flops(shape: ModelShape, seq_len: int, f: Features, layer_params: int) -> tuple[float, float]:
    """FLOPs the memory features of `f` add to one sequence's step: (matmuls, causal attention forward). A
    checkpointed layer's forward again (`layer_params` weights a token multiplies by; its attention too unless
    `keep_attention`), a tiled MLP's forward in its backward, tiled logits' forward. Both callers (step_seconds,
    planner/mfu_bound) pass active_layer_params(): a recomputed MoE layer runs each token through its routed
    experts only, as its first forward did (flops_per_sequence's matmul_params counts the same)."""
    s, L = seq_len, shape.num_layers
    matmul = attention = 0.0
    if f.every:
        recomputed = math.ceil(L / f.every)
        matmul += recomputed * 2.0 * layer_params * s
        full = shape.causal_attention_layers(s, range(0, L, f.every))  # the checkpointed layers, windows counted
        attention += 0.0 if f.keep_attention else full * 2.0 * shape.num_heads * shape.head_dim * s * s
    if f.tiled_mlp:
        matmul += L * 2.0 * 3 * shape.hidden_size * shape.intermediate_size * s
    if f.tiled_logits:
        matmul += 2.0 * shape.vocab_size * shape.hidden_size * s
    return matmul, attention


def step_seconds(shape: ModelShape, seq_len: int, sp: int, f: Features, device: str = "cuda",
                 precision: str = "bf16", mfu: float = MFU, peak_tflops: float = PEAK_TFLOPS, *,
                 world: int | None = None, ranks_per_node: int = 8, accum: int = 1, cp: int = 1) -> dict[str, float]:
    """Predicted seconds of one optimizer step (`accum` micro-batches of one sequence per SP group) on one rank:
    {"base": no feature, no offload; "compute": with the recompute of `f` and the head chunks' cost
    (head_chunk_seconds; cp: the context-parallel factor of sp); "copies": checkpoint offload;
    "offload": the ZeRO-3 offloads (offload_seconds; world defaults to sp); "total"}."""
    s, h, L = seq_len, shape.hidden_size, shape.num_layers
    base = flops_per_sequence(shape, s)  # 3 x forward FLOPs
    extra = sum(recompute_flops(shape, s, f, shape.active_layer_params()))
    rate = sp * mfu * peak_tflops * 1e12  # per step, the SP group shares the sequence
    copy_s = 0.0
    if f.offload_activations and f.every and device == "cuda":
        hid = math.ceil(s / sp) * h * DTYPE_BYTES[precision]
        copy_s = 2 * math.ceil(L / f.every) * hid / PCIE_BYTES_PER_S
    chunk_s = head_chunk_seconds(shape, seq_len, sp, f, precision, mfu, peak_tflops, cp, ranks_per_node)
    out = {"base": accum * base / rate, "compute": accum * ((base + extra) / rate + chunk_s), "copies": accum * copy_s,
           "offload": offload_seconds(shape, world or sp, f, device, precision, ranks_per_node, accum)}
    out["total"] = out["compute"] + out["copies"] + out["offload"]
    return out


def relative_speed(shape: ModelShape, seq_len: int, sp: int, f: Features, device: str = "cuda",
                   precision: str = "bf16", mfu: float = MFU, peak_tflops: float = PEAK_TFLOPS, *,
                   world: int | None = None, ranks_per_node: int = 8, accum: int = 1, cp: int = 1) -> float:
    """time(no feature, no offload) / time(f) for one step, from the recompute, copy and offload cost model."""
    t = step_seconds(shape, seq_len, sp, f, device, precision, mfu, peak_tflops, world=world,
                     ranks_per_node=ranks_per_node, accum=accum, cp=cp)
    return t["base"] / t["total"]


def peak_bytes(shape: ModelShape, seq_len: int, sp: int, world: int, f: Features, offloads: Features,
               precision: str, device: str, cp: int = 1) -> int:
    """Predicted peak of one rank: on a GPU the device peak; on a CPU everything shares the host RAM, so the
    ZeRO-3 CPU offloads count too (planner.memory_model.predict_peak_bytes' rule)."""
    return _peaks(shape, seq_len, sp, world, f, offloads, precision, device, cp)[0]


def _peaks(shape, seq_len, sp, world, f, offloads, precision, device, cp=1) -> tuple[int, int]:
    """(peak of one rank as in peak_bytes, host bytes of one rank: offloaded states and checkpoints).
    `offloads` carries the run's settings auto does not choose: the ZeRO-3 offloads, the lean RMSNorm and MLP."""
    feats = replace(f, offload_params=offloads.offload_params, offload_optimizer=offloads.offload_optimizer,
                    lean_rmsnorm=offloads.lean_rmsnorm, lean_mlp=offloads.lean_mlp)
    est = estimate(shape, seq_len, sp, world, feats, precision, cp=cp, device=device, grad_accum=GRAD_ACCUM_DEFAULT)
    host = sum(est.cpu_per_rank.values())
    return est.gpu_peak + (host if device == "cpu" else 0), host


def candidates(num_layers: int, pinned: Mapping, device: str, chunks: Iterable[int] = (1,),
               no_tiled_mlp: str = "") -> list[Features]:
    """Every feature set that honours `pinned` ({name: value} the user wrote). One K per count of
    checkpointed layers (the smallest K that gives it); offload only with checkpointing, and on GPU; attention in
    each of `chunks` head chunks (a pinned attention_head_chunks: that count only). `no_tiled_mlp`: why the model's
    MLP cannot be tiled (ModelShape.no_tiled_mlp: an MoE block), then no set tiles it and a pinned tiled_mlp is a
    one-line ValueError (it was offered, and the stage's engine refused it after the earlier stages had trained)."""
    if no_tiled_mlp and pinned.get("tiled_mlp"):
        raise ValueError(f"tiled_mlp: {no_tiled_mlp}; drop tiled_mlp (--tiled_mlp, a stage's memory_features)")
    ks, counts = [], set()
    for k in range(1, num_layers + 1):
        if math.ceil(num_layers / k) not in counts:
            counts.add(math.ceil(num_layers / k))
            ks.append(k)
    opts = {"tiled_logits": [False, True], "tiled_mlp": [False] if no_tiled_mlp else [False, True],
            "checkpoint_every": [0, *ks],
            "offload_activations": [False, True] if device == "cuda" else [False], "keep_attention": [False, True],
            "attention_head_chunks": list(chunks)}
    for key, value in pinned.items():
        opts[key] = [int(value) if key in ("checkpoint_every", "attention_head_chunks") else bool(value)]
    out = []
    for tl, tm, k0, off, keep, n in itertools.product(*(opts[n] for n in (
            "tiled_logits", "tiled_mlp", "checkpoint_every", "offload_activations", "keep_attention",
            "attention_head_chunks"))):
        k = k0
        if (off or keep) and not k:
            if pinned.get("offload_activations") or pinned.get("keep_attention"):  # pinned on: they imply K=1
                k = 1
            else:
                continue
        out.append(Features(tiled_logits=tl, tiled_mlp=tm, checkpoint_every=k, offload_activations=off,
                            keep_attention=keep, attention_head_chunks=n))
    return list(dict.fromkeys(out))


def sp_degrees(shape: ModelShape, world: int, seq_len: int, sp_max: int) -> list[int]:
    """Pure-Ulysses SP degrees possible on `world` ranks (base.parallel.check_layout's rule), at most sp_max."""
    return [sp for sp, _ in sp_splits(shape, world, seq_len, sp_max, cp=1)]


def sp_splits(shape: ModelShape, world: int, seq_len: int, sp_max: int, cp: int | str = 1,
              gpus_per_node: int | None = None) -> list[tuple[int, int]]:
    """(sp, cp) pairs possible on `world` ranks, sp <= sp_max ascending (base.parallel.check_layout's rule). cp an
    int: that context-parallel factor (1: pure Ulysses, sp must suit the heads); "auto": every sp dividing the
    world, split by base.parallel.split_sp (Ulysses as large as the heads and `gpus_per_node` allow)."""
    cp = 1 if cp == "auto" and shape.linear_layers else cp  # gated delta-net layers refuse cp (linear_attention.py)
    ok = []
    for sp in range(1, min(world, sp_max) + 1):
        try:
            c = split_sp(sp, shape.num_heads, shape.num_kv_heads, gpus_per_node)[1] if cp == "auto" else int(cp)
            check_layout(world, sp, shape.num_heads, shape.num_kv_heads, seq_len, cp=c)
            ok.append((sp, c))
        except ValueError:
            pass
    return ok


def head_chunk_options(shape: ModelShape, ulysses: int, pinned: int | str = "auto",
                       explicit_sp: bool = False) -> list[int]:
    """The attention_head_chunks counts auto tries at Ulysses factor `ulysses`: a pinned count (an int) alone, [] where
    it does not split the heads per rank (a one-line ValueError instead when the SP degree is the user's); "auto":
    every valid count (planner.attention_sp.head_chunk_choices), or [1] for a family model_utils/head_chunks.py
    cannot chunk (ModelShape.head_chunks_ok: latent attention, GPT-OSS's sinks, OLMo-2/3's q/k norms over all heads,
    Phi-3's fused qkv_proj, ...; it used to offer them chunks, and the first chunked forward crashed). A pinned
    count > 1 for such a family: a one-line ValueError (model_utils/families.check_supported refuses it too)."""
    unchunkable = getattr(shape, "kv_lora_rank", 0) or shape.model_type == "gpt_oss" or not shape.head_chunks_ok
    if pinned in ("auto", None, 0):
        return [1] if unchunkable else head_chunk_choices(shape.num_heads, shape.num_kv_heads, ulysses)
    if int(pinned) > 1 and unchunkable:
        raise ValueError(f"attention_head_chunks {int(pinned)}: {shape.model_type} "
                         f"{shape.no_head_chunks or 'cannot run in head chunks'}; use attention_head_chunks 1 (or auto)")
    ok = head_chunk_choices(shape.num_heads, shape.num_kv_heads, ulysses)
    if int(pinned) not in ok:
        if explicit_sp:
            check_head_chunks(int(pinned), shape.num_heads, shape.num_kv_heads, ulysses)
        return []
    return [int(pinned)]


def choose(shape: ModelShape, seq_len: int, world: int, budget_bytes: int, *, sp: int | None,
           sp_max: int | None = None, pinned: Mapping | None = None, offloads: Features | None = None,
           precision: str = "bf16", device: str = "cuda", headroom: float = HEADROOM,
           host_bytes_per_rank: int | None = None, free_offloads: Iterable[str] = (), ranks_per_node: int = 8,
           accum: int = 1, cp: int | str = "auto") -> Choice:
    """The fastest candidate whose predicted peak, plus `headroom` of the budget, fits in budget_bytes; at `sp`,
    or (sp=None) at the smallest degree <= sp_max where anything fits. Ties: fewer ZeRO offloads, then the smaller
    peak. Attention head chunks (model_utils/head_chunks.py) are tried at every count that splits a degree's heads
    per rank (`pinned["attention_head_chunks"]`, an int, pins one); they cost time (head_chunk_seconds), so a
    count > 1 wins only where it is the cheapest way to fit. `offloads` holds the ZeRO-3 offloads (and lean norm / MLP) as the run has them; `free_offloads` names
    those of them ("offload_params", "offload_optimizer") auto may also turn off (each is tried on and off, its
    cost in the speed: step_seconds with `world`, `ranks_per_node` sharing CPU Adam, `accum` micro-steps per
    optimizer step). On a GPU, `host_bytes_per_rank` (CPU memory of a node / its ranks, less the runtime) also
    bounds what the ZeRO-3 and checkpoint offloads put in host memory. One-line ValueError when nothing fits.
    Tiled logits run tiles of `pinned["logits_tile_mb"]` MiB when given, else of
    planner.memory_model.logits_tile_bytes(budget_bytes). `cp`: the context-parallel factor of each degree tried
    ("auto", as context_parallel_size's default: base.parallel.split_sp with `ranks_per_node`, Ulysses as large as
    the heads and a node allow, so a degree the heads do not divide is split u x cp; an int: that factor, 1 being
    pure Ulysses); the Choice carries it (Choice.cp)."""
    cp = 1 if cp == "auto" and shape.linear_layers else cp  # gated delta-net layers refuse cp (linear_attention.py)
    pinned = dict(pinned or {})
    tile_mb = int(pinned.pop("logits_tile_mb", 0) or 0) or logits_tile_bytes(budget_bytes) // 2**20
    chunk_pin = pinned.pop("attention_head_chunks", "auto")
    usable = usable_bytes(budget_bytes, headroom)
    if sp:
        degrees = [(sp, split_sp(sp, shape.num_heads, shape.num_kv_heads, ranks_per_node)[1] if cp == "auto"
                    else int(cp))]
    else:
        degrees = sp_splits(shape, world, seq_len, sp_max or world, cp, ranks_per_node)
    fixed = offloads or Features()
    free = [n for n in OFFLOAD_KEYS if n in set(free_offloads)]
    sets = [dict(zip(free, bits)) for bits in itertools.product((False, True), repeat=len(free))]
    least = None
    for d, c in degrees:
        chunks = head_chunk_options(shape, d // c, chunk_pin, explicit_sp=bool(sp))
        if not chunks:
            continue  # the pinned count does not split this degree's heads per rank
        cands = [replace(f, logits_tile_mb=tile_mb) if f.tiled_logits else f
                 for f in candidates(shape.num_layers, pinned, device, chunks, shape.no_tiled_mlp)]
        # cp K/V in a ring (model_utils/ring_attention.py): tried under cp > 1, taken only where no gather set fits
        rings = [bool(pinned["ring_attention"])] if "ring_attention" in pinned else [False, True] if c > 1 else [False]
        cands = [replace(f, ring_attention=r and c > 1) for r in rings for f in cands]
        scored, lean = [], {}  # lean: the leanest peak per set of free offloads turned on
        for o in sets:
            off = replace(fixed, **o)
            n_on = sum(o.values())
            on = tuple(n for n in free if o[n])
            for f in cands:
                peak, host = _peaks(shape, seq_len, d, world, f, off, precision, device, c)
                least = peak if least is None else min(least, peak)
                lean[on] = min(lean.get(on, peak), peak)
                if peak <= usable and (device == "cpu" or host_bytes_per_rank is None or host <= host_bytes_per_rank):
                    t = step_seconds(shape, seq_len, d, replace(f, offload_params=off.offload_params,
                                                                offload_optimizer=off.offload_optimizer),
                                     device, precision, world=world, ranks_per_node=ranks_per_node, accum=accum,
                                     cp=c)
                    # ranked on a pessimistic time, the offloads' cost counted twice (CPU_ADAM_BYTES_PER_S is an
                    # estimate): an offload the fit does not need is taken only where it pays even then
                    scored.append((-t["base"] / (t["total"] + t["offload"]), n_on, peak, f, off, t))
        if any(not s[3].ring_attention for s in scored):  # the gather fits: keep it (the ring sends 2x in backward)
            scored = [s for s in scored if not s[3].ring_attention]
        if scored:
            _, n_on, peak, f, off, t = min(scored, key=lambda c: c[:3])
            speed = t["base"] / t["total"]
            why = ""
            if free and n_on:
                without = [c for c in scored if not c[1]]
                if without:
                    t0 = min(without, key=lambda c: c[:3])[5]
                    why = f"pays: {speed:.3f} of no-feature speed with it, {t0['base'] / t0['total']:.3f} without"
                else:
                    on = tuple(n for n in free if getattr(off, n))
                    subsets = [k for k in lean if k and k != on and set(k) < set(on)]
                    why = f"needed: {lean[()] / GiB:.1f} GiB without" + "".join(
                        f", {lean[k] / GiB:.1f} GiB with {describe_offloads(*(n in k for n in OFFLOAD_KEYS))} alone"
                        for k in subsets) + f" > {usable / GiB:.1f} GiB usable"
            elif free:
                why = f"fits: {peak / GiB:.1f} of {usable / GiB:.1f} GiB usable"
            return Choice(f, d, peak, budget_bytes, speed, offload_params=off.offload_params,
                          offload_optimizer=off.offload_optimizer, offload_why=why, offload_step_s=t["offload"],
                          step_s=t["total"], cp=c)
    where = f"sp={sp}" if sp else f"any sp <= {sp_max or world}"
    raise ValueError(f"memory_features auto: nothing fits {seq_len} tokens at {where} in {budget_bytes / GiB:.1f} GiB "
                     f"per rank less {headroom:.0%} headroom (the leanest set needs {(least or 0) / GiB:.2f} GiB)")


def gpu_budget(gpu_mem_gb: float) -> int:
    """Bytes per rank the tensors may use on a GPU of `gpu_mem_gb` GB: less GPU_RESERVED (context, NCCL, workspaces).
    One-line ValueError for nan / inf (a flag's value: plan.py's and train.py's --gpu_mem_gb)."""
    if not math.isfinite(gpu_mem_gb):
        raise ValueError(f"--gpu_mem_gb {gpu_mem_gb:g}: give the GPU's memory in GB, a finite number (H100: 80)")
    return int(gpu_mem_gb * GiB) - GPU_RESERVED


def usable_bytes(budget_bytes: int, headroom: float = HEADROOM) -> int:
    """THE headroom rule: the most a predicted peak may be on a rank whose budget is `budget_bytes` (gpu_budget, or a
    CPU run's cap less its start-up RSS): the budget less `headroom` of it. `choose` (every run's start-up, through
    training/curriculum.device_budget) and scripts/plan.py (its fits, longest lengths and --compare) both use it, so
    a length the planner shows is one a run accepts. An 80 GiB GPU: (80 - 2) x 0.9 = 70.2 GiB."""
    return int(budget_bytes * (1 - headroom))


ALL_FEATURES = Features(tiled_mlp=True, tiled_logits=True, checkpoint_every=1, offload_activations=True)  # ALST


def zero_offloads(zero: Mapping) -> dict:
    """{offload_params, offload_optimizer} of a `zero_optimization` block (the JSON's, a stage's overrides merged)."""
    devices = offload_devices(zero)
    return {n: devices[n] == "cpu" for n in OFFLOAD_KEYS}


def offload_devices(zero: Mapping) -> dict:
    """{offload_params, offload_optimizer: the `device` ("cpu", "nvme", "none")} of a `zero_optimization` block;
    "none" where the block or its device is absent."""
    return {n: str((zero.get(key) or {}).get("device") or "none") for n, key in OFFLOAD_KEYS.items()}


def pinned_offloads(overrides: Mapping | None) -> dict:
    """{offload_params / offload_optimizer: device} that a stage's deepspeed_overrides names explicitly: pinned."""
    zero = (overrides or {}).get("zero_optimization") or {}
    return {n: str(zero[key]["device"]) for n, key in OFFLOAD_KEYS.items()
            if isinstance(zero.get(key), Mapping) and "device" in zero[key]}


def offload_plan(json_zero: Mapping, overrides: Mapping | None, device: str, auto: bool) -> tuple[list[str], str]:
    """(the offloads auto may choose for a stage, what decides the others): free are the offloads the DeepSpeed
    JSON puts on the CPU that the stage's overrides do not name, on a GPU run under memory_features auto."""
    json_dev, pins = offload_devices(json_zero), pinned_offloads(overrides)
    if device != "cuda":
        return [], "the DeepSpeed config's: a CPU run moves nothing between memories"
    if not auto:
        return [], "the DeepSpeed config's (memory_features manual)"
    free = [n for n in OFFLOAD_KEYS if json_dev[n] == "cpu" and n not in pins]
    short = {"offload_params": "params", "offload_optimizer": "optimizer"}
    notes = [f"{short[n]} pinned to {pins[n]} by the stage's deepspeed_overrides" for n in OFFLOAD_KEYS if n in pins]
    kept = [n for n in OFFLOAD_KEYS if n not in pins and json_dev[n] != "cpu"]
    off = [short[n] for n in kept if json_dev[n] == "none"]
    if off:
        notes.append(f"the DeepSpeed config does not offload {' or '.join(off)} (auto only turns offloads off)")
    notes += [f"{short[n]} on {json_dev[n]} as the DeepSpeed config says" for n in kept if json_dev[n] != "none"]
    return free, "; ".join(notes)


def offload_overrides(choice: Choice, free: Iterable[str]) -> dict:
    """The deepspeed_overrides that carry auto's offload choice to the engine: {"zero_optimization":
    {"offload_param": {"device": "cpu" | "none"}, ...}} for the free offloads; {} when there are none."""
    zero = {OFFLOAD_KEYS[n]: {"device": "cpu" if getattr(choice, n) else "none"} for n in OFFLOAD_KEYS if n in set(free)}
    return {"zero_optimization": zero} if zero else {}


