"""Special-token strings in a text document (--text_specials auto|text|parse). A conversation brought pre-rendered as
text (TRL's `dataset_text_field` form, `tokenizer(text)`'s reading) starts with a turn token: under `auto`, the
default, such a text is read with its control tokens and every other text keeps its special-token strings as text
(`<|endoftext|>` in tokenizer code, `<s>` in HTML). Yesterday's rule refused the render instead: a code corpus holding
a template's test file (ollama's template/testdata/chatml.gotmpl/user) stopped a preparation late, and a base
tokenizer without a chat template (Llama-3.2-1B base) never saw a render at all. Small local tokenizers, one process."""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import pytest

from data.prepare_data import main, prepare
from data.tokenizer import TURN_STARTS, Tokenizer
from tests.unit.data.chat_fixtures import build_tokenizer
from tests.unit.data.test_prepare_data import _bos_tokenizer, _write_jsonl
from tests.unit.data.test_prepare_documents import QUIET, _docs, _llama3_instruct

CHATML = "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\nHi<|im_end|>\n"
LLAMA3 = ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHello there<|eot_id|><|start_header_id|>"
          "assistant<|end_header_id|>\n\nHi<|eot_id|>")
# a code corpus (The Stack's form): tokenizer code naming the end-of-text token, ollama's template/testdata/
# chatml.gotmpl/user (a ChatML render, byte for byte), a C file
CODE = ["def count(tokenizer):\n    return tokenizer.encode('<|endoftext|>')\n",
        "<|im_start|>user\nHello, how are you?<|im_end|>\n<|im_start|>assistant\n",
        "int main() { return 0; }\n"]


def test_a_code_corpus_holding_a_template_test_file_is_prepared_with_its_render_parsed(tmp_path, capsys):
    """The default (auto): the ollama render is read as Qwen's tokenizer(text) reads it (its <|im_start|> / <|im_end|>
    control tokens), the tokenizer code keeps `<|endoftext|>` as text (it was not turned into the separator), the C
    file is untouched; a note counts each kind. Yesterday: refused at that row (rc 2), --skip_bad_rows or not."""
    path = build_tokenizer(str(tmp_path / "tok"), "qwen25")
    tok = Tokenizer(path)
    eot, start = tok.hf.convert_tokens_to_ids("<|endoftext|>"), tok.hf.convert_tokens_to_ids("<|im_start|>")
    src = _write_jsonl(tmp_path / "code.jsonl", CODE, "text")
    assert main(["--input", src, "--output", str(tmp_path / "o"), "--tokenizer_name_or_path", path, "--workers", "0"]) == 0
    out = capsys.readouterr().out
    assert "note: 1 text document(s) start as a rendered conversation" in out and "docs/sft.md" in out, out
    assert "note: 1 text document(s) hold a special-token string (<s>, <|endoftext|>, ...) kept as text" in out, out
    code, render, c = _docs(tmp_path / "o")
    assert render == tok.encode(CODE[1]) + [tok.sep_id] and render.count(start) == 2
    assert eot not in code[:-1] and code[-1] == tok.sep_id == eot and tok.decode(code[:-1]) == CODE[0]
    assert c == tok.encode(CODE[2]) + [eot]
    m = json.loads((tmp_path / "o" / "manifest.json").read_text())
    assert (m["text_specials"], m["parsed_text_docs"], m["special_text_docs"]) == ("auto", 1, 1)


