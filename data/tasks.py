"""Synthetic long-context retrieval tasks (in the spirit of RULER, Hsieh et al. 2024): the five generators by name,
a trial rendered as chat, a stage's `tasks:` checked, and a wrapper that mixes them into a stage's training stream.

Five tasks, each a sample of exactly the stage's length: `passkey`, `niah_multikey`, `variable_tracking` and
`niah_multivalue` (data/tasks_trials.py: what each asks, and the pieces every trial is built from), and here
`common_words` (RULER's common-words extraction, CWE): the context is a shuffled list of made-up words (the haystack
is one filler sentence; depth only places the list in it): 3 words appear 5 times each, every other word twice, as
many as the length holds; the answer lists the 3 frequent words in order of first appearance. The loss is on the
answer tokens only (data/tasks_trials.py says why).

In training (`TaskMixSampler`), a stage key `tasks: {passkey: 0.2, niah_multikey: 0.1}` makes that fraction
of the stage's micro-steps synthetic. A synthetic sample is a pure function of (seed, task, serial number),
so the sampler's state (its counters, each task's next serial, the wrapped sampler's own state) is the whole data
position; the serials are global (all DP ranks' micro-batches together), so a resume on fewer or more ranks, or
another micro-batch, continues after every sample already trained.
"""

from __future__ import annotations

import random

import numpy as np

from data.tasks_trials import (
    FILLER,
    TooShort,
    _answer,
    _assemble,
    _encode,
    _spaced,
    niah_multikey,
    niah_multivalue,
    passkey,
    variable_tracking,
)

TASKS = ("passkey", "niah_multikey", "variable_tracking", "niah_multivalue", "common_words")
CWE_COMMON, CWE_FREQ_COMMON, CWE_FREQ_RARE = 3, 5, 2  # 3 words 5 times each among words seen twice

CONSONANTS, VOWELS = "bdfgklmnprstvz", "aeiou"  # a made-up word's syllable: one of each


class TooLong(ValueError):
    """A length past what a task can fill (common_words past its made-up words, ~100M tokens): lower it."""


