"""Where a reply starts and ends (data/chat_locate.py), on the sweep's tokenizers (data/chat_sweep.py): Command R7B's
reply is trained through the stop after its end-of-turn, with or without a generation config beside the tokenizer;
Nemotron Nano v2's reply of tool calls alone from its first token. ~2 s, no network."""

from __future__ import annotations

import os

import numpy as np
import pytest

from data.chat import ChatEncoder
from data.chat_sweep import CASES, build_tokenizer, families
from data.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("locate_tokenizers"))


def spans(key: str, root: str, conv: list[dict], config: bool = True) -> list[str]:
    """The trained spans' texts of `conv` through family `key`'s template as shipped (without its
    generation_config.json where `config` is False)."""
    fam = families()[key]
    sub = os.path.join(root, "with" if config else "without")
    os.makedirs(sub, exist_ok=True)
    path = build_tokenizer(sub, key, fam)
    if not config and os.path.exists(os.path.join(path, "generation_config.json")):
        os.remove(os.path.join(path, "generation_config.json"))
    tok = Tokenizer(path)
    ids, mask, _ = ChatEncoder(tok, "assistant", fam.get("template", "auto")).encode({"messages": conv})
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    return [tok.hf.decode(ids[a:b]) for a, b in zip(edges[::2], edges[1::2])]


@pytest.mark.parametrize("config", [True, False])
def test_command_r7b_replies_are_trained_through_their_stop(root, config):
    """R7B ends a reply `<|END_RESPONSE|><|END_OF_TURN_TOKEN|>` and generation stops only on the second (its EOS, its
    generation config's one stop): the span ended at the first, the model never learned to stop. Without a
    generation config the EOS is the stop: the template writes it after every reply."""
    got = spans("command_r7b", root, CASES["multi-turn"], config)
    assert got == ["apple river<|END_RESPONSE|><|END_OF_TURN_TOKEN|>", "2 words<|END_RESPONSE|><|END_OF_TURN_TOKEN|>"]
    call, answer = spans("command_r7b_tool_use", root, CASES["tool list"], config)
    assert call.endswith("<|END_ACTION|><|END_OF_TURN_TOKEN|>") and "count_words" in call
    assert answer == "<|START_RESPONSE|>2 words<|END_RESPONSE|><|END_OF_TURN_TOKEN|>"


def test_a_stop_only_the_conversations_end_writes_stays_untrained_and_history_ends_stay(root):
    """Phi-4-mini writes its EOS only after the last reply (`<|end|><|endoftext|>`): without a generation config it
    is no turn's stop, and stays untrained; gpt-oss's history `<|end|><|start|>` reaches no stop: unchanged."""
    assert spans("phi4_mini", root, CASES["multi-turn"], config=False)[-1] == "2 words<|end|>"
    got = spans("gpt_oss", root, CASES["multi-turn"])
    assert got[0].endswith("apple river") and got[1].endswith("2 words<|return|>")


def test_the_stop_an_r7b_export_gets_is_the_one_trained(root):
    from data.chat_stops import reply_stops

    os.makedirs(os.path.join(root, "with"), exist_ok=True)
    path = build_tokenizer(os.path.join(root, "with"), "command_r7b", families()["command_r7b"])
    assert reply_stops(path) == [Tokenizer(path).hf.convert_tokens_to_ids("<|END_OF_TURN_TOKEN|>")]


@pytest.mark.parametrize("case", ["tool call", "tool list", "arguments as JSON text"])
def test_nemotron_nano2_reply_of_calls_alone_is_trained_from_its_first_token(root, case):
    """The prompt ends `Assistant\\n<think>\\n`, the history writes `Assistant\\n<TOOLCALL>[`: with both words plain
    text they share the token `<`, and the reply was trained from `TOOLCALL>` (its `<` never learned)."""
    call, answer = spans("nemotron_nano2", root, CASES[case])
    assert call.startswith('<TOOLCALL>[{"name": "count_words"') and call.endswith("</TOOLCALL>\n<SPECIAL_12>")
    assert answer == "2 words\n<SPECIAL_12>"