def test_text_and_parse_read_every_text_one_way_and_the_plan_records_the_reading(tmp_path):
    """--text_specials text: every text as text (the render spelled out); parse: every text as control tokens (the
    tokenizer code's `<|endoftext|>` too). The plan records the reading: a shard stopped under another one, or under
    yesterday's refusal, resumes only with --overwrite; `text` is the reading from before the refusal (same value)."""
    path = build_tokenizer(str(tmp_path / "tok"), "qwen25")
    tok = Tokenizer(path)
    eot, start = tok.hf.convert_tokens_to_ids("<|endoftext|>"), tok.hf.convert_tokens_to_ids("<|im_start|>")
    src = _write_jsonl(tmp_path / "code.jsonl", CODE, "text")
    lines = []
    m = prepare([src], str(tmp_path / "t"), path, workers=0, log=lines.append, text_specials="text")
    code, render, _ = _docs(tmp_path / "t")
    assert start not in render and eot not in code[:-1] and (m["parsed_text_docs"], m["special_text_docs"]) == (0, 2)
    assert m["text_specials"] == "text" and not [x for x in lines if "rendered conversation" in x]
    lines = []
    m = prepare([src], str(tmp_path / "p"), path, workers=0, log=lines.append, text_specials="parse")
    code, render, _ = _docs(tmp_path / "p")
    assert render.count(start) == 2 and code[:-1].count(eot) == 1 and code == tok.encode(CODE[0]) + [eot]
    assert (m["text_specials"], m["parsed_text_docs"], m["special_text_docs"]) == ("parse", 2, 0)
    assert len([x for x in lines if "read as control tokens (--text_specials parse)" in x]) == 1
    with pytest.raises(ValueError, match=r"differs in \['text_specials'\]"):
        prepare([src], str(tmp_path / "p"), path, **QUIET)  # the default (auto): another preparation
    plan_path = tmp_path / "t" / "plan-s00000.json"
    plan = json.loads(plan_path.read_text())
    assert plan["text_specials"] == "as text"  # yesterday's refusal stopped the run at a render: start again
    plan_path.write_text(json.dumps({**plan, "text_specials": "as text, a rendered conversation refused"}))
    with pytest.raises(ValueError, match=r"differs in \['text_specials'\]"):
        prepare([src], str(tmp_path / "t"), path, **QUIET, text_specials="text")
    with pytest.raises(ValueError, match="--text_specials 'raw': use auto, text or parse"):
        prepare([src], str(tmp_path / "x"), path, **QUIET, text_specials="raw")


def test_a_base_tokenizer_without_a_chat_template_reads_a_render_by_its_vocabulary(tmp_path):
    """Llama-3.2-1B / Meta-Llama-3-8B base ship no chat template, and their vocabulary has <|start_header_id|> /
    <|eot_id|> as special tokens: a Llama 3 render (a fine-tuning set made for the instruct model, brought to the base)
    was trained spelled out, unsaid. Its turn starts (TURN_STARTS) tell the render: read with its control tokens, one
    BOS; a page naming them mid-text and a text starting with <|eot_id|> (no turn start) stay text. The in-job stream
    (build_token_stream) reads it alike."""
    from data.packing import build_token_stream

    path = _llama3_instruct(tmp_path / "base", base=True)
    tok = Tokenizer(path)
    assert not tok.hf.chat_template and tok.sep_id == tok.eos_id == tok.hf.convert_tokens_to_ids("<|end_of_text|>")
    header = tok.hf.convert_tokens_to_ids("<|start_header_id|>")
    assert tok.rendered_start(LLAMA3) == "<|start_header_id|>"
    assert tok.rendered_start("  <|begin_of_text|>\n<|start_header_id|>user") == "<|start_header_id|>"
    assert tok.rendered_start("<|eot_id|> a quick fox") is None
    page = "Llama 3 writes <|start_header_id|>user<|end_header_id|> before each turn"
    src = _write_jsonl(tmp_path / "t.jsonl", [LLAMA3, page], "text")
    m = prepare([src], str(tmp_path / "o"), path, **QUIET)
    render, text = _docs(tmp_path / "o")
    assert render == tok.encode(LLAMA3) + [tok.sep_id] and render.count(header) == 2 and render.count(tok.bos_id) == 1
    assert header not in text and (m["parsed_text_docs"], m["special_text_docs"]) == (1, 1)
    stream = build_token_stream(src, tok, tok.vocab_size, str(tmp_path / "cache"))[0]
    assert np.load(stream).tolist() == render + text
    # a folder whose tokenizer(text) puts no BOS (no post-processor) but names <|begin_of_text|> its bos_token: the
    # render starts with that string, then the turn start
    spec = json.loads((tmp_path / "base" / "tokenizer.json").read_text())
    (tmp_path / "base" / "tokenizer.json").write_text(json.dumps({**spec, "post_processor": None}))
    bare = Tokenizer(path)
    assert bare.bos_id is None and bare.rendered_start(LLAMA3) == "<|start_header_id|>"
    assert bare.rendered_start("<|begin_of_text|>a quick fox") is None


