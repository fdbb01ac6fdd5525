"""Loading the Hugging Face causal LM partitioned under ZeRO-3.

`load_hf_config` is cheap (no weights) so the layout can be checked before any heavy work;
`build_model` then materialises the weights already partitioned (`deepspeed.zero.Init` through
transformers' `HfDeepSpeedConfig`).
"""

from __future__ import annotations

import json
import os
import re

import torch

from base.log import cause
from model_utils.hub import resolve
from planner.presets import PRESETS


def resolve_model(name_or_path: str, weights: bool = True) -> str:
    """The folder (or preset name) a --model_name_or_path reads: a hub id becomes its snapshot in the local Hugging
    Face cache (model_utils/hub.py), offline; one-line ValueError naming the download command when it is not there."""
    return resolve(name_or_path, PRESETS, weights=weights)


def load_hf_config(name_or_path: str, allow_quantized: bool = False):
    """The model's config, no weight read; one-line ValueError for a folder that cannot be trained as it is: no
    config.json (a PEFT adapter: merge it first), custom code (auto_map of a type this transformers lacks: never
    run), or quantized weights (`check_not_quantized`; `allow_quantized`: scripts/dequantize.py, which reads them)."""
    from transformers import AutoConfig

    given, name_or_path = name_or_path, resolve_model(name_or_path, weights=False)
    if os.path.isdir(name_or_path):
        if not os.path.isfile(os.path.join(name_or_path, "config.json")):
            raise ValueError(_no_config(name_or_path))
        check_custom_code(name_or_path)
        try:  # trust_remote_code off: transformers otherwise asks on stdin, on every rank, for auto_map's code
            config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=False)
        except (OSError, ValueError, KeyError) as e:  # not JSON, no model_type, a type this transformers lacks
            raise ValueError(f"--model_name_or_path {name_or_path}: its config.json does not load ({cause(e, 160)}): "
                             "give a save_pretrained folder of a model this transformers knows") from None
        if not allow_quantized:
            check_not_quantized(given, config)
        return config
    if name_or_path in PRESETS:
        return preset_config(name_or_path)
    raise ValueError(f"--model_name_or_path {name_or_path!r}: not a local folder, a preset "
                     f"({', '.join(sorted(PRESETS))}) nor a Hugging Face hub id (org/name) in the local cache")


def _no_config(folder: str) -> str:
    """The refusal of a model folder without config.json; a PEFT adapter (adapter_config.json) says how to merge it."""
    adapter = os.path.join(folder, "adapter_config.json")
    if not os.path.isfile(adapter):
        return f"--model_name_or_path {folder}: folder has no config.json (expected a save_pretrained folder)"
    try:
        with open(adapter) as fh:
            base = json.load(fh).get("base_model_name_or_path") or "its base model"
    except (OSError, ValueError, AttributeError):
        base = "its base model"
    return (f"--model_name_or_path {folder}: a PEFT adapter (adapter_config.json), not a model: merge it into {base} "
            "first (peft: PeftModel.from_pretrained(base, adapter).merge_and_unload().save_pretrained(DIR), and the "
            "tokenizer's save_pretrained(DIR)) and train from DIR")


