"""A conversation's prefix renders as views on its one tokenization: what data/chat.py's prefix path needs of each
`render(messages[:n])`, with tokenizing linear in the conversation (issue 47 item 12).

The prefix path compares, for each assistant turn, the tokens of two or three prefix renders with the whole
conversation's tokens. Tokenized one by one, that is turns x length tokens (a 1M-token conversation of 100
messages: 206 s on a fixture tokenizer). Here the whole conversation is tokenized once, and a prefix render's tokens
are `full[:j] + seg`: a Hugging Face tokenizer splits its added (control) tokens out of the text before anything
else, so where a prefix's text is the conversation's text up to the end of an added token (the last one they
share), its tokens up to there are the conversation's, and only the rest (`seg`: the last turn's end, a generation
prompt) is tokenized, after that token's own text so that it is tokenized where it stands (never as a text's
start). The token there must come out as the conversation's (checked per prefix; otherwise that prefix is
tokenized whole). Where the added tokens sit in the text: plain ones (no strip, no single-word rule, not
normalized) at the next occurrence of their text, in order, with the Rust tokenizer run without offsets; others
from the tokenizer's offsets. A slow tokenizer takes the exact path: every prefix tokenized whole.

What is not linear: the template is still rendered per prefix, as text (transformers' apply_chat_template, which
loops over the prefix's messages: ~8 us x messages^2 in all, measured 1,000 messages ~5 s, 5,000 ~213 s on a
loaded core; data/chat_render.py prefix_costly says it at preparation, docs/sft.md has the figures).
tests/unit/data/test_chat_linear.py compares both paths on every family.

data/chat.py's `{% generation %}` path gives Renders the tokens Hugging Face's assistant mask was computed on (its
encode with offsets, `given`): they are the conversation's, taken as they are, its added tokens placed by those
offsets. Before, Renders tokenized the same text again, only for chat.py to compare the two: a 4 MB row (a real Qwen
vocabulary) 5.8 s and +801 MB of one worker, now 3.5 s and +516 MB, the prefix path 2.2 s and +380 MB (docs/sft.md).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import numpy as np


class View:
    """The tokens of one prefix render: `full[:j] + seg`."""

    __slots__ = ("full", "j", "seg")

    def __init__(self, full: list[int], j: int, seg: list[int]):
        self.full, self.j, self.seg = full, j, seg

    def __len__(self) -> int:
        return self.j + len(self.seg)

    def lcp(self, arr: np.ndarray) -> int:
        """Length of the common prefix with the conversation's tokens (`arr`, the same as `full`)."""
        n = min(len(self.seg), len(arr) - self.j)
        if n <= 0:
            return self.j
        diff = np.flatnonzero(np.asarray(self.seg[:n]) != arr[self.j:self.j + n])
        return self.j + (int(diff[0]) if len(diff) else n)

    def slice(self, a: int, b: int) -> list[int]:
        """`tokens[a:b]` (0 <= a), as a list."""
        b = min(b, len(self))
        if a >= b:
            return []
        head = self.full[a:min(b, self.j)] if a < self.j else []
        return head + self.seg[max(a - self.j, 0):b - self.j]


