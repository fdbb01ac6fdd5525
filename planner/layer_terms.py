"""One decoder layer's activation terms on one rank, per phase (split out of planner/memory_model.py, which
re-exports these names): what the layer saves for backward, and what its attention's, MLP's, norms' backward and a
checkpointed layer's recompute hold beyond that (`layer_phase_terms`); the tiled MLP's tile count; an RMSNorm's saved
set. Notation as in docs/memory_model.md (T, h, I, b, ...). Pure arithmetic on shapes: no torch import.
"""

from __future__ import annotations

import math

from planner.attention_sp import (
    attention_split,
    attention_tensor_bytes,
    chunk_split,
    chunked_attention_bytes,
    gqa_expanded_grad_bytes,
)
from planner.shapes import ModelShape

# Each tile re-enters ZeRO-3's fetch/release hooks of the MLP's three projections, in the forward and again in
# the recomputing backward: a fixed cost per tile. ALST's tile of `hidden` tokens is large on real models (4096+
# tokens, unchanged by this floor) but 128-256 tokens on tiny ones, where measured at 8192 tokens, h256, 2 ranks
# (one launch each, idle): 16 tiles 1263 tok/s, 4 tiles 1359, untiled 1364. The floor keeps tiny models' tiles
# at 1024 tokens; the intermediates of such a tile ([1024, intermediate] x 3) are a few MiB there.
MLP_MIN_TILE_TOKENS = 1024
NORM_CHUNK_BYTES = 2**26  # lean RMSNorm: at most 64 MiB of fp32 per temporary of a chunk of rows ...
NORM_MIN_CHUNKS = 8  # ... and at least this many chunks (tiny models), of at least NORM_MIN_CHUNK_ROWS rows
NORM_MIN_CHUNK_ROWS = 1024


def mlp_tiles(tokens: int, hidden: int, tile_tokens: int | None = None) -> int:
    """DeepSpeed TiledMLP shard count over a rank's `tokens`: ALST's ceil(tokens / hidden) (a tile of ~hidden
    tokens), with tiles of at least MLP_MIN_TILE_TOKENS; `tile_tokens` overrides the tile size (tests)."""
    return max(1, math.ceil(tokens / (tile_tokens or max(hidden, MLP_MIN_TILE_TOKENS))))


# MoE experts as transformers 5.23 runs them by default, on GPU and CPU (integrations/moe.grouped_mm_experts_forward):
# each token's k routed copies, sorted by expert, go through grouped matmuls, and autograd keeps per copy its input
# [T*k, h], gate_up [T*k, 2I], act(gate) and the gated product [T*k, I] each, the down output [T*k, h] (for the
# routing weights' product); gpt-oss's clamped gate (GptOssExperts._apply_gate) keeps 3 [T*k, I] more.
EXPERT_ROW_TENSORS = {"gpt_oss": 7}  # [T*k, I] tensors kept per routed copy; other families 4
# Families whose routing weights are in the compute dtype (the router casts them back); the others' (Mixtral,
# DeepSeek, and any not measured) are fp32, which makes the weighted expert outputs and their gradients fp32 [T*k, h]
ROUTING_IN_COMPUTE_DTYPE = frozenset({"qwen3_moe", "qwen2_moe", "olmoe", "gpt_oss"})
FP32_ROUTER_INPUT = frozenset({"deepseek_v2", "deepseek_v3"})  # the router upcasts its input: an fp32 [T, h] kept


