"""The planner's shapes of latent attention (MLA) and mixture-of-experts models: DeepSeek-V2-Lite and DeepSeek-V3
presets give their published parameter counts, their attention is sized at the q/k head dim (v is padded to it
through Ulysses' all-to-all) with one KV head per query head, and scripts/plan.py plans them."""

from __future__ import annotations

import subprocess
import sys

import pytest

from planner.presets import PRESETS
from planner.shapes import ModelShape, load_shape, windowed_layers


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
# ignores a configured window is refused at the first step: model_utils/attention's check of the windows it received);
# then families whose config holds a sliding_window their attention never applies (Llama: a stray key)
WINDOW_FAMILIES = ["mistral", "mixtral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "gemma2", "gemma3_text", "gpt_oss",
                   "cohere2", "ministral", "phi3", "starcoder2", "exaone4", "olmo3", "cohere2_moe", "gemma4_text",
                   "granite_swa", "cwm", "smollm3"]
NO_WINDOW_FAMILIES = ["llama", "phimoe", "seed_oss", "hunyuan_v1_dense", "glm4", "nemotron_h", "zaya"]
WINDOWS_SEEN: dict[int, int | None] = {}


def _record_window(module, query, key, value, mask, **kwargs):
    """An attention function that notes the window transformers hands each layer, then runs SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    window = kwargs["sliding_window"] if "sliding_window" in kwargs else getattr(module, "sliding_window", None)
    WINDOWS_SEEN[module.layer_idx] = window
    return sdpa_attention_forward(module, query, key, value, mask, **kwargs)


@pytest.mark.parametrize("kind", WINDOW_FAMILIES + NO_WINDOW_FAMILIES)
def test_windowed_layers_are_those_transformers_runs(kind, monkeypatch):
    """FLOPs counted every layer as full attention: ModelShape read layer_types for linear attention only, so
    gpt-oss-20b (12 of 24 layers at a 128-token window) was counted 1.6x (128k) to 1.9x (1M) over. Then a family
    outside the planner's table had every layer windowed from a config.json without layer_types (EXAONE-4.0-32B: 64,
    where transformers runs 48, its 1M attention FLOPs 33x low), a family that never applies the window (Llama with a
    stray sliding_window, Phi-MoE, GLM-4, ...) had it counted, and Qwen2/3 counted a window when config.json leaves
    out use_sliding_window (transformers' default: off). Per family, tiny and run once on CPU: the window each layer's
    attention receives, against the planner from the config.json transformers saves (layer_types listed), from it
    without layer_types and from the hub-like dict it was built from, use_sliding_window on and left out. Without
    transformers to derive layer_types the planner may count fewer windows, never more (the safe side)."""
    import torch
    from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM

    import planner.shapes

    AttentionInterface.register("record_window", _record_window)
    fields = dict(model_type=kind, num_hidden_layers=8, hidden_size=32, intermediate_size=32, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, vocab_size=64, pad_token_id=0, sliding_window=16,
                  max_window_layers=3, num_local_experts=2, num_experts=2, moe_intermediate_size=16,
                  num_experts_per_tok=1, vocab_size_per_layer_input=64, hidden_size_per_layer_input=8)
    for use in (True, None):
        raw = fields if use is None else {**fields, "use_sliding_window": use}
        cfg = AutoConfig.for_model(**raw)
        if hasattr(cfg, "attn_logit_softcapping"):
            cfg.attn_logit_softcapping = None  # SDPA takes no soft-capping; the windows are the same
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="record_window")
        WINDOWS_SEEN.clear()
        with torch.no_grad():
            model(torch.arange(8)[None])
        want = tuple(i for i in sorted(WINDOWS_SEEN) if WINDOWS_SEEN[i])
        assert {WINDOWS_SEEN[i] for i in want} <= {16}, (kind, WINDOWS_SEEN)
        saved = cfg.to_dict()
        dicts = {"saved": saved, "saved without layer_types": {k: v for k, v in saved.items() if k != "layer_types"},
                 "hub-like": raw}
        for name, d in dicts.items():
            assert windowed_layers(d) == ((16, want) if want else (0, ())), (kind, use, name)
        # transformers not importable: no layer_types derived
        monkeypatch.setattr(planner.shapes, "_derived_layer_types", lambda cfg: [], raising=False)
        assert set(windowed_layers(raw)[1]) <= set(want), (kind, use)
        monkeypatch.undo()
    assert windowed_layers({**fields, "use_sliding_window": False}) == (0, ()) or kind not in (
        "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "smollm3")


def test_preset_and_hub_windows():
    """The presets' windows, and EXAONE-4.0-32B's config.json as published (no layer_types: every 4th layer full)."""
    assert load_shape("gpt-oss-20b").window_layers == tuple(range(0, 24, 2))
    assert load_shape("llama3-8b").window_layers == ()
    exaone = {"architectures": ["Exaone4ForCausalLM"], "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120,
              "intermediate_size": 27392, "max_position_embeddings": 131072, "model_type": "exaone4",
              "num_attention_heads": 40, "num_hidden_layers": 64, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
              "rope_theta": 1000000, "sliding_window": 4096, "sliding_window_pattern": 4,
              "tie_word_embeddings": False, "vocab_size": 102400}
    shape = ModelShape.from_config(exaone)
    assert shape.sliding_window == 4096 and shape.window_layers == tuple(i for i in range(64) if (i + 1) % 4)
