"""Memory of one ZeRO-3 + Ulysses training step, per GPU and per node: pure arithmetic on shapes (its FLOPs:
planner/flops.py).

Shared by `scripts/plan.py` (the planner) and the tests; no torch or transformers import. One decoder layer's
terms are planner/layer_terms.py's (re-exported here). Every term is derived in docs/memory_model.md, whose
notation the code follows:
    T = tokens per rank (ceil(seq_len / sp); 2*ceil(seq_len / 2sp) under context parallelism), S = T * sp (the padded
    sequence), sp = u * cp (Ulysses factor u splits heads, context-parallel factor cp splits the sequence), h = hidden size,
    I = MLP intermediate size, V = vocab, L = layers, nh / nkv = query / KV heads, d = head dim,
    b = bytes per element of the compute dtype (bf16: 2, fp32: 4), W = world size, N = parameters.
All sizes are bytes. The model is a decoder-only LM with a gated (SwiGLU) MLP and RMSNorm, which covers
the Llama / Qwen2 / Qwen3 families; attention is flash or SDPA-flash, so there is no S^2 score matrix.

    from planner.memory_model import predict_peak_bytes, load_shape
    predict_peak_bytes(load_shape("tiny-llama"), seq_len=1024, sp=2, features={"tiled_mlp"})
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace

from base.parallel import check_layout
from planner.attention_sp import (  # noqa: F401  (re-exported: the attention-under-SP terms live there)
    attention_split,
    attention_tensor_bytes,
    chunk_split,
    chunked_attention_bytes,
    cp_kv_buffer_bytes,
    gqa_expanded_grad_bytes,
    kept_attention_bytes,
    kv_length,
)
from planner.layer_terms import (  # noqa: F401  (re-exported: one decoder layer's phase terms live there)
    MLP_MIN_TILE_TOKENS,
    NORM_CHUNK_BYTES,
    NORM_MIN_CHUNK_ROWS,
    NORM_MIN_CHUNKS,
    layer_activations,
    layer_phase_terms,
    mlp_tiles,
    norm_chunk_rows,
    norm_saved,
)
from planner.shapes import (  # noqa: F401  (re-exported: callers import them from here)
    DTYPE_BYTES,
    LEAN_MLP_MODEL_TYPES,
    LEAN_RMSNORM_MODEL_TYPES,
    Features,
    ModelShape,
    load_shape,
)
from planner.zero3_host import (  # noqa: F401  (re-exported: ZeRO-3's host terms live there)
    PINNED_NO_LIMIT,
    ZERO_SUBGROUP,
    grad_accum_dtype,
    pinned_block_bytes,
    pinned_round_limit,
    zero3_partitions,
    zero3_pinned_requests,
    zero3_state_terms,
    zero3_subgroups,
)

GiB = 2**30
GRAD_ACCUM_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}  # data_types.grad_accum_dtype -> bytes per gradient element
GRAD_ACCUM_DEFAULT = "fp32"  # what training/ds_config.build_ds_config sets when the config leaves it out (bf16 too)
LOGITS_TILE_BYTES = 2**30  # tiled logits: shards of ~1 GiB of fp32 logits (ArcticTraining's rule; shapes.py has the same) ...
LOGITS_TILE_BUDGET_SHARE = 64  # ... under memory_features auto at most 1/64 of the per-rank budget (logits_tile_bytes)
# The runtime does not pin the offloaded layer checkpoints nor the async save's copy of GPU-resident states through
# that allocator: base/host_arena.py page-locks pageable memory of their exact size in place (cudaHostRegister), so
# the host holds them as bytes (to a 4 KiB page). False: count them as torch's pinned blocks, as the runtime's
# fallback holds them where registration fails (one warning line on that rank).
HOST_ARENA = True


def parse_seq_len(text: str | int) -> int:
    """'131072', '128k', '1M', '15_000_000', '1.5k' -> tokens; k and M are binary (128k = 131072, 1M = 1048576), a
    fraction of them rounded as always (0.1M = 104858). One-line ValueError for anything else: no number, inf / nan, a
    fraction of a token (1.5), under 1."""
    s = str(text).strip().replace("_", "").lower()
    scale = {"k": 2**10, "m": 2**20}.get(s[-1:], 1)
    num = s[:-1] if scale > 1 else s
    try:
        tokens = float(num) * scale
    except ValueError:
        tokens = math.nan
    if not math.isfinite(tokens) or (scale == 1 and tokens != int(tokens)):  # inf, nan, 1.5: no whole number
        raise ValueError(f"sequence length {text!r}: write a whole number of tokens as 131072, 128k or 1M")
    tokens = round(tokens)
    if tokens < 1:
        raise ValueError(f"sequence length {text!r} must be at least 1 token")
    return int(num) * scale if num.lstrip("+-").isdigit() else int(tokens)  # digits exactly, past float's 2**53


def positive_flag(flag: str, value: float, fix: str = "use a number > 0", zero_ok: bool = False) -> float:
    """`value` of the command-line `flag` when finite and > 0 (>= 0 with `zero_ok`), else a one-line ValueError naming
    the flag, the value and `fix`: nan / inf would reach the arithmetic as NaN tables or an int() overflow."""
    if not (math.isfinite(value) and (value >= 0 if zero_ok else value > 0)):
        raise ValueError(f"--{flag.lstrip('-')} {value:g}: {fix}")
    return value


def logits_tiles(tokens: int, vocab: int, tile_bytes: int | None = None) -> int:
    """Tiled logits+loss shard count: ~tile_bytes (default LOGITS_TILE_BYTES) of fp32 logits per shard, at most
    one per token (model_utils/tiled_loss.logits_tiles at micro-batch 1)."""
    return max(1, min(tokens, math.ceil(tokens * vocab * 4 / (tile_bytes or LOGITS_TILE_BYTES))))


def logits_tile_bytes(budget_bytes: int) -> int:
    """The logits tile memory_features auto uses: 1/LOGITS_TILE_BUDGET_SHARE of the per-rank budget, at most
    LOGITS_TILE_BYTES, at least 1 MiB. Training holds three fp32 buffers of a tile (12 B per logit), so the
    logits phase stays under 5% of the budget. An 80 GB GPU keeps ArcticTraining's 1 GiB tile (Llama-3, vocab
    128256: 2093 rows per tile); a 24 GB one gets 0.34 GiB tiles (700 rows), a 1 GiB CPU test cap 8 MiB."""
    return max(2**20, min(LOGITS_TILE_BYTES, budget_bytes // LOGITS_TILE_BUDGET_SHARE))


@dataclass
class Estimate:
    """Per-rank GPU terms, per-rank CPU terms and the peak rule; bytes throughout."""

    seq_len: int
    sp: int
    world: int
    tokens_per_rank: int
    gpu: dict[str, int]  # resident for the whole step
    gpu_phases: dict[str, int]  # only one of these is live at a time; the peak adds the largest
    cpu_per_rank: dict[str, int]
    gpus_per_node: int
    # evaluation (forward without autograd): its working set replaces the step's activations and phases
    eval_phases: dict[str, int] = field(default_factory=dict)
    cp: int = 1  # context-parallel factor of sp; the Ulysses factor is sp // cp

    @property
    def ulysses(self) -> int:
        return self.sp // self.cp

    @property
    def gpu_peak(self) -> int:
        return sum(self.gpu.values()) + max(self.gpu_phases.values())

    @property
    def peak_phase(self) -> str:
        return max(self.gpu_phases, key=self.gpu_phases.get)

    @property
    def cpu_per_node(self) -> int:
        return sum(self.cpu_per_rank.values()) * self.gpus_per_node

    @property
    def eval_gpu_peak(self) -> int:
        """Peak of an evaluation forward: the resident terms without the step's activations (none are saved
        without autograd) plus the larger eval phase. 0 when no eval phase was estimated."""
        if not self.eval_phases:
            return 0
        resident = sum(v for k, v in self.gpu.items() if not k.startswith(ACTIVATION_TERMS))
        return resident + max(self.eval_phases.values())

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(gpu_peak=self.gpu_peak, peak_phase=self.peak_phase, cpu_per_node=self.cpu_per_node,
                   ulysses=self.ulysses)
        if self.eval_phases:
            out.update(eval_gpu_peak=self.eval_gpu_peak)
        return out


ACTIVATION_TERMS = ("saved activations", "activation checkpoints")  # prefixes of the step-only resident terms


def linear_attention_bytes(shape: ModelShape, seq_len: int, sp: int, chunk: int = 64) -> int:
    """Working set of one gated delta-net layer (Qwen3-Next, Qwen3.5: model_utils/linear_attention.py) on a rank,
    which after its all-to-all holds the FULL sequence S for nv/sp value heads: the recurrent state [nv/sp, dk, dv]
    at every chunk boundary (S/C of them; the chunked kernels keep them for backward) and, per token and head, the
    chunk buffers (the [C] decay / UT-system row, the corrected values and the decayed keys), fp32. Counted once
    (one layer at a time). Qwen3-Next-80B at 1M tokens, SP 8: 4 GiB of states + 7 GiB of buffers."""
    if not shape.linear_layers:
        return 0
    hv, dk, dv = shape.linear_v_heads // sp, shape.linear_k_dim, shape.linear_v_dim
    chunks = -(-seq_len // chunk)
    return 4 * hv * (chunks * dk * dv + chunks * chunk * (chunk + 2 * dv + dk))


def tokens_per_rank(seq_len: int, sp: int, cp: int = 1) -> int:
    """T: a sample is padded to a multiple of sp, or of 2*sp under context parallelism (zigzag: 2*cp chunks, each
    cut over the u ranks of a Ulysses group; base.parallel.ParallelDims.seq_multiple)."""
    return 2 * math.ceil(seq_len / (2 * sp)) if cp > 1 else math.ceil(seq_len / sp)


def lean_norm_applies(shape: ModelShape, f: Features) -> bool:
    """Whether the step runs the lean RMSNorm: asked for, and the family's norm is Llama's formula."""
    return f.lean_rmsnorm and shape.model_type in LEAN_RMSNORM_MODEL_TYPES


def lean_mlp_applies(shape: ModelShape, f: Features) -> bool:
    """Whether the step runs the lean gated MLP: asked for, and the family's MLP is Llama's formula."""
    return f.lean_mlp and shape.model_type in LEAN_MLP_MODEL_TYPES


def logits_bytes(shape: ModelShape, tokens: int, b: int, tiled: bool, lean_norm: bool = False,
                 tile_bytes: int | None = None) -> int:
    """Logits and loss on one rank: the backward's three fp32 buffers per logit row, the final norm, d(hidden)."""
    rows = math.ceil(tokens / logits_tiles(tokens, shape.vocab_size, tile_bytes)) if tiled else tokens
    # backward of cross-entropy: the fp32 log-softmax it saved, nll_loss's gradient and log-softmax's (4 B each);
    # the forward's lm_head output + fp32 upcast + log-softmax (b + 4 + 4, or 4 + 4 in fp32) is smaller, and the
    # forward's logits are dropped before backward (training.step.loss_sum returns only the loss)
    per_elem = 12
    # the tiled loss sums the head's per-tile gradients in fp32 (model_utils/tiled_loss.TileGradSum): Llama-3 2 GiB
    grad_sum = 4 * shape.vocab_size * shape.hidden_size if tiled and b < 4 and rows < tokens else 0
    return rows * shape.vocab_size * per_elem + norm_saved(tokens, shape.hidden_size, b, lean_norm) + \
        tokens * shape.hidden_size * b + grad_sum