def moe_mlp_terms(shape: ModelShape, tokens: int, b: int) -> tuple[int, int, int]:
    """(saved, backward, forward) bytes of one MoE layer's MLP on one rank: what it keeps for backward; what its
    backward holds beyond the saved sets (the layer's 3 [T, h] gradients apart); what its forward holds beyond what
    it keeps (a checkpointed layer's recompute). Saved per token: k*(2h + 4I)*b for the routed copies, the router's
    fp32 probabilities [T, E], the top-k ids, the sort / gather / inverse permutations (int64 [T*k] each) and the
    routing weights, plus the shared experts as one dense gated MLP of ModelShape.shared_width (DeepSeek's: 4 [T, I_s]).
    Measured with saved_tensors_hooks at each family's real widths (bf16, B/token; tests/unit/planner/
    test_moe_activations.py checks the formula against transformers at small widths): Qwen3-30B-A3B 115,024
    (the dense term counted 49,152), Mixtral-8x7B 262,236 (114,688), gpt-oss-20b 207,536 (23,040), OLMoE 131,408
    (8,192). Qwen3-30B-A3B at 128k tokens, sp 8 (T = 16384, E = 128): 1.76 GiB per layer, 84.6 GiB over its 48
    layers kept whole, where the dense term gave 0.75 and 36 (its 4 x 8 recipe planned 61.7 GiB and needed ~86).
    Backward: 3 [T*k, h] gradients of the weighted outputs (fp32 ones with fp32 routing weights, + one in the
    compute dtype), or where I is large the gate_up gradient beside the freed expert tensors ((2I - h) per copy);
    forward: the weighted outputs (routing weights' dtype) + 2 [T*k, I] + their fp32 sum [T, h] (exact live bytes
    on CPU, bench/live_bytes.py: within these, the safe side)."""
    h, k, n_exp, inter = shape.hidden_size, shape.experts_per_token, shape.num_experts, shape.moe_intermediate_size
    rows = tokens * k  # routed copies
    w = b if shape.model_type in ROUTING_IN_COMPUTE_DTYPE else 4  # bytes of a routing weight
    saved = rows * (2 * h + EXPERT_ROW_TENSORS.get(shape.model_type, 4) * inter) * b
    saved += tokens * (4 * n_exp + 40 * k + 4) + 4 * n_exp  # router probs, top-k ids, 3 permutations, routing
    # weights; the experts' row offsets
    if shape.model_type in FP32_ROUTER_INPUT:  # + the [T, E] group mask, top-k group rows, a group's top-2 ids (16 B
        # per group: DeepSeek-V3's 8 groups 128 of its ~408k B/token, the 7 past the first left out); the upcast weight
        saved += tokens * (4 * h + n_exp + 24) + 4 * n_exp * h
    shared = shape.shared_width  # the shared experts' intermediate width (Qwen2-MoE: its own size), one HF gated MLP
    saved += 4 * tokens * shared * b
    backward = max(rows * max(h * (3 * w + (b if w > b else 0)), (2 * inter - h) * b), 2 * tokens * shared * b)
    forward = tokens * (k * (w * h + 2 * inter * b) + 4 * h + shared * b)
    return saved, backward, forward


def layer_phase_terms(shape: ModelShape, tokens: int, sp: int, b: int, tiled_mlp: bool,
                      lean_norm: bool = False, lean_mlp: bool = False, cp: int = 1, chunks: int = 1,
                      flash: bool = False, ring: bool = False, checkpointed: bool = False,
                      dense_mlp: bool = False) -> dict[str, int]:
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
    (model_utils/ring_attention.py): the kernel's k, v are the rank's own S/cp (attention_sp.kv_length).
    An MoE model (shape.num_experts): the layer's MLP is its experts' (moe_mlp_terms), or with `dense_mlp` one of its
    first shape.dense_layers, a dense MLP of intermediate_size; untiled either way, as model_utils/memory._tile_mlps
    refuses --tiled_mlp for a model whose MLPs are not all gated dense ones."""
    tiled_mlp = tiled_mlp and not shape.num_experts
    moe = moe_mlp_terms(shape, tokens, b) if shape.num_experts and not dense_mlp else None
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
    mlp_saved = 0 if tiled_mlp else moe[0] if moe else mlp_kept * tokens * inter * b
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
    mlp_grads = moe[1] if moe else ((mlp_kept + (3 if lean_mlp else 2)) if tiled_mlp else 2) * rows * inter * b
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
        f_mlp = 2 * hid + (4 * rows * inter * b + 3 * rows * h * b if tiled_mlp else moe[2] if moe else
                           rows * inter * b)
        f_attn = 2 * hid + (2 * pre_c if chunks > 1 else 0)  # + one chunk's projections and their RoPE'd copies
        terms["recompute"] = hid + max(f_mlp, f_attn)
    terms["saved"] = saved
    terms["transient"] = max(v for k, v in terms.items() if k != "saved")
    return terms


def layer_activations(shape: ModelShape, tokens: int, sp: int, b: int, tiled_mlp: bool,
                      lean_norm: bool = False, lean_mlp: bool = False, cp: int = 1, chunks: int = 1,
                      flash: bool = False, ring: bool = False, checkpointed: bool = False,
                      dense_mlp: bool = False) -> tuple[int, int]:
    """(saved, backward transient) bytes of one decoder layer on one rank (layer_phase_terms: the transient is its
    largest phase); `saved` includes the layer input. lean_norm: the RMSNorms are model_utils/rmsnorm.py's (see
    norm_saved); lean_mlp: the MLP's gated product is model_utils/mlp.py's (act(gate) is not kept). cp: the
    context-parallel factor of sp (attention_tensor_bytes). flash: the attention kernel is FlashAttention-2's (a GPU
    run), whose GQA backward writes dk and dv for every query head and sums them to the KV heads after
    (gqa_expanded_grad_bytes). ring: context-parallel K/V in a ring (model_utils/ring_attention.py): the kernel's k, v
    are the rank's own S/cp (attention_sp.kv_length). dense_mlp: an MoE model's dense layer (layer_phase_terms)."""
    t = layer_phase_terms(shape, tokens, sp, b, tiled_mlp, lean_norm, lean_mlp, cp, chunks, flash, ring, checkpointed,
                          dense_mlp)
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
