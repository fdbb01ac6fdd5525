"""A long user turn spliced into the template's rendering (data/chat.py `ChatEncoder.encode_long`, what data/tasks.py
`chat_sample` renders a retrieval trial with): the template rendered around a placeholder, the haystack tokenized
once, gives exactly the ids and the loss mask of the whole conversation rendered and tokenized (`encode`), for every
template family of the golden tests, at a few lengths, where the long turn is the only one and where other turns
follow it. A template that alters the content falls back to the whole render (same result). Fixture tokenizers, no
network: ~3 s."""

from __future__ import annotations

import random

import numpy as np
import pytest

from data.chat import ChatEncoder
from data.chat_splice import splice_parts
from data.tasks import TASKS, make_sample
from data.tokenizer import Tokenizer
from tests.unit.data.chat_fixtures import FAMILIES, QWEN15_SHAPE, build_tokenizer

SP = "recipes/base/tiny_passkey256/tokenizer.model"  # the demo's: no template, the ChatML default by tokens
SPLICED = ("llama3", "qwen25", "mistral", "gemma", "smollm2", "qwen3", "markers", "phi3")  # every templated family


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("splice_tokenizers"))
    return {f: Tokenizer(build_tokenizer(root, f)) for f in FAMILIES} | {"sentencepiece": Tokenizer(SP)}


def haystack(tok, task: str, n: int) -> tuple[str, str]:
    """(user text, answer) of a plain trial of `n` tokens, as chat_sample asks it."""
    s = make_sample(task, tok, n, 0.5, random.Random(f"{task}:{n}"))
    first = int(np.flatnonzero(s["shift_labels"] != -100)[0]) + 1
    return tok.decode(s["input_ids"][:first]).strip(), s["answer"]


@pytest.mark.parametrize("family", sorted(FAMILIES) + ["sentencepiece"])
def test_spliced_equals_the_whole_render(toks, family):
    tok = toks[family]
    enc = ChatEncoder(tok, "assistant", "chatml" if family in ("none", "sentencepiece") else "none")
    for task, n in [("passkey", 256), ("niah_multikey", 1024), ("variable_tracking", 4096), ("common_words", 2048)]:
        user, answer = haystack(tok, task, n)
        convs = [[{"role": "user", "content": user}, {"role": "assistant", "content": answer}]]
        if family not in ("gemma", "mistral"):  # these refuse a system turn / need strict alternation as written
            convs.append([{"role": "system", "content": "Be brief."}, {"role": "user", "content": user},
                          {"role": "assistant", "content": answer}, {"role": "user", "content": "Again?"},
                          {"role": "assistant", "content": answer}])
        for msgs in convs:
            at = next(k for k, m in enumerate(msgs) if m["role"] == "user")
            want_ids, want_mask, _ = enc.encode({"messages": msgs})
            ids, mask = enc.encode_long(msgs, at)
            assert ids == want_ids, (task, n)
            assert np.array_equal(mask, want_mask), (task, n)
            if family in SPLICED:  # spliced, not the fallback
                assert splice_parts(enc, enc_conv(msgs), at, user) is not None, (family, task)


def enc_conv(msgs):
    from data.chat_rows import message as _message

    return [_message(m, i) for i, m in enumerate(msgs)]


def test_a_template_that_alters_the_content_falls_back_to_the_whole_render(toks):
    """Llama 3 trims the content: a user turn with surrounding spaces cannot be spliced verbatim; the whole render
    is used (same ids as encode)."""
    enc = ChatEncoder(toks["llama3"], "assistant", "none")
    msgs = [{"role": "user", "content": "  What is the pass key?  "}, {"role": "assistant", "content": "12345"}]
    assert splice_parts(enc, enc_conv(msgs), 0, msgs[0]["content"]) is None
    ids, mask = enc.encode_long(msgs, 0)
    want_ids, want_mask, _ = enc.encode({"messages": msgs})
    assert ids == want_ids and np.array_equal(mask, want_mask)