def test_rendered_start_never_takes_the_bos_unk_pad_or_mask(tmp_path):
    """WikiText's lines start with <unk>; a template may write the pad token (Seed-OSS writes <seed:pad>): a text that
    starts with the unk, pad or mask token is no render, with a template or without one. A text writing its own BOS,
    then plain text, is none either; a sentencepiece model reads no special string from text."""
    from transformers import AutoTokenizer

    tok = Tokenizer(_bos_tokenizer(tmp_path / "bos"))
    assert tok.rendered_start("<s>a quick <s>brown</s> fox") is None and tok.rendered_start(" </s> fox") is None
    path = build_tokenizer(str(tmp_path / "q"), "qwen25")  # pad <pad>; its vocabulary has <unk>, <mask> too
    hf = AutoTokenizer.from_pretrained(path)
    hf.add_special_tokens({"unk_token": "<unk>", "mask_token": "<mask>"})
    hf.chat_template = "{{ '<unk><pad><mask>' }}" + hf.chat_template  # a template naming them all
    hf.save_pretrained(str(tmp_path / "named"))
    for folder, template in ((tmp_path / "named", True), (tmp_path / "bare", False)):
        if not template:
            hf.chat_template = None
            hf.save_pretrained(str(folder))
        t = Tokenizer(str(folder))
        assert bool(t.hf.chat_template) is template and {"<unk>", "<pad>", "<mask>"} <= set(t.specials)
        assert [t.rendered_start(f"{s} = Valkyria = ") for s in ("<unk>", "<pad>", "<mask>")] == [None] * 3
        assert t.rendered_start("<|endoftext|> trailing text") is None  # special, but no turn start
        assert t.rendered_start(CHATML) == "<|im_start|>"
    assert Tokenizer("recipes/base/tiny_passkey256/tokenizer.model").rendered_start("<s><|im_start|>user") is None


def test_turn_starts_cover_every_shipped_template():
    """Every family of data/chat_templates/ rendered (user first, system first; with a tool list where it renders one):
    the special token a render starts with after its BOS is in TURN_STARTS, and the families whose renders start in
    plain text are exactly those named in data/tokenizer.py (their turns are not special tokens): a family added with
    another turn start fails here until TURN_STARTS lists it."""
    import tempfile

    from transformers import AutoTokenizer

    from data.chat_sweep import TOOLS, families
    from data.chat_sweep import build_tokenizer as family_tokenizer

    convs = [[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}],
             [{"role": "system", "content": "Be terse"}, {"role": "user", "content": "Hi"},
              {"role": "assistant", "content": "Yo"}]]
    starts, plain = set(), set()
    with tempfile.TemporaryDirectory() as root:
        for key, fam in families().items():
            hf = AutoTokenizer.from_pretrained(family_tokenizer(root, key, fam))
            kw = {"chat_template": "default"} if isinstance(hf.chat_template, dict) else {}
            for conv in convs:
                try:  # Gemma 2 and Mistral v0.1 refuse a system message
                    text = hf.apply_chat_template(conv, tools=TOOLS["tool list"] if key == "mistral_v03" else None,
                                                  tokenize=False, **kw).lstrip()
                except Exception:  # noqa: BLE001 (the template's raise_exception)
                    continue
                text = text[len(fam["bos"]):].lstrip() if fam.get("bos") and text.startswith(fam["bos"]) else text
                first = [s for s in hf.all_special_tokens if text.startswith(s)]
                if first:
                    starts.add(max(first, key=len))
                else:
                    plain.add(key)
    assert starts <= set(TURN_STARTS) and set(TURN_STARTS) - starts == {"[INST]"}, starts ^ set(TURN_STARTS)
    assert plain == {"llama2", "mistral_v01", "mistral_v02", "mixtral", "olmo2", "zephyr", "vicuna", "seed_oss",
                     "deepseek_v3", "deepseek_r1", "deepseek_v31", "deepseek_r1_0528", "hunyuan_a13b"}, plain


