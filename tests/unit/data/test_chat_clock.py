"""A template that writes today's date (`strftime_now`: gpt-oss, Mistral Small 3.2, Llama 3.1-3.3, Granite 3.3,
Apertus) renders one instant in every render of a row (data/chat_render.py FrozenClock): a row is rendered 4-11 times, and
a midnight between two renders left a prefix unlike the conversation (the turn not located: the row refused for
another reason, or a reply left untrained). The clock is transformers' module `datetime`, swapped here for one that
turns to the next day after its n-th reading, for every n (as the audit reproduced it). < 2 s."""

from __future__ import annotations

import datetime as real_dt
import json

import pytest
import transformers.utils.chat_template_utils as ctu

from data.chat import ChatEncoder
from data.chat_sweep import build_tokenizer, check, families, marked
from data.prepare_data import prepare
from data.store import Prepared
from data.tokenizer import Tokenizer

ROW = {"messages": [{"role": "user", "content": "Say exactly: apple river"},
                    {"role": "assistant", "content": "apple river"},
                    {"role": "user", "content": "Count them."}, {"role": "assistant", "content": "2 words"}]}


class Midnight:
    """`datetime` whose now() is 2026-11-30 23:59:59 for its first `flip` readings, then 2026-12-01."""
    n, flip = 0, 10 ** 9

    @classmethod
    def now(cls, tz=None):
        cls.n += 1
        return real_dt.datetime(2026, 11, 30, 23, 59, 59) if cls.n <= cls.flip else real_dt.datetime(2026, 12, 1)


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("clock"))
    return {key: Tokenizer(build_tokenizer(root, key, families()[key])) for key in ("gpt_oss", "mistral_small32")}


@pytest.fixture
def midnight(monkeypatch):
    assert ctu.datetime is real_dt.datetime  # where transformers' strftime_now reads the time (else: move the swap)
    monkeypatch.setattr(ctu, "datetime", Midnight)
    Midnight.n, Midnight.flip = 0, 10 ** 9
    return Midnight


@pytest.mark.parametrize("key", ["gpt_oss", "mistral_small32"])
def test_a_row_encodes_the_same_whenever_midnight_passes(toks, midnight, key):
    assert "strftime_now" in toks[key].hf.chat_template
    runs = []
    for flip in range(40):  # a fresh encoder each time: its probe renders are crossed too (old code: ~20 readings)
        midnight.n, midnight.flip = 0, flip
        ids, mask, stats = ChatEncoder(toks[key], "assistant").encode(ROW)
        assert stats["untrained_turns"] == 0, (flip, stats["why"])
        runs.append((ids, mask.tolist()))
    assert all(r == runs[0] for r in runs)
    assert ctu.datetime is Midnight  # put back after every render


def test_the_instant_given_is_the_one_rendered(toks, midnight):
    enc = ChatEncoder(toks["gpt_oss"], "assistant", now="2026-11-30T23:59:59")
    ids, mask, _ = enc.encode(ROW)
    text = toks["gpt_oss"].hf.decode(ids)
    assert "2026-11-30" in text and "2026-12-01" not in text and mask.sum() > 0
    assert midnight.n == 0 and ctu.datetime is Midnight  # the module's clock never read, and restored
    with enc.clock, enc.clock:  # nested: each exit restores what its entry found
        assert ctu.datetime.now().date() == real_dt.date(2026, 11, 30)
    assert ctu.datetime is Midnight


def test_the_sweeps_oracle_renders_at_the_encoders_instant(toks, midnight):
    """data/chat_sweep.check compares the encoder's ids with its own render: in CI at any hour, a midnight between
    the two made a WRONG cell."""
    fam = families()["gpt_oss"]
    enc = ChatEncoder(toks["gpt_oss"], "assistant")
    enc.encode(ROW)  # the probes read once
    midnight.n = 0
    enc.encode(ROW)
    midnight.n, midnight.flip = 0, midnight.n  # the encoder's renders on one day, the oracle's on the next
    assert check(enc, marked(fam), ROW["messages"]) == "trains"


def test_a_preparation_records_its_instant_and_a_resumed_shard_keeps_it(toks, tmp_path):
    """prepare_data reads the instant once (its shard plan's `clock`); a shard continued later renders with it."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(ROW) + "\n" for _ in range(3)))
    out = tmp_path / "prep"
    run = lambda: prepare([str(rows)], str(out), toks["gpt_oss"].path, workers=0, log=lambda _: None)  # noqa: E731
    run()
    plan = out / "plan-s00000.json"
    assert real_dt.datetime.fromisoformat(json.loads(plan.read_text())["clock"])
    for f in ["shard-00000-of-00001.json", "manifest.json", *(p.name for p in out.glob("chunk-*.json"))]:
        (out / f).unlink()  # killed before its first commit, continued another day
    plan.write_text(json.dumps({**json.loads(plan.read_text()), "clock": "2026-11-30T23:59:59"}))
    run()
    p = Prepared(str(out))
    text = toks["gpt_oss"].hf.decode(p.tokens.read(0, len(p.tokens)).tolist())
    assert text.count("2026-11-30") == 3 and json.loads(plan.read_text())["clock"] == "2026-11-30T23:59:59"
