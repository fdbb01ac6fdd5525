"""Memory of one ZeRO-3 + Ulysses training step, per GPU and per node: pure arithmetic on shapes (its FLOPs:
planner/flops.py).

Shared by `scripts/plan.py` (the planner) and the tests; no torch or transformers import. Every term is
derived in docs/memory_model.md, whose notation the code follows:
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
# Each tile re-enters ZeRO-3's fetch/release hooks of the MLP's three projections, in the forward and again in
# the recomputing backward: a fixed cost per tile. ALST's tile of `hidden` tokens is large on real models (4096+
# tokens, unchanged by this floor) but 128-256 tokens on tiny ones, where measured at 8192 tokens, h256, 2 ranks
# (one launch each, idle): 16 tiles 1263 tok/s, 4 tiles 1359, untiled 1364. The floor keeps tiny models' tiles
# at 1024 tokens; the intermediates of such a tile ([1024, intermediate] x 3) are a few MiB there.
MLP_MIN_TILE_TOKENS = 1024
LOGITS_TILE_BYTES = 2**30  # tiled logits: shards of ~1 GiB of fp32 logits (ArcticTraining's rule; shapes.py has the same) ...
LOGITS_TILE_BUDGET_SHARE = 64  # ... under memory_features auto at most 1/64 of the per-rank budget (logits_tile_bytes)
NORM_CHUNK_BYTES = 2**26  # lean RMSNorm: at most 64 MiB of fp32 per temporary of a chunk of rows ...
NORM_MIN_CHUNKS = 8  # ... and at least this many chunks (tiny models), of at least NORM_MIN_CHUNK_ROWS rows
NORM_MIN_CHUNK_ROWS = 1024
# The runtime does not pin the offloaded layer checkpoints nor the async save's copy of GPU-resident states through
# that allocator: base/host_arena.py page-locks pageable memory of their exact size in place (cudaHostRegister), so
# the host holds them as bytes (to a 4 KiB page). False: count them as torch's pinned blocks, as the runtime's
# fallback holds them where registration fails (one warning line on that rank).
HOST_ARENA = True


def parse_seq_len(text: str | int) -> int:
    """'131072', '128k', '1M', '15_000_000' -> tokens; k and M are binary (128k = 131072, 1M = 1048576)."""
    s = str(text).strip().replace("_", "").lower()
    scale = {"k": 2**10, "m": 2**20}.get(s[-1:], 1)
    num = s[:-1] if scale > 1 else s
    try:
        value = round(float(num) * scale)
    except ValueError:
        raise ValueError(f"sequence length {text!r}: write tokens as 131072, 128k or 1M") from None
    if value < 1:
        raise ValueError(f"sequence length {text!r} must be at least 1 token")
    return value


def mlp_tiles(tokens: int, hidden: int, tile_tokens: int | None = None) -> int:
    """DeepSpeed TiledMLP shard count over a rank's `tokens`: ALST's ceil(tokens / hidden) (a tile of ~hidden
    tokens), with tiles of at least MLP_MIN_TILE_TOKENS; `tile_tokens` overrides the tile size (tests)."""
    return max(1, math.ceil(tokens / (tile_tokens or max(hidden, MLP_MIN_TILE_TOKENS))))


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


def layer_phase_terms(shape: ModelShape, tokens: int, sp: int, b: int, tiled_mlp: bool,
                      lean_norm: bool = False, lean_mlp: bool = False, cp: int = 1, chunks: int = 1,
                      flash: bool = False, ring: bool = False, checkpointed: bool = False) -> dict[str, int]:
    """One decoder layer on one rank, per phase: {"saved": what it keeps for backward, its input included;
    "attention", "mlp", "norm": what its attention's / MLP's / a norm's backward holds beyond the saved sets (their
    own gradients included); "recompute" (a checkpointed layer): what re-running its forward holds beyond its saved set
    (the incoming gradient included); "transient": the largest of these}. `checkpointed`: the layer is one of
    activation checkpointing's (its recompute counted).
    Measured per phase (2026-11-27, issue 43): the H200 run at 1M tokens (bench/results/gpu.json, Llama-3-8B width,
    2 layers, 16 head chunks, tiled lean MLP, layer 0 checkpointed) and the same phases of a small model on CPU by exact
    live bytes (bench/live_bytes.py; tests/unit/planner/test_phase_bytes.py), which agree in [T, h] units.
    lean_norm: the RMSNorms are model_utils/rmsnorm.py's (see norm_saved); lean_mlp: the MLP's gated product is
    model_utils/mlp.py's (act(gate) is not kept). cp: the context-parallel factor of sp (attention_tensor_bytes).
    flash: the attention kernel is FlashAttention-2's (a GPU run), whose GQA backward writes dk and dv for every query
    head and sums them to the KV heads after (gqa_expanded_grad_bytes). ring: context-parallel K/V in a ring
    (model_utils/ring_attention.py): the kernel's k, v are the rank's own S/cp (attention_sp.kv_length)."""
    h, d, inter = shape.hidden_size, shape.head_dim, shape.intermediate_size
    _, q_loc, _ = attention_split(shape, sp, cp)
    queries = tokens * sp // cp  # S/cp: the queries (and outputs) a rank attends for
    hid = tokens * h * b  # one [T, h] hidden state
    # q, o [S/cp, nh/u, d] and k, v [S, kv_loc, d] (gathered over cp): the tensors flash attention saves
    attn_io = attention_tensor_bytes(shape, tokens, sp, b, cp, ring)
    lse = queries * q_loc * 4  # fp32 softmax log-sum-exp
    # attention output back in [T, nh*d], o_proj's input: under SP the all-to-all's output (u > 1) or the
    # concatenation of the two zigzag chunks' outputs (u = 1, cp > 1); without SP a view of o
    o_back = tokens * shape.num_heads * d * b if sp > 1 else 0
    mlp_kept = 3 if lean_mlp else 4  # gate, up, act(gate) (not with lean_mlp), act*up
    mlp_saved = 0 if tiled_mlp else mlp_kept * tokens * inter * b
    saved = 2 * norm_saved(tokens, h, b, lean_norm) + o_back + attn_io + lse + mlp_saved  # the residual stream: in the norms
    # A lean norm's output is recomputed by the consumers that can (model_utils/rmsnorm.norm_source), so it is not
    # kept: chunked attention recomputes it whole in its backward (1 [T, h], in the place of the post-attention
    # norm's saved input, which that norm's backward has released by then: no net term), the tiled MLP one tile's
    # rows at a time. Llama-3-8B at 1M tokens on one GPU: 16 GiB less per layer's working set.
    renorm_attn = lean_norm and chunks > 1
    renorm_mlp = lean_norm and tiled_mlp
    saved -= (renorm_attn + renorm_mlp) * hid
    if chunks > 1:  # head chunks (attention_sp.chunked_attention_bytes): only the kernel outputs stay for backward
        chunk_saved, chunk_transient = chunked_attention_bytes(shape, tokens, sp, b, cp, chunks, flash, ring)
        saved += chunk_saved - (o_back + attn_io + lse)
    if shape.qk_norm and chunks == 1:  # (chunked: the q/k norms run inside a chunk and keep nothing)  # Qwen3: RMSNorm on q and k per head, on the local tokens before the all-to-all; RoPE saves
        # neither side, so what is kept is the norms' own: HF's an fp32 copy + the normalized q/k (4 + b), the lean
        # one its input (b) and 1/rms per row
        qk_heads = shape.num_heads + shape.num_kv_heads
        saved += tokens * qk_heads * (d * b + 4) if lean_norm else tokens * qk_heads * d * (4 + b)
    # dq, do [S/cp, ...]; dk, dv full-length [kv_length, kv_loc, d] (each cp rank's contribution to every key, before
    # the reduce-scatter; their copy in rank order is cp_kv_buffer_bytes) + flash-attn's fp32 dq accumulator
    attn_grads = attn_io + queries * q_loc * d * 4 if chunks == 1 else chunk_transient
    if flash and chunks == 1:  # (chunked: per chunk, in chunked_attention_bytes)
        attn_grads += gqa_expanded_grad_bytes(shape, tokens, sp, b, cp)
    rows = math.ceil(tokens / mlp_tiles(tokens, h)) if tiled_mlp else tokens
    # tiled: a tile's recomputed tensors + 2 grads; the lean product's backward (model_utils/mlp.py) allocates
    # d(gate) and d(up) whole while d(product) is alive: 3 (profiler, 2026-11-26: with 4 head chunks +
    # checkpointing the tiled MLP's backward sets the peak; with 2 the planner gave 0.952 of it, fp32 gqa)
    mlp_grads = ((mlp_kept + (3 if lean_mlp else 2)) if tiled_mlp else 2) * rows * inter * b
    if tiled_mlp:  # + DeepSpeed TiledMLP's x_grad, zeros_like the whole [T, h] input, filled tile by tile (profiler:
        mlp_grads += hid  # TiledMLPBackward set the peak 1u above the old term once chunked attention no longer did)
        if renorm_mlp:  # the tile's input rows, recomputed (the norm's fp32 temporaries, a few rows each, are gone
            mlp_grads += rows * h * b  # before the tile's MLP runs; profiler, bf16 gqa + checkpointing: 1.077)
    # RMSNorm's backward runs in fp32 whatever the dtype: HF's holds five [T, h] fp32 temporaries (mul, mean, pow,
    # 2 muls: measured with the profiler's allocation events) beside 3 [T, h]; the lean one holds 3 [T, h] and five
    # fp32 temporaries of one chunk of rows: the incoming gradient, d(normed input) from the consumer (the MLP's
    # x_grad, or the attention's dx) and the norm's own dx (d(attn out) of the other terms does not exist in a norm's
    # backward). Until 2026-11-28 the lean term counted its dx on top of the 3 (4 [T, h]): the H200 headline run
    # measured the post-attention norm at 54.00 GiB where that gave 70.20 (x0.769), exact live bytes on CPU (fp32,
    # the top layer, bench/live_bytes.py) 9.30u where it gave 10.32u and this gives 9.32u
    # (tests/unit/planner/test_phase_bytes.py). By then the MLP's saved tensors are already freed.
    norm_rows = norm_chunk_rows(tokens, h) if lean_norm else tokens
    norm_grads = 5 * norm_rows * h * 4 - mlp_saved
    # + the gradients every backward holds: incoming dx, d(attn out), d(normed input), 3 [T, h] ...
    terms = {"attention": 3 * hid + attn_grads, "mlp": 3 * hid + mlp_grads, "norm": 3 * hid + norm_grads}
    if tiled_mlp:  # ... except the tiled MLP's: only the incoming gradient (d(attn out) does not exist yet, its input
        # gradient is the x_grad above). H200: MLP backward measured 52.58 GiB where 3 [T, h] gave 69.61 (x0.755).
        # The lean tile (model_utils/mlp.py under TiledMLP) holds 8 [rows, I] at its peak, not 6: gate, up, act(gate)
        # and the product recomputed, d(product), d(gate), d(up) and silu's backward; and the tile's input gradient
        # rows beside its recomputed input, with the lean norm's recompute of the tile's rows 4 [rows, h] (exact live
        # bytes, CPU: test_planner_tensor_bytes' fp32 gqa case with checkpointing and 4 head chunks measured 14.40u
        # in the top layer's MLP backward where 2 [rows, h] gave 13.90u)
        tile_tensors = 8 if lean_mlp else mlp_kept + 2
        terms["mlp"] = hid + hid + tile_tensors * rows * inter * b + (4 if renorm_mlp else 1) * rows * h * b
        if renorm_mlp and b < 4 and rows < tokens:  # model_utils.memory.NormTiledMLP sums gate / up / down's per-tile
            terms["mlp"] += 4 * 3 * h * inter  # gradients in fp32 (tiled_loss.TileGradSum): Llama-3-8B 0.7 GB
    if chunks > 1:  # one chunk's q, k, v projections before the all-to-all (KV replicated to u heads before sending)
        _, hkv_c, _, _ = chunk_split(shape, sp, cp, chunks)
        u_ = sp // cp
        pre_c = tokens * (shape.num_heads // chunks + 2 * max(hkv_c, u_ if u_ > hkv_c else 0)) * d * b
    if chunks > 1:  # chunked attention's backward: the incoming gradient and dx (2 [T, h]); the recomputed input x
        # takes the place of the post-attention norm's saved input, freed by then. H200, layer 0 (checkpointed):
        # 48.89 GiB measured where 3 [T, h] gave 59.92 (x0.816)
        # The current chunk's projections are in the chunk's term; a finished chunk's are freed before the next
        # chunk's backward, in a layer that kept its activations as in a checkpointed one. (Until 2026-11-27 they
        # were not: head chunks' kernel cache (now memory.KeepKernels) answered the recomputed kernel call with the
        # cached tensor itself, one
        # of _Chunked's saved tensors, and autograd tied each chunk's graph and q, k, v to it until the backward
        # returned: the H200's 72.14 GiB in layer 1 at 1M tokens, 16 chunks x 4 heads x [T, d] = 16 GiB above this
        # term. Fixed; CPU exact live bytes: tests/unit/planner/test_phase_bytes.py.)
        terms["attention"] = 2 * hid + attn_grads
    if checkpointed:  # re-running the forward in backward: the incoming gradient (1 [T, h]) + the forward's own
        # working set beyond the saved set it rebuilds: the MLP's input (the post-attention norm's output) and output
        # (2 [T, h]) with the tiled MLP's 4 tensors of a tile (gate, up, act, product) and 3 [rows, h], or the
        # attention's input and output with one chunk's q, k, v. H200, layer 0: recompute measured 59.56 GiB where
        # the planner's figure (its saved set alone) was 28.92 (x2.06); on CPU the recompute is the layer's forward
        # peak + the incoming gradient + the kernel outputs it keeps, exactly.
        f_mlp = 2 * hid + (4 * rows * inter * b + 3 * rows * h * b if tiled_mlp else rows * inter * b)
        f_attn = 2 * hid + (2 * pre_c if chunks > 1 else 0)  # + one chunk's projections and their RoPE'd copies
        terms["recompute"] = hid + max(f_mlp, f_attn)
    terms["saved"] = saved
    terms["transient"] = max(v for k, v in terms.items() if k != "saved")
    return terms


def layer_activations(shape: ModelShape, tokens: int, sp: int, b: int, tiled_mlp: bool,
                      lean_norm: bool = False, lean_mlp: bool = False, cp: int = 1, chunks: int = 1,
                      flash: bool = False, ring: bool = False, checkpointed: bool = False) -> tuple[int, int]:
    """(saved, backward transient) bytes of one decoder layer on one rank (layer_phase_terms: the transient is its
    largest phase); `saved` includes the layer input. lean_norm: the RMSNorms are model_utils/rmsnorm.py's (see
    norm_saved); lean_mlp: the MLP's gated product is model_utils/mlp.py's (act(gate) is not kept). cp: the
    context-parallel factor of sp (attention_tensor_bytes). flash: the attention kernel is FlashAttention-2's (a GPU
    run), whose GQA backward writes dk and dv for every query head and sums them to the KV heads after
    (gqa_expanded_grad_bytes). ring: context-parallel K/V in a ring (model_utils/ring_attention.py): the kernel's k, v
    are the rank's own S/cp (attention_sp.kv_length)."""
    t = layer_phase_terms(shape, tokens, sp, b, tiled_mlp, lean_norm, lean_mlp, cp, chunks, flash, ring, checkpointed)
    return t["saved"], t["transient"]


