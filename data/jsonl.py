"""Reading JSONL documents: `{"text": ...}` (tokenized by us) or `{"input_ids": [...]}` (pre-tokenized: a packed row is
split into its documents and an attention_mask's padding stripped, as prepare_data reads them; one with a loss mask
is refused by `read_documents`, which has no mask to carry; data/ids_rows.py); a file holding one JSON array of rows
instead (`array_elements`); which files of a folder are data.

Errors name the file and line and stop before any heavy work.
"""

from __future__ import annotations

import codecs
import fnmatch
import glob
import gzip
import io
import json
import os
import re
from collections.abc import Iterator

from base.log import print0
from data.ids_rows import BESIDE_IDS, MASKED, MASKS, beside_ids, documents, no_mask_here

GLOB = "*?["  # a path holding one of these that names nothing is a pattern (`DIR/data/train_sft-*.parquet`)
_SPLIT_WORDS = {"train": "train", "training": "train", "validation": "validation", "valid": "validation",
                "val": "validation", "dev": "validation", "test": "test", "testing": "test", "eval": "test",
                "evaluation": "test"}  # datasets' SPLIT_KEYWORDS (data_files.py)
NOT_DATA = ("README.md", "config.json", "dataset_info.json", "dataset_infos.json", "dataset_dict.json")  # a dataset
# snapshot's metadata beside its data files (datasets' FILES_TO_IGNORE, data_files.py): never read as rows
_WS = re.compile(r"[ \t\r\n]*")
ARRAY_CHUNK = 1 << 20
_SHARD = re.compile(r"(?:^|/)([a-z0-9_]+?)-\d{5}-of-\d{5}")  # the hub's `{split}-00000-of-00003.parquet`
_SHARD_NAME = re.compile(r"^(.*[-_.])(\d{5})-of-(\d{5})(.*)$")  # a shard's file name: prefix, index, count, suffix
_FINGERPRINT = re.compile(r"^-[0-9a-f]{16}(?=\.|$)")  # older push_to_hub's per-shard `-a3ecf92756993583` in a suffix
COMPRESSED = ("", ".gz", ".gzip", ".zst", ".zstd", ".bz2", ".xz")  # what open_file decompresses
COMPRESSED_END = re.compile(r"\.(?:gz|gzip|zst|zstd|bz2|xz)$")  # a name's COMPRESSED ending


def hidden(rel: str) -> bool:
    """Whether a relative path lies in a hidden folder or is a hidden file (`.ipynb_checkpoints/a-checkpoint.jsonl`, a
    snapshot's `.cache/huggingface/`): never data."""
    return any(p.startswith(".") and p not in (".", "..") for p in rel.split(os.sep))


# source code and its configuration: a repository's `scripts/train.py`, `tests/test_model.py`, `src/test/...` name no
# split (a code repository read with --loader text was refused as holding several)
CODE_EXT = (".py", ".ipynb", ".pyi", ".js", ".ts", ".jsx", ".tsx", ".java", ".kt", ".scala", ".c", ".cc", ".cpp", ".h",
            ".hpp", ".cu", ".go", ".rs", ".rb", ".php", ".swift", ".m", ".r", ".jl", ".lua", ".pl", ".cs", ".sh", ".sql",
            ".yaml", ".yml", ".toml", ".cfg", ".ini", ".lock", ".mk", ".cmake", ".gradle", ".html", ".css")


def split_of(rel: str) -> str | None:
    """The split a file belongs to by a dataset repository's naming (datasets' data_files.py patterns): a shard named
    `{split}-00000-of-00003` whose split holds a split word (`train_sft`, `test_gen`) or whose name ends with one
    (`c4-validation.00000-of-00008.json.gz`); else a split word that is a folder of its path (`train/...`,
    `data/test/...`) or the first or last word of its name (`train.jsonl`, `test_data.json`, `alpaca_dev.jsonl`,
    `wiki.valid.txt`); None where it names none. A word inside a name (`the_last_train_home.txt`, `a_test_of_courage.txt`,
    `web-dev-blogs.jsonl`) names none, nor does source code (CODE_EXT: `scripts/train.py`, `tests/test_model.py`)."""
    rel = rel.lower().replace(os.sep, "/")
    m = _SHARD.search(rel)
    if m and any(w in _SPLIT_WORDS for w in m.group(1).split("_")):
        return m.group(1)
    parts = rel.split("/")
    name = COMPRESSED_END.sub("", parts[-1])
    if name.endswith(CODE_EXT):
        return None
    shard = _SHARD_NAME.match(name)
    words = [w for w in re.split(r"[-_.]", (shard[1] if shard else os.path.splitext(name)[0])) if w]
    ends = words[-1:] if shard else words[:1] + words[-1:]
    return next((_SPLIT_WORDS[w] for w in parts[:-1] + ends if w in _SPLIT_WORDS), None)


