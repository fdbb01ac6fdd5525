"""config.json rewritten for transformers 4.x readers (vLLM, llama.cpp's converter and other tools pinned < 5) beside
what transformers 5 writes: the RoPE layout (legacy_rope), `torch_dtype` (legacy_dtype) and the field names 5 renamed
(legacy_aliases). transformers 5 reads both, the same values. model_utils/export.py calls them on the config.json it
has just written; their own file: what older readers need of config.json is a concern apart from writing the weights.
"""

from __future__ import annotations

import json


def legacy_rope(path: str) -> None:
    """config.json at `path` also in the RoPE layout of transformers before 5 (rope_theta, rope_scaling; Gemma 3's
    rope_local_base_freq), beside transformers 5's rope_parameters: a loader on 4.x (vLLM and converters pinned to
    it) read no rope_theta (10000) and no scaling from rope_parameters alone, and served a model trained at theta 8e6
    at 10000. transformers 5 reads both, the same values."""
    with open(path) as fh:
        d = json.load(fh)
    text = d.get("text_config") if isinstance(d.get("text_config"), dict) else None
    target = text if text is not None and "rope_parameters" in text else d
    params = target.get("rope_parameters")
    if not isinstance(params, dict) or not params:
        return
    if all(isinstance(v, dict) for v in params.values()):  # per layer type: 4.x reads the global layers' RoPE
        local = params.get("sliding_attention") or {}
        if "rope_theta" in local:
            target["rope_local_base_freq"] = local["rope_theta"]
        params = params.get("full_attention") or next(iter(params.values()))
    if "rope_theta" in params:
        target["rope_theta"] = params["rope_theta"]
    if "partial_rotary_factor" in params:
        target["partial_rotary_factor"] = params["partial_rotary_factor"]
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
    if scaling.get("rope_type") == "longrope":  # 4.x's Phi3Config takes exactly these three (more: it refuses to load)
        scaling = {"type": "longrope", "short_factor": scaling["short_factor"], "long_factor": scaling["long_factor"]}
    target["rope_scaling"] = scaling if scaling.get("rope_type", scaling.get("type", "default")) != "default" else None
    with open(path, "w") as fh:
        json.dump(d, fh, indent=2, sort_keys=True)


def legacy_dtype(path: str) -> None:
    """config.json at `path` also with `torch_dtype` beside transformers 5's `dtype` (top level and text config):
    transformers before 4.56 reads only torch_dtype, and loaded a bf16 export as fp32 (twice the memory)."""
    with open(path) as fh:
        d = json.load(fh)
    for c in (d, d.get("text_config")):
        if isinstance(c, dict) and c.get("dtype"):
            c["torch_dtype"] = c["dtype"]
    with open(path, "w") as fh:
        json.dump(d, fh, indent=2, sort_keys=True)


def legacy_aliases(path: str, config) -> None:
    """config.json at `path` also with the names transformers 4.x reads where 5 renamed a field (each config class's
    attribute_map, old -> new, in every sub-config; an old one set is kept): 5 writes the new one only (Qwen3-MoE's
    num_local_experts, num_experts null), and 4.x (vLLM) read 128 experts and failed to load any other count."""
    with open(path) as fh:
        d = json.load(fh)

    def walk(c, raw: dict) -> None:
        for old, new in (getattr(type(c), "attribute_map", None) or {}).items():
            if raw.get(old) is None and raw.get(new) is not None:
                raw[old] = raw[new]
        for key, sub in raw.items():
            if isinstance(sub, dict) and hasattr(getattr(c, key, None), "attribute_map"):
                walk(getattr(c, key), sub)

    walk(config, d)
    with open(path, "w") as fh:
        json.dump(d, fh, indent=2, sort_keys=True)
