"""common_words' made-up words (data/tasks.py): the 3-syllable pool (343,000 words) ran out at ~1.6M tokens and its
draw looped forever, silently, on every rank at start-up; a 1M sample made 664,661 encode calls (~17 s). Now the pool
goes on with 4 syllables, a full pool is refused in one line naming the length, the words are encoded in batches, and
every sample that could be built before is the same (ids, answer, rng). Shown with small syllable tables and lengths."""

from __future__ import annotations

import random
import types

import pytest

import data.tasks as tasks
from data.tasks import CWE_COMMON, CWE_FREQ_COMMON, CWE_FREQ_RARE, FILLER, _answer, _assemble, _encode


@pytest.fixture(scope="module")
def tok():
    from data.corpus import build_demo_corpus
    from data.tokenizer import Tokenizer

    return Tokenizer(build_demo_corpus()[1])


def _old_word(rng: random.Random, taken: set) -> str:
    """data/tasks.py's `_made_up_word` before the change (a copy)."""
    while True:
        word = "".join(rng.choice("bdfgklmnprstvz") + rng.choice("aeiou") for _ in range(3))
        if word not in taken:
            taken.add(word)
            return word


def _old_common_words(tokenizer, seq_len: int, depth: float, rng: random.Random) -> dict:
    """data/tasks.py's `common_words` before the change (a copy): one encode per word and per occurrence."""
    taken: set = set()
    common = [_old_word(rng, taken) for _ in range(CWE_COMMON)]
    intro = _encode(tokenizer, "Below is a list of words. Memorize the ones that appear most often.")
    question_text = (f"Question: What are the {CWE_COMMON} most common words in the list above? Answer: The top "
                     f"{CWE_COMMON} words are:")
    question, answer = _answer(tokenizer, question_text, " ".join(common))
    budget = seq_len - len(question) - len(answer) - 4 - len(_encode(tokenizer, FILLER)) - len(intro)
    words = common * CWE_FREQ_COMMON
    used = sum(len(_encode(tokenizer, w)) for w in words)
    while True:
        word = _old_word(rng, taken)
        cost = len(_encode(tokenizer, word)) * CWE_FREQ_RARE
        if used + cost > budget:
            break
        words += [word] * CWE_FREQ_RARE
        used += cost
    rng.shuffle(words)
    order = sorted(common, key=words.index)
    listed = intro + [t for w in words for t in _encode(tokenizer, w)]
    question, answer = _answer(tokenizer, question_text, " ".join(order))
    return _assemble(tokenizer, seq_len, [(depth, listed)], question, answer, "common_words", " ".join(order))


def _same(tokenizer, seq_len: int, seed: int) -> None:
    old_rng, new_rng = random.Random(seed), random.Random(seed)
    old = _old_common_words(tokenizer, seq_len, 0.3, old_rng)
    new = tasks.common_words(tokenizer, seq_len, 0.3, new_rng)
    assert new["answer"] == old["answer"]
    assert new["input_ids"].tolist() == old["input_ids"].tolist()
    assert new["shift_labels"].tolist() == old["shift_labels"].tolist()
    assert new_rng.getstate() == old_rng.getstate()  # the draws and the shuffle consumed the rng as before


@pytest.mark.parametrize("seq_len", [205, 256, 1024, 8192])
def test_batched_encoding_gives_the_old_samples(tok, seq_len):
    for seed in range(3):
        _same(tok, seq_len, seed)


def test_batched_encoding_gives_the_old_samples_with_a_byte_level_bpe(tmp_path):
    from data.tokenizer import Tokenizer
    from tests.unit.data.chat_fixtures import build_tokenizer

    bpe = Tokenizer(build_tokenizer(str(tmp_path), "qwen25"))  # no dummy prefix: each word encoded with its space
    for seq_len in (256, 4096):
        _same(bpe, seq_len, 1)


