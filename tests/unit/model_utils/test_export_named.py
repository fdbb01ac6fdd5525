"""The export of a run trained with `--chat_template tool_use` over a named set (Hermes-2-Pro / 3, Command R7B): the
whole set kept (model_utils/export_tokenizer.py), so a server picks `tool_use` for a request with tools and `default`
without, as transformers' apply_chat_template does. Fixture tokenizers of the sweep's families, no network: ~2 s."""

from __future__ import annotations

import json
import os

import pytest

from data.chat_sweep import TOOLS, build_tokenizer, families
from model_utils.export_tokenizer import export_tokenizer

MSGS = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("key", ["hermes_tool_use", "command_r7b"])
def test_a_tool_use_run_exports_the_whole_named_set(tmp_path, key):
    """Before, the set was replaced by `tool_use` alone: Hermes' raised on every request without tools ('NoneType'
    object is not iterable), R7B's wrote its tool preamble into them."""
    from transformers import AutoTokenizer

    src = build_tokenizer(str(tmp_path), key, families()[key])
    own = AutoTokenizer.from_pretrained(src).chat_template
    out = str(tmp_path / "out")
    export_tokenizer(src, out, own["tool_use"], None)
    got = AutoTokenizer.from_pretrained(out)
    assert got.chat_template == own
    plain = got.apply_chat_template(MSGS, tokenize=False, add_generation_prompt=True)
    assert plain == got.apply_chat_template(MSGS, tokenize=False, add_generation_prompt=True,
                                            chat_template=own["default"])
    tools = TOOLS["tool list"]
    assert got.apply_chat_template(MSGS, tools=tools, tokenize=False, add_generation_prompt=True) == \
        got.apply_chat_template(MSGS, tools=tools, tokenize=False, add_generation_prompt=True,
                                chat_template=own["tool_use"])
    inline = json.load(open(os.path.join(out, "tokenizer_config.json")))["chat_template"]  # 4.x's form too
    assert [t["name"] for t in inline] == ["default", "tool_use"]


def test_another_member_is_still_carried_alone(tmp_path):
    """A member no server picks by itself (Command-R's `rag`; here `default`'s text under another name) is what
    every request must be rendered with: exported alone, as before."""
    from transformers import AutoTokenizer

    src = build_tokenizer(str(tmp_path), "hermes_tool_use", families()["hermes_tool_use"])
    own = AutoTokenizer.from_pretrained(src).chat_template
    out = str(tmp_path / "out")
    export_tokenizer(src, out, own["default"] + "{# rag #}", None)
    assert AutoTokenizer.from_pretrained(out).chat_template == own["default"] + "{# rag #}"
