"""Named template sets (Hermes-2-Pro / 3, Command-R / R7B ship `default` + `tool_use`): which one a row takes under
`auto` (data/chat_template.row_template: `tool_use` for a row with tools, as transformers' apply_chat_template picks
it), and a tool row refused by another member names `--chat_template tool_use` (data/chat_tools.tool_use_fix), not
another model's template; rows encoded through the pick as TRL encodes them (a mixed tool dataset,
hermes-function-calling-v1), the export keeping the set. Fixture tokenizers of the sweep's families
(data/chat_sweep.py), no network: ~7 s."""

from __future__ import annotations

import json

import pytest

from data.chat import ChatEncoder
from data.chat_rows import RowError
from data.chat_stops import trained_template
from data.chat_sweep import CASES, TOOLS, build_tokenizer, families
from data.chat_template import row_template
from data.tokenizer import Tokenizer

SET = {"default": "D", "tool_use": "T"}
DEFS = TOOLS["tool list"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("named_tokenizers"))


def encoder(root: str, key: str, template: str = "auto") -> ChatEncoder:
    return ChatEncoder(Tokenizer(build_tokenizer(root, key, families()[key])), template=template)


@pytest.mark.parametrize("row,want", [
    ({"messages": [], "tools": DEFS}, "tool_use"),
    ({"messages": [], "tools": json.dumps([d["function"] for d in DEFS])}, "tool_use"),  # LLaMA-Factory's JSON text
    ({"messages": []}, "auto"), ({"messages": [], "tools": None}, "auto"),
    ({"messages": [], "tools": []}, "auto"), ({"messages": [], "tools": "[]"}, "auto"),  # as a request without tools
])
def test_auto_takes_tool_use_for_a_row_with_tools(row, want):
    assert row_template(SET, "auto", row) == want


@pytest.mark.parametrize("own,template", [
    (SET, "default"), (SET, "tool_use"), (SET, "chatml"),  # a template named: every row
    ({"default": "D", "rag": "R"}, "auto"), ({"tool_use": "T"}, "auto"),  # no `tool_use`; no `default` (refused)
    ("S", "auto"), (None, "auto"),  # one template; none
])
def test_the_template_named_or_a_set_without_both_is_every_rows(own, template):
    assert row_template(own, template, {"messages": [], "tools": DEFS}) == template


def test_a_tools_value_that_is_no_list_is_refused_as_in_any_template():
    with pytest.raises(RowError, match=r"^tools: .* not a list"):
        row_template(SET, "auto", {"messages": [], "tools": {"name": "f"}})


def _refusal(enc: ChatEncoder, row: dict) -> str:
    with pytest.raises(RowError) as e:
        enc.encode(row)
    msg = str(e.value)
    assert len(msg.splitlines()) == 1
    return msg


@pytest.mark.parametrize("row", [
    {"messages": CASES["tool list"], "tools": DEFS},  # the definitions dropped
    {"messages": CASES["tool call"]},  # calls without definitions: `default` does not render them
])
def test_hermes_default_names_its_own_tool_use_for_a_tool_row(root, row):
    """Before: "use a template that takes tools= (Llama 3.1, Qwen2.5 / 3, Mistral v0.3, ...)" / "use a template that
    renders tool_calls", though the tokenizer ships one."""
    msg = _refusal(encoder(root, "hermes_tool_use", "default"), row)
    assert "use --chat_template tool_use (the tokenizer's own template for rows with tools)" in msg
    assert "Llama 3.1" not in msg


@pytest.mark.parametrize("key", ["command_r", "command_r7b"])
def test_command_r_default_names_its_own_tool_use_for_a_tool_turn(root, key):
    """Command-R's `default` refuses a tool turn (roles must alternate); before, nothing said the set has a fix."""
    msg = _refusal(encoder(root, key, "default"), {"messages": CASES["tool list"], "tools": DEFS})
    assert "roles must alternate" in msg and msg.endswith(
        ": use --chat_template tool_use (the tokenizer's own template for rows with tools)")


def test_a_tokenizer_without_a_tool_use_template_keeps_the_other_fix(root):
    msg = _refusal(encoder(root, "qwen2"), {"messages": CASES["tool list"], "tools": DEFS})
    assert "use a template that takes tools= (Llama 3.1" in msg and "tool_use" not in msg


# --- rows through the pick (data/chat.py ChatEncoder.named) ---

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
