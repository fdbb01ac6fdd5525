"""Named model shapes: tiny ones the demo and tests build from scratch, and real ones the planner sizes.

A preset is a plain dict of Hugging Face config fields plus `model_type`, so it can be turned into a
`transformers` config (`model_utils.build.preset_config`) or read as shapes without importing transformers (the planner).
"""

from __future__ import annotations

PRESETS: dict[str, dict] = {
    # Trainable on CPU in seconds; 4 heads / 2 KV heads so SP=2 and SP=4 (KV replication) both work.
    "tiny-llama": dict(
        model_type="llama", vocab_size=2048, hidden_size=128, intermediate_size=344,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=131072, rope_theta=10000.0, tie_word_embeddings=False,
    ),
    "tiny-qwen2": dict(
        model_type="qwen2", vocab_size=2048, hidden_size=128, intermediate_size=344,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
        max_position_embeddings=131072, rope_theta=10000.0, tie_word_embeddings=True,
    ),
    # Real shapes (weights are never downloaded here): used by scripts/plan.py and the dry run.
    "llama3-8b": dict(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=False,
    ),
    "llama3-70b": dict(
        model_type="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
        num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
        max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=False,
    ),
    "qwen2.5-7b": dict(
        model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
        num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
        max_position_embeddings=131072, rope_theta=1000000.0, tie_word_embeddings=False,
    ),
    "qwen3-32b": dict(
        model_type="qwen3", vocab_size=151936, hidden_size=5120, intermediate_size=25600,
        num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=131072, rope_theta=1000000.0, tie_word_embeddings=False,
    ),
    # latent attention (MLA) + MoE: q/k head dim 128 + 64 (RoPE part), v head dim 128, latent ranks
    "deepseek-v2-lite": dict(  # 15.7B parameters, 2.4B active
        model_type="deepseek_v2", vocab_size=102400, hidden_size=2048, intermediate_size=10944,
        num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64, n_shared_experts=2,
        num_experts_per_tok=6, moe_intermediate_size=1408, first_k_dense_replace=1,
        max_position_embeddings=163840, rope_theta=10000.0, tie_word_embeddings=False,
    ),
    "deepseek-v3": dict(  # 671B parameters, 37B active (the multi-token-prediction layer not counted)
        model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256, n_shared_experts=1,
        num_experts_per_tok=8, moe_intermediate_size=2048, first_k_dense_replace=3,
        max_position_embeddings=163840, rope_theta=10000.0, tie_word_embeddings=False,
    ),
    # learned attention sinks per head, alternating 128-token windows and full layers, MoE: 20.9B parameters
    "gpt-oss-20b": dict(
        model_type="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4,
        sliding_window=128, max_position_embeddings=131072, rope_theta=150000.0, tie_word_embeddings=False,
    ),
}
