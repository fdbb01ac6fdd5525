"""The exported tokenizer (model_utils/export.py writes it beside the weights): the run's Hugging Face tokenizer folder
saved by transformers 5 and rewritten so 4.x readers load it alike (export_tokenizer, legacy_tokenizer: vLLM and
llama.cpp's converter pin < 5), and the check that a recorded tokenizer or base model is still there (check_recorded;
recorded_or_none for the run's own export)."""

from __future__ import annotations

import json
import os
import shutil


def check_recorded(tokenizer_path: str | None, source: str | None) -> None:
    """A one-line ValueError where the run's tokenizer (a file or folder when it trained: data/tokenizer.py refuses
    any other) or the model it started from (a folder, a cached hub id or a preset) is no longer there: the export
    went on without the tokenizer, or without the base's generation_config.json (an Instruct model's end-of-turn ids),
    and said nothing."""
    if tokenizer_path and not os.path.exists(tokenizer_path):
        raise ValueError(f"the run's tokenizer {tokenizer_path} no longer exists (moved, deleted, or relative to another "
                         "working directory): give scripts/export_hf.py --tokenizer PATH (where it is now), or "
                         "--tokenizer none to export without one")
    if not source:
        return
    from model_utils.build import PRESETS, resolve_model

    try:
        found = resolve_model(source, weights=False)
    except ValueError as e:
        found, why = None, str(e)
    else:
        why = f"{source}: no such folder"
    if found is None or not (found in PRESETS or os.path.isdir(found)):
        raise ValueError(f"the run's base model is not there ({why}; the export copies its generation_config.json): "
                         "give scripts/export_hf.py --source PATH (where it is now), or --source none to export "
                         "without it")


def recorded_or_none(tokenizer_path: str | None, source: str | None) -> tuple[str | None, str | None]:
    """train.py's end-of-run export: a tokenizer or base model gone since the run started (a node-local cache cleaned
    during a week of training) is left out with one note naming the re-export, not a refusal after the training
    (the run would end without COMPLETE)."""
    for i, pair in enumerate(((tokenizer_path, None), (None, source))):
        try:
            check_recorded(*pair)
        except ValueError as e:
            print(f"note: exporting without it: {e}", flush=True)
            tokenizer_path, source = (None, source) if i == 0 else (tokenizer_path, None)
    return tokenizer_path, source


VERY_LARGE = 1e20  # a model_max_length above it is transformers' "no limit" (int(1e30)), not a length


def export_tokenizer(tokenizer_path: str, out: str, template: str | None, positions: int | None,
                     trained_bos: bool | None = None) -> None:
    """The run's Hugging Face tokenizer folder written to `out` (transformers' save_pretrained, then legacy_tokenizer:
    read alike by 4.x and 5), with the chat template the rows were rendered with (`template`; else the folder's own,
    or the one it ships only in chat_template.json, which AutoTokenizer does not read and data/tokenizer.py trains on:
    Mistral-Small-3.1-2503), and a model_max_length of at least `positions` (the model's max_position_embeddings: a
    base's 131072 kept after a 1M extension cut a truncation=True input at 128k, with false length warnings).
    A `template` that is the `tool_use` of the folder's named set (Hermes-2-Pro / 3, Command-R / R7B; trained with
    `--chat_template tool_use`) keeps the whole set, as an `auto` run's export does: transformers and vLLM pick
    `tool_use` for a request with tools and `default` without. Replaced by it alone, every request without tools
    raised on Hermes ('NoneType' object is not iterable) and got R7B's tool preamble. Another member (`rag`, which no
    server picks by itself) is carried alone, as before: what the rows were rendered with.
    `trained_bos`: whether training put a BOS before a text (the checkpoint's trainer.json `bos_id`: export.trained_bos),
    the exported add_bos_token; where the tokenizer here frames a text otherwise (its files read under another
    transformers major: legacy_tokenizer), one note says so and the recorded rule is written. None (a checkpoint from
    before it was recorded): what the tokenizer does here (adds_bos), which is training's under the same major."""
    from transformers import AutoTokenizer

    # as training read it (data/tokenizer.HF_TOKENIZER): a folder's own Python never run
    tok = AutoTokenizer.from_pretrained(tokenizer_path, mistral_format=False, trust_remote_code=False)
    here = adds_bos(tok)  # before anything of it is changed: what it puts before a text under this transformers
    if trained_bos is not None and trained_bos != here:
        print(f"note: the run trained {'with' if trained_bos else 'without'} a BOS before each text (trainer.json "
              f"bos_id), and tokenizer {tokenizer_path} here puts {'one' if here else 'none'} (its files read under "
              "another transformers major, whose BOS rule differs, or its config edited): the export's add_bos_token "
              f"is {str(trained_bos).lower()}, as it trained", flush=True)
    bos = here if trained_bos is None else trained_bos
    shipped = os.path.join(tokenizer_path, "chat_template.json")
    own = tok.chat_template
    if not own and (value := _json(shipped).get("chat_template")):
        # named templates are listed as tokenizer_config.json lists them ([{name, template}]): a dict in memory
        own = {t.get("name"): t.get("template") for t in value} if isinstance(value, list) else value
    if template and isinstance(own, dict) and "default" in own and own.get("tool_use") == template:
        template = None  # the set, which a server picks from by the request's tools as training picked it
    tok.chat_template = template or own
    length = tok.model_max_length
    if positions and isinstance(length, (int, float)) and length < VERY_LARGE:
        tok.model_max_length = max(int(length), int(positions))
    tok.save_pretrained(out)
    # a sentencepiece folder's own files, verbatim: a fast tokenizer writes tokenizer.json only, and a loader
    # without the conversion (sentencepiece, llama.cpp's converter, a slow tokenizer) needs tokenizer.model; a
    # processor's chat_template.json (AutoProcessor, vLLM's multimodal path read it), its template the trained one
    for name, always in (("tokenizer.model", True), ("special_tokens_map.json", False), ("chat_template.json", True)):
        src = os.path.join(tokenizer_path, name)
        if os.path.isfile(src) and (always or not os.path.exists(os.path.join(out, name))):
            shutil.copy(src, os.path.join(out, name))
    got = _json(os.path.join(out, "chat_template.json"))
    if template and got.get("chat_template") not in (None, template):  # another format than the rows': replaced
        with open(os.path.join(out, "chat_template.json"), "w") as fh:
            json.dump({**got, "chat_template": template}, fh, indent=2)
    legacy_tokenizer(out, tokenizer_path, bos)


