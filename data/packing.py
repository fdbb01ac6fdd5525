"""Packing: documents -> one token stream (EOS between documents) -> fixed-length samples.

The stream is tokenized once and cached as .npy (keyed by the data files and tokenizer), so every
stage of a curriculum packs the same stream to its own length. A sample is `seq_len` consecutive
tokens; labels are the next token inside the sample (the last position has none), exactly as a
Hugging Face causal LM computes its loss from `labels=input_ids`.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np

from data.jsonl import list_files, read_documents
from data.tokenizer import Tokenizer


def _cache_key(dataset_path: str, tokenizer_path: str | None) -> str:
    h = hashlib.sha256()
    for f in list_files(dataset_path) + ([tokenizer_path] if tokenizer_path else []):
        st = os.stat(f) if os.path.isfile(f) else None
        h.update(f"{os.path.abspath(f)}:{st.st_size if st else 0}:{st.st_mtime_ns if st else 0}".encode())
    return h.hexdigest()[:16]


def build_token_stream(dataset_path: str, tokenizer: Tokenizer | None, model_vocab: int,
                       cache_dir: str) -> tuple[str, str]:
    """Tokenize every document into `tokens.npy` (uint32) and `doc_starts.npy`; return their paths.

    Validates as it goes: bad lines, token ids outside the model's vocabulary, an empty dataset.
    """
    key = _cache_key(dataset_path, tokenizer.path if tokenizer else None)
    out = os.path.join(cache_dir, f"tokens-{key}")
    tok_path, starts_path = out + ".npy", out + ".starts.npy"
    if os.path.exists(tok_path) and os.path.exists(starts_path):
        return tok_path, starts_path
    if tokenizer is not None and tokenizer.vocab_size > model_vocab:
        raise ValueError(f"tokenizer {tokenizer.path} has {tokenizer.vocab_size} tokens but the model's vocab_size is "
                         f"{model_vocab}: use the model's own tokenizer or resize the model's embeddings")
    chunks, starts, n = [], [], 0
    eos = tokenizer.eos_id if tokenizer is not None else None
    for file, line, doc in read_documents(dataset_path):
        if isinstance(doc, str):
            if tokenizer is None:
                raise ValueError(f"{file}:{line}: a \"text\" document needs --tokenizer_name_or_path")
            ids = tokenizer.encode(doc)
        else:
            ids = doc
            bad = [t for t in ids if t >= model_vocab]
            if bad:
                raise ValueError(f"{file}:{line}: token id {bad[0]} >= the model's vocab_size {model_vocab}")
        if not ids:
            continue
        if eos is not None:
            ids = list(ids) + [eos]
        starts.append(n)
        chunks.append(np.asarray(ids, dtype=np.uint32))
        n += len(ids)
    if n == 0:
        raise ValueError(f"--dataset_path {dataset_path}: no documents (every line blank or empty)")
    os.makedirs(cache_dir, exist_ok=True)
    for path, arr in ((tok_path, np.concatenate(chunks)), (starts_path, np.asarray(starts, dtype=np.int64))):
        tmp = path + f".tmp{os.getpid()}.npy"
        np.save(tmp, arr)
        os.replace(tmp, path)
    return tok_path, starts_path


class PackedDataset:
    """Sample i = tokens[i*L : (i+1)*L] of the cached stream, with labels and position ids."""

    def __init__(self, tokens_path: str, starts_path: str, seq_len: int, reset_position_ids: bool):
        self.tokens = np.load(tokens_path, mmap_mode="r")
        self.starts = np.load(starts_path)
        self.seq_len = seq_len
        self.reset_position_ids = reset_position_ids
        if len(self.tokens) < seq_len:
            raise ValueError(f"the dataset has {len(self.tokens)} tokens, fewer than max_seq_length={seq_len}: "
                             "add data or shorten the sequence")

    def __len__(self) -> int:
        return len(self.tokens) // self.seq_len

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        lo = i * self.seq_len
        ids = np.asarray(self.tokens[lo: lo + self.seq_len], dtype=np.int64)
        labels = np.full_like(ids, -100)
        labels[:-1] = ids[1:]  # next-token targets inside the sample; last position unlabeled
        pos = np.arange(self.seq_len, dtype=np.int64)
        if self.reset_position_ids:
            # restart positions at each document start inside the window (flash-attn varlen reads these)
            inside = self.starts[(self.starts > lo) & (self.starts < lo + self.seq_len)] - lo
            for s in inside:
                pos[s:] = np.arange(self.seq_len - s)
        return {"input_ids": ids, "shift_labels": labels, "position_ids": pos}
