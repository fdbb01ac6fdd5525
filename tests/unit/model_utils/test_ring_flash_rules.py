"""The ring's flash path (model_utils/ring_attention.py, flash_attention_2) against flash-attn's own rules, on CPU:
no GPU with flash-attn has run it. flash_rules.py stands in for flash-attn 2.8.3: the same custom ops, signatures,
window conversions, bottom-right mask and +inf lse of an empty row (issue 49 item 8; the merged pairs against one
dense mask: test_ring_attention.py)."""

from __future__ import annotations

import collections

import pytest
import torch

from model_utils import context_parallel as cpm
from model_utils import ring_attention as ra
from tests.unit.model_utils import flash_rules
from tests.unit.model_utils.test_ring_attention import _dense, _docs

pytestmark = pytest.mark.skipif(flash_rules.REAL, reason="the real flash-attn owns its ops: tests/test_gpu_smoke.py")
INF = float("inf")


def _case(bounds, window, cp=1):
    torch.manual_seed(0)
    sl, d = bounds[0][-1], 8
    q, k, v = (torch.randn(len(bounds), h, sl, d) for h in (4, 2, 2))
    docs = _docs(bounds)
    ranges = [cpm.local_ranges(sl, cp, c) for c in range(cp)]
    return q, k, v, docs, ra.Spec(None, cp, 0, ranges, docs, window, d ** -0.5, "flash_attention_2")


def test_merge_adds_nothing_for_a_query_that_saw_no_key_of_the_block():
    """flash-attn gives a query with no key out 0 and lse +inf: the merge takes it as no key (the old merge: NaN)."""
    acc, lse = torch.ones(1, 1, 3, 2), torch.tensor([[[0.5, -INF, 0.5]]])
    ra._merge(acc, lse, torch.zeros(1, 1, 3, 2), torch.tensor([[[INF, INF, -INF]]]))
    assert torch.equal(acc, torch.tensor([[[[1.0, 1.0], [0.0, 0.0], [1.0, 1.0]]]]))
    assert torch.equal(lse, torch.tensor([[[0.5, -INF, 0.5]]]))


def test_the_ring_on_packed_documents_with_a_window_equals_one_dense_mask(monkeypatch):
    """bounds [0, 10, 48], window 8 (issue 49's case, at cp 1: one process) and a layout with a 2-key document
    start: the whole ring forward through the stand-in ops equals the dense mask, no NaN."""
    flash_rules.install(monkeypatch)
    for bounds, window in (([[0, 10, 48]], 8), ([[0, 22, 48]], 16)):
        q, k, v, docs, spec = _case(bounds, window)
        got = ra.ring_attention(q, k, v, spec).transpose(1, 2)
        want, _ = _dense(q, k, v, docs.doc, window, spec.scale)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_keep_attention_and_head_chunks_keep_the_rings_merged_output_once(monkeypatch):
    """flash-attn >= 2.7's varlen forward is a torch op that attention_ops lists: --keep_attention's and head chunks'
    kernel cache (memory.KeepKernels) kept each of the ring's 2cp+1 block calls (3 here at cp 1; 18.3 GiB a layer at 16M
    on 8 x 4 in 4 chunks). Now they keep the ring's one op: its merged output and lse; the recompute runs no kernel."""
    from model_utils import memory

    flash_rules.install(monkeypatch)
    q, k, v, _, spec = _case([[0, 10, 48]], 8)
    for mode in (memory.KeepKernels,):
        cache = collections.deque()
        with mode(memory.attention_ops(), cache, recompute=False):
            out = ra.ring_attention(q, k, v, spec)
        assert len(cache) == 1, (mode, [type(c) for c in cache])
        kept_out, kept_lse = cache[0]
        assert kept_out.shape == q.shape and kept_lse.shape == q.shape[:3] and kept_lse.dtype == torch.float32
        calls = flash_rules.CALLS["forward"]
        with mode(memory.attention_ops(), cache, recompute=True):
            again = ra.ring_attention(q, k, v, spec)
        assert flash_rules.CALLS["forward"] == calls and not cache
        assert torch.equal(again, out)


def test_the_calls_cu_seqlens_are_built_once_per_micro_batch(monkeypatch):
    """Every flash call of every layer of a micro-batch (two layers' forward and backward block calls here) reads
    its cu_seqlens from one device tensor built once (each call built its own with a blocking host-to-device copy:
    3 per forward pair, 5 per backward pair)."""
    flash_rules.install(monkeypatch)
    seen = []
    for name, at in (("forward", 3), ("backward", 6)):
        def record(*args, inner=ra.FLASH[name], at=at):
            seen.extend(args[at:at + 2])
            return inner(*args)
        monkeypatch.setitem(ra.FLASH, name, record)
    q, k, v, docs, _ = _case([[0, 10, 30, 48], [0, 48]], 8, cp=2)
    ranges = [cpm.local_ranges(48, 2, c) for c in range(2)]
    chunks = [r for rank in ranges for r in rank]
    for _layer in range(2):
        spec = ra.Spec(None, 2, 0, ranges, docs, 8, 8 ** -0.5, "flash_attention_2")  # one per call, as context_parallel
        for qr in chunks:
            for kr in (kr for kr in chunks if spec.reaches(qr, kr)):
                qs, ks = slice(*qr), slice(*kr)
                o, lo = ra.flash_forward(spec, q[:, :, qs], k[:, :, ks], v[:, :, ks], qr, kr)
                grads = [torch.zeros(2, h, 12, 8) for h in (4, 2, 2)]
                ra.flash_backward(spec, o, q[:, :, qs], k[:, :, ks], v[:, :, ks], o, lo.clamp(max=0), qr, kr, *grads)
    assert len(seen) > 40 and all(t.dtype == torch.int32 and t.is_contiguous() for t in seen)
    assert len({t.untyped_storage().data_ptr() for t in seen}) == 1


@pytest.mark.parametrize("version", ["2.6.3", "2.5.9.post1"])
def test_a_flash_attn_older_than_2_7_is_refused_for_the_ring_at_start_up(version, monkeypatch):
    """flash-attn 2.6 takes window_size=(left, right) and returns 8 values: the ring's first call was a TypeError.
    Refused in one line when the ring is registered; 2.7 and later pass."""
    flash_rules.install(monkeypatch, version)
    with pytest.raises(ValueError, match=rf"ring_attention with flash_attention_2 needs flash-attn >= 2.7 \(found "
                                         rf"{version}\): .* ring_attention false"):
        cpm.register("flash_attention_2", None, 2, 0, ring=True)
    for ok in ("2.7.0", "2.8.3.post2"):
        flash_rules.install(monkeypatch, ok)
        cpm.check_ring_flash_attn()
