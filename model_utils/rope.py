"""RoPE settings per stage, applied through transformers' own `rope_parameters` (transformers 5), so the
rotary embedding is computed by transformers' implementations and an exported model carries them.

Supported `rope_type`s: default (with a raised `rope_theta`: ABF), linear (position interpolation),
dynamic (NTK), yarn, llama3. Formulas: transformers.modeling_rope_utils.

`dynamic` is refused under sequence parallelism: transformers rescales its frequencies from the largest
position id in the forward, and under Ulysses each rank computes RoPE on its own shard of the sequence
(before the all-to-all), so the ranks would rotate one sequence with different frequencies.
"""

from __future__ import annotations

import hashlib
import json

ROPE_TYPES = {
    "default": set(),
    "linear": {"factor"},
    "dynamic": {"factor"},
    "yarn": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
}


def check_rope(rope: dict, where: str, sp: int = 1) -> None:
    """One-line ValueError for a RoPE setting that cannot work (at SP degree `sp`)."""
    kind = rope.get("rope_type", "default")
    if kind not in ROPE_TYPES:
        raise ValueError(f"{where}: rope_type {kind!r} is not supported: use one of {sorted(ROPE_TYPES)}")
    if kind == "dynamic" and sp > 1:
        raise ValueError(f"{where}: rope_type dynamic scales each rank's frequencies from the positions of its own "
                         f"sequence shard, so under sequence_parallel_size {sp} the ranks would disagree: use yarn "
                         "or linear, or sequence_parallel_size 1")
    missing = ROPE_TYPES[kind] - set(rope)
    if missing:
        raise ValueError(f"{where}: rope_type {kind} needs {sorted(missing)}")
    if "rope_theta" in rope and not rope["rope_theta"] > 0:
        raise ValueError(f"{where}: rope_theta must be > 0, got {rope['rope_theta']}")
    if "factor" in rope and not rope["factor"] >= 1:
        raise ValueError(f"{where}: rope factor must be >= 1 (it stretches the context), got {rope['factor']}")


def apply_rope(hf_config, rope: dict | None, max_seq_length: int) -> None:
    """Merge a stage's RoPE settings into the model config (in place) and size the position table."""
    if rope:
        base = dict(hf_config.rope_parameters or {})
        if rope.get("rope_type", "default") != base.get("rope_type", "default"):
            base = {"rope_theta": base.get("rope_theta", 10000.0)}  # drop the old type's own fields
        hf_config.rope_parameters = {**base, **rope}
        if rope.get("rope_type") in ("yarn", "llama3", "linear", "dynamic"):
            hf_config.rope_parameters.setdefault("original_max_position_embeddings",
                                                 hf_config.max_position_embeddings)
    hf_config.max_position_embeddings = max(hf_config.max_position_embeddings, max_seq_length)


ARCH_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings")


def model_hash(hf_config) -> str:
    """Hash of the fields that decide the weights' shapes (RoPE and attention backend excluded)."""
    d = hf_config.to_dict()
    return hashlib.sha256(json.dumps({k: d.get(k) for k in ARCH_FIELDS}, sort_keys=True).encode()).hexdigest()[:16]