def adds_bos(tok) -> bool:
    """Whether the Hugging Face tokenizer `tok` puts a token before a text (`tok(text)`): data/tokenizer.py's probe
    for its `bos_id`, what training framed every text document with (model_utils does not import data)."""
    plain, full = tok("a", add_special_tokens=False)["input_ids"], tok("a")["input_ids"]
    return len(full) > len(plain) and full[1:1 + len(plain)] == plain


def _json(path: str) -> dict:
    """The JSON object in `path`; {} where there is none (no file, not JSON, not an object)."""
    try:
        with open(path) as fh:
            got = json.load(fh)
    except (OSError, ValueError):
        return {}
    return got if isinstance(got, dict) else {}


KEPT = ("legacy", "add_bos_token", "add_eos_token", "add_prefix_space")  # how a sentencepiece text is cut and framed


def legacy_tokenizer(out: str, source: str, bos: bool | None = None) -> None:
    """tokenizer_config.json at `out` also as transformers 4.x reads it (vLLM and llama.cpp's converter pin < 5, TGI
    4.51): 5 writes `tokenizer_class: TokenizersBackend` (for PreTrainedTokenizerFast, the Llama 3 family; no such
    class in 4.x), its extra special tokens as a list in `extra_special_tokens` (4.57: "'list' object has no attribute
    'keys'"), `backend` / `is_local` / `local_files_only` (passed on to the class), and the chat template only in
    chat_template.jinja (4.46 and TGI read it inline). Rewritten: the class of the `source` folder's
    tokenizer_config.json (else PreTrainedTokenizerFast), the list as `additional_special_tokens`, the template inline
    too (the .jinja files kept: 5 reads them first), the three keys dropped, and the source's KEPT keys where it has
    them (5's save_pretrained omits `legacy`, and 5 reads a missing one as False: a Mistral v0.1 `legacy: true`
    folder's exported `[INST]` after <s> was `[` where training had `▁[`). `add_bos_token`: `bos`, whether training's
    tokenizer put a BOS before a text (its recorded rule, else adds_bos here), where given, not the source's flag: transformers 4.x's
    LlamaTokenizerFast rebuilds the post-processor from that flag on load (update_post_processor,
    transformers/models/llama/tokenization_llama_fast.py in 4.57), 5.x keeps tokenizer.json's, so DeepSeek-R1-Distill-
    Qwen's layout (LlamaTokenizerFast over a byte-level BPE, `add_bos_token: true`, no BOS in the post-processor)
    trained without a BOS under 5 and its export, read by a 4.x server (vLLM), put one before every plain completion
    (the other layout, a BOS in the post-processor and the flag false, the reverse). 5 reads it back alike (same ids,
    special tokens, template). Written in the folder the export builds and swaps in whole, as config.json is."""
    path = os.path.join(out, "tokenizer_config.json")
    c = _json(path)
    if not c:
        return
    own = _json(os.path.join(source, "tokenizer_config.json"))
    c.update({k: own[k] for k in KEPT if k in own})
    if bos is not None:
        c["add_bos_token"] = bos
    cls = own.get("tokenizer_class")
    c["tokenizer_class"] = cls if isinstance(cls, str) and cls != "TokenizersBackend" else "PreTrainedTokenizerFast"
    extra = c.get("extra_special_tokens")
    if isinstance(extra, list):  # 5 lists sentencepiece's user-defined pieces there too: only the special ones move
        decoder = [v for v in (c.get("added_tokens_decoder") or {}).values() if isinstance(v, dict)]
        special = {v.get("content") for v in decoder if v.get("special")}
        have = list(c.get("additional_special_tokens") or [])
        c["additional_special_tokens"] = have + [t for t in c.pop("extra_special_tokens") if t not in have and (
            not decoder or (t.get("content") if isinstance(t, dict) else t) in special)]
    named = c.pop("model_specific_special_tokens", None)  # Gemma 3's boi_token / eoi_token: 4.x's named form
    if isinstance(named, dict) and named and not isinstance(c.get("extra_special_tokens"), dict):
        c["extra_special_tokens"] = named
    for key in ("backend", "is_local", "local_files_only"):
        c.pop(key, None)
    named = {}
    if os.path.isfile(os.path.join(out, "chat_template.jinja")):
        with open(os.path.join(out, "chat_template.jinja"), encoding="utf-8") as fh:
            named["default"] = fh.read()
    more = os.path.join(out, "additional_chat_templates")
    for f in sorted(os.listdir(more)) if os.path.isdir(more) else ():
        if f.endswith(".jinja"):
            with open(os.path.join(more, f), encoding="utf-8") as fh:
                named[f.removesuffix(".jinja")] = fh.read()
    if list(named) == ["default"]:
        c["chat_template"] = named["default"]
    elif named:  # 4.x's inline form of named templates
        c["chat_template"] = [{"name": k, "template": v} for k, v in named.items()]
    with open(path, "w") as fh:
        json.dump(c, fh, indent=2, ensure_ascii=False)
