"""What a run reads: the token stream, its held-out tail (fixed for the whole curriculum), each stage's view.

The stream is a prepared folder (`scripts/prepare_data.py`, data/store.py): `--dataset_path` pointing at
one is memory-mapped by every rank itself (nothing tokenized, no collective); a small JSONL is prepared
inside the job first (data/prepare.py, rank 0, size-limited). A stage with a `data:` mixture trains on
its components (data/mixture.py); a stage without one packs the whole stream in order.

Held-out documents are chosen once per run, not per stage: the last documents of the stream, enough to
fill the largest evaluation any stage asks for (max over stages of heldout_samples x max_seq_length
tokens). No stage trains on them, and every stage evaluates on these same documents packed to its own
length, so a later stage never evaluates on tokens an earlier one trained on.

Cost at scale: the stream is memory-mapped (a 20B-token uint32 stream is 80 GB on the shared file
system, nothing of it in RAM until read); per document, its start, length (int64) and source (int32) are
the only arrays loaded whole (a few hundred MB for tens of millions of documents).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import numpy as np

from base import comm
from data.mixture import MixtureDataset, MixtureSampler, parse_mixture, select_documents
from data.packing import DocPack
from data.prepare import prepare_in_job
from data.replay import ReplayDataset, ReplaySampler, parse_replay
from data.sampler import ResumableSampler
from data.store import MANIFEST, Prepared, read_json, tokenizer_identity
from data.tasks import TaskMixDataset, TaskMixSampler, check_tasks
from data.tokenizer import Tokenizer

DEFAULT_HELDOUT_SAMPLES = 2


def heldout_samples(eval_cfg: dict) -> int:
    return int(eval_cfg.get("heldout_samples", DEFAULT_HELDOUT_SAMPLES))


def heldout_tokens(stages) -> int:
    """Tokens the held-out tail must hold: the largest evaluation of any stage."""
    return max((heldout_samples(s.eval) * s.max_seq_length for s in stages), default=0)


def split_point(n_tokens: int, starts: np.ndarray, need: int, min_train: int) -> int:
    """First held-out token: the start of the document holding token n_tokens - need, so whole documents are
    held out; if that would leave fewer than `min_train` training tokens (a stream of a few huge documents),
    cut inside that document instead. ValueError when even that cannot fit."""
    if need == 0:
        return n_tokens
    cut = n_tokens - need
    if cut < min_train:
        raise ValueError(f"the dataset has {n_tokens} tokens: the held-out documents need {need} (the largest "
                         f"stage's eval.heldout_samples x max_seq_length) and training needs at least {min_train}: "
                         "add data or lower eval.heldout_samples")
    doc_start = int(starts[np.searchsorted(starts, cut, side="right") - 1]) if len(starts) else cut
    return doc_start if doc_start >= min_train else cut


@dataclass
class RunData:
    prepared: Prepared  # the memory-mapped stream: tokens, per-document starts / lens / source
    boundary: int  # tokens[boundary:] are held out for evaluation
    tokenizer: Tokenizer | None
    reset_position_ids: bool
    mask_cross_document_labels: bool = False

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_id if self.tokenizer else 0

    @property
    def tokens(self):
        return self.prepared.tokens

    @property
    def starts(self) -> np.ndarray:
        return self.prepared.starts

    def _pack(self, idx: np.ndarray, seq_len: int, heldout: bool = False) -> DocPack:
        """Documents `idx` clipped to the training part (or the held-out part) of the stream, packed."""
        starts, ends = self.prepared.starts[idx], self.prepared.starts[idx] + self.prepared.lens[idx]
        if heldout:
            starts = np.maximum(starts, self.boundary)
        else:
            ends = np.minimum(ends, self.boundary)
        keep = ends > starts
        return DocPack(self.prepared.tokens, starts[keep], (ends - starts)[keep], seq_len, self.reset_position_ids,
                       self.mask_cross_document_labels)

    def train_set(self, seq_len: int) -> DocPack:
        """The stage's training samples: the stream before the held-out documents, packed to `seq_len`."""
        return self._pack(np.arange(len(self.prepared.lens)), seq_len)

    def mixture(self, stage) -> MixtureDataset | None:
        comps = parse_mixture(getattr(stage, "data", None), f"stage {stage.index} ({stage.name}) data")
        if comps is None:
            return None
        p = self.prepared
        parts = []
        for c in comps:
            idx = select_documents(c, p.sources, p.source, p.lens)
            pack = self._pack(idx, stage.max_seq_length)
            if len(pack) < 1:
                raise ValueError(f"stage {stage.index} ({stage.name}): mixture component {c.name!r} (sources "
                                 f"{list(c.sources)}) has {pack.n_tokens} training tokens, less than one sample of "
                                 f"{stage.max_seq_length}; the dataset's sources are {p.sources}")
            parts.append(pack)
        return MixtureDataset(parts, [c.name for c in comps])

    def stage_view(self, stage, dp: int, dp_rank: int, micro_batch: int, seed: int):
        """(dataset, sampler) a stage trains from: `dataset[i]` is a sample dict, `sampler.next_batch()` gives
        this DP rank's next micro-batch of indices, the sampler's state_dict() is the data position, and
        `sampler.source_shares()` the realised token share per mixture component ({} without a mixture).
        A stage with `tasks:` wraps both so that fraction of its micro-steps are synthetic (data/tasks.py); a
        stage with `replay:` wraps that so a share of its micro-steps are packed shorter samples, each length's
        own view of the same mixture and tasks (data/replay.py)."""
        replay = parse_replay(getattr(stage, "replay", None), stage.max_seq_length,
                              f"stage {stage.index} ({stage.name}) replay")
        dataset, sampler = self._view(stage, dp, dp_rank, micro_batch, seed)
        if not replay:
            return dataset, sampler
        short = {n: self._view(dataclasses.replace(stage, max_seq_length=n), dp, dp_rank,
                               micro_batch * (stage.max_seq_length // n), seed + 7919 * n) for n in replay}
        return (ReplayDataset(dataset, {n: v[0] for n, v in short.items()}),
                ReplaySampler(sampler, {n: v[1] for n, v in short.items()}, replay, stage.max_seq_length, micro_batch))

    def _view(self, stage, dp: int, dp_rank: int, micro_batch: int, seed: int):
        mix = self.mixture(stage)
        if mix is not None:
            weights = [c.weight for c in parse_mixture(stage.data)]
            dataset, sampler = mix, MixtureSampler(mix.sizes, weights, mix.names, dp, dp_rank, micro_batch,
                                                   seed=seed + stage.index)
        else:
            dataset = self.train_set(stage.max_seq_length)
            sampler = ResumableSampler(len(dataset), dp, dp_rank, micro_batch, seed=seed + stage.index)
        tasks = check_tasks(stage, self.tokenizer)
        if not tasks:
            return dataset, sampler
        dataset = TaskMixDataset(dataset, list(tasks), self.tokenizer, stage.max_seq_length, seed + stage.index)
        return dataset, TaskMixSampler(sampler, dataset, tasks, dp, dp_rank, micro_batch)

    def heldout(self, seq_len: int, n: int) -> list[dict[str, np.ndarray]]:
        """The first `n` held-out samples at `seq_len` (the same documents at every stage)."""
        if n == 0:
            return []
        idx = np.flatnonzero(self.prepared.starts + self.prepared.lens > self.boundary)
        ds = self._pack(idx, seq_len, heldout=True)
        return [ds[i] for i in range(min(n, len(ds)))]


def open_run_data(dataset_path: str | None, tokenizer_path: str | None, model_vocab: int, stages,
                  reset_position_ids: bool, mask_cross_document_labels: bool = False) -> RunData:
    """A small JSONL is prepared first (rank 0). Rank 0 then reads the folder's manifest and picks the tokenizer,
    every rank opens the folder with that manifest, and a folder one rank cannot open stops every rank with the
    same line (collectives). Checks the data against the model (token ids < model_vocab) and every stage's
    mixture, before any model."""
    folder, tokenizer_path = prepare_in_job(dataset_path, tokenizer_path, model_vocab)

    def choose() -> tuple[dict, str | None]:
        try:
            m = read_json(os.path.join(folder, MANIFEST))
        except OSError as e:
            raise ValueError(f"--dataset_path {folder}: no readable {MANIFEST} ({e}): prepare the data again") from None
        if tokenizer_path is None and m.get("tokenizer") and os.path.exists(m["tokenizer"]["path"]):
            return m, m["tokenizer"]["path"]  # the one it was prepared with (passkey evaluation decodes text)
        return m, tokenizer_path

    m, tokenizer_path = comm.run_on_main(choose)
    try:
        prepared, why = Prepared(folder, m), None
    except (OSError, ValueError) as e:
        prepared, why = None, f"--dataset_path {folder} on rank {comm.rank()}: {e}"
    why = next((w for w in comm.all_gather_object(why) if w), None)
    if why:
        raise ValueError(why)
    tokenizer = Tokenizer(tokenizer_path) if tokenizer_path else None
    if tokenizer is not None and m.get("tokenizer") and tokenizer_identity(tokenizer_path) != m["tokenizer"]["sha256"]:
        raise ValueError(f"--tokenizer_name_or_path {tokenizer_path} is not the tokenizer {folder} was prepared with "
                         f"({m['tokenizer']['path']}): pass that one, or prepare the data again")
    if tokenizer is not None and tokenizer.vocab_size > model_vocab:
        raise ValueError(f"tokenizer {tokenizer.path} has {tokenizer.vocab_size} tokens but the model's vocab_size is "
                         f"{model_vocab}: use the model's own tokenizer or resize the model's embeddings")
    if prepared.max_token_id >= model_vocab:
        raise ValueError(f"--dataset_path {folder}: token id {prepared.max_token_id} >= the model's vocab_size "
                         f"{model_vocab}: the data was prepared for another vocabulary")
    longest = max(s.max_seq_length for s in stages)
    boundary = split_point(len(prepared.tokens), prepared.starts, heldout_tokens(stages), min_train=longest)
    data = RunData(prepared, boundary, tokenizer, reset_position_ids, mask_cross_document_labels)
    for s in stages:
        data.mixture(s)  # a bad or empty mixture component stops the run here, before the model is built
        check_tasks(s, tokenizer)  # so does a bad `tasks:` (unknown task, fractions, too short a length)
        for n in parse_replay(getattr(s, "replay", None), s.max_seq_length, f"stage {s.index} ({s.name}) replay"):
            short = dataclasses.replace(s, max_seq_length=n)  # and a replay length its mixture or tasks cannot fill
            data.mixture(short)
            check_tasks(short, tokenizer)
    return data
