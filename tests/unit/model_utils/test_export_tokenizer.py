"""The tokenizer model_utils/export.export_hf writes beside the weights, from hub-style tokenizer folders (written by
transformers 4.x, as Llama-3.1-Instruct's and Qwen2.5-Instruct's are downloaded): tokenizer_config.json as transformers
4.x reads it too (vLLM and llama.cpp's converter pin < 5), a template shipped only in chat_template.json, a
model_max_length as long as the model's positions, and a recorded tokenizer or base folder that is gone refused."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.unit.data.chat_fixtures import CORPUS, LLAMA3, QWEN25, SPECIAL

TINY = dict(vocab_size=416, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
MSGS = [{"role": "user", "content": "Hello there, how are you today?"}]


def _hub_folder(root, name: str, cls: str, eos: str, template: str | None, **extra) -> str:
    """A tokenizer folder as transformers 4.x wrote it: tokenizer.json, and tokenizer_config.json with `cls`, the
    template inline, model_max_length 131072 (as Llama 3.1 and Qwen2.5 ship it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out = root / name
    out.mkdir()
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    t.save(str(out / "tokenizer.json"))
    added = {str(t.token_to_id(s)): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                                     "single_word": False, "special": True} for s in SPECIAL}
    config = {"added_tokens_decoder": added, "eos_token": eos, "clean_up_tokenization_spaces": True,
              "model_max_length": 131072, "tokenizer_class": cls, **extra}
    if template:
        config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return str(out)


def _export(tmp_path, monkeypatch, tokenizer: str | None, name: str = "out", **kw) -> str:
    """export_hf of a tiny Llama (the ZeRO consolidation patched to return its state dict) with `tokenizer`."""
    import deepspeed.utils.zero_to_fp32 as z
    from transformers import AutoConfig, AutoModelForCausalLM

    from model_utils.export import export_hf

    config = AutoConfig.for_model("llama", **TINY, max_position_embeddings=kw.pop("positions", 4096))
    torch.manual_seed(0)
    state = AutoModelForCausalLM.from_config(config).state_dict()
    ck = tmp_path / "run" / "checkpoints" / "step_000002"
    ck.mkdir(parents=True, exist_ok=True)
    (ck / "hf_config.json").write_text(config.to_json_string())
    monkeypatch.setattr(z, "get_fp32_state_dict_from_zero_checkpoint", lambda root, tag: dict(state))
    return export_hf(str(ck), str(tmp_path / name), tokenizer, **kw)


def _ids(tok) -> tuple:
    got = tok.apply_chat_template(MSGS, add_generation_prompt=True, tokenize=True)
    got = got["input_ids"] if hasattr(got, "keys") else got
    return list(got), tok("apple river")["input_ids"], sorted(tok.all_special_tokens), tok.chat_template


def test_the_exported_tokenizer_config_is_read_by_transformers_4_too(tmp_path, monkeypatch):
    """transformers 5's save_pretrained wrote `tokenizer_class: TokenizersBackend` (Llama 3's
    PreTrainedTokenizerFast), `extra_special_tokens` as a list (4.57: "'list' object has no attribute 'keys'"),
    `backend` / `is_local` / `local_files_only`, and the template only in chat_template.jinja (4.46 and TGI read it
    inline): every consumer pinned below 5 failed to load the export. Now the 4.x keys, and 5 reads the same ids,
    special tokens and template as from the source folder."""
    from transformers import AutoTokenizer

    folders = {"llama": _hub_folder(tmp_path, "llama", "PreTrainedTokenizerFast", "<|eot_id|>", LLAMA3,
                                    bos_token="<|begin_of_text|>"),
               "qwen": _hub_folder(tmp_path, "qwen", "Qwen2Tokenizer", "<|im_end|>", QWEN25, pad_token="<|endoftext|>",
                                   errors="replace", additional_special_tokens=["<|im_start|>", "<|im_end|>"])}
    for name, src in folders.items():
        out = _export(tmp_path, monkeypatch, src, name=f"out_{name}")
        raw = json.loads((tmp_path / f"out_{name}" / "tokenizer_config.json").read_text())
        want = json.loads(open(os.path.join(src, "tokenizer_config.json")).read())
        assert raw["tokenizer_class"] == want["tokenizer_class"]
        assert not {"backend", "is_local", "local_files_only", "extra_special_tokens"} & set(raw)
        assert raw.get("additional_special_tokens") == want.get("additional_special_tokens")
        assert raw["chat_template"] == (tmp_path / f"out_{name}" / "chat_template.jinja").read_text() == want["chat_template"]
        assert _ids(AutoTokenizer.from_pretrained(out)) == _ids(AutoTokenizer.from_pretrained(src))


