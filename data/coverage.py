"""How much of its data a stage draws, said at the stage's start where samples repeat or data goes unread.

Each stage packs the stream (or each mixture component) at its own length and draws its samples from a seeded
permutation of them, independently of the stages before it (as a curriculum run as separate trainer runs does: a
sample at 256k is not two samples at 128k, so there is no shared position to continue from). Where the stages'
budgets together come near the stream's size, a later stage's samples hold tokens earlier stages trained while
others were never drawn (two stages of half an epoch each: ~25% of the tokens twice, ~25% never); a component
drawn many times over repeats its few samples; a text pack's last partial sample is in no sample at all. Nothing
here changes what is trained: the notes say it with the numbers, so a user adds data or changes the weights
knowingly. Computed on rank 0 only (they only print); cost: one mixture build per stage with `data:` (O(documents), a
second or two at tens of millions of documents).

The start says them for every stage at once (`start_notes`: RunData.check_batches, given the run's accumulation, and
the dry run on a prepared folder), each once: the stage's own start says only what was not said (a note about the 1M
stage came days into the run). It also says, per stage after the first, how much of the stage trains context longer
than the stage before it (`length_lines`): with document masking a stage whose documents are all shorter than the
previous stage's length trains what that stage trained, at more cost (a corpus of web pages under a 128k -> 1M
curriculum), and a loud warning names the fix (a long component, docs/data.md#choosing-length-buckets-per-stage).
"""

from __future__ import annotations

import numpy as np

from data.mixture import parse_mixture, select_documents
from data.packing import ConvPack
from data.replay import parse_replay
from data.tasks import parse_tasks

REPEAT_NOTE = 0.05  # a stage whose samples are at least this share trained before (expected) is noted
TAIL_NOTE = 0.01  # a text pack whose last partial sample (in no sample) is at least this share of it is noted


