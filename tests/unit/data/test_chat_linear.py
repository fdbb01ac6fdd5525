"""Chat preparation linear in the conversation (issue 47 item 12; data/chat_views.py): the prefix path tokenizes the
conversation once plus each prefix's short tail, instead of every prefix render whole (turns x length), and gives
exactly the ids, loss mask and counts of the exact path (every prefix tokenized whole: today's `encode` before the
change) on every family of the golden tests and of the sweep (data/chat_sweep.py), for every kind of conversation
the sweep sends and long multi-turn ones, with a byte-level BPE and a sentencepiece-style (Metaspace) tokenizer.
Fixture tokenizers, no network: ~10 s."""

from __future__ import annotations

import numpy as np
import pytest

from data import chat_views
from data.chat import ChatEncoder, RowError
from data.chat_sweep import CASES, families
from data.chat_sweep import build_tokenizer as sweep_tokenizer
from data.chat_views import Renders
from data.tokenizer import Tokenizer
from tests.unit.data.chat_fixtures import FAMILIES, build_tokenizer

CALL = {"type": "function", "function": {"name": "count_words", "arguments": {"text": "apple river"}}}


def conversations(system: bool = True) -> list[list[dict]]:
    """Long and awkward conversations beside the sweep's: many turns, a reply repeated in a user turn, blanks around
    contents, an empty reply, tool calls and results, a control token's text quoted in a reply."""
    many = [{"role": "system", "content": "You are terse."}] if system else []
    for i in range(12):
        many += [{"role": "user", "content": f"  Step {i}: say apple river {i} times.\n"},
                 {"role": "assistant", "content": f"apple river x{i}" + (" " * (i % 3))}]
    tools = [{"role": "user", "content": "Count apple river."}, {"role": "assistant", "content": "", "tool_calls": [CALL]},
             {"role": "tool", "content": "2"}, {"role": "assistant", "content": "2 words"},
             {"role": "user", "content": "And again?"}, {"role": "assistant", "content": "Still 2 words."}]
    odd = [{"role": "user", "content": "Say: apple river"}, {"role": "assistant", "content": "apple river"},
           {"role": "user", "content": "\n\nNothing?"}, {"role": "assistant", "content": ""},
           {"role": "user", "content": "Quote it"}, {"role": "assistant", "content": "It ends <|im_end|> there."}]
    return [many, tools, odd]


def outcome(enc: ChatEncoder, conv: list[dict], linear: bool):
    enc.linear = linear
    try:
        ids, mask, stats = enc.encode({"messages": conv})
    except RowError as e:
        return ("refused", str(e))
    return ids, mask.tolist(), stats


def assert_same(enc, conv, what):
    want, got = outcome(enc, conv, False), outcome(enc, conv, True)
    assert got == want, what


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("linear_tokenizers"))


@pytest.mark.parametrize("family", sorted(families()))
def test_the_linear_path_equals_the_exact_one_on_every_sweep_family(root, family):
    fam = families()[family]
    enc = ChatEncoder(Tokenizer(sweep_tokenizer(root, family, fam)), "assistant", fam.get("template", "auto"))
    for case, conv in CASES.items():
        assert_same(enc, [{**m, "content": m["content"].replace("{eot}", fam["eot"])} for m in conv], case)
    for i, conv in enumerate(conversations() + conversations(system=False)):
        assert_same(enc, conv, i)


@pytest.mark.parametrize("offsets", [False, True])
@pytest.mark.parametrize("family", sorted(set(FAMILIES) - {"none"}))
def test_the_linear_path_equals_the_exact_one_on_every_golden_family(root, family, offsets, monkeypatch):
    """Added tokens found by their text (plain ones) or by the tokenizer's offsets (stripped or normalized ones)."""
    if offsets:
        monkeypatch.setattr(chat_views, "_plain_added", lambda hf: None)
    enc = ChatEncoder(Tokenizer(build_tokenizer(root + "/golden", family)), "assistant", "none")
    r = Renders(enc, conversations(system=False)[0])
    assert len(r.at) >= 24 and all(r.text[a:b] == enc.hf.convert_ids_to_tokens(r.full[t])
                                   for t, a, b in zip(r.at, r.starts, r.ends))
    for i, conv in enumerate(conversations() + conversations(system=False)):
        assert_same(enc, conv, i)


@pytest.mark.parametrize("legacy", [False, True])
def test_a_sentencepiece_style_tokenizer(root, legacy):
    """Metaspace pre-tokenization (Llama 2, Mistral, Gemma: `▁` before a text's first word only) or the legacy
    normalizer (`▁` before every piece between control tokens): a prefix's tail is tokenized where it stands, after
    its control token, never as a text's start."""
    from tokenizers import Tokenizer as Raw
    from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Raw(models.BPE(unk_token="<unk>"))
    if legacy:
        raw.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    else:
        raw.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    raw.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    corpus = [" ".join(m["content"] for m in c) for c in conversations()] * 5
    raw.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"], show_progress=False))
    hf = PreTrainedTokenizerFast(tokenizer_object=raw)
    hf.add_special_tokens({"eos_token": "</s>", "bos_token": "<s>", "additional_special_tokens": ["[INST]", "[/INST]"]})
    hf.chat_template = FAMILIES["mistral"][0]
    path = f"{root}/metaspace{int(legacy)}"
    hf.save_pretrained(path)
    enc = ChatEncoder(Tokenizer(path), "assistant", "none")
    for i, conv in enumerate(conversations(system=False)):
        conv = [m for m in conv if m["role"] in ("user", "assistant")]
        if i == 1:
            conv = conv[:1] + conv[2:]  # alternating, as Mistral's template requires
        assert_same(enc, conv, i)
        assert outcome(enc, conv, True)[0] != "refused"
    r = Renders(enc, conversations(system=False)[0])
    assert r.prefix(4).j > 0 and r.prefix(4, gen=True).j > 0  # views on the conversation, not whole prefixes


