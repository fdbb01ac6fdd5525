"""Packing: documents -> one token stream (EOS between documents) -> fixed-length samples.

`build_token_stream` is the small in-process tokenizer kept for tests and tools (the run itself reads a
prepared folder: data/prepare_data.py). `DocPack` packs any choice of documents of a stream (a stage's
mixture component) to a stage's length; `PackedDataset` is the whole contiguous stream. A sample is `seq_len` consecutive
tokens; labels are the next token inside the sample (the last position has none), exactly as a
Hugging Face causal LM computes its loss from `labels=input_ids`.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np

from base.atomic import atomic_write
from data.jsonl import list_files, read_documents
from data.store import save_npy, tokenizer_identity
from data.tokenizer import Tokenizer

RULES = "bos2:chat12:eos2:doc11"  # the tokenization rules' version (cache_key below says what each part means); recorded
# in a prepare_data plan too: a shard continued or merged under other rules is refused (its chunks would mix them)
# where it holds rows a step between them changed (data/output_lock.check_rules)
# Which rows each step changed, by the kinds a shard's record counts (output_lock.KINDS): "chat" conversations
# (chat_docs; every chatN step, up to today's, so a bump of it cannot go unlisted), "ids" pre-tokenized rows shaped by
# columns beside their ids (ids_beside_rows: a loss mask, packing, padding), "special" text documents holding a
# special-token string (special_text_docs, recorded since a4b2e59, before shards recorded their rules: doc9 changed
# only texts ending with the EOS string, each counted there under doc8). A shard holding none of a step's rows is the
# same under both sides of it: merged or continued with a note. A step not listed changed text rows or any row:
# refused across it, whatever the shard holds (doc9 unlisted refused every shard of yesterday's bos2:chat9:eos2:doc8,
# text-only ones of identical tokens too).
RULE_ROWS = {**{f"chat{k}": "chat" for k in range(2, int(RULES.split(":")[1].removeprefix("chat")) + 1)},
             "doc7": "ids", "doc8": "ids", "doc9": "special", "doc10": "ids",
             "doc11": "special"}


def cache_key(inputs: list[str], tokenizer_path: str | None, model_vocab: int) -> str:
    """What a cached token stream or in-job prepared folder (data/prepare.py) is derived from: each input as one string
    (the in-job folder's: its units' content, data/discover.Unit.identity; the stream's: `file_stats`), the tokenizer's
    content (a HF folder rewritten in place keeps its own size and mtime), the vocabulary its token ids were checked
    against and the rules (RULES)."""
    h = hashlib.sha256(f"{model_vocab}:{RULES}".encode())
    # :bos2: text documents start with the tokenizer's BOS, once where the text writes its own; :chat8: chat rows
    # encoded by today's rules (a reply's weight, reasoning a template drops, a top-level system, a prompt / completion of strings with the BOS; the ChatML default rendered
    # as served, a `reasoning` field, JSON-text arguments as the object; chat5: an empty tool list as none, bare tool
    # definitions wrapped as OpenAI's, LLaMA-Factory v1's loss_weight and `value` text parts; chat6: a reply trained
    # through its stop (Command R7B), Anthropic / MCP / flat tool definitions in OpenAI's form; chat7: a top-level
    # `system_prompt` (OpenHermes', ultrachat_de's) is the system turn, a chat6 cache dropped it; chat8: an earlier
    # reply's end-of-turn behind a newline is trained with it (Apriel-1.6), one with no end-of-turn is not trained; chat9: a
    # string completion ending with the EOS gets no second one, an empty one is refused; chat10: a string completion
    # holding a stop's text before more text is refused as a messages reply is, one ending with stops is trained as its
    # text and one EOS (a reply too: `Paris<|im_end|>` was untrained); chat11: a system message the rendering drops
    # refuses a `--loss_on all` row (Mistral v0.3), the ChatML default refuses a prompt's tool call; chat12: a message's
    # text parts are joined as the template joins them where it renders the list itself (no separator: Mistral Small
    # 3.2, GLM-4.6/4.7, Kimi K2, Llama 4, Gemma 4, ...; chat11 trained `a\nb`), a thinking part trains where the
    # template renders it (Ministral 3 Reasoning)); :eos2: no second EOS
    # after a document that ends with its own (a stream, or a folder prepare_data wrote before 2026-11-30, had two);
    # :doc3: a text document ends with its family's end-of-text token where the EOS is a chat end-of-turn, special-token
    # strings in a text are text, a blank text is dropped, pre-tokenized ids get the BOS a text gets; :doc4: a text that
    # starts as a rendered conversation is refused (a cache built from one under doc3 trained its tokens spelled out);
    # :doc5: ids ending with the tokenizer's own EOS get no separator after it, gpt-oss's <|return|> maps to <|endoftext|>;
    # :doc6: a text that starts as a rendered conversation is read with its control tokens, not refused (--text_specials
    # auto), also for a tokenizer without a chat template (a doc5 cache from a Llama-3 base tokenizer trained one spelled
    # out); :doc7: pre-tokenized ids with TRL's assistant_masks / completion_mask are trained on their mask (a doc6
    # folder trained every token), a packed row (seq_lengths, restarting position_ids) is refused (data/ids_rows.py);
    # :doc8: a packed row is split into its documents, an attention_mask's padding at the row's ends stripped (doc7
    # stored and trained the pads); :doc9: a text ending with the tokenizer's own EOS string (an Instruct one's
    # <|eot_id|>) ends there, once, with the separator (doc8 spelled it out as text); :doc10: pre-tokenized labels that
    # masked the final EOS as a pad (pad == eos) after a trained token keep one EOS, trained (doc9 cut it: the row ran
    # into the next); :doc11: a text starting with `<|im_system|>`, `<|begin_of_sentence|>`, `[|system|]` or `[|user|]`
    # (Kimi K2's, ERNIE 4.5's, EXAONE 4's turn starts: data/tokenizer.TURN_STARTS) where the tokenizer has that special
    # token is read as a rendered conversation, with its control tokens (doc10 spelled them out as text); a change of
    # TURN_STARTS is a doc step (tests/unit/data/test_prepare_lock.py pins them to RULES)
    for x in inputs:
        h.update(f"{x}\n".encode())
    if tokenizer_path:
        h.update(tokenizer_identity(tokenizer_path).encode())
    return h.hexdigest()[:16]


def file_stats(files: list[str]) -> list[str]:
    """The token stream's inputs for `cache_key`: each file's path, size and mtime (one stat each). Not the in-job
    prepared folder's: a copy re-staged at each requeue (/tmp/slurm-$JOBID/...) has a new mtime, and the folder was
    prepared again by rank 0 while every GPU waited (the stream, tools' and tests', is rebuilt in seconds)."""
    return [f"{os.path.abspath(f)}:{(st := os.stat(f)).st_size}:{st.st_mtime_ns}" for f in files]


def vocab_refusal(tokenizer: Tokenizer, model_vocab: int) -> str:
    """A tokenizer with more tokens than the model's embedding rows (its ids past them would index nothing): there is
    no resize option here, and the tokenizer may be the model folder's own (tokens added to it after the save)."""
    return (f"tokenizer {tokenizer.path} has {tokenizer.vocab_size} tokens but the model's vocab_size is {model_vocab}: "
            "use the tokenizer the model was saved with, or resize the embeddings and save the model with transformers "
            "first (model.resize_token_embeddings(len(tokenizer)); model.save_pretrained(DIR); "
            "tokenizer.save_pretrained(DIR)) and train from DIR")


def build_token_stream(dataset_path: str, tokenizer: Tokenizer | None, model_vocab: int,
                       cache_dir: str) -> tuple[str, str]:
    """Tokenize every document into `tokens.npy` (uint32) and `doc_starts.npy`; return their paths.

    Validates as it goes: bad lines, token ids outside the model's vocabulary, an empty dataset.
    """
    key = cache_key(file_stats(list_files(dataset_path)), tokenizer.path if tokenizer else None, model_vocab)
    out = os.path.join(cache_dir, f"tokens-{key}")
    tok_path, starts_path = out + ".npy", out + ".starts.npy"
    if os.path.exists(tok_path) and os.path.exists(starts_path):
        return tok_path, starts_path
    if tokenizer is not None and tokenizer.vocab_size > model_vocab:
        raise ValueError(vocab_refusal(tokenizer, model_vocab))
    chunks, starts, n = [], [], 0
    eos = tokenizer.sep_id if tokenizer is not None else None  # a text document's separator (data/tokenizer.py)
    for file, line, doc in read_documents(dataset_path):
        if isinstance(doc, str):
            if tokenizer is None:
                raise ValueError(f"{file}:{line}: a \"text\" document needs --tokenizer_name_or_path")
            # as prepare_data's default (--text_specials auto) writes: one BOS (the text's own where it has one),
            # special-token strings as text, those of a text that starts as a rendered conversation as control tokens,
            # a blank text dropped
            ids = tokenizer.frame_texts([doc], eos)[0][0]
        else:
            ids = tokenizer.with_bos(doc)[0] if tokenizer is not None else doc  # as prepare_data: ids get the BOS
            bad = [t for t in ids if t >= model_vocab]
            if bad:
                raise ValueError(f"{file}:{line}: token id {bad[0]} >= the model's vocab_size {model_vocab}")
        if not ids:
            continue
        # as prepare_data: a document ending with the separator (`...</s>` in the text, pre-tokenized ids with theirs)
        # or the tokenizer's own EOS gets no other
        if eos is not None and int(ids[-1]) not in (eos, tokenizer.eos_id):
            ids = list(ids) + [eos]
        starts.append(n)
        chunks.append(np.asarray(ids, dtype=np.uint32))
        n += len(ids)
    if n == 0:
        raise ValueError(f"--dataset_path {dataset_path}: no documents (every line blank or empty)")
    os.makedirs(cache_dir, exist_ok=True)
    for path, arr in ((tok_path, np.concatenate(chunks)), (starts_path, np.asarray(starts, dtype=np.int64))):
        # its own tmp name (base/atomic.tmp_name: host, pid, random), not the pid alone that a second job's rank 0
        # in its own container shares
        atomic_write(path, lambda fh, a=arr: save_npy(fh, a))  # a full disk's own errno (data/store.NpyOut)
    return tok_path, starts_path


def reset_positions(seq_len: int, inside: np.ndarray) -> np.ndarray:
    """Position ids of a sample whose documents start at the sorted offsets `inside` (0 excluded): each token's
    distance from the start of its document.

    Linear in the sample length whatever the number of documents: a fixed number of array passes (mark each
    start with its own offset, a running maximum gives every token its document's start, subtract). The
    previous loop rewrote the whole tail at every start, O(documents x length): at 1M tokens of ~2k-token
    documents (~500 starts) ~2.5e8 element writes, 0.2 s of CPU per sample here (1M tokens, 500 starts;
    1 s under load), paid by each of the 8 ranks of the SP group (each reads the whole sample and keeps its
    slice: data/sharding.py) and growing with the square of the length; now 7 ms, whatever the documents."""
    pos = np.arange(seq_len, dtype=np.int64)
    if len(inside):
        start = np.zeros(seq_len, dtype=np.int64)
        start[np.asarray(inside, dtype=np.int64)] = inside
        pos -= np.maximum.accumulate(start)
    return pos


def _read(tokens, lo: int, hi: int) -> np.ndarray:
    return tokens.read(lo, hi) if hasattr(tokens, "read") else np.asarray(tokens[lo:hi])


def chat_documents(mask, starts, lens, limit: int = 0) -> np.ndarray:
    """Indices of the documents that are conversations: their loss mask leaves some token untrained (a header, a
    prompt; data/chat.py), where a text document's trains every token (data/store.py `Ones`, or a mixed chunk's ones).
    A chat row prepared with `--loss_on all` trains every token too and counts as text here. `limit`: the first that
    many. Reads each document's mask once, stopping at `limit`: for held-out sets (small), not a whole stream."""
    if mask is None:
        return np.zeros(0, np.int64)
    out = []
    for k, (st, ln) in enumerate(zip(np.asarray(starts).tolist(), np.asarray(lens).tolist())):
        if ln and not np.asarray(_read(mask, st, st + ln)).all():
            out.append(k)
            if limit and len(out) == limit:
                break
    return np.asarray(out, np.int64)


class DocPack:
    """Samples of `seq_len` tokens cut from the concatenation of chosen documents (`doc_starts[k]`,
    `doc_lens[k]` into `tokens`, in that order; a document may appear more than once (upsampling)).

    Sample i is tokens [i*L, (i+1)*L) of that virtual stream: a document longer than L is split at sample
    boundaries (every token in exactly one sample, none lost or repeated, except the stream's last partial
    sample), shorter ones are packed with their boundaries kept for position ids and label masking.
    Labels are the next token inside the sample; with `mask_cross_document_labels` the label of a
    document's last token (predicting the next document's first token) is -100, as ProLong trains. With a
    `mask` (the prepared folder's per-token loss mask, data/store.py; chat documents, data/chat.py) a label is
    -100 where the token it names is not a target: only the assistant's tokens are predicted.
    """

    def __init__(self, tokens, doc_starts, doc_lens, seq_len: int, reset_position_ids: bool,
                 mask_cross_document_labels: bool = False, mask=None):
        self.tokens, self.mask = tokens, mask
        self.doc_starts = np.asarray(doc_starts, dtype=np.int64)
        lens = np.asarray(doc_lens, dtype=np.int64)
        self.virt = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)  # virtual start of each document
        self.contiguous = bool(np.all(self.doc_starts[1:] == self.doc_starts[:-1] + lens[:-1]))
        self.seq_len = seq_len
        self.reset_position_ids = reset_position_ids
        self.mask_cross_document_labels = mask_cross_document_labels

    @property
    def n_tokens(self) -> int:
        return int(self.virt[-1])

    def __len__(self) -> int:
        return self.n_tokens // self.seq_len

    def window(self, i: int, src=None) -> tuple[np.ndarray, np.ndarray]:
        """(token ids of sample i, offsets inside it where a document starts, 0 excluded); `src`: read that array
        (the loss mask) at the same places instead of the tokens."""
        src = self.tokens if src is None else src
        lo, hi = i * self.seq_len, (i + 1) * self.seq_len
        k0 = int(np.searchsorted(self.virt, lo, side="right")) - 1
        k1 = int(np.searchsorted(self.virt, hi, side="left"))
        inside = self.virt[k0 + 1: k1] - lo
        if self.contiguous:
            base = int(self.doc_starts[0]) if len(self.doc_starts) else 0
            return _read(src, base + lo, base + hi), inside
        pieces = []
        for k in range(k0, k1):
            a, b = max(lo, int(self.virt[k])), min(hi, int(self.virt[k + 1]))
            off = int(self.doc_starts[k]) + a - int(self.virt[k])
            pieces.append(_read(src, off, off + b - a))
        return np.concatenate(pieces), inside

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        raw, inside = self.window(i)
        ids = np.asarray(raw, dtype=np.int64)
        labels = np.full_like(ids, -100)
        labels[:-1] = ids[1:]  # next-token targets inside the sample; last position unlabeled
        if self.mask is not None:
            target = np.asarray(self.window(i, self.mask)[0], dtype=bool)
            labels[:-1][~target[1:]] = -100  # a token that is not a target is never predicted
        if self.mask_cross_document_labels and len(inside):
            labels[inside - 1] = -100  # a document's last token does not predict the next document
        # restart positions at each document start inside the window (document-masked attention reads these)
        pos = reset_positions(self.seq_len, inside if self.reset_position_ids else [])
        return {"input_ids": ids, "shift_labels": labels, "position_ids": pos}


