"""What a run reads: the token stream, its held-out documents (fixed for the whole curriculum), each stage's view.

The stream is a prepared folder (`scripts/prepare_data.py`, data/store.py): `--dataset_path` pointing at
one is memory-mapped by every rank itself (nothing tokenized, no collective); a small JSONL is prepared
inside the job first (data/prepare.py, rank 0, size-limited). Rank 0 picks the tokenizer (data/run_tokenizer.py).
A stage with a `data:` mixture trains on its components (data/mixture.py); a stage without one packs the whole
stream in order.

Held-out documents are chosen once per run, not per stage (data/heldout.py: enough whole documents for the largest
evaluation, spread over the stream). No stage trains on them, and every stage evaluates on these same documents
packed to its own length (in that order: a short stage's few samples still come from several documents and parts of
the stream), so a later stage never evaluates on tokens an earlier one trained on. A dataset too small for that share
keeps a smaller held-out set (a one-line warning) as long as one training sample of the longest stage remains; the
start says how many documents and tokens are held out (`heldout_note`).

Cost at scale: the stream is memory-mapped (a 20B-token uint32 stream is 80 GB on the shared file
system, nothing of it in RAM until read); the per-document arrays are loaded whole by every rank: start,
length, cut (int64), source (int32) and a stage's pack index, ~44 bytes a document kept and ~90 while a stage
packs (measured on 4M documents): 25B tokens of ~700-token web documents (36M) cost ~1.6 GB a rank, ~13 GB
a node of 8 ranks, ~3 GB a rank at a stage's start.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from dataclasses import dataclass

import numpy as np

from base import comm
from base.log import print0
from data.coverage import length_lines, start_notes
from data.heldout import held_identity, heldout_note, heldout_samples, heldout_split, sample_starts, split_of
from data.mixture import MixtureDataset, MixtureSampler, parse_mixture, select_documents
from data.packing import ConvPack, DocPack, chat_documents, vocab_refusal
from data.pipeline_notes import cut_lines, text_chat_line
from data.prepare import prepare_in_job
from data.prepared_again import again_note, rules_note, same_input, unrecorded_note
from data.replay import ReplayDataset, ReplaySampler, parse_replay
from data.run_tokenizer import pick_tokenizer
from data.sampler import ResumableSampler
from data.sft_notes import sft_notes
from data.store import MANIFEST, Prepared, read_json, vocab_identity
from data.tasks import TaskMixDataset, TaskMixSampler, check_tasks, tasks_as_chat
from data.tokenizer import Tokenizer


@dataclass
class RunData:
    prepared: Prepared  # the memory-mapped stream: tokens, per-document starts / lens / source
    cut: np.ndarray  # per document: tokens [start, start + cut) train, the rest is held out (heldout_split)
    held: np.ndarray  # the held-out documents, in evaluation order
    tokenizer: Tokenizer | None
    reset_position_ids: bool
    mask_cross_document_labels: bool = False
    heldout_split: dict | None = None  # {"wants", "min_train", "reach"} it was made from: recorded in every checkpoint

    def reply_stops(self) -> list[int]:
        """The end-of-turn ids the run's chat documents trained (data/chat_stops.py); [] for text-only data. Read
        once; every checkpoint records them, so an export of it adds the same stops (scripts/export_hf.py)."""
        if self.mask is None or self.tokenizer is None:
            return []
        if not hasattr(self, "_stops"):
            from data.chat_stops import reply_stops

            self._stops = reply_stops(self.tokenizer.path, self.prepared.manifest.get("chat_template") or "auto")
        return self._stops

    def trained_template(self) -> str | None:
        """The chat template the run's conversations were rendered with, where the tokenizer's own default is another
        (data/chat_stops.trained_template): its export carries it. None for text-only data or the same template."""
        if self.mask is None or self.tokenizer is None:
            return None
        if not hasattr(self, "_template"):
            from data.chat_stops import trained_template

            self._template = trained_template(self.tokenizer.path, self.prepared.manifest.get("chat_template") or "auto")
        return self._template

    @property
    def tokenizer_vocab(self) -> str | None:
        """The vocabulary of the run's tokenizer (data/store.vocab_identity; None without one), read once."""
        if self.tokenizer is None:
            return None
        if not hasattr(self, "_vocab"):
            self._vocab = vocab_identity(self.tokenizer.path)
        return self._vocab

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_id if self.tokenizer else 0

    @property
    def tokens(self):
        return self.prepared.tokens

    @property
    def starts(self) -> np.ndarray:
        return self.prepared.starts

    @property
    def mask(self):
        """The prepared per-token loss mask (chat documents: data/chat.py), None for a text-only folder."""
        return getattr(self.prepared, "mask", None)

    def _pack(self, idx: np.ndarray, seq_len: int, heldout: bool = False, sft: bool = False,
              whole: bool = False) -> DocPack | ConvPack:
        """Documents `idx` clipped to the training part (or the held-out part; `whole`: neither) of the stream, packed:
        end to end (text), or as whole conversations side by side (`sft`: ConvPack)."""
        starts, ends = self.prepared.starts[idx], self.prepared.starts[idx] + self.prepared.lens[idx]
        if heldout:
            starts = starts + self.cut[idx]
        elif not whole:
            ends = starts + self.cut[idx]
        keep = ends > starts
        if sft:
            pack = ConvPack(self.prepared.tokens, self.mask, starts[keep], (ends - starts)[keep], seq_len, self.pad_id)
            pack.docs = int(keep.sum())  # the documents it was given: its stage note counts them (data/pipeline_notes)
            return pack
        return DocPack(self.prepared.tokens, starts[keep], (ends - starts)[keep], seq_len, self.reset_position_ids,
                       self.mask_cross_document_labels, self.mask)

    def train_set(self, seq_len: int, sft: bool = False) -> DocPack | ConvPack:
        """The stage's training samples: the stream without the held-out documents, packed to `seq_len`."""
        return self._pack(np.arange(len(self.prepared.lens)), seq_len, sft=sft)

    def check_sft(self, stage) -> None:
        """An SFT stage needs chat documents (a loss mask) and document masking; one line otherwise."""
        if getattr(stage, "kind", "text") != "sft":
            return
        where = f"stage {stage.index} ({stage.name}) kind sft"
        if self.mask is None:
            raise ValueError(f"{where}: the dataset has no chat documents (no loss mask): prepare chat rows (messages, "
                             "conversations, prompt/completion) with scripts/prepare_data.py, or make it a text stage")
        if not self.reset_position_ids:
            raise ValueError(f"{where}: conversations are packed with document masking, which restarts positions: "
                             "drop --reset_position_ids no")

    def short_chat_heldout(self, stage) -> str:
        """A warning when an SFT stage's held-out conversation loss has fewer samples than its eval asks: the held-out
        documents are spread over the whole stream, so in a folder of mostly text its conversations get their share of
        them, few or none (the loss is then reported as none, never 0.0). '' when it has them all."""
        asked = heldout_samples(getattr(stage, "eval", None) or {})
        if getattr(stage, "kind", "text") != "sft" or self.mask is None or not asked:
            return ""
        pack, convs = self._heldout_conversations(stage.max_seq_length)
        got = min(asked, len(pack))  # counted, not built (a sample at 1M is tens of MB; the evaluation builds its own)
        if got >= asked:
            return ""
        return (f"warning: stage {stage.index} ({stage.name}) kind sft: {got} of the {asked} held-out conversation "
                f"samples its eval asks at {stage.max_seq_length} (the {len(self.held)} held-out documents, spread over the "
                f"whole folder, hold {convs} conversation(s)): its held-out conversation loss is "
                + ("none" if not got else f"over {got} sample(s)")
                + "; score held-out chats with scripts/evaluate.py RUN --heldout CHATS.jsonl")

    def _held_spans(self) -> tuple[np.ndarray, np.ndarray]:
        """(start, length) of each held-out document in the token stream, past its cut."""
        p, held = self.prepared, self.held
        return p.starts[held] + self.cut[held], p.lens[held] - self.cut[held]

    def _heldout_conversations(self, seq_len: int) -> tuple[ConvPack, int]:
        """The held-out conversations packed whole at `seq_len` (ConvPack, as an SFT stage packs), and how many."""
        starts, lens = self._held_spans()
        keep = chat_documents(self.mask, starts, lens)
        return ConvPack(self.prepared.tokens, self.mask, starts[keep], lens[keep], seq_len, self.pad_id), len(keep)

    def held_hint(self, idx: np.ndarray, n: int, sft: bool, got: int) -> str:
        """Where packing `idx` at `n` gives too few samples (`got`) and the held-out documents hold some it would
        train: how many with them, naming the setting that holds them out; '' otherwise (one more packing, on a
        refusal's path only)."""
        if not len(self.held) or len(with_held := self._pack(idx, n, sft=sft, whole=True)) <= got:
            return ""
        return (f"; with the held-out documents it packs {len(with_held)}: lower eval.heldout_samples "
                "(--eval_heldout_samples; 0 holds none out)")

    def mixture(self, stage, replay_of: int | None = None) -> MixtureDataset | None:
        """The stage's `data:` components packed to its length (None without one); `replay_of`: the length of the stage
        whose replay length this is (its refusals name the replay length)."""
        comps = parse_mixture(getattr(stage, "data", None), f"stage {stage.index} ({stage.name}) data")
        if comps is None:
            return None
        p = self.prepared
        where = f"stage {stage.index} ({stage.name})" + (f" replay length {stage.max_seq_length}" if replay_of else "")
        parts = []
        for c in comps:
            idx = select_documents(c, p.sources, p.source, p.lens)
            sft = getattr(stage, "kind", "text") == "sft"
            pack = self._pack(idx, stage.max_seq_length, sft=sft)
            held = self.held_hint(idx, stage.max_seq_length, sft, 0) if len(pack) < 1 else ""
            if len(pack) < 1 and getattr(pack, "dropped", 0):  # (an SFT replay length cutting a long-document QA set)
                raise ValueError(f"{where}: mixture component {c.name!r}: {dropped_line(pack, stage.max_seq_length)}: "
                                 + (REPLAY_FIX if replay_of else "lengthen max_seq_length, or give the stage other data")
                                 + held)
            if len(pack) < 1 and not len(idx) and (c.min_doc_tokens or c.max_doc_tokens is not None):
                bounds = " and ".join(([f">= {c.min_doc_tokens}"] if c.min_doc_tokens else [])
                                      + ([f"<= {c.max_doc_tokens}"] if c.max_doc_tokens is not None else []))
                raise ValueError(f"{where}: mixture component {c.name!r}: no document of {bounds} tokens in sources "
                                 f"{list(c.sources)} (min_doc_tokens / max_doc_tokens): add such documents, or adjust "
                                 f"or drop the stage's data:; the dataset's sources are {p.sources}")
            if len(pack) < 1:
                raise ValueError(f"{where}: mixture component {c.name!r} (sources "
                                 f"{list(c.sources)}) has {pack.n_tokens} training tokens, less than one sample of "
                                 f"{stage.max_seq_length}; the dataset's sources are {p.sources}{held}")
            parts.append(pack)
        return MixtureDataset(parts, [c.name for c in comps])

    def check_batches(self, stages, world: int, micro_batch: int, done: int = 0, grad_accum: int | None = None) -> None:
        """One line (ValueError, on every rank) at the start, before any model, where a stage still to train (its steps
        end past `done`, the step resumed from) has fewer packed samples of the whole stream than one step gives its
        data-parallel ranks (dp x micro-batch; a replay length: dp x micro-batch x L/l of its samples): its sampler
        refused it only at the stage's start, after the stages before it trained, and again at every requeue. A stage
        with `data:` is not refused (its sampler repeats a small component's samples: data/coverage.py says so). Rank 0
        counts: one packing per stage and replay length, O(documents) each (a second or two at tens of millions; an SFT
        stage's ~2 s per million conversations). With `grad_accum` (the run's) rank 0 then says every stage's draw notes
        at once (data/coverage.start_notes: a stage's own start said them, days into a curriculum). The notes are made
        inside the same run_on_main (a mixture build per `data:` stage: ~20 s at 36M documents, minutes per SFT
        component at 100M conversations): the other ranks wait on the bounded host wait, never in a collective (NCCL's
        watchdog) for rank 0's work."""
        def count_and_note() -> list[str]:
            self._check_batches(stages, world, micro_batch, done)
            return [] if grad_accum is None else start_notes(self, stages, world, micro_batch, grad_accum, done)

        notes = comm.run_on_main(count_and_note, long=True)
        self.said = getattr(self, "said", set()) | set(notes)  # every rank: a stage's own start leaves them out
        for line in notes:  # notes only print (print0: rank 0), never a stop
            print0(line)

    def _check_batches(self, stages, world: int, micro_batch: int, done: int) -> None:
        end = 0
        for s in stages:
            end += s.max_steps  # training/curriculum.stage_start
            if end <= done or getattr(s, "data", None) is not None:
                continue
            dp, sft, L = max(1, world // s.sp), getattr(s, "kind", "text") == "sft", s.max_seq_length
            where = f"stage {s.index} ({s.name})"
            for n in [L, *parse_replay(getattr(s, "replay", None), L, f"{where} replay")]:
                pack, per = self.train_set(n, sft), L // n  # a replay sample packs L / n samples of length n
                if len(pack) >= dp * micro_batch * per:
                    continue
                need = f"dp {dp} x per_device_train_batch_size {micro_batch}" + (f" x {L}/{n}" if per > 1 else "")
                why = f" ({dropped_line(pack, n)})" if getattr(pack, "dropped", 0) else ""
                raise ValueError(f"{where}{f' replay length {n}' if per > 1 else ''}: {len(pack)} packed samples of {n} "
                                 f"tokens, fewer than the {need} = {dp * micro_batch * per} one step reads{why}: "
                                 + (REPLAY_FIX if per > 1 else "add data, lengthen max_seq_length to keep those dropped"
                                    if not len(pack) and why else "add data, shorten max_seq_length")
                                 + ", or lower the batch size or the data-parallel degree (world / sp)"
                                 + self.held_hint(np.arange(len(self.prepared.lens)), n, sft, len(pack)))

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

    def viewed_mixture(self, stage) -> MixtureDataset | None:
        """The mixture the stage's view trains from (built by `stage_view`), else a new one (data/coverage.py)."""
        key = (stage.index, stage.max_seq_length, getattr(stage, "kind", "text"))
        got = getattr(self, "_viewed", {})
        return got[key] if key in got else self.mixture(stage)

    def _view(self, stage, dp: int, dp_rank: int, micro_batch: int, seed: int):
        mix = self.mixture(stage)
        if not hasattr(self, "_viewed") or stage.index not in {k[0] for k in self._viewed}:
            self._viewed = {}  # the current stage's only: a later stage's view drops the earlier's
        self._viewed[(stage.index, stage.max_seq_length, getattr(stage, "kind", "text"))] = mix
        if mix is not None:
            weights = [c.weight for c in parse_mixture(stage.data)]
            dataset, sampler = mix, MixtureSampler(mix.sizes, weights, mix.names, dp, dp_rank, micro_batch,
                                                   seed=seed + stage.index)
        else:
            dataset = self.train_set(stage.max_seq_length, sft=getattr(stage, "kind", "text") == "sft")
            sampler = ResumableSampler(len(dataset), dp, dp_rank, micro_batch, seed=seed + stage.index)
        packs = mix.parts if mix is not None and hasattr(mix, "parts") else [dataset]
        if any(isinstance(p, ConvPack) for p in packs):  # which packing the samples' indices name (a resume says a change)
            sampler.packing = next(p for p in packs if isinstance(p, ConvPack)).state_dict()["packing"]
        where = f"stage {stage.index} ({stage.name}) at {stage.max_seq_length}"
        names = mix.names if mix is not None and hasattr(mix, "parts") else None
        if any(isinstance(p, ConvPack) and (p.truncated or p.dropped or p.split) for p in packs):  # an SFT stage's
            for line in cut_lines(where, packs, names, self.prepared.manifest):  # cuts, per mixture component
                print0(line)
        if getattr(stage, "kind", "text") != "sft":  # a text stage splitting conversations: rank 0 alone reads the
            # mask (~45 s at 100M conversations, once, not by every rank off the shared file system), the others wait
            # on the bounded host wait, not in a collective
            line = comm.run_on_main(lambda: text_chat_line(where, packs, self.mask), long=True)
            if line:
                print0(line)
        if mix is not None and all(isinstance(p, ConvPack) for p in packs):  # each component packed alone: its
            fills = [p.fill() for p in packs]  # weight is a share of samples, padding included (said, not changed)
            real = [w * f for w, f in zip(weights, fills)]
            if min(fills) < 0.9:
                print0(f"stage {stage.index} ({stage.name}) at {stage.max_seq_length}: each mixture component is packed alone; "
                       + ", ".join(f"{n} fills {f:.2f} of its samples (weight {w:g}: {r / sum(real):.3f} of the "
                                   "conversation tokens)" for n, f, w, r in zip(mix.names, fills, weights, real))
                       + ": a weight counts its padding; raise it, or put the sources in one component")
        tasks = check_tasks(stage, self.tokenizer)
        if not tasks:
            return dataset, sampler
        chat = None
        if getattr(stage, "kind", "text") == "sft" and tasks_as_chat(stage.tasks):  # in the conversations' template
            from data.chat import ChatEncoder

            # at the preparation's instant (a date template's `strftime_now`): every rank renders the same trials, and
            # as the conversations were (each rank's own clock split an SP group's tokens across a midnight)
            chat = ChatEncoder(self.tokenizer, "assistant", self.prepared.manifest.get("chat_template", "auto"),
                               self.prepared.manifest.get("created"))
        dataset = TaskMixDataset(dataset, list(tasks), self.tokenizer, stage.max_seq_length, seed + stage.index, chat)
        return dataset, TaskMixSampler(sampler, dataset, tasks, dp, dp_rank, micro_batch)

    def heldout(self, seq_len: int, n: int, sft: bool = False) -> list[dict[str, np.ndarray]]:
        """The first `n` held-out samples at `seq_len`: the same documents, in the same order, at every stage; each
        sample starts at a document's start where one leaves room (`sample_starts`), so its position buckets
        measure growing context. With `sft` (an SFT stage's evaluation, the held-out conversation loss) the held-out
        conversations packed whole, as the stage trains (ConvPack): chat documents only (data/packing.py
        `chat_documents`), none when no conversation was held out."""
        if sft:  # the conversations only: a mixed folder's held-out text documents would outweigh them (issue 47)
            pack = self._heldout_conversations(seq_len)[0]
            return [pack[i] for i in range(min(n, len(pack)))]
        starts, lens = self._held_spans()
        at = np.concatenate([[0], np.cumsum(lens)])  # where each held-out document begins, laid end to end
        out = []
        for o in sample_starts(lens, seq_len, n):
            j = int(np.searchsorted(at, o, side="right")) - 1  # the document the sample begins in
            st, ln = starts[j:].copy(), lens[j:].copy()
            st[0], ln[0] = st[0] + o - at[j], ln[0] - (o - at[j])
            out.append(DocPack(self.prepared.tokens, st, ln, seq_len, self.reset_position_ids,
                               self.mask_cross_document_labels, self.mask)[0])  # chat documents: their targets only
        return out


def dropped_line(pack: ConvPack, n: int) -> str:
    """Why an SFT pack at `n` tokens is empty or short: conversations whose supervised tokens all lie past the cut, or
    that hold none (`untargeted`)."""
    what = f"all {pack.dropped} of its conversations were" if not pack.n_tokens else f"{pack.dropped} conversation(s) were"
    none = getattr(pack, "untargeted", 0)
    return f"{what} dropped: their supervised tokens lie past the cut at {n} tokens" + (
        f" ({none} of them hold none at all)" if none else "")


def _chat(prepared):
    """Whether document d is a conversation (held out whole or trains whole: data/heldout.py); None for text only."""
    mask = getattr(prepared, "mask", None)
    return (lambda d: bool(len(chat_documents(mask, prepared.starts[d:d + 1], prepared.lens[d:d + 1])))) \
        if mask is not None else None


def lengths_view(folder: str, stages, reset_position_ids: bool) -> RunData:
    """A prepared folder as the dry run sees it (training/startup.dry_run): its documents' lengths and sources, the
    held-out split a run would start with, no tokenizer; enough for data/coverage.py's notes. Cost: the per-document
    arrays (~20 bytes a document) and O(documents) passes; no token is read."""
    prepared = Prepared(folder, read_json(os.path.join(folder, MANIFEST)))
    split = split_of(stages)
    cut, held, _ = heldout_split(prepared.lens, [tuple(w) for w in split["wants"]], split["min_train"],
                                 chat=_chat(prepared))
    return RunData(prepared, cut, held, None, reset_position_ids, heldout_split=split)


REPLAY_FIX = "use a longer replay length, or drop the replay (it packs the stage's own data at each length)"


def open_run_data(dataset_path: str | None, tokenizer_path: str | None, model_vocab: int, stages,
                  reset_position_ids: bool, mask_cross_document_labels: bool = False,
                  model_path: str | None = None, heldout: dict | None = None, trained_on: str | None = None) -> RunData:
    """A small JSONL is prepared first (rank 0). Rank 0 then reads the folder's manifest and picks the tokenizer,
    every rank opens the folder with that manifest, and a folder one rank cannot open stops every rank with the
    same line (collectives). Checks the data against the model (token ids < model_vocab), against the tokenizer
    whose ids the resumed checkpoint was trained on (`trained_on`, its SHA-256) and every stage's mixture, before
    any model."""
    # a resumed run (its first start's split recorded) is prepared again whatever the in-job limit says today
    user = tokenizer_path is not None
    folder, tokenizer_path = prepare_in_job(dataset_path, tokenizer_path, model_vocab, model_path,
                                            resumed=heldout is not None, first=(heldout or {}).get("prepared"))

    def choose() -> tuple[dict, str | None]:
        try:
            m = read_json(os.path.join(folder, MANIFEST))
        except OSError as e:
            raise ValueError(f"--dataset_path {folder}: no readable {MANIFEST} ({e}): prepare the data again") from None
        return m, pick_tokenizer(folder, m, tokenizer_path, model_path, stages, user)  # passkey evaluation decodes text

    m, tokenizer_path = comm.run_on_main(choose)
    if comm.rank() == 0 and (note := rules_note(folder, m)):
        print0(note)  # a folder prepared before a git pull that changed how its rows tokenize
    # another vocabulary's ids would train under the same weights (a template fixed since is the same tokenizer)
    vocab = comm.run_on_main(lambda: vocab_identity(tokenizer_path)) if trained_on and tokenizer_path else None
    if vocab and vocab != trained_on:
        raise ValueError(f"--dataset_path {folder}: tokenized with {tokenizer_path}, whose vocabulary is not the one the "
                         "resumed checkpoint trained on: resume with that tokenizer's data, or start a new run (another "
                         "--output_dir, or --resume none)")
    try:
        prepared, why = Prepared(folder, m), None
    except (OSError, ValueError) as e:  # store.Prepared turns a truncated .npy (EOFError...) into a ValueError too
        # the host named: a folder copied to node-local disk on every node (docs/multinode.md) fails on one node's copy
        prepared, why = None, f"--dataset_path {folder}: the copy on {socket.gethostname()} (rank {comm.rank()}): {e}"
    why = next((w for w in comm.all_gather_object(why) if w), None)
    if why:
        raise ValueError(why)
    tokenizer = Tokenizer(tokenizer_path) if tokenizer_path else None
    if tokenizer is not None and tokenizer.vocab_size > model_vocab:
        raise ValueError(vocab_refusal(tokenizer, model_vocab))
    if prepared.max_token_id >= model_vocab:
        raise ValueError(f"--dataset_path {folder}: token id {prepared.max_token_id} >= the model's vocab_size "
                         f"{model_vocab}: the data was prepared for another vocabulary")
    split = split_of(stages)
    first_docs, first_folder = (heldout or {}).get("docs"), (heldout or {}).get("prepared")
    first_input = (heldout or {}).get("input")
    heldout = {k: v for k, v in heldout.items() if k not in ("docs", "prepared", "input")} if heldout else heldout
    if heldout and any(heldout.get(k) != split[k] for k in ("wants", "min_train")):  # a resume: its first start's
        print0(f"note: the held-out documents stay those of this run's first start (its stages asked {heldout['wants']}"
               f", today's {split['wants']}): a new length evaluates what they hold; the training samples stay the "
               "same, so the data position resumes where it was")
    split = heldout or split  # a split recorded before "reach" (data/heldout.reach_documents) is made as it was then
    cut, held, warning = heldout_split(prepared.lens, [tuple(w) for w in split["wants"]], min_train=split["min_train"],
                                       chat=_chat(prepared), reach=bool(split.get("reach")))
    for line in [warning] * bool(warning) + heldout_note(prepared.lens, cut, held, split, _chat(prepared) is not None):
        print0(line)
    docs = held_identity(prepared, cut, held)
    moved = len(set(docs) - set(first_docs)) if first_docs is not None else 0
    if first_folder and os.path.realpath(first_folder) != os.path.realpath(folder) and dataset_path != folder and \
            comm.rank() == 0 and same_input(first_input, dataset_path, first_folder, folder):
        print0(again_note(dataset_path, folder, first_folder))  # prepared in the job again under another cache key
    elif heldout is not None and not first_folder and folder != dataset_path and comm.rank() == 0:
        print0(unrecorded_note(dataset_path, folder))  # a checkpoint from before the record: which it trained on unknown
    if moved:  # (said beside the note above too: a re-tokenized chat set moves its held-out documents)
        print0(f"note: {moved} of the {len(docs)} held-out documents were not held out at this run's first start (the "
               f"folder at --dataset_path was prepared again: its documents re-tokenized or in another order): they "
               "may have trained, so the held-out loss from here is not comparable with the one before; a clean one "
               "needs a new run (another --output_dir)")
    split = {**split, "docs": first_docs if first_docs is not None else docs,  # the first start's, kept: said again
             "prepared": first_folder or folder, "input": (heldout or {}).get("input", dataset_path)}  # what it
    # first trained on: the folder, and the --dataset_path it was prepared from
    data = RunData(prepared, cut, held, tokenizer, reset_position_ids, mask_cross_document_labels, split)
    if vocab and tokenizer is not None:
        data._vocab = vocab  # read once: every checkpoint records it (tokenizer_vocab)
    for s in stages:
        data.check_sft(s)  # an SFT stage on a folder without chat documents
        short = data.short_chat_heldout(s)
        if short:
            print0(short)
        for line in sft_notes(s, data.mixture(s), prepared, model_path, stages):  # a bad or empty mixture component stops
            print0(line)  # the run here, before the model is built; an SFT stage's long data, loss shares: said
        check_tasks(s, tokenizer)  # so does a bad `tasks:` (unknown task, fractions, too short a length)
        for n in parse_replay(getattr(s, "replay", None), s.max_seq_length, f"stage {s.index} ({s.name}) replay"):
            short = dataclasses.replace(s, max_seq_length=n)  # and a replay length its mixture or tasks cannot fill
            data.mixture(short, replay_of=s.max_seq_length)
            check_tasks(short, tokenizer)
    if comm.rank() == 0:  # each stage's share of longer context than the stage before (lengths only): said once
        for line in length_lines(data, stages):
            print0(line)
    return data
