"""Which architectures the sequence-parallel, document-masked attention path takes, decided from the config at
start-up (train.py's `training.startup`, scripts/evaluate.py) so that a refusal is one line before any weight is
read: the attention backends (attention.SUPPORTED), the layer types, the 2026 families (gated delta-net hybrids run
by model_utils/linear_attention.py, latent attention padded by ulysses.py, learned sinks in sinks.py), and the
architectures tests/multiproc/test_model_sweep.py found Ulysses cannot split as transformers writes them.
"""

from __future__ import annotations

from model_utils.attention import LAYER_TYPES, SUPPORTED
from model_utils.sinks import SINKS_COVERED, has_sinks
from planner.moe_keys import OTHER_MLP_NAME, expert_count, tiled_mlp_refusal
from planner.shapes import head_chunks_refusal

# gated delta-net hybrids whose "linear_attention" layers model_utils/linear_attention.py runs under Ulysses by heads
# (defined here, imported there: attention.py never imports linear_attention.py, so the two form no cycle)
LINEAR_MODEL_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
_SHAPE_FIELDS = ("head_dim", "num_attention_heads", "num_key_value_heads", "qk_head_dim", "v_head_dim")
# architectures whose attention Ulysses cannot split as transformers writes it (found by tests/multiproc/
# test_model_sweep.py, which crashed in the first SP step for each): refused at start-up with the reason
SP_UNSUPPORTED = {
    "jetmoe": "mixture-of-attention heads (keys repeated per routed expert) do not match num_key_value_heads",
    "diffllama": "differential attention pairs heads (its outputs are 2 x head_dim), Ulysses assumes one head dim",
    "ctrl": "its attention receives no position_ids (Ulysses and document masking need them)",
    "moshi": "its attention receives no position_ids (Ulysses and document masking need them)",
    "persimmon": "its attention receives no position_ids (Ulysses and document masking need them)",
    "doge": "its attention does not call transformers' ALL_ATTENTION_FUNCTIONS (check_routed found 0 of 2 layers)",
    # GPTBigCodeBlock calls its attention without position_ids: DeepSpeed's Ulysses asserts "requires position_ids"
    # in the first SP step (StarCoder 1, SantaCoder, Granite-20B/34B-Code)
    "gpt_bigcode": "its attention receives no position_ids (Ulysses and document masking need them)",
    "youtu": "loading under ZeRO-3 crashes: its _init_weights indexes the embedding's padding row, which ZeRO-3 has "
             "partitioned (IndexError before the first step)",
}

# the class attribute by which transformers says an architecture has an attention backend
_BACKEND_FLAG = {"sdpa": "_supports_sdpa", "flex_attention": "_supports_flex_attn",
                 "flash_attention_2": "_supports_flash_attn", "flash_attention_3": "_supports_flash_attn"}


def drop_router_logits(hf_config) -> bool:
    """Turn an MoE config's `output_router_logits` off (config and text config); True where it was on. The router's
    load-balancing loss is not trained here (the tiled loss uses the logits only, and a true changed nothing in what
    trained), and the router logits cost memory: every layer's [tokens, experts], ~7.8 GB a rank for Hy3 at 1M
    tokens, SP 8. Some configs ship it on (tencent/Hy3; TRL / Axolotl MoE fine-tunes save theirs): said, not refused."""
    cfgs = {id(c): c for c in (hf_config, hf_config.get_text_config() if hasattr(hf_config, "get_text_config")
                               else hf_config)}.values()
    on = any(getattr(c, "output_router_logits", False) for c in cfgs)
    for c in cfgs:
        if getattr(c, "output_router_logits", False):
            c.output_router_logits = False
    return on


def moe_type(hf_config) -> str:
    """The model_type of a mixture-of-experts config (its text config's: planner.moe_keys.expert_count > 0); "" for a
    dense one."""
    cfg = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    return str(getattr(cfg, "model_type", "") or "moe") if expert_count(cfg.to_dict()) else ""