def test_the_in_job_paths_prepare_a_render_and_forget_yesterdays_caches(tmp_path, monkeypatch):
    """train.py's in-job preparation (prepare_data's default, auto) prepares a render with its control tokens instead
    of refusing it naming prepare_data.py; the older in-process stream (build_token_stream) gives the same ids. Their
    cache key moved on (doc6): a cache a template-less tokenizer built under doc5 held renders spelled out."""
    from data import prepare as in_job
    from data.packing import build_token_stream, cache_key
    from data.store import tokenizer_identity

    monkeypatch.setattr(in_job, "CACHE", str(tmp_path / "cache"))
    path = build_tokenizer(str(tmp_path / "tok"), "qwen25")
    tok = Tokenizer(path)
    src = _write_jsonl(tmp_path / "chats.jsonl", [CHATML], "text")
    folder, _ = in_job.prepare_in_job(src, path, tok.vocab_size)
    (doc,) = _docs(folder)
    assert doc == tok.encode(CHATML) + [tok.sep_id]
    assert np.load(build_token_stream(src, tok, tok.vocab_size, str(tmp_path / "s"))[0]).tolist() == doc
    old = hashlib.sha256(f"{tok.vocab_size}:bos2:chat6:eos2:doc5".encode())
    st = os.stat(src)
    old.update(f"{os.path.abspath(src)}:{st.st_size}:{st.st_mtime_ns}".encode())
    old.update(tokenizer_identity(path).encode())
    assert cache_key([src], path, tok.vocab_size) != old.hexdigest()[:16]


def test_the_text_path_leaves_the_tokenizers_special_switch_as_it_was(tmp_path, monkeypatch):
    """transformers leaves its backend's encode_special_tokens at the last call's split_special_tokens: the fallback
    text path (taken where the Rust path's probe disagrees) left it on, and a later direct (Rust) batch of a chat row
    read <|im_start|> as text (a review of the day's change)."""
    from data import tokenizer as tk

    monkeypatch.setattr(tk, "_split_specials", lambda backend, direct, texts: [[-1]] * len(texts))  # the probe fails
    tok = Tokenizer(build_tokenizer(str(tmp_path / "qwen"), "qwen25"))
    start = tok.hf.convert_tokens_to_ids("<|im_start|>")
    assert tok.direct and tok.hf.backend_tokenizer.encode_special_tokens is False
    tok.frame_texts(["a page that mentions <|im_start|> in its text", CHATML], tok.sep_id)
    assert tok.hf.backend_tokenizer.encode_special_tokens is False
    assert tok._encode_batch(["<|im_start|>user"])[0][0] == start


@pytest.mark.parametrize("family", ["llama3", "qwen25"])
def test_a_text_ending_with_the_tokenizers_eos_string_ends_there_once(tmp_path, family):
    """`{"text": doc + tokenizer.eos_token}` (the common form; TRL's add_eos reads it as ended) with an Instruct
    tokenizer: its EOS <|eot_id|> / <|im_end|> is no separator (<|end_of_text|> / <|endoftext|> is), and only the
    separator's string was read at a text's end: every document trained the EOS spelled out as ~10 text pieces, then
    the separator, under a generic note. Now the trailing EOS string is the document's end, the separator written once,
    counted in a note of its own; the same string inside a text stays text. The in-job stream reads it alike."""
    from data.packing import build_token_stream

    path = _llama3_instruct(tmp_path / "tok") if family == "llama3" else build_tokenizer(str(tmp_path / "tok"), family)
    tok = Tokenizer(path)
    eos_s = tok.hf.eos_token
    assert eos_s in ("<|eot_id|>", "<|im_end|>") and tok.sep_id != tok.eos_id
    texts = ["a quick brown fox" + eos_s, "a quick brown fox", f"the {eos_s} token ends a turn"]
    src = _write_jsonl(tmp_path / "t.jsonl", texts, "text")
    lines = []
    m = prepare([src], str(tmp_path / "o"), path, workers=0, log=lines.append)
    ended, plain, mid = _docs(tmp_path / "o")
    want = ([tok.bos_id] if tok.bos_id is not None else []) + tok.encode("a quick brown fox") + [tok.sep_id]
    assert ended == plain == want, tok.hf.convert_ids_to_tokens(ended)
    assert tok.eos_id not in mid and mid[-1] == tok.sep_id and (m["eos_text_docs"], m["special_text_docs"]) == (1, 1)
    said = [x for x in lines if "end with the tokenizer's EOS string" in x]
    assert len(said) == 1 and said[0].startswith("note: 1 text document(s)") and f"(id {tok.sep_id})" in said[0], lines
    stream = build_token_stream(src, tok, tok.vocab_size, str(tmp_path / "cache"))[0]
    assert np.load(stream).tolist() == ended + plain + mid
