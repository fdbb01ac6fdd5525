"""Context parallelism with K/V passed in a ring (`context_parallel_kv: ring`) instead of gathered whole.

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
(fp32); dK / dV of block j travel with it in the compute dtype and arrive at their owner after cp steps (bf16: the
partial sums rounded at each of the cp - 1 hops, as Transformer Engine's context-parallel ring does). Autograd over the per-block
calls would have kept every block's K / V for backward: the whole gathered K / V again, which is what this avoids.

What a rank holds beyond its own q, k, v, o (planner.attention_sp.cp_kv_buffer_bytes counts it; the multi-process
test checks it byte for byte against STATS["peak_bytes"]): forward, the block computed on and the one arriving (2
K/V blocks; 1 at cp = 2) plus the fp32 output and lse accumulators; backward, 2 K/V blocks (1 at cp = 2), the fp32
dQ accumulator and 3 dK/dV blocks (the one computed, the one in flight to the next rank, the one arriving).
Llama-3-8B at 16M tokens on u=8 x cp=4 in 4 head chunks (bf16; per chunk 1 query and 1 KV head per rank): a K/V
block is 2 GiB and the backward's ring 12 GiB, where the gather holds 8 GiB of staging and whole-sequence K, V,
dK, dV in the kernel (18 GiB, against 4 for the rank's own).

Cost against the gather at that scale: forward passes the same K / V bytes ((cp-1)/cp of the gathered size);
backward passes K / V again and dK / dV (cp hops): 2x the gather's backward bytes (one reduce-scatter of dK / dV).
Each hop starts before the step's compute and is waited after it. A step computes an S/(2cp)-query chunk pair
against S/cp keys: at 16M ~11 s per head chunk on an H100 (MFU 0.4) next to ~0.04 s for a 2 GiB
block over a 50 GB/s InfiniBand port, so the ring hides its traffic where the gather waits for its whole collective
before any compute (planner.comm_model.layer_collectives).

Kernels per backend (queries [a, b) of one zigzag chunk against the keys [c, e) of another, global positions):
- sdpa (the CPU / test path): the attention written out in fp32 (torch's sdpa returns no lse on CPU), over tiles
  of TILE_ROWS queries, with the document / causal / window mask of the pair.
- flash_attention_2/3, flex_attention: not yet (context_parallel.register refuses them with a one-line error; the
  gather path serves them).
"""

from __future__ import annotations

import torch

from base import comm

TILE_ROWS = 1024  # queries per tile of the math kernel: scores [bs, hq, TILE_ROWS, S/(2cp)] fp32 at a time
RING_BACKENDS = ("sdpa",)
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
    """What one attention call's ring needs: the group, the layout, the mask and the kernel."""

    def __init__(self, group, cp: int, rank: int, ranges: list, doc: torch.Tensor, window: int | None, scale: float):
        self.group, self.cp, self.rank, self.ranges = group, cp, rank, ranges  # ranges[c]: rank c's two (a, b)
        self.doc, self.window, self.scale = doc, window, scale  # doc [bs, sl] int32 document ids (global)

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


def math_backward(spec: Spec, do, q, k, v, out, lse, qr, kr):
    """(dq [bs, hq, nq, d], dk, dv [bs, hkv, nk, d]) fp32 of block (qr, kr) given the GLOBAL out and lse."""
    hq, hkv = q.shape[1], k.shape[1]
    ke, ve = _expand(k, hq).float(), _expand(v, hq).float()
    dqs, dk, dv = [], 0.0, 0.0
    for lo in range(0, q.shape[2], TILE_ROWS):
        hi = min(lo + TILE_ROWS, q.shape[2])
        p = torch.exp(_scores(spec, q, ke, qr, kr, lo, hi) - lse[:, :, lo:hi, None])
        g = do[:, :, lo:hi].float()
        dv = dv + p.transpose(-1, -2) @ g
        ds = p * (g @ ve.transpose(-1, -2) - (g * out[:, :, lo:hi].float()).sum(-1, keepdim=True))
        dqs.append(ds @ ke * spec.scale)
        dk = dk + ds.transpose(-1, -2) @ q[:, :, lo:hi].float() * spec.scale
    fold = (lambda x: x.unflatten(1, (hkv, hq // hkv)).sum(2)) if hq != hkv else (lambda x: x)
    return torch.cat(dqs, dim=2), fold(dk), fold(dv)


# ---- the ring --------------------------------------------------------------------------------------------------

def _merge(acc: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, lo: torch.Tensor) -> None:
    """In place: (acc, lse) <- the softmax over both key sets (acc, o: [.., n, d] fp32; lse, lo: [.., n])."""
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


class _Ring(torch.autograd.Function):
    """q [bs, hq, T, d], k / v [bs, hkv, T, d] (this rank's two zigzag chunks) -> out [bs, hq, T, d]."""

    @staticmethod
    def forward(ctx, q, k, v, spec: Spec):
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
                o, lo = math_forward(spec, q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], qr, kr)
                _merge(acc[:, :, qs], lse[:, :, qs], o, lo)
            if shift is not None:
                if i > 0:
                    held.drop(*kv)  # the block received last step, now sent on
                kv = shift.wait()
        out = acc.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.spec = spec
        STATS["calls"] += 1
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        spec, held, c = ctx.spec, _Held(), q.shape[2] // 2
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        held.add(dq)
        kv, dshift = [k, v], None
        for i in range(spec.cp):
            shift = comm.RingShift(kv, spec.group, STATS["log"]) if i < spec.cp - 1 else None
            if shift is not None:
                held.add(*shift.recv)
            part = torch.zeros((2, *k.shape), dtype=k.dtype, device=k.device)  # dK, dV of block c - i
            held.add(part)
            for qs, ks, qr, kr in _pairs(spec, (spec.rank - i) % spec.cp, c):
                dq_p, dk_p, dv_p = math_backward(spec, dout[:, :, qs], q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks],
                                                 out[:, :, qs], lse[:, :, qs], qr, kr)
                dq[:, :, qs] += dq_p
                part[0][:, :, ks] += dk_p.to(k.dtype)
                part[1][:, :, ks] += dv_p.to(k.dtype)
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
        return dq.to(q.dtype), mine[0], mine[1], None


def ring_attention(query, key, value, spec: Spec) -> torch.Tensor:
    """query [bs, hq, T, d], key / value [bs, hkv, T, d] -> [bs, T, hq, d], the rank's queries against the whole
    sequence's keys, K / V passed around the cp ring."""
    return _Ring.apply(query, key.contiguous(), value.contiguous(), spec).transpose(1, 2)
