"""Learned attention sinks (GPT-OSS's `s_aux`: one extra softmax logit per query head that attends to nothing) under
document masking and sequence parallelism. ulysses.py slices the sinks to each rank's query heads after the
all-to-all; on CPU every backend's call runs attention.py's sdpa pieces (and context_parallel.py's chunks) with
`sink_sdpa` (transformers' flex refuses sinks on CPU); on a GPU flex_attention applies them from its lse with our
BlockMask (written by construction, untested here); flash-attention drops them and is refused (families.py).
"""

from __future__ import annotations

import torch

# architectures with a learned per-head attention sink (an extra softmax logit per head, passed as `s_aux`): GPT-OSS
# is covered (ulysses.py slices the sinks with their heads; `_sink_sdpa` on CPU, transformers' flex lse on GPU); the
# others are refused until each is checked against its plain model (their attention code differs: issue 34)
SINK_MODEL_TYPES = ("gpt_oss", "flint", "granite_swa", "granitemoe_swa", "mimo_v2_flash", "hy_v4", "deepseek_v4")
SINKS_COVERED = ("gpt_oss",)


def sink_sdpa(module, query, key, value, mask, s_aux=None, scaling=None, **kwargs):
    """One piece's attention with a learned sink per head (GPT-OSS's `s_aux`): an extra logit in every query's softmax
    that attends to nothing. Same signature and output as transformers' sdpa_attention_forward ([1, q, hq, dv]), so
    `_sdpa_docs` and context_parallel's `_sdpa_chunk` run it per piece: every query is in exactly one piece (also
    under cp, whose queries see the gathered keys in one call), so its sink enters its softmax once.

    The sink is one more key, first, that every query sees: one more q/k dimension (q 1, real keys 0, the sink key
    s_h / scale) so its score is s_h, and a zero value; torch's sdpa then computes softmax([scores, s_h]) . [V, 0] and
    its backward reaches the sinks through that key. query [1, hq, q, d]; key/value [1, hkv, k, d]; `mask` [1, 1, q, k]
    bool or None (plain causal). The CPU path (transformers' flex refuses sinks on CPU): per piece it repeats K/V to the
    query heads and builds a [q, k + 1] mask (torch keeps both for backward), so one long document of n tokens costs
    O(n^2) bytes per layer here, as the eager path does; on a GPU flex_attention applies the sink from its lse with the
    BlockMask (no [q, k] tensor) and this function is not used."""
    hq, nq, d = query.shape[1], query.shape[2], query.shape[-1]
    g, nk = hq // key.shape[1], key.shape[2]
    scale = scaling if scaling is not None else d ** -0.5
    key, value = key.repeat_interleave(g, dim=1), value.repeat_interleave(g, dim=1)  # [1, hq, k, d]
    sink_key = torch.cat([query.new_zeros(1, hq, 1, d), (s_aux.to(query.dtype) / scale).view(1, hq, 1, 1)], dim=-1)
    q = torch.cat([query, query.new_ones(1, hq, nq, 1)], dim=-1)  # [1, hq, q, d + 1]
    k = torch.cat([sink_key, torch.cat([key, key.new_zeros(1, hq, nk, 1)], dim=-1)], dim=2)  # [1, hq, 1 + k, d + 1]
    v = torch.cat([value.new_zeros(1, hq, 1, value.shape[-1]), value], dim=2)  # [1, hq, 1 + k, dv]
    if mask is None:  # causal with the last query and key aligned
        mask = torch.ones(nq, nk, dtype=torch.bool, device=query.device).tril(nk - nq)[None, None]
    mask = torch.cat([mask.new_ones(1, 1, nq, 1), mask], dim=-1)  # [1, 1, q, 1 + k]: the sink for every query
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.transpose(1, 2), None  # [1, q, hq, dv]


def has_sinks(model_or_config) -> bool:
    """Whether the model's attention has learned sinks (by its type, or a `.sinks` parameter)."""
    config = getattr(model_or_config, "config", model_or_config)
    if config.get_text_config().model_type in SINK_MODEL_TYPES:
        return True
    return model_or_config is not config and any(n.endswith(".sinks") for n, _ in model_or_config.named_parameters())
