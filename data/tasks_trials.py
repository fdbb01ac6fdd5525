"""A synthetic retrieval trial's pieces (in the spirit of RULER, Hsieh et al. 2024), and the four needle tasks built
from them (data/tasks.py holds the fifth, common_words, and everything a stage does with them).

A trial is a sample of exactly the stage's length: a haystack of repeated filler sentences with the task's
statements inserted at a depth, then a question whose answer ends the sample (`_assemble`):

- `passkey`: a 5-digit key at one depth; "What is the pass key? The pass key is" -> " 12345".
- `niah_multikey`: 4 needles "One of the special magic numbers for <word> is: <7 digits>." at different
  depths (the queried one at the given depth, 3 distractor keys elsewhere); the question names one key.
- `variable_tracking`: two chains `VAR ABCDE = 12345.`, `VAR FGHIJ = VAR ABCDE.`, ... (5 variables each,
  the queried chain's first statement at the given depth, the rest spread after it, the other chain
  interleaved as a distractor); the answer lists the variables holding the queried value, in chain order.
- `niah_multivalue` (RULER's multi-value needle): 4 needles "One of the special magic numbers for <word> is:
  <7 digits>." for the same key (the first at the given depth, the others anywhere); the answer lists all 4
  values, in the order they appear in the text.

A sample is the packer's dict (`input_ids`, `shift_labels`, `position_ids`, monotonic) plus `task` and
`answer` (text). **The loss is on the answer tokens only**: the haystack is the same filler sentence
repeated, so its tokens carry nothing but "repeat the filler" (thousands of trivially predictable tokens
per sample that would outweigh the 5-30 answer tokens); the stage's real text supplies the language
modelling signal, and the task samples' loss is exactly what the evaluation scores.
"""

from __future__ import annotations

import random
import string

import numpy as np

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
WORDS = ("apple", "river", "candle", "forest", "mirror", "silver", "garden", "planet", "window", "tiger",
         "bottle", "castle", "dragon", "engine", "feather", "guitar", "harbor", "island", "jacket", "lemon",
         "marble", "needle", "orange", "pencil", "rocket", "saddle", "tunnel", "violin", "wallet", "yellow")
NIAH_KEYS = 4  # 1 queried + 3 distractors (RULER's multikey_1 has 3 distractor needles too)
VT_HOPS, VT_CHAINS = 4, 2  # 5 variables per chain, one distractor chain
NIAH_VALUES = 4  # RULER's multivalue: 4 values for the one key


def _spaced(tokenizer) -> bool:
    """Whether the tokenizer separates encoded segments itself (a sentencepiece dummy prefix), read once."""
    got = getattr(tokenizer, "_segments_spaced", None)
    if got is None:
        got = " " in tokenizer.decode(tokenizer.encode("alpha") + tokenizer.encode("beta")).strip()
        tokenizer._segments_spaced = got
    return got


def _encode(tokenizer, text: str) -> list[int]:
    """Tokens of one segment. Segments are written without outer spaces where a sentencepiece tokenizer's dummy
    prefix is the space between them, so concatenated segments are the tokens the text would have whole
    (with " The pass key..." the leading space became a lone "▁" token, different from the key's tokens
    inside the needle, which no copying model can match); a byte-level BPE (Llama 3, Qwen: no such prefix) gets
    the space written (its common_words list ran together as one string of letters, `danodipunosegupelu`, which no
    model can count)."""
    text = text.strip()
    return tokenizer.encode(text if _spaced(tokenizer) else f" {text}")


def _answer(tokenizer, question: str, answer: str) -> tuple[list[int], list[int]]:
    """(question tokens, answer tokens) as the answer is tokenized after the question in one text, so
    the key's tokens are the ones it has inside its needle (" 27611" alone gets a second "▁")."""
    q = _encode(tokenizer, question)
    both = _encode(tokenizer, f"{question.strip()} {answer}")
    if both[: len(q)] == q and len(both) > len(q):
        return q, both[len(q):]
    return q, tokenizer.encode(f" {answer}")  # a tokenizer that merges across the boundary