def one_split(root: str, files: list[str], flag: str) -> list[str]:
    """`files` (a folder's) when they name one split at most (files naming none do not count: `train.jsonl` beside
    `more.jsonl` is one corpus); a ValueError (one line) where they name several (a dataset repo's snapshot: its test
    split would be trained on, silently)."""
    splits = {}
    for f in files:
        splits.setdefault(split_of(os.path.relpath(f, root)), []).append(f)
    named = sorted(s for s in splits if s)
    if len(named) < 2:
        no_missing_shard(root, files, flag)
        return files
    pick = next((s for s in named if s.startswith("train")), named[0])
    example = re.sub(r"\d{5}-of-\d{5}(-[0-9a-f]{16}(?=\.|$))?", "*", splits[pick][0])  # a fingerprint too
    exts = {os.path.splitext(COMPRESSED_END.sub("", f.lower()))[1] + "".join(COMPRESSED_END.findall(f.lower())) for f in files}
    every = os.path.join(root, "**", "*" + (exts.pop() if len(exts) == 1 else ""))
    raise ValueError(f"{flag} {root}: its files belong to several splits ({', '.join(named)}, by Hugging Face's "
                     f"file naming), so the evaluation splits would be trained on: give one split's files, e.g. "
                     f"{flag} '{example}' (where the names mean no splits, every file: {flag} '{every}')")


def matching(path: str, flag: str) -> list[str] | None:
    """The files a pattern names (sorted), None for a path that is no pattern; a ValueError for one naming none. A
    split's shards are judged among those the pattern would name (no_missing_shard): `train_sft-*` lacking one of 3
    is refused, 3 of the 10 `c4-train.0000*-of-01024.json.gz` read (a subset chosen on purpose)."""
    if os.path.exists(path) or not any(c in path for c in GLOB):
        return None
    files = sorted(f for f in glob.glob(path, recursive=True) if os.path.isfile(f))
    if not files:
        raise ValueError(f"{flag} {path}: the pattern names no file")
    no_missing_shard(os.path.dirname(path.split("*")[0]) or ".", files, flag, pattern=path)
    return files


_SAID: set[str] = set()  # notes already said (once per process: discover runs once per shard and per rank)


def no_missing_shard(root: str, files: list[str], flag: str, pattern: str | None = None) -> None:
    """For a folder's `{split}-00000-of-00003` files: ValueError (one line) naming the shards a split lacks where most
    are there (a download cut short, one file deleted: the split was trained without them, without a word); a note
    saying how many are there where fewer than half are (a subset on purpose: C4's `en/c4-train.0000[0-2]-of-01024`,
    fetched with --include), read as it is. Older `datasets` push_to_hub names each shard with its own fingerprint
    (`train_sft-00000-of-00003-a3ecf92756993583.parquet`): not part of the split's name. A glob's (`pattern`): the
    same among the shards it would name (`train_sft-*` with one of 3 missing: refused, as the several-splits refusal
    suggests that glob; `c4-train.0000*-of-01024` with 3 of its 10: a note). Cost: a regex per file."""
    per_dir: dict[tuple, dict[str, set[int]]] = {}
    for f in files:
        m = _SHARD_NAME.match(os.path.basename(f))
        if m:
            post = _FINGERPRINT.sub("-*", m[4])  # the missing shard's fingerprint is unknown: named `-*`
            per_dir.setdefault((m[1], int(m[3]), post, m[3]), {}).setdefault(os.path.dirname(f), set()).add(int(m[2]))
    groups: dict[tuple, set[int]] = {}
    dirs: dict[tuple, list[str]] = {}
    for key, held in per_dir.items():  # folders holding disjoint shards of one split (a/ 0-4, b/ 5-9) are that split;
        if sum(map(len, held.values())) == len(set().union(*held.values())):  # one shard in two (a config a folder,
            groups[("", *key)], dirs[("", *key)] = set().union(*held.values()), sorted(held)  # en/, fr/): their own
        else:
            for d, have in held.items():
                groups[(d, *key)], dirs[(d, *key)] = have, [d]
    missing = []
    for key, have in sorted(groups.items()):
        pre, n, post, total = key[-4:]
        d = dirs[key][0]
        every = range(n in have, n + (n in have))  # numbered from 1 (safetensors') too
        if pattern is not None:  # a glob's: the shards it would name (in any of the split's folders)
            every = [k for k in every if any(fnmatch.fnmatch(os.path.join(x, f"{pre}{k:05d}-of-{total}{post}"), pattern)
                                             for x in dirs[key])]
        lack = [k for k in every if k not in have]
        if not lack:
            continue
        if 2 * len(have) >= len(every):  # most of the split: a download cut short
            missing += [os.path.join(d, f"{pre}{k:05d}-of-{total}{post}") for k in lack]
            continue
        note = (f"{flag} {root}: {len(have)} of the {len(every)} shards of {os.path.relpath(os.path.join(d, pre), root)}*-of-"
                f"{total}{post} are here: reading those (part of the split)")
        if note not in _SAID:
            _SAID.add(note)
            print0(note)
    if missing:
        names = ", ".join(os.path.relpath(f, root) for f in missing[:3])
        more, many = f" and {len(missing) - 3} more" if len(missing) > 3 else "", len(missing) > 1
        raise ValueError(f"{flag} {root}: shard{'s' * many} {names}{more} of its split {'are' if many else 'is'} missing "
                         f"(a download cut short?): the split would be trained without {'them' if many else 'it'}; "
                         "download it again, or, to train on part of the split on purpose, give a glob naming only "
                         "the shards present (e.g. train-0000[0-5]-*)")