class PackedDataset(DocPack):
    """Sample i = tokens[i*L : (i+1)*L] of a contiguous stream (the cached files' paths, memory-mapped, or
    arrays / a TokenStore); `starts` are the document starts in it (a first document may begin before it)."""

    def __init__(self, tokens, starts, seq_len: int, reset_position_ids: bool,
                 mask_cross_document_labels: bool = False):
        tokens = np.load(tokens, mmap_mode="r") if isinstance(tokens, str) else tokens
        starts = np.load(starts) if isinstance(starts, str) else np.asarray(starts, dtype=np.int64)
        n = len(tokens)
        if n < seq_len:
            raise ValueError(f"the dataset has {n} tokens, fewer than max_seq_length={seq_len}: "
                             "add data or shorten the sequence")
        bounds = np.unique(np.concatenate([[0], starts[(starts >= 0) & (starts < n)]])).astype(np.int64)
        super().__init__(tokens, bounds, np.diff(np.append(bounds, n)), seq_len, reset_position_ids,
                         mask_cross_document_labels)
        self.starts = starts


TARGET_BLOCK = 1 << 22  # tokens of loss mask `targets` sums at once (16 MB of int32 running sums)
TARGET_GAP = 1 << 16  # a gap between two documents past which they are read apart (a scattered selection)