def router_note(hf_config, asked: bool) -> str:
    """The start-up's one line for an MoE ("" for a dense model), said on every MoE start, not only where the config
    asked for output_router_logits (`asked`, which drop_router_logits turned off): TRL's MoE fine-tunes default
    router_aux_loss_coef 0.001, and a user expecting that balancing loss gets none here."""
    kind = moe_type(hf_config)
    if not kind:
        return ""
    return (f"note: {kind} is a mixture of experts: the router's load-balancing (aux) loss is not trained here (the loss "
            "is the logits' cross-entropy; router_aux_loss_coef is unused, and the router logits would cost every "
            "layer's [tokens, experts] of memory)" + ("; the config asks for output_router_logits: turned off" if asked
                                                      else ""))


def check_tiled_mlp(hf_config, on: bool, where: str) -> None:
    """Refuse tiled_mlp on an MoE model (or LFM2: OTHER_MLP_NAME) in one line, before any engine (the dry run alike): model_utils/memory.py tiles
    gated gate/up/down_proj MLPs only, and refused the expert block when the stage's engine was built, after the
    earlier stages had trained (gpt-oss's 128k stage: 1908 steps), and again at every restart."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    own = getattr(text, "model_type", "")
    kind = (moe_type(hf_config) or (own if own in OTHER_MLP_NAME else "")) if on else ""
    if kind:
        raise ValueError(f"{where}: tiled_mlp: {tiled_mlp_refusal(kind)}; drop tiled_mlp (--tiled_mlp, the stage's "
                         "memory_features)")


def check_config(hf_config, attn: str, head_chunks: int | str = 1) -> None:
    """`check_supported` from the config alone, plus whether transformers has `attn` for this architecture
    (Gemma-2 has no sdpa path): train.py calls it before any heavy work, so a refusal is one line."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(hf_config), None)
    if cls is not None and attn in SUPPORTED and not getattr(cls, _BACKEND_FLAG[attn], False):
        others = [a for a in SUPPORTED if a != attn and getattr(cls, _BACKEND_FLAG[a], False)
                  and not (a.startswith("flash_attention") and has_sinks(hf_config))]  # refused below for sinks
        raise ValueError(f"{cls.__name__}: transformers has no {attn} attention for this architecture; use "
                         f"--attn_implementation {' or '.join(others) or 'eager (not sequence-parallel here)'}")
    check_supported(hf_config, attn, cls.__name__ if cls is not None else type(hf_config).__name__, head_chunks)


