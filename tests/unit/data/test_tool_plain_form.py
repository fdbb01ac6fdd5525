"""A template that reads a tool definition's function object (`tool.name`, `tool.description`: Apertus-8B-Instruct-2509
as shipped) gets the row's `tools` in that plain form where OpenAI's `{"type": "function", "function": {...}}` fails
(data/chat_tools.py `_fitted`); before, every form was wrapped and the row refused with the raw Jinja error. Fixture
tokenizers of the sweep's families (data/chat_sweep.py), no network: ~3 s."""

from __future__ import annotations

import pytest

from data.chat import ChatEncoder, RowError
from data.chat_sweep import CASES, TOOLS, build_tokenizer, check, families, marked, native
from data.chat_tools import row_tools
from data.tokenizer import Tokenizer

CONV = CASES["tool list"]  # a question, a tool call, its result, a reply
DEFS = TOOLS["tool list"]  # OpenAI's form
PLAIN = [t["function"] for t in DEFS]  # the function objects (LLaMA-Factory's, glaive's bare definitions)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("plain_tool_tokenizers"))


def encoder(root: str, key: str) -> ChatEncoder:
    return ChatEncoder(Tokenizer(build_tokenizer(root, key, families()[key])), "assistant")


@pytest.mark.parametrize("given", [DEFS, PLAIN], ids=["openai", "plain"])
def test_apertus_trains_a_row_with_tools_in_either_form(root, given):
    fam = families()["apertus"]
    enc = encoder(root, "apertus")
    conv = native(CONV, fam)  # its arguments as JSON text, the form Apertus concatenates
    ids, mask, stats = enc.encode({"messages": conv, "tools": given})
    text = enc.tok.hf.decode(ids)
    assert "// Count the words of a text" in text and "type count_words" in text  # the definition, rendered
    trained = enc.tok.hf.decode([i for i, m in zip(ids, mask) if m])
    assert "count_words" in trained and "Count the words" not in trained  # the call trains, the definition never
    # the sweep's property (ids = the template's rendering, every supervised token inside a reply's marked region,
    # the untrained turn counted) against the marked template given the plain form
    assert check(enc, marked(fam), conv, PLAIN, conv).startswith("trains 1 of 2: message 3"), stats
    assert row_tools({"tools": given}, enc, conv) == PLAIN


def test_a_template_that_reads_openais_form_keeps_it(root):
    enc = encoder(root, "qwen25")
    assert row_tools({"tools": PLAIN}, enc, CONV) == DEFS  # wrapped, as the server gives it


def test_a_definition_neither_form_renders_is_refused_in_one_line_naming_both(root):
    enc = encoder(root, "apertus")
    bare = [{"name": "count_words", "parameters": PLAIN[0]["parameters"]}]  # no description: "// " + undefined
    with pytest.raises(RowError) as e:
        enc.encode({"messages": native(CONV, families()["apertus"]), "tools": bare})
    msg = str(e.value)
    assert "\n" not in msg and "both forms tried" in msg and "OpenAI's" in msg and "the plain" in msg, msg
    assert "tools ['count_words']" in msg
