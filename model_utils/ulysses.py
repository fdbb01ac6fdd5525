"""Ulysses sequence parallelism through DeepSpeed's `UlyssesSPAttentionHF`, over document-masked attention.

`register` first puts the document-masked core attention of `model_utils/attention.py` in transformers'
`ALL_ATTENTION_FUNCTIONS` (also at sp == 1, so every SP degree computes the same thing), then, for sp > 1,
`register_with_transformers` wraps it: [bs, sl/sp, hc, hs] --all-to-all--> [bs, sl, hc/sp, hs] -> attention
over the full sequence on hc/sp heads (documents and windows rebuilt from the gathered position ids) ->
all-to-all back. KV heads fewer than sp are replicated by DeepSpeed. It also builds the SP groups
(consecutive ranks) and returns them as the `mpu` for `deepspeed.initialize`. The outermost function is
tracked, so `attention.check_routed(model)` can refuse a model whose attention bypasses it. `unregister`
undoes all of it, so a later stage can register a different SP degree.
"""

from __future__ import annotations

from model_utils import attention


def register(model, sp: int, attn_implementation: str, micro_batch: int):
    """Register document-masked (and, for sp > 1, Ulysses) attention for `model`; returns the mpu (None at sp 1)."""
    attention.register(model, attn_implementation)
    mpu = None
    if sp > 1:
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

        mpu = UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=model, core_attn_implementation=attn_implementation, sequence_parallel_size=sp,
            micro_batch_size=micro_batch, seq_length_is_variable=True)
    attention.track(model, attn_implementation)
    return mpu


def unregister() -> int:
    """Restore the plain attention functions and destroy DeepSpeed's SP groups (returns how many groups)."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    from base import comm

    attention.restore()
    n = comm.destroy_groups([parallel_state_sp._SEQUENCE_PARALLEL_GROUP,
                             parallel_state_sp._SEQUENCE_DATA_PARALLEL_GROUP])
    parallel_state_sp._release_sequence_parallel_groups()
    return n


check_routed = attention.check_routed  # train.py: call once after the first micro-step's forward