def norm_saved(tokens: int, h: int, b: int, lean: bool = False) -> int:
    """What one RMSNorm saves for backward (HF Llama/Qwen/Mistral): its input upcast to fp32 (in fp32 the input
    itself), the normalized x in the compute dtype (for the weight's gradient) and the output (the next
    projection's input). The residual stream is saved only through these: the additions save nothing.
    lean (model_utils/rmsnorm.py): the input in the compute dtype, the fp32 inverse RMS per token, the output."""
    return tokens * (h * 2 * b + 4) if lean else tokens * h * (4 + 2 * b)


def norm_chunk_rows(rows: int, h: int) -> int:
    """Rows per chunk of the lean RMSNorm (model_utils/rmsnorm.py): at most NORM_CHUNK_BYTES of fp32 per
    temporary, at least NORM_MIN_CHUNKS chunks, chunks of at least NORM_MIN_CHUNK_ROWS rows. Llama-3-8B at 128k
    tokens per rank: 4096 rows, 32 chunks, 64 MiB per temporary instead of 2 GiB."""
    return max(1, min(rows, max(NORM_MIN_CHUNK_ROWS, min(NORM_CHUNK_BYTES // (4 * h), math.ceil(rows / NORM_MIN_CHUNKS)))))


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
    saved, transient = layer_activations(shape, tokens, sp, b, f.tiled_mlp, lean, lean_mlp_applies(shape, f), cp,
                                         f.attention_head_chunks, flash=gpu_run, ring=f.ring_attention)
    # a checkpointed layer: its recompute counted, no earlier chunks' projections held (layer_phase_terms)
    transient_ck = layer_activations(shape, tokens, sp, b, f.tiled_mlp, lean, lean_mlp_applies(shape, f), cp,
                                     f.attention_head_chunks, flash=gpu_run, ring=f.ring_attention,
                                     checkpointed=True)[1] if f.every else transient
    phases: dict[str, int] = {}
    if f.every:
        L = shape.num_layers
        ck = -(-L // f.every)  # layers 0, K, 2K, ...: only their input is kept; the others keep everything
        gpu["activation checkpoints"] = 2 * hid if f.offload_activations else ck * hid
        if f.offload_activations:  # one page-locked slot per checkpoint (model_utils/memory._to_host): 5M tokens on
            # 8 GPUs, 4.77 GiB each, held as 4.77 in the host arena (as torch's pinned blocks, the fallback: 8 GiB)
            cpu["activation checkpoints"] = ck * (hid if HOST_ARENA else pin(hid))
        recompute = saved - hid + transient_ck
        if f.keep_attention:  # + each checkpointed layer's attention output and fp32 lse, cached on the device
            kept = kept_attention_bytes(shape, tokens, sp, b, cp)
            gpu["activation checkpoints: kept attention outputs"] = ck * kept
            recompute -= kept  # the recompute reuses them instead of allocating its own
        if ck < L:
            gpu["saved activations (layers not checkpointed)"] = (L - ck) * saved
            phases["layer working set (backward)"] = transient
            # backward runs from the top layer down: the layers above the last checkpointed one (K*floor((L-1)/K))
            # keep activations and have freed them by the time it is recomputed
            recompute -= (L - 1 - f.every * ((L - 1) // f.every)) * saved
        phases["layer working set (recompute+backward)"] = max(recompute, 0)
    else:
        gpu["saved activations (all layers)"] = shape.num_layers * saved
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