def test_a_sample_encodes_its_words_in_a_few_batches(tok, monkeypatch):
    """At 8k the old code made one encode per word and per occurrence (~3,000 calls; 664,661 at 1M, ~17 s)."""
    calls = {"encode": 0, "encode_batch": 0}

    def counting(name: str):
        call = getattr(tok, name)

        def counted(texts):
            calls[name] += 1
            return call(texts)
        return counted

    for name in calls:
        monkeypatch.setattr(tok, name, counting(name))
    tasks.common_words(tok, 8192, 0.5, random.Random(0))
    assert calls["encode"] <= 12 and calls["encode_batch"] <= 12, calls


def test_encoding_without_encode_batch_is_the_same(tok):
    """A tokenizer with only `encode` (a stand-in) is encoded one word at a time, to the same sample."""
    plain = types.SimpleNamespace(encode=tok.encode, decode=tok.decode, bos_id=tok.bos_id)
    assert (tasks.common_words(plain, 1024, 0.5, random.Random(2))["input_ids"].tolist()
            == tasks.common_words(tok, 1024, 0.5, random.Random(2))["input_ids"].tolist())


@pytest.fixture
def small_pool(monkeypatch):
    """Syllable tables of 2 consonants x 1 vowel: 8 words of 3 syllables, 16 of 4."""
    monkeypatch.setattr(tasks, "CONSONANTS", "bd")
    monkeypatch.setattr(tasks, "VOWELS", "a")


def test_the_pool_goes_on_with_4_syllables_then_refuses(small_pool):
    rng, taken = random.Random(0), set()
    words = [tasks._made_up_word(rng, taken) for _ in range(24)]
    assert sorted(len(w) for w in words) == [6] * 8 + [8] * 16  # every 3-syllable word first, then 4 syllables
    assert [len(w) for w in words[:8]] == [6] * 8 and len(set(words)) == 24
    with pytest.raises(tasks.TooLong, match="all 24 made-up words of 3 and 4 syllables are taken"):
        tasks._made_up_word(rng, taken)


def test_common_words_past_the_3_syllable_pool(tok, small_pool):
    """Past the 3-syllable pool (the old loop never ended: ~1.6M tokens with the real tables), the list goes on with
    4-syllable words and the answer is still the 3 most frequent words."""
    s = tasks.common_words(tok, 256, 0.5, random.Random(0))
    first = int((s["shift_labels"] != -100).argmax()) + 1
    listed = tok.decode(s["input_ids"][:first].tolist()).split("appear most often.", 1)[1].split("Question:")[0].split()
    counts = {w: listed.count(w) for w in set(listed)}
    assert any(len(w) == 8 for w in counts) and len(counts) > 8
    assert sorted(w for w, n in counts.items() if n == CWE_FREQ_COMMON) == sorted(s["answer"].split())


def test_past_every_made_up_word_is_refused_in_one_line_naming_the_length(tok, small_pool):
    with pytest.raises(tasks.TooLong, match=r"^max_seq_length=4096 is too long for a common_words trial \(all 24 "):
        tasks.common_words(tok, 4096, 0.5, random.Random(0))
    stage = types.SimpleNamespace(index=1, name="long", max_seq_length=4096, tasks={"common_words": 0.1})
    with pytest.raises(ValueError, match=r"^stage 1 \(long\): max_seq_length=4096 is too long .*\): lower "
                                         r"max_seq_length or drop common_words$"):
        tasks.check_tasks(stage, tok)
    from training.evaluation import check_passkey_fits

    evals = types.SimpleNamespace(index=0, name="long", max_seq_length=4096, eval={"tasks": ["common_words"],
                                                                                   "lengths": [4096]})
    with pytest.raises(ValueError, match=r"^stage 'long': max_seq_length=4096 is too long .*\): lower eval.lengths or "
                                         r"drop common_words from eval.tasks for this stage$"):
        check_passkey_fits([evals], tok)