def test_a_template_shipped_only_in_chat_template_json_is_exported(tmp_path, monkeypatch):
    """Mistral-Small-3.1-2503 ships its only template in chat_template.json (a processor's file): training renders
    with it (data/tokenizer.py), and the export, reloading with AutoTokenizer (which does not read that file),
    shipped no template and no chat_template.json: a server rendered another format. Both are exported now."""
    from transformers import AutoTokenizer

    src = _hub_folder(tmp_path, "mistral3", "PreTrainedTokenizerFast", "<|eot_id|>", None, bos_token="<|begin_of_text|>")
    shipped = json.dumps({"chat_template": LLAMA3}, indent=1)
    (tmp_path / "mistral3" / "chat_template.json").write_text(shipped)
    out = _export(tmp_path, monkeypatch, src)
    assert (tmp_path / "out" / "chat_template.json").read_text() == shipped  # verbatim
    assert json.loads((tmp_path / "out" / "export.json").read_text())["tokenizer"] == src  # which one, recorded
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template == LLAMA3
    assert json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())["chat_template"] == LLAMA3
    assert tok.apply_chat_template(MSGS, tokenize=False, add_generation_prompt=True).endswith(
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    # rows rendered with another template (--chat_template): the file carries that one, as the tokenizer does
    out = _export(tmp_path, monkeypatch, src, name="forced", template=QWEN25)
    assert json.loads((tmp_path / "forced" / "chat_template.json").read_text()) == {"chat_template": QWEN25}
    assert AutoTokenizer.from_pretrained(out).chat_template == QWEN25


def test_the_tokenizer_length_is_the_models_after_an_extension(tmp_path, monkeypatch):
    """A 1M extension of a base whose tokenizer says model_max_length 131072: config.json said 1048576, the tokenizer
    131072, and `tokenizer(text, truncation=True)` cut everything past 128k (with false "longer than the maximum"
    warnings). The export's tokenizer says the model's length; a longer one, or none (the 1e30 sentinel), is kept."""
    from transformers import AutoTokenizer

    src = _hub_folder(tmp_path, "qwen", "Qwen2Tokenizer", "<|im_end|>", QWEN25)
    out = _export(tmp_path, monkeypatch, src, name="long", positions=1048576)
    assert AutoTokenizer.from_pretrained(out).model_max_length == 1048576
    out = _export(tmp_path, monkeypatch, src, name="short", positions=4096)
    assert AutoTokenizer.from_pretrained(out).model_max_length == 131072
    raw = json.loads((tmp_path / "qwen" / "tokenizer_config.json").read_text())
    del raw["model_max_length"]
    (tmp_path / "qwen" / "tokenizer_config.json").write_text(json.dumps(raw))
    out = _export(tmp_path, monkeypatch, src, name="none", positions=4096)
    assert AutoTokenizer.from_pretrained(out).model_max_length > 1e20


def test_a_recorded_tokenizer_or_base_that_is_gone_is_refused(tmp_path, monkeypatch):
    """The tokenizer folder (or the base model, whose generation_config.json is copied) recorded in the checkpoint
    and gone at export time: the export went on without it and said nothing. Refused in one line naming it and the
    override; scripts/export_hf.py --tokenizer / --source give where they are now (`none`: without)."""
    import importlib.util

    gone = str(tmp_path / "moved" / "tok")
    for kw, flag in (({"tokenizer": gone}, "--tokenizer"), ({"tokenizer": None, "source": gone}, "--source")):
        with pytest.raises(ValueError) as e:
            _export(tmp_path, monkeypatch, **kw)
        assert len(str(e.value).splitlines()) == 1 and gone in str(e.value) and flag in str(e.value)
        assert not (tmp_path / "out").exists()
    spec = importlib.util.spec_from_file_location("export_hf", os.path.join(os.getcwd(), "scripts", "export_hf.py"))
    export = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(export)
    ck = tmp_path / "run" / "checkpoints" / "step_000002"
    (ck / "MANIFEST.json").write_text("{}")
    seen = {}
    monkeypatch.setattr(export.Checkpointer, "verify", lambda self, path: None)
    monkeypatch.setattr(export.Checkpointer, "read_trainer", staticmethod(lambda path: {
        "tokenizer": gone, "config": {"model_name_or_path": gone}}))
    monkeypatch.setattr(export, "export_hf", lambda path, out, tok, source=None, **kw: seen.update(tok=tok, source=source) or out)
    assert export.main([str(ck)]) == 2 and not seen  # refused: the recorded tokenizer is gone
    src = _hub_folder(tmp_path, "here", "PreTrainedTokenizerFast", "<|eot_id|>", None)
    assert export.main([str(ck), "--tokenizer", src, "--source", "none"]) == 0
    assert seen == {"tok": src, "source": None}
    assert export.main([str(ck), "--tokenizer", "none", "--source", str(tmp_path)]) == 0
    assert seen == {"tok": None, "source": str(tmp_path)}


def test_the_runs_own_export_leaves_out_what_is_gone_with_a_note(tmp_path, capsys):
    """train.py's export at the end of a run: a tokenizer or base folder gone since the start is left out with one
    note each (a refusal there ended a finished run with exit 2 and no COMPLETE); what is there is kept."""
    from model_utils.export import recorded_or_none

    here, gone = str(tmp_path), str(tmp_path / "gone")
    assert recorded_or_none(here, here) == (here, here) and capsys.readouterr().out == ""
    assert recorded_or_none(gone, here) == (None, here)
    assert recorded_or_none(here, gone) == (here, None)
    assert recorded_or_none(gone, gone) == (None, None)
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: exporting without it")]
    assert len(notes) == 4 and all(gone in n for n in notes)


def test_a_legacy_sentencepiece_tokenizer_is_exported_as_it_trained(tmp_path):
    """A Llama / Mistral v0.1 style folder (tokenizer.model, `legacy: true`): transformers 5's save_pretrained wrote
    no `legacy`, and 5 reads a missing one as False, so the export cut `[INST]` after <s> as `[` where training had
    `▁[` (every served turn start another token). The source's legacy / add_bos_token / add_eos_token / add_prefix_space
    are kept, and 5 reads the export with the source's ids, text and chat alike."""
    import shutil

    from transformers import AutoTokenizer

    from model_utils.export import export_tokenizer

    src, out = tmp_path / "mistral", tmp_path / "out"
    src.mkdir()
    out.mkdir()
    shutil.copy(os.path.join(os.getcwd(), "recipes", "base", "tiny_passkey256", "tokenizer.model"), src)
    tpl = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
           "{% else %} {{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")
    kept = {"legacy": True, "add_bos_token": True, "add_eos_token": False}
    (src / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "chat_template": tpl, **kept}))
    export_tokenizer(str(src), str(out), None, 4096)
    raw = json.loads((out / "tokenizer_config.json").read_text())
    assert {k: raw.get(k) for k in kept} == kept
    a, b = AutoTokenizer.from_pretrained(str(src)), AutoTokenizer.from_pretrained(str(out))
    conv = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "the quick fox"},
            {"role": "user", "content": "how are you"}]
    x, y = (t.apply_chat_template(conv, tokenize=True, return_dict=False) for t in (a, b))
    assert a.convert_ids_to_tokens(x)[1] == "▁["  # (the case: legacy True puts ▁ before the turn's first piece)
    assert x == y
    assert a("hello there  how\nare you")["input_ids"] == b("hello there  how\nare you")["input_ids"]