def _haystack(tokenizer, n: int) -> list[int]:
    filler = _encode(tokenizer, FILLER)
    return (filler * (n // len(filler) + 1))[:n]


class TooShort(ValueError):
    """A length that cannot hold a trial: `need` tokens, its statements, question, answer, BOS and one filler
    sentence (what a trial of these draws needs at any length: only the haystack fills the rest)."""

    def __init__(self, message: str, need: int):
        super().__init__(message)
        self.need = need


def _assemble(tokenizer, seq_len: int, inserts: list[tuple[float, list[int]]], question: list[int],
              answer: list[int], task: str, answer_text: str) -> dict:
    """Filler with each (depth, tokens) inserted at that fraction of the haystack, then question + answer;
    labels on the answer only. ValueError when `seq_len` cannot hold it with one filler sentence."""
    bos = [tokenizer.bos_id] if getattr(tokenizer, "bos_id", None) is not None else []  # as a document starts
    need = sum(len(t) for _, t in inserts) + len(question) + len(answer) + len(bos)
    n_fill = seq_len - need
    if n_fill < len(_encode(tokenizer, FILLER)):
        raise TooShort(f"max_seq_length={seq_len} is too short for a {task} trial (needs "
                       f"{need + len(_encode(tokenizer, FILLER))} tokens)", need + len(_encode(tokenizer, FILLER)))
    body = _haystack(tokenizer, n_fill)
    # insert from the deepest point backwards so earlier offsets stay valid; ties keep their listed order
    for _, (depth, toks) in sorted(enumerate(inserts), key=lambda x: (x[1][0], x[0]), reverse=True):
        at = int(depth * n_fill)
        body[at:at] = toks
    ids = np.asarray(bos + body + question + answer, dtype=np.int64)
    labels = np.full_like(ids, -100)
    first = len(ids) - len(answer)
    labels[first - 1: len(ids) - 1] = ids[first:]  # each answer token predicted from the position before it
    return {"input_ids": ids, "shift_labels": labels, "position_ids": np.arange(len(ids)), "task": task,
            "answer": answer_text}


def passkey(tokenizer, seq_len: int, depth: float, rng: random.Random) -> dict:
    key = str(rng.randint(10000, 99999))
    needle = _encode(tokenizer, f"The pass key is {key}. Remember it. {key} is the pass key.")
    question, answer = _answer(tokenizer, "What is the pass key? The pass key is", key)
    return _assemble(tokenizer, seq_len, [(depth, needle)], question, answer, "passkey", key)


def niah_multikey(tokenizer, seq_len: int, depth: float, rng: random.Random) -> dict:
    keys = rng.sample(WORDS, NIAH_KEYS)
    values = [str(rng.randint(1_000_000, 9_999_999)) for _ in keys]
    depths = [depth] + [rng.random() for _ in keys[1:]]
    inserts = [(d, _encode(tokenizer, f"One of the special magic numbers for {k} is: {v}."))
               for d, k, v in zip(depths, keys, values)]
    question, answer = _answer(tokenizer, f"What is the special magic number for {keys[0]} mentioned in the provided "
                               f"text? One of the special magic numbers for {keys[0]} is:", values[0])
    return _assemble(tokenizer, seq_len, inserts, question, answer, "niah_multikey", values[0])


def _var_name(rng: random.Random, taken: set) -> str:
    while True:
        name = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
        if name not in taken:
            taken.add(name)
            return name


def variable_tracking(tokenizer, seq_len: int, depth: float, rng: random.Random) -> dict:
    taken: set = set()
    values = rng.sample(range(10000, 100000), VT_CHAINS)
    chains = [[_var_name(rng, taken) for _ in range(VT_HOPS + 1)] for _ in range(VT_CHAINS)]
    inserts = []
    for c, (names, value) in enumerate(zip(chains, values)):
        start = depth if c == 0 else rng.random() * depth  # the distractor chain begins anywhere before it
        span = (1.0 - start) * 0.9
        for h, name in enumerate(names):
            rhs = str(value) if h == 0 else f"VAR {names[h - 1]}"
            inserts.append((start + span * h / (len(names) - 1), _encode(tokenizer, f"VAR {name} = {rhs}.")))
    text = " ".join(chains[0])
    question, answer = _answer(tokenizer, f"Question: Find all variables that are assigned the value {values[0]} in "
                               f"the text above. Answer: According to the chain(s) of variables assignment in the "
                               f"text above, {VT_HOPS + 1} variables are assigned the value {values[0]}, they are:",
                               text)
    return _assemble(tokenizer, seq_len, inserts, question, answer, "variable_tracking", text)


def niah_multivalue(tokenizer, seq_len: int, depth: float, rng: random.Random) -> dict:
    key = rng.choice(WORDS)
    values = rng.sample(range(1_000_000, 10_000_000), NIAH_VALUES)
    depths = [depth] + [rng.random() for _ in values[1:]]
    inserts = [(d, _encode(tokenizer, f"One of the special magic numbers for {key} is: {v}."))
               for d, v in zip(depths, values)]
    # _assemble keeps the inserts in (depth, listed order) order: the answer lists the key's values that way
    shown = [str(values[i]) for i in sorted(range(NIAH_VALUES), key=lambda i: (depths[i], i))]
    question, answer = _answer(tokenizer, f"What are all the special magic numbers for {key} mentioned in the provided "
                               f"text? The special magic numbers for {key} mentioned in the provided text are:",
                               " ".join(shown))
    return _assemble(tokenizer, seq_len, inserts, question, answer, "niah_multivalue", " ".join(shown))
