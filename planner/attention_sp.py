"""Attention under sequence parallelism, per rank: what the kernel holds under Ulysses x context parallelism,
and what headwise chunking (model_utils/head_chunks.py) changes. Pure arithmetic on shapes (no torch).

Notation as in docs/memory_model.md: T tokens per rank, S = T * sp, sp = u x cp, nh / nkv query / KV heads,
d head dim, b bytes per element, n head chunks (`attention_head_chunks`).
"""

from __future__ import annotations

from base.parallel import kv_compatible
from planner.shapes import ModelShape


def attention_split(shape: ModelShape, sp: int, cp: int = 1) -> tuple[int, int, int]:
    """(u, q_loc, kv_loc): the Ulysses factor u = sp / cp, query heads per rank after its all-to-all (nh / u) and
    KV heads per rank (nkv / u, or 1 when u > nkv: DeepSpeed replicates KV heads before the all-to-all)."""
    assert cp >= 1 and sp % cp == 0, f"cp={cp} must divide sp={sp}"
    u = sp // cp
    assert shape.num_heads % u == 0 and kv_compatible(shape.num_kv_heads, u), (shape.num_heads, shape.num_kv_heads, u)
    return u, shape.num_heads // u, shape.num_kv_heads // u if shape.num_kv_heads >= u else 1


def kv_length(seq: int, cp: int = 1, ring: bool = False) -> int:
    """Keys per layer the attention kernel holds (and saves) on one rank: the whole sequence S; under cp > 1 the
    flash path (model_utils/context_parallel._flash_chunk) copies, for each of the rank's two zigzag query chunks,
    the gathered keys up to that chunk's end: (c+1)*n + (2cp-c)*n = S + S/(2cp) keys (n = S/2cp; fewer with
    document masking, and the sdpa path slices views: S). Counted at the flash bound. ring (ring_attention): the
    kernel holds the rank's own S/cp keys; the blocks passing through are cp_kv_buffer_bytes."""
    if ring and cp > 1:
        return seq // cp
    return seq if cp == 1 else seq + seq // (2 * cp)