def targets(mask, starts, lens, block: int = TARGET_BLOCK) -> np.ndarray:
    """Per document k (`starts[k]`, `lens[k]` into the mask: 1 a target), its targets at positions 1..lens[k]-1: what
    a packed sample predicts of it (its first token is predicted by nothing of it). Every token but the first where
    `mask` is None. Reads the documents' mask once in stream order, nearby documents together (gaps of up to
    TARGET_GAP read through), a running sum of `block` tokens at a time: ~3.5 s per billion tokens here (1.5 s for a
    400M-token memory-mapped mask in the page cache, on 2 shared cores; ~1.3 s per billion warm on a review's
    machine). Memory: ~20 MB for the running sum plus ~49 bytes per document of numpy temporaries (the order, the
    documents' ends, the gaps: ~5 GB at 100M conversations)."""
    starts, lens = np.asarray(starts, np.int64), np.asarray(lens, np.int64)
    if mask is None:
        return np.maximum(lens - 1, 0)
    out = np.zeros(len(lens), np.int64)
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], starts[order] + lens[order]
    reach = np.maximum.accumulate(e) if len(e) else e
    breaks = np.append(np.flatnonzero(s[1:] - reach[:-1] > TARGET_GAP) + 1, len(s))
    i = 0
    while i < len(s):
        j = min(int(breaks[np.searchsorted(breaks, i, side="right")]),
                max(i + 1, int(np.searchsorted(s, s[i] + block, side="left"))))
        lo, hi = int(s[i]), int(e[i:j].max())
        if hi - lo > 1:  # (else empty or 1-token documents: no target)
            run = np.cumsum(np.asarray(_read(mask, lo, hi)), dtype=np.int32)
            got = run[np.clip(e[i:j] - 1 - lo, 0, hi - lo - 1)] - run[np.minimum(s[i:j] - lo, hi - lo - 1)]
            out[order[i:j]] = np.where(e[i:j] - s[i:j] > 1, got, 0)  # mask[s + 1: e]
        i = j
    return out


