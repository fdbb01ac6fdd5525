"""Reading JSONL documents: `{"text": ...}` (tokenized by us) or `{"input_ids": [...]}` (pre-tokenized).

Errors name the file and line and stop before any heavy work.
"""

from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Iterator

GLOB = "*?["  # a path holding one of these that names nothing is a pattern (`DIR/data/train_sft-*.parquet`)
_SPLIT_WORDS = {"train": "train", "training": "train", "validation": "validation", "valid": "validation",
                "val": "validation", "dev": "validation", "test": "test", "testing": "test", "eval": "test",
                "evaluation": "test"}  # datasets' SPLIT_KEYWORDS (data_files.py)
_SHARD = re.compile(r"(?:^|/)([a-z0-9_]+?)-\d{5}-of-\d{5}")  # the hub's `{split}-00000-of-00003.parquet`


def split_of(rel: str) -> str | None:
    """The split a file belongs to by Hugging Face's naming, as `datasets` infers it from a folder: a shard named
    `{split}-00000-of-00003` whose split holds a split word (`train_sft`, `test_gen`), else a path part or a word of
    the name that is one (`train/...`, `c4-validation.00000-of-00008.json.gz`); None where it names none."""
    rel = rel.lower()
    m = _SHARD.search(rel)
    if m and any(w in _SPLIT_WORDS for w in m.group(1).split("_")):
        return m.group(1)
    return next((_SPLIT_WORDS[w] for w in re.split(r"[-_./]", rel) if w in _SPLIT_WORDS), None)


def one_split(root: str, files: list[str], flag: str) -> list[str]:
    """`files` (a folder's) when they name one split at most (files naming none do not count: `train.jsonl` beside
    `more.jsonl` is one corpus); a ValueError (one line) where they name several (a dataset repo's snapshot: its test
    split would be trained on, silently)."""
    splits = {}
    for f in files:
        splits.setdefault(split_of(os.path.relpath(f, root)), []).append(f)
    named = sorted(s for s in splits if s)
    if len(named) < 2:
        return files
    pick = next((s for s in named if s.startswith("train")), named[0])
    example = re.sub(r"\d{5}-of-\d{5}", "*", splits[pick][0])
    raise ValueError(f"{flag} {root}: its files belong to several splits ({', '.join(named)}, by Hugging Face's "
                     f"file naming), so the evaluation splits would be trained on: give one split's files, e.g. "
                     f"{flag} '{example}'")


def matching(path: str, flag: str) -> list[str] | None:
    """The files a pattern names (sorted), None for a path that is no pattern; a ValueError for one naming none."""
    if os.path.exists(path) or not any(c in path for c in GLOB):
        return None
    files = sorted(f for f in glob.glob(path, recursive=True) if os.path.isfile(f))
    if not files:
        raise ValueError(f"{flag} {path}: the pattern names no file")
    return files


def list_files(path: str) -> list[str]:
    if (files := matching(path, "--dataset_path")) is not None:
        return files
    if os.path.isdir(path):
        files = sorted(os.path.join(dp, f) for dp, _, fs in os.walk(path) for f in fs
                       if f.endswith((".jsonl", ".json")))
        if not files:
            raise ValueError(f"--dataset_path {path}: folder has no .jsonl files")
        return one_split(path, files, "--dataset_path")
    if not os.path.isfile(path):
        raise ValueError(f"--dataset_path {path}: no such file or folder")
    return [path]


def read_documents(path: str) -> Iterator[tuple[str, int, str | list[int]]]:
    """Yield (file, line_number, text_or_ids) for every non-blank line; ValueError on a bad line."""
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
                    yield file, n, obj["input_ids"]
                else:
                    raise ValueError(f"{file}:{n}: expected {{\"text\": str}} or {{\"input_ids\": [int, ...]}}, "
                                     f"got keys {sorted(obj) if isinstance(obj, dict) else type(obj).__name__}")
