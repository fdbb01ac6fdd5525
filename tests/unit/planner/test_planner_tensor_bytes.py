"""The memory model's activation terms against exact tensor bytes, and against the peaks measured on an H200.

bench/calibration.py (`make calibrate`) compares whole runs by peak RSS (fp32, 20% band: the allocator and the runtime are
in that number). Here the measurement is exact: the torch profiler's allocation events give the live tensor
bytes of one forward + backward, on CPU, of a plain Hugging Face Llama through this project's own features
(model_utils.memory.apply_memory_features, make_loss_fn): the peak above what existed before the step is the
counterpart of a GPU's max_memory_allocated minus the model states. Each weight gradient is dropped when it is
produced (ZeRO-3 reduces and releases it), so the peak is activations and their transients.

It runs bf16 as well as fp32: before this test the model assumed RMSNorm saves two [T, h] tensors in the compute
dtype; HF's RMSNorm saves its fp32 upcast, the normalized x and its output (in bf16, 4 of the model's `hid`
units instead of 2), and cross-entropy's backward holds 12 bytes per logit, not 14. On the H200 the old model
under-predicted tiled logits by 12% (with tiled MLP 20%) and over-predicted HF's checkpointing by 14%; it fails
10 of the 11 exact cases below (0.89-0.96 and 1.11-1.42) and the H200 check.

The last 7 cases run the lean RMSNorm (model_utils/rmsnorm.py, train.py's default since 2026-11-25; measured
0.987-1.072). The H200 peaks were measured with Hugging Face's RMSNorm and are predicted with it.
"""

from __future__ import annotations

import json
import os
import types

import pytest

from planner.memory_model import Features, ModelShape, estimate
from tests.conftest import ROOT

T = 4096
SHAPES = {"gqa": dict(h=256, inter=688, nh=4, kv=2, vocab=2048, layers=4),
          "mha": dict(h=256, inter=688, nh=8, kv=8, vocab=8192, layers=3),
          # Qwen3: RMSNorm on q and k per head, here over 2h of q + k per token (Qwen3-32B: 1.8h)
          "qwen3": dict(h=256, inter=688, nh=8, kv=2, vocab=2048, layers=3, model_type="qwen3", head_dim=64)}