def _made_up_word(rng: random.Random, taken: set) -> str:
    """A pronounceable word no other word of the sample has: 3 syllables (14 x 5 each: 343,000 words) while that pool
    has a free one, drawn until an untaken one comes as before (so every sample that finished before is unchanged:
    ~1.55M tokens with a 128k vocabulary), then 4 syllables (24,010,000 more; the 3-syllable pool ran out at ~1.6M
    tokens and the loop never ended, silently, on every rank at start-up). `taken` holds only this function's words
    (its size says which pool is being drawn). TooLong where both are full, or after 64x the draws a free word takes
    on average (a chance of e^-64 where one is free)."""
    pool = (len(CONSONANTS) * len(VOWELS)) ** 3
    syllables, n = (3, len(taken)) if len(taken) < pool else (4, len(taken) - pool)
    if syllables == 4:
        pool = (len(CONSONANTS) * len(VOWELS)) ** 4
    if n >= pool:
        raise TooLong(f"all {len(taken)} made-up words of 3 and 4 syllables are taken")
    for _ in range(64 * pool // (pool - n) + 64):
        word = "".join(rng.choice(CONSONANTS) + rng.choice(VOWELS) for _ in range(syllables))
        if word not in taken:
            taken.add(word)
            return word
    raise TooLong(f"no free made-up word of {syllables} syllables after {64 * pool // (pool - n) + 64} draws "
                  f"({n} of {pool} taken)")


def _encode_words(tokenizer, words: list[str]) -> list[list[int]]:
    """`_encode(tokenizer, w)` of each word (no spaces inside) in one encode_batch call where the tokenizer has one:
    the same ids (Tokenizer.encode_batch is the same encoder, checked on a probe for the Rust path)."""
    texts = words if _spaced(tokenizer) else [f" {w}" for w in words]
    batch = getattr(tokenizer, "encode_batch", None)
    return [list(t) for t in batch(texts)] if batch is not None else [tokenizer.encode(t) for t in texts]


def _rare_words(tokenizer, rng: random.Random, taken: set, room: int, ids: dict) -> list[str]:
    """Rare words, each to be listed CWE_FREQ_RARE times, drawn until the next one would pass `room` tokens (that
    one drawn too, unlisted), their ids put in `ids`; the rng and `taken` left as drawing them one at a time leaves
    them. Drawn and encoded in chunks (one encode_batch each: 221,544 words at 1M took 664,661 encode calls, ~17 s of
    a sample's Python), each chunk ~90% of what the room still holds; the chunk where the room ends is redrawn from
    its start up to that word (the draws are the rng's, the same again)."""
    out: list[str] = []
    per = sum(len(t) for t in ids.values()) / max(1, len(ids))  # tokens per word, from the common words
    while True:
        state = rng.getstate()
        chunk = [_made_up_word(rng, taken) for _ in range(max(16, int(0.9 * room / (CWE_FREQ_RARE * per))))]
        for i, (word, toks) in enumerate(zip(chunk, _encode_words(tokenizer, chunk))):
            cost = len(toks) * CWE_FREQ_RARE
            if cost > room:
                rng.setstate(state)
                taken.difference_update(chunk)
                again = [_made_up_word(rng, taken) for _ in range(i + 1)]
                assert again == chunk[: i + 1]
                return out
            ids[word] = toks
            out.append(word)
            room -= cost
        per = sum(len(ids[w]) for w in chunk) / len(chunk)


def common_words(tokenizer, seq_len: int, depth: float, rng: random.Random) -> dict:
    """The made-up words are 3 syllables up to ~1.55M tokens (128k vocabulary), 4 beyond (`_made_up_word`): every
    sample that could be built before is the same, ids and rng. Cost of a sample with a 131k-vocabulary tokenizer on
    a loaded core: 5.5 s at 1M (39 s before: an encode per word and per occurrence), 14 s at 1.6M, 33 s at 2M (most of
    it drawing the last free 3-syllable words: ~4.4M draws, the price of leaving the shorter samples unchanged)."""
    taken: set = set()
    common = [_made_up_word(rng, taken) for _ in range(CWE_COMMON)]
    intro = _encode(tokenizer, "Below is a list of words. Memorize the ones that appear most often.")
    question_text = (f"Question: What are the {CWE_COMMON} most common words in the list above? Answer: The top "
                     f"{CWE_COMMON} words are:")
    # the answer's tokens in another order may differ at the joins: 4 tokens of slack (the filler takes them)
    question, answer = _answer(tokenizer, question_text, " ".join(common))
    budget = seq_len - len(question) - len(answer) - 4 - len(_encode(tokenizer, FILLER)) - len(intro)
    ids = dict(zip(common, _encode_words(tokenizer, common)))
    words = common * CWE_FREQ_COMMON
    used = sum(len(ids[w]) for w in words)
    try:  # rare words, each CWE_FREQ_RARE times, as many as the length holds
        rare = _rare_words(tokenizer, rng, taken, budget - used, ids)
    except TooLong as e:
        raise TooLong(f"max_seq_length={seq_len} is too long for a common_words trial ({e})") from None
    words += [w for w in rare for _ in range(CWE_FREQ_RARE)]
    rng.shuffle(words)
    order = sorted(common, key=words.index)
    listed = intro + [t for w in words for t in ids[w]]
    question, answer = _answer(tokenizer, question_text, " ".join(order))
    return _assemble(tokenizer, seq_len, [(depth, listed)], question, answer, "common_words", " ".join(order))


GENERATORS = {"passkey": passkey, "niah_multikey": niah_multikey, "variable_tracking": variable_tracking,
              "niah_multivalue": niah_multivalue, "common_words": common_words}


def make_sample(task: str, tokenizer, seq_len: int, depth: float, rng: random.Random) -> dict:
    return GENERATORS[task](tokenizer, seq_len, depth, rng)


def chat_sample(task: str, tokenizer, chat, seq_len: int, depth: float, rng: random.Random,
                reseed: bool = True) -> dict:
    """A task rendered as one chat exchange through `chat` (data/chat.py's ChatEncoder, the template the stage's
    conversations were prepared with): the user turn is the haystack and the question, the assistant's reply the
    answer (loss on the reply and its end-of-turn token, as on the real conversations), padded to `seq_len` (the
    padding its own document: no label, positions restarted). How an SFT stage mixes a small share of long
    synthetic exchanges into short chats (Llama 3's recipe). The plain sample is built shorter by the template's
    overhead (measured on a short exchange, plus 8 tokens of slack for text re-tokenized at its joins) and shrunk
    again if the rendering still runs over.

    Which question: with `reseed` (a training sample's, TaskMixDataset: kept as it was, so a resumed run draws the
    samples it drew before) each try's plain trial is seeded by a draw of `rng`; without it (an evaluation trial,
    training/evaluation.py `trial`) every try starts from `rng` as given, the draws `make_sample(.., rng)` makes: the
    plain trial's question at the same seed (its answer, its needles' depths; common_words' list is filled to the
    shorter length, its words' order may differ). Seeded by a draw, an SFT checkpoint asked through its template was
    compared with its base asked plainly over other questions (passkey 0.1 at 512: 38355 against 87619)."""
    inner, start = seq_len - _chat_overhead(tokenizer, chat), rng.getstate()
    for _ in range(4):
        if not reseed:
            rng.setstate(start)
        plain = make_sample(task, tokenizer, inner, depth, random.Random(rng.random()) if reseed else rng)
        first = int(np.flatnonzero(plain["shift_labels"] != -100)[0]) + 1  # the answer's first token
        lead = int(getattr(tokenizer, "bos_id", None) is not None)  # the template writes its own BOS
        msgs = [{"role": "user", "content": tokenizer.decode(plain["input_ids"][lead:first]).strip()},
                {"role": "assistant", "content": plain["answer"]}]
        ids, mask = chat.encode_long(msgs, 0)  # the haystack tokenized once, spliced into the template's rendering
        if len(ids) <= seq_len:
            break
        inner -= len(ids) - seq_len + 8
    else:
        raise ValueError(f"max_seq_length={seq_len} is too short for a {task} trial rendered as chat")
    n = len(ids)
    out = np.full(seq_len, tokenizer.pad_id, dtype=np.int64)
    out[:n] = ids
    target = np.zeros(seq_len, dtype=bool)
    target[:n] = mask.astype(bool)
    labels = np.full(seq_len, -100, dtype=np.int64)
    labels[:-1] = np.where(target[1:], out[1:], -100)
    pos = np.arange(seq_len, dtype=np.int64)
    pos[n:] -= n  # the padding: a document of its own
    return {"input_ids": out, "shift_labels": labels, "position_ids": pos, "task": task, "answer": plain["answer"]}


def _chat_overhead(tokenizer, chat) -> int:
    """Tokens the template adds around one exchange (measured on a short one), plus 8 of slack for text re-tokenized
    at its joins: `chat_sample` builds the plain trial this much shorter."""
    probe = {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}
    return len(chat.encode(probe)[0]) - len(tokenizer.encode("x")) - len(tokenizer.encode("y")) + 8


def trial_need(task: str, tokenizer, depth: float, rng: random.Random, chat=None, reseed: bool = True) -> int:
    """The shortest length that holds the trial `make_sample(task, tokenizer, length, depth, rng)` (with `chat`:
    `chat_sample(.., reseed)`'s, whose first try is that much longer) would build, without building it: the trial
    asked at length 0 stops at its count (TooShort) after the rng's draws and a few short encodes, before any
    haystack. Cost ~1 ms whatever the length the trial is for (a whole trial: 0.1-0.3 s at 1M, common_words'
    seconds). Exact for the tasks whose statements do not depend on the length; common_words' is its list's least
    (the common words alone): a longer trial fills its list to the length with rare words, leaving 4 tokens of slack
    for its answer's joins."""
    over = 0
    if chat is not None:  # chat_sample's plain trial, built shorter by the template's tokens (seeded as it seeds it)
        over, rng = _chat_overhead(tokenizer, chat), random.Random(rng.random()) if reseed else rng
    try:
        make_sample(task, tokenizer, 0, depth, rng)
    except TooShort as e:
        return e.need + over
    raise AssertionError(f"a {task} trial fit in 0 tokens")


def cwe_may_run_out(seq_len: int) -> bool:
    """Whether common_words can run out of made-up words (TooLong) at `seq_len`: only where the list could hold every
    word of both pools twice at a token each (~49M tokens, past any length a run accepts; one tries a real trial)."""
    pool = sum((len(CONSONANTS) * len(VOWELS)) ** k for k in (3, 4))
    return seq_len > CWE_FREQ_RARE * (pool - CWE_COMMON - 1)


def tasks_as_chat(spec) -> bool:
    """`tasks: {passkey: 0.02, chat: true}`: an SFT stage renders its synthetic samples as chat exchanges
    (`chat_sample`); without it they are plain text with answer-only loss, as the retrieval evaluation asks them."""
    return bool(isinstance(spec, dict) and spec.get("chat"))


def parse_tasks(spec, where: str = "tasks") -> dict[str, float]:
    """A stage's `tasks:` ({task: fraction of the stage's samples}, and `chat: true|false`) checked; one-line
    ValueError."""
    if not spec:
        return {}
    if not isinstance(spec, dict):
        raise ValueError(f"{where}: expected {{task: fraction}}, e.g. {{passkey: 0.2}}, got {spec!r}")
    if not isinstance(spec.get("chat", False), bool):
        raise ValueError(f"{where}: chat must be true or false (render the tasks as chat exchanges in an SFT stage)")
    spec = {k: v for k, v in spec.items() if k != "chat"}
    unknown = sorted(set(spec) - set(TASKS))
    if unknown:
        raise ValueError(f"{where}: unknown task(s) {unknown}; valid: {list(TASKS)}")
    out = {t: float(spec[t]) for t in TASKS if t in spec}
    if any(not 0 < f <= 1 for f in out.values()) or sum(out.values()) > 1 + 1e-9:
        raise ValueError(f"{where}: fractions must be in (0, 1] and sum to at most 1, got {out}")
    return out


def check_tasks(stage, tokenizer) -> dict[str, float]:
    """A stage's task fractions, after checking it can generate them (text tokenizer, length)."""
    tasks = parse_tasks(getattr(stage, "tasks", None), f"stage {stage.index} ({stage.name}) tasks")
    if tasks and tokenizer is None:
        raise ValueError(f"stage {stage.index} ({stage.name}): synthetic tasks {list(tasks)} need a text tokenizer "
                         "(--tokenizer_name_or_path) or drop the stage's `tasks`")
    for t in tasks:
        try:
            need = train_need(t, tokenizer)
            if stage.max_seq_length < need:
                raise TooShort(f"max_seq_length={stage.max_seq_length} is too short for a {t} trial (needs {need} "
                               f"tokens: the most of {TRAIN_PROBES} draws plus {TRAIN_SLACK} of slack)", need)
            if t == "common_words" and cwe_may_run_out(stage.max_seq_length):
                make_sample(t, tokenizer, stage.max_seq_length, 0.5, random.Random(0))
        except ValueError as e:
            fix = "lower" if isinstance(e, TooLong) else "raise"
            raise ValueError(f"stage {stage.index} ({stage.name}): {e}: {fix} max_seq_length or drop {t}") from None
    return tasks


# A training stage's synthetic samples are drawn from seeds `{seed}:{task}:{serial}` (TaskMixDataset), each needing
# its own length (variable_tracking: 285-319 tokens with the demo's tokenizer, 192-222 with a 131k-vocabulary one),
# and one that does not fit raised mid-stage. The check takes the most of TRAIN_PROBES draws plus TRAIN_SLACK tokens: over 4000
# draws the most sat at most 12 tokens above the most of 256 (both tokenizers, every task). Cost: TRAIN_PROBES
# trial_need calls per task (~0.1-0.5 s), once per tokenizer whatever the stage's length (the need does not depend on
# it). A chat stage's template adds its own tokens on top (chat_sample shrinks its plain trial by them).
TRAIN_PROBES, TRAIN_SLACK = 256, 32


def train_need(task: str, tokenizer) -> int:
    """The length a stage needs to draw `task`'s training samples: the most of TRAIN_PROBES draws + TRAIN_SLACK."""
    cache = getattr(tokenizer, "_train_needs", None)
    if cache is None:
        cache = tokenizer._train_needs = {}
    if task not in cache:
        rngs = [random.Random(f"check:{task}:{k}") for k in range(TRAIN_PROBES)]
        cache[task] = max(trial_need(task, tokenizer, r.random(), r) for r in rngs) + TRAIN_SLACK
    return cache[task]


class TaskMixDataset:
    """The stage's dataset plus virtual synthetic samples: index `i < len(base)` is the base's sample, index
    `len(base) + k` is synthetic sample serial `k // n_tasks` of task `names[k % n_tasks]`."""

    def __init__(self, base, names: list[str], tokenizer, seq_len: int, seed: int, chat=None):
        """`chat`: a ChatEncoder (an SFT stage): the synthetic samples are rendered as chat exchanges."""
        self.base, self.names, self.tokenizer, self.seq_len, self.seed = base, list(names), tokenizer, seq_len, seed
        self.chat = chat
        self.n_base = len(base)

    def __len__(self) -> int:
        return self.n_base

    def index(self, task: int, serial: int) -> int:
        return self.n_base + serial * len(self.names) + task

    def __getitem__(self, i: int) -> dict:
        if i < self.n_base:
            return self.base[i]
        serial, task = divmod(i - self.n_base, len(self.names))
        rng = random.Random(f"{self.seed}:{self.names[task]}:{serial}")  # str seeds are hashed with SHA-512
        if self.chat is not None:
            return chat_sample(self.names[task], self.tokenizer, self.chat, self.seq_len, rng.random(), rng)
        return make_sample(self.names[task], self.tokenizer, self.seq_len, rng.random(), rng)


class TaskMixSampler:
    """Wraps a stage's sampler: each micro-step (all DP ranks together, dp x mb samples) is either the wrapped
    sampler's next micro-batch or a micro-batch of one synthetic task, chosen by the same rule as
    MixtureSampler (the component furthest below its share goes next: realised shares within one
    micro-step of the fractions at every point). Deciding per micro-step keeps every DP rank calling the
    wrapped sampler together, so its own position stays the same on all ranks."""

    def __init__(self, base, dataset: TaskMixDataset, fractions: dict[str, float], dp: int, dp_rank: int,
                 micro_batch: int):
        self.base, self.dataset = base, dataset
        self.names = list(fractions)
        assert self.names == dataset.names
        self.weights = np.asarray([1.0 - sum(fractions.values()), *fractions.values()], dtype=np.float64)
        self.dp, self.dp_rank, self.mb = dp, dp_rank, micro_batch
        self.drawn, self.counts = 0, np.zeros(len(self.weights), dtype=np.int64)
        # each task's first serial not yet trained, over all DP ranks: the same on every rank (rank r of a synthetic
        # micro-step takes serials[t] + r * mb ...). Derived from counts x dp x mb, a resume on fewer ranks or a
        # smaller micro-batch restarted inside the serials already trained: a 4-rank run resumed on 2 drew only
        # samples it had trained (exact repeats) for as many synthetic micro-steps as it had run
        self.serials = np.zeros(len(self.names), dtype=np.int64)

    def next_batch(self) -> list[int]:
        c = int(np.argmax(self.weights * (self.drawn + 1) - self.counts))
        self.counts[c] += 1
        self.drawn += 1
        if c == 0:
            return self.base.next_batch()
        serial0 = int(self.serials[c - 1]) + self.dp_rank * self.mb
        self.serials[c - 1] += self.dp * self.mb
        return [self.dataset.index(c - 1, serial0 + j) for j in range(self.mb)]

    def source_shares(self) -> dict[str, float]:
        """Share of samples per component: the wrapped sampler's components (or `stream`) and `task:<name>`."""
        n = max(1, self.drawn)
        base = self.counts[0] / n
        shares = {k: v * base for k, v in self.base.source_shares().items()} or {"stream": float(base)}
        shares.update({f"task:{t}": float(c) / n for t, c in zip(self.names, self.counts[1:])})
        return shares

    def state_dict(self) -> dict:
        return {"tasks": self.names, "drawn": self.drawn, "counts": self.counts.tolist(),
                "serials": self.serials.tolist(), "base": self.base.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        from data.sampler import check_position  # (torch: imported with the sampler, not with this module)

        check_position(state, "tasks", self.names)  # one line where the recipe changed (data/sampler.py)
        self.drawn, self.counts = int(state["drawn"]), np.asarray(state["counts"], dtype=np.int64)
        if "serials" in state:
            self.serials = np.asarray(state["serials"], dtype=np.int64)
        else:  # a state saved before the serials: its counts under the layout that saved it (the wrapped sampler's dp
            # and micro-batch): exact where that run never changed layout (the same as the old rule at the same
            # layout); one that had already been resumed on fewer ranks may go on inside serials its larger first
            # layout trained (repeats of at most those, once)
            base = state["base"]
            per_step = int(base.get("dp", self.dp)) * int(base.get("micro_batch", self.mb))
            self.serials = self.counts[1:] * per_step
        self.base.load_state_dict(state["base"])


def eval_lengths(stage, stages) -> list[int]:
    """The lengths a stage's tasks are tried at (eval.lengths: earlier | all | [lengths]; training/evaluation.py)."""
    spec = stage.eval.get("lengths", "earlier")
    if not stages:
        return [stage.max_seq_length]
    if spec in ("earlier", "all"):  # the stages up to this one, or every stage
        return sorted({s.max_seq_length for s in (stages[: stage.index + 1] if spec == "earlier" else stages)})
    if isinstance(spec, list) and all(isinstance(x, int) and x > 0 for x in spec):
        return sorted(set(spec))
    raise ValueError(f"stage {stage.name!r}: eval.lengths must be earlier, all or a list of lengths, got {spec!r}")
