"""Conversations brought pre-rendered as text (a "text" column already formatted with the chat template, as TRL's
SFTTrainer and `tokenizer(text)` read it): since special-token strings in a text are read as text, such a text would
train its template's tokens spelled out in pieces. A text that starts with a special-token string (after the BOS
string and whitespace) is refused in one line naming file:row, `messages` and `--text_specials parse`; `parse` reads
them as control tokens; a special-token string mid-text stays text. Small local tokenizers, one process."""

from __future__ import annotations

import json

import pytest

from data.prepare_data import main, prepare
from data.tokenizer import Tokenizer
from tests.unit.data.chat_fixtures import build_tokenizer
from tests.unit.data.test_prepare_data import _bos_tokenizer, _write_jsonl
from tests.unit.data.test_prepare_documents import QUIET, _docs, _llama3_instruct

CHATML = "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\nHi<|im_end|>\n"
LLAMA3 = ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHello there<|eot_id|><|start_header_id|>"
          "assistant<|end_header_id|>\n\nHi<|eot_id|>")


def _one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_a_pre_rendered_chatml_text_is_refused_naming_its_row_and_both_fixes(tmp_path, capsys):
    """Qwen2.5's ChatML render saved as text, the second row of a file: every <|im_start|> / <|im_end|> became
    pieces of text (the model trained on a format it never sees). Refused in one line, --skip_bad_rows or not."""
    path = build_tokenizer(str(tmp_path / "tok"), "qwen25")
    src = _write_jsonl(tmp_path / "t.jsonl", ["a plain web page", CHATML], "text")
    for extra in ([], ["--skip_bad_rows"]):
        err = _one_line_error(capsys, ["--input", src, "--output", str(tmp_path / f"o{len(extra)}"),
                                       "--tokenizer_name_or_path", path, "--workers", "0", *extra])
        assert f"{src}:2: a text that starts with the special-token string <|im_start|>" in err, err
        assert "`messages` row" in err and "docs/sft.md" in err and err.endswith(
            "--text_specials parse to read special-token strings in text as control tokens"), err
        assert "--skip_bad_rows" not in err


def test_text_specials_parse_reads_them_as_control_tokens_and_is_recorded(tmp_path):
    """--text_specials parse: the render's special-token strings are its control tokens (tokenizer(text)'s reading),
    the separator appended; the manifest and the plan record it, and a resume under the other reading is refused."""
    path = build_tokenizer(str(tmp_path / "tok"), "qwen25")
    tok = Tokenizer(path)
    src = _write_jsonl(tmp_path / "t.jsonl", [CHATML, "code with <|endoftext|> inside"], "text")
    out = str(tmp_path / "out")
    lines = []
    m = prepare([src], out, path, workers=0, log=lines.append, text_specials="parse")
    chat, code = _docs(out)
    assert chat == tok.encode(CHATML) + [tok.sep_id] and chat.count(tok.hf.convert_tokens_to_ids("<|im_start|>")) == 2
    assert code == tok.encode("code with <|endoftext|> inside") + [tok.sep_id]
    assert m["text_specials"] == "parse" and m["special_text_docs"] == 2
    assert len([x for x in lines if "read as control tokens (--text_specials parse)" in x]) == 1
    with pytest.raises(ValueError, match=r"differs in \['text_specials'\]"):
        prepare([src], out, path, **QUIET)  # the default reading: another preparation
    plain, o2 = str(_write_jsonl(tmp_path / "p.jsonl", ["plain"], "text")), tmp_path / "o2"
    assert prepare([plain], str(o2), path, **QUIET)["text_specials"] == "text"
    plan = json.loads((o2 / "plan-s00000.json").read_text())
    (o2 / "plan-s00000.json").write_text(json.dumps({**plan, "text_specials": "as text"}))  # stopped before this rule
    with pytest.raises(ValueError, match=r"differs in \['text_specials'\]"):
        prepare([plain], str(o2), path, **QUIET)


