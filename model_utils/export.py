"""Export a committed checkpoint to a Hugging Face folder (config.json + sharded safetensors).

The fp32 master weights are consolidated from the ZeRO-3 shards on disk (DeepSpeed's zero_to_fp32) and
written to safetensors with the model built on the meta device only (no weights: hub_layout), so this runs in one
process without a process group and without a second copy of the weights:

    python scripts/export_hf.py checkpoints/RUN            # newest valid checkpoint -> checkpoints/RUN/hf_model

What a user loads afterwards is what they would generate with: `use_cache` on (training turns the KV cache off in
the model's config; an export carrying that off made `generate()` recompute the whole prompt per token: 23 s
against 3 s for 40 new tokens after a 2,000-token prompt on the demo's export, an audit measured), and the base
model's `generation_config.json` (an Instruct model's list of end-of-turn ids, its sampling defaults) copied from
the folder the run started from, where it has one; its `output_router_logits` too (training turns it off:
model_utils/families.drop_router_logits). The run's tokenizer too, as transformers 4.x reads it as well as 5
(export_tokenizer, legacy_tokenizer: vLLM and llama.cpp's converter pin < 5); a recorded tokenizer or base model that
is gone is refused (check_recorded), not silently left out.

The weights are written in the layout transformers' save_pretrained writes for the model loaded from the base folder
(hub_layout): transformers 5 fuses an MoE's experts in memory (Qwen3-MoE's `mlp.experts.gate_up_proj`, one 3-D
tensor) and reverts that on save (`mlp.experts.N.gate_proj.weight` ...), Gemma 3's vision tower back under the base's
`vision_tower.vision_model.`: the base's names, which transformers 4.x, vLLM's loaders and converters read. config.json
also has the names 4.x reads where 5 renamed a field (export_config.legacy_aliases: Qwen3-MoE's num_experts).
They are written in the run's training precision by default (`dtype="auto"`: bf16 for a bf16 run, as save_pretrained
of a bf16 model writes; half the fp32 size, 16 GB for 8B) or as asked (fp32 keeps the master weights exactly), and
config.json says so in `dtype` and in `torch_dtype` (what transformers before 4.56 reads). What the model class keeps
in fp32 in a bf16 / fp16 model (its `_keep_in_fp32_modules_strict`: an MoE router's `e_score_correction_bias`) stays
fp32, as save_pretrained writes it (kept_in_fp32).

The folder written is replaced whole (a new one built beside it, then swapped in); which existing folder it may replace
(the run's own or a previous export, which holds MARKER; a link's target likewise) is model_utils/export_target.py
`check_out`, asked before any work.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from contextlib import contextmanager

from base.atomic import fsync_path, named
from model_utils.export_config import legacy_aliases, legacy_dtype, legacy_rope
from model_utils.export_target import MARKER, check_out
from model_utils.export_tokenizer import _json, check_recorded, export_tokenizer, recorded_or_none  # noqa: F401

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # --dtype (besides auto) -> torch's name


def base_file(source: str | None, name: str) -> str | None:
    """The file `name` of the folder the run started from (its --model_name_or_path: a folder, or a hub id in the
    local cache); None where there is none (a preset, a folder without it, a model no longer there)."""
    if not source:
        return None
    from model_utils.build import resolve_model

    try:
        path = os.path.join(resolve_model(source, weights=False), name)
    except ValueError:
        return None
    return path if os.path.isfile(path) else None


def generation_config(source: str | None) -> str | None:
    """The base model's generation_config.json (base_file)."""
    return base_file(source, "generation_config.json")


def add_stops(path: str, config, stops: list[int]) -> list[int]:
    """Add `stops` to the eos_token_id of the generation config at `path` (written from `config`'s ids where there is
    none); returns the ids added."""
    if not stops:
        return []
    if os.path.isfile(path):
        with open(path) as fh:
            gen = json.load(fh)
    else:  # a composite config (Gemma 3, Mistral 3) keeps them on its text config
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        gen = {"bos_token_id": getattr(text, "bos_token_id", None), "eos_token_id": getattr(text, "eos_token_id", None)}
    have = gen.get("eos_token_id")
    have = [] if have is None else [have] if isinstance(have, int) else list(have)
    added = [s for s in stops if s not in have]
    if added:
        gen["eos_token_id"] = have + added
        with open(path, "w") as fh:
            json.dump(gen, fh, indent=2)
    return added


