"""Mixture-of-experts shapes (planner/moe_keys.moe_fields) against the model transformers builds, and the tiled MLP that
auto never offers an MoE (planner.auto_features.candidates). The planner read only DeepSeek / Qwen / Mixtral's keys:
ERNIE-4.5-MoE planned as a dense 3.35B (it has 21.83B), Hunyuan, Qwen2-MoE and GraniteMoeShared without their shared
experts; and auto chose tiled_mlp for gpt-oss's 256k stage, whose expert blocks model_utils/memory.py refuses to tile
(exit 2 at that stage's engine, after the first stage had trained)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from planner import auto_features as af
from planner.memory_model import load_shape
from planner.shapes import ModelShape

# the released configs' shapes (hub config.json), as the audit's meta-device count took them
ERNIE = dict(hidden_size=2560, intermediate_size=12288, num_hidden_layers=28, num_attention_heads=20,
             num_key_value_heads=4, head_dim=128, vocab_size=103424, moe_num_experts=64, moe_k=6,
             moe_intermediate_size=1536, moe_num_shared_experts=2, moe_layer_start_index=1, tie_word_embeddings=True)
HUNYUAN = dict(hidden_size=4096, intermediate_size=3072, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=128167, num_experts=64, moe_topk=8, num_shared_expert=1,
               moe_intermediate_size=3072)
QWEN2_57B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                 num_key_value_heads=4, vocab_size=151936, num_experts=64, num_experts_per_tok=8,
                 moe_intermediate_size=2560, shared_expert_intermediate_size=20480)
QWEN15_MOE = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=24, num_attention_heads=16,
                  num_key_value_heads=16, vocab_size=151936, num_experts=60, num_experts_per_tok=4,
                  moe_intermediate_size=1408, shared_expert_intermediate_size=5632)
GRANITE_SHARED = dict(hidden_size=1536, intermediate_size=512, num_hidden_layers=32, num_attention_heads=24,
                      num_key_value_heads=8, vocab_size=49155, num_local_experts=40, num_experts_per_tok=8,
                      shared_intermediate_size=1024, tie_word_embeddings=True)
CASES = {
    "ernie-4.5-21b-a3b": ("ernie4_5_moe", ERNIE),
    "ernie, every 2nd layer MoE up to 20": ("ernie4_5_moe", {**ERNIE, "moe_layer_interval": 2,
                                                             "moe_layer_end_index": 20}),
    "hunyuan-a13b": ("hunyuan_v1_moe", HUNYUAN),
    "hunyuan, top-k per layer": ("hunyuan_v1_moe", {**HUNYUAN, "moe_topk": [8] * 32}),
    "qwen2-57b-a14b": ("qwen2_moe", QWEN2_57B),
    "qwen1.5-moe-a2.7b": ("qwen2_moe", QWEN15_MOE),
    "qwen2-moe, sparse step 2, dense layer 3": ("qwen2_moe", {**QWEN15_MOE, "decoder_sparse_step": 2,
                                                              "mlp_only_layers": [3]}),
    "granitemoeshared": ("granitemoeshared", GRANITE_SHARED),
    "qwen3-30b-a3b": ("qwen3_moe", dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                                        num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                                        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768)),
    "glm-4.5-air": ("glm4_moe", dict(hidden_size=4096, intermediate_size=10944, num_hidden_layers=46,
                                     num_attention_heads=96, num_key_value_heads=8, head_dim=128, vocab_size=151552,
                                     n_routed_experts=128, num_experts_per_tok=8, moe_intermediate_size=1408,
                                     n_shared_experts=1, first_k_dense_replace=1, partial_rotary_factor=0.5)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_moe_params_match_the_built_model(case):
    """The planner's parameters (hence ZeRO-3's shards, the optimizer's states, the checkpoint's size) are those of the
    model transformers builds from the config (on the meta device: no memory), and its top-k the router's."""
    model_type, kw = CASES[case]
    config = AutoConfig.for_model(model_type, **kw)
    with torch.device("meta"):
        real = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    shape = ModelShape.from_config(config.to_dict())
    assert abs(shape.num_params() - real) / real < 1e-4, (case, shape.num_params(), real)
    top_k = config.num_experts_per_tok  # each family's attribute_map: moe_k, moe_topk, ...
    assert shape.experts_per_token == (max(top_k) if isinstance(top_k, list) else top_k)


def test_ernie_is_planned_as_an_moe():
    shape = ModelShape.from_config(AutoConfig.for_model("ernie4_5_moe", **ERNIE).to_dict())
    assert (shape.num_experts, shape.experts_per_token, shape.shared_width, shape.dense_layers) == (64, 6, 3072, 1)
    assert 21.8e9 < shape.num_params() < 21.9e9 and shape.matmul_params() < 4e9  # "21B-A3B"


def test_moe_without_top_k_refused():
    """A config with experts and no key the planner knows for the top-k: one line, not a guess."""
    cfg = {**QWEN15_MOE, "model_type": "qwen2_moe"}
    del cfg["num_experts_per_tok"]
    with pytest.raises(ValueError, match="60 experts and no top-k.*num_experts_per_tok") as err:
        ModelShape.from_config(cfg)
    assert "\n" not in str(err.value)


def test_auto_never_tiles_an_moe_mlp():
    """gpt-oss's 256k stage (recipes/gpt_oss_20b_128k_to_1m.yaml, 32 x 80 GB, SP 8) chose tiled_mlp, which its expert
    blocks cannot run; a dense model is still offered it, and a pinned tiled_mlp on an MoE is one line."""
    oss = load_shape("gpt-oss-20b")
    assert oss.no_tiled_mlp and not load_shape("llama3-8b").no_tiled_mlp
    assert not any(f.tiled_mlp for f in af.candidates(oss.num_layers, {}, "cuda", no_tiled_mlp=oss.no_tiled_mlp))
    assert any(f.tiled_mlp for f in af.candidates(oss.num_layers, {}, "cuda"))
    budget = af.gpu_budget(80)
    for seq_len in (131072, 262144, 524288):
        assert not af.choose(oss, seq_len, 32, budget, sp=8).features.tiled_mlp
    with pytest.raises(ValueError, match="tiled_mlp: gpt_oss's MLP is a mixture-of-experts block") as err:
        af.choose(oss, 262144, 32, budget, sp=8, pinned={"tiled_mlp": True})
    assert "\n" not in str(err.value)


def test_other_top_k_names_and_a_config_that_says_it_is_dense():
    """Kimi-Linear / Bailing name the top-k num_experts_per_token, Gemma-4 MoE top_k_experts: they were refused as
    "no top-k"; Doge (is_moe false) and Gemma-4 dense (enable_moe_block false) carry an expert count from their class
    defaults and were judged MoE."""
    from planner.moe_keys import expert_count, moe_fields

    for key in ("num_experts_per_token", "top_k_experts"):
        cfg = {"model_type": "x", "num_hidden_layers": 2, "intermediate_size": 64, "num_experts": 8, key: 2}
        assert moe_fields(cfg)["experts_per_token"] == 2
    assert expert_count({"num_experts": 16384, "is_moe": False}) == 0
    assert expert_count({"num_experts": 128, "enable_moe_block": False}) == 0
    assert expert_count({"num_experts": 128, "enable_moe_block": True}) == 128