@pytest.mark.parametrize("text", [LLAMA3, "  <|begin_of_text|>\n<|start_header_id|>user<|end_header_id|>\n\nhi"])
def test_a_render_after_its_bos_is_refused_and_mid_text_specials_stay_text(tmp_path, capsys, text):
    """Llama 3's render starts with its BOS string, then <|start_header_id|>: refused (whitespace around the BOS too).
    A text holding the same strings after its start (a page about the template) is text, counted, as before."""
    path = _llama3_instruct(tmp_path / "tok")
    tok = Tokenizer(path)
    assert tok.rendered_start(text) == "<|start_header_id|>"
    src = _write_jsonl(tmp_path / "t.jsonl", [text], "text")
    err = _one_line_error(capsys, ["--input", src, "--output", str(tmp_path / "o"), "--tokenizer_name_or_path", path,
                                   "--workers", "0"])
    assert f"{src}:1: a text that starts with the special-token string <|start_header_id|>" in err, err
    about = "Llama 3 writes <|start_header_id|>user<|end_header_id|> before each turn"
    m = prepare([_write_jsonl(tmp_path / "a.jsonl", [about, "<|begin_of_text|>a quick fox"], "text")],
                str(tmp_path / "a"), path, **QUIET)
    page, own_bos = _docs(tmp_path / "a")
    header = tok.hf.convert_tokens_to_ids("<|start_header_id|>")
    assert m["special_text_docs"] == 1 and header not in page and own_bos.count(tok.bos_id) == 1


def test_a_text_starting_with_the_bos_string_alone_is_not_a_render(tmp_path):
    """A text that writes its own BOS and then plain text (`<s>a quick ...`, a Mistral-like BOS) keeps its one BOS,
    as before; a sentencepiece model reads no special string from text: never refused."""
    tok = Tokenizer(_bos_tokenizer(tmp_path / "bos"))
    assert tok.rendered_start("<s>a quick <s>brown</s> fox") is None
    # a special string the tokenizer's chat template never writes (</s>, <unk> as WikiText's lines start, <pad>) first:
    # text, not a render
    assert tok.rendered_start(" </s> fox") is None
    qwen = Tokenizer(build_tokenizer(str(tmp_path / "qwen"), "qwen25"))
    assert qwen.rendered_start("<|endoftext|> trailing text") is None  # special, but no turn of its template
    assert qwen.rendered_start("<|im_start|>user\nhi<|im_end|>") == "<|im_start|>"
    sp = Tokenizer("recipes/base/tiny_passkey256/tokenizer.model")
    assert sp.rendered_start("<s><|im_start|>user") is None


def test_the_in_job_paths_refuse_it_naming_prepare_data_and_the_flag(tmp_path, monkeypatch):
    """train.py has no --text_specials: its in-job preparation (the default reading) refuses the render naming
    scripts/prepare_data.py with --text_specials parse; the older in-process stream (build_token_stream) refuses it
    with its file:line too (it trained the tokens spelled out)."""
    from data import prepare as in_job
    from data.packing import build_token_stream

    monkeypatch.setattr(in_job, "CACHE", str(tmp_path / "cache"))
    path = build_tokenizer(str(tmp_path / "tok"), "qwen25")
    src = str(tmp_path / "chats.jsonl")
    with open(src, "w") as fh:
        fh.write(json.dumps({"text": CHATML}) + "\n")
    with pytest.raises(ValueError) as e:
        in_job.prepare_in_job(src, path, 1000)
    msg = str(e.value)
    assert "\n" not in msg and f"{src}:1: a text that starts with the special-token string <|im_start|>" in msg, msg
    assert f"python scripts/prepare_data.py --input {src} --output DIR --tokenizer_name_or_path {path} " \
           "--text_specials parse" in msg and msg.endswith("then pass --dataset_path DIR"), msg
    with pytest.raises(ValueError, match=rf"^{src}:1: a text that starts with .*--text_specials parse"):
        build_token_stream(src, Tokenizer(path), 1000, str(tmp_path / "stream"))


def test_the_text_path_leaves_the_tokenizers_special_switch_as_it_was(tmp_path, monkeypatch):
    """transformers leaves its backend's encode_special_tokens at the last call's split_special_tokens: the fallback
    text path (taken where the Rust path's probe disagrees) left it on, and a later direct (Rust) batch of a chat row
    read <|im_start|> as text (a review of the day's change)."""
    from data import tokenizer as tk

    monkeypatch.setattr(tk, "_split_specials", lambda backend, direct, texts: [[-1]] * len(texts))  # the probe fails
    tok = Tokenizer(build_tokenizer(str(tmp_path / "qwen"), "qwen25"))
    start = tok.hf.convert_tokens_to_ids("<|im_start|>")
    assert tok.direct and tok.hf.backend_tokenizer.encode_special_tokens is False
    tok.frame_texts(["a page that mentions <|im_start|> in its text"], tok.sep_id)
    assert tok.hf.backend_tokenizer.encode_special_tokens is False
    assert tok._encode_batch(["<|im_start|>user"])[0][0] == start
