"""The two RULER tasks added to data/tasks.py, checked from the sample's text alone (never the generator's
variables): multi-value needle (`niah_multivalue`: every value of one key, in text order) and common-words
extraction (`common_words`: the most frequent words of a long list). Each is a pure function of its seed, has
exactly the asked length with labels on the answer only, and is refused in one line where it cannot fit."""

from __future__ import annotations

import collections
import random
import re

import numpy as np
import pytest

from data.tasks import CWE_COMMON, CWE_FREQ_COMMON, CWE_FREQ_RARE, TASKS, make_sample
from data.tasks_trials import NIAH_VALUES

NEW = ("niah_multivalue", "common_words")


@pytest.fixture(scope="module")
def tok():
    from data.corpus import build_demo_corpus
    from data.tokenizer import Tokenizer

    return Tokenizer(build_demo_corpus()[1])


def split(tok, s: dict) -> tuple[str, str]:
    """(prompt text, answer text) of a sample, cut where its labels start."""
    first = int(np.flatnonzero(s["shift_labels"] != -100)[0]) + 1
    return tok.decode(s["input_ids"][:first].tolist()), tok.decode(s["input_ids"][first:].tolist()).strip()


def test_new_tasks_are_registered_for_training_and_evaluation():
    from training.evaluation import task_trials

    assert set(NEW) <= set(TASKS)
    assert task_trials({"tasks": {"niah_multivalue": 3, "common_words": 2}}, object()) == {
        "niah_multivalue": 3, "common_words": 2}


@pytest.mark.parametrize("task", NEW)
@pytest.mark.parametrize("seq_len", [256, 777, 4096])
def test_deterministic_exact_length_labels_on_the_answer(tok, task, seq_len):
    a, b = (make_sample(task, tok, seq_len, 0.4, random.Random(11)) for _ in range(2))
    c = make_sample(task, tok, seq_len, 0.4, random.Random(12))
    assert all(np.array_equal(a[k], b[k]) for k in ("input_ids", "shift_labels", "position_ids")) and a["answer"] == b["answer"]
    assert a["answer"] != c["answer"]  # another seed, another question
    ids, lab = a["input_ids"], a["shift_labels"]
    assert len(ids) == len(lab) == seq_len and np.array_equal(a["position_ids"], np.arange(seq_len))
    scored = np.flatnonzero(lab != -100)
    assert scored.tolist() == list(range(scored[0], seq_len - 1))  # one run of labels ending the sample
    assert lab[scored].tolist() == ids[scored[0] + 1:].tolist()
    assert split(tok, a)[1] == a["answer"] and a["task"] == task


@pytest.mark.parametrize("seq_len", [256, 2048])
def test_multivalue_answer_is_every_value_of_the_key_in_text_order(tok, seq_len):
    for seed in range(8):
        s = make_sample("niah_multivalue", tok, seq_len, 0.3, random.Random(seed))
        prompt, answer = split(tok, s)
        key = re.search(r"What are all the special magic numbers for (\w+) mentioned", prompt).group(1)
        needles = re.findall(r"special magic numbers for (\w+) is: (\d{7})\.", prompt)
        assert [k for k, _ in needles] == [key] * NIAH_VALUES and len({v for _, v in needles}) == NIAH_VALUES
        assert answer.split() == [v for _, v in needles]


def test_multivalue_depth_places_the_first_value(tok):
    where = []
    for depth in (0.0, 0.5, 1.0):
        text = tok.decode(make_sample("niah_multivalue", tok, 4000, depth, random.Random(3))["input_ids"].tolist())
        key = re.search(r"numbers for (\w+) mentioned", text).group(1)
        hits = [m.start() / len(text) for m in re.finditer(rf"numbers for {key} is: \d+\.", text)]
        where.append(hits)
    assert min(where[0]) < 0.03 and any(0.4 < h < 0.6 for h in where[1]) and max(where[2]) > 0.85, where


@pytest.mark.parametrize("seq_len", [256, 1024, 8192])
def test_common_words_answer_is_the_most_frequent_words(tok, seq_len):
    for seed in range(5):
        s = make_sample("common_words", tok, seq_len, 0.5, random.Random(seed))
        prompt, answer = split(tok, s)
        listed = prompt.split("appear most often.", 1)[1].split("Question:", 1)[0]
        words = re.findall(r"(?:[bdfgklmnprstvz][aeiou]){3}", listed)  # made-up words only (not the filler)
        counts = collections.Counter(words)
        top = [w for w, n in counts.items() if n == CWE_FREQ_COMMON]
        assert len(top) == CWE_COMMON and set(counts.values()) == {CWE_FREQ_COMMON, CWE_FREQ_RARE}
        assert answer.split() == sorted(top, key=words.index)  # in order of first appearance
        # the list fills the length: what is left (question, answer, intro, one filler sentence, a word pair) is small
        assert sum(len(tok.encode(w)) for w in words) > seq_len - 145
        if seq_len >= 1024:
            assert len(counts) > 10 * CWE_COMMON  # many distractor words


@pytest.mark.parametrize("task", NEW)
def test_too_short_is_refused_in_one_line(tok, task):
    with pytest.raises(ValueError, match=rf"max_seq_length=120 is too short for a {task} trial \(needs \d+ tokens\)"):
        make_sample(task, tok, 120, 0.5, random.Random(0))