def stage_tokens(stage, world: int, micro_batch: int, grad_accum: int) -> int:
    """The tokens a stage's steps draw (samples x length, padding included), all data-parallel ranks together."""
    dp = max(1, world // stage.sp)  # the SP degree is Ulysses x context parallelism already (base/parallel.py)
    return stage.max_steps * stage.max_seq_length * micro_batch * grad_accum * dp


class Refused(ValueError):
    """A stage's mixture refused (data/pipeline.RunData.mixture's one line): `start_notes` raises it, not a warning."""


def _whole_stream(stage) -> bool:
    return getattr(stage, "data", None) is None


def tail_notes(where: str, seq_len: int, packs: list[tuple[str, int]]) -> list[str]:
    """The tokens of each text pack (name, tokens) in no sample: a pack of n tokens gives n // seq_len samples of
    `seq_len` (data/packing.DocPack; not changed, so a resumed run's samples stay the same), so its last partial sample
    (the end of its last documents in stream order) is trained in no epoch. Said where it is TAIL_NOTE or more of the
    pack: 12 documents of 160k tokens at 1M lose 871,424 tokens (45%)."""
    out = []
    for name, n in packs:
        tail = n % seq_len
        if n and tail / n >= TAIL_NOTE:
            what = "its whole stream" if name == "stream" else f"its mixture component {name!r}"
            out.append(f"note: {where}: {tail} tokens ({tail / n:.0%}) of {what} ({n} tokens) are in no sample (the "
                       f"last partial sample of {seq_len}: the end of its last documents, untrained in every epoch): "
                       "add documents, or train them at a shorter length")
    return out


def _unsaid(data, notes: list[str]) -> list[str]:
    return [n for n in notes if n not in getattr(data, "said", ())]  # said at the start (`start_notes`): not again


def draw_notes(data, stages, stage, world: int, micro_batch: int, grad_accum: int) -> list[str]:
    """Notes for `stage` of `stages` over `data` (a RunData): a mixture component drawn more than once over, the
    sources no component reads, the stream drawn more than once over, or (expected) share of its samples that earlier
    stages drawing from the same whole stream trained; the tokens of a component or the stream in no sample. Those the
    start said already (`data.said`, `start_notes`) are left out."""
    where = f"stage {stage.index} ({stage.name})"
    tokens = stage_tokens(stage, world, micro_batch, grad_accum)
    notes = []
    if not _whole_stream(stage):
        comps = parse_mixture(stage.data)
        try:
            mix = data.viewed_mixture(stage)  # the one the stage trains from: not built twice (O(documents) on rank 0)
        except ValueError as e:
            raise Refused(str(e)) from None
        weights = np.asarray([c.weight for c in comps]) / sum(c.weight for c in comps)
        over = [f"{n!r} {tokens * w / (size * stage.max_seq_length):.1f}x ({size} samples)"
                for n, w, size in zip(mix.names, weights, mix.sizes) if tokens * w > size * stage.max_seq_length]
        if over:
            notes.append(f"note: {where} draws {tokens} tokens: its mixture component(s) {', '.join(over)} repeat "
                         "their samples that many times over: add documents to them or lower their weight")
        p = data.prepared
        read = set()
        for c in comps:
            read |= set(np.unique(p.source[select_documents(c, p.sources, p.source, p.lens)]).tolist())
        unread = [i for i in range(len(p.sources)) if i not in read]
        per_source = np.bincount(p.source, weights=data.cut, minlength=len(p.sources))
        share = per_source[unread].sum() / max(1.0, per_source.sum())
        if unread and share > 0:
            notes.append(f"note: {where}: source(s) {[p.sources[i] for i in unread]} ({share:.0%} of the training "
                         "tokens) are in no component of its data: this stage does not train on them")
        tails = [(n, part.n_tokens) for n, part in zip(mix.names, getattr(mix, "parts", []))
                 if not isinstance(part, ConvPack)]  # a conversation pack pads its last sample: nothing is left out
        return _unsaid(data, notes + tail_notes(where, stage.max_seq_length, tails))
    stream = max(1, int(data.cut.sum()))
    if getattr(stage, "kind", "text") != "sft":
        notes += tail_notes(where, stage.max_seq_length, [("stream", stream)])
    f = tokens / stream
    if f > 1:
        notes.append(f"note: {where} draws {tokens} tokens from a stream of {stream}: each sample about {f:.1f} times")
    earlier = [s for s in stages[: stage.index] if _whole_stream(s)]
    seen = 1 - float(np.prod([1 - min(1.0, stage_tokens(s, world, micro_batch, grad_accum) / stream)
                              for s in earlier])) if earlier else 0.0
    if seen >= REPEAT_NOTE:
        notes.append(f"note: {where} draws its samples from the whole stream again, independently of stage(s) "
                     f"{[s.index for s in earlier]}: about {seen:.0%} of its tokens were trained by them, and after it "
                     f"about {(1 - seen) * (1 - min(1.0, f)):.0%} of the stream's {stream} tokens by no stage: more data "
                     "than the curriculum's tokens keeps repeats rare")
    return _unsaid(data, notes)


def start_notes(data, stages, world: int, micro_batch: int, grad_accum: int, done: int = 0) -> list[str]:
    """`draw_notes` of every stage still to train (its steps end past `done`, the step resumed from), for the start to
    say at once; recorded in `data.said` so that a stage's own start leaves them out. A stage whose notes fail says so
    and the others go on (notes only print), except a stage whose mixture is refused: that ValueError is raised, the
    refusal the stage's own start gives (days in, at a later stage; a dry run passed it with a warning). Cost:
    `draw_notes`' per stage (a mixture build per stage with `data:`)."""
    out, end = [], 0
    data.said = getattr(data, "said", set())
    for s in stages:
        end += s.max_steps  # training/curriculum.stage_start
        if end <= done:
            continue
        try:
            out += draw_notes(data, stages, s, world, micro_batch, grad_accum)
        except Refused:
            raise  # a refused mixture: its one line, as the stage's start gives it
        except Exception as e:  # noqa: BLE001
            out.append(f"warning: stage {s.index}'s data notes failed ({type(e).__name__}: {e}); training goes on")
    data.said |= set(out)
    return out


_CHUNK = 1 << 22  # documents per pass of `piece_stats`: ~300 MB of temporaries, whatever the stream


def piece_stats(lens: np.ndarray, seq_len: int, longer: int) -> tuple[int, int, int, int]:
    """(tokens in pieces longer than `longer`, tokens, samples holding such a piece, samples) of a text pack of
    documents `lens` (in pack order) at `seq_len`, as data/packing.DocPack cuts it: samples are consecutive windows of
    the documents laid end to end, so a document is cut into pieces at sample boundaries (its continuation starts the
    next sample at position 0) and the last partial sample is in none. Lengths only, no token read: O(documents) in
    chunks of _CHUNK plus a flag per sample (tens of millions of documents: about a second)."""
    lens = np.asarray(lens, np.int64)
    n = int(lens.sum()) // seq_len
    limit, hit, diff, tokens, at = n * seq_len, np.zeros(n + 1, bool), np.zeros(n + 1, np.int64), 0, 0
    for lo in range(0, len(lens), _CHUNK):
        ln = lens[lo: lo + _CHUNK]
        s = at + np.concatenate([[0], np.cumsum(ln)[:-1]])
        at += int(ln.sum())
        e = np.minimum(s + ln, limit)
        s, e = s[e > s], e[e > s]
        a, b = s // seq_len, (e - 1) // seq_len
        one = a == b
        head = np.where(one, e - s, (a + 1) * seq_len - s)  # a document inside one sample is all head
        tail = np.where(one, 0, e - b * seq_len)
        mid = np.maximum(0, b - a - 1) * (seq_len > longer)  # whole samples of the document: a piece of seq_len
        tokens += int(head[head > longer].sum() + tail[tail > longer].sum() + mid.sum() * seq_len)
        hit[a[head > longer]] = True
        hit[b[tail > longer]] = True
        np.add.at(diff, a[mid > 0] + 1, 1)
        np.add.at(diff, b[mid > 0], -1)
    hit |= np.cumsum(diff) > 0
    return tokens, limit, int(hit[:n].sum()), n


def _pct(x: float) -> str:
    return "0%" if x == 0 else "under 0.1%" if x < 0.001 else f"{x:.1%}"


def _reach(data, stage, n: int, longer: int) -> tuple[float, float, int]:
    """(share of tokens in pieces longer than `longer`, share of samples holding one, the longest document) of what
    the stage packs at `n`: the whole stream's training part, or each mixture component's by its weight."""
    comps = parse_mixture(getattr(stage, "data", None))
    p = data.prepared
    if comps is None:
        parts = [(1.0, data.cut[data.cut > 0])]
    else:
        total = sum(c.weight for c in comps)
        parts = []
        for c in comps:
            ln = data.cut[select_documents(c, p.sources, p.source, p.lens)]
            parts.append((c.weight / total, ln[ln > 0]))
    x = y = 0.0
    for w, ln in parts:
        t, tok, h, m = piece_stats(ln, n, longer)
        x, y = x + w * t / max(1, tok), y + w * h / max(1, m)
    return x, y, max((int(ln.max()) for _, ln in parts if len(ln)), default=0)


def _stage_lines(data, prev, s) -> list[str]:
    L, P, where = s.max_seq_length, prev.max_seq_length, f"stage {s.index} ({s.name})"
    replay = parse_replay(getattr(s, "replay", None), L, f"{where} replay")
    x, y, longest = _reach(data, s, L, P)
    x, y = x * (1 - sum(replay.values())), y * (1 - sum(replay.values()))
    for n, r in replay.items():  # a replay sample packs L / n samples of n: none holds a piece longer than n
        if n > P:
            xn, yn, _ = _reach(data, s, n, P)
            x, y = x + r * xn, y + r * (1 - (1 - yn) ** (L // n))
    tasks = parse_tasks(getattr(s, "tasks", None), f"{where} tasks")
    masked = data.reset_position_ids
    line = (f"{where}, {L} tokens: {_pct(x)} of its tokens are in document pieces longer than {P} (stage "
            f"{prev.index}'s length), {_pct(y)} of its samples hold one")
    if tasks:
        line += f"; besides, its tasks' synthetic samples ({', '.join(tasks)}) span its whole length"
    if not masked:
        line += (f" (--reset_position_ids no: every sample's positions run to {L}, but only these pieces are one "
                 "document's context; the rest attends across unrelated documents)")
    if x > 0 or tasks:
        return [line]
    why = (f"its data holds no document longer than {P} (the longest: {longest} tokens)" if longest <= P else
           f"its few documents longer than {P} are cut at sample boundaries into shorter pieces")
    return [line, f"warning: {where} trains no context longer than stage {prev.index}'s {P} tokens: {why}; "
            + (f"with document masking it trains what stage {prev.index} trained, at more cost" if masked else
               f"its positions past {P} see only unrelated documents")
            + f": give it long documents, a component of them, e.g. data: [{{name: long, weight: 0.6, min_doc_tokens: "
            f"{P}}}, {{name: short, weight: 0.4, max_doc_tokens: {P - 1}}}] (their `source:` the sources that hold "
            "them), or upsample them (docs/data.md#choosing-length-buckets-per-stage)"]


def length_lines(data, stages, header: bool = True) -> list[str]:
    """What the start says of each text stage longer than the one before: the share of its tokens in document pieces
    longer than the previous stage's length, and of its samples holding one (its replay's shorter samples counted; its
    `tasks:` said beside), and a warning where none is: that stage trains no longer context than the one before (with
    --reset_position_ids no, positions reach its length only across unrelated documents). With `header`, first whether
    document masking is on. SFT stages: data/sft_notes.py. Lengths only (`piece_stats`): no token is read; a stage
    whose count fails says so (notes only print)."""
    out = ["data: document masking " + ("on (positions restart at each document, which attends only to itself; "
                                        "--reset_position_ids no turns it off)" if data.reset_position_ids else
                                        "off (--reset_position_ids no: positions run through each sample and "
                                        "documents attend across their boundaries)")] if header else []
    for prev, s in zip(stages, stages[1:]):
        if s.max_seq_length <= prev.max_seq_length or getattr(s, "kind", "text") == "sft":
            continue
        try:
            out += _stage_lines(data, prev, s)
        except Exception as e:  # noqa: BLE001
            out.append(f"warning: stage {s.index}'s length notes failed ({type(e).__name__}: {e}); training goes on")
    return out