def test_the_4x_rewrite_moves_only_special_tokens_and_keeps_named_ones(tmp_path):
    """transformers 5 lists sentencepiece's user-defined pieces ([INST], not special) in `extra_special_tokens` and
    writes Gemma 3's named tokens as `model_specific_special_tokens`: the rewrite made the pieces special for 4.x (vLLM's
    decode with skip_special_tokens dropped them) and lost the named ones (a review found both)."""
    import json

    from model_utils.export_tokenizer import legacy_tokenizer

    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir(), out.mkdir()
    (src / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GemmaTokenizer"}))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "TokenizersBackend", "extra_special_tokens": ["[INST]", "<start_of_image>"],
        "model_specific_special_tokens": {"boi_token": "<start_of_image>"},
        "added_tokens_decoder": {"5": {"content": "[INST]", "special": False},
                                 "6": {"content": "<start_of_image>", "special": True}}}))
    legacy_tokenizer(str(out), str(src))
    c = json.loads((out / "tokenizer_config.json").read_text())
    assert c["additional_special_tokens"] == ["<start_of_image>"] and c["tokenizer_class"] == "GemmaTokenizer"
    assert c["extra_special_tokens"] == {"boi_token": "<start_of_image>"} and "model_specific_special_tokens" not in c


def _distill_folder(root, in_post_processor: bool, flag: bool) -> str:
    """DeepSeek-R1-Distill-Qwen's layout: LlamaTokenizerFast over a byte-level BPE, `add_bos_token: flag` in
    tokenizer_config.json, a BOS in tokenizer.json's post-processor or not."""
    from tokenizers import Tokenizer as Raw
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    bos, eos = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
    t = Raw(models.BPE())
    t.pre_tokenizer, t.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    t.train_from_iterator(["a quick brown fox jumps over the lazy dog"] * 10, trainers.BpeTrainer(
        vocab_size=300, special_tokens=[bos, eos], show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    t.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[
        (bos, 0)]) if in_post_processor else processors.ByteLevel(trim_offsets=False)
    src = root / "src"
    src.mkdir()
    t.save(str(src / "tokenizer.json"))
    (src / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizerFast", "add_bos_token": flag, "add_eos_token": False, "legacy": True,
        "bos_token": bos, "eos_token": eos, "pad_token": eos, "clean_up_tokenization_spaces": False}))
    return str(src)