def test_a_last_reply_with_no_end_of_turn_is_counted_spliced_too(tmp_path):
    """`encode_long(..., stats=True)` gives `encode`'s stats: a conversation whose last reply the template ends with
    no end-of-turn token (Qwen1.5) is counted (`no_stop_rows`), spliced or rendered whole (a long last reply)."""
    tok = Tokenizer(build_tokenizer(str(tmp_path), "qwen25"))
    tok.hf.chat_template = QWEN15_SHAPE
    enc = ChatEncoder(tok, "assistant", "none")
    user, answer = haystack(tok, "passkey", 512)
    pair = [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    cases = [(pair, 0, 1), (pair + [{"role": "user", "content": "Thanks."}], 0, 0),
             ([{"role": "user", "content": "Repeat it."}, {"role": "assistant", "content": user}], 1, 1)]
    for msgs, at, want in cases:
        ids, mask, stats = enc.encode_long(msgs, at, stats=True)
        whole_ids, whole_mask, whole = enc.encode({"messages": msgs})
        assert (ids, stats["no_stop_rows"]) == (whole_ids, whole["no_stop_rows"]) and np.array_equal(mask, whole_mask)
        assert stats["no_stop_rows"] == want, (at, want)
    assert splice_parts(enc, enc_conv(pair), 0, user) is not None  # the first case was spliced


@pytest.mark.parametrize("task", TASKS)
def test_a_chat_trial_tokenizes_its_haystack_once(toks, task, monkeypatch):
    """data/tasks.py chat_sample through the splice: the long text is tokenized once (before: three times, by the
    whole render and the two prefix renders), and the trial is what rendering the whole user turn gives (the ids, and
    the loss on the reply and its end-of-turn)."""
    from data.tasks import chat_sample

    tok = toks["qwen25"]
    enc = ChatEncoder(tok, "assistant", "none")
    long_texts, encode, encode_batch = [], tok.encode, tok.encode_batch

    def counted(text):
        if len(text) > 1000:
            long_texts.append(len(text))
        return encode(text)

    def counted_batch(texts):
        long_texts.extend(len(t) for t in texts if len(t) > 1000)
        return encode_batch(texts)

    monkeypatch.setattr(tok, "encode", counted)
    monkeypatch.setattr(tok, "encode_batch", counted_batch)
    s = chat_sample(task, tok, enc, 2048, 0.5, random.Random(3))
    monkeypatch.undo()
    assert len(long_texts) == 1, long_texts
    scored = np.flatnonzero(s["shift_labels"] != -100)
    n = int(np.flatnonzero(s["position_ids"][1:] == 0)[0]) + 1 if (s["position_ids"][1:] == 0).any() else 2048
    ids = s["input_ids"][:n].tolist()
    user = tok.hf.decode(ids).split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
    want, mask, _ = enc.encode({"messages": [{"role": "user", "content": user},
                                             {"role": "assistant", "content": s["answer"]}]})
    assert ids == want and np.array_equal(np.flatnonzero(mask[1:]), scored)


@pytest.mark.parametrize("family", SPLICED)
def test_a_long_reply_ending_with_its_stop_text_is_encoded_as_encode_cuts_it(toks, family):
    """A review: encode trains a reply ending with stops' texts as its text and the template's own end-of-turn
    (`Paris</s>`); encode_long spliced such a long reply verbatim (Mistral's: other ids than encode's)."""
    tok = toks[family]
    enc = ChatEncoder(tok, "assistant", "none")
    reply = " ".join(["river"] * 300) + tok.hf.decode([tok.eos_id])
    msgs = [{"role": "user", "content": "Say river a lot."}, {"role": "assistant", "content": reply}]
    want_ids, want_mask, _ = enc.encode({"messages": msgs})
    ids, mask = enc.encode_long(msgs, 1)
    assert ids == want_ids and np.array_equal(mask, want_mask)