def latent_dims(config) -> tuple[int, int] | None:
    """(q/k head dim, v head dim) of latent attention (MLA: DeepSeek-V2/V3, GLM-4.7-Flash, where `head_dim` is the
    RoPE part's), None where q, k and v all have `head_dim` (DeepSpeed's Ulysses assumes that one head dim; ulysses.py
    wraps latent attention itself, v padded to the q/k head dim)."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    qk, v, hd = (getattr(cfg, k, None) for k in ("qk_head_dim", "v_head_dim", "head_dim"))
    if not qk and getattr(cfg, "qk_rope_head_dim", None):
        qk = (getattr(cfg, "qk_nope_head_dim", 0) or 0) + cfg.qk_rope_head_dim
    qk, v = qk or hd, v or hd
    return (int(qk), int(v)) if qk and v and {qk, v} != {hd} else None


def check_supported(model_or_config, attn: str, name: str | None = None, head_chunks: int | str = 1) -> None:
    """One-line refusals, at start-up, of models whose attention cannot be document-masked here, or not in
    `head_chunks` chunks of heads ("auto": the planner's choice, which never chunks these)."""
    config = getattr(model_or_config, "config", model_or_config)
    cfg = config.get_text_config()
    name = name or type(model_or_config).__name__
    if attn not in SUPPORTED:
        raise ValueError(f"{name}: attention {attn!r} cannot be document-masked; use one of {', '.join(SUPPORTED)}")
    linear = ("linear_attention",) if cfg.model_type in LINEAR_MODEL_TYPES else ()  # Ulysses by heads there
    if any(getattr(c, "use_bidirectional_attention", None) in (True, "all") or getattr(c, "is_causal", True) is False
           for c in (config, cfg)):  # Gemma / Gemma-3 / EmbeddingGemma's encoder mode; "vision" (Gemma-4) is causal on text
        raise ValueError(f"{name} ({cfg.model_type}): bidirectional attention (use_bidirectional_attention / is_causal "
                         "false) is not supported: documents are masked causally here; use a causal (decoder) config")
    bad = sorted(set(getattr(cfg, "layer_types", None) or []) - set(LAYER_TYPES) - set(linear))
    if bad:
        raise ValueError(f"{name}: layer types {bad} are not supported (only {' / '.join(LAYER_TYPES)} layers are "
                         "sequence-parallel and document-masked): use a model without them")
    if getattr(cfg, "final_logit_softcapping", None):
        raise ValueError(f"{name}: final_logit_softcapping={cfg.final_logit_softcapping} is not supported: the tiled "
                         "LM head / loss (always used by evaluation) computes the logits without it")
    if getattr(cfg, "attention_chunk_size", None):
        raise ValueError(f"{name}: chunked attention (attention_chunk_size={cfg.attention_chunk_size}) is not "
                         "supported: use a model with full or sliding-window attention")
    if cfg.model_type in SP_UNSUPPORTED:
        raise ValueError(f"{name} ({cfg.model_type}) is not supported under sequence parallelism: "
                         f"{SP_UNSUPPORTED[cfg.model_type]}")
    if not hasattr(cfg, "num_key_value_heads"):  # OPT, Falcon, BioGPT...: the layout checks read it (AttributeError)
        raise ValueError(f"{name} ({cfg.model_type}): the config has no num_key_value_heads, which the sequence-parallel "
                         "layout reads: not supported under sequence parallelism yet")
    per_layer = sorted(set(getattr(cfg, "per_layer_attributes", None) or ()) & set(_SHAPE_FIELDS))
    if per_layer:  # a heterogeneous config (Gemma-4 unified: head_dim per layer); reading them globally raises
        raise ValueError(f"{name} ({cfg.model_type}): per-layer {', '.join(per_layer)} is not supported under sequence "
                         "parallelism yet: Ulysses is set up with one attention shape for every layer")
    dims = latent_dims(cfg)
    if dims is not None and dims[1] > dims[0]:  # ulysses.py pads v up to the q/k head dim, never down
        raise ValueError(f"{name} ({cfg.model_type}): latent attention with a v head dim ({dims[1]}) above the q/k head "
                         f"dim ({dims[0]}) is not supported under sequence parallelism")
    if has_sinks(model_or_config) and cfg.model_type not in SINKS_COVERED:
        raise ValueError(f"{name} ({cfg.model_type}): learned attention sinks are not supported under sequence "
                         f"parallelism for this architecture yet (only {', '.join(SINKS_COVERED)}): its attention was "
                         "not checked against the plain model")
    if has_sinks(model_or_config) and attn.startswith("flash_attention"):
        raise ValueError(f"{name} ({cfg.model_type}): learned attention sinks with {attn}: the flash-attn 2/3 kernels "
                         "transformers calls drop the sinks (a wrong loss); use --attn_implementation flex_attention")
    n = 1 if head_chunks in ("auto", None, 0) else int(head_chunks)
    if n > 1 and dims is not None:
        raise ValueError(f"attention_head_chunks {n}: latent attention (MLA, {cfg.model_type}) has no per-head q/k/v "
                         "projections to chunk; use attention_head_chunks 1")
    if n > 1 and has_sinks(model_or_config):
        raise ValueError(f"attention_head_chunks {n}: {cfg.model_type}'s learned attention sinks are not split by head "
                         "chunks; use attention_head_chunks 1")
    why = head_chunks_refusal(cfg) if n > 1 else ""
    if why:  # OLMo-2/3's q/k norms over all heads, Phi-3's fused qkv_proj, ...: the first chunked forward crashed
        raise ValueError(f"attention_head_chunks {n}: {name} ({cfg.model_type}) {why}; use attention_head_chunks 1 "
                         "(or auto)")
