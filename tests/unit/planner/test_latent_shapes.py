"""The planner's shapes of latent attention (MLA) and mixture-of-experts models: DeepSeek-V2-Lite and DeepSeek-V3
presets give their published parameter counts, their attention is sized at the q/k head dim (v is padded to it
through Ulysses' all-to-all) with one KV head per query head, and scripts/plan.py plans them."""

from __future__ import annotations

import subprocess
import sys

import pytest

from planner.presets import PRESETS
from planner.shapes import ModelShape, load_shape


@pytest.mark.parametrize("name,total,active", [("deepseek-v2-lite", 15.7e9, 2.4e9), ("deepseek-v3", 671e9, 37e9)])
def test_deepseek_presets_count_latent_attention_and_experts(name, total, active):
    shape = load_shape(name)
    assert (shape.head_dim, shape.v_dim, shape.num_kv_heads) == (192, 128, shape.num_heads)
    assert shape.kv_lora_rank == 512 and shape.q_lora_rank == (PRESETS[name]["q_lora_rank"] or 0)
    assert abs(shape.num_params() - total) / total < 0.02, shape.num_params()
    assert abs(shape.matmul_params() - active) / active < 0.05, shape.matmul_params()  # the routed experts a token uses


def test_latent_attention_params_are_not_the_dense_formula():
    """The MLA projections from the latent ranks, against the module sizes transformers builds (meta device)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, kv_lora_rank=32,
                  q_lora_rank=48, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                  moe_intermediate_size=32, first_k_dense_replace=1, n_group=1, topk_group=1)
    shape = ModelShape.from_config({**fields, "model_type": "deepseek_v3"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("deepseek_v3", **fields))
    attn = sum(p.numel() for p in model.model.layers[0].self_attn.parameters())
    assert shape.attention_params() == attn
    dense = ModelShape(**{**vars(shape), "kv_lora_rank": 0, "num_experts": 0})
    assert dense.attention_params() != attn
    total = sum(p.numel() for n, p in model.named_parameters() if "bias" not in n)  # e_score_correction_bias
    assert shape.num_params() == total


def test_plan_py_plans_a_deepseek_preset():
    out = subprocess.run([sys.executable, "scripts/plan.py", "--model", "deepseek-v2-lite", "--seq_len", "128k",
                          "--nodes", "1", "--auto"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "memory_features auto:" in out.stdout


def test_auto_never_chunks_heads_of_latent_attention_or_sinks():
    """ulysses.register refuses head chunks for both: memory_features auto must not choose them."""
    import dataclasses

    from planner.auto_features import head_chunk_options

    oss = load_shape("gpt-oss-20b")
    assert abs(oss.num_params() - 20.9e9) / 20.9e9 < 0.02 and oss.num_experts == 32
    for shape in (oss, load_shape("deepseek-v3")):
        assert head_chunk_options(shape, 8) == [1], shape.model_type
    assert head_chunk_options(dataclasses.replace(oss, model_type="llama"), 8) == [1, 2, 4, 8]


# transformers 5.23's families with a sliding window, each with its own rule for which layers use it (a family that
# ignores a configured window is refused at the first step: model_utils/attention's check of the windows it received)
WINDOW_FAMILIES = ["mistral", "mixtral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "gemma2", "gemma3_text", "gpt_oss",
                   "cohere2", "ministral", "phi3", "starcoder2"]


def test_windowed_layers_are_those_transformers_runs():
    """FLOPs counted every layer as full attention: ModelShape read layer_types for linear attention only, so
    gpt-oss-20b (12 of 24 layers at a 128-token window) was counted 1.6x (128k) to 1.9x (1M) over. Per family, the
    layers whose attention module transformers builds with the window (meta device; a module without the attribute
    gets config.sliding_window where its forward passes it), from the config as transformers holds it (layer_types
    listed) and from a config.json without layer_types; use_sliding_window off: none."""
    import inspect

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(num_hidden_layers=8, hidden_size=32, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                  head_dim=16, vocab_size=64, pad_token_id=0, sliding_window=16, use_sliding_window=True,
                  max_window_layers=3, num_local_experts=2, num_experts=2, moe_intermediate_size=16,
                  num_experts_per_tok=1)
    for kind in WINDOW_FAMILIES:
        cfg = AutoConfig.for_model(kind, **fields)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
        want = []
        for i, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            passed = "sliding_window" in inspect.getsource(type(attn).forward)
            w = attn.sliding_window if hasattr(attn, "sliding_window") else cfg.sliding_window if passed else None
            want += [i] * bool(w)
        raw = {k: v for k, v in cfg.to_dict().items() if k != "layer_types"}
        for d in (cfg.to_dict(), raw):
            shape = ModelShape.from_config(d)
            assert (shape.sliding_window, shape.window_layers) == ((16, tuple(want)) if want else (0, ())), (kind, d is raw)
        assert ModelShape.from_config({**raw, "use_sliding_window": False}).window_layers == () or kind not in (
            "qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
    assert load_shape("gpt-oss-20b").window_layers == tuple(range(0, 24, 2))
    assert load_shape("llama3-8b").window_layers == ()
