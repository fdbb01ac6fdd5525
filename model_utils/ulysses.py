"""Sequence parallelism of a model's attention: Ulysses (DeepSpeed's `UlyssesSPAttentionHF`) x context parallel.

`register` first puts the document-masked core attention of `model_utils/attention.py` in transformers'
`ALL_ATTENTION_FUNCTIONS` (also at sp == 1, so every SP degree computes the same thing); with cp > 1 it replaces
that core by the context-parallel one (`model_utils/context_parallel.py`: K/V gathered over the cp group, queries
kept); with a Ulysses factor u > 1 DeepSpeed's wrapper goes around it: [bs, sl/sp, hc, hs] --all-to-all over u
ranks--> [bs, sl/cp, hc/u, hs] -> the core -> all-to-all back. KV heads fewer than u are replicated by DeepSpeed.
Latent attention (MLA: DeepSeek-V2/V3; q/k head dim d, v head dim dv < d, `families.latent_dims`) goes through our
own instance per call shape (`_wrap_ulysses`, as head chunks do): v padded with zeros to d for the all-to-all and the
core, the output's padding dropped after the all-to-all back (costs there); head chunks are refused for it.
Learned attention sinks (GPT-OSS: `s_aux` [hq], one logit per query head) go the same way: after the all-to-all a
rank holds query heads [r*hq/u, (r+1)*hq/u), so `_wrap_ulysses` hands the core that slice of the sinks (their
gradient reaches the whole parameter, the other heads' part zero on this rank); under cp every rank holds them all.

Groups (dims.sp = u x cp, consecutive ranks, sp_rank = cp_rank * u + ulysses_rank): the SP group is DeepSpeed's
`parallel_state_sp` (returned as the `mpu` for `deepspeed.initialize`, so its batch accounting and gradient
reduction are those of pure Ulysses at the same SP degree); the Ulysses groups are consecutive u ranks inside it
(one node on a cluster), the cp groups the ranks with the same Ulysses rank (across nodes). With cp == 1 this is
DeepSpeed's own `register_with_transformers`, unchanged. The outermost function is tracked, so
`attention.check_routed(model)` can refuse a model whose attention bypasses it. `unregister` undoes all of it,
so a later stage can register another (u, cp).
"""

from __future__ import annotations

import torch

from base import comm
from model_utils import attention, context_parallel, families, linear_attention
from model_utils import head_chunks as head_chunks_mod
from model_utils.sinks import has_sinks

_GROUPS: list = []  # the Ulysses and cp groups this module created (destroyed by unregister)


def _subgroup_ranks(world: int, sp: int, cp: int) -> tuple[list[list[int]], list[list[int]]]:
    """(Ulysses groups, cp groups) as rank lists over the whole world, the same on every rank."""
    u = sp // cp
    ulysses, cps = [], []
    for base in range(0, world, sp):
        ulysses += [[base + c * u + j for j in range(u)] for c in range(cp)]
        cps += [[base + c * u + j for c in range(cp)] for j in range(u)]
    return ulysses, cps


