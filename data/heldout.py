"""The held-out documents of a run: chosen once for the whole curriculum, spread over the stream.

Enough whole documents to fill the largest evaluation any stage asks for (max over stages of heldout_samples x
max_seq_length tokens), spread over the whole stream (`heldout_split`: documents in the order of a fixed hash of their
index, so every prefix of that order is spread evenly; a pure function of the prepared folder, the same on every rank
and every restart). data/pipeline.py applies the split (`RunData.cut`, `RunData.held`) and says its size at the start
(`heldout_note`). A conversation is never cut (its head would train without its answer): it is held out whole or
trains whole. Each stage's length L gets a held-out document of at least L/2 tokens first in the evaluation order,
where the stream has one that fits (`reach_documents`): picked by spread order alone, a books-heavy stream's held-out
set was all web pages, and the held-out loss at 1M measured no context past a few thousand tokens. Cost: O(documents)
passes over the per-document lengths, on every rank (one more per stage length for the long documents), and the masks
of the few documents it would cut.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import numpy as np

from data.store import Prepared

DEFAULT_HELDOUT_SAMPLES = 2


def heldout_samples(eval_cfg: dict) -> int:
    return int(eval_cfg.get("heldout_samples", DEFAULT_HELDOUT_SAMPLES))


_PHI64 = np.uint64(0x9E3779B97F4A7C15)  # 2^64 / golden ratio (Fibonacci hashing)


def spread_order(lens: np.ndarray, need: int) -> np.ndarray:
    """Documents holding at least `need` tokens (or all), in held-out order: by i * 2^64/phi mod 2^64, a
    low-discrepancy sequence, so the first k of the order are spread evenly over the stream, whatever k.
    O(documents) passes; only the candidates are sorted (tens of millions of documents cost no full sort)."""
    key = np.arange(len(lens), dtype=np.uint64) * _PHI64  # wraps mod 2^64: numpy arrays do not raise
    share = 1.5 * need / max(1, int(lens.sum()))
    while True:
        cand = np.flatnonzero(key <= np.uint64(min(int(share * 2.0**64), 2**64 - 1))) if share < 1 else np.arange(len(lens))
        if share >= 1 or int(lens[cand].sum()) >= need:
            return cand[np.argsort(key[cand], kind="stable")]
        share *= 2


def _spread(lens: np.ndarray, want: int, room: int):
    """`spread_order`'s documents one by one, each once, the candidates doubled while more are asked for (a larger
    pool continues after the largest key given so far: pools are sorted by the same key)."""
    last = None
    while True:
        pool = spread_order(lens, want)
        keys = pool.astype(np.uint64) * _PHI64
        new = pool if last is None else pool[keys > last]
        yield from new.tolist()
        if len(new):
            last = keys[-1]
        if want >= room or len(pool) == len(lens):
            return
        want = min(room, 2 * want)


def held_identity(prepared: Prepared, cut: np.ndarray, held: np.ndarray) -> list[str]:
    """What the held-out documents are, whatever their index: per document a hash of its held-out part's length and
    first and last 32 tokens (16 hex digits). Held-out documents are chosen by index (`spread_order`), and a folder
    prepared again (another shard count, a file added) orders its documents otherwise: a resume compares these with
    its first start's (recorded in every checkpoint) to say when the held-out set now holds trained documents. Cost:
    the held-out documents only (a few thousand at 1M-token evaluations), 64 tokens each, on every rank."""
    out = []
    for d in held.tolist():
        lo, hi = int(prepared.starts[d] + cut[d]), int(prepared.starts[d] + prepared.lens[d])
        ends = np.concatenate([np.asarray(prepared.tokens[lo: min(hi, lo + 32)]),
                               np.asarray(prepared.tokens[max(lo, hi - 32): hi])]).astype(np.int64)
        out.append(hashlib.blake2b(np.int64(hi - lo).tobytes() + ends.tobytes(), digest_size=8).hexdigest())
    return out


def sample_starts(lens: np.ndarray, seq_len: int, n: int, inside: bool = True) -> list[int]:
    """Where the held-out samples at `seq_len` begin, as offsets into the held-out documents (lengths `lens`, in
    order) laid end to end: each at the start of the first document at or after the previous sample's end, so
    even a short stage's few samples come from different documents; where that would leave no room for the
    samples still to come, right at that end, inside a document (with `inside`; else as many as start at a
    document's start). At most `n`, each one whole: `n` when the documents hold n x seq_len tokens."""
    v = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    out, pos = [], 0
    while len(out) < n and v[-1] - pos >= seq_len:
        j = int(np.searchsorted(v[:-1], pos))
        if j < len(lens) and v[-1] - v[j] >= seq_len * (1 if not inside else n - len(out)):
            pos = int(v[j])
        elif not inside:
            break
        out.append(pos)
        pos += seq_len
    return out


def reach_documents(lens: np.ndarray, wants: list[tuple[int, int]], most: int, room: int) -> list[int]:
    """Documents to hold out first so that every stage's length L (wants: [(L, samples)]) has one of at least L/2
    tokens, the longest length first (a document long enough for it serves the shorter ones too): of those of at least
    L/2 and at most `most` tokens (a longer one trains: no sample reads its rest) that fit the `room` left, the first
    in `spread_order`'s key order; none for a length no such document reaches (`reach_note` says so). Cost: one pass over
    the lengths per stage length (tens of millions of documents: a fraction of a second each)."""
    key = np.arange(len(lens), dtype=np.uint64) * _PHI64  # spread_order's key: its first long document
    out: list[int] = []
    for sl in sorted({sl for sl, k in wants if k > 0}, reverse=True):
        if any(2 * int(lens[d]) >= sl for d in out):
            continue
        left = room - int(lens[out].sum())
        cand = np.flatnonzero((2 * lens >= sl) & (lens <= min(most, left)))
        if len(cand):
            out.append(int(cand[np.argmin(key[cand])]))
    return out


def heldout_split(lens: np.ndarray, wants: list[tuple[int, int]], min_train: int,
                  chat: Callable[[int], bool] | None = None, reach: bool = True) -> tuple[np.ndarray, np.ndarray, str]:
    """(cut, held, warning) for `wants` = [(seq_len, held-out samples)] per stage: document i trains on its tokens
    [start, start + cut[i]) and the rest is held out (cut = its length: all training); `held` are the held-out
    documents in evaluation order. Whole documents in `spread_order` until every stage's samples fit, each from
    a document's start (`sample_starts`; at most twice the tokens asked); a document longer than twice the
    largest evaluation is passed over (it would take from training what no sample reads) unless only such are
    left, then its tail is held out, as the last one's is where taking it whole would leave fewer than
    `min_train` tokens (one sample of the longest stage) to train on. A conversation (`chat(d)`: its mask leaves a
    token untrained) is never cut: its head is the prompt without its answer (an SFT stage trained on nothing of
    it, its tail was scored as a conversation starting mid-document); it is held out whole or trains whole, and
    where that leaves fewer held-out tokens than asked `warning` says so. A stream too small for the largest
    evaluation holds out what leaves `min_train` (none if that is shorter than the shortest stage) and says so
    in `warning`; ValueError when not even `min_train` tokens exist. `chat` is asked only of the documents it
    would cut (a few, in a small stream: a large one fills the evaluation from whole documents). With `reach` (a run
    started since held-out sets reach each stage's length; a run resumed from before keeps its split: False) the
    `reach_documents` come first, held whole."""
    n_tok = int(lens.sum())
    cut = lens.astype(np.int64).copy()
    wants = [(sl, k) for sl, k in wants if k > 0]
    need = max((sl * k for sl, k in wants), default=0)
    if need == 0:
        return cut, np.zeros(0, np.int64), ""
    if n_tok < min_train:
        raise ValueError(f"the dataset has {n_tok} tokens, fewer than one training sample of the longest stage "
                         f"({min_train} tokens): add data or shorten max_seq_length")
    room, small = n_tok - min_train, need > n_tok - min_train
    if small:
        room = room if room >= min(sl for sl, _ in wants) else 0
    budget, held, big, whole = min(need, room), [], [], 0  # whole: conversations left to train, not cut

    def fits() -> bool:  # every stage's samples start at a document's start
        return all(len(sample_starts(lens[held] - cut[held], sl, k, inside=False)) == k for sl, k in wants)

    def hold(d: int, take: int) -> int:  # document d's last `take` tokens held out; a conversation whole or not at all
        nonlocal whole
        if take < lens[d] and chat is not None and chat(d):
            whole += 1
            return 0
        held.append(d)
        cut[d] -= take
        return take

    total = 0
    first = reach_documents(lens, wants, 2 * need, room) if reach and room else []
    for d in first:  # whole, first in the evaluation order: every stage's first sample starts at the longest one
        total += hold(d, int(lens[d]))
    for d in _spread(lens, min(room, 2 * budget), room) if room else ():
        if total >= min(2 * budget, room) or (total >= budget and fits()):
            break  # enough, or as much as spreading the sample starts may cost (the rest start inside documents)
        if d in first:
            continue
        if lens[d] > 2 * need:
            big.append(d)  # longer than any evaluation reads: it trains, unless nothing else is left
            continue
        total += hold(d, min(int(lens[d]), room - total))  # its tail only where the whole would starve training
    for d in big:  # a stream of a few huge documents: their tails
        if total >= budget:
            break
        total += hold(d, min(int(lens[d]), budget - total))
    fix = "(add data, or set --eval_heldout_samples / eval.heldout_samples)"
    whole_said = (f"a conversation is held out whole or not at all, and {whole} more would each have left fewer than "
                  f"{min_train} tokens to train on")
    if small:
        warning = (f"warning: the dataset has {n_tok} tokens, too few for {need} held-out tokens (the largest stage's "
                   f"eval heldout_samples x max_seq_length) and {min_train} to train on: "
                   + (f"holding out {total} tokens instead" if total else "no held-out evaluation")
                   + (f"; {whole_said}" if whole else "") + f" {fix}")
    elif whole and total < budget:
        warning = (f"warning: holding out {total} of the {need} tokens the largest stage's eval asks (heldout_samples x "
                   f"max_seq_length): {whole_said} {fix}")
    else:
        warning = ""
    return cut, np.asarray(held, dtype=np.int64), warning


HELD_NOTE = 0.05  # a held-out share of the stream above this is said with how to lower it


def split_of(stages) -> dict:
    """The held-out split a run starts with (data/pipeline.open_run_data; recorded in every checkpoint, a resume makes
    its first start's again): each stage's held-out samples at its length and at the first stage's (every stage also
    evaluates there), one training sample of the longest stage kept, a long document held out per length (`reach`)."""
    first = stages[0].max_seq_length
    wants = [[n, heldout_samples(s.eval)] for s in stages for n in sorted({s.max_seq_length, first})]
    return {"wants": wants, "min_train": max(s.max_seq_length for s in stages), "reach": True}


def heldout_note(lens: np.ndarray, cut: np.ndarray, held: np.ndarray, split: dict | None = None,
                 chats: bool = False) -> list[str]:
    """The start's lines on the held-out split: how many documents and tokens it holds out of the stream, above
    HELD_NOTE how to lower it (a small SFT set: 1,000 LIMA-sized conversations lose ~15% to two 128k evaluations,
    which `heldout_split` takes whole documents for, up to twice the tokens asked), and given the `split` it was made
    from, `reach_note` (not for `chats`). [] when nothing is held out."""
    if not len(held):
        return []
    total = int(lens.sum())
    taken = total - int(cut.sum())
    share = taken / max(1, total)
    lines = [f"held out {len(held)} documents, {taken} tokens ({share:.1%} of the stream): every stage's held-out loss "
             "is measured on them, no stage trains on them"]
    if share > HELD_NOTE:
        lines.append(f"note: the held-out documents are {share:.1%} of the stream (the largest stage's eval "
                     "heldout_samples x max_seq_length, in whole documents): lower eval.heldout_samples in the recipe (or "
                     "--eval_heldout_samples; 0: no held-out loss) to train on more of a small dataset")
    # (not for chats: a conversation set is short on purpose, and "add long documents" is no advice for it)
    reach = reach_note(lens, cut, held, [tuple(w) for w in split["wants"]], bool(split.get("reach"))) \
        if split and not chats else ""
    return lines + [reach] * bool(reach)


def reach_note(lens: np.ndarray, cut: np.ndarray, held: np.ndarray, wants: list[tuple[int, int]], reach: bool) -> str:
    """One line where a stage's held-out loss measures no context past half its length: no held-out document reaches
    L/2 (the stream has none that fits, or the split is a resumed run's from before `reach_documents`: kept, since
    another split would shift its training samples under the data position). '' when every stage's does."""
    if not len(held):
        return ""
    longest = int((lens[held] - cut[held]).max())
    short = sorted({sl for sl, k in wants if k > 0 and 2 * longest < sl})
    if not short:
        return ""
    why = ("this run's held-out documents were chosen at its first start, before a long one was held out for each "
           "stage: kept, so its training samples stay the same (a new run holds one out)" if not reach else
           f"the stream has no document of {(short[0] + 1) // 2}+ tokens that the held-out set can take whole: add long "
           "documents (docs/data.md#choosing-length-buckets-per-stage)")
    return (f"note: no held-out document reaches past {longest} tokens, so the held-out loss at {short} measures no "
            f"context past that (its position buckets beyond it are none): {why}")
