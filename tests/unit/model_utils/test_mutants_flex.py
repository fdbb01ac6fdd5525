"""What flex_attention computes from context_parallel.rect_block_mask, without compiling it: a pair (q, k) attends
when its block pair is listed full, or listed partial and the mask_mod keeps it; that [q, k] mask equals the dense
document / causal / window one, for every cp rank's query chunk.

The compiled check (test_cp_pieces.py::test_flex_rectangular_block_mask_equals_dense) takes ~45 s on CPU with a
window, so its window case is slow; without it a mask_mod keeping the pair at exactly `window` (`<=`) passed the fast
suite (mutation audit mutA: M08). This reads the BlockMask's own tables, as flex's kernels do."""

from __future__ import annotations

import pytest
import torch

from model_utils import attention
from model_utils import context_parallel as cpm
from tests.multiproc.test_doc_masking import BOUNDS

SL = 300  # BOUNDS' length


def _listed(counts: torch.Tensor, indices: torch.Tensor, nk: int) -> torch.Tensor:
    """[bs, 1, nq] counts and [bs, 1, nq, nk] indices (the first `count` selected) -> [bs, nq, nk] bool."""
    bs, _, nq = counts.shape
    out = torch.zeros(bs, nq, nk, dtype=torch.bool)
    for b in range(bs):
        for i in range(nq):
            out[b, i, indices[b, 0, i, :counts[b, 0, i]].long()] = True
    return out


def _flex_semantics(bm, lq: int, lk: int) -> torch.Tensor:
    """[bs, lq, lk]: the pairs flex_attention lets attend under BlockMask `bm`."""
    qb, kb = bm.BLOCK_SIZE
    nk = -(-lk // kb)
    partial = _listed(bm.kv_num_blocks, bm.kv_indices, nk)
    full = _listed(bm.full_kv_num_blocks, bm.full_kv_indices, nk)
    bs = partial.shape[0]
    q, k = torch.arange(lq), torch.arange(lk)
    in_full = full[:, q // qb][:, :, k // kb]
    in_partial = partial[:, q // qb][:, :, k // kb]
    kept = bm.mask_mod(torch.arange(bs)[:, None, None], 0, q[None, :, None], k[None, None, :])
    return in_full | (in_partial & kept)


@pytest.mark.parametrize("window", [None, 7, 50, 200])
def test_rect_block_mask_lets_attend_exactly_the_dense_mask(window):
    pos = torch.stack([torch.cat([torch.arange(e - s) for s, e in zip(b[:-1], b[1:])]) for b in BOUNDS])
    doc = attention.Documents(pos, 2).doc
    i = torch.arange(SL)
    dense = (doc[:, :, None] == doc[:, None, :]) & (i[None, :, None] >= i[None, None, :])
    if window is not None:
        dense &= (i[None, :, None] - i[None, None, :]) < window
    for cp in (2, 3):
        for c in range(cp):
            for a, b in cpm.local_ranges(SL, cp, c):
                got = _flex_semantics(cpm.rect_block_mask(doc, a, b, window), b - a, b)
                assert torch.equal(got, dense[:, a:b, :b]), (cp, c, a, b)
