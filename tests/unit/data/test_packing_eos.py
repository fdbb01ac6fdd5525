"""The in-job token stream (data/packing.build_token_stream) appends the EOS as data/prepare_data.py does: not after a
document that already ends with it. One process, a tokenizer trained on one sentence: well under a second."""

from __future__ import annotations

import numpy as np

from data.packing import build_token_stream
from data.prepare_data import prepare
from data.store import Prepared
from data.tokenizer import Tokenizer
from tests.unit.data.test_prepare_data import _bos_tokenizer, _write_jsonl


def _docs(tokens: str, starts: str) -> list[list[int]]:
    t, s = np.load(tokens).tolist(), np.load(starts).tolist() + [len(np.load(tokens))]
    return [t[a:b] for a, b in zip(s, s[1:])]


def test_a_document_ending_with_its_eos_gets_no_second_one_in_the_stream(tmp_path):
    """`<s>a quick brown fox</s>` (and ids ending with the EOS) became [..., </s>, </s>] in the in-job stream, while
    the prepared folder (prepare_data, fixed the same way) had one: the two disagreed on the same file."""
    path = _bos_tokenizer(tmp_path / "tok")
    tok = Tokenizer(path)
    eos = tok.eos_id
    text = _write_jsonl(tmp_path / "t.jsonl", ["<s>a quick brown fox</s>", "the lazy dog"], key="text")
    own, plain = _docs(*build_token_stream(text, tok, tok.vocab_size, str(tmp_path / "c1")))
    assert own[-1] == plain[-1] == eos and own.count(eos) == 1 and plain.count(eos) == 1
    prepare([text], str(tmp_path / "out"), path, workers=0, log=lambda _: None)
    p = Prepared(str(tmp_path / "out"))
    assert p.tokens.read(0, len(p.tokens)).tolist() == own + plain  # the prepared folder and the stream agree
    ids = _write_jsonl(tmp_path / "ids.jsonl", [[5, 6, eos], [7, 8]])
    bos = tok.bos_id  # pre-tokenized ids get the BOS a text gets (prepare_data likewise)
    stream = _docs(*build_token_stream(ids, tok, tok.vocab_size, str(tmp_path / "c2")))
    assert stream == [[bos, 5, 6, eos], [bos, 7, 8, eos]]
    prepare([ids], str(tmp_path / "out2"), path, workers=0, log=lambda _: None)
    p = Prepared(str(tmp_path / "out2"))
    assert p.tokens.read(0, len(p.tokens)).tolist() == stream[0] + stream[1]