@pytest.mark.parametrize("in_post_processor, flag", [(False, True), (True, False)])
def test_the_exported_add_bos_token_is_whether_training_added_one(tmp_path, in_post_processor, flag):
    """DeepSeek-R1-Distill-Qwen's layout: LlamaTokenizerFast over a byte-level BPE, `add_bos_token: true` in
    tokenizer_config.json and no BOS in tokenizer.json's post-processor (and the reverse). transformers 4.x's
    LlamaTokenizerFast adds a BOS from the flag on load, 5.x from the post-processor: the export copied the source's
    flag, so a 4.x server (vLLM) reading it put a BOS before plain completions that training (this .venv's
    transformers) never had. The exported flag is now whether training added one (checked by hand under 4.57.1: the
    export then loads with training's ids under both)."""
    from data.tokenizer import Tokenizer
    from model_utils.export_tokenizer import export_tokenizer

    src, out = _distill_folder(tmp_path, in_post_processor, flag), tmp_path / "out"
    trained = Tokenizer(src).bos_id is not None
    export_tokenizer(src, str(out), None, None)
    assert json.loads((out / "tokenizer_config.json").read_text())["add_bos_token"] is trained
    assert (Tokenizer(str(out)).bos_id is not None) is trained  # and 5 reads the export as training read the source


@pytest.mark.parametrize("in_post_processor, recorded, written", [
    (True, {"bos_id": None}, False), (False, {"bos_id": 0}, True),  # the other major's rule: the recorded one, said
    (True, {"bos_id": 0}, True), (True, {}, True), (False, {}, False)])  # the same; not recorded: this major's
def test_the_exported_add_bos_token_is_the_one_the_checkpoint_recorded(tmp_path, monkeypatch, capsys,
                                                                       in_post_processor, recorded, written):
    """A run trained under one transformers major and exported under another: the same DeepSeek-R1-Distill-Qwen files
    put a BOS before a text under 4.x (from add_bos_token) and none under 5.x (from the post-processor), and the export
    worked training's rule out again under its own, so it wrote the other major's add_bos_token. The run records the
    BOS it framed its texts with (trainer.json `bos_id`: an id, or null for none) and export_hf writes that, with one
    note where the tokenizer here puts another; a checkpoint from before the record exports what the tokenizer does
    here (as before)."""
    import deepspeed.utils.zero_to_fp32 as z
    from transformers import LlamaConfig, LlamaForCausalLM

    from data.tokenizer import Tokenizer
    from model_utils.export import export_hf

    src = _distill_folder(tmp_path, in_post_processor, not in_post_processor)
    assert (Tokenizer(src).bos_id is not None) is in_post_processor  # (this .venv's rule: the post-processor's)
    config = LlamaConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=300)
    ck = tmp_path / "run" / "checkpoints" / "step_000004"
    ck.mkdir(parents=True)
    (ck / "hf_config.json").write_text(config.to_json_string())
    (ck / "trainer.json").write_text(json.dumps({"step": 4, "stage": 0, "tokenizer": src, **recorded}))
    state = LlamaForCausalLM(config).state_dict()
    monkeypatch.setattr(z, "get_fp32_state_dict_from_zero_checkpoint", lambda root, tag: dict(state))
    export_hf(str(ck), str(tmp_path / "run" / "hf_model"), src, owned=True)
    assert json.loads((tmp_path / "run" / "hf_model" / "tokenizer_config.json").read_text())["add_bos_token"] is written
    notes = [line for line in capsys.readouterr().out.splitlines() if "BOS before each text" in line]
    assert len(notes) == (written != in_post_processor) and all(f"add_bos_token is {str(written).lower()}" in n
                                                                for n in notes)
