"""`scripts/prepare_data.py --chat_template FILE`: a user's own jinja template (TRL's `chat_template_path`, Axolotl's
`chat_template_jinja`; a base model taught a format of its own, a fixed copy of a template that fails). Before, a
path was taken for a named template's name and refused ("has no named templates"), and TRL's flag was pointed at a
--chat_template that takes no file. Now the file's text is what the manifest records and what the run, its export
(trained_template) and evaluate.py render with; a file that is not there, holds no template or does not compile is
one line before any work, nothing written."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from data.chat import ChatEncoder
from data.chat_stops import reply_stops, trained_template
from data.chat_sweep import check
from data.prepare_data import main
from data.store import Prepared
from data.tokenizer import Tokenizer
from tests.unit.data.chat_fixtures import build_tokenizer

# an Alpaca-style format no tokenizer of the fixtures ships; its marked copy is the oracle (HF's assistant mask)
ALPACA = ("{%- for m in messages %}{%- if m['role'] == 'system' %}{{ m['content'] + '\\n\\n' }}"
          "{%- elif m['role'] == 'user' %}{{ '### Instruction:\\n' + m['content'] + '\\n\\n' }}"
          "{%- elif m['role'] == 'assistant' %}{{ '### Response:\\n' }}{% generation %}{{ m['content'] + eos_token }}"
          "{% endgeneration %}{{ '\\n\\n' }}{%- endif %}{%- endfor %}"
          "{%- if add_generation_prompt %}{{ '### Response:\\n' }}{%- endif %}")
PLAIN = ALPACA.replace("{% generation %}", "").replace("{% endgeneration %}", "")
CONV = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": "the quick fox"}, {"role": "user", "content": "how are you today"},
        {"role": "assistant", "content": "the lazy dog"}]


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("toks"))
    return {f: build_tokenizer(root, f) for f in ("llama3", "none")}


@pytest.mark.parametrize("family", ["llama3", "none"])  # over a tokenizer's own template, and one without any
def test_a_template_file_trains_exactly_its_replies_and_travels_with_the_run(tmp_path, toks, family):
    path = toks[family]
    tpl = tmp_path / "alpaca.jinja"
    tpl.write_text(PLAIN)
    rows = tmp_path / "chats.jsonl"
    rows.write_text(json.dumps({"messages": CONV}) + "\n")
    out = str(tmp_path / "prepared")
    assert main(["--input", str(rows), "--output", out, "--tokenizer_name_or_path", path, "--workers", "0",
                 "--chat_template", str(tpl)]) == 0
    p = Prepared(out)
    assert p.manifest["chat_template"] == PLAIN  # the text, not the path: a file moved or edited later changes nothing
    tok = Tokenizer(path)
    ids = p.tokens.read(0, int(p.lens[0])).tolist()
    mask = p.mask.read(0, int(p.lens[0]))
    enc = ChatEncoder(tok, "assistant", p.manifest["chat_template"])
    assert check(enc, ALPACA, CONV) == "trains"  # the sweep's property: HF's assistant mask of the marked copy
    got = enc.encode({"messages": CONV})[:2]
    assert got[0] == ids[:len(got[0])] and np.array_equal(np.asarray(got[1]), mask[:len(got[1])])
    want = ["the quick fox" + tok.hf.eos_token, "the lazy dog" + tok.hf.eos_token]
    runs = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))  # each trained run's [start, end)
    assert [tok.decode(ids[a:b]) for a, b in zip(runs[::2], runs[1::2])] == want
    # what the run records for its export and its stops (data/pipeline.py calls these with the manifest's value)
    assert trained_template(path, p.manifest["chat_template"]) == PLAIN
    assert reply_stops(path, p.manifest["chat_template"]) == [tok.eos_id]
    # evaluate.py asks the checkpoint in it (trainer.json's trained_template), named in its line
    from scripts.evaluate import chat_encoder, trained_as
    from training.eval_report import asked

    mode = trained_as(tok, PLAIN)
    assert mode == PLAIN and chat_encoder(tok, mode)._text(CONV[1:2], gen=True).startswith("### Instruction:\n")
    assert asked("trained") == "chat (the template file its run was prepared with)"
    # the same command with the file edited: another preparation, one line, nothing touched
    tpl.write_text(PLAIN.replace("### Response", "### Answer"))
    before = sorted(os.listdir(out))
    assert main(["--input", str(rows), "--output", out, "--tokenizer_name_or_path", path, "--workers", "0",
                 "--chat_template", str(tpl)]) == 2
    assert sorted(os.listdir(out)) == before


def test_a_folder_or_a_json_gives_the_template_it_ships(tmp_path, toks):
    from data.chat_template import given_template
    from tests.unit.data.chat_fixtures import LLAMA3

    assert given_template(toks["llama3"]) == LLAMA3  # TRL's chat_template_path takes a tokenizer folder
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": PLAIN}))
    assert given_template(str(tmp_path / "tokenizer_config.json")) == PLAIN
    assert given_template(str(tmp_path)) == PLAIN
    for value in ("auto", "chatml", "none", "tool_use"):  # a choice or a name: as given
        assert given_template(value) == value


@pytest.mark.parametrize("name, content, said", [
    ("missing.jinja", None, "no such file"),
    ("empty_dir", "DIR", "has no chat_template.jinja"),
    ("named.json", json.dumps({"chat_template": [{"name": "default", "template": "{{ x }}"}]}),
     "no `chat_template` string in this JSON"),
    ("notes.txt", "just some notes", "holds no jinja"),
    ("broken.jinja", "{% for m in messages %}\n{{ m['content'] }}", "line 2: Unexpected end of template"),
])
def test_a_bad_template_file_is_one_line_before_any_work(tmp_path, toks, capsys, name, content, said):
    value = tmp_path / name
    if content == "DIR":
        value.mkdir()
    elif content is not None:
        value.write_text(content)
    rows = tmp_path / "chats.jsonl"
    rows.write_text(json.dumps({"messages": CONV}) + "\n")
    out = tmp_path / "prepared"
    assert main(["--input", str(rows), "--output", str(out), "--tokenizer_name_or_path", toks["llama3"],
                 "--workers", "0", "--chat_template", str(value)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: --chat_template {value}: ") and said in err and "\n" not in err, err
    assert not out.exists()


def test_a_template_file_needs_a_hugging_face_tokenizer(tmp_path):
    from tests.unit.data.test_prepare_data import _SP

    with pytest.raises(ValueError, match=r"^--chat_template FILE: tokenizer \S+ is no Hugging Face tokenizer folder"):
        ChatEncoder(Tokenizer(_SP), "assistant", PLAIN)


def test_a_text_rendered_in_the_files_format_is_read_as_a_render(tmp_path, toks):
    """A text document starting with a turn start (`--text_specials auto`) is a render, read with its control tokens,
    where the template writes that token: the tokenizer's own template alone was asked, so over a Llama 3 tokenizer a
    text rendered in the run's own format (a ChatML FILE) was split into plain pieces, beside chat rows of that very
    format trained with the control token."""
    from tests.unit.data.chat_fixtures import QWEN25

    tpl = tmp_path / "chatml.jinja"
    tpl.write_text(QWEN25)
    text = "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\nthe quick fox<|im_end|>\n"
    rows = tmp_path / "mixed.jsonl"
    rows.write_text(json.dumps({"text": text}) + "\n" + json.dumps({"messages": CONV}) + "\n")
    out = str(tmp_path / "prepared")
    assert main(["--input", str(rows), "--output", out, "--tokenizer_name_or_path", toks["llama3"], "--workers", "0",
                 "--chat_template", str(tpl)]) == 0
    p = Prepared(out)
    start = Tokenizer(toks["llama3"]).hf.convert_tokens_to_ids("<|im_start|>")
    first = p.tokens.read(0, int(p.lens[0])).tolist()  # the text: the input's first row
    assert first.count(start) == 2 and p.manifest["parsed_text_docs"] == 1, (first, p.manifest)
