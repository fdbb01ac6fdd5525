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
"""

from __future__ import annotations

import numpy as np

from data.mixture import parse_mixture, select_documents
from data.packing import ConvPack

REPEAT_NOTE = 0.05  # a stage whose samples are at least this share trained before (expected) is noted
TAIL_NOTE = 0.01  # a text pack whose last partial sample (in no sample) is at least this share of it is noted


def stage_tokens(stage, world: int, micro_batch: int, grad_accum: int) -> int:
    """The tokens a stage's steps draw (samples x length, padding included), all data-parallel ranks together."""
    dp = max(1, world // stage.sp)  # the SP degree is Ulysses x context parallelism already (base/parallel.py)
    return stage.max_steps * stage.max_seq_length * micro_batch * grad_accum * dp


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


def draw_notes(data, stages, stage, world: int, micro_batch: int, grad_accum: int) -> list[str]:
    """Notes for `stage` of `stages` over `data` (a RunData): a mixture component drawn more than once over, the
    sources no component reads, the stream drawn more than once over, or (expected) share of its samples that earlier
    stages drawing from the same whole stream trained; the tokens of a component or the stream in no sample."""
    where = f"stage {stage.index} ({stage.name})"
    tokens = stage_tokens(stage, world, micro_batch, grad_accum)
    notes = []
    if not _whole_stream(stage):
        comps = parse_mixture(stage.data)
        mix = data.viewed_mixture(stage)  # the one the stage trains from: not built twice (O(documents) on rank 0)
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
        return notes + tail_notes(where, stage.max_seq_length, tails)
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
    return notes