def eval_tile_rows(tokens: int, vocab: int, tile_bytes: int = LOGITS_TILE_BYTES) -> int:
    """Rows (tokens) of one evaluation logits tile: model_utils/tiled_loss.logits_tiles at micro-batch 1."""
    return math.ceil(tokens / logits_tiles(tokens, vocab, tile_bytes))


def eval_phases(shape: ModelShape, seq_len: int, sp: int, b: int, tiled: bool = True, tiled_mlp: bool = False,
                tile_bytes: int = LOGITS_TILE_BYTES, cp: int = 1) -> dict[str, int]:
    """Transient bytes of one evaluation forward on one rank (no autograd: nothing is saved for backward, no
    gradient exists), as two phases of which one is live at a time:

    - one decoder layer: the hidden state carried between layers, its norm, then either attention (q, k, v, o at
      the full sequence with heads/sp after the all-to-all, o back in [T, nh*d]; the all-to-all staging buffer
      is among the resident terms) or the gated MLP (gate, up, act(gate)*up of [rows, I]; rows = one TiledMLP
      tile with --tiled_mlp);
    - the logits tile (model_utils/tiled_loss._stats): lm_head output (b), its fp32 upcast (4, bf16 only),
      cross-entropy's fp32 log-softmax (4) and the contiguous copy of it that nll_loss makes for the
      [bs, V, tile] layout `_stats` passes (4; measured, see docs/memory_model.md), plus the last hidden
      state and its final norm.
    `tiled=False` is the old evaluation (the whole [T, V] logits of the shard). cp: as in layer_activations (q, o
    for S/cp tokens, k, v gathered for all S)."""
    tokens = tokens_per_rank(seq_len, sp, cp)
    h, inter = shape.hidden_size, shape.intermediate_size
    hid = tokens * h * b
    attn = attention_tensor_bytes(shape, tokens, sp, b, cp)  # q, o [S/cp, nh/u, d]; k, v [S, kv_loc, d]
    o_back = tokens * shape.num_heads * shape.head_dim * b
    rows = math.ceil(tokens / mlp_tiles(tokens, h)) if tiled_mlp else tokens
    layer = 2 * hid + max(attn + o_back, 3 * rows * inter * b)  # all-to-all staging: a resident term already
    logit_rows = eval_tile_rows(tokens, shape.vocab_size, tile_bytes) if tiled else tokens
    per_elem = b + (4 if b < 4 else 0) + 4 + 4
    return {"eval: one layer forward": layer,
            "eval: logits tile + CE" if tiled else "eval: whole logits + CE": logit_rows * shape.vocab_size * per_elem
            + 2 * hid}


