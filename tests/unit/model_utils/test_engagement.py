"""Every saving the memory plan counts engages or stops the run (model_utils/engagement.py): the per-step counters
match what the plan expects on sdpa and eager (flash runs the same Python paths: the counters and the stop sit in
the features' own code, before any backend call), chunked attention chunks with an attention mask, the tiled MLP
recomputes its lean norm's output at micro-batch 2 too, and a norm recompute that does not fire stops the first
forward with one line."""

from __future__ import annotations

import types

import pytest
import torch

from model_utils import engagement, head_chunks, memory
from tests.multiproc.test_parity import rel

LAYERS = 2


def _model(attn: str, chunks: int, offload: bool = True):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", hidden_size=128, intermediate_size=344, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=512, num_hidden_layers=LAYERS,
                               tie_word_embeddings=False, initializer_range=0.3)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).float().train()
    opts = types.SimpleNamespace(tiled_mlp=True, tiled_logits=True, gradient_checkpointing=offload,
                                 checkpoint_every=0, offload_activations=offload, lean_rmsnorm=True,
                                 keep_attention=False, lean_mlp=True, attention_head_chunks=chunks)
    memory.apply_memory_features(model, opts)
    head_chunks.install(model, chunks)
    return model, opts


def _step(model, bs: int = 2, sl: int = 32):
    """One micro-batch's forward and backward with a padding mask (the last token of row 0 masked: sdpa then gets
    a mask; eager always builds one), through the tiled loss."""
    ids = torch.randint(4, 512, (bs, sl), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(bs, sl, dtype=torch.long)
    mask[0, -1] = 0
    labels = torch.cat([ids[:, 1:], torch.full((bs, 1), -100)], 1)
    loss = model(input_ids=ids, attention_mask=mask, position_ids=torch.arange(sl).expand(bs, sl), use_cache=False,
                 tiled_loss_labels=labels)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_every_counted_saving_engages_with_a_mask(attn, monkeypatch):
    """Chunked attention with a mask, the norm recompute of both consumers (micro-batch 2), the tiled MLP and
    logits, checkpoint offload: engaged == expected per micro-batch, the recompute not counted twice, and the
    loss and gradients those of the same model in one chunk (the mask applied in every chunk). On the old code
    attention ran unchunked whenever a mask was passed and the tiled MLP kept its input at micro-batch 2: both
    counted 0 there."""
    monkeypatch.setattr(memory, "MLP_TILE_TOKENS", 12)
    model, opts = _model(attn, 2)
    want = engagement.arm(model, opts)
    assert want == {"attention_head_chunks": LAYERS, "norm_recompute": 2 * LAYERS, "tiled_mlp": LAYERS,
                    "tiled_logits": 1, "offload_activations": LAYERS}
    loss, grads = _step(model)
    got = engagement.take(model, 1)
    assert got["engaged"] == got["expected"] == want, got
    engagement.check(got)
    ref_model, _ = _model(attn, 1)
    ref_loss, ref_grads = _step(ref_model)
    assert abs(loss - ref_loss) / abs(ref_loss) < 1e-5
    assert max(rel(grads[n], g) for n, g in ref_grads.items()) < 1e-4
    engagement.reset()  # (the reference model counted too: the counters are the process's)
    _step(model)
    assert engagement.take(model, 2)["engaged"] == want  # counts restart at each take; expected scales with GA


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_norm_recompute_that_does_not_fire_stops_the_first_forward(attn, monkeypatch):
    """The storage match lost (as if ZeRO-3's hooks handed the consumer a copy): one line naming the feature and the
    fix, raised in the first layer's forward (before the backward that would need the uncounted [T, h]). The old
    code went on keeping the norm's output."""
    model, opts = _model(attn, 2, offload=False)
    engagement.arm(model, opts)
    monkeypatch.setattr(head_chunks, "norm_source", lambda t: None)
    with pytest.raises(ValueError, match=r"^norm_recompute: .*chunked attention.*lean_rmsnorm false"):
        _step(model)
    monkeypatch.setattr(memory, "norm_source", lambda t: None)
    model, opts = _model(attn, 1, offload=False)  # the tiled MLP alone
    engagement.arm(model, opts)
    with pytest.raises(ValueError, match=r"^norm_recompute: the tiled MLP"):
        _step(model)
    with torch.no_grad():  # evaluation counts nothing and never stops
        model(input_ids=torch.ones(1, 8, dtype=torch.long))


def test_step_counts_are_agreed_and_checked(monkeypatch):
    """take -> the metrics' fields; the minimum over ranks rides in the peak-memory all-reduce (one collective);
    a shortfall is one line naming the feature and its fix."""
    from base import comm
    from training import metrics

    model = types.SimpleNamespace(_engagement_expected={"tiled_mlp": 2, "tiled_logits": 1})
    monkeypatch.setitem(engagement._ENGAGED, "tiled_mlp", 4)
    monkeypatch.setitem(engagement._ENGAGED, "tiled_logits", 2)
    got = engagement.take(model, 2)
    assert got == {"engaged": {"tiled_mlp": 4, "tiled_logits": 2}, "expected": {"tiled_mlp": 4, "tiled_logits": 2}}
    assert engagement._ENGAGED["tiled_mlp"] == 0 and engagement.take(types.SimpleNamespace(), 1) is None
    calls = []

    def all_reduce(values, op="sum", group=None):  # another rank engaged its tiled MLP 3 times only
        calls.append(op)
        return torch.tensor([max(values[0], 1.5), -3.0 if values[1] == -4.0 else values[1], values[2]],
                            dtype=torch.float64)

    monkeypatch.setattr(comm, "all_reduce", all_reduce)
    metrics.peak_memory_gb(got)
    assert calls == ["max"] and got["engaged"] == {"tiled_mlp": 3, "tiled_logits": 2}
    assert engagement.fields(got) == {"engaged/tiled_mlp": 3, "engaged/tiled_logits": 2, "expected/tiled_mlp": 4,
                                      "expected/tiled_logits": 2}
    with pytest.raises(ValueError, match=r"^tiled_mlp: engaged 3 of 4 times .*set tiled_mlp false"):
        engagement.check(got)
