"""model_utils/ring_attention.py's kernels in one process (the ring itself runs in tests/multiproc/
test_context_parallel.py): every (query chunk, key chunk) pair of the zigzag layout, merged by lse, equals one dense
document / causal / window mask over the whole sequence; and the flash kernel's varlen calls (`pair_calls`: bottom-
right alignment, the window shifted for key chunks before the queries), run through a CPU stand-in of flash-attn's
own ops and rules (flash_rules.py: its window conversions, the implicit right limit, +inf lse of an empty row), equal
the math kernel forward and backward."""

from __future__ import annotations

import types

import pytest
import torch

from model_utils import attention
from model_utils import context_parallel as cpm
from model_utils import ring_attention as ra
from tests.unit.model_utils import flash_rules


def _docs(bounds: list[list[int]]) -> attention.Documents:
    pos = torch.stack([torch.cat([torch.arange(e - s) for s, e in zip(b[:-1], b[1:])]) for b in bounds])
    return attention.Documents(pos, len(bounds))


def _dense(q, k, v, doc, window, scale):
    """[bs, hq, sl, d] attention over the whole sequence with the document / causal / window mask."""
    g = q.shape[1] // k.shape[1]
    s = torch.einsum("bhqd,bhkd->bhqk", q, k.repeat_interleave(g, 1)) * scale
    i, j = torch.arange(q.shape[2])[:, None], torch.arange(q.shape[2])[None, :]
    keep = (doc[:, :, None] == doc[:, None, :]) & (j <= i)
    if window is not None:
        keep &= i - j < window
    s = s.masked_fill(~keep[:, None], float("-inf"))
    return torch.softmax(s, -1) @ v.repeat_interleave(g, 1), torch.logsumexp(s, -1)


# one document crossing every chunk; short ones with a 1-token document; a long document across rows' chunk edges;
# a document starting 2 keys before a query chunk, under a window longer than that (issue 49: flash's implicit right
# limit left queries 12..14 with no key: lse +inf, NaN in the merge)
LAYOUTS = [[[0, 48]], [[0, 1, 2, 9, 10, 30, 31, 48]], [[0, 5, 40, 41, 48], [0, 17, 18, 48]], [[0, 10, 48]],
           [[0, 11, 48], [0, 23, 48]]]


@pytest.mark.skipif(flash_rules.REAL, reason="the real flash-attn owns its ops' names: tests/test_gpu_smoke.py")
@pytest.mark.parametrize("bounds,window,cp", [(LAYOUTS[0], 5, 3), (LAYOUTS[1], None, 2), (LAYOUTS[1], 5, 3),
                                              (LAYOUTS[2], 13, 2), (LAYOUTS[2], 4, 3), (LAYOUTS[3], 8, 2),
                                              (LAYOUTS[4], 12, 2), (LAYOUTS[4], 6, 4)])
def test_block_pairs_merged_equal_one_dense_mask_and_flash_calls_equal_math(bounds, window, cp, monkeypatch):
    flash_rules.install(monkeypatch)
    torch.manual_seed(0)
    sl, bs, hq, hkv, d = 48, len(bounds), 4, 2, 8
    q, k, v, do = (torch.randn(bs, h, sl, d) for h in (hq, hkv, hkv, hq))
    docs = _docs(bounds)
    ranges = [cpm.local_ranges(sl, cp, c) for c in range(cp)]
    math, flash = (ra.Spec(None, cp, 0, ranges, docs, window, d ** -0.5, backend) for backend in
                   ("sdpa", "flash_attention_2"))
    ref_out, ref_lse = _dense(q, k, v, docs.doc, window, d ** -0.5)
    chunks = [r for rank in ranges for r in rank]
    for qr in chunks:
        qs = slice(*qr)
        acc = torch.zeros(bs, hq, qr[1] - qr[0], d)
        lse = torch.full((bs, hq, qr[1] - qr[0]), -torch.inf)
        for kr in chunks:
            if not math.reaches(qr, kr):
                continue
            ks = slice(*kr)
            o, lo = ra.math_forward(math, q[:, :, qs], k[:, :, ks], v[:, :, ks], qr, kr)
            fo, flo = ra.flash_forward(flash, q[:, :, qs], k[:, :, ks], v[:, :, ks], qr, kr)
            fin = ~torch.isinf(lo)  # a query that sees none of the block: -inf (math), +inf or -inf (flash)
            assert torch.equal(fin, ~torch.isinf(flo)), (qr, kr)
            torch.testing.assert_close(flo[fin], lo[fin])
            torch.testing.assert_close(fo, o, atol=1e-5, rtol=1e-5)
            ra._merge(acc, lse, fo, flo)  # the flash calls' own out / lse, as the ring merges them
        # the merge of the pairs = the whole-sequence call (the kernels compute in fp32)
        torch.testing.assert_close(acc, ref_out[:, :, qs], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, ref_lse[:, :, qs], atol=1e-5, rtol=1e-5)
        for kr in chunks:  # backward of each pair given the GLOBAL out / lse: flash's calls equal the math kernel's
            if math.reaches(qr, kr):
                ks = slice(*kr)
                args = (do[:, :, qs], q[:, :, qs], k[:, :, ks], v[:, :, ks], acc, lse, qr, kr)
                want, got = ([torch.zeros(bs, hq, qr[1] - qr[0], d)] + [torch.zeros(bs, hkv, kr[1] - kr[0], d)]
                             + [torch.zeros(bs, hkv, kr[1] - kr[0], d)] for _ in range(2))
                ra.math_backward(math, *args, *want)  # each adds into (dq, dk, dv)
                ra.flash_backward(flash, *args, *got)
                for w, g in zip(want, got):
                    torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_pair_calls_shift_the_window_for_earlier_key_chunks():
    """Queries [20, 30) of a document [0, 40) against keys [10, 20) under a window of 6: queries 20..24 reach keys
    15..19; query 20 sees all five (one call, no window); 21..24 see keys > p - 6: keys 16..19, flash aligns the
    segment's last query (24) with the last key (19), so left = 20 - 25 + 6 - 1 = 0. Never more queries than keys
    in a windowed call (flash's implicit right limit: right = max_seqlen_k)."""
    assert ra.pair_calls([[0, 40]], (20, 30), (10, 20), 6) == [([(0, 0, 1, 5, 10)], False, -1),
                                                                ([(0, 1, 5, 6, 10)], False, 0)]
    assert ra.pair_calls([[0, 10, 48]], (12, 24), (0, 12), 8) == [([(0, 0, 6, 10, 12)], False, -1),
                                                                   ([(0, 6, 7, 11, 12)], False, 0)]
    assert ra.pair_calls([[0, 40]], (20, 30), (10, 20), None) == [([(0, 0, 10, 0, 10)], False, -1)]
    assert ra.pair_calls([[0, 20, 40]], (20, 30), (10, 20), None) == []  # the queries' document starts at 20
    assert ra.pair_calls([[0, 22, 40]], (20, 30), (20, 30), 4) == [([(0, 0, 2, 0, 2), (0, 2, 10, 2, 10)], True, 3)]


