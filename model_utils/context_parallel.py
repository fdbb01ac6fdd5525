"""Context parallelism across Ulysses groups: SP = ulysses x cp, so the SP degree is free of the head count.

Ulysses (DeepSpeed's all-to-all) splits heads inside a node; it needs its factor to divide the query heads. The
context-parallel factor cp splits the sequence across Ulysses groups: after the all-to-all a rank holds the
queries, keys and values of its cp shard ([bs, heads/u, sl/cp, hd]) and this function, registered as the core
attention under DeepSpeed's wrapper (or alone when u = 1), computes attention over the WHOLE sequence by
all-gathering K and V over the cp group (Llama 3's context parallelism): every rank keeps its own queries and
sees every key, so any mask works (packed documents, sliding windows), and backward is one reduce-scatter of
dK / dV. Samples are laid out in zigzag order (base.parallel.zigzag_chunks: cp rank c holds chunks c and
2cp-1-c of 2cp), so each rank's causal work is equal.

Why all-gather rather than a ring of K/V blocks (ring attention) at Llama-3-8B, 1M tokens, 4 nodes x 8 H100,
sp = 32 = 8 x 4 (docs/attention.md has the numbers): with GQA a rank's K/V are small next to its queries (after
the all-to-all: 1 KV head of 128 dims vs 4 query heads), so gathering them is 2 x 1M x 128 x 2 B = 512 MB per
layer per rank in bf16 (3/4 of it over InfiniBand), the same bytes a ring passes, in one collective that NCCL
pipelines, with no per-block online-softmax merging, and any mask is just a mask over global positions. Its cost
is memory: the gathered K/V of one layer ([sl, 1, 128] x 2, 0.5 GB, plus as much for dK / dV in its backward)
where a ring keeps two blocks; at 1M that is under 1% of an 80 GB GPU, and under activation checkpointing only
the layer being computed holds it.

Per backend, for each of the rank's two query chunks [a, b) against the keys [0, b) (global positions):
- sdpa: the document pieces of the whole row (attention.sdpa_pieces) clipped to [a, b), one call per piece with
  its [q, k] mask (a piece is at most BLOCK tokens unless one document is longer). The CPU / test path.
- flex_attention: a rectangular BlockMask from the document ids at block granularity (`rect_block_mask`).
Learned attention sinks (GPT-OSS's `s_aux`, already sliced to the rank's heads by ulysses.py) enter once per query:
every query is computed in one call against all its keys (nothing is merged across K/V shards); flex applies them
from its lse (GPU), and on CPU the sdpa pieces run `sinks.sink_sdpa`.
- flash_attention_2/3: varlen with separate cu_seqlens for queries and keys (`varlen_chunk`): each document's
  queries inside [a, b) against its keys from its start, causal aligned bottom-right as flash-attn does when
  the lengths differ. Written by construction (no GPU here); tests/unit/model_utils checks its inputs on CPU.
"""

from __future__ import annotations

import bisect

import torch

from base import comm
from base.parallel import zigzag_chunks
from model_utils import attention, ring_attention, sinks