def eval_phase_bytes(shape: ModelShape, seq_len: int, sp: int, b: int, tiled: bool = True, tiled_mlp: bool = False,
                     tile_bytes: int = LOGITS_TILE_BYTES, cp: int = 1) -> int:
    """The larger of `eval_phases`: what an evaluation forward adds on top of the resident model states."""
    return max(eval_phases(shape, seq_len, sp, b, tiled, tiled_mlp, tile_bytes, cp).values())


def estimate(shape: ModelShape, seq_len: int, sp: int, world: int,
             features: Features | Mapping[str, bool] | Iterable[str] | None,
             precision: str = "bf16", gpus_per_node: int | None = None, cp: int = 1,
             async_save: bool = False, device: str = "cuda", pinned_offloads: bool = True,
             pinned_limit: int = PINNED_NO_LIMIT, grad_accum: str | None = None) -> Estimate:
    """Per-rank memory of one training step for seq_len tokens per sample, micro-batch 1 per SP group; sp = u x cp
    (cp = 1: pure Ulysses). gpus_per_node only sizes the per-node CPU total: a split whose Ulysses groups straddle
    nodes is slow, not impossible (planner.comm_model prices it). `async_save`: the run keeps a host copy of the
    rank's checkpoint for its background saves (training/async_save.Staging).
    device "cuda" (a GPU run): attention is FlashAttention-2 (its GQA backward: gqa_expanded_grad_bytes) and what goes
    to host memory through pinned buffers is counted as the caching host allocator holds it (pinned_block_bytes):
    the offloaded layer checkpoints, and the async save's host copy when the optimizer's states are on the GPU;
    `pinned_offloads` (default True): ZeRO-3's offloaded parameter and gradient buffers are pinned too (DeepSpeed's
    offload `pin_memory`, on in ds_configs/zero3_offload.json), block by block as zero3_pinned_requests lists them;
    `pinned_limit`: pinned_round_limit of the
    run's allocator settings (default: torch's, every block rounded). "cpu": SDPA on the host, nothing pinned.
    `grad_accum`: the DeepSpeed config's data_types.grad_accum_dtype, the dtype of ZeRO-3's gradient partitions
    (fp32 under bf16: +2 B per parameter / world); None: the model's dtype (DeepSpeed's when the key is absent: the
    runs measured so far). What plans a run (Planner, auto's choice) passes GRAD_ACCUM_DEFAULT."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: use cpu or cuda")
    gpu_run = device == "cuda"
    pin = (lambda nbytes: pinned_block_bytes(nbytes, pinned_limit)) if gpu_run else (lambda nbytes: nbytes)
    check_layout(world, sp, shape.num_heads, shape.num_kv_heads, seq_len, cp=cp)
    if precision not in DTYPE_BYTES:
        raise ValueError(f"precision {precision!r}: use bf16 or fp32")
    f = Features.of(features)
    b = DTYPE_BYTES[precision]
    tokens = tokens_per_rank(seq_len, sp, cp)
    u = sp // cp
    h = shape.hidden_size
    hid = tokens * h * b

    # ZeRO-3 model states, partitioned over the whole world (SP ranks included); on the host as the allocator holds them
    if grad_accum is not None and grad_accum not in GRAD_ACCUM_BYTES:
        raise ValueError(f"grad_accum_dtype {grad_accum!r}: use one of {sorted(GRAD_ACCUM_BYTES)}")
    accum = GRAD_ACCUM_BYTES[grad_accum] if grad_accum else b
    gpu, cpu = zero3_state_terms(shape, world, b, f, gpu_run, pinned_offloads, pinned_limit, async_save, HOST_ARENA,
                                 accum)
    # communication: the largest gathered module (a layer or the embedding/LM head) with its unreduced
    # grads, plus the prefetch (0.9 h^2) and reduce (h^2) buckets
    gpu["zero3 gathered params+grads, buckets"] = b * (2 * max(shape.layer_params(), shape.vocab_size * h)
                                                      + 2 * h * h)
    if u > 1:  # Llama-3-8B at 1M, u=8 x cp=4: 0.375 GiB (0.75 as sp=32); Qwen2.5-7B, 4 x 2: 1.125
        kv_send = max(shape.num_kv_heads, u)
        gpu["ulysses all-to-all staging"] = tokens * (shape.num_heads + 2 * kv_send) * shape.head_dim * b
    if cp > 1:
        gpu["context-parallel K/V ring buffers" if f.ring_attention else "context-parallel K/V gather staging"] = \
            cp_kv_buffer_bytes(shape, tokens, sp, b, cp, f.ring_attention,  # the ring runs per head chunk
                               chunk_split(shape, sp, cp, f.attention_head_chunks)[2:] if f.ring_attention else None)
    if shape.linear_layers:  # gated delta-net: its state per chunk and chunk buffers over the full sequence
        gpu["linear attention: chunk states + buffers (one layer)"] = linear_attention_bytes(shape, seq_len, sp)

    lean = lean_norm_applies(shape, f)
    args = (shape, tokens, sp, b, f.tiled_mlp, lean, lean_mlp_applies(shape, f), cp, f.attention_head_chunks)
    saved, transient = layer_activations(*args, flash=gpu_run, ring=f.ring_attention)  # an MoE model's MoE layer
    # a checkpointed layer: its recompute counted, no earlier chunks' projections held (layer_phase_terms)
    transient_ck = layer_activations(*args, flash=gpu_run, ring=f.ring_attention,
                                     checkpointed=True)[1] if f.every else transient
    L = shape.num_layers
    dense = min(shape.dense_layers, L) if shape.num_experts else 0  # an MoE model's first layers, a dense MLP each
    saved_dense = saved
    if dense:  # (DeepSeek's first_k_dense_replace): their own terms, the larger transients of the two kinds
        saved_dense, t_dense = layer_activations(*args, flash=gpu_run, ring=f.ring_attention, dense_mlp=True)
        transient = max(transient, t_dense)
        transient_ck = max(transient_ck, layer_activations(*args, flash=gpu_run, ring=f.ring_attention,
                                                           checkpointed=True, dense_mlp=True)[1]) if f.every else transient

    def layers_saved(layers: Iterable[int]) -> int:  # what the given layers save, each by its kind
        return sum(saved_dense if i < dense else saved for i in layers)

    phases: dict[str, int] = {}
    if f.every:
        ck = -(-L // f.every)  # layers 0, K, 2K, ...: only their input is kept; the others keep everything
        gpu["activation checkpoints"] = 2 * hid if f.offload_activations else ck * hid
        if f.offload_activations:  # one page-locked slot per checkpoint (model_utils/memory._to_host): 5M tokens on
            # 8 GPUs, 4.77 GiB each, held as 4.77 in the host arena (as torch's pinned blocks, the fallback: 8 GiB)
            cpu["activation checkpoints"] = ck * (hid if HOST_ARENA else pin(hid))
        recompute = max(saved, saved_dense) - hid + transient_ck
        if f.keep_attention:  # + each checkpointed layer's attention output and fp32 lse, cached on the device
            kept = kept_attention_bytes(shape, tokens, sp, b, cp)
            gpu["activation checkpoints: kept attention outputs"] = ck * kept
            recompute -= kept  # the recompute reuses them instead of allocating its own
        if ck < L:
            gpu["saved activations (layers not checkpointed)"] = layers_saved(i for i in range(L) if i % f.every)
            phases["layer working set (backward)"] = transient
            # backward runs from the top layer down: the layers above the last checkpointed one (K*floor((L-1)/K))
            # keep activations and have freed them by the time it is recomputed
            recompute -= layers_saved(range(f.every * ((L - 1) // f.every) + 1, L))
        phases["layer working set (recompute+backward)"] = max(recompute, 0)
    else:
        gpu["saved activations (all layers)"] = layers_saved(range(L))
        phases["layer working set (backward)"] = transient
    tile = f.logits_tile_mb * 2**20 if f.logits_tile_mb > 0 else LOGITS_TILE_BYTES  # this module's (tests patch it)
    phases["logits + loss"] = logits_bytes(shape, tokens, b, f.tiled_logits, lean, tile)
    if not f.offload_optimizer and b < 4:
        phases["optimizer step (fp32 grad copy)"] = 4 * max(zero3_subgroups(zero3_partitions(shape, world)))
    if gpu_run and f.offload_optimizer:  # a checkpoint load (stage start, resume) holds a transient fp32 master copy, the
        # arena and snapshot given back first (training/stage.py): Llama-3-8B, 32 ranks: 1 GB/rank (GPU optimizer: unmeasured)
        load = 4 * shape.num_params() // world - sum(v for k, v in cpu.items() if k.startswith(("activation", "async")))
        if load > 0:
            cpu["checkpoint load: fp32 master copy (transient)"] = load
    return Estimate(seq_len=seq_len, sp=sp, world=world, tokens_per_rank=tokens, gpu=gpu, gpu_phases=phases,
                    cpu_per_rank=cpu, gpus_per_node=gpus_per_node or world,
                    eval_phases=eval_phases(shape, seq_len, sp, b, tiled=True, tiled_mlp=f.tiled_mlp,
                                            tile_bytes=tile, cp=cp), cp=cp)


def predict_peak_bytes(shape: ModelShape | Mapping | str, seq_len: int, sp: int,
                       features: Features | Mapping[str, bool] | Iterable[str] | None = None,
                       precision: str = "fp32", device: str = "cpu", world: int | None = None, cp: int = 1) -> int:
    """Predicted peak tensor bytes of one rank in one training step (world defaults to sp, i.e. dp = 1).

    shape: a ModelShape, a config dict or a preset name. device="cuda": the GPU peak (offloaded states and
    checkpoints excluded). device="cpu": everything lives in the same RAM, so offloaded model states count too
    and activation offload is a no-op. Interpreter and library memory (the RSS before the model exists) are
    not included: compare against the peak minus that baseline.
    """
    if not isinstance(shape, ModelShape):
        shape = load_shape(shape) if isinstance(shape, str) else ModelShape.from_config(shape)
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: use cpu or cuda")
    feats = Features.of(features)
    if device == "cpu":
        feats = replace(feats, offload_activations=False)
    est = estimate(shape, seq_len, sp, world or sp, feats, precision, cp=cp, device=device)
    return est.gpu_peak + (sum(est.cpu_per_rank.values()) if device == "cpu" else 0)
