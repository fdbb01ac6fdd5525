"""A run's note on a folder prepared under older tokenization rules than today's (rules_note), and the resume's notes
on an in-job prepared folder (data/prepare.prepare_in_job: --dataset_path given raw JSONL,
Parquet, ...): where this start prepared the input into another folder than the one the run trained on, or where
the checkpoint does not say which it trained on, whether the tokens from here may differ and how to keep the old ones.
data/pipeline.open_run_data says them; the folders' plans (data/prepare_data.py) are what they compare.
"""

from __future__ import annotations

import glob
import os

from data import packing
from data.output_lock import judge, said
from data.store import is_prepared, read_json


def _plan(folder: str) -> dict | None:
    """What an in-job prepared folder was prepared from (its one shard's plan, data/prepare_data.py), None unreadable."""
    try:
        return read_json(sorted(glob.glob(os.path.join(glob.escape(folder), "shard-*-of-*.json")))[0])["plan"]
    except (OSError, ValueError, IndexError, KeyError, TypeError):
        return None


# what makes an in-job folder's cache key (data/packing.cache_key), as its plan records it
_RULES = ("tokenization rules (a text's separator or special-token strings, a chat row's system_prompt or end-of-turn: "
          "data/packing.RULES)")
_AGAIN = {"units": "its input (its files' names or content)", "tokenizer": "the tokenizer's files",
          "vocab_bound": "the vocabulary bound", "rules": f"the {_RULES}"}


def again_note(dataset_path: str, folder: str, first: str) -> str:
    """The resume's note where --dataset_path was prepared in the job into another folder than the one the run first
    trained on, with why, from the two folders' plans: what differs, or nothing (a folder keyed by the input's path and
    mtime before in-job folders were keyed by its content: the same tokens, prepared once more after that upgrade).
    Cost: two small JSON reads, at a resume only."""
    kept = os.path.isdir(first)
    head = (f"note: --dataset_path {dataset_path} was prepared again in this job ({folder}; this run trained on {first}"
            f"{'' if kept else ', since removed'}): ")
    old, new = _plan(first) if kept else None, _plan(folder)
    if old is not None and new is not None and all(old.get(k) == new.get(k) for k in _AGAIN):
        return head + ("the same input, tokenizer and rules as then, under another cache key (an earlier version "
                       "keyed an in-job folder by its input's path and mtime, not its content), so it holds the same "
                       f"tokens (a chat template's rendered date aside); {first} may be removed once no run uses it")
    said = (" and ".join(v for k, v in _AGAIN.items() if old.get(k) != new.get(k)) + " differ from its first "
            "preparation's" if old is not None and new is not None else
            f"today's {_RULES} may tokenize its documents otherwise, or its input or tokenizer changed")
    return head + f"{said}, so the tokens trained from this step may differ from those before" + (
        f"; to keep them pass --dataset_path {first}" if kept else "")


def _input_key(plan: dict | None) -> tuple | None:
    """An in-job folder's input as every version's plan records it: each unit's kind, file name and size (its
    `units`: `kind:path:size` before 2026-11-30, `kind:source/file:size:sample` since), with its tokenizer's SHA-256;
    None where the plan says nothing readable."""
    try:
        units = frozenset((u.split(":")[0], os.path.basename(u.split(":")[1]), u.split(":")[2]) for u in plan["units"])
    except (TypeError, KeyError, AttributeError, IndexError):
        return None
    return (units, plan.get("tokenizer")) if units else None


def same_input(recorded: str | None, dataset_path: str | None, first: str, folder: str) -> bool:
    """Whether today's --dataset_path is the input this run first trained on (`recorded`, prepared into `first`): the
    same path, or the same files (names and sizes) and tokenizer re-staged at another path (`_input_key` of both
    folders' plans): a copy moved to another mount after a rules bump got no word on its re-tokenized data (an upgrade
    audit). Cost: two small JSON reads, at a resume onto another folder only (rank 0)."""
    if recorded == dataset_path:
        return True
    key = _input_key(_plan(first)) if os.path.isdir(first) else None
    return key is not None and key == _input_key(_plan(folder))


def unrecorded_note(dataset_path: str | None, folder: str) -> str:
    """The resume's note where the checkpoint does not record which prepared folder it trained on (its held-out record
    without `prepared`: written before 2026-11-30) and this start prepared, or reused, the in-job `folder`: an older
    version's preparation of the same input may have tokenized it otherwise (an upgrade audit: losses differed from the
    first resumed step on, the sample count the same, nothing said). Names the one other folder beside `folder` made
    from the same input and tokenizer where there is exactly one. Cost: a listing of the in-job cache and a small JSON
    read per folder in it, at such a resume only (rank 0)."""
    cache, key = os.path.dirname(folder), _input_key(_plan(folder))
    try:
        names = sorted(os.listdir(cache)) if key is not None else []
    except OSError:
        names = []
    others = [p for p in (os.path.join(cache, n) for n in names if ".tmp." not in n)
              if p != folder and is_prepared(p) and _input_key(_plan(p)) == key]
    what = f"--dataset_path {dataset_path}" if dataset_path else "the demo corpus"
    keep = (f"pass --dataset_path {others[0]} (the one other folder in {cache} prepared from this input)"
            if len(others) == 1 else f"pass the folder it trained on as --dataset_path, if it is still in {cache}")
    return (f"note: the resumed checkpoint does not record which preparation of {what} it trained on (written before "
            f"2026-11-30): this start's, {folder}, may tokenize it otherwise than the earlier version's it trained on, "
            f"so the tokens trained from here may differ from those before; to keep the old tokens {keep}")


def rules_note(folder: str, m: dict) -> str | None:
    """A note where `folder` (its manifest `m`) was prepared under older tokenization rules than today's
    (data/packing.RULES) and a step between them changed rows it holds, or may hold (data/output_lock.judge, by the
    manifest's counts): it trains as prepared. A git pull that fixed such rows (a chat template's turns, a loss mask)
    changed nothing for a folder prepared before it, without a word (an upgrade audit). The rules: the manifest's
    (since 2026-12-01), else each shard's plan (its own counts); neither: nothing said (a copy of the manifest and
    tokens alone). In-job folders are keyed by the rules (data/packing.cache_key): always today's. Cost: none, or one
    small JSON read a shard for an older manifest (rank 0, once)."""
    if "rules" in m:
        had = [(r, m) for r in m["rules"]]
    else:
        try:
            had = [(r["plan"].get("rules"), r) for r in (read_json(p) for p in sorted(glob.glob(os.path.join(
                glob.escape(folder), "shard-*-of-*.json"))))]
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return None
    held, may = {}, {}
    for rules, record in had:
        if rules != packing.RULES:
            h, m_, _ = judge(rules, record)
            held.update(dict.fromkeys(h)), may.update(dict.fromkeys(m_))
    if not held and not may:
        return None
    olds = sorted({str(r) if r is not None else "older than any recorded" for r, _ in had if r != packing.RULES})
    return (f"note: --dataset_path {folder} was prepared under tokenization rules {', '.join(olds)}, today's are "
            f"{packing.RULES}: "
            + "; ".join(([f"{said(list(held))} read rows it holds differently"] if held else [])
                        + ([f"{said(list(may))} changed rows its records do not count (prepared before the count): "
                            "it may hold some"] if may else []))
            + "; it trains as it was prepared: run its scripts/prepare_data.py command again with --overwrite (or "
            "another --output) for today's")