class _Zstd(io.RawIOBase):
    """A .zst file's bytes, frame after frame; a file that ends inside a frame is an error (zstandard's stream_reader
    ends early without a word: a download cut short lost its tail, 12,703 of 20,000 rows in the audit's case, seen as
    one bad row at most)."""

    def __init__(self, path: str):
        import zstandard

        # a frame's window up to 2 GiB, as `zstd -d --long=31` reads: `zstd --long=30` (large corpora compress so)
        # needs 1 GiB, over zstandard's default limit (128 MiB: "damaged"). The window is allocated as the frame states
        # it: ~1 GiB of this reading process for such a file, none more for the usual 8 MiB windows
        self.fh, self.zstd = open(path, "rb"), zstandard.ZstdDecompressor(max_window_size=2**31)
        self.obj, self.out, self.at, self.done = None, b"", 0, False

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while self.at == len(self.out) and not self.done:
            chunk = self.fh.read(1 << 18)
            if not chunk:
                if self.obj is not None and not self.obj.eof:  # gzip's own EOFError says the same
                    raise EOFError("the file ends inside a zstd frame (cut short?)")
                self.done = True
            parts = []
            while chunk:
                if self.obj is None or self.obj.eof:  # the next frame (zstd -T, pzstd and cat'ed files hold several)
                    self.obj = self.zstd.decompressobj()
                parts.append(self.obj.decompress(chunk))
                chunk = self.obj.unused_data if self.obj.eof else b""
            self.out, self.at = b"".join(parts), 0
        n = min(len(b), len(self.out) - self.at)
        b[:n] = self.out[self.at:self.at + n]
        self.at += n
        return n

    def close(self) -> None:
        self.fh.close()
        super().close()


def open_file(path: str):
    """A data file's bytes, decompressed (.gz, .zst, .bz2, .xz), as a binary file (lines, or read())."""
    low = path.lower()
    if low.endswith((".gz", ".gzip")):
        return gzip.open(path, "rb")
    if low.endswith((".zst", ".zstd")):
        return io.BufferedReader(_Zstd(path), 1 << 16)
    if low.endswith(".bz2"):
        import bz2

        return bz2.open(path, "rb")
    if low.endswith(".xz"):
        import lzma

        return lzma.open(path, "rb")
    return open(path, "rb")


def starts_array(fh) -> bool:
    """Whether a JSON file (binary, at its start) holds one array (its first character, after a BOM and blanks, is
    `[`), not a row per line."""
    return fh.read(1 << 16).removeprefix(codecs.BOM_UTF8).lstrip(b" \t\r\n").startswith(b"[")


