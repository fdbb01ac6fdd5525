"""The attention probes time the call transformers makes (issue 49): under transformers 5.x its sdpa path hands SDPA
an unmasked GQA call with enable_gqa=True and the KV heads NOT repeated (integrations/sdpa_attention.py,
use_gqa_in_sdpa); the probes repeated them, a different call (K/V copies, another dispatch). Checked on CPU through
a recording SDPA: model_utils/attention_pick.hf_sdpa (auto's timing) and bench.gpu_kernels.time_backends (the GPU
check's kernel probe)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model_utils import attention_pick as ap


def _recording(monkeypatch):
    calls, real = [], F.scaled_dot_product_attention

    def sdpa(q, k, v, *a, **kw):
        calls.append((q.shape[1], k.shape[1], bool(kw.get("enable_gqa"))))
        return real(q, k, v, *a, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    return calls


def test_hf_sdpa_makes_transformers_call_and_its_result(monkeypatch):
    from transformers.integrations.sdpa_attention import repeat_kv

    calls = _recording(monkeypatch)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, 16, 8, generator=g) for n in (4, 2, 2))
    out = ap.hf_sdpa(q, k, v)
    assert calls == [(4, 2, True)]  # what transformers 5.23 passes: 2 KV heads, enable_gqa
    ref = torch.nn.functional.scaled_dot_product_attention(q, repeat_kv(k, 2), repeat_kv(v, 2), is_causal=True)
    assert torch.allclose(out, ref, atol=1e-6)
    ap.hf_sdpa(q, k[:, :1].expand(1, 4, 16, 8), v[:, :1].expand(1, 4, 16, 8))  # as many KV as query heads
    assert calls[-1] == (4, 4, False)


def test_the_gpu_checks_kernel_probe_times_the_unrepeated_call(monkeypatch):
    from bench.gpu_kernels import time_backends

    calls = _recording(monkeypatch)
    rows = time_backends(32, 4, 2, 8, "cpu")
    assert rows and all(r["ok"] for r in rows), rows
    assert calls and set(calls) == {(4, 2, True)}, calls
