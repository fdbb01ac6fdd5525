"""The one-line reasons a corpus row is refused, for data/readers.parse_item (split out of readers.py)."""

from __future__ import annotations

import re

from data.chat import row_format

SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")  # a surrogate's escape on the raw line: only then is the row walked


def lone_surrogate(value) -> bool:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(lone_surrogate(k) or lone_surrogate(v) for k, v in value.items())
    return isinstance(value, list) and any(lone_surrogate(v) for v in value)


def labelled(ids: str) -> str:
    return (f"pre-tokenized {ids!r} with 'labels' that differ from them (axolotl's / LLaMA-Factory's preprocessed "
            "output, -100 over the prompt): its loss mask would be ignored and the prompt trained; prepare from the "
            "chat rows it was made from (messages, ...: docs/sft.md), or drop 'labels' to train every token (labels "
            "equal to the ids, as run_clm's group_texts writes them, train every token: read)")


def both(fields, row: dict) -> str:
    return (f"both {fields.text!r} / {fields.ids!r} and a chat field ({row_format(row)}): which is meant? Keep one "
            "(read as text, every token of the row would be trained)")


def elsewhere(fields, obj: dict) -> str:
    """Where a row with no text field may hold it: a string field (The Stack's `content`), or nested (not read)."""
    nested = [k for k, v in obj.items() if isinstance(v, dict) and (k in (fields.text.split(".")[0], fields.ids) or fields.text in v)]
    if nested:
        return f": nested fields are not read ({nested[0]!r} holds an object, keys {sorted(obj[nested[0]])[:8]}); flatten " \
            "the rows (the text a top-level string field)"
    names = sorted((k for k, v in obj.items() if isinstance(v, str) and k != fields.source), key=lambda k: -len(obj[k]))
    return f": string fields here: {names[:5]}; name the one with the text: --text_field {names[0]}" if names else ""
