"""A pre-tokenized row's columns beside its ids, for data/readers.parse_item and data/jsonl.read_documents: `labels`
(axolotl's / LLaMA-Factory's preprocessed output), TRL's loss masks (`assistant_masks`, `completion_mask`: 1 = the
token is a target) and TRL's packing columns (`seq_lengths`, `position_ids`: several documents in one row).

A 0/1 mask of the ids' length is the row's loss mask (both: a token is a target where both say so, as TRL builds its
labels): the row becomes `{MASKED: (ids, mask)}`, which data/chat.py's encoder hands on as a chat row's (ids, mask):
stored in mask-*.bin, counted in `chat_docs` / `supervised_tokens`, its ids as given (no BOS or EOS added: they are
a conversation as its template rendered it), its masked tokens the only targets. Before, such rows trained every
token, and a packed row's conversations attended to each other, without a word. Cost: one pass over the row's ids per
column, in the workers (~50 ms for a 1M-token row), only for rows that carry such a column.
"""

from __future__ import annotations

import numpy as np

MASKS = ("assistant_masks", "completion_mask")
PACKED = ("seq_lengths", "position_ids")
BESIDE_IDS = ("labels",) + MASKS + PACKED  # read beside a row's ids (a table's columns too)
MASKED = "input_ids\x00mask"  # a row read with its loss mask: {MASKED: (ids, mask)} (not a column name)
BESIDE = "input_ids\x00beside"  # a table's row: {BESIDE: (ids, {column: value})}, checked in the worker
_FIX = "prepare from the rows they were made from (messages, prompt / completion: docs/sft.md)"


def labelled(ids: str) -> str:
    return (f"pre-tokenized {ids!r} with 'labels' that differ from them (axolotl's / LLaMA-Factory's preprocessed "
            "output, -100 over the prompt): its loss mask would be ignored and the prompt trained; prepare from the "
            "chat rows it was made from (messages, ...: docs/sft.md), or drop 'labels' to train every token (labels "
            "equal to the ids, as run_clm's group_texts writes them, train every token: read)")


def _list(v):
    return v.tolist() if hasattr(v, "tolist") else list(v) if isinstance(v, tuple) else v


def _shown(v: list) -> str:
    return f"[{', '.join(map(str, v[:4]))}{', ...' if len(v) > 4 else ''}]"


def _packed(row: dict, n: int) -> str | None:
    """Why a row is several documents (None: one, or no packing column): TRL's `seq_lengths` (one length per
    document; `[n]` is one) or `position_ids` that restart (`0..n-1` is one document)."""
    packed = ("a packed row (TRL's pack_dataset / padding-free output: several documents in one row), read as one "
              "document its conversations would attend to each other; give the rows before packing (this trainer "
              "packs them itself, each document's positions restarting: docs/sft.md)")
    lens = _list(row.get("seq_lengths"))
    if lens is not None and lens != [n]:
        return f"seq_lengths {_shown(lens) if isinstance(lens, list) else repr(lens)} beside {n} ids: {packed}"
    pos = _list(row.get("position_ids"))
    if pos is not None and (not isinstance(pos, list) or pos != list(range(n))):
        at = next((i for i, p in enumerate(pos) if p != i), len(pos)) if isinstance(pos, list) else 0
        return f"position_ids that restart at token {at} (of {n} ids): {packed}"
    return None


def _bits(m, col: str, n: int) -> np.ndarray | str:
    """The column's 0/1 mask as uint8, or why it is none."""
    m = _list(m)
    a = np.asarray(m) if isinstance(m, list) else None
    if a is None or a.ndim != 1 or len(a) != n or (n and (a.dtype.kind not in "biuf" or ((a != 0) & (a != 1)).any())):
        what = f"{len(m)} values" if isinstance(m, list) else type(m).__name__
        return f"{col} ({what}) beside {n} ids is no 0/1 loss mask of the ids (one per token): {_FIX}"
    return a.astype(np.uint8)


def only_same_labels(extra: dict, ids) -> bool:
    """Whether a table row's filled columns beside its ids are only labels equal to them (run_clm's group_texts): read
    as plain ids in the reading process, as cheaply as before (a list compare), not sent on to be checked."""
    return extra.keys() == {"labels"} and isinstance(ids := _list(ids), list) and _list(extra["labels"]) == ids


def beside_ids(ids, row: dict, name: str) -> tuple[object, str | None]:
    """(value, None) or (None, why the row is refused): `ids` (the row's `name` column) as read, or `{MASKED: (ids,
    mask)}` where a mask column holds one. Ids that are no list of non-negative ints are handed back as given, for the
    caller's own check."""
    ids = _list(ids)
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        return ids, None
    n = len(ids)
    if row.get("labels") is not None and _list(row["labels"]) != ids:
        return None, labelled(name)
    if why := _packed(row, n):
        return None, why
    mask, cols = None, [c for c in MASKS if row.get(c) is not None]
    for col in cols:
        m = _bits(row[col], col, n)
        if isinstance(m, str):
            return None, m
        mask = m if mask is None else mask & m
    if mask is None:
        return ids, None
    if not mask[1:].any():  # the first token is predicted from nothing: never a target
        return None, f"{' and '.join(cols)} mark no token to train (past the first): nothing to learn from the row"
    return {MASKED: (ids, mask)}, None


def no_mask_here(cols: list[str]) -> str:
    """The in-process stream's refusal (data/packing.build_token_stream: ids only, no mask)."""
    return (f"{' and '.join(cols)} beside input_ids: a loss mask, which this in-process reader cannot carry (every "
            "token would be trained): prepare the rows with scripts/prepare_data.py, which reads it (docs/sft.md)")
