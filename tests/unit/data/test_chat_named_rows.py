"""`auto` over a named set picks per row (data/chat.py ChatEncoder.named, data/chat_template.row_template): a row
with tools is rendered by the set's `tool_use`, one without by `default`, as transformers' apply_chat_template
(which TRL calls with each row's tools) and vLLM render them, so a mixed tool dataset (hermes-function-calling-v1)
trains as TRL trains it; the export keeps the set. Fixture tokenizers of the sweep's families, no network: ~4 s."""

from __future__ import annotations

import pytest

from data.chat import ChatEncoder
from data.chat_rows import RowError
from data.chat_stops import trained_template
from data.chat_sweep import CASES, TOOLS, build_tokenizer, families
from data.tokenizer import Tokenizer

DEFS = TOOLS["tool list"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("named_row_tokenizers"))


def encoder(root: str, key: str, template: str = "auto") -> ChatEncoder:
    return ChatEncoder(Tokenizer(build_tokenizer(root, key, families()[key])), template=template)


@pytest.mark.parametrize("key", ["hermes_tool_use", "command_r7b"])
def test_auto_renders_each_row_as_transformers_picks_its_template(root, key):
    """Before, every row took `default`: each one with tools was refused (Hermes: "use a template that takes tools=
    (Llama 3.1, ...)"; R7B: roles must alternate), though the tokenizer ships the template for it."""
    enc = encoder(root, key)
    hf = enc.tok.hf
    for row in ({"messages": CASES["tool list"], "tools": DEFS}, {"messages": CASES["multi-turn"]}):
        ids, mask, stats = enc.encode(row)
        assert hf.decode(ids) == hf.apply_chat_template(row["messages"], tools=row.get("tools"), tokenize=False)
        assert stats["untrained_turns"] == 0 and mask.sum() > 0
    assert enc.encode({"messages": CASES["multi-turn"]})[0] == encoder(root, key, "default").encode(
        {"messages": CASES["multi-turn"]})[0]
    with_tools = {"messages": CASES["tool list"], "tools": DEFS}
    got, want = enc.encode(with_tools), encoder(root, key, "tool_use").encode(with_tools)
    assert got[0] == want[0] and got[1].tolist() == want[1].tolist()


def test_an_empty_tool_list_stays_on_default(root):
    """As a request without tools is served (transformers alone would take `tool_use` for `tools=[]`)."""
    enc = encoder(root, "hermes_tool_use")
    row = {"messages": CASES["multi-turn"], "tools": "[]"}
    assert enc.encode(row)[0] == encoder(root, "hermes_tool_use", "default").encode(row)[0]


def test_a_tool_row_tool_use_refuses_is_refused_by_tool_use(root):
    """Command-R's `tool_use` writes text after the last message: its refusal, not `default`'s."""
    with pytest.raises(RowError, match=r"`tool_use` template"):
        encoder(root, "command_r").encode({"messages": CASES["tool list"], "tools": DEFS})


def test_an_auto_run_exports_the_set(root):
    assert trained_template(build_tokenizer(root, "hermes_tool_use", families()["hermes_tool_use"]), "auto") is None
