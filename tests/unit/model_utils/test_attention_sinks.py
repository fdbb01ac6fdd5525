"""Learned attention sinks (GPT-OSS's `s_aux`) in the document-masked attention, in one process: the CPU path
(`model_utils/sinks.sink_sdpa` per sdpa piece, and per context-parallel chunk) against GPT-OSS's own eager attention run on
each document alone (forward and gradients, sinks included), with windows and packed documents; and the start-up
rules for latent attention and sinks (refused head chunks, refused flash-attention, other sink types refused)."""

from __future__ import annotations

import types

import pytest
import torch

from model_utils import attention, families
from model_utils import context_parallel as cpm
from model_utils.sinks import sink_sdpa

BOUNDS = [[0, 3, 40, 41, 150, 300], [0, 300]]  # a 1-token document, short ones grouped, long ones alone
HQ, HKV, D, SCALE = 4, 2, 16, 0.25


def _eager_docs(q, k, v, sinks, window):
    """GPT-OSS's eager attention (transformers) on each document alone with a causal (+ window) mask: [bs, sl, hq, d]."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    module = types.SimpleNamespace(num_key_value_groups=HQ // HKV, sinks=sinks, training=False)
    rows = []
    for r, b in enumerate(BOUNDS):
        outs = []
        for s, e in zip(b[:-1], b[1:]):
            i = torch.arange(e - s)
            keep = (i[:, None] >= i[None, :]) & ((i[:, None] - i[None, :] < window) if window else True)
            mask = torch.zeros(e - s, e - s).masked_fill(~keep, float("-inf"))[None, None]
            out, _ = eager_attention_forward(module, q[r:r + 1, :, s:e], k[r:r + 1, :, s:e], v[r:r + 1, :, s:e],
                                             mask, scaling=SCALE)
            outs.append(out)
        rows.append(torch.cat(outs, dim=1))
    return torch.cat(rows)


def _inputs():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, h, 300, D, requires_grad=True) for h in (HQ, HKV, HKV))
    sinks = (2.0 * torch.randn(HQ)).requires_grad_()  # peaked: a sink counted twice moves the answer visibly
    pos = torch.stack([torch.cat([torch.arange(e - s) for s, e in zip(b[:-1], b[1:])]) for b in BOUNDS])
    return q, k, v, sinks, pos


def _grads(out, tensors):
    return torch.autograd.grad((out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum(), tensors)


@pytest.mark.parametrize("window", [None, pytest.param(7, marks=pytest.mark.slow), 50])  # ~10-20 s each
def test_sinks_per_document_equal_gpt_oss_eager(monkeypatch, window):
    monkeypatch.setattr(attention, "BLOCK", 32)  # short documents grouped, long ones alone or chunked by the window
    q, k, v, sinks, pos = _inputs()
    fn = attention.document_masked("flex_attention", None)  # on CPU with s_aux: the sdpa pieces, never flex
    got, _ = fn(types.SimpleNamespace(), q, k, v, None, position_ids=pos, sliding_window=window, s_aux=sinks,
                scaling=SCALE)
    want = _eager_docs(q, k, v, sinks, window)
    assert (got - want).abs().max() < 1e-5
    for g, w in zip(_grads(got, (q, k, v, sinks)), _grads(want, (q, k, v, sinks))):
        assert (g - w).abs().max() < 1e-4 * max(1.0, w.abs().max().item())
    # the test can fail: a sink entering twice (one more logit s: log 2 added) or not at all is far away
    twice, _ = fn(types.SimpleNamespace(), q, k, v, None, position_ids=pos, sliding_window=window,
                  s_aux=sinks + torch.log(torch.tensor(2.0)), scaling=SCALE)
    none, _ = fn(types.SimpleNamespace(), q, k, v, None, position_ids=pos, sliding_window=window,
                 s_aux=torch.full((HQ,), -1e4), scaling=SCALE)
    assert (twice - want).abs().max() > 1e-2 and (none - want).abs().max() > 1e-2


@pytest.mark.parametrize("window,cp", [(None, 2), (7, 3)])
def test_sinks_once_per_query_under_context_parallel_chunks(window, cp):
    """Each cp rank's two query chunks against the gathered keys: the sink enters each query's softmax once."""
    q, k, v, sinks, pos = _inputs()
    want = _eager_docs(q, k, v, sinks, window)
    docs = attention.Documents(pos, 2)
    for c in range(cp):
        for a, b in cpm.local_ranges(300 - 300 % (2 * cp), cp, c):
            got = cpm._sdpa_chunk(sink_sdpa, types.SimpleNamespace(), q[:, :, a:b], k, v, docs, a, b,
                                  window, {"s_aux": sinks, "scaling": SCALE})
            assert (got - want[:, a:b]).abs().max() < 1e-5, (c, a, b)


def test_sink_and_latent_rules_at_start_up():
    from transformers import AutoConfig, AutoModelForCausalLM

    from model_utils import ulysses

    small = dict(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16)
    oss = AutoConfig.for_model("gpt_oss", **small, num_local_experts=2, num_experts_per_tok=1, sliding_window=8,
                               layer_types=["sliding_attention", "full_attention"])
    families.check_config(oss, "flex_attention")  # covered
    with pytest.raises(ValueError, match=r"^GptOssForCausalLM \(gpt_oss\): learned attention sinks with "
                                         r"flash_attention_2: .* use --attn_implementation flex_attention$"):
        families.check_supported(oss, "flash_attention_2", "GptOssForCausalLM")
    other = AutoConfig.for_model("llama", **small)
    other.model_type = "flint"  # a sinks family not checked against its plain model
    with pytest.raises(ValueError, match=r"\(flint\): learned attention sinks are not supported .* \(only gpt_oss\)"):
        families.check_supported(other, "sdpa", "X")
    dims = types.SimpleNamespace(ulysses=2, sp=2, cp=1)
    mla = AutoConfig.for_model("deepseek_v3", **{**small, "num_key_value_heads": 4, "head_dim": 8},
                               qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, kv_lora_rank=16,
                               q_lora_rank=None, n_routed_experts=2, num_experts_per_tok=1, moe_intermediate_size=32,
                               n_group=1, topk_group=1)
    for cfg, what in ((mla, "latent attention"), (oss, "learned attention sinks")):
        refusal = rf"^attention_head_chunks 2: .*{what}.* use attention_head_chunks 1$"
        with pytest.raises(ValueError, match=refusal):  # at start-up, from the config alone (training/startup.py)
            families.check_config(cfg, "flex_attention", 2)
        families.check_config(cfg, "flex_attention", "auto")  # the planner's choice never chunks these
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
        with pytest.raises(ValueError, match=refusal):  # and again where a stage registers its attention
            ulysses.register(model, dims, "sdpa", 1, head_chunks=2)


def test_a_masked_document_piece_never_runs_cudnn(monkeypatch):
    """A piece with an explicit mask runs with cuDNN's SDPA off: torch 2.11-2.13's cuDNN backward returns NaN grad_q
    with a mask tensor at lengths 64 mod 128 (pytorch#196678), and SDPA's default on H100 / H200 is cuDNN; a causal
    piece without a mask keeps SDPA's choice. Read on CPU through the backend flags each call sees."""
    monkeypatch.setattr(attention, "BLOCK", 64)  # [0, 3), [3, 40), [40, 41) grouped: a mask; the long ones alone
    q, k, v, _, pos = _inputs()
    seen = []

    def orig(module, q_, k_, v_, mask, **kw):
        seen.append((mask is not None, torch.backends.cuda.cudnn_sdp_enabled()))
        return q_.transpose(1, 2), None

    attention._sdpa_docs(orig, types.SimpleNamespace(), q, k, v, attention.Documents(pos, 2), None, {})
    assert {m for m, _ in seen} == {True, False}  # both kinds of piece in these bounds
    assert all(not on for masked, on in seen if masked) and all(on for masked, on in seen if not masked), seen
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored after