def base_config(source: str | None) -> dict:
    """The raw config.json of the folder the run started from (base_file); {} where there is none."""
    path = base_file(source, "config.json")
    return _json(path) if path else {}


def restore_router_logits(config, base: dict) -> None:
    """`output_router_logits` back on (config and text config) where the base's config.json had it on: training
    turns it off (model_utils/families.drop_router_logits: the load-balancing loss is not trained here), and an
    export carrying that off changed what a user fine-tuning it further trains."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    base_text = base.get("text_config") if isinstance(base.get("text_config"), dict) else base
    for c, raw in ((config, base), (text, base_text)):
        if raw.get("output_router_logits") is True and hasattr(c, "output_router_logits"):
            c.output_router_logits = True


def trained_in(checkpoint: str) -> str | None:
    """torch's name of the precision the run trained in, from the DeepSpeed config its engine saved in the
    checkpoint (rank 0's model-states file: small under ZeRO-3, the weights are in the optimizer states); None where
    it has none. Not hf_config.json's dtype: a run's first stage loads the base with from_pretrained, which copies
    the config, so that records the base's dtype (a bf16 base trained in fp32 on CPU said bfloat16)."""
    import glob

    import torch

    files = sorted(glob.glob(os.path.join(checkpoint, "*_model_states.pt")))
    if not files:
        return None
    ds = torch.load(files[0], map_location="cpu", weights_only=False).get("ds_config") or {}
    half = [name for key, name in (("bf16", "bfloat16"), ("bfloat16", "bfloat16"), ("fp16", "float16")) if (ds.get(key) or {}).get("enabled")]
    return half[0] if half else "float32"


def export_dtype(config, dtype: str, checkpoint: str | None = None) -> str:
    """torch's name of the dtype to write: `dtype` (bf16, fp16, fp32) or, for auto, the run's training precision
    (trained_in; where the checkpoint does not say, hf_config.json's dtype)."""
    if dtype != "auto" and dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype}: not one of auto, {', '.join(DTYPES)}")
    if dtype != "auto":
        return DTYPES[dtype]
    ran = (checkpoint and trained_in(checkpoint)) or str(getattr(config, "dtype", None) or "").removeprefix("torch.")
    return ran if ran in ("bfloat16", "float16") else "float32"