def check_custom_code(folder: str) -> None:
    """A config.json whose model_type this transformers lacks and whose code ships with the model (auto_map): refused
    in one line (custom code is never run here). A known model_type with an auto_map loads transformers' own class."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        with open(os.path.join(folder, "config.json")) as fh:
            raw = json.load(fh)
    except (OSError, ValueError):
        return  # AutoConfig's own error says why (load_hf_config)
    mt = raw.get("model_type") if isinstance(raw, dict) else None
    if isinstance(raw, dict) and raw.get("auto_map") and mt not in CONFIG_MAPPING:
        import transformers

        code = raw["auto_map"].get("AutoModelForCausalLM") or raw["auto_map"].get("AutoConfig") \
            if isinstance(raw["auto_map"], dict) else raw["auto_map"]
        raise ValueError(f"--model_name_or_path {folder}: model_type {mt!r} is custom code (config.json auto_map: "
                         f"{code}), which is not run here (trust_remote_code is off) and is not supported under "
                         f"sequence parallelism: use a model type transformers {transformers.__version__} implements "
                         "(docs/models.md lists which train here), e.g. the model's transformers-native release")


# quantized checkpoints scripts/dequantize.py writes a dense bf16 copy of, with transformers' own dequantizing config:
# fine-grained FP8 (Qwen3-*-FP8, DeepSeek-V3/R1) and MXFP4 (gpt-oss as OpenAI ships it: no bf16 release exists)
DEQUANTIZABLE = {"fp8": "FineGrainedFP8Config", "mxfp4": "Mxfp4Config"}


def quant_method(hf_config) -> str | None:
    """The quant_method of the config's (or its text config's) quantization_config; None when it has none."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    for c in (hf_config, text):
        q = getattr(c, "quantization_config", None)
        if q:
            method = q.get("quant_method") if isinstance(q, dict) else getattr(q, "quant_method", None)
            return str(getattr(method, "value", method) or "unknown")
    return None


def check_not_quantized(name: str, hf_config) -> None:
    """Quantized weights are refused in one line before any data or weight is read: a quantized load skips ZeRO-3's
    partitioning (every rank would hold the whole model: gpt-oss-120b ~234 GB in bf16), FP8 layers on H100/H200
    give no weight gradient, MXFP4 kernels are not trainable, bitsandbytes/GPTQ/AWQ crashed at the first stage's
    engine, and the export's config.json kept the quantization block over dense weights."""
    method = quant_method(hf_config)
    if method is None:
        return
    if method in DEQUANTIZABLE:
        raise ValueError(f"--model_name_or_path {name}: quantized weights (quantization_config quant_method {method}) "
                         "are not trained here: write a dense bf16 copy once with `python scripts/dequantize.py "
                         f"--model {name} --output DIR` (the whole model in host memory) and train from DIR")
    raise ValueError(f"--model_name_or_path {name}: quantized weights (quantization_config quant_method {method}) are "
                     "not trained here and cannot be dequantized by scripts/dequantize.py (fp8, mxfp4 only): train "
                     "from the model's unquantized release (its bf16 / fp16 weights)")


TINY_PRESETS = tuple(n for n in PRESETS if n.startswith("tiny-"))  # the demo's and the tests' models, random on purpose
# Below this a model is a demo's or a test's (tiny-llama: 0.8M parameters; the smallest released LMs, GPT-2 and
# SmolLM, have 124M and 135M): trained on the built-in demo corpus without a word (training/startup.check_sources)
TINY_PARAMS = 100_000_000


def is_tiny(name_or_path: str, hf_config) -> bool:
    """A tiny preset, or a model of fewer than TINY_PARAMS parameters (the planner's count; a family it cannot
    read: its embeddings and 12 h^2 per layer)."""
    if name_or_path in PRESETS:
        return name_or_path in TINY_PRESETS
    from planner.shapes import ModelShape

    text = hf_config.get_text_config()
    try:
        n = ModelShape.from_config(text.to_dict()).num_params()
    except (ValueError, KeyError, TypeError):
        h = text.hidden_size
        n = text.vocab_size * h + 12 * h * h * text.num_hidden_layers
    return n < TINY_PARAMS


def weights_source(name_or_path: str) -> str:
    """Where a run's starting weights come from, in words (the dry run's `weights:` line)."""
    if name_or_path in PRESETS:
        return f"random init (preset {name_or_path}: its shape only, no weights are read)"
    folder = resolve_model(name_or_path, weights=False)
    return name_or_path if folder == name_or_path else f"{name_or_path} (the local Hugging Face cache: {folder})"


