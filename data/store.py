"""The prepared dataset folder: what `scripts/prepare_data.py` writes and every training rank memory-maps.

    FOLDER/manifest.json                     written last (os.replace): its presence means "complete"
    FOLDER/tokens-s00000-c000000.bin         raw token ids, uint16 when the vocabulary fits, else uint32
    FOLDER/docs-s00000-c000000.lens.npy      int64 length of every document of the chunk (EOS included)
    FOLDER/docs-s00000-c000000.src.npy       int32 source of every document (index into the chunk's table)
    FOLDER/mask-s00000-c000000.bin           uint8 loss mask, one per token (1: a target), only in a chunk holding
                                             chat documents (data/chat.py); a chunk without one: every token is
    FOLDER/chunk-s00000-c000000.json         chunk record: counts, CRC32s, source table, input position
    FOLDER/shard-00000-of-00001.json         a finished shard (`--shard i/N`): its chunk records in order
    FOLDER/plan-s00000.json                  what a shard was started with (resume refuses another plan)

The manifest lists every chunk in order (shard 0's chunks, then shard 1's, ...), the tokenizer's identity
(kind, path, SHA-256 of its files, vocabulary size, EOS), the largest token id, counts per source,
checksums and the command. Documents are contiguous in the token files, so a document's start is the
running sum of the lengths; the only arrays loaded whole are the per-document lengths and sources.
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from array import array

import numpy as np

from base.atomic import atomic_write, fsync_path

MANIFEST = "manifest.json"
FORMAT = "ulysses-longtrain/prepared-v1"
MAX_SOURCES = 1000  # a mixture's corpora, not a row's id: each chunk's record lists them all (a 1M-row id column as
# sources made the merge quadratic, hours)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "vocab.txt",
                   "chat_template.jinja", "chat_template.json")  # the template renders chat rows (data/chat.py)


def is_prepared(path: str | None) -> bool:
    return bool(path) and os.path.isfile(os.path.join(path, MANIFEST))


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def chunk_name(shard: int, chunk: int) -> str:
    return f"s{shard:05d}-c{chunk:06d}"


def tokenizer_identity(path: str) -> str:
    """SHA-256 over the tokenizer's files (a sentencepiece .model, or a HF folder's tokenizer files), so a
    moved copy of the same tokenizer is recognised and another one is not."""
    return _files_sha256(path, TOKENIZER_FILES)


def _files_sha256(path: str, names: tuple[str, ...]) -> str:
    """SHA-256 over `path` (a file) or the files of `names` that folder `path` has, each by its name and bytes."""
    h = hashlib.sha256()
    files = [path] if os.path.isfile(path) else [os.path.join(path, f) for f in names
                                                 if os.path.isfile(os.path.join(path, f))]
    for f in files:
        h.update(os.path.basename(f).encode())
        with open(f, "rb") as fh:
            h.update(fh.read())
    return h.hexdigest()


VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "tekken.json")


def vocab_identity(path: str) -> str:
    """SHA-256 over what fixes a text's ids (a sentencepiece .model; a HF folder's vocabulary, merges and
    tokenizer.json), not its chat template or config: a resume checks it (a fixed template is no other tokenizer)."""
    return _files_sha256(path, VOCAB_FILES)


def file_crc32(path: str, block: int = 1 << 24) -> int:
    crc = 0
    with open(path, "rb") as fh:
        while b := fh.read(block):
            crc = zlib.crc32(b, crc)
    return crc


def write_json_atomic(path: str, obj) -> None:
    """tmp + fsync + os.replace + fsync of the folder: a reader sees the old file, the new one, or none."""
    atomic_write(path, json.dumps(obj, indent=1).encode())


class NpyOut:
    """A binary file as numpy sees a stream: `write` only. np.save into a real file object writes through
    `ndarray.tofile`, whose short write on a full disk or quota raises `OSError('54784 requested and 27120 written')`
    with errno None (numpy 2.4, measured on a full tmpfs): a crash (exit 1), not the user's disk (exit 2). Through
    `write` the OS's own error comes out (EFBIG under RLIMIT_FSIZE, ENOSPC, EDQUOT); the array goes in numpy's 16 MiB
    pieces (a 400 MB int64 array: 0.3-1.0 s either way on a shared box's page cache, measured)."""

    def __init__(self, fh):
        self.write = fh.write


def save_npy(fh, arr: np.ndarray) -> None:
    """np.save into the open binary file `fh`, a full disk's error with its errno (NpyOut)."""
    np.save(NpyOut(fh), arr)


def save_npy_atomic(path: str, arr: np.ndarray) -> None:
    atomic_write(path, lambda fh: save_npy(fh, arr), suffix=".npy")


fsync_dir = fsync_path  # a folder's fsync (base/atomic.py holds the one copy)


def read_json(path: str) -> dict:
    with open(path) as fh:
        return json.load(fh)


class Ones:
    """A chunk without a mask file: every token a target. Sliced like the memory-mapped masks."""

    dtype = np.dtype(np.uint8)

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, sl: slice) -> np.ndarray:
        lo, hi, _ = sl.indices(self.n)
        return np.ones(max(0, hi - lo), np.uint8)