def _wrap_ulysses(model, attn: str, group, micro_batch: int) -> None:
    """DeepSpeed's Ulysses attention over `group` around the registered core, installed the way
    `UlyssesSPAttentionHF.register_with_transformers` installs it, but with one instance per head shape of the call
    (the instance checks its shapes): the whole layer's heads, or one head chunk's (model_utils/head_chunks.py). It
    also carries what DeepSpeed's own wrapper cannot: latent attention's narrower v, and learned sinks per head."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    cfg = model.config.get_text_config()
    core = ALL_ATTENTION_FUNCTIONS[attn]
    by_heads: dict = {}
    rank, u = comm.rank(group), comm.world(group)

    def uattn_wrapper(module, query, key, value, attention_mask, *args, **kwargs):
        heads = (query.shape[1], key.shape[1], query.shape[-1])  # query [bs, hq, sl/sp, d], key [bs, hkv, sl/sp, d]
        if heads not in by_heads:
            uattn = UlyssesSPAttentionHF(
                attn=core, batch_size=micro_batch, attn_head_count=heads[0], attn_head_size=query.shape[-1],
                kv_head_count=heads[1], num_hidden_layers=cfg.num_hidden_layers, process_group=group,
                seq_length_is_variable=True)
            uattn.core_attn_implementation = attn
            by_heads[heads] = uattn
        if kwargs.get("s_aux") is not None:  # learned sinks [hq] (GPT-OSS): this rank's heads after the all-to-all
            n = heads[0] // u  # query heads split in order, rank r holds [r*n, (r+1)*n) (KV replication is K/V's only)
            kwargs["s_aux"] = kwargs["s_aux"][rank * n:(rank + 1) * n]
        dv = value.shape[-1]
        if dv == query.shape[-1]:
            return by_heads[heads](module, query, key, value, None, *args, **kwargs)  # masks: rebuilt from positions
        # latent attention (MLA): value [bs, h, sl/sp, dv] with dv < d. DeepSpeed's all-to-all takes one head dim, so
        # v goes padded with zeros to d (the zero columns stay zero through attention) and the output, [bs, sl/sp,
        # hq * d] after the all-to-all back, loses them. Cost: v's and the output's all-to-all carry d / dv times
        # their bytes; at DeepSeek-V3 (128 heads, d 192, dv 128) the layer's four all-to-alls move 768 instead of
        # 640 values per head and token (+20%), and the core's P.V product is 1.5x.
        out, weights = by_heads[heads](module, query, key, torch.nn.functional.pad(value, (0, query.shape[-1] - dv)),
                                       None, *args, **kwargs)
        bs, sl = out.shape[:2]
        return out.view(bs, sl, heads[0], -1)[..., :dv].reshape(bs, sl, heads[0] * dv), weights

    ALL_ATTENTION_FUNCTIONS[attn] = uattn_wrapper


def register(model, dims, attn_implementation: str, micro_batch: int, head_chunks: int | str = 1, ring: bool = False):
    """Register document-masked (and, for dims.sp > 1, Ulysses x context-parallel) attention for `model`; returns
    the mpu (None at sp 1). `dims`: the stage's base.parallel.ParallelDims (sp, cp, world, rank). `head_chunks` > 1
    runs each layer's attention that many chunks of heads at a time (model_utils/head_chunks.py; "auto" unresolved
    by the planner: 1); a count that does not split the heads per rank is refused in one line. `ring`: under cp > 1
    the K/V pass around the cp group (model_utils/ring_attention.py) instead of being gathered whole."""
    head_chunks = 1 if head_chunks in ("auto", None, 0) else int(head_chunks)
    families.check_supported(model, attn_implementation, head_chunks=head_chunks)  # at start-up too (config alone)
    latent, sinks = families.latent_dims(model.config) is not None, has_sinks(model)
    head_chunks_mod.install(model, head_chunks, dims.ulysses)
    attention.register(model, attn_implementation)
    mpu = None
    if dims.sp > 1 and dims.cp == 1:
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        core = ALL_ATTENTION_FUNCTIONS[attn_implementation]
        mpu = UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=model, core_attn_implementation=attn_implementation, sequence_parallel_size=dims.sp,
            micro_batch_size=micro_batch, seq_length_is_variable=True)
        if head_chunks > 1 or latent or sinks:  # DeepSpeed's wrapper: all heads of one head dim, no sinks: ours
            ALL_ATTENTION_FUNCTIONS[attn_implementation] = core
            _wrap_ulysses(model, attn_implementation, mpu.get_sequence_parallel_group(), micro_batch)
    elif dims.sp > 1:
        from deepspeed.runtime.sequence_parallel import parallel_state_sp

        parallel_state_sp.initialize_sequence_parallel(sequence_parallel_size=dims.sp)
        ulysses_ranks, cp_ranks = _subgroup_ranks(dims.world, dims.sp, dims.cp)
        u_group = comm.subgroups(ulysses_ranks) if dims.ulysses > 1 else None
        cp_group = comm.subgroups(cp_ranks)
        _GROUPS.extend(g for g in (u_group, cp_group) if g is not None)
        context_parallel.register(attn_implementation, cp_group, dims.cp, dims.cp_rank, ring)  # ring: K/V in a ring
        if dims.ulysses > 1:
            _wrap_ulysses(model, attn_implementation, u_group, micro_batch)
        mpu = parallel_state_sp
    if linear_attention.is_hybrid(model):  # gated delta-net layers: Ulysses by heads, documents restarted (any sp)
        linear_attention.check_layout(model, dims.sp, dims.cp)
        linear_attention.install(model, mpu.get_sequence_parallel_group() if dims.sp > 1 else None, dims.sp)
    attention.track(model, attn_implementation)
    return mpu


def unregister() -> int:
    """Restore the plain attention functions and destroy the SP groups (returns how many groups)."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    attention.restore()
    n = comm.destroy_groups([parallel_state_sp._SEQUENCE_PARALLEL_GROUP,
                             parallel_state_sp._SEQUENCE_DATA_PARALLEL_GROUP, *_GROUPS])
    _GROUPS.clear()
    parallel_state_sp._release_sequence_parallel_groups()  # DeepSpeed 0.19.8+ (base/versions.py's floor)
    from deepspeed.utils import groups

    groups.mpu = None  # deepspeed.initialize keeps the last mpu in this global: an SP-1 stage after an SP stage
    return n  # asked the released groups for its data-parallel group ("sequence data parallel group is not initialized")


def check_routed(model) -> None:
    """train.py: call once after the first micro-step's forward (attention and linear-attention layers)."""
    attention.check_routed(model)
    linear_attention.check_routed(model)
