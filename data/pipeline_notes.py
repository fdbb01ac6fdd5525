"""What a stage's view says of how its conversations were packed, at the stage's start (data/pipeline.RunData._view).

- `cut_lines` (an SFT stage, ConvPack): the conversations longer than the stage dropped (no supervised token before
  the cut) or cut to its length, and the supervised tokens past the cuts, per mixture component where the stage has
  a `data:` mixture (one line each). A share of the whole stage's supervised tokens hid that most long rows were
  gone: 40 long-document QA rows among 200 short chats at 1024 read "34 dropped ... 3.6%" (34 of the 35 longer than
  1024 were); a `long` component at weight 0.3 that lost 8 of its 10 rows read "8 dropped (2.0%)", naming none.
- `text_chat_line` (a text stage, DocPack, over a folder with chat documents: no `kind: sft`, or a text stage with no
  `data:` over a mixed folder): the loss mask is honoured, but a conversation longer than what is left of a sample
  is split at the sample's end, positions restart there, and its later replies train without their question or
  document (8 long-QA rows and 20 chats at 128: 161 of the 267 supervised tokens). Said, never refused: a mixed
  folder under a text stage is legitimate.

`cut_lines` is a pure function of the packs every rank has; `text_chat_line` reads the loss mask, so rank 0 alone
runs it (data/pipeline.py: base/comm.run_on_main, the line sent to every rank's log); rank 0 prints (print0).
"""

from __future__ import annotations

import numpy as np

from data.packing import ConvPack, DocPack, targets
from data.store import Ones

BLOCK = 1 << 20  # documents (and about as many per-sample pieces) `text_chat_line` counts at once


def _share(part: int, whole: int) -> str:
    share = part / max(1, whole)
    return "under 0.1%" if 0 < share < 0.001 else f"{share:.1%}"


def _split_kind(manifest: dict) -> str:
    """What ConvPack splits into pieces: text documents, or conversations under --loss_on all (every token a target:
    a text's mask), named by the folder's manifest."""
    convs = manifest.get("chat_docs", 0) if manifest.get("loss_on") == "all" else 0
    return ("longer text document(s)" if not convs else "conversation(s) under --loss_on all (every token a target, "
            "as a text's)" if convs >= manifest.get("n_docs", 0) else "longer text document(s) or conversation(s) "
            "under --loss_on all (every token a target: alike)")


def _cut(p: ConvPack, manifest: dict) -> str:
    """One pack's counts (`p.docs`: the documents it was given, data/pipeline.RunData._pack; those split as text are
    not conversations): of those longer than the length, how many dropped and cut, the targets past the cuts."""
    lost, convs = p.lost_targets, getattr(p, "docs", len(p.starts)) - p.split
    trained = p.n_targets - p.piece_targets  # the conversations' own: a split text's pieces are none of theirs
    dropped = p.dropped - p.untargeted  # the long ones (ConvPack: a document that fits and has a target is kept)
    out = (f"{dropped} of its {dropped + p.truncated} conversation(s) longer than {p.seq_len} dropped (no supervised "
           f"token before the cut), {p.truncated} cut to the length"
           + (f", {p.untargeted} shorter one(s) dropped (no supervised token at all)" if p.untargeted else "")
           + f"; {lost} supervised token(s) past the cuts not trained ({_share(lost, lost + trained)} of its "
           f"{convs} conversation(s)' supervised tokens)")
    return out + (f"; {p.split} {_split_kind(manifest)} split into pieces" if p.split else "")


def cut_lines(where: str, packs: list, names: list[str] | None, manifest: dict) -> list[str]:
    """An SFT stage's cut lines (`where`: "stage N (name) at L"): one for the stage, or one per mixture component
    (`names`) with something cut, dropped or split; [] when nothing is. Counts ConvPack keeps: no pass over the data."""
    if names is None:
        names = [""] * len(packs)
    return [f"{where}{f', component {n!r}' if n else ''}: {_cut(p, manifest)}" for p, n in zip(packs, names)
            if isinstance(p, ConvPack) and (p.truncated or p.dropped or p.split)]


