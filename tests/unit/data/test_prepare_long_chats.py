"""A conversation whose replies are found by prefix renders costs ~8 us x messages^2 (data/chat_render.py
`prefix_costly`): prepare_data warns once, naming the row, its count and the fix (a template with generation markers),
from the encoder's own stats (no second render). A marked template is linear: no warning."""

import json

import pytest

from data import prepare_data as pd
from data import prepare_worker
from data.chat import ChatEncoder
from data.chat_render import prefix_costly
from data.tokenizer import Tokenizer
from tests.unit.data.chat_fixtures import build_tokenizer


@pytest.fixture(scope="module")
def tok_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("toks"))


def _conv(n: int) -> list[dict]:
    return [{"role": ("user", "assistant")[i % 2], "content": f"message {i} words"} for i in range(n)]


def test_the_cost_is_warned_of_where_a_template_has_no_markers(tmp_path, tok_root):
    assert not prefix_costly(499, 1000) and prefix_costly(500, 1000)
    assert not prefix_costly(1000, 1_000_000)  # 1M tokens: the marked path (~10 us a token) is no cheaper
    assert prefix_costly(2000, 1_000_000)
    enc = ChatEncoder(Tokenizer(build_tokenizer(tok_root, "qwen25")), "auto", "auto")
    assert enc.encode({"messages": _conv(6)})[2]["prefix_messages"] == 6
    marked = ChatEncoder(Tokenizer(build_tokenizer(tok_root, "markers")), "auto", "auto")
    assert marked.encode({"messages": _conv(6)})[2]["prefix_messages"] == 0


@pytest.mark.parametrize("family,warned", [("qwen25", True), ("markers", False)])
def test_prepare_warns_once_of_long_conversations(tmp_path, tok_root, monkeypatch, family, warned):
    monkeypatch.setattr(prepare_worker, "prefix_costly", lambda m, tokens: m >= 6)  # 6 messages stand for thousands
    with open(tmp_path / "chat.jsonl", "w") as fh:
        for n in (2, 8, 6, 10):
            fh.write(json.dumps({"messages": _conv(n)}) + "\n")
    logs = []
    pd.prepare([str(tmp_path / "chat.jsonl")], str(tmp_path / "out"), build_tokenizer(tok_root, family), workers=0,
               batch_docs=2, log=logs.append)
    said = [line for line in logs if "messages^2" in line]
    assert len(said) == (1 if warned else 0), logs
    if warned:  # the first batch's longest row (rows 0-1), said once though rows 2-3 are long too
        assert "chat.jsonl" in said[0] and "of 8 messages" in said[0] and "{% generation %}" in said[0]
        assert "--chat_template chatml" in said[0] and "\n" not in said[0]
