"""Reading JSONL documents: `{"text": ...}` (tokenized by us) or `{"input_ids": [...]}` (pre-tokenized).

Errors name the file and line and stop before any heavy work.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator


def list_files(path: str) -> list[str]:
    if os.path.isdir(path):
        files = sorted(os.path.join(dp, f) for dp, _, fs in os.walk(path) for f in fs
                       if f.endswith((".jsonl", ".json")))
        if not files:
            raise ValueError(f"--dataset_path {path}: folder has no .jsonl files")
        return files
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
