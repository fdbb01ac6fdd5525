"""Context parallelism's pieces in one process: the zigzag layout, and each backend's chunk attention (queries
[a, b) against keys [0, b)) against one dense document-and-window mask. flash-attention cannot run here: its
inputs (`varlen_chunk`: key range and separate cu_seqlens) are checked by running each fragment through sdpa
with the bottom-right causal alignment flash-attn applies when query and key lengths differ."""

from __future__ import annotations

import pytest
import torch

from base.parallel import ParallelDims, check_layout, split_sp, zigzag_chunks
from data.sharding import shard
from model_utils import attention
from model_utils import context_parallel as cpm
from tests.multiproc.test_doc_masking import BOUNDS, dense_reference

SL = 300


@pytest.mark.parametrize("u,cp", [(1, 2), (2, 2), (1, 3), (3, 2), (2, 4)])
def test_zigzag_shards_reassemble_in_order(u, cp):
    sp, sl = u * cp, 2 * u * cp * 5
    batch = {"input_ids": torch.arange(sl)[None].repeat(2, 1)}
    shards = [shard(batch, sp, r, cp)["input_ids"] for r in range(sp)]
    per_cp = [torch.cat(shards[c * u:(c + 1) * u], dim=1) for c in range(cp)]  # what Ulysses' all-to-all gathers
    for c in range(cp):  # rank c holds chunks c and 2cp-1-c: equal causal work
        want = torch.cat([torch.arange(a, b) for a, b in cpm.local_ranges(sl, cp, c)])
        assert torch.equal(per_cp[c][0], want)
    assert torch.equal(cpm.natural(torch.stack(per_cp), cp, dim=1), batch["input_ids"])
    assert zigzag_chunks(2) == [0, 3, 1, 2]
    work = [sum(b for _, b in cpm.local_ranges(sl, cp, c)) for c in range(cp)]  # keys seen by a chunk's last row
    assert len(set(work)) == 1


def test_split_chooses_the_largest_ulysses_and_refuses_in_one_line():
    assert split_sp(8, 28, 4, 8) == (4, 2)  # Qwen2.5-7B on one 8-GPU node
    assert split_sp(2, 9, 3) == (1, 2)
    assert split_sp(64, 32, 8, 8) == (8, 8)  # Llama-3-8B on 8 nodes: Ulysses never leaves a node
    assert split_sp(4, 32, 8, None, 2) == (2, 2)
    with pytest.raises(ValueError, match=r"context_parallel_size=3 does not divide .* use one of \[1, 2, 4\] or auto"):
        split_sp(4, 32, 8, None, 3)
    with pytest.raises(ValueError, match=r"Ulysses factor of 4, which must divide the 6 query heads.* one of \[2, 4\]"):
        split_sp(4, 6, 2, None, 1)  # pure Ulysses at 4 on 6 heads
    with pytest.raises(ValueError, match=r"divide gpus_per_node 4 .* one of \[2, 4, 8\]"):
        split_sp(8, 32, 8, 4, 1)  # a Ulysses group of 8 would straddle two 4-GPU nodes
    check_layout(6, 6, 9, 3, 96, cp=2)
    with pytest.raises(ValueError, match="2 x sequence_parallel_size"):
        check_layout(4, 4, 8, 8, 6, cp=2)
    dims = ParallelDims(world=8, sp=4, rank=6, local_rank=6, cp=2)
    assert (dims.ulysses, dims.cp_rank, dims.seq_multiple) == (2, 1, 8)


class _Attn(torch.nn.Module):
    num_key_value_groups, is_causal, training = 2, True, True


def _qkv():
    torch.manual_seed(0)
    return torch.randn(2, 4, SL, 16), torch.randn(2, 2, SL, 16), torch.randn(2, 2, SL, 16)


def _docs():
    pos = torch.stack([torch.cat([torch.arange(e - s) for s, e in zip(b[:-1], b[1:])]) for b in BOUNDS])
    return attention.Documents(pos, 2)


@pytest.mark.parametrize("window", [None, 7, 50])
@pytest.mark.parametrize("cp", [2, 3])
def test_sdpa_chunks_equal_dense_mask(monkeypatch, window, cp):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    monkeypatch.setattr(attention, "BLOCK", 32)
    q, k, v = _qkv()
    docs = _docs()
    want = dense_reference(q, k, v, docs.doc, window)  # [bs, sl, hq, hd]
    for c in range(cp):
        for a, b in cpm.local_ranges(SL, cp, c):
            got = cpm._sdpa_chunk(sdpa_attention_forward, _Attn(), q[:, :, a:b], k, v, docs, a, b, window, {})
            assert (got - want[:, a:b]).abs().max() < 1e-5, (c, a, b)


def _bottom_right(q, k, v, window):
    """One fragment as flash-attn computes it: causal aligned to the bottom-right corner (+ window)."""
    lq, lk = q.shape[2], k.shape[2]
    i = torch.arange(lq)[:, None] + (lk - lq)
    j = torch.arange(lk)[None, :]
    mask = j <= i
    if window:
        mask &= i - j < window
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)


@pytest.mark.parametrize("window", [None, 7, 50])
def test_varlen_inputs_give_the_dense_answer(window):
    q, k, v = _qkv()
    docs = _docs()
    want = dense_reference(q, k, v, docs.doc, window)
    for cp in (2, 3):
        for c in range(cp):
            for a, b in cpm.local_ranges(SL, cp, c):
                for r, bounds in enumerate(BOUNDS):
                    k_lo, cu_q, cu_k = cpm.varlen_chunk(bounds, a, b)
                    assert cu_q[-1] == b - a and cu_k[-1] == b - k_lo
                    outs = [_bottom_right(q[r:r + 1, :, a + q0:a + q1], k[r:r + 1, :, k_lo + k0:k_lo + k1],
                                          v[r:r + 1, :, k_lo + k0:k_lo + k1], window)
                            for q0, q1, k0, k1 in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:])]
                    assert all(q1 - q0 <= k1 - k0 for q0, q1, k0, k1 in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:]))
                    got = torch.cat(outs, dim=1)
                    assert (got - want[r:r + 1, a:b]).abs().max() < 1e-5, (cp, c, a, b, r)


@pytest.mark.parametrize("window", [None, pytest.param(50, marks=pytest.mark.slow)])  # flex on CPU: ~25-50 s each
def test_flex_rectangular_block_mask_equals_dense(window):
    """transformers compiles flex_attention; on CPU, once a first shape was compiled, torch 2.13's inductor
    recompiles with dynamic shapes and its C++ codegen fails for these chunk shapes ("cur_qSplitSize8 was not
    declared": a torch bug, not ours). Static recompiles per shape here; a GPU compiles flex to Triton."""
    import torch._dynamo
    from transformers.integrations.flex_attention import flex_attention_forward

    q, k, v = _qkv()
    docs = _docs()
    want = dense_reference(q, k, v, docs.doc, window)
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False, cache_size_limit=64):
        # rank 1's first chunk and rank 0's second: a = 75 and 225, neither block-aligned, the second ending the
        # sequence (each (a, b) compiles once, ~5 s on CPU: 0 and 150, rank 0's first and rank 1's second, add nothing)
        for a, b in [cpm.local_ranges(SL, 2, 1)[0], cpm.local_ranges(SL, 2, 0)[1]]:
            got = cpm._flex_chunk(flex_attention_forward, _Attn(), q[:, :, a:b].contiguous(), k, v, docs, a, b, window,
                                  {})
            assert (got - want[:, a:b]).abs().max() < 1e-4, (a, b)