def array_elements(fh, chunk: int = ARRAY_CHUNK):
    """The elements of a file holding one JSON array of rows (Stanford Alpaca's alpaca_data.json, LLaMA-Factory's
    data files, OpenHermes-2.5's 1.9 GB openhermes2_5.json), each as its JSON text in bytes, one at a time, as a JSONL
    reader yields lines: memory is the largest element plus a chunk, never the whole file (datasets' json builder
    loads it whole). Each element is scanned here to find its end (json's C scanner) and parsed again by the worker
    that reads it: a second parse, ~10 s a GB on one core. ValueError naming the element where the array is
    malformed (nothing after it can be told apart: no skipping)."""
    decoder = json.JSONDecoder()
    text = codecs.getincrementaldecoder("utf-8-sig")()  # a leading BOM is dropped
    state = {"buf": "", "pos": 0, "eof": False}

    def fill(size: int) -> None:
        data = fh.read(size)
        state["eof"] = not data
        state["buf"] = state["buf"][state["pos"]:] + text.decode(data, final=not data)
        state["pos"] = 0

    def peek() -> str:  # the next character after blanks, "" at the end of the file
        while True:
            state["pos"] = _WS.match(state["buf"], state["pos"]).end()
            if state["pos"] < len(state["buf"]) or state["eof"]:
                return state["buf"][state["pos"]:state["pos"] + 1]
            fill(chunk)

    if peek() != "[":
        raise ValueError("not a JSON array")
    state["pos"] += 1
    n, closed = 0, peek() == "]"
    state["pos"] += closed
    while not closed:
        want = chunk
        peek()
        while True:
            buf, pos = state["buf"], state["pos"]
            try:
                end = decoder.raw_decode(buf, pos)[1]
                # a number the buffer cut (`12.` of `12.5`) decodes short: its end must be followed by something else
                if state["eof"] or end < len(buf) and buf[end] not in "0123456789.eE+-":
                    break
            except json.JSONDecodeError as e:
                at_end = e.pos >= len(buf) or e.msg.startswith("Unterminated string")  # the text ended inside it
                if state["eof"] and at_end:
                    raise ValueError(f"element {n}: the file ends inside it (cut short?)") from None
                if state["eof"] or not (at_end or e.pos >= len(buf) - 8):  # (an escape the buffer's end cut)
                    raise ValueError(f"element {n}: not valid JSON ({e.msg})") from None
            fill(want)
            want *= 2  # a long element: reads double, so it is scanned O(log) times, not once per chunk
        yield buf[pos:end].encode("utf-8")
        n, state["pos"] = n + 1, end
        c = peek()
        if c not in (",", "]"):
            raise ValueError(f"after element {n - 1}: " + (f"expected ',' or ']', got {c!r}" if c else
                                                           "the file ends inside the array (cut short?)"))
        state["pos"] += 1
        closed = c == "]"
    if peek() != "":
        raise ValueError("text after the array's closing ']'")


def list_files(path: str) -> list[str]:
    if (files := matching(path, "--dataset_path")) is not None:
        return files
    if os.path.isdir(path):
        files = sorted(os.path.join(dp, f) for dp, _, fs in os.walk(path) for f in fs
                       if f.endswith((".jsonl", ".json")) and f not in NOT_DATA
                       and not hidden(os.path.relpath(os.path.join(dp, f), path)))
        if not files:
            raise ValueError(f"--dataset_path {path}: folder has no .jsonl files")
        return one_split(path, files, "--dataset_path")
    if not os.path.isfile(path):
        raise ValueError(f"--dataset_path {path}: no such file or folder")
    return [path]


def read_documents(path: str) -> Iterator[tuple[str, int, str | list[int]]]:
    """Yield (file, line_number, text_or_ids) for every document of every non-blank line (a packed row's each; data/
    ids_rows.py); ValueError on a bad line."""
    for file in list_files(path):
        with open(file, encoding="utf-8") as fh:
            for n, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{file}:{n}: not valid JSON ({e.msg}); each line must be one JSON object") from None
                if isinstance(obj, dict) and isinstance(obj.get("text"), str):
                    yield file, n, obj["text"]
                elif isinstance(obj, dict) and isinstance(obj.get("input_ids"), list) and all(
                        isinstance(t, int) and t >= 0 for t in obj["input_ids"]):
                    pieces = [obj["input_ids"]]
                    if any(obj.get(c) is not None for c in BESIDE_IDS):  # labels, loss masks, packing, padding
                        value, why = beside_ids(obj["input_ids"], obj, "input_ids")
                        pieces = documents(value)[0] if not why else []
                        if why or any(isinstance(p, dict) and MASKED in p for p in pieces):  # (no mask carried here)
                            raise ValueError(f"{file}:{n}: " + (why or no_mask_here([c for c in MASKS if obj.get(c)
                                                                                     is not None])))
                    for ids in pieces:  # a packed row's documents, each its own
                        yield file, n, ids
                else:
                    raise ValueError(f"{file}:{n}: expected {{\"text\": str}} or {{\"input_ids\": [int, ...]}}, "
                                     f"got keys {sorted(obj) if isinstance(obj, dict) else type(obj).__name__}")
