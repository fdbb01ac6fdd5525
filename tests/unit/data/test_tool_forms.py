"""Tool definitions in the forms public traces and APIs write them reach the template as OpenAI's (data/chat_tools.py
row_tools): Anthropic's / Claude traces' `input_schema` and MCP's `inputSchema` named `parameters` (the same JSON
Schema; wrapped as they were, gpt-oss offered `() => any`, Mistral v0.3 printed "input_schema"), the Responses API's
flat `{"type": "function", "name": ...}` nested, any other key refused in one line; an empty list ("[]") is no tools
except for a template that renders only with a tool list (Hermes' and Command-R's `tool_use`), which gets [] as
before. Fixture tokenizers of the sweep's families (data/chat_sweep.py), no network: ~3 s."""

from __future__ import annotations

import json

import pytest

from data.chat import ChatEncoder
from data.chat_rows import RowError
from data.chat_sweep import CASES, TOOLS, families
from data.chat_sweep import build_tokenizer as sweep_tokenizer
from data.chat_tools import row_tools
from data.tokenizer import Tokenizer

DEFS = TOOLS["tool list"]  # OpenAI's form
FN = DEFS[0]["function"]
ANTHROPIC = [{"name": FN["name"], "description": FN["description"], "input_schema": FN["parameters"]}]
FORMS = {
    "anthropic": ANTHROPIC,
    "anthropic custom": [{"type": "custom", **ANTHROPIC[0]}],
    "mcp": [{"name": FN["name"], "description": FN["description"], "inputSchema": FN["parameters"]}],
    "responses flat": [{"type": "function", **FN}],
    "bare": [FN],
}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tool_form_tokenizers"))


def encoder(root: str, key: str) -> ChatEncoder:
    fam = families()[key]
    return ChatEncoder(Tokenizer(sweep_tokenizer(root, key, fam)), template=fam.get("template", "auto"))


@pytest.mark.parametrize("form", list(FORMS))
def test_each_form_is_openais_definition(form):
    assert row_tools({"tools": FORMS[form]}) == DEFS
    assert row_tools({"tools": json.dumps(FORMS[form])}) == DEFS
    assert list(row_tools({"tools": FORMS[form]})[0]["function"]) == ["name", "description", "parameters"]  # in place


@pytest.mark.parametrize("key", ["gpt_oss", "gemma4", "mistral_v03", "qwen25"])
def test_anthropic_mcp_and_flat_definitions_train_the_tool_list_a_server_renders(root, key):
    """Wrapped as they were, gpt-oss offered `type count_words = () => any;`, Gemma 4 no parameters, Mistral v0.3
    printed "input_schema", while the replies call the function with arguments."""
    enc = encoder(root, key)
    conv = CASES["tool list"]
    want_ids, want_mask, _ = enc.encode({"messages": conv, "tools": DEFS})
    for form in ("anthropic", "mcp", "responses flat"):
        ids, mask, _ = enc.encode({"messages": conv, "tools": FORMS[form]})
        assert ids == want_ids and mask.tolist() == want_mask.tolist(), form


@pytest.mark.parametrize("tool,named", [
    ({**ANTHROPIC[0], "cache_control": {"type": "ephemeral"}}, "['input_schema', 'cache_control']"),  # its caching
    ({"name": "f", "title": "F", "description": "d", "inputSchema": {}}, "['title', 'inputSchema']"),  # MCP's title
    ({"name": "f", "parameters": {}, "returns": {"type": "int"}}, "['returns']"),
    ({"type": "function", "name": "f", "input_schema": {}, "parameters": {}}, "['input_schema']"),
])
def test_a_definition_with_keys_openai_has_not_is_refused_in_one_line(tool, named):
    with pytest.raises(RowError) as e:
        row_tools({"tools": [{"name": "ok", "parameters": {}}, tool]})
    msg = str(e.value)
    assert len(msg.splitlines()) == 1 and msg.startswith("tools[1]: ") and named in msg and '"function": {' in msg


@pytest.mark.parametrize("tool", [
    DEFS[0], {**DEFS[0], "function": {**FN, "returns": "int"}},  # OpenAI's nested form: as given, whatever it holds
    {"name": "f", "description": "d", "parameter_definitions": {"q": {"type": "str"}}},  # Cohere's (Command-R reads it)
    {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},  # a provider's hosted tool
    {"type": "custom", "name": "code_exec", "description": "Runs code"},  # OpenAI's free-text custom tool
])
def test_other_forms_stay_as_given(tool):
    assert row_tools({"tools": [tool]}) == [tool]


# ---- "[]": no tools, except where the template renders only with a tool list
@pytest.mark.parametrize("key", ["hermes_tool_use", "command_r_tool_use"])
def test_an_empty_tool_list_is_given_to_a_template_that_renders_only_with_a_list(root, key):
    """Glaive / LLaMA-Factory tool sets hold "[]" on about a third of their rows; passed as None, Hermes' and
    Command-R's `tool_use` (they iterate `tools`) refused every such row, and one stops the preparation."""
    enc = encoder(root, key)
    assert row_tools({"tools": "[]"}, enc, CASES["multi-turn"]) == []


def test_a_row_with_an_empty_tool_list_encodes_with_hermes_tool_use(root):
    """Before "[]" was read as no tools it encoded (473 tokens, 8 trained); then it was refused.
    (Command-R's `tool_use` writes text after the last message: its turns are not located either way.)"""
    enc = encoder(root, "hermes_tool_use")
    conv = CASES["multi-turn"]
    ids, mask, stats = enc.encode({"messages": conv, "tools": "[]"})
    served = enc.tok.hf.apply_chat_template(conv, tools=[], tokenize=False, chat_template=enc.template)
    assert enc.tok.hf.decode(ids) == served and stats["untrained_turns"] == 0 and mask.sum() > 0


@pytest.mark.parametrize("key", ["llama31", "mistral_v03"])
def test_an_empty_tool_list_stays_no_tools_where_the_template_renders_without(root, key):
    enc = encoder(root, key)
    assert row_tools({"tools": "[]"}, enc, CASES["multi-turn"]) is None
    assert row_tools({"tools": []}, enc, ("a prompt", "a completion")) is None  # a text pair renders no template
