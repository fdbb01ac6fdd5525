"""Mixture-of-experts config keys as transformers' families name them, read into ModelShape's fields
(planner/shapes.py), and which models the tiled MLP cannot run (an expert block; LFM2's `feed_forward`). Split out
of planner/shapes.py. Torch-free."""

from __future__ import annotations

from collections.abc import Iterable, Mapping


def or_default(value, default: int) -> int:
    return default if value is None else int(value)


# Mixture-of-experts config keys as transformers 5.23's families name them (read against each modeling file): the
# routed experts, how many a token is routed to (ERNIE-4.5: moe_num_experts, moe_k; Hunyuan: moe_topk, an int or one
# per layer), the always-active (shared) experts, each moe_intermediate_size wide (DeepSeek, GLM, ERNIE)
EXPERT_KEYS = ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts")
TOP_K_KEYS = ("num_experts_per_tok", "moe_k", "moe_topk", "num_experts_per_token", "top_k_experts")  # Kimi-Linear
# and Bailing: num_experts_per_token; Gemma-4 MoE: top_k_experts
SHARED_KEYS = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")
# one shared MLP of its own width: Qwen2-MoE / Qwen1.5-MoE / Qwen3-Next (gated by a [h, 1] projection, not counted:
# h parameters a layer), GraniteMoeShared
SHARED_WIDTH_KEYS = ("shared_expert_intermediate_size", "shared_intermediate_size")


def expert_count(cfg: Mapping) -> int:
    """Routed experts of a config dict (0: a dense model): what makes it an MoE here (planner, start-up alike). A
    config that says it is dense (`is_moe: false`: Doge; `enable_moe_block: false`: Gemma-4) is, whatever expert
    count its class defaults to."""
    if cfg.get("is_moe") is False or cfg.get("enable_moe_block") is False:
        return 0
    return _first(cfg, EXPERT_KEYS)


def _first(cfg: Mapping, keys: Iterable[str]) -> int:
    """The first of `keys` the config sets (a list, one value per layer: its largest, the safe side); 0: none."""
    for k in keys:
        v = cfg.get(k)
        v = max(v) if isinstance(v, (list, tuple)) and v else v
        if v:
            return int(v)
    return 0


def moe_fields(cfg: Mapping) -> dict:
    """ModelShape's mixture-of-experts fields of a config dict ({} for a dense model), as transformers builds the
    family: which keys name the experts, the top-k and the shared experts (above), and which layers are MoE: ERNIE-4.5
    every moe_layer_interval-th from moe_layer_start_index to moe_layer_end_index, Qwen-MoE every decoder_sparse_step-th
    not in mlp_only_layers, DeepSeek / GLM / AFMoE / LFM2 after the first first_k_dense_replace / num_dense_layers.
    Hunyuan-A13B's experts and its one shared MLP are intermediate_size wide (transformers reads neither its
    moe_intermediate_size nor num_shared_expert). An MoE config that names no top-k: a one-line ValueError (how many
    experts a token multiplies by is the MoE's FLOPs and activations; a guess would plan them wrong)."""
    experts = expert_count(cfg)
    if not experts:
        return {}
    kind, n, inter = str(cfg.get("model_type", "")), int(cfg["num_hidden_layers"]), int(cfg["intermediate_size"])
    top_k = _first(cfg, TOP_K_KEYS)
    if not top_k:
        raise ValueError(f"model config ({kind or 'no model_type'}) has {experts} experts and no top-k "
                         f"({' / '.join(TOP_K_KEYS)}): set num_experts_per_tok in its config.json to plan it")
    width = _first(cfg, ("moe_intermediate_size",)) or inter
    shared = _first(cfg, SHARED_KEYS)
    shared_width = _first(cfg, SHARED_WIDTH_KEYS)
    if kind == "hunyuan_v1_moe":
        width, shared, shared_width = inter, 1, inter
    elif shared_width:
        shared = 1
    if "moe_layer_start_index" in cfg or kind.startswith("ernie4_5"):  # (transformers' defaults: 1, -1 the last, 1)
        start, end = or_default(cfg.get("moe_layer_start_index"), 1), or_default(cfg.get("moe_layer_end_index"), -1)
        every, end = or_default(cfg.get("moe_layer_interval"), 1), n - 1 if end == -1 else end
        moe = sum((i + 1) % every == 0 and start <= i <= end for i in range(n))
    elif "decoder_sparse_step" in cfg or "mlp_only_layers" in cfg:
        every, dense = or_default(cfg.get("decoder_sparse_step"), 1), set(cfg.get("mlp_only_layers") or ())
        moe = sum(i not in dense and (i + 1) % every == 0 for i in range(n))
    else:
        moe = n - min(n, _first(cfg, ("first_k_dense_replace", "num_dense_layers")))
    return dict(num_experts=experts, experts_per_token=top_k, shared_experts=shared, moe_intermediate_size=width,
                shared_intermediate_size=shared_width, dense_layers=n - moe)


# dense families whose decoder layers keep their MLP under another name than `mlp`, which the tiled MLP
# (model_utils/memory.py) and its engagement count read: LFM2's `feed_forward`
OTHER_MLP_NAME = ("lfm2", "lfm3")


def tiled_mlp_refusal(model_type: str) -> str:
    """Why --tiled_mlp cannot run a model: an MoE's decoder MLP is an expert block; LFM2's is not `mlp`."""
    if model_type in OTHER_MLP_NAME:
        return f"{model_type}'s decoder layers keep their MLP as feed_forward, which the tiled MLP does not reach"
    return (f"{model_type or 'this model'}'s MLP is a mixture-of-experts block (routed experts), which the tiled MLP "
            "(model_utils/memory.py) cannot run")