class TokenStore:
    """The chunks' token files as one array-like: `len(store)`, `store.read(lo, hi)` (a copy) and
    `store[lo:hi]`. Each file is memory-mapped; nothing is read until a sample asks for it."""

    def __init__(self, parts: list[np.ndarray]):
        self.parts = [p for p in parts if len(p)]
        self.offsets = np.cumsum([0] + [len(p) for p in self.parts])
        self.dtype = self.parts[0].dtype if self.parts else np.dtype(np.uint32)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def read(self, lo: int, hi: int) -> np.ndarray:
        if len(self.parts) == 1:
            return np.asarray(self.parts[0][lo:hi])
        k = int(np.searchsorted(self.offsets, lo, side="right")) - 1
        out = []
        while lo < hi and k < len(self.parts):
            base = int(self.offsets[k])
            take = min(hi, int(self.offsets[k + 1])) - lo
            out.append(np.asarray(self.parts[k][lo - base: lo - base + take]))
            lo, k = lo + take, k + 1
        return np.concatenate(out) if len(out) != 1 else out[0]

    def __getitem__(self, sl: slice) -> np.ndarray:
        lo, hi, step = sl.indices(len(self))
        assert step == 1, "TokenStore reads contiguous ranges only"
        return self.read(lo, hi)


class Prepared:
    """An opened prepared folder: `tokens` (TokenStore), per-document `starts`/`lens` (int64) and `source`
    (int32 index into `sources`), and the manifest."""

    def __init__(self, path: str, manifest: dict | None = None):
        """`manifest`: the one rank 0 read (training passes it so every rank opens the same version of a folder
        that is being replaced); by default the folder's own."""
        self.path = path
        self.manifest = manifest if manifest is not None else read_json(os.path.join(path, MANIFEST))
        if self.manifest.get("format") != FORMAT:
            raise ValueError(f"{path}/{MANIFEST}: format {self.manifest.get('format')!r}, expected {FORMAT!r}: "
                             "prepare the data again with scripts/prepare_data.py")
        dtype = np.dtype(self.manifest["dtype"])
        self.sources: list[str] = list(self.manifest["sources"])
        index = {name: i for i, name in enumerate(self.sources)}
        parts, lens, srcs, masks = [], [], [], []
        for c in self.manifest["chunks"]:
            f = os.path.join(path, c["tokens"])
            size = os.path.getsize(f) if os.path.exists(f) else -1
            if size < 0 and os.path.exists(os.path.join(path, MANIFEST)) is False:
                raise ValueError(f"{path}: not visible on this node (its manifest was read on rank 0's): a prepared "
                                 "folder, and the data cache (ULYSSES_CACHE) a small JSONL is prepared into, must be on "
                                 "a file system every node sees")
            if size != c["n_tokens"] * dtype.itemsize:
                raise ValueError(f"{f}: {size} bytes, the manifest says {c['n_tokens'] * dtype.itemsize}: the "
                                 "prepared folder is incomplete or was modified; prepare it again")
            parts.append(np.memmap(f, dtype=dtype, mode="r") if c["n_tokens"] else np.zeros(0, dtype))
            m = os.path.join(path, c["mask"]) if c.get("mask") else None
            if m and (os.path.getsize(m) if os.path.exists(m) else -1) != c["n_tokens"]:
                raise ValueError(f"{m}: not {c['n_tokens']} bytes as the manifest says: prepare the folder again")
            masks.append(np.memmap(m, dtype=np.uint8, mode="r") if m and c["n_tokens"] else Ones(c["n_tokens"]))
            lens.append(load_docs(os.path.join(path, c["lens"]), c.get("n_docs")))
            remap = np.asarray([index[s] for s in c["sources"]] or [0], dtype=np.int32)
            srcs.append(remap[load_docs(os.path.join(path, c["src"]), c.get("n_docs"))])
        self.tokens = TokenStore(parts)
        # the per-token loss mask (uint8, 1: a target) where a chunk holds chat documents; None: text only
        self.mask = TokenStore(masks) if any(c.get("mask") for c in self.manifest["chunks"]) else None
        self.lens = np.concatenate(lens).astype(np.int64, copy=False) if lens else np.zeros(0, np.int64)
        self.source = np.concatenate(srcs) if srcs else np.zeros(0, np.int32)
        self.starts = np.zeros_like(self.lens)  # no temporary copies: 8 bytes a document each at tens of millions
        np.cumsum(self.lens[:-1], out=self.starts[1:])
        if int(self.lens.sum()) != len(self.tokens):
            raise ValueError(f"{path}: document lengths sum to {int(self.lens.sum())} but the token files hold "
                             f"{len(self.tokens)}: prepare the data again")

    @property
    def max_token_id(self) -> int:
        return int(self.manifest["max_token_id"])

    def verify(self) -> list[str]:
        """Re-read every file and compare with the manifest's CRC32s; the list of mismatches (empty: intact)."""
        bad = []
        for c in self.manifest["chunks"]:
            for key in ("tokens", "lens", "src") + (("mask",) if c.get("mask") else ()):
                f = os.path.join(self.path, c[key])
                if file_crc32(f) != c[f"crc32_{key}"]:
                    bad.append(f)
        return bad


