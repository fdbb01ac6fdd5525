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
}