def test_planner_takes_the_ring_only_where_the_gathered_kv_does_not_fit():
    """memory_features auto at Llama-3-8B on 32 GPUs (8 x 4, ALST features pinned): the gather at 8M tokens; at 16M
    nothing with the gather fits and the ring does (issue 43's 16M on 32), holding 18 GiB per rank in 4 head chunks
    (12 of them fp32 dK / dV)."""
    from planner import auto_features as af
    from planner.attention_sp import chunk_split, cp_kv_buffer_bytes
    from planner.memory_model import Features, load_shape

    shape = load_shape("llama3-8b")
    pinned = {"checkpoint_every": 1, "offload_activations": True, "tiled_mlp": True, "tiled_logits": True}
    offloads = Features(offload_params=True, offload_optimizer=True, lean_rmsnorm=True, lean_mlp=True)

    def choose(seq, **pin):
        return af.choose(shape, seq, 32, af.gpu_budget(80), sp=32, cp=4, sp_max=8, pinned={**pinned, **pin},
                         offloads=offloads, device="cuda", ranks_per_node=8)

    assert not choose(2**23).features.ring_attention
    ring = choose(2**24)
    assert ring.features.ring_attention and ring.peak_bytes <= af.usable_bytes(af.gpu_budget(80))
    with pytest.raises(ValueError, match="nothing fits"):
        choose(2**24, ring_attention=False)
    heads = chunk_split(shape, 32, 4, ring.features.attention_head_chunks)[2:]
    assert heads == (1, 1) and cp_kv_buffer_bytes(shape, 2**24 // 32, 32, 2, 4, True, heads) == 18 * 2**30


def test_compare_reaches_16m_tokens_on_32_gpus_with_room():
    """Issue 43: `plan.py --compare` (which runs the ring where cp > 1) gives >= 16,777,216 tokens of Llama-3-8B on
    32 GPUs with >= 4 GiB of the 78 GiB budget free (the gather alone: 15,655,296)."""
    import importlib.util
    import os

    from tests.distributed import ROOT

    spec = importlib.util.spec_from_file_location("plan", os.path.join(ROOT, "scripts", "plan.py"))
    plan = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plan)
    row = next(r for r in plan.compare() if r["gpus"] == 32)
    assert row["longest"] >= 2**24 and row["gpu_room_gib"] >= 4, row


@pytest.mark.parametrize("attn", ["flex_attention", "flash_attention_3"])
def test_ring_on_a_backend_without_its_kernel_is_refused_in_one_line(attn):
    with pytest.raises(ValueError, match=f"ring_attention with attn_implementation {attn}: .* ring_attention false"):
        cpm.register(attn, None, 2, 0, ring=True)


def test_the_sdpa_ring_on_a_gpu_is_refused_and_auto_does_not_pick_it(monkeypatch):
    """On a GPU the ring runs flash_attention_2: the sdpa ring (the CPU test path, fp32 score tiles the plan does not
    count: 8 GiB a tile at 16M on 8 x 4) is refused in one line, and memory_features auto on a GPU without flash-attn
    pins the ring off before it plans (training.curriculum._gpu_without_flash). A CPU run (and a dry run) keeps it."""
    from training import curriculum

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match="ring_attention on a GPU runs flash_attention_2 .* ring_attention false"):
        cpm.register("sdpa", None, 2, 0, ring=True)
    cfg = types.SimpleNamespace(attn_implementation="sdpa")
    assert curriculum._gpu_without_flash(cfg)
    assert not curriculum._gpu_without_flash(types.SimpleNamespace(attn_implementation="flash_attention_2"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not curriculum._gpu_without_flash(cfg)
