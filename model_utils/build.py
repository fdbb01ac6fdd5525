"""Loading the Hugging Face causal LM partitioned under ZeRO-3.

`load_hf_config` is cheap (no weights) so the layout can be checked before any heavy work;
`build_model` then materialises the weights already partitioned (`deepspeed.zero.Init` through
transformers' `HfDeepSpeedConfig`).
"""

from __future__ import annotations

import os

import torch

from base.log import cause
from model_utils.hub import resolve
from planner.presets import PRESETS


def resolve_model(name_or_path: str, weights: bool = True) -> str:
    """The folder (or preset name) a --model_name_or_path reads: a hub id becomes its snapshot in the local Hugging
    Face cache (model_utils/hub.py), offline; one-line ValueError naming the download command when it is not there."""
    return resolve(name_or_path, PRESETS, weights=weights)


def load_hf_config(name_or_path: str):
    from transformers import AutoConfig

    name_or_path = resolve_model(name_or_path, weights=False)
    if os.path.isdir(name_or_path):
        if not os.path.isfile(os.path.join(name_or_path, "config.json")):
            raise ValueError(f"--model_name_or_path {name_or_path}: folder has no config.json "
                             "(expected a save_pretrained folder)")
        try:
            return AutoConfig.from_pretrained(name_or_path)
        except (OSError, ValueError, KeyError) as e:  # not JSON, no model_type, a type this transformers lacks
            raise ValueError(f"--model_name_or_path {name_or_path}: its config.json does not load ({cause(e, 160)}): "
                             "give a save_pretrained folder of a model this transformers knows") from None
    if name_or_path in PRESETS:
        return preset_config(name_or_path)
    raise ValueError(f"--model_name_or_path {name_or_path!r}: not a local folder, a preset "
                     f"({', '.join(sorted(PRESETS))}) nor a Hugging Face hub id (org/name) in the local cache")


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
        model = AutoModelForCausalLM.from_pretrained(name_or_path, config=hf_config, dtype=dtype,
                                                     attn_implementation=attn_implementation)
    else:
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation=attn_implementation)
    model.config.use_cache = False
    return model, handle


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