def test_200_turns_tokenize_the_conversation_about_once(root, monkeypatch):
    """A 200-message conversation: the characters handed to the tokenizer are at most 3x the conversation's
    rendering (the old path tokenized each reply's two prefix renders whole: ~100x here), and its ids equal the
    exact path's."""
    from transformers import PreTrainedTokenizerFast

    enc = ChatEncoder(Tokenizer(build_tokenizer(root + "/golden", "qwen25")), "assistant", "none")
    conv = []
    for i in range(100):
        conv += [{"role": "user", "content": f"Question {i}: " + "apple river " * 6},
                 {"role": "assistant", "content": f"Answer {i}: " + "two words " * 6}]
    length = len(enc._text(conv))
    seen, call = [], PreTrainedTokenizerFast.__call__

    def counted(self, text, *a, **kw):
        seen.append(len(text) if isinstance(text, str) else sum(map(len, text)))
        return call(self, text, *a, **kw)

    monkeypatch.setattr(PreTrainedTokenizerFast, "__call__", counted)
    ids, mask, stats = enc.encode({"messages": conv})
    monkeypatch.undo()
    assert stats["untrained_turns"] == 0 and int(mask.sum()) > 0
    assert sum(seen) <= 3 * length, f"{sum(seen)} characters tokenized for a {length}-character conversation"
    enc.linear = False
    assert enc.encode({"messages": conv})[0] == ids


class _Counting:
    """The Rust tokenizer with each encode's text lengths recorded (every other attribute, set or read, its own)."""

    def __init__(self, raw, seen: list[int]):
        object.__setattr__(self, "_raw", raw)
        object.__setattr__(self, "_seen", seen)

    def __getattr__(self, name):
        attr = getattr(self._raw, name)
        if not name.startswith("encode") or not callable(attr):
            return attr

        def counted(texts, *a, **kw):
            self._seen.append(len(texts) if isinstance(texts, str) else sum(len(t) for t in texts))
            return attr(texts, *a, **kw)
        return counted

    def __setattr__(self, name, value):
        setattr(self._raw, name, value)


@pytest.mark.parametrize("plain", [True, False])
def test_a_marked_template_tokenizes_a_long_conversation_once(root, plain, monkeypatch):
    """A `{% generation %}` template (TRL's training templates, `--chat_template chatml`): Hugging Face's assistant
    mask is an encode with offsets of the whole conversation; its tokens are the row's and its prefixes' views'
    (data/chat_views.Renders given them). Before, Renders tokenized the same text again only to compare the two:
    a 4 MB row 5.8 s and +801 MB, now 3.5 s and +516 MB, the prefix path 2.2 s and +380 MB (a real Qwen vocabulary).
    The mask is the same either way (tests/unit/data/test_chat_sweep*.py compare it with Hugging Face's own)."""
    if not plain:  # added tokens placed by the tokenizer's offsets, not by their text
        monkeypatch.setattr(chat_views, "_plain_added", lambda hf: None)
    enc = ChatEncoder(Tokenizer(build_tokenizer(root + "/golden", "markers")), "assistant", "none")
    assert enc.kind == "markers"
    conv = [{"role": "user", "content": "Read this. " + "apple river two words " * 4000 + "Who did it?"},
            {"role": "assistant", "content": "The butler."}, {"role": "user", "content": "Sure?"},
            {"role": "assistant", "content": "Yes, the butler."}]
    length = len(enc._text(conv))
    want = enc.tok.hf.apply_chat_template(conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    seen = []
    monkeypatch.setattr(enc.hf, "_tokenizer", _Counting(enc.hf._tokenizer, seen))
    ids, mask, stats = enc.encode({"messages": conv})
    monkeypatch.undo()
    whole = [n for n in seen if n >= length // 2]
    assert len(whole) == 1, f"{len(whole)} encodes of the whole {length}-character conversation ({seen})"
    assert sum(seen) - sum(whole) < length // 4  # the rest: prefixes' short tails
    assert ids == list(want["input_ids"]) and mask.tolist() == list(want["assistant_masks"])
    assert stats["untrained_turns"] == 0 and spans_of(enc, ids, mask) == ["The butler.<|im_end|>",
                                                                            "Yes, the butler.<|im_end|>"]


def spans_of(enc, ids, mask) -> list[str]:
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    return [enc.tok.hf.decode(ids[a:b]) for a, b in zip(edges[::2], edges[1::2])]