PACK_WINDOW = 64  # samples' worth of conversations sorted and best-fit together; as many bins stay open
PAD_PIECE = 128  # the padding tail is cut into documents of at most this many tokens (document-masked: no quadratic cost)


def best_fit_bins(lens: np.ndarray, seq_len: int, window: int = PACK_WINDOW) -> tuple[np.ndarray, np.ndarray]:
    """Whole documents (lengths `lens`, each <= seq_len) into bins of `seq_len` tokens, best-fit decreasing within a
    bounded window of the stream: the documents of the next `window` x seq_len tokens, longest first, each into the
    open bin it fills best (the least room that holds it), else a new bin; after each window the fullest bins beyond
    `window` open ones are closed. Returns (order, bounds): bin b holds documents order[bounds[b]:bounds[b + 1]], in
    the order placed; bins in the order opened (a pure function of `lens`, the same on every rank and restart).

    Bounded at any scale: the working set is one window and `window` open bins, whatever the number of documents
    (millions of conversations into 1M-token samples: the window is then 64M tokens, ~32k 2k-token chats); a
    document's place in the stream bounds nothing (ConvPack packs a permutation of it). Output: two int64 arrays
    of one entry per document (16 bytes each, as the per-document arrays already loaded); one Python step per
    document (bisect over <= 2 x window open bins): ~2 s per million documents here (bench/packing.py)."""
    import bisect

    n = len(lens)
    bin_of, seq = np.zeros(n, np.int64), np.zeros(n, np.int64)
    cum = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    open_: list[tuple[int, int]] = []  # (room left, bin), sorted: the best fit is the first with room >= length
    bins, placed, lo = 0, 0, 0
    lens_l = np.asarray(lens, np.int64).tolist()
    while lo < n:
        hi = max(lo + 1, int(np.searchsorted(cum, cum[lo] + window * seq_len, side="right")) - 1)
        for k in (lo + np.argsort(-np.asarray(lens[lo:hi]), kind="stable")).tolist():
            ln = lens_l[k]
            at = bisect.bisect_left(open_, (ln, -1))
            if at < len(open_):
                room, b = open_.pop(at)
            else:
                room, b, bins = seq_len, bins, bins + 1
            bin_of[k], seq[k], placed = b, placed, placed + 1
            if room - ln > 0:
                bisect.insort(open_, (room - ln, b))
        if len(open_) > window:
            del open_[: len(open_) - window]  # the fullest close: the rest keep taking the next window's documents
        lo = hi
    order = np.lexsort((seq, bin_of)).astype(np.int64)
    bounds = np.searchsorted(bin_of[order], np.arange(bins + 1)).astype(np.int64)
    return order, bounds


