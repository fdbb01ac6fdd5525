"""Context parallelism with K/V passed in a ring (`ring_attention: true`) instead of gathered whole.

model_utils/context_parallel.py's default all-gathers the whole sequence's K and V over the cp group for each
layer: one [S, kv_heads/u, d] pair per rank (plus its rank-order copy, and dK / dV as large in backward). At
Llama-3-8B, 16M tokens on 32 GPUs (u=8 x cp=4) that is what binds (issue 43). Here each rank keeps its own block
(its two zigzag chunks, [bs, hkv, S/cp, d]) and the blocks travel: at step i rank c computes its queries against
the block of rank c-i while the next block arrives (base.comm.RingShift: one send to c+1, one receive from c-1,
started before the compute and waited after it). The partial outputs merge by their log-sum-exp (online softmax:
out = sum_j exp(lse_j - lse) out_j, lse = logsumexp_j lse_j), so any mask over global positions still works
(packed documents with restarted positions, sliding windows): the blocks are (query chunk, key chunk) pairs of
global ranges, masked as one whole-sequence call would mask them.

Backward (the `_Ring` autograd.Function) runs the ring again, as ring-flash-attention and Megatron's context
parallelism do: with the global output O and lse saved, block j's gradients are exact on their own (P = exp(S -
lse), D = rowsum(dO * O), dS = P (dP - D)), so nothing per block is kept from the forward. dQ accumulates locally
(fp32); dK / dV of block j accumulate and travel with it in fp32 (as ring-flash-attention does) and arrive at their
owner after cp steps, cast to the compute dtype there. Autograd over the per-block calls would have kept every
block's K / V for backward: the whole gathered K / V again, which is what this avoids. The forward is one torch op
(`_forward_op`), so --keep_attention and head chunks keep its merged output and lse, not each block call's.

What a rank holds beyond its own q, k, v, o (planner.attention_sp.cp_kv_buffer_bytes counts it; the multi-process
test checks it byte for byte against STATS["peak_bytes"]): forward, the block computed on and the one arriving (2
K/V blocks; 1 at cp = 2) plus the fp32 output and lse accumulators; backward, 2 K/V blocks (1 at cp = 2), the fp32
dQ accumulator and 3 fp32 dK/dV blocks (the one computed, the one in flight to the next rank, the one arriving). Not in
it: each block pair's kernel working set (the math path's fp32 scores of a tile; flash-attn's own dq accumulator
and dk, dv of one chunk, the pair's rows being views at micro-batch 1), as for the gather's kernel.
Llama-3-8B at 16M tokens on u=8 x cp=4 in 4 head chunks (bf16; per chunk 1 query and 1 KV head per rank): a K/V
block is 2 GiB and the backward's ring 18 GiB (4 of K/V, 2 of dQ, 12 of fp32 dK/dV: 6 more than in bf16), where the
gather holds 8 GiB of staging and whole-sequence K, V, dK, dV in the kernel (18 GiB, against 4 for the rank's own).

Cost against the gather at that scale: forward passes the same K / V bytes ((cp-1)/cp of the gathered size);
backward passes K / V again and dK / dV (cp hops): 2x the gather's backward bytes (one reduce-scatter of dK / dV).
Each hop starts before the step's compute and is waited after it. A step computes an S/(2cp)-query chunk pair
against S/cp keys: at 16M ~11 s per head chunk on an H100 (MFU 0.4) next to ~0.04 s for a 2 GiB
block over a 50 GB/s InfiniBand port, so the ring hides its traffic where the gather waits for its whole collective
before any compute (planner.comm_model.layer_collectives).

Kernels per backend (queries [a, b) of one zigzag chunk against the keys [c, e) of another, global positions):
- sdpa (the CPU / test path): the attention written out in fp32 (torch's sdpa returns no lse on CPU), over tiles
  of TILE_ROWS queries, with the document / causal / window mask of the pair.
- flash_attention_2: flash-attn's (>= 2.7) varlen forward (softmax_lse) and backward from the global out / lse per
  block pair (`pair_calls`: the diagonal pair per document, causal; an earlier key chunk only for the document that
  spans into the query chunk, not causal, the window shifted for flash's bottom-right alignment and split so its
  implicit right limit drops no key), the calls' cu_seqlens built once per micro-batch on the device (`_plan`).
  Written by construction: no GPU with flash-attn here; tests/unit/model_utils/test_ring_flash_rules.py runs it on
  CPU through a stand-in registered as flash-attn's own ops (tests/unit/model_utils/flash_rules.py: its window
  conversions, bottom-right mask, +inf lse of an empty row) against the math kernel and a dense mask.
- flash_attention_3, flex_attention: not yet (context_parallel.register refuses them in one line; the gather serves
  them).
"""

