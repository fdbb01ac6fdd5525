"""Rows as LLaMA-Factory and multimodal exports write them (an audit against apply_chat_template on its demo files):
an empty tool list ("[]") is no tools, bare tool definitions reach the template as OpenAI's, a filled media column
is refused (this trainer is text-only), v1's per-message `loss_weight` is a reply's flag and its `{"type": "text",
"value": ...}` parts are text. Fixture tokenizers of the sweep's families (data/chat_sweep.py), no network: ~3 s."""

from __future__ import annotations

import json

import numpy as np
import pytest

from data.chat import ChatEncoder
from data.chat_rows import RowError, normalize
from data.chat_sweep import CASES, TOOLS, families
from data.chat_sweep import build_tokenizer as sweep_tokenizer
from data.chat_tools import row_tools
from data.tokenizer import Tokenizer

DEFS = TOOLS["tool list"]  # OpenAI's form
BARE = [d["function"] for d in DEFS]  # LLaMA-Factory's / glaive's: {"name", "description", "parameters"}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("lf_tokenizers"))


def encoder(root: str, key: str) -> ChatEncoder:
    return ChatEncoder(Tokenizer(sweep_tokenizer(root, key, families()[key])))


# ---- F1: "[]" (109 of the 300 rows of LLaMA-Factory's glaive_toolcall demo) is no tools
@pytest.mark.parametrize("value", ["[]", " [ ] ", [], np.array([], dtype=object)])
def test_an_empty_tool_list_is_no_tools(value):
    assert row_tools({"tools": value}) is None


@pytest.mark.parametrize("key", ["llama31", "mistral_v03"])
def test_a_row_with_an_empty_tool_list_encodes_as_one_without(root, key):
    """Llama 3.1 wrote "Environment: ipython" and an empty function list; Mistral v0.3 an empty [AVAILABLE_TOOLS],
    its earlier replies then untrained."""
    enc = encoder(root, key)
    conv = CASES["multi-turn"]
    ids, mask, stats = enc.encode({"messages": conv, "tools": "[]"})
    want_ids, want_mask, _ = enc.encode({"messages": conv})
    assert ids == want_ids and mask.tolist() == want_mask.tolist() and stats["untrained_turns"] == 0


# ---- F2: bare definitions reach the template as a server gives them
def test_a_bare_definition_is_wrapped_as_openais():
    assert row_tools({"tools": json.dumps(BARE)}) == DEFS
    assert row_tools({"tools": DEFS}) == DEFS  # OpenAI's form as given
    cohere = [{"name": "f", "description": "d", "parameter_definitions": {"q": {"type": "str"}}}]
    assert row_tools({"tools": cohere}) == cohere  # Command-R's own form, which its template reads as given


@pytest.mark.parametrize("key", ["qwen25", "llama31", "mistral_v03"])
def test_bare_definitions_train_the_tool_list_a_server_renders(root, key):
    """Qwen2.5 / Llama 3.1 printed the bare JSON (not the list served); Mistral v0.3 reads `tool.function`."""
    enc = encoder(root, key)
    conv = CASES["tool list"]
    ids, mask, _ = enc.encode({"messages": conv, "tools": json.dumps(BARE)})
    want_ids, want_mask, _ = enc.encode({"messages": conv, "tools": DEFS})
    assert ids == want_ids and mask.tolist() == want_mask.tolist()
    served = enc.tok.hf.apply_chat_template(conv, tools=DEFS, tokenize=False, chat_template=enc.template)
    assert enc.tok.hf.decode(ids) == served


# ---- F3: a media column is refused, not dropped (image-grounded replies trained text-only)
_MLLM = [{"role": "user", "content": "<image>Who are they?"},
         {"role": "assistant", "content": "They're Kane and Gretzka from Bayern Munich."}]


@pytest.mark.parametrize("key,value", [("images", ["mllm_demo_data/1.jpg"]), ("image", "coco/0001.jpg"),
                                       ("videos", ["v.mp4"]), ("audios", ["a.wav"]),
                                       ("images", [{"bytes": b"\x89PNG", "path": None}])])
def test_a_filled_media_column_is_refused_in_one_line(key, value):
    with pytest.raises(RowError, match=rf"^{key}: .*text-only.*drop the column and the placeholders, or use a "
                                       "multimodal trainer") as e:
        normalize({"messages": _MLLM, key: value})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("value", [None, [], "", np.array([]), {"bytes": None, "path": None}])
def test_an_empty_media_column_is_no_media(value):
    assert normalize({"messages": _MLLM, "images": value})[1][1]["content"].startswith("They're")


# ---- F4: LLaMA-Factory v1's per-message loss_weight
def _v1(weights: tuple) -> dict:
    texts = ("hi", "Hello! I am X.", "bye", "Bye.")
    return {"messages": [{"role": r, "content": [{"type": "text", "value": t}], "loss_weight": w}
                         for r, t, w in zip(("user", "assistant") * 2, texts, weights)]}


def test_a_reply_with_loss_weight_0_is_context_only(root):
    enc = encoder(root, "qwen25")
    ids, mask, stats = enc.encode(_v1((0.0, 0.0, 0.0, 1.0)))
    assert enc.tok.hf.decode([i for i, m in zip(ids, mask) if m]) == "Bye.<|im_end|>"
    assert stats["flagged_turns"] == 1 and "loss_weight" not in enc.tok.hf.decode(ids)


@pytest.mark.parametrize("weights,match", [((0.0, 0.5, 0.0, 1.0), r"message 1 \(assistant\): loss_weight 0\.5"),
                                           ((1.0, 1.0, 0.0, 1.0), r"message 0 \(user\): loss_weight 1\.0 asks to train")])
def test_a_loss_weight_that_cannot_be_honoured_is_refused(weights, match):
    with pytest.raises(RowError, match=match):
        normalize(_v1(weights))


# ---- F5: v1's {"type": "text", "value": ...} parts are text; its reasoning / tool_call parts named with the fix
def test_v1_value_parts_are_text():
    _, conv, _ = normalize(_v1((0.0, 1.0, 0.0, 1.0)))
    assert [m["content"] for m in conv] == ["hi", "Hello! I am X.", "bye", "Bye."]
    assert [m.get("train") for m in conv] == [None, True, None, True]
    row = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "value": "b"}]},
                        {"role": "tool", "content": [{"type": "text", "value": "[1]"}]},
                        {"role": "assistant", "content": "ok"}]}
    assert [m["content"] for m in normalize(row)[1]] == ["a\nb", "[1]", "ok"]


@pytest.mark.parametrize("part,match", [
    ({"type": "reasoning", "value": "Let me think."}, r"content part 0 is a 'reasoning' part \(LLaMA-Factory v1's\).*"
                                                      "reasoning_content"),
    ({"type": "tool_call", "value": '{"name": "f", "arguments": {}}'}, r"'tool_call' part .*tool_calls"),
    ({"type": "text", "text": "a", "value": "b"}, r"a `text` and a `value` of another text"),
    ({"type": "text"}, r"a text part without its text as a string \(keys \['type'\]\): give it under `text`"),
])
def test_parts_not_read_are_named_with_the_fix(part, match):
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [part]}]}
    with pytest.raises(RowError, match=match) as e:
        normalize(row)
    assert "\n" not in str(e.value) and "not text" not in str(e.value)
