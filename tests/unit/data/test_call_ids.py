"""Tool-call ids given where the template needs them (data/chat_tools.call_ids): Mistral v0.3 / Small 3.2 raise on a
call or a result without a 9-character id (every LLaMA-Factory ShareGPT function_call row, OpenAI-form rows without
ids); Apriel-1.6 writes an id only when the reply is not last, so a call given one was untrained there. Fixture
tokenizers of the sweep's families (data/chat_sweep.py), no network: ~3 s."""

from __future__ import annotations

import json

import numpy as np
import pytest

from data.chat import ChatEncoder
from data.chat_sweep import TOOLS, families
from data.chat_sweep import build_tokenizer as sweep_tokenizer
from data.chat_tools import _needs_ids, call_ids
from data.tokenizer import Tokenizer

CALL = {"name": "count_words", "arguments": {"text": "apple river"}}
SHAREGPT = {"conversations": [{"from": "human", "value": "How many words in apple river?"},
                              {"from": "function_call", "value": json.dumps(CALL)},
                              {"from": "observation", "value": "2"}, {"from": "gpt", "value": "2 words"}],
            "tools": json.dumps([TOOLS["tool list"][0]["function"]])}  # LLaMA-Factory's: a JSON string, bare
OPENAI = {"messages": [{"role": "user", "content": "How many words in apple river?"},
                       {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": CALL}]},
                       {"role": "tool", "content": "2"}, {"role": "assistant", "content": "2 words"}],
          "tools": TOOLS["tool list"]}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("call_id_tokenizers"))


def encoder(root: str, key: str) -> ChatEncoder:
    fam = families()[key]
    return ChatEncoder(Tokenizer(sweep_tokenizer(root, key, fam)), "auto", fam.get("template", "auto"))


def trained(enc: ChatEncoder, row: dict) -> tuple[list[str], dict]:
    ids, mask, stats = enc.encode(json.loads(json.dumps(row)))
    e = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    return [enc.tok.hf.decode(ids[a:b]) for a, b in zip(e[::2], e[1::2])], stats


@pytest.mark.parametrize("key,call", [
    ("mistral_v03", '[TOOL_CALLS] [{"name": "count_words", "arguments": {"text": "apple river"}, "id": "c00000000"}]</s>'),
    ("mistral_small32", '[TOOL_CALLS]count_words[CALL_ID]c00000000[ARGS]{"text": "apple river"}</s>')])
@pytest.mark.parametrize("row", [SHAREGPT, OPENAI], ids=["sharegpt", "openai"])
def test_calls_without_ids_train_where_the_template_needs_ids(root, key, call, row):
    """Both templates raised on a call without an id: every such row refused (OpenAI's since ever, ShareGPT's until
    f0707ed gave ids in the conversion, which cost Apriel-1.6 its call turn)."""
    got, stats = trained(encoder(root, key), row)
    assert got[0] == call and got[1].strip() == "2 words</s>" and stats["untrained_turns"] == 0, (got, stats)


@pytest.mark.parametrize("key", ["mistral_v03", "mistral_small32"])
def test_a_row_with_ids_keeps_its_own(root, key):
    row = json.loads(json.dumps(OPENAI))
    row["messages"][1]["tool_calls"][0]["id"], row["messages"][2]["tool_call_id"] = "abcDEF123", "abcDEF123"
    got, stats = trained(encoder(root, key), row)
    assert "abcDEF123" in got[0] and "c00000000" not in got[0] and stats["untrained_turns"] == 0, (got, stats)


@pytest.mark.parametrize("key", ["apriel16", "apriel16_training"])
@pytest.mark.parametrize("row", [SHAREGPT, OPENAI], ids=["sharegpt", "openai"])
def test_apriel_trains_a_call_turn_without_ids_as_before(root, key, row):
    """Apriel-1.6 writes `"id": ...` only when the call is not the last message: with ids given in the ShareGPT
    conversion the prefix render and the conversation differed and the call turn went untrained, counted."""
    got, stats = trained(encoder(root, key), row)
    assert got == ['\n<tool_calls>[{"name": "count_words", "arguments": {"text": "apple river"}}]</tool_calls>\n<|end|>',
                   "2 words"] and stats["untrained_turns"] == 0, (got, stats)


def test_the_probe_reads_which_templates_need_ids(root):
    got = {k: _needs_ids(encoder(root, k)) for k in ("mistral_v03", "mistral_small32", "apriel16", "qwen25", "llama31")}
    assert got == {"mistral_v03": True, "mistral_small32": True, "apriel16": False, "qwen25": False, "llama31": False}


def test_ids_by_position_results_in_order_own_ids_kept(root):
    enc = encoder(root, "mistral_v03")
    call = {"type": "function", "function": CALL}
    conv = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "tool_calls": [call, {**call, "id": "c00000001"}, call]},
            {"role": "tool", "content": "a"}, {"role": "tool", "content": "b", "tool_call_id": "c00000001"},
            {"role": "tool", "content": "c"}, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": "d"}, {"role": "assistant", "content": "done"}]
    out = call_ids(enc, conv)
    assert [c["id"] for c in out[1]["tool_calls"]] == ["c00000000", "c00000001", "c00000002"]  # none a call's own
    assert [m.get("tool_call_id") for m in out[2:5]] == ["c00000000", "c00000001", "c00000002"]
    assert out[5]["tool_calls"][0]["id"] == out[6]["tool_call_id"] == "c00000003"
    assert "id" not in conv[1]["tool_calls"][0] and "tool_call_id" not in conv[2]  # the row itself untouched
    assert call_ids(encoder(root, "qwen25"), conv) is conv  # a template that takes calls without ids: as given