def attention_tensor_bytes(shape: ModelShape, tokens: int, sp: int, b: int, cp: int = 1, ring: bool = False) -> int:
    """q, k, v, o as the attention kernel sees them on one rank, per layer: q and o [S/cp, nh/u, d] (this rank's
    queries: its cp share of the sequence, its Ulysses share of the heads); k and v [kv_length, kv_loc, d], the
    WHOLE sequence: under cp > 1 gathered from the cp group (all-gather of K/V, Llama-3's context parallelism), so
    they grow with S, not S/cp. With cp = 1 this is the pure-Ulysses `S*d*(2*q_loc + 2*kv_loc)*b`.
    Llama-3-8B at 1M tokens, 32 ranks as u=8 x cp=4 (bf16): q + o 0.5 GiB, k + v 0.56 GiB per layer (pure Ulysses
    at sp=32 holds 0.5: its 8 KV heads replicated to one per rank over the full S); Qwen2.5-7B at 1M as u=4 x cp=2
    inside a node (T=131072): q + o 1.75 GiB, k + v 0.625 GiB."""
    u, q_loc, kv_loc = attention_split(shape, sp, cp)
    seq = tokens * sp
    return (seq // cp) * shape.head_dim * 2 * q_loc * b + kv_length(seq, cp, ring) * shape.head_dim * 2 * kv_loc * b


def cp_kv_buffer_bytes(shape: ModelShape, tokens: int, sp: int, b: int, cp: int = 1, ring: bool = False,
                       heads: tuple[int, int] | None = None) -> int:
    """The context-parallel K/V staging of one rank (0 when cp = 1): the all-gather writes K and V in rank order
    ([cp, S/cp] = zigzag chunks) and the kernel reads them in sequence order, so one full-length [S, kv_loc, d]
    pair exists twice around the forward's gather; in backward dK and dV are reordered back into rank order for
    the reduce-scatter, the same size again. Counted as resident, as the Ulysses staging is (conservative: it
    lives only around each collective). Llama-3-8B at 1M, u=8 x cp=4: 0.5 GiB; Qwen2.5-7B at 1M, 4 x 2: 0.5 GiB.

    ring (model_utils/ring_attention.py): the most the ring holds at once, in its backward: 2 K/V blocks of one rank
    ([S/cp, kv, d] each of K and V; 1 block at cp = 2) in the compute dtype, the fp32 dQ accumulator [S/cp, q, d] and
    3 dK/dV blocks (computed, in flight, arriving) in fp32 (accumulated and passed on in fp32, as ring-flash-attention
    does); the kernel's k, v are then the rank's own S/cp keys (kv_length). heads: (q, kv) per rank of one head chunk
    (chunk_split; the ring runs per chunk), default the rank's (attention_split). Llama-3-8B at 16M, 8 x 4, 4 head
    chunks: 18 GiB (4 of K/V, 2 of dQ, 12 of dK/dV: in bf16 they were 6; the gather: 8 GiB here and 18 GiB of
    whole-S K, V, dK, dV in the kernel). tests/multiproc/test_context_parallel checks it byte for byte (x the
    micro-batch: the ring's buffers scale with it)."""
    if cp == 1:
        return 0
    _, q_loc, kv_loc = attention_split(shape, sp, cp)
    if not ring:
        return 2 * tokens * sp * kv_loc * shape.head_dim * b
    q_loc, kv_loc = heads or (q_loc, kv_loc)
    t = tokens * sp // cp  # the rank's queries and keys after the all-to-all
    block = 2 * t * kv_loc * shape.head_dim  # K and V elements of one rank's block
    return min(2, cp - 1) * block * b + 3 * block * 4 + t * q_loc * shape.head_dim * 4



def gqa_expanded_grad_bytes(shape: ModelShape, tokens: int, sp: int, b: int, cp: int = 1, q_heads: int | None = None,
                            kv_heads: int | None = None) -> int:
    """FlashAttention-2's GQA backward (flash_attn's mha_bwd / mha_varlen_bwd): where a rank holds fewer KV heads than
    query heads, dk and dv are first written for every query head ([keys, q_heads, d] each, the compute dtype) and
    summed to the KV heads after, so the kernel's backward holds two query-head-wide key gradients beyond dk and dv.
    q_heads / kv_heads: per rank (default: attention_split's; a head chunk passes its own). Keys: the whole S (under
    cp, one zigzag chunk's call sees at most S keys; the calls run one at a time). 0 without GQA on the rank.
    Llama-3-8B at SP 1: 2 [T, h] (2 GiB per 128k tokens in bf16); at 1M tokens on one GPU 16 GiB.
    estimate(device="cuda") counts it for every GPU run, SDPA included: torch's SDPA flash backend vendors
    FlashAttention-2's backward, GQA expansion included, and transformers passes it enable_gqa where no mask is given.
    The H200 run of issue 43 ran SDPA (flash-attn not installed; train.py's auto picks sdpa then): 1 GiB per head chunk
    of 2 query heads on 1 KV head, inside the attention backward it measured within 4% (not measured apart)."""
    _, q_loc, kv_loc = attention_split(shape, sp, cp)
    q_loc, kv_loc = q_heads or q_loc, kv_heads or kv_loc
    return 2 * tokens * sp * q_loc * shape.head_dim * b if q_loc > kv_loc else 0


def kept_attention_bytes(shape: ModelShape, tokens: int, sp: int, b: int, cp: int = 1) -> int:
    """What --keep_attention keeps per checkpointed layer: the attention kernel's output [S/cp, nh/u, d] and its
    fp32 log-sum-exp [nh/u, S/cp] (torch's selective checkpoint caches the kernel's outputs, not its inputs; the
    gathered K/V are inputs, so cp adds nothing here)."""
    _, q_loc, _ = attention_split(shape, sp, cp)
    return tokens * sp // cp * q_loc * (shape.head_dim * b + 4)



# ---- headwise chunking (model_utils/head_chunks.py) ---------------------------------------------------------

def chunk_heads(num_heads: int, num_kv_heads: int, chunks: int) -> tuple[int, int]:
    """(query heads, KV heads) of one head chunk before the all-to-all: nh / n query heads and the KV heads they
    read (nkv / n, or 1 when a chunk is narrower than a GQA group: that KV head is then projected by each chunk
    of its group)."""
    hc = num_heads // chunks
    return hc, max(1, hc * num_kv_heads // num_heads)


def head_chunk_choices(num_heads: int, num_kv_heads: int, ulysses: int = 1) -> list[int]:
    """The head-chunk counts n that work under a Ulysses factor u: n divides the query heads per rank (nh / u), a
    chunk holds whole GQA groups or lies inside one (its KV heads are whole), and its KV heads split over or
    replicate across the u ranks as DeepSpeed's all-to-all needs (kv_compatible). 1 is always one."""
    g = num_heads // num_kv_heads
    out = []
    for n in range(1, num_heads // ulysses + 1):
        if (num_heads // ulysses) % n:
            continue
        hc, kvc = chunk_heads(num_heads, num_kv_heads, n)
        if (hc % g == 0 or g % hc == 0) and kv_compatible(kvc, ulysses):
            out.append(n)
    return out


def check_head_chunks(chunks: int, num_heads: int, num_kv_heads: int, ulysses: int = 1) -> int:
    """`chunks` when it is one of head_chunk_choices, else a one-line ValueError naming the valid values."""
    ok = head_chunk_choices(num_heads, num_kv_heads, ulysses)
    if chunks not in ok:
        per = f" ({num_heads // ulysses} per rank at Ulysses factor {ulysses})" if ulysses > 1 else ""
        raise ValueError(f"attention_head_chunks={chunks}: the model's {num_heads} query heads{per} and {num_kv_heads} "
                         f"KV heads split into whole-head chunks for {ok}: use one of them, or auto")
    return chunks


def chunk_split(shape: ModelShape, sp: int, cp: int, chunks: int) -> tuple[int, int, int, int]:
    """(hq, hkv, q_c, kv_c): one chunk's query / KV heads before the all-to-all (nh / n, chunk_heads) and per rank
    after it (hq / u; hkv / u, or 1 when DeepSpeed replicates the chunk's KV heads over u > hkv ranks)."""
    u = sp // cp
    hq, hkv = chunk_heads(shape.num_heads, shape.num_kv_heads, chunks)
    return hq, hkv, hq // u, hkv // u if hkv >= u else 1


def chunked_attention_bytes(shape: ModelShape, tokens: int, sp: int, b: int, cp: int = 1,
                            chunks: int = 1, flash: bool = False, ring: bool = False) -> tuple[int, int]:
    """(saved, backward transient) of one layer's attention run in `chunks` head chunks (model_utils/head_chunks.py),
    on one rank; the transient excludes the 3 [T, h] gradients every layer's backward holds (layer_activations).

    saved: the kernel outputs of every chunk, the output [S/cp, nh/u, d] and fp32 log-sum-exp, which is what
    --keep_attention keeps (kept_attention_bytes): about 1 [T, h] however many chunks. Unchunked, the layer saves
    q, k, v, o, lse and o's all-to-all back instead (attn_io + lse + o_back: 3.5 [T, h] for Llama-3-8B at SP 8).
    transient, one chunk at a time: its recomputed projections before the all-to-all and their gradients
    (2 T (hq + 2 hkv) d b), q, k, v after it and the gradients of q, k, v, o (2 attn_io_c - o_c), the fp32 dq
    accumulator of flash attention, and the output back in [T, hq d] with its gradient (2 o_back_c; at SP 1 the
    output is a view of o, its gradient still a tensor); flash: FlashAttention-2's GQA backward's query-head-wide dk,
    dv of the chunk (gqa_expanded_grad_bytes)."""
    u = sp // cp
    d = shape.head_dim
    hq, hkv, q_c, kv_c = chunk_split(shape, sp, cp, chunks)
    queries, seq = tokens * sp // cp, tokens * sp
    o_c = queries * q_c * d * b
    io_c = 2 * o_c + 2 * kv_length(seq, cp, ring) * kv_c * d * b  # ring: the rank's own K / V (kv_length)
    acc_c = queries * q_c * d * 4
    back_c = tokens * hq * d * b
    pre_c = tokens * (hq + 2 * max(hkv, u if u > hkv else 0)) * d * b  # KV replicated to u heads before sending
    saved = kept_attention_bytes(shape, tokens, sp, b, cp)
    transient = 2 * pre_c + 2 * io_c - o_c + acc_c + back_c * (2 if sp > 1 else 1)
    if flash:
        transient += gqa_expanded_grad_bytes(shape, tokens, sp, b, cp, q_c, kv_c)
    return saved, transient