def load_docs(path: str, n_docs: int | None) -> np.ndarray:
    """A chunk's per-document array (.lens.npy / .src.npy) of `n_docs` entries (None: not checked). One ValueError
    for a file cut short, empty or of another length: a half-written copy of the folder on one node's disk made np.load
    raise EOFError (empty) or a ValueError naming no file (a cut header or body), and the run ended in a traceback."""
    try:
        arr = np.load(path)
    except (EOFError, ValueError) as e:
        raise ValueError(f"{path}: not a whole .npy file ({e}): the prepared folder is incomplete (a copy cut short?) "
                         "or was modified; copy or prepare it again") from None
    if n_docs is not None and len(arr) != n_docs:
        raise ValueError(f"{path}: {len(arr)} documents, the manifest says {n_docs}: the prepared folder is incomplete "
                         "or was modified; copy or prepare it again")
    return arr


# ------------------------------------------------------------------ writing: one shard's chunks (data/prepare_data.py)

class ChunkWriter:
    """Appends batch results to chunk files of one shard; `commit()` makes a chunk durable and visible (its files
    fsynced, then its record written: the commit point a resumed preparation starts after)."""

    def __init__(self, out: str, shard: int, chunk: int, dtype: np.dtype, sources: list[str]):
        self.out, self.shard, self.chunk, self.dtype = out, shard, chunk, dtype
        self.sources = list(sources)
        self.index = {s: i for i, s in enumerate(self.sources)}
        self.records: list[dict] = []
        self._open()

    def _open(self):
        name = chunk_name(self.shard, self.chunk)
        self.files = {"tokens": f"tokens-{name}.bin", "lens": f"docs-{name}.lens.npy", "src": f"docs-{name}.src.npy"}
        self.fh = open(os.path.join(self.out, self.files["tokens"]), "wb")
        self.mask_fh, self.mask_crc = None, 0  # opened at the chunk's first chat document (data/store.py: mask)
        self.lens, self.src, self.n_tokens, self.crc, self.max_id = array("q"), array("i"), 0, 0, -1
        self.per_source: dict[str, list[int]] = {}

    def _write_mask(self, m: np.ndarray) -> None:
        b = np.ascontiguousarray(m, dtype=np.uint8).tobytes()
        self.mask_fh.write(b)
        self.mask_crc = zlib.crc32(b, self.mask_crc)

    def add(self, res: dict, unit_names: list[str]) -> None:
        if res.get("mask") is not None and self.mask_fh is None:  # the chunk's text so far: every token a target
            self.mask_fh = open(os.path.join(self.out, self.files["tokens"].replace("tokens-", "mask-")), "wb")
            self._write_mask(np.ones(self.n_tokens, np.uint8))
        if self.mask_fh is not None:
            self._write_mask(res["mask"] if res.get("mask") is not None else np.ones(len(res["tokens"]), np.uint8))
        b = res["tokens"].tobytes()
        self.fh.write(b)
        self.crc = zlib.crc32(b, self.crc)
        self.n_tokens += len(res["tokens"])
        self.max_id = max(self.max_id, res["max_id"])
        for n, (u, src) in zip(res["lens"], res["srcs"]):
            name = src if src is not None else unit_names[u]
            if name not in self.index:
                if src is not None and len(self.sources) >= MAX_SOURCES:  # a row's --source_field value: every
                    # chunk's record lists the sources, O(chunks x sources) (a folder's many files stay allowed)
                    raise ValueError(f"more than {MAX_SOURCES} sources ({name!r} and the others --source_field gives): "
                                     "a source is a corpus a mixture weighs (web, code, books), not a row's id; "
                                     "drop --source_field or name a field of few values")
                self.index[name] = len(self.sources)
                self.sources.append(name)
            self.lens.append(n)
            self.src.append(self.index[name])
            c = self.per_source.setdefault(name, [0, 0])
            c[0], c[1] = c[0] + 1, c[1] + n

    def commit(self, next_pos: tuple[int, int], stats: dict) -> dict:
        """fsync this chunk's files, then write its record (the commit point); open the next chunk."""
        self.fh.flush()
        os.fsync(self.fh.fileno())
        self.fh.close()
        mask = None
        if self.mask_fh is not None:
            self.mask_fh.flush()
            os.fsync(self.mask_fh.fileno())
            self.mask_fh.close()
            mask = os.path.basename(self.mask_fh.name)
        lens, src = np.frombuffer(self.lens, dtype=np.int64), np.frombuffer(self.src, dtype=np.int32)
        for key, arr in (("lens", lens), ("src", src)):
            save_npy_atomic(os.path.join(self.out, self.files[key]), arr)
        rec = {**self.files, "n_tokens": self.n_tokens, "n_docs": len(lens), "crc32_tokens": self.crc,
               "crc32_lens": file_crc32(os.path.join(self.out, self.files["lens"])),
               "crc32_src": file_crc32(os.path.join(self.out, self.files["src"])),
               "sources": list(self.sources), "per_source": self.per_source, "max_token_id": self.max_id,
               "mask": mask, "crc32_mask": self.mask_crc if mask else None,
               "next": list(next_pos), **stats}
        write_json_atomic(os.path.join(self.out, f"chunk-{chunk_name(self.shard, self.chunk)}.json"), rec)
        self.records.append(rec)
        self.chunk += 1
        self._open()
        return rec

    def abandon(self) -> None:
        self.fh.close()
        os.remove(os.path.join(self.out, self.files["tokens"]))
        if self.mask_fh is not None:
            self.mask_fh.close()
            os.remove(self.mask_fh.name)