from __future__ import annotations

import bisect
import itertools

import torch

from base import comm

TILE_ROWS = 1024  # queries per tile of the math kernel: scores [bs, hq, TILE_ROWS, S/(2cp)] fp32 at a time
RING_BACKENDS = ("sdpa", "flash_attention_2")
STATS: dict = {"peak_bytes": 0, "calls": 0, "log": None}  # log: a list to record every shift's (shape, dtype)


def _nbytes(*ts: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


class _Held:
    """Bytes of the ring's own buffers alive now, and the most at once (STATS["peak_bytes"])."""

    def __init__(self):
        self.now = 0

    def add(self, *ts):
        self.now += _nbytes(*ts)
        STATS["peak_bytes"] = max(STATS["peak_bytes"], self.now)

    def drop(self, *ts):
        self.now -= _nbytes(*ts)


class Spec:
    """What one attention call's ring needs: the group, the layout, the mask and the kernel. `docs`: the micro-batch's
    attention.Documents (doc ids [bs, sl] on the device; the flash kernel's plans are cached on it)."""

    def __init__(self, group, cp: int, rank: int, ranges: list, docs, window: int | None, scale: float,
                 backend: str = "sdpa"):
        self.group, self.cp, self.rank, self.ranges = group, cp, rank, ranges  # ranges[c]: rank c's two (a, b)
        self.docs, self.doc, self.window, self.scale = docs, docs.doc, window, scale  # doc [bs, sl] int32 ids
        flash = backend.startswith("flash_attention")
        self.forward, self.backward = (flash_forward, flash_backward) if flash else (math_forward, math_backward)

    def reaches(self, qr: tuple[int, int], kr: tuple[int, int]) -> bool:
        """Whether any key of kr can be attended by a query of qr (causal, window; documents inside the kernel)."""
        if kr[0] >= qr[1]:
            return False
        return self.window is None or qr[0] - (kr[1] - 1) < self.window


# ---- the math kernel (sdpa backend): fp32, tiles of TILE_ROWS queries -----------------------------------------

def _scores(spec: Spec, q, k, qr, kr, lo: int, hi: int) -> torch.Tensor:
    """[bs, hq, hi - lo, nk] masked scaled scores of queries qr[0] + [lo, hi) against keys kr; k already expanded."""
    qpos = torch.arange(qr[0] + lo, qr[0] + hi, device=q.device)
    kpos = torch.arange(kr[0], kr[1], device=q.device)
    s = torch.einsum("bhqd,bhkd->bhqk", q[:, :, lo:hi].float(), k.float()) * spec.scale
    keep = (spec.doc[:, qr[0] + lo:qr[0] + hi, None] == spec.doc[:, None, kr[0]:kr[1]]) & (kpos <= qpos[:, None])
    if spec.window is not None:
        keep &= (qpos[:, None] - kpos) < spec.window
    return s.masked_fill(~keep[:, None], float("-inf"))


def _expand(x: torch.Tensor, hq: int) -> torch.Tensor:
    return x.repeat_interleave(hq // x.shape[1], dim=1) if x.shape[1] != hq else x  # HF's repeat_kv order


def math_forward(spec: Spec, q, k, v, qr, kr):
    """(out [bs, hq, nq, d] fp32, lse [bs, hq, nq] fp32) of queries qr against keys kr alone; -inf lse where a
    query sees none of them."""
    k, v = _expand(k, q.shape[1]), _expand(v, q.shape[1]).float()
    outs, lses = [], []
    for lo in range(0, q.shape[2], TILE_ROWS):
        s = _scores(spec, q, k, qr, kr, lo, min(lo + TILE_ROWS, q.shape[2]))
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
        outs.append(p @ v)
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def math_backward(spec: Spec, do, q, k, v, out, lse, qr, kr, dq, dk, dv) -> None:
    """Adds block (qr, kr)'s gradients, given the GLOBAL out and lse of the queries, into dq [bs, hq, nq, d] and
    dk, dv [bs, hkv, nk, d] (views of the ring's accumulators)."""
    hq, hkv = q.shape[1], k.shape[1]
    ke, ve = _expand(k, hq).float(), _expand(v, hq).float()
    dk_x, dv_x = 0.0, 0.0  # [bs, hq, nk, d] fp32: the query heads' parts, summed to the KV heads below
    for lo in range(0, q.shape[2], TILE_ROWS):
        hi = min(lo + TILE_ROWS, q.shape[2])
        p = torch.exp(_scores(spec, q, ke, qr, kr, lo, hi) - lse[:, :, lo:hi, None])
        g = do[:, :, lo:hi].float()
        dv_x = dv_x + p.transpose(-1, -2) @ g
        ds = p * (g @ ve.transpose(-1, -2) - (g * out[:, :, lo:hi].float()).sum(-1, keepdim=True))
        dq[:, :, lo:hi] += ds @ ke * spec.scale
        dk_x = dk_x + ds.transpose(-1, -2) @ q[:, :, lo:hi].float() * spec.scale
    fold = (lambda x: x.unflatten(1, (hkv, hq // hkv)).sum(2)) if hq != hkv else (lambda x: x)
    dk += fold(dk_x)
    dv += fold(dv_x)


# ---- the flash kernel (flash_attention_2): flash-attn's varlen forward / backward per block pair -------------------

def pair_calls(bounds: list[list[int]], qr: tuple[int, int], kr: tuple[int, int], window: int | None) -> list:
    """The varlen calls of queries qr against keys kr (global ranges of two zigzag chunks), per row's document
    bounds [0, s1, ..., sl]: [(segments, causal, left)], segments [(row, q_lo, q_hi, k_lo, k_hi)] offsets inside the
    chunks, `left` flash-attn's window_size_left (-1: none). flash-attn's rules (csrc/flash_attn/flash_api.cpp,
    src/mask.h, 2.8.3): a segment's mask is aligned bottom-right (its last query with its last key); a left window
    with no right one gets right = max_seqlen_k, so query i of a segment of m queries and n keys sees keys j <=
    i + n - m + max_seqlen_k; a query that sees no key gets out 0 and lse +inf. So every call here has each query
    see all of its keys within those limits, and none is empty:
    - the diagonal pair (kr == qr): each document clipped to the chunk, the same range of queries and keys: causal,
      left = window - 1; one call for all rows.
    - keys before the queries (kr ends at or before qr starts): only the document holding query qr[0] reaches back
      (documents are contiguous): its queries [qr[0], q_hi) against its keys [k_lo, kr[1]), not causal. Without a
      window (or where the window reaches past k_lo: queries < k_lo + w) a query sees all of them: one call for all
      rows, no window. The queries past k_lo + w - 1 (at most n - 1 of them, so the implicit right limit keeps every
      key) see keys > p - w: a second call per row on keys [k_lo + 1, kr[1]) with left = kr[1] - q_hi + w - 1
      (bottom-right alignment). One call for both, left = that and right = -1, took right = max_seqlen_k: with more
      queries than keys + 1 the first queries lost keys, all of them (lse +inf: NaN in `_merge`) past twice as many
      (issue 49: bounds [0, 10, 48], cp 2, window 8).
    - keys after the queries: nothing (Spec.reaches skips the pair)."""
    (a, b), (c, e), n = qr, kr, qr[1] - qr[0]
    if kr == qr:
        segs = []
        for r, bd in enumerate(bounds):
            i = bisect.bisect_right(bd, a) - 1
            while i < len(bd) - 1 and bd[i] < b:
                lo, hi = max(bd[i], a) - a, min(bd[i + 1], b) - a
                segs.append((r, lo, hi, lo, hi))
                i += 1
        return [(segs, True, window - 1 if window else -1)]
    assert e <= a, (qr, kr)
    whole, cut = [], []
    for r, bd in enumerate(bounds):
        i = bisect.bisect_right(bd, a) - 1
        s, end = bd[i], bd[i + 1]
        k_lo = max(s, c, a - window + 1 if window else c)
        q_hi = min(end, b, e + window - 1 if window else b)
        if k_lo >= e or q_hi <= a:
            continue
        split = min(q_hi, k_lo + window) if window else q_hi  # queries before it see every key of [k_lo, e)
        whole.append((r, 0, split - a, k_lo - c, e - c))
        if split < q_hi:  # q_hi - split <= e - k_lo - 1 keys: the implicit right limit keeps them all
            cut.append(([(r, split - a, q_hi - a, k_lo + 1 - c, e - c)], False, e - q_hi + window - 1))
    assert all(seg[2] <= n for call in cut for seg in call[0]) and all(seg[2] <= n for seg in whole)
    return ([(whole, False, -1)] if whole else []) + cut


def _fa_forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, left):
    """flash-attn 2.8's varlen forward -> (out [total_q, hq, d], lse [hq, total_q] fp32). Not run on a GPU yet (a CPU
    stand-in of its rules runs it: tests/unit/model_utils/flash_rules.py)."""
    from flash_attn.flash_attn_interface import _flash_attn_varlen_forward

    out, lse, _, _ = _flash_attn_varlen_forward(
        q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k, dropout_p=0.0,
        softmax_scale=scale, causal=causal, window_size_left=left, window_size_right=0 if causal else -1,
        softcap=0.0, alibi_slopes=None, return_softmax=False)
    return out, lse


def _fa_backward(do, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal, left):
    """flash-attn 2.8's varlen backward from the GIVEN out / lse -> (dq, dk, dv) in q's dtype. Not run on a GPU yet."""
    from flash_attn.flash_attn_interface import _flash_attn_varlen_backward

    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _flash_attn_varlen_backward(
        dout=do, q=q, k=k, v=v, out=out, softmax_lse=lse, dq=dq, dk=dk, dv=dv, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
        max_seqlen_q=max_q, max_seqlen_k=max_k, dropout_p=0.0, softmax_scale=scale, causal=causal,
        window_size_left=left, window_size_right=0 if causal else -1, softcap=0.0, alibi_slopes=None,
        deterministic=False, rng_state=None)
    return dq, dk, dv


FLASH = {"forward": _fa_forward, "backward": _fa_backward}  # a test puts a CPU stand-in with flash's semantics here


def _plan(spec: Spec) -> dict:
    """{(qr, kr): [(segments, causal, left, cu_q, cu_k, max_q, max_k)]} for every block pair of the layout (every
    rank's: a few hundred small lists at most), with the calls' cu_seqlens (int32) as views of one tensor on the
    device: built by the first ring call of a micro-batch (one host-to-device copy) and cached on its Documents, so
    a layer's block calls copy nothing (each call built its own with a blocking copy: 3 per forward pair, 5 per
    backward pair)."""
    key = ("ring_flash", spec.cp, spec.window)
    if key not in spec.docs._cache:
        bounds = spec.docs.bounds or [[0, spec.docs.sl]] * spec.docs.bs
        host, calls = [], {}
        chunks = [r for rank in spec.ranges for r in rank]
        for qr in chunks:
            for kr in chunks:
                if spec.reaches(qr, kr):
                    calls[(qr, kr)] = []
                    for segs, causal, left in pair_calls(bounds, qr, kr, spec.window):
                        lq, lk = [s[2] - s[1] for s in segs], [s[4] - s[3] for s in segs]
                        at = len(host)
                        host += [0, *itertools.accumulate(lq), 0, *itertools.accumulate(lk)]
                        calls[(qr, kr)].append((segs, causal, left, at, len(segs) + 1, max(lq), max(lk)))
        cu = torch.tensor(host, dtype=torch.int32, device=spec.doc.device)
        spec.docs._cache[key] = {pair: [(segs, causal, left, cu[at:at + m], cu[at + m:at + 2 * m], mq, mk)
                                        for segs, causal, left, at, m, mq, mk in got] for pair, got in calls.items()}
    return spec.docs._cache[key]


def _gather(x: torch.Tensor, segs, kv: bool) -> torch.Tensor:
    """[bs, h, n, d] -> the segments' rows as [total, h, d]. Segments of one row, back to back (micro-batch 1: every
    call), are a view (flash-attn takes any strides but the last); else a copy."""
    lo, hi = (3, 4) if kv else (1, 2)
    if all(s[0] == segs[0][0] for s in segs) and all(s[hi] == t[lo] for s, t in zip(segs, segs[1:])):
        return x[segs[0][0], :, segs[0][lo]:segs[-1][hi]].transpose(0, 1)
    return torch.cat([x[s[0], :, s[lo]:s[hi]].transpose(0, 1) for s in segs])


def _scatter(dst: torch.Tensor, src: torch.Tensor, segs, kv: bool, add: bool = False) -> None:
    """The inverse of _gather into dst [bs, h, n, ...] from src [total, h, ...] (or [h, total] for lse: dst 3-d)."""
    lo, hi = (3, 4) if kv else (1, 2)
    off = 0
    for s in segs:
        m = s[hi] - s[lo]
        part = src[:, off:off + m] if dst.dim() == 3 else src[off:off + m].transpose(0, 1)
        view = dst[s[0], :, s[lo]:s[hi]]
        view.add_(part) if add else view.copy_(part)
        off += m


def flash_forward(spec: Spec, q, k, v, qr, kr):
    """As math_forward, through flash-attn's varlen kernel per call of pair_calls."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
    for segs, causal, left, cu_q, cu_k, max_q, max_k in _plan(spec)[(qr, kr)]:
        qf, kf, vf = _gather(q, segs, False), _gather(k, segs, True), _gather(v, segs, True)
        o, lo = FLASH["forward"](qf, kf, vf, cu_q, cu_k, max_q, max_k, spec.scale, causal, left)
        _scatter(out, o.float(), segs, False)
        _scatter(lse, lo.float(), segs, False)
    return out, lse


def flash_backward(spec: Spec, do, q, k, v, out, lse, qr, kr, dq, dk, dv) -> None:
    """As math_backward, through flash-attn's varlen backward given the global out / lse of the queries."""
    for segs, causal, left, cu_q, cu_k, max_q, max_k in _plan(spec)[(qr, kr)]:
        qf, kf, vf = _gather(q, segs, False), _gather(k, segs, True), _gather(v, segs, True)
        dof, of = _gather(do, segs, False), _gather(out, segs, False)
        lf = torch.cat([lse[s[0], :, s[1]:s[2]] for s in segs], dim=1).contiguous()  # [hq, total_q]
        g = FLASH["backward"](dof, qf, kf, vf, of, lf, cu_q, cu_k, max_q, max_k, spec.scale, causal, left)
        _scatter(dq, g[0], segs, False, add=True)
        _scatter(dk, g[1], segs, True, add=True)
        _scatter(dv, g[2], segs, True, add=True)


# ---- the ring --------------------------------------------------------------------------------------------------

def _merge(acc: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, lo: torch.Tensor) -> None:
    """In place: (acc, lse) <- the softmax over both key sets (acc, o: [.., n, d] fp32; lse, lo: [.., n]). A query
    that saw no key of the block has lo -inf (math) or +inf (flash-attn's convention): both add nothing."""
    lo = torch.where(lo == float("inf"), float("-inf"), lo)
    new = torch.logaddexp(lse, lo)
    safe = torch.where(torch.isinf(new), 0.0, new)
    acc.mul_(torch.exp(lse - safe)[..., None]).add_(o * torch.exp(lo - safe)[..., None])
    lse.copy_(new)


def _pairs(spec: Spec, j: int, c: int):
    """(query half, key half, query range, key range) of rank `spec.rank`'s chunks against rank j's that reach."""
    for qh, qr in enumerate(spec.ranges[spec.rank]):
        for kh, kr in enumerate(spec.ranges[j]):
            if spec.reaches(qr, kr):
                yield slice(qh * c, (qh + 1) * c), slice(kh * c, (kh + 1) * c), qr, kr


def _forward(q, k, v, spec: Spec):
    """The ring's forward: (out [bs, hq, T, d] in q's dtype, lse [bs, hq, T] fp32) of the rank's queries against
    every rank's block."""
    held, c = _Held(), q.shape[2] // 2
    acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
    held.add(acc, lse)
    kv = [k, v]
    for i in range(spec.cp):
        shift = comm.RingShift(kv, spec.group, STATS["log"]) if i < spec.cp - 1 else None
        if shift is not None:
            held.add(*shift.recv)
        for qs, ks, qr, kr in _pairs(spec, (spec.rank - i) % spec.cp, c):
            o, lo = spec.forward(spec, q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], qr, kr)
            _merge(acc[:, :, qs], lse[:, :, qs], o, lo)
        if shift is not None:
            if i > 0:
                held.drop(*kv)  # the block received last step, now sent on
            kv = shift.wait()
    return acc.to(q.dtype), lse


# The ring's forward as one torch op, so that what caches attention kernels' outputs by op (--keep_attention's
# _KeepAttention, head chunks' _KeepKernel: model_utils.memory.attention_ops lists this op) keeps the ring's merged
# output and lse once: a dispatch mode does not see the ops run inside an op it handles. flash-attn >= 2.7
# registers its varlen forward as an op too, and each of the ring's 2cp+1 block calls was kept (16M on 8 x 4 in 4
# head chunks: ~18.3 GiB a layer against 4.06 planned). The Spec travels by an id (an op takes no Python object).
_SPECS: dict[int, Spec] = {}
_SPEC_IDS = itertools.count()


@torch.library.custom_op("ulysses_ring::forward", mutates_args=())
def _forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(q, k, v, _SPECS[spec_id])


def forward_op():
    """The ring's forward op (for model_utils.memory.attention_ops)."""
    return torch.ops.ulysses_ring.forward.default


class _Ring(torch.autograd.Function):
    """q [bs, hq, T, d], k / v [bs, hkv, T, d] (this rank's two zigzag chunks) -> out [bs, hq, T, d]."""

    @staticmethod
    def forward(ctx, q, k, v, spec: Spec):
        sid = next(_SPEC_IDS)
        _SPECS[sid] = spec
        try:
            out, lse = forward_op()(q, k, v, sid)
        finally:
            del _SPECS[sid]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.spec = spec
        STATS["calls"] += 1
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        spec, held, c = ctx.spec, _Held(), q.shape[2] // 2
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        held.add(dq)
        kv, dshift = [k, v], None
        for i in range(spec.cp):
            shift = comm.RingShift(kv, spec.group, STATS["log"]) if i < spec.cp - 1 else None
            if shift is not None:
                held.add(*shift.recv)
            # dK, dV of block c - i, accumulated and passed on in fp32 as ring-flash-attention does (in the compute
            # dtype, bf16, each of the cp - 1 hops rounded the partial sums)
            part = torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device)
            held.add(part)
            for qs, ks, qr, kr in _pairs(spec, (spec.rank - i) % spec.cp, c):
                spec.backward(spec, dout[:, :, qs], q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], out[:, :, qs],
                              lse[:, :, qs], qr, kr, dq[:, :, qs], part[0][:, :, ks], part[1][:, :, ks])
            if dshift is not None:  # the other ranks' part of this block, from the previous rank
                (incoming,) = dshift.wait()
                held.drop(part, part)  # the buffer sent last step is free, and `part` folds into the arrived one
                part = incoming.add_(part)
            dshift = comm.RingShift([part], spec.group, STATS["log"])  # after step cp-1: to the block's owner
            held.add(*dshift.recv)
            if shift is not None:
                if i > 0:
                    held.drop(*kv)
                kv = shift.wait()
        (mine,) = dshift.wait()
        return dq.to(q.dtype), mine[0].to(k.dtype), mine[1].to(v.dtype), None


def ring_attention(query, key, value, spec: Spec) -> torch.Tensor:
    """query [bs, hq, T, d], key / value [bs, hkv, T, d] -> [bs, T, hq, d], the rank's queries against the whole
    sequence's keys, K / V passed around the cp ring."""
    return _Ring.apply(query, key.contiguous(), value.contiguous(), spec).transpose(1, 2)