def natural(stacked: torch.Tensor, cp: int, dim: int) -> torch.Tensor:
    """[cp, ..., 2C (at `dim` + 1), ...] gathered in cp-rank order (rank c: chunks c, 2cp-1-c) -> [..., 2cp*C, ...]
    in sequence order, along `dim` of one rank's tensor."""
    halves = stacked.unflatten(dim + 1, (2, -1))  # [cp, ..., 2, C, ...]
    where = {ch: (i // 2, i % 2) for i, ch in enumerate(zigzag_chunks(cp))}  # chunk -> (rank, half)
    return torch.cat([halves[where[ch][0]].select(dim, where[ch][1]) for ch in range(2 * cp)], dim=dim)


def local_ranges(sl: int, cp: int, c: int) -> list[tuple[int, int]]:
    """The global [a, b) ranges of cp rank c's two chunks, in the order it holds them."""
    n = sl // (2 * cp)
    return [(c * n, (c + 1) * n), ((2 * cp - 1 - c) * n, (2 * cp - c) * n)]


# ---- per backend: queries [a, b) of the whole sequence against keys [0, b) ------------------------------------

def _sdpa_chunk(orig, module, q, key, value, docs, a: int, b: int, window, kwargs):
    # q [bs, hq, b - a, hd]; key/value [bs, hkv, sl, hd] in sequence order
    rows = []
    for r in range(q.shape[0]):
        bounds = docs.bounds[r] if docs.bounds is not None else [0, docs.sl]
        outs = []
        for q_lo, q_hi, k_lo, _k_hi in docs.pieces(r, window):
            lo, hi = max(q_lo, a), min(q_hi, b)
            if lo >= hi:
                continue
            piece = (lo, hi, k_lo, hi)  # causal: no key after the piece's last query
            out = attention.masked_sdpa(orig, module, q[r:r + 1, :, lo - a:hi - a], key[r:r + 1, :, k_lo:hi],
                                        value[r:r + 1, :, k_lo:hi], attention._piece_mask(docs.doc[r], bounds, piece,
                                                                                          window), kwargs)
            outs.append(out)  # [1, hi - lo, hq, hd]
        rows.append(torch.cat(outs, dim=1))
    return torch.cat(rows, dim=0)  # [bs, b - a, hq, hd]


def rect_block_mask(doc: torch.Tensor, a: int, b: int, window: int | None, block: int = attention.FLEX_BLOCK):
    """flex_attention BlockMask of queries [a, b) (global) against keys [0, b) for document ids `doc` [bs, sl]
    (nondecreasing along each row), at block granularity: [bs, nq, nk] block tables, never [q, k]."""
    from torch.nn.attention.flex_attention import BlockMask

    bs, dev = doc.shape[0], doc.device
    nq, nk = -(-(b - a) // block), -(-b // block)

    def padded(ids, n):
        return torch.cat([ids, ids[:, -1:].expand(bs, n * block - ids.shape[1])], dim=1)

    qids, kids = padded(doc[:, a:b], nq), padded(doc[:, :b], nk)  # mask_mod may read the padded tail
    q0 = a + torch.arange(nq, device=dev) * block  # first / last global query of each block
    q1 = torch.clamp(q0 + block - 1, max=b - 1)
    k0 = torch.arange(nk, device=dev) * block
    k1 = torch.clamp(k0 + block - 1, max=b - 1)
    lo_q, hi_q = qids.view(bs, nq, block)[..., 0][:, :, None], qids.view(bs, nq, block)[..., -1][:, :, None]
    lo_k, hi_k = kids.view(bs, nk, block)[..., 0][:, None, :], kids.view(bs, nk, block)[..., -1][:, None, :]
    some = (lo_q <= hi_k) & (lo_k <= hi_q) & (k0[None, None, :] <= q1[None, :, None])
    full = (lo_q == hi_q) & (lo_k == hi_k) & (lo_q == lo_k) & (k1[None, None, :] <= q0[None, :, None])
    full &= ((q1 - q0 == block - 1)[None, :, None]) & ((k1 - k0 == block - 1)[None, None, :])  # whole blocks only
    if window is not None:
        some &= (q0[None, :, None] - k1[None, None, :]) < window  # nearest pair within the window
        full &= (q1[None, :, None] - k0[None, None, :]) < window  # farthest pair within the window
    partial = some & ~full

    def blocks(m):  # -> [bs, 1, nq] counts, [bs, 1, nq, nk] indices (the selected ones first, in order)
        return m.sum(-1).to(torch.int32)[:, None], torch.argsort((~m).to(torch.int8), dim=-1, stable=True).to(torch.int32)[:, None]

    def mask_mod(bi, h, qi, ki):
        keep = (qids[bi, qi] == kids[bi, ki]) & (qi + a >= ki)
        return keep & (qi + a - ki < window) if window is not None else keep

    return BlockMask.from_kv_blocks(*blocks(partial), *blocks(full), BLOCK_SIZE=block, mask_mod=mask_mod,
                                    seq_lengths=(b - a, b))


def _flex_chunk(orig, module, q, key, value, docs, a: int, b: int, window, kwargs):
    k = ("cp_flex", a, b, window)
    if k not in docs._cache:
        docs._cache[k] = rect_block_mask(docs.doc, a, b, window)
    out, _ = orig(module, q, key[:, :, :b], value[:, :, :b], docs._cache[k], **kwargs)
    return out


def varlen_chunk(bounds: list[int], a: int, b: int) -> tuple[int, list[int], list[int]]:
    """For one row with document bounds [0, s1, ..., sl]: (k_lo, cu_q, cu_k) for queries [a, b) against their
    documents' keys. Documents overlapping [a, b) are consecutive, so their keys are the one range [k_lo, b):
    fragment i has queries [max(s_i, a), min(e_i, b)) and keys [s_i, min(e_i, b)), both ending together (the
    bottom-right causal alignment flash-attn uses when the lengths differ). cu_* start at 0 (offsets from a / k_lo)."""
    i = bisect.bisect_right(bounds, a) - 1  # the document holding query a
    k_lo, cu_q, cu_k = bounds[i], [0], [0]
    while i < len(bounds) - 1 and bounds[i] < b:
        e = min(bounds[i + 1], b)
        cu_q.append(e - a)
        cu_k.append(e - k_lo)
        i += 1
    return k_lo, cu_q, cu_k


def _flash_chunk(orig, module, q, key, value, docs, a: int, b: int, window, kwargs):
    # UNTESTED on a GPU here. Rows flattened into one packed row; FA applies kwargs["sliding_window"] itself.
    bs, hq, _, _ = q.shape
    k = ("cp_varlen", a, b)
    if k not in docs._cache:
        from transformers.modeling_flash_attention_utils import flash_attn_supports_top_left_mask

        if flash_attn_supports_top_left_mask():  # flash-attn < 2.1 aligns causal top-left: wrong when lq < lk
            raise ValueError("context parallelism with flash-attention needs flash-attn >= 2.1 (bottom-right causal "
                             "alignment); upgrade it or use context_parallel_size 1")
        cu_q, cu_k, ranges, max_q, max_k = [0], [0], [], 0, 0
        for r in range(bs):
            bounds = docs.bounds[r] if docs.bounds is not None else [0, docs.sl]
            k_lo, cq, ck = varlen_chunk(bounds, a, b)
            cu_q += [cu_q[-1] + x for x in cq[1:]]
            cu_k += [cu_k[-1] + x for x in ck[1:]]
            max_q = max(max_q, *(y - x for x, y in zip(cq[:-1], cq[1:])))
            max_k = max(max_k, *(y - x for x, y in zip(ck[:-1], ck[1:])))
            ranges.append(k_lo)
        dev = q.device
        docs._cache[k] = (torch.tensor(cu_q, dtype=torch.int32, device=dev),
                          torch.tensor(cu_k, dtype=torch.int32, device=dev), ranges, max_q, max_k)
    cu_q, cu_k, ranges, max_q, max_k = docs._cache[k]
    kw = {n: v for n, v in kwargs.items() if n != "position_ids"}
    qf = q.transpose(0, 1).reshape(1, hq, -1, q.shape[-1])  # [1, hq, bs * (b - a), hd]
    kf = torch.cat([key[r:r + 1, :, lo:b] for r, lo in enumerate(ranges)], dim=2)  # [1, hkv, sum of key ranges, hd]
    vf = torch.cat([value[r:r + 1, :, lo:b] for r, lo in enumerate(ranges)], dim=2)
    out, _ = orig(module, qf, kf, vf, None, cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k, max_length_q=max_q,
                  max_length_k=max_k, **kw)
    return out.reshape(bs, b - a, hq, -1)


_BY_BACKEND = {"sdpa": _sdpa_chunk, "flex_attention": _flex_chunk, "flash_attention_2": _flash_chunk,
               "flash_attention_3": _flash_chunk}


def context_parallel(attn: str, orig, group, cp: int, cp_rank: int, ring: bool = False):
    """The core attention function for backend `attn` under context parallelism over `group` (cp ranks): gathers
    K / V (and the position ids) of the whole sequence, computes this rank's two query chunks against them with
    document masking and the layer's window, and returns [bs, sl/cp, hq, hd] in the rank's own (zigzag) order.
    ring: K / V pass around the cp group block by block instead (model_utils/ring_attention.py); the position ids
    are still gathered ([sl] int32 per row: 64 MiB at 16M tokens)."""
    chunk_fn = _BY_BACKEND[attn]

    def attention_cp(module, query, key, value, attention_mask, **kwargs):
        # query [bs, hq, T, hd], key / value [bs, hkv, T, hd]: T = sl / cp tokens, chunks c and 2cp-1-c
        if attention_mask is not None or query.shape[2] != key.shape[2]:
            raise ValueError(f"{type(module).__name__}: context parallelism needs unpadded training-style calls (no "
                             "attention mask, no KV cache): use context_parallel_size 1 for this call")
        if kwargs.get("position_ids") is None:
            raise ValueError(f"{type(module).__name__} passes no position_ids to its attention function: context "
                             "parallelism needs them; use a model whose attention forwards **kwargs")
        bs, _, t, _ = query.shape
        pos = kwargs["position_ids"]  # [1 or bs, T]
        # the whole sequence's positions, every layer (the same collectives on every rank, whatever is cached)
        pos_all = natural(comm.gather_stack(pos.to(torch.int32), group, cp), cp, dim=1)  # [1 or bs, sl]
        docs = attention.documents_for(pos_all, bs)  # built by the first layer of a micro-batch, then cached
        window = attention._window(module, kwargs)
        attention._STATE["windows"].add(window)
        sl = pos_all.shape[1]
        if window is not None and window >= sl:
            window = None
        if ring:
            if kwargs.get("s_aux") is not None or kwargs.get("softcap") or kwargs.get("dropout"):
                raise ValueError(f"{type(module).__name__}: ring_attention does not run attention sinks, logit "
                                 "softcapping or attention dropout: use ring_attention false")
            spec = ring_attention.Spec(group, cp, cp_rank, [local_ranges(sl, cp, j) for j in range(cp)], docs,
                                       window, kwargs.get("scaling") or query.shape[-1] ** -0.5, attn)
            return ring_attention.ring_attention(query, key, value, spec), None
        k_all = natural(comm.gather_stack(key, group, cp), cp, dim=2)  # [bs, hkv, sl, hd]
        v_all = natural(comm.gather_stack(value, group, cp), cp, dim=2)
        fn, inner = chunk_fn, orig
        if kwargs.get("s_aux") is not None and query.device.type == "cpu":  # learned sinks (GPT-OSS) on CPU
            fn, inner = _sdpa_chunk, sinks.sink_sdpa  # each query in one piece: its sink enters once
        outs = []
        for half, (a, b) in enumerate(local_ranges(sl, cp, cp_rank)):
            q = query[:, :, half * (t // 2):(half + 1) * (t // 2)]
            outs.append(fn(inner, module, q, k_all, v_all, docs, a, b, window, kwargs))
        return torch.cat(outs, dim=1), None  # [bs, T, hq, hd]

    return attention_cp


RING_FLASH_ATTN = "2.7"  # the ring calls flash-attn's private varlen ops: window_size_left / _right and 4 outputs


def check_ring_flash_attn() -> None:
    """The ring's flash kernel calls flash_attn_interface._flash_attn_varlen_forward / _backward with 2.7's signature
    (2.6 takes window_size=(left, right) and returns 8 values: a TypeError at the first ring call): refused at start-up."""
    from packaging.version import Version

    try:
        import flash_attn
    except ImportError:
        flash_attn = None
    found = getattr(flash_attn, "__version__", None)
    if found is None or Version(found) < Version(RING_FLASH_ATTN):
        raise ValueError(f"ring_attention with flash_attention_2 needs flash-attn >= {RING_FLASH_ATTN} (found "
                         f"{found or 'none'}): upgrade it (requirements-gpu.txt) or set ring_attention false")


def register(attn: str, group, cp: int, cp_rank: int, ring: bool = False) -> None:
    """Make the registered core attention for `attn` the context-parallel one (after attention.register, before
    Ulysses wraps it). attention.restore() undoes it. ring: K / V in a ring (ring_attention.RING_BACKENDS only)."""
    if ring and attn == "flash_attention_2":
        check_ring_flash_attn()
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if ring and attn not in ring_attention.RING_BACKENDS:
        raise ValueError(f"ring_attention with attn_implementation {attn}: the ring runs on "
                         f"{list(ring_attention.RING_BACKENDS)}; use one of them or ring_attention false")
    if ring and attn == "sdpa" and torch.cuda.is_available():  # the sdpa ring is the CPU / test path: fp32 scores of
        # TILE_ROWS queries against a whole key block, which the plan does not count (16M on 8 x 4: 8 GiB a tile)
        raise ValueError("ring_attention on a GPU runs flash_attention_2 (the sdpa ring is the CPU test path): install "
                         "flash-attn (requirements-gpu.txt) or set ring_attention false")
    ALL_ATTENTION_FUNCTIONS[attn] = context_parallel(attn, attention._ORIGINAL[("attn", attn)], group, cp, cp_rank,
                                                     ring)