def _exact_peak(prec: str, shape: dict, feats: dict) -> int:
    """Peak live tensor bytes of one training micro-step above the bytes live before it (model, inputs)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from model_utils.memory import apply_memory_features, make_loss_fn

    cfg = AutoConfig.for_model(shape.get("model_type", "llama"), hidden_size=shape["h"],
                               intermediate_size=shape["inter"], num_attention_heads=shape["nh"],
                               num_key_value_heads=shape["kv"], vocab_size=shape["vocab"],
                               num_hidden_layers=shape["layers"], head_dim=shape.get("head_dim", shape["h"] // shape["nh"]),
                               tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to({"bf16": torch.bfloat16, "fp32": torch.float32}[prec]).train()
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    opts = types.SimpleNamespace(tiled_mlp=False, tiled_logits=False, gradient_checkpointing=False,
                                 checkpoint_every=0, offload_activations=False, lean_rmsnorm=False,
                                 keep_attention=False, lean_mlp=False, attention_head_chunks=1)
    vars(opts).update(feats)
    apply_memory_features(model, opts)
    if feats.get("attention_head_chunks", 1) > 1:  # headwise-chunked attention (model_utils/head_chunks.py)
        from model_utils.head_chunks import install

        install(model, feats["attention_head_chunks"])
    loss_fn = make_loss_fn(opts)
    ids = torch.randint(0, shape["vocab"], (1, T))
    mb = {"input_ids": ids, "position_ids": torch.arange(T)[None], "shift_labels": ids}
    # first step outside the measurement, on a short input (256 tokens: a sixteenth of a T-token step): lazy buffers
    # (RoPE caches) exist after it
    w = ids[:, :256]
    loss_fn(model, {"input_ids": w, "position_ids": torch.arange(256)[None], "shift_labels": w}).backward()
    from training.metrics import profiled_peak_bytes

    return profiled_peak_bytes(lambda: loss_fn(model, mb).backward())


def _predicted(prec: str, shape: dict, feats: dict) -> int:
    model_type = shape.get("model_type", "llama")
    ms = ModelShape(vocab_size=shape["vocab"], hidden_size=shape["h"], intermediate_size=shape["inter"],
                    num_layers=shape["layers"], num_heads=shape["nh"], num_kv_heads=shape["kv"],
                    head_dim=shape.get("head_dim", shape["h"] // shape["nh"]), qk_norm=model_type == "qwen3",
                    model_type=model_type)
    est = estimate(ms, T, 1, 1, Features.of({**feats, "offload_params": True, "offload_optimizer": True}), prec,
                   device="cpu")  # CPU SDPA: no FlashAttention-2 GQA expansion (issue 43), nothing pinned
    return est.gpu_peak - est.gpu["zero3 gathered params+grads, buckets"]  # no ZeRO-3 here: the model is resident


CASES = [  # (precision, shape, features, logits tile bytes: small ones make the layer phases the peak)
    ("bf16", "gqa", {}, None),
    ("fp32", "gqa", {}, None),
    ("bf16", "gqa", {"gradient_checkpointing": True}, None),
    ("bf16", "gqa", {"tiled_logits": True}, 4 * 2**20),
    ("fp32", "gqa", {"tiled_logits": True}, 4 * 2**20),
    ("bf16", "gqa", {"tiled_logits": True, "tiled_mlp": True}, 4 * 2**20),
    ("bf16", "gqa", {"tiled_logits": True, "tiled_mlp": True, "gradient_checkpointing": True}, 4 * 2**20),
    ("fp32", "gqa", {"tiled_logits": True, "tiled_mlp": True, "gradient_checkpointing": True}, 4 * 2**20),
    ("bf16", "gqa", {"tiled_logits": True, "checkpoint_every": 2}, 4 * 2**20),
    ("bf16", "mha", {"tiled_logits": True, "checkpoint_every": 3}, 4 * 2**20),
    ("fp32", "mha", {"tiled_logits": True, "checkpoint_every": 3}, 4 * 2**20),
    # the lean RMSNorm (model_utils/rmsnorm.py, train.py's default): saves x and 1/rms, backward in 4 chunks here
    ("bf16", "gqa", {"lean_rmsnorm": True}, None),
    ("fp32", "gqa", {"lean_rmsnorm": True}, None),
    ("bf16", "gqa", {"lean_rmsnorm": True, "tiled_logits": True}, 4 * 2**20),
    ("bf16", "gqa", {"lean_rmsnorm": True, "tiled_logits": True, "tiled_mlp": True}, 4 * 2**20),
    ("fp32", "gqa", {"lean_rmsnorm": True, "tiled_logits": True, "tiled_mlp": True}, 4 * 2**20),
    ("bf16", "gqa", {"lean_rmsnorm": True, "tiled_logits": True, "tiled_mlp": True, "gradient_checkpointing": True},
     4 * 2**20),
    ("bf16", "mha", {"lean_rmsnorm": True, "tiled_logits": True, "checkpoint_every": 3}, 4 * 2**20),
    # keep_attention: each checkpointed layer keeps the attention output + lse: measured 1.061, 1.049, 0.995 of the
    # peak (2026-11-25); without that term the model gives 0.905 and 0.949 for the first two (it fails them)
    ("bf16", "gqa", {"lean_rmsnorm": True, "tiled_logits": True, "tiled_mlp": True, "gradient_checkpointing": True,
                     "keep_attention": True}, 4 * 2**20),
    ("fp32", "gqa", {"lean_rmsnorm": True, "tiled_logits": True, "gradient_checkpointing": True,
                     "keep_attention": True}, 4 * 2**20),
    ("bf16", "mha", {"lean_rmsnorm": True, "tiled_logits": True, "checkpoint_every": 3, "keep_attention": True},
     4 * 2**20),
    # the lean gated MLP (model_utils/mlp.py, train.py's default): one [T, I] fewer kept per layer
    ("bf16", "gqa", {"lean_rmsnorm": True, "lean_mlp": True}, None),
    ("fp32", "gqa", {"lean_rmsnorm": True, "lean_mlp": True, "tiled_logits": True}, 4 * 2**20),
    ("bf16", "gqa", {"lean_rmsnorm": True, "lean_mlp": True, "tiled_logits": True, "tiled_mlp": True}, 4 * 2**20),
    ("bf16", "mha", {"lean_rmsnorm": True, "lean_mlp": True, "tiled_logits": True, "checkpoint_every": 3,
                     "keep_attention": True}, 4 * 2**20),
    ("bf16", "gqa", {"lean_rmsnorm": True, "lean_mlp": True, "tiled_logits": True, "gradient_checkpointing": True},
     4 * 2**20),
    # headwise-chunked attention (model_utils/head_chunks.py): a layer keeps only its kernel outputs (o + lse) for
    # backward, not q, k, v, o; backward holds one chunk's tensors at a time. Measured 2026-11-26 (u = T*h*b): gqa
    # bf16 69.95u unchunked -> 61.95u at 2 and 4 chunks (4 layers x 2u: q, k, v, o = 3u kept -> o = 1u), predicted
    # 61.45u (0.992); checkpointed + tiled MLP 18.18u -> 16.18u, predicted 17.05u at 2 chunks (1.053)
    ("bf16", "gqa", {"lean_rmsnorm": True, "lean_mlp": True, "tiled_logits": True, "attention_head_chunks": 2},
     4 * 2**20),
    ("bf16", "gqa", {"lean_rmsnorm": True, "lean_mlp": True, "tiled_logits": True, "attention_head_chunks": 4},
     4 * 2**20),
    ("fp32", "mha", {"lean_rmsnorm": True, "lean_mlp": True, "tiled_logits": True, "attention_head_chunks": 8},
     4 * 2**20),
    ("bf16", "gqa", {"lean_rmsnorm": True, "lean_mlp": True, "tiled_logits": True, "tiled_mlp": True,
                     "gradient_checkpointing": True, "attention_head_chunks": 2}, 4 * 2**20),
    # with 4 chunks and checkpointing the peak moves to the tiled MLP's backward: measured 16.15u (fp32) there at 2
    # and at 4 chunks (unchunked, checkpointed + tiled MLP: 18.18u, attention's backward). In [T, h] units of the
    # layer working set (recompute + backward), unchunked -> 4 chunks: attention's q, k, v, o + grads + fp32 dq
    # (about 5.5u here) -> one chunk's (1.4u), so the tiled MLP's tile (3 kept + 3 grads of [T/4, I] = 4.0u) + its
    # zeroed x_grad (1u) binds. The planner gave 0.952 of it (15.38u: 2 grads of a lean tile, not 3); now 0.99.
    ("fp32", "gqa", {"lean_rmsnorm": True, "lean_mlp": True, "tiled_logits": True, "tiled_mlp": True,
                     "gradient_checkpointing": True, "attention_head_chunks": 4}, 4 * 2**20),
    # Qwen3's q/k norms, with Hugging Face's RMSNorm and the lean one
    ("bf16", "qwen3", {"tiled_logits": True}, 4 * 2**20),
    ("bf16", "qwen3", {"tiled_logits": True, "tiled_mlp": True}, 4 * 2**20),
    ("fp32", "qwen3", {"tiled_logits": True}, 4 * 2**20),
    ("bf16", "qwen3", {"lean_rmsnorm": True, "tiled_logits": True}, 4 * 2**20),
    ("bf16", "qwen3", {"lean_rmsnorm": True, "tiled_logits": True, "tiled_mlp": True}, 4 * 2**20),
    ("bf16", "qwen3", {"lean_rmsnorm": True, "tiled_logits": True, "tiled_mlp": True, "gradient_checkpointing": True},
     4 * 2**20),
]


def _id(prec: str, shape: str, feats: dict, tile) -> str:
    return f"{prec}-{shape}-{'+'.join(feats) or 'none'}{'-tiles' if tile else ''}"


# This CPU has no bf16 matmul units: a bf16 case costs ~75 s here (a 4096x256x688 matmul takes 0.65 s in bf16,
# 0.04 s in fp32), so `make test` runs every fp32 case (Qwen3's q/k norms among them) and these bf16 ones (HF's
# RMSNorm upcast, chunked attention with checkpointing and tiled MLP); the other bf16 cases are `slow`.
FAST_BF16 = {"bf16-gqa-none", "bf16-gqa-lean_rmsnorm+lean_mlp+tiled_logits+tiled_mlp+gradient_checkpointing"
             "+attention_head_chunks-tiles"}
# and this fp32 one, ~80-100 s with the cores shared (4 head chunks recomputed under checkpointing), is `slow` too
SLOW_FP32 = {"fp32-gqa-lean_rmsnorm+lean_mlp+tiled_logits+tiled_mlp+gradient_checkpointing+attention_head_chunks-tiles"}
PARAMS = [pytest.param(*c, id=_id(*c), marks=[pytest.mark.slow] if (c[0] == "bf16" and _id(*c) not in FAST_BF16)
                       or _id(*c) in SLOW_FP32 else []) for c in CASES]
assert FAST_BF16 | SLOW_FP32 <= {p.id for p in PARAMS}


@pytest.mark.parametrize("prec,shape,feats,tile", PARAMS)
def test_predicted_activation_peak_matches_exact_tensor_bytes(monkeypatch, prec, shape, feats, tile):
    import model_utils.tiled_loss
    import planner.memory_model

    if tile:
        monkeypatch.setattr(model_utils.tiled_loss, "LOGITS_TILE_BYTES", tile)
        monkeypatch.setattr(planner.memory_model, "LOGITS_TILE_BYTES", tile)
    measured, pred = _exact_peak(prec, SHAPES[shape], feats), _predicted(prec, SHAPES[shape], feats)
    # measured here, 2026-11-24: 0.978-1.11 (above 1: RMSNorm's backward transient is an upper bound); Qwen3's
    # q/k norms (2026-11-25, before the term existed 0.70-0.93): 0.99-1.06, except with checkpointing, 1.25 (safe
    # side; the recompute phase adds the layer's whole saved set to the attention backward's transients, here with
    # q + k 2.5h wide; not traced further)
    upper = 1.30 if shape == "qwen3" and feats.get("gradient_checkpointing") else 1.12
    print(f"pred/measured {pred / measured:.3f}")
    assert 0.97 <= pred / measured <= upper, f"predicted {pred / 2**20:.1f} MiB, measured {measured / 2**20:.1f} MiB"


def test_predicted_peak_matches_the_h200_measurements():
    """The planner against max_memory_allocated of real train.py / HF Trainer steps on an H200 (bf16, 65536 tokens):
    within 3%, for every feature set measured there (the old model: -20% to +14%)."""
    with open(os.path.join(ROOT, "bench", "results", "gpu_h200_peaks.json")) as fh:
        rec = json.load(fh)
    shape = ModelShape.from_config(rec["model"])
    for point in rec["peaks_gib"]:
        feats = Features.of({**point["features"], "offload_params": True, "offload_optimizer": True})
        pred = estimate(shape, rec["seq_len"], 1, 1, feats, "bf16").gpu_peak / 2**30
        assert 0.97 <= pred / point["peak_gib"] <= 1.03, (point, pred)
