"""Ulysses sequence parallelism through DeepSpeed's `UlyssesSPAttentionHF`.

`register_with_transformers` swaps the model's core attention (sdpa / flash_attention_2) in
`ALL_ATTENTION_FUNCTIONS` for a wrapper that does: [bs, sl/sp, hc, hs] --all-to-all--> [bs, sl, hc/sp, hs]
-> attention over the full sequence on hc/sp heads -> all-to-all back. KV heads fewer than sp are
replicated by DeepSpeed. It also builds the SP groups (consecutive ranks) and returns them as the `mpu`
for `deepspeed.initialize`. `unregister` undoes both, so a later stage can register a different SP degree.
"""

from __future__ import annotations

_ORIGINAL: dict = {}


def register(model, sp: int, attn_implementation: str, micro_batch: int):
    """Register Ulysses attention for `model` on SP groups of size `sp`; returns the mpu (None when sp == 1)."""
    if sp == 1:
        return None
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    _ORIGINAL.setdefault(attn_implementation, ALL_ATTENTION_FUNCTIONS[attn_implementation])
    return UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation=attn_implementation, sequence_parallel_size=sp,
        micro_batch_size=micro_batch, seq_length_is_variable=True)


def unregister() -> None:
    """Restore the plain attention functions and drop DeepSpeed's SP groups."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for name, fn in _ORIGINAL.items():
        ALL_ATTENTION_FUNCTIONS[name] = fn
    _ORIGINAL.clear()
    parallel_state_sp._release_sequence_parallel_groups()