class Renders:
    """The conversation rendered and tokenized once (`text`, `full`, `arr`); `prefix(n, gen)` is the View of
    `render(conv[:n], add_generation_prompt=gen)`, every render given the row's `tools` (its tool definitions,
    usually in the first turn: a text every prefix shares). `linear=False`: every prefix tokenized whole (the exact
    path). `given`: the text's tokens as the tokenizer gave them, with each token's characters (a BatchEncoding's
    token_to_chars), taken instead of tokenizing it again (data/chat.py's marker path)."""

    def __init__(self, enc, conv: list[dict], linear: bool = True, tools: list | None = None,
                 given: tuple[list[int], Callable[[int], tuple[int, int] | None]] | None = None):
        self.enc, self.conv, self.tools = enc, conv, tools
        self.text = enc._text(conv, tools=tools)
        hf = enc.hf
        self.linear = linear and bool(getattr(hf, "is_fast", False))
        self.starts, self.ends, self.at = [], [], []
        if given is not None:  # (ids, token -> its characters) of this text: no tokenizing here
            self.full, chars = given
            self.arr = np.asarray(self.full)
            if self.linear:
                self._place(chars)
            return
        if not self.linear:
            self.full = enc.tok.encode(self.text)
            self.arr = np.asarray(self.full)
            return
        backend = hf.backend_tokenizer
        plain = _plain_added(hf) if enc.tok.direct else None
        if plain is not None and not getattr(backend, "encode_special_tokens", False):
            # the Rust tokenizer without offsets (~3x faster on byte-level BPE); each added token then sits at the
            # next occurrence of its text: plain added tokens match every occurrence, leftmost first
            self.full = backend.encode_batch_fast([self.text], add_special_tokens=False)[0].ids
            self.arr = np.asarray(self.full)
            pos = 0
            for t in np.flatnonzero(np.isin(self.arr, list(plain))).tolist():
                at = self.text.find(plain[self.full[t]], pos)
                if at < 0:  # not where it should be: no views (every prefix tokenized whole)
                    self.starts, self.ends, self.at = [], [], []
                    break
                pos = at + len(plain[self.full[t]])
                self.at.append(t)
                self.starts.append(at)
                self.ends.append(pos)
            return
        out = hf(self.text, add_special_tokens=False, return_offsets_mapping=True)
        self.full, offsets = list(out["input_ids"]), out["offset_mapping"]
        self.arr = np.asarray(self.full)
        self._place(offsets.__getitem__)

    def _place(self, chars: Callable[[int], tuple[int, int] | None]) -> None:
        """Where the added tokens sit in the text, from each one's characters (`chars(t)`: the tokenizer's offsets)."""
        for t in np.flatnonzero(np.isin(self.arr, list(self.enc._added()))).tolist():
            span = chars(t)
            if span is not None and span[1] > span[0]:
                self.at.append(t)
                self.starts.append(span[0])
                self.ends.append(span[1])

    def prefix(self, n: int, gen: bool = False) -> View:
        text = self.enc._text(self.conv[:n], gen, self.tools)  # RowError where the template refuses the prefix
        tok = self.enc.tok.encode
        i = self._shared(text)
        if i < 0:
            return View(self.full, 0, tok(text))
        t, s, e = self.at[i], self.starts[i], self.ends[i]
        ids = tok(self.text[s:e] + text[e:])
        if not ids or ids[0] != self.full[t]:  # the control token is not tokenized alone here: the whole prefix
            return View(self.full, 0, tok(text))
        return View(self.full, t + 1, ids[1:])

    def _shared(self, text: str) -> int:
        """Index (in `at`) of the last added token whose text `text` shares with the conversation's from its start;
        -1 for none. The shared prefix grows with i: the last candidate first (the usual case), else bisection."""
        if not self.linear:
            return -1
        hi = bisect.bisect_right(self.ends, len(text)) - 1
        if hi < 0 or self._same(text, hi):
            return hi
        lo = -1  # invariant: lo shares (or is -1), hi does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self._same(text, mid) else (lo, mid)
        return lo

    def _same(self, text: str, i: int) -> bool:
        e = self.ends[i]
        return text.startswith(self.text[:e])


def _plain_added(hf) -> dict[int, str] | None:
    """{id: text} of the added tokens where each is matched at every occurrence of its text (no strip, no
    single-word rule, not normalized or no normalizer); None otherwise (offsets are then asked of the tokenizer)."""
    norm = hf.backend_tokenizer.normalizer is not None
    out = {}
    for i, t in hf.added_tokens_decoder.items():
        if t.lstrip or t.rstrip or t.single_word or (t.normalized and norm) or not t.content:
            return None
        out[i] = t.content
    return out
