"""The flash_attention_2 paths' packing, on CPU and micro-batch 2: attention.py's `_flash_docs` (no cp: every row's
documents in one packed row) and context_parallel.py's `_flash_chunk` (a cp rank's query chunk against its documents'
keys), run through a stand-in of transformers' flash function (varlen cu_seq_lens_q / _k, causal aligned
bottom-right as flash-attn >= 2.1 does when the lengths differ, GQA), equal one dense document mask.

test_cp_pieces.py checks `varlen_chunk`'s ranges fragment by fragment, and at micro-batch 1 a [1, h, sl, d] tensor
reshaped to [1, h, sl, d] is the same tensor: flattening [bs, h, sl, d] without moving bs next to sl
(`transpose(0, 1)`) interleaved the rows' heads and passed them all (mutation audit mutA: M14, M27). flash-attn
itself cannot run here; tests/test_gpu_smoke.py runs the real kernel where there is one."""

from __future__ import annotations

import torch

from model_utils import attention
from model_utils import context_parallel as cpm
from tests.multiproc.test_doc_masking import dense_reference

SL = 60
BOUNDS = [[0, 3, 20, 21, 45, 60], [0, 25, 60]]  # micro-batch 2: a 1-token document, rows with different cuts


def _fake_flash(module, q, k, v, mask, cu_seq_lens_q=None, cu_seq_lens_k=None, max_length_q=None, max_length_k=None,
                **kwargs):
    """transformers' flash_attention_forward on CPU: q [1, hq, N, d] packed, k / v [1, hkv, M, d] -> [1, N, hq, d];
    sequence i is queries cu_q[i]:cu_q[i + 1] against keys cu_k[i]:cu_k[i + 1], the last query seeing the last key."""
    assert mask is None and q.shape[0] == 1 and cu_seq_lens_q is not None
    g = q.shape[1] // k.shape[1]
    cq, ck, outs = cu_seq_lens_q.tolist(), cu_seq_lens_k.tolist(), []
    assert max_length_q == max(b - a for a, b in zip(cq[:-1], cq[1:]))
    assert max_length_k == max(b - a for a, b in zip(ck[:-1], ck[1:]))
    for q0, q1, k0, k1 in zip(cq[:-1], cq[1:], ck[:-1], ck[1:]):
        ks, vs = (t[:, :, k0:k1].repeat_interleave(g, 1) for t in (k, v))
        keep = torch.arange(k1 - k0)[None, :] <= torch.arange(q1 - q0)[:, None] + (k1 - k0) - (q1 - q0)
        outs.append(torch.nn.functional.scaled_dot_product_attention(q[:, :, q0:q1], ks, vs, attn_mask=keep))
    return torch.cat(outs, 2).transpose(1, 2), None


class _Attn(torch.nn.Module):
    num_key_value_groups, is_causal, training = 2, True, True


def _inputs():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, SL, 8), torch.randn(2, 2, SL, 8), torch.randn(2, 2, SL, 8)
    pos = torch.stack([torch.cat([torch.arange(e - s) for s, e in zip(b[:-1], b[1:])]) for b in BOUNDS])
    return q, k, v, pos


def test_flash_docs_packs_a_micro_batch_of_two_into_one_row():
    q, k, v, pos = _inputs()
    want = dense_reference(q, k, v, attention.Documents(pos, 2).doc, None)  # [bs, sl, hq, hd]
    attention._DOCS.clear()
    try:
        got, _ = attention.document_masked("flash_attention_2", _fake_flash)(_Attn(), q, k, v, None,
                                                                             position_ids=pos)
    finally:
        attention._DOCS.clear()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_cp_flash_chunk_packs_a_micro_batch_of_two_into_one_row():
    q, k, v, pos = _inputs()
    docs = attention.Documents(pos, 2)
    want = dense_reference(q, k, v, docs.doc, None)
    for cp in (2, 3):
        for c in range(cp):
            for a, b in cpm.local_ranges(SL, cp, c):
                got = cpm._flash_chunk(_fake_flash, _Attn(), q[:, :, a:b], k, v, docs, a, b, None, {})
                torch.testing.assert_close(got, want[:, a:b], atol=1e-5, rtol=1e-5, msg=f"cp {cp} rank {c} [{a}, {b})")