def meta_model(config):
    """The model class model_utils/build.py trains, built from `config` on the meta device (no weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def kept_in_fp32(model, dtype: str) -> re.Pattern | None:
    """The parameters (a pattern searched in each in-memory name) a `dtype` export keeps in fp32, as transformers
    keeps them in a model loaded in that dtype, which its save_pretrained then writes: the class's
    `_keep_in_fp32_modules_strict` in bf16 and fp16 (GLM-4.5's and DeepSeek-V3's router `e_score_correction_bias`,
    which picks the experts: bf16 rounds 1.0 + 0.01 x noise to steps of 2^-7), its `_keep_in_fp32_modules` in fp16
    only (gpt-oss's norms); their globs as transformers matches them (`*` any text, searched). None where none."""
    names = set()
    if dtype in ("bfloat16", "float16"):
        names |= set(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    if dtype == "float16":
        names |= set(getattr(model, "_keep_in_fp32_modules", None) or ())
    return re.compile("|".join(n.replace("*", ".*") for n in sorted(names))) if names else None


def hub_layout(config, state: dict, model=None, base: list[str] | None = None) -> dict:
    """`state` (the parameters as transformers 5 holds them in memory) in the layout its save_pretrained writes:
    transformers' own revert_weight_conversion, on the model built on the meta device (no weights) from `config` (the
    conversions are looked up by its class and model type; `model`: that one, built already). `base`: the tensor names
    of the folder the run started from (base_keys): what from_pretrained converts loading them is reverted, as
    save_pretrained of a model loaded from it does (without: a multimodal Gemma 3's `vision_tower.embeddings.`, where
    4.x / vLLM read `vision_tower.vision_model.`: a random vision tower). A family without conversions (the dense
    ones) is returned as given, same keys, same order, same tensors. Cost at scale: the experts
    split off a fused tensor are copies (safetensors saves no part of a storage), so it runs one layer at a time,
    popping that layer's tensors from `state`: the extra memory is one layer's experts (Qwen3-30B-A3B: 128 x 3 x 768 x
    2048 x 4 B = 2.4 GB fp32, half that in bf16), not a second copy of the model; the export runs on one rank only."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers before 5: what it holds in memory is what it saves
        return state
    model = model if model is not None else meta_model(config)
    if base and not as_loaded(model, base):
        return state  # its names are the ones held in memory
    order = list(state)
    layers: dict[str, list[str]] = {}
    for k in order:  # no conversion spans layers (experts are merged within one)
        m = re.match(r"(.*?\.layers\.\d+)\.", k)
        layers.setdefault(m.group(1) if m else "", []).append(k)
    out: dict = {}
    for keys in layers.values():
        for k, v in revert_weight_conversion(model, {k: state.pop(k) for k in keys}).items():
            # an expert split off a fused tensor is a view of it: safetensors refuses to save part of a storage
            out[k] = v if v.untyped_storage().nbytes() == v.numel() * v.element_size() else v.clone()
    return {k: out[k] for k in order} if set(out) == set(order) else out


def as_loaded(model, keys: list[str]) -> list:
    """The weight conversions from_pretrained applies loading tensors named `keys` into `model`, kept on it as it keeps
    them (`_weight_conversions`, which revert_weight_conversion undoes). Cost: thousands of names x tens of patterns."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    mapping, meta = get_model_conversion_mapping(model), model.state_dict()
    renames = [c for c in mapping if isinstance(c, WeightRenaming)]
    converters = [c for c in mapping if isinstance(c, WeightConverter)]
    for k in keys:
        rename_source_key(k, renames, converters, model.base_model_prefix, meta)
    model._weight_conversions = [c for c in mapping if c.was_used()]
    return model._weight_conversions


def base_keys(source: str | None) -> list[str] | None:
    """The tensor names of the base folder's safetensors (its index's weight_map, else its one file's header: no
    weights read); None where it has none."""
    if index := base_file(source, "model.safetensors.index.json"):
        return list(_json(index).get("weight_map") or {}) or None
    if one := base_file(source, "model.safetensors"):
        from safetensors import safe_open

        with safe_open(one, "pt") as fh:
            return list(fh.keys())
    return None


def trained_length(checkpoint: str) -> int:
    """The sequence length the checkpoint's stage trained at (its trainer.json: the stage's max_seq_length, else the
    run's; lengths never decrease over stages); 0 where it does not say."""
    got = _json(os.path.join(checkpoint, "trainer.json"))
    cfg = got.get("config") if isinstance(got.get("config"), dict) else {}
    at = got.get("stage") if isinstance(got.get("stage"), int) else 0
    stages = [s if isinstance(s, dict) else {} for s in cfg.get("stages") or [{}]][: at + 1] or [{}]
    return max(int(s.get("max_seq_length") or cfg.get("max_seq_length") or 0) for s in stages)


def trained_bos(checkpoint: str) -> bool | None:
    """Whether the run put a BOS before each text (its trainer.json `bos_id`: data/tokenizer.Tokenizer.bos_id, an id
    or null), the exported add_bos_token (export_tokenizer); None where it does not say (a checkpoint from before it
    was recorded, a run without a tokenizer)."""
    got = _json(os.path.join(checkpoint, "trainer.json"))
    if "bos_id" not in got or not (got["bos_id"] is None or isinstance(got["bos_id"], int)):
        return None
    return got["bos_id"] is not None


def sentencepiece_ids(path: str) -> tuple[int | None, int | None, int | None]:
    """(bos, eos, pad) of a sentencepiece model file, None where it has none: what the run's documents were ended
    with (data/tokenizer.py), so what generation must stop on (the preset's 1 / 2 named <unk> / <s> in the demo's)."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=path)
    return tuple(i if i >= 0 else None for i in (sp.bos_id(), sp.eos_id(), sp.pad_id()))


CARD = "README.md"  # the export's model card (model_card)


def base_named(source: str | None) -> tuple[str | None, str]:
    """(the base model's hub id or None, how the card names it) for a run's --model_name_or_path: a hub id (a local
    hub cache snapshot's too), a preset (random init), a local folder by its name only (no local path)."""
    from model_utils.hub import looks_like_hub_id
    from planner.presets import PRESETS

    if not source:
        return None, "none recorded"
    if source in PRESETS:
        return None, f"none: random init with the shape of the preset `{source}`"
    if m := re.search(r"models--(.+?)/snapshots/", os.path.abspath(source)):
        source = m.group(1).replace("--", "/")
    if looks_like_hub_id(source) or m:
        return source, f"`{source}`"
    return None, f"a local folder named `{os.path.basename(os.path.abspath(source.rstrip(os.sep)))}`"


def model_card(checkpoint: str, source: str | None, config, dtype: str, tokenizer: bool, template: bool) -> str:
    """The export's README.md: front matter (`base_model` where it is a hub id, `library_name`), the base model, each
    stage trained up to `checkpoint` with its length, steps and RoPE (training/curriculum.py's rule: a stage without
    `rope` keeps the one before; the first, the run's, else the model's own; `{}` the model's own), the dtype and the
    tokenizer. No local path (export.json records those). The base's own card is not copied: its licence is named."""
    t = _json(os.path.join(checkpoint, "trainer.json"))
    cfg = t.get("config") if isinstance(t.get("config"), dict) else {}
    at, step, names = t.get("stage") if isinstance(t.get("stage"), int) else 0, t.get("step"), t.get("stage_names") or []
    steps = [n if isinstance(n, int) else None for n in t.get("stage_steps") or []]
    hub, named = base_named(source)
    rope, rows = cfg.get("rope") or None, []
    for i, s in enumerate([s if isinstance(s, dict) else {} for s in cfg.get("stages") or [{}]][: at + 1]):
        rope = (s["rope"] or None) if s.get("rope") is not None else rope
        n = steps[i] if i < len(steps) else None
        if i == at and isinstance(step, int) and None not in steps[:at]:
            n = step - sum(steps[:at])  # the stage this checkpoint is in: its steps so far
        how = f"`{json.dumps(rope)}`" if rope else "the base model's"
        rows.append(f"| {i} | {names[i] if i < len(names) else s.get('name') or 'main'} | "
                    f"{s.get('max_seq_length') or cfg.get('max_seq_length')} | {'?' if n is None else n} | {how} |")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    final = json.dumps(getattr(text, "rope_parameters", None) or {}, default=str)
    tokens = f", {t['tokens']:,} tokens" if isinstance(t.get("tokens"), int) else ""
    tok = ("the run's, in this folder" + (", with the chat template its rows were rendered with" if template else "")
           if tokenizer else "none in this folder: use the base model's")
    return "\n".join([
        "---", *([f"base_model: {hub}"] if hub else []), "library_name: transformers", "---", "",
        f"# {(re.findall('`(.+?)`', named) or ['Model'])[0]} trained to {trained_length(checkpoint)} tokens", "",
        "Made with ulysses-longtrain (long-context training: DeepSpeed ZeRO-3, Ulysses sequence parallelism).", "",
        f"- Base model: {named}; its licence and terms apply (its own card is not copied here).",
        f"- Exported from step {step} (stage {at}){tokens}; weights in {dtype}.",
        f"- RoPE in config.json (the last stage's): `{final}`.", f"- Tokenizer: {tok}.", "",
        "| stage | name | length (tokens) | steps | RoPE |", "|---|---|---|---|---|", *rows, ""])


def export_hf(checkpoint: str, out_dir: str, tokenizer_path: str | None = None, source: str | None = None,
              owned: bool = False, stops: list[int] | None = None, identity: str | None = None,
              template: str | None = None, dtype: str = "auto") -> str:
    """Write `checkpoint` (its fp32 master weights, its last stage's RoPE) to `out_dir`; `source` is the run's
    --model_name_or_path (its generation_config.json is copied); `identity`: the checkpoint's content hash (its
    manifest's SHA-256), recorded beside its path (a branch writes a new step_N under the old name); `stops`: ids
    generation must also stop on (the
    end-of-turn a chat SFT trained: data/chat_stops.py), added to generation_config.json's eos_token_id. Checks
    `out_dir` first (check_out). `template`: the chat template a chat SFT's rows were rendered with where the
    tokenizer's own default is another (the ChatML default of a base tokenizer, a forced or named template): the
    exported tokenizer carries it, or a server renders prompts in a format the model was never tuned on. `dtype`: the
    weights' dtype on disk (export_dtype: auto is the run's training precision). A symlinked `out_dir` is written
    where it points (the link kept; check_out: the target missing, empty or a previous export of this run's)."""
    check_out(out_dir, checkpoint, owned)
    check_recorded(tokenizer_path, source)
    if dtype != "auto":
        export_dtype(None, dtype)  # the one-line refusal of an unknown one, before any work
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from huggingface_hub import save_torch_state_dict
    from transformers import AutoConfig

    with open(os.path.join(checkpoint, "hf_config.json")) as fh:
        fields = json.load(fh)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)  # carries the last stage's RoPE
    config.use_cache = True  # training runs without the KV cache (model_utils/build.py); generation wants it
    restore_router_logits(config, base_config(source))
    written = export_dtype(config, dtype, checkpoint)
    config.dtype = getattr(torch, written)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    rope = dict(getattr(text, "rope_parameters", None) or {})
    if rope.get("rope_type") in ("yarn", "longrope") and rope.get("factor") and rope.get("original_max_position_embeddings"):
        # the length YaRN extends to: transformers before 4.56 (and copies of its code) derive the factor as
        # max_position_embeddings / original, so a base's 131072 over 256 loaded as factor 512 (now: a warning), and
        # vLLM serves original x factor whatever it says: a stage trained past its reach (a factor short of its
        # length) keeps the trained factor, said
        reach = text.max_position_embeddings = int(rope["original_max_position_embeddings"] * rope["factor"])
        if (length := trained_length(checkpoint)) > reach:
            print(f"note: the stage trained at {length} tokens, past its YaRN reach {reach} (factor {rope['factor']} x "
                  f"{rope['original_max_position_embeddings']}): servers read {reach} as the longest prompt (vLLM), "
                  f"and a longer one needs factor >= {length / rope['original_max_position_embeddings']:.3g}", flush=True)
    if not getattr(config, "architectures", None):  # a preset-built model has none (vLLM, pipeline() read it)
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
        config.architectures = [name] if isinstance(name, str) else None
    if tokenizer_path and os.path.isfile(tokenizer_path):  # a sentencepiece file: its ids, not the preset's
        config.bos_token_id, config.eos_token_id, config.pad_token_id = sentencepiece_ids(tokenizer_path)
    model = meta_model(config)  # before the consolidation: a config no class builds fails in seconds
    fp32 = kept_in_fp32(model, written)
    root, tag = os.path.split(checkpoint.rstrip("/"))
    state = get_fp32_state_dict_from_zero_checkpoint(root, tag=tag)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # tied to the input embeddings; transformers re-ties on load
    for k in list(state):  # one tensor at a time: each fp32 one is freed as its cast replaces it (no second copy)
        if state[k].is_floating_point() and not (fp32 and fp32.search(k)):
            state[k] = state[k].to(config.dtype)
    state = hub_layout(config, state, model, base_keys(source))
    # a symlinked hf_model (or --out): written where it points (a target check_out let through: missing, empty or a
    # previous export); rmtree leaves a link in place, and replacing it with the new folder failed (ENOTDIR) after the
    # whole run, and at every restart. Built beside the target: os.replace is atomic on that file system only
    out = os.path.realpath(out_dir)
    tmp = out + ".export-tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    with disk_named(tmp):  # a full disk or quota: one line naming the folder, exit 2 (not a crash, not requeued)
        os.makedirs(tmp)
        config.save_pretrained(tmp)
        legacy_rope(os.path.join(tmp, "config.json"))
        legacy_dtype(os.path.join(tmp, "config.json"))
        legacy_aliases(os.path.join(tmp, "config.json"), config)
        save_torch_state_dict({k: v.contiguous() for k, v in state.items()}, tmp, max_shard_size="5GB",
                              safe_serialization=True)
        if gen := generation_config(source):
            shutil.copy(gen, os.path.join(tmp, "generation_config.json"))
        added = add_stops(os.path.join(tmp, "generation_config.json"), config, stops or [])
        if tokenizer_path and os.path.isfile(tokenizer_path):
            shutil.copy(tokenizer_path, os.path.join(tmp, "tokenizer.model"))
        elif tokenizer_path and os.path.isdir(tokenizer_path):
            export_tokenizer(tokenizer_path, tmp, template, getattr(text, "max_position_embeddings", None),
                             trained_bos(checkpoint))
        tokenized = any(os.path.isfile(os.path.join(tmp, f))
                        for f in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json"))
        with open(os.path.join(tmp, CARD), "w") as fh:
            fh.write(model_card(checkpoint, source, config, written, tokenized, bool(template)))
        with open(os.path.join(tmp, MARKER), "w") as fh:  # local paths: check_out and is_export_of know exports by it
            json.dump({"checkpoint": os.path.abspath(checkpoint), "manifest_sha256": identity, "source": source,
                       "tokenizer": tokenizer_path and os.path.abspath(tokenizer_path),
                       "generation_config": gen, "added_stops": added, "trained_template": bool(template),
                       "dtype": written}, fh, indent=1)
        durable(tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    fsync_path(os.path.dirname(out))  # the rename itself, before train.py writes COMPLETE
    return out_dir


FULL_OS = {28: errno.ENOSPC, 122: errno.EDQUOT}  # Linux's numbers as a Rust io::Error prints them: "(os error 28)"


@contextmanager
def disk_named(tmp: str):
    """The export's writes, a full disk's error named as one (training/job.users_disk: exit 2, the user's one line):
    safetensors' `SafetensorError: Error while serializing: I/O error: No space left on device (os error 28)` (122:
    a quota) is no OSError, nor caused by one, so an 8B run's last 16 GB ended in a traceback and exit 1, which
    scripts/slurm.sbatch read as node 0's crash: requeued without it, the export run again and failed again (measured
    on a 256 kB tmpfs, an audit). Now an OSError(ENOSPC / EDQUOT) naming `tmp`, raised from it. An OSError of a
    small write (config, tokenizer, card) that names no file names `tmp` too. The partial `tmp` stays (never taken
    for an export: no rename; the next export removes it)."""
    try:
        yield
    except OSError as e:
        named(e, tmp)  # a short write that says no errno, on a disk left with no block; a write naming nothing
        raise
    except Exception as e:  # noqa: BLE001 -- safetensors' Rust error, known by its text only
        code = re.search(r"\(os error (\d+)\)", str(e))
        err = FULL_OS.get(int(code[1])) if code else None
        if err is None:
            raise
        raise OSError(err, os.strerror(err), tmp) from e


def durable(folder: str) -> None:
    """fsync every file under `folder`, then the folder: the export is whole on disk before it replaces the old one
    (without it, a node lost after the rename could leave an hf_model of short shards, COMPLETE beside it). At 8B: ~16 GB of
    shards already written, the fsyncs wait for what the page cache still holds (seconds to a minute on NFS)."""
    for d, _, fs in os.walk(folder):
        for f in fs:
            fsync_path(os.path.join(d, f))
        fsync_path(d)