def _masked(mask, starts: np.ndarray) -> np.ndarray:
    """Whether each document (its start in the stream) lies in a chunk with a mask file: a chunk without one
    (data/store.Ones) holds text only, never read here. A mask that is one array: every document."""
    parts = getattr(mask, "parts", None)
    if parts is None:
        return np.ones(len(starts), bool)
    real = np.asarray([not isinstance(m, Ones) for m in parts] + [False])
    return real[np.searchsorted(mask.offsets, starts, side="right") - 1]


def _counts(mask, v0: np.ndarray, v1: np.ndarray, st: np.ndarray, L: int) -> np.ndarray:
    """[conversations, split, trained, orphan] of documents spanning virtual [v0, v1) (`st`: where each begins in the
    stream), each cut into its per-sample pieces: `targets` counts a piece's targets at its positions 1.. (a sample's
    first token is predicted by nothing; a conversation's own first token, its header, is not counted), and a document
    with an untrained token among those is a conversation."""
    first = v0 // L
    n = (v1 - 1) // L - first + 1  # the samples each spans
    doc = np.repeat(np.arange(len(n)), n)
    j = np.arange(len(doc)) - np.repeat(np.cumsum(n) - n, n)  # the piece's place in its document
    a = np.maximum(v0[doc], (first[doc] + j) * L)
    b = np.minimum(v1[doc], (first[doc] + j + 1) * L)
    got = targets(mask, st[doc] + a - v0[doc], b - a)
    chat = np.bincount(doc, got, len(n)) < np.bincount(doc, np.maximum(b - a - 1, 0), len(n))
    return np.asarray([chat.sum(), (chat & (n > 1)).sum(), got[chat[doc]].sum(), got[chat[doc] & (j > 0)].sum()])


def _text_counts(p: DocPack, mask) -> np.ndarray:
    """[conversations, of them split across samples, their supervised tokens trained, of those trained in a sample
    after the one their conversation starts in] of a text pack: its documents in the trained samples (the last partial
    sample is in none), BLOCK documents and about as many pieces at a time."""
    L, total = p.seq_len, np.zeros(4, np.int64)
    end = len(p) * L
    for lo in range(0, len(p.doc_starts), BLOCK):
        hi = min(lo + BLOCK, len(p.doc_starts))
        v0, v1 = p.virt[lo:hi], np.minimum(p.virt[lo + 1:hi + 1], end)
        keep = np.flatnonzero((v1 > v0) & _masked(mask, p.doc_starts[lo:hi]))
        v0, v1, st = v0[keep], v1[keep], p.doc_starts[lo:hi][keep]
        cum = np.cumsum((v1 - 1) // L - v0 // L + 1)  # pieces so far (a short stage over long documents: many)
        a = 0
        while a < len(cum):
            b = max(a + 1, int(np.searchsorted(cum, (int(cum[a - 1]) if a else 0) + BLOCK, "right")))
            total += _counts(mask, v0[a:b], v1[a:b], st[a:b], L)
            a = b
    return total


def text_chat_line(where: str, packs: list, mask) -> str:
    """A text stage's line where its packing trains some conversation's supervised tokens without its start (`where`:
    "stage N (name) at L"); '' otherwise, and for a text-only folder (`mask` None: nothing read).

    Cost: one sequential read of the loss mask of the documents in chunks holding one (data/packing.targets, as an
    SFT stage's ConvPack reads it; a mixed folder's text-only chunks are not read), and O(documents + samples) numpy
    in blocks of BLOCK documents and about as many pieces (~15 int64 temporaries each and targets' ~49 bytes: ~200 MB
    at any scale). Here (2 shared cores, load ~5): 10M ~100-token conversations (1B tokens) in 4-5 s at 1024 and at
    128k, nearly all of it the mask read (~4.5 s per billion tokens); 10M documents in text-only chunks 0.06 s. At
    100M such conversations (10B tokens): ~45 s on rank 0 at the stage's start (its ConvPack under `kind: sft`
    reads the same and best-fits for ~200 s more); longer conversations cost their tokens' read.
    """
    if mask is None:
        return ""
    convs, split, trained, orphan = (int(x) for x in sum((_text_counts(p, mask) for p in packs
                                                          if isinstance(p, DocPack)), np.zeros(4, np.int64)))
    if not orphan:
        return ""
    return (f"{where} packs {convs} conversation(s) as text: {split} split across samples, {orphan} of their "
            f"{trained} supervised tokens ({_share(orphan, trained)}) trained without their conversation's start; "
            "`kind: sft` packs each whole")