class ConvPack:
    """Supervised fine-tuning samples: whole conversations (documents `doc_starts[k]`, `doc_lens[k]`) packed side by
    side into samples of `seq_len` tokens, never split between two samples.

    Packed best-fit decreasing within a bounded window of the stream (`best_fit_bins`): next-fit in stream order
    filled 0.75 of 64k samples for LongAlign-like lengths and 0.77 of 128k samples for 90% short / 10% 30k-100k
    chats; best-fit 0.96-0.99 (bench/packing.py, docs/data.md). A text document longer than `seq_len` (its every
    token a target: an SFT stage's pretraining replay, a `long*` component kept for retention) is split into pieces
    of `seq_len`, as a text stage splits it (`split`; it was cut to its head, the same head every epoch); so is a
    conversation prepared with `--loss_on all`, whose mask is a text's (the stage note names them by the manifest). A
    conversation longer than `seq_len` is cut to its first `seq_len` tokens, alone in its sample; one with no target in
    its first min(length, seq_len) tokens (mask 1 at positions 1..) is dropped (`dropped`: its targets all past the
    cut, or none at all, `untargeted`: a head held apart from its answer trained nothing, silently), the others cut
    are counted (`truncated`); `n_targets` counts what the samples train (`piece_targets`: the split pieces' part of
    it). The tail of a sample is padding (`pad_id`, no label) cut into documents of at most PAD_PIECE tokens, so under
    document masking it costs tail x PAD_PIECE, not tail^2. Positions restart at every conversation and no
    conversation's last token predicts the next one's first (labels -100 there), whatever the run's flags: one
    conversation never sees another.

    The packing is a pure function of the documents' lengths and which of them train a target (one sequential read of
    their masks, `targets`: ~1.3-3.5 s per billion tokens, beside best-fit's ~2 s per million conversations), computed once
    per stage by every rank, so the sampler's position (data/sampler.py: epoch, micro-batches taken, the number of
    samples) is all a resume needs; `state_dict()` names the packing for the checkpoint's records."""

    def __init__(self, tokens, mask, doc_starts, doc_lens, seq_len: int, pad_id: int, window: int = PACK_WINDOW):
        self.tokens, self.mask, self.seq_len, self.pad_id, self.window = tokens, mask, seq_len, pad_id, window
        starts = np.asarray(doc_starts, dtype=np.int64)
        lens = np.asarray(doc_lens, dtype=np.int64).copy()
        text = [k for k in np.flatnonzero(lens > seq_len).tolist()  # read once, the long documents only
                if mask is None or np.asarray(_read(mask, int(starts[k]), int(starts[k] + lens[k])), bool)[1:].all()]
        self.split = len(text)
        if text:  # each piece a document of its own (its first token then predicted by nothing, as in a text stage)
            pieces = {k: np.arange(0, int(lens[k]), seq_len) for k in text}
            reps = np.ones(len(lens), np.int64)
            for k, at in pieces.items():
                reps[k] = len(at)
            first = np.repeat(starts, reps)
            offs = np.zeros(len(first), np.int64)
            plen = np.repeat(lens, reps)
            at_k = np.cumsum(reps) - reps  # where document k's pieces begin (linear: millions of documents)
            for k, at in pieces.items():
                j = int(at_k[k])
                offs[j:j + len(at)] = at
                plen[j:j + len(at)] = np.minimum(seq_len, lens[k] - at)
            starts, lens = first + offs, plen
        self.starts = starts
        self.lens = np.minimum(lens, seq_len)
        # what each trains, within the length: one with none (every target past the cut, or a conversation with no
        # target at all: a head of one cut before its answer) is dropped; a text piece (every token a target) is kept
        got = targets(mask, starts, self.lens)
        piece = np.zeros(len(lens), bool)
        if text:
            piece[np.repeat(np.isin(np.arange(len(reps)), text), reps)] = True
        keep = (got > 0) | piece
        self.lost_targets = 0  # supervised tokens past the cuts (a long-document QA set's answers sit at the end)
        for k in np.flatnonzero(lens > seq_len).tolist():
            st = int(self.starts[k])
            m = np.ones(int(lens[k]), bool) if mask is None else np.asarray(_read(mask, st, st + int(lens[k])), bool)
            self.lost_targets += int(m[seq_len:].sum() if keep[k] else m[1:].sum())
        long = lens > seq_len
        self.dropped = int((~keep).sum())
        self.untargeted = int((~long & ~keep).sum())  # of them, those that fit the length: no target at all
        self.truncated = int((long & keep).sum())
        self.n_targets = int(got[keep].sum())  # the supervised tokens the packed samples hold (one epoch)
        # of them, the split pieces' (a text's, or a --loss_on all conversation's): the cut line's share is of the
        # unsplit conversations alone (a 400-token text beside 2 cut chats at 16 read their 24 lost of 30 as 5.9%)
        self.piece_targets = int(got[piece].sum())
        kept = np.flatnonzero(keep)
        # packed in a fixed permutation of the stream, not its order: a length-sorted set (datasets' sort("length"),
        # nothing here shuffles) gave each window one length and nothing to fill the gaps: 0.85 of 64k samples filled
        # where a shuffled stream fills 1.00 (the packing audit); the sampler shuffles the samples anyway
        p = np.random.default_rng(0).permutation(len(kept))
        order, self.bounds = best_fit_bins(self.lens[kept][p], seq_len, window)
        self.order = kept[p[order]]
        self.n_tokens = int(self.lens[kept].sum())

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def fill(self) -> float:
        """Tokens of conversations over the samples' tokens (1.0: no padding)."""
        return self.n_tokens / max(1, len(self) * self.seq_len)

    def state_dict(self) -> dict:
        return {"packing": "best-fit-decreasing, permuted", "window": self.window, "samples": len(self), "tokens": self.n_tokens,
                "text_split": self.split}

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        L = self.seq_len
        ids = np.full(L, self.pad_id, dtype=np.int64)
        target = np.zeros(L, dtype=bool)
        inside, at = [], 0
        for k in self.order[self.bounds[i]:self.bounds[i + 1]].tolist():
            st, ln = int(self.starts[k]), int(self.lens[k])
            ids[at:at + ln] = _read(self.tokens, st, st + ln)
            target[at:at + ln] = True if self.mask is None else np.asarray(_read(self.mask, st, st + ln), bool)
            target[at] = False  # a conversation's first token is predicted by nothing of it
            if at:
                inside.append(at)
            at += ln
        inside += range(at, L, PAD_PIECE)  # the padding (after at least one conversation): short documents
        labels = np.full(L, -100, dtype=np.int64)
        labels[:-1] = np.where(target[1:], ids[1:], -100)
        pos = reset_positions(L, np.asarray(inside, dtype=np.int64))
        return {"input_ids": ids, "shift_labels": labels, "position_ids": pos}
