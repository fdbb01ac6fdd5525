"""An MoE layer's saved activations: the planner's term (planner.layer_terms.moe_mlp_terms) against what transformers'
experts keep for backward (audit 67: the planner counted an MoE layer's MLP as a dense one of intermediate_size, and
planned gpt-oss-20b's 128k stage at 53.6 GiB where it needs ~121, Qwen3-30B-A3B's 4 x 8 128k at 61.7 for ~86).

Two checks: the figures measured at each family's real widths (bf16, saved_tensors_hooks on one MoE block, parameters
and the block input excluded, B/token), and the same measurement here at small widths on CPU, so that the formula
follows transformers itself. The planner before the fix failed both (MoE / dense ratio 2.3-25 at real widths).
"""

from __future__ import annotations

import dataclasses

import pytest

from planner.memory_model import Features, ModelShape, estimate, layer_activations, layer_phase_terms

B = 2  # bf16

# family: (config fields at real widths, the measured experts the measurement built, measured saved B/token)
REAL = {
    "Qwen3-30B-A3B": ("qwen3_moe", dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                                        num_experts=16, num_experts_per_tok=8), 115_024),
    "OLMoE-1B-7B": ("olmoe", dict(hidden_size=2048, intermediate_size=1024, num_experts=16, num_experts_per_tok=8),
                    131_408),
    "gpt-oss-20b": ("gpt_oss", dict(hidden_size=2880, intermediate_size=2880, num_local_experts=4,
                                    num_experts_per_tok=4, head_dim=64, num_attention_heads=64), 207_536),
    "Mixtral-8x7B": ("mixtral", dict(hidden_size=4096, intermediate_size=14336, num_local_experts=2,
                                     num_experts_per_tok=2), 262_236),
}


def _shape(model_type: str, fields: dict) -> ModelShape:
    cfg = {"model_type": model_type, "vocab_size": 256, "num_hidden_layers": 1, "num_attention_heads": 16,
           "num_key_value_heads": 8, **fields}
    return ModelShape.from_config(cfg)


def mlp_saved_per_token(shape: ModelShape, tokens: int = 4096) -> float:
    """The planner's saved bytes of one layer's MLP per token: the layer's saved set less the same layer without
    an MLP (no experts, intermediate size 0)."""
    bare = dataclasses.replace(shape, num_experts=0, experts_per_token=0, shared_experts=0, moe_intermediate_size=0,
                               dense_layers=0, intermediate_size=0)
    return (layer_activations(shape, tokens, 1, B, False)[0] - layer_activations(bare, tokens, 1, B, False)[0]) / tokens


@pytest.mark.parametrize("name", sorted(REAL))
def test_moe_saved_bytes_match_the_real_width_measurements(name):
    model_type, fields, measured = REAL[name]
    got = mlp_saved_per_token(_shape(model_type, fields))
    assert abs(got / measured - 1) < 0.01, (name, got, measured)  # within 1%: the router / index terms


# small widths (h != 2I apart from each other), k and E varied; the families of the four above and DeepSeek-V3
# (shared experts, fp32 router input) and Qwen2-MoE's routed part
SMALL = {
    "qwen3_moe": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=48, num_experts=8,
                      num_experts_per_tok=4),
    "olmoe": dict(hidden_size=64, intermediate_size=40, num_experts=4, num_experts_per_tok=2),
    "mixtral": dict(hidden_size=64, intermediate_size=160, num_local_experts=4, num_experts_per_tok=2),
    "gpt_oss": dict(hidden_size=64, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, head_dim=16,
                    num_attention_heads=4),
    "deepseek_v3": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
                        n_shared_experts=2, num_experts_per_tok=4, n_group=1, topk_group=1, first_k_dense_replace=0,
                        kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16),
}


@pytest.mark.parametrize("model_type", sorted(SMALL))
def test_moe_saved_bytes_match_transformers_on_cpu(model_type):
    torch = pytest.importorskip("torch")
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    tokens = 512
    fields = {"num_attention_heads": 4, **SMALL[model_type]}
    cfg = CONFIG_MAPPING[model_type](vocab_size=256, num_hidden_layers=1, num_key_value_heads=4, **fields)
    torch.manual_seed(0)
    block = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).model.layers[0].mlp
    x = torch.randn(1, tokens, cfg.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    for t in (x, *block.parameters()):  # the block input is the norm's output (counted there), the weights ZeRO-3's
        seen.pop(t.untyped_storage().data_ptr(), None)
    measured = sum(seen.values()) / tokens
    got = mlp_saved_per_token(ModelShape.from_config({"model_type": model_type, **cfg.to_dict()}), tokens)
    # within 1% below (DeepSeek's group ids past one group) and 3% above (one router / index formula for all)
    assert 0.99 <= got / measured < 1.03, (model_type, got, measured)


def test_dense_layers_of_an_moe_model_keep_a_dense_mlp():
    """DeepSeek's first_k_dense_replace layers: the dense term as before; the others the MoE term, with and without
    checkpointing (the layers not checkpointed counted by kind)."""
    shape = _shape("deepseek_v3", dict(hidden_size=256, intermediate_size=1024, moe_intermediate_size=128,
                                       n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                                       first_k_dense_replace=3, num_hidden_layers=8, num_attention_heads=8,
                                       num_key_value_heads=8, head_dim=32))
    T, seq = 1024, 8192
    moe = layer_activations(shape, T, 8, B, False)[0]
    dense = layer_activations(shape, T, 8, B, False, dense_mlp=True)[0]
    plain = dataclasses.replace(shape, num_experts=0, experts_per_token=0, shared_experts=0, moe_intermediate_size=0,
                                dense_layers=0)
    assert dense == layer_activations(plain, T, 8, B, False)[0] != moe
    est = estimate(shape, seq, 8, 8, Features(), "bf16")
    assert est.gpu["saved activations (all layers)"] == 3 * dense + 5 * moe
    est = estimate(shape, seq, 8, 8, Features(checkpoint_every=2), "bf16")  # layers 1, 3, 5, 7 keep theirs
    assert est.gpu["saved activations (layers not checkpointed)"] == dense + 3 * moe
    # --tiled_mlp is refused for an MoE model (model_utils/memory._tile_mlps): its MLPs count untiled
    assert layer_phase_terms(shape, T, 8, B, True) == layer_phase_terms(shape, T, 8, B, False)