def pick_attn_implementation(requested: str, planning: bool = False) -> str:
    """The attention backend to run, as far as the config tells: auto is flash_attention_2 on a GPU where flash-attn
    is installed (provisional: training/startup.settle_attention then times it against SDPA on this GPU and keeps the
    faster, model_utils/attention_pick.py), else sdpa. `planning` (dry run) accepts a GPU backend on a machine
    without one."""
    if requested != "auto":
        if requested.startswith("flash_attention") and not torch.cuda.is_available() and not planning:
            raise ValueError(f"--attn_implementation {requested} needs a CUDA GPU: use sdpa on CPU")
        return requested
    if torch.cuda.is_available():
        try:
            import flash_attn  # noqa: F401

            return "flash_attention_2"
        except ImportError:
            pass
    return "sdpa"


def build_model(name_or_path: str, hf_config, ds_config: dict, attn_implementation: str, dtype: torch.dtype,
                pretrained: bool = True):
    """The model, partitioned over the world as it is created. Returns (model, hf_ds_config_handle);
    keep the handle alive: transformers reads ZeRO-3 settings through it.

    `pretrained=False` when a checkpoint will overwrite every weight (a resume, a stage after the first): the
    model is created from its config only. Loading the HF weights there was wasted work: Llama-3-8B is 16 GB
    read from the shared file system and scattered into the partitions at every stage start and every resume,
    minutes on 32 ranks, before the checkpoint replaced all of it."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    handle = HfDeepSpeedConfig(ds_config)
    name_or_path = resolve_model(name_or_path, weights=pretrained)  # a hub id must never build random weights
    if pretrained and os.path.isdir(name_or_path):
        model, info = AutoModelForCausalLM.from_pretrained(name_or_path, config=hf_config, dtype=dtype,
                                                           attn_implementation=attn_implementation,
                                                           output_loading_info=True)
        check_loaded(name_or_path, hf_config, info.get("missing_keys") or ())
    else:
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation=attn_implementation)
    model.config.use_cache = False
    return model, handle


def check_loaded(folder: str, hf_config, missing) -> None:
    """Weights the model needs that the folder's files lack would train from random init, with only transformers'
    load report in the log: refused in one line, the likely cause named. Decided from every rank's list (a collective:
    every rank builds the model at the same point; under ZeRO-3 rank 0 reads the values, the others the keys on the
    meta device, so the lists agree; one small all_gather at each model build). Unexpected keys alone are accepted: a
    checkpoint may carry tensors this class does not use (DeepSeek-V3's / GLM's multi-token-prediction layers)."""
    from base import comm

    mine = sorted(missing)
    got = next((g for g in comm.all_gather_object(mine) if g), None)
    if not got:
        return
    text = hf_config.get_text_config()
    layers = sorted({int(k.split(".layers.")[1].split(".")[0]) for k in got if re.search(r"\.layers\.\d+\.", k)})
    causes = []
    if all(k.startswith("lm_head.") for k in got) and not getattr(text, "tie_word_embeddings", False):
        causes.append("tie_word_embeddings is false but only the input embeddings were saved (a tied model: set it "
                      "true, as saved)")
    if layers and all(".layers." in k for k in got):  # whole layers from some index on, nothing else
        span = f"{layers[0]}" if len(layers) == 1 else f"{layers[0]}..{layers[-1]}"
        causes.append(f"num_hidden_layers {text.num_hidden_layers} is more than the saved layers (layer {span} "
                      "missing)")
    if not causes:
        causes.append("the files name the tensors otherwise, e.g. with a prefix such as _orig_mod. (torch.compile) "
                      "or module. (DDP): save the unwrapped model with save_pretrained")
    raise ValueError(f"--model_name_or_path {folder}: {len(got)} weight(s) the model needs are not in its files "
                     f"({', '.join(got[:3])}{' ...' if len(got) > 3 else ''}) and would train from random init; "
                     f"likely {'; or '.join(causes)}")


def preset_config(name: str, **overrides):
    """A `transformers` config for preset `name` (fields in `overrides` win)."""
    from transformers import AutoConfig

    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}: use a local HF folder or one of {sorted(PRESETS)}")
    fields = {**PRESETS[name], **overrides}
    model_type = fields.pop("model_type")
    theta = fields.pop("rope_theta")
    fields["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    return AutoConfig.for_model(model_type, **fields)
