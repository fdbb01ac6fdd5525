"""The one-line reasons a corpus row is refused, for data/readers.parse_item (split out of readers.py); a pre-tokenized
row's labels, loss masks and packing columns: data/ids_rows.py."""

from __future__ import annotations

import json
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


def both(fields, row: dict) -> str:
    """A row with a text (or ids) field and a chat field: the way out named (tatsu-lab/alpaca ships a pre-rendered
    `text` beside instruction / output: every row was refused and no flag named). A field name the rows lack reads
    none: `--text_field none` reads every row's chat fields."""
    flag = "--text_field" if fields.text in row else "--ids_field"
    return (f"both {fields.text!r} / {fields.ids!r} and a chat field ({row_format(row)}): which is meant? Keep one "
            f"(read as text, every token of the row would be trained); to read every row's chat fields and not its "
            f"text: {flag} none")


TREE = ("a message-per-row tree (OpenAssistant's: `text` beside `role` and `parent_id`), each row one message, read as "
        "text every token trained: build conversations as `messages` (docs/sft.md)")


def tree_row(keys) -> bool:
    """oasst1 / oasst2's message table (one row a message: message_id, parent_id, text, role, message_tree_id)."""
    return "role" in keys and ("parent_id" in keys or "message_tree_id" in keys)


def other_chat(obj: dict) -> str:
    """": a chat dataset in a format not read here (...): ..." for a row chat_like finds a conversation in, else ""."""
    chat = chat_like(obj)
    return f": a chat dataset in a format not read here ({chat}): convert its rows to `messages` (docs/sft.md)" \
        if chat else ""


def _texty(k: str, v: str) -> bool:
    """A string field that may be a document's text: not an id's, a source's or a language's field, and words (an
    id "0" or a source "sharegpt" named as --text_field trained garbage)."""
    low = k.lower()
    return not (low in ("id", "idx", "uuid", "hash", "url", "source", "lang", "language", "split") or low.endswith(
        ("_id", "_ids", "_idx", "_uuid", "_hash"))) and len(v.split()) > 1


def elsewhere(fields, obj: dict) -> str:
    """Where a row with no text field may hold it: a string field (The Stack's `content`), or nested (not read)."""
    nested = [k for k, v in obj.items() if isinstance(v, dict) and (k in (fields.text.split(".")[0], fields.ids) or fields.text in v)]
    if nested and {"replies", "role"} & set(obj[nested[0]]):  # oasst1 / oasst2's trees: a flattened one is no chat
        return f": {nested[0]!r} holds a message tree (OpenAssistant's, keys {sorted(obj[nested[0]])[:8]}), not read " \
            "here: convert each path through it to a conversation as `messages` (docs/sft.md)"
    if nested:
        return f": nested fields are not read ({nested[0]!r} holds an object, keys {sorted(obj[nested[0]])[:8]}); flatten " \
            "the rows (the text a top-level string field)"
    chat = other_chat(obj)
    if chat:  # its longest string named as the text trained garbage: lmsys' conversation_id, OpenOrca's system_prompt
        return chat
    names = sorted((k for k, v in obj.items() if isinstance(v, str) and k != fields.source), key=lambda k: -len(obj[k]))
    texty = [k for k in names if _texty(k, obj[k])]
    return "" if not names else f": string fields here: {names[:5]}" + (
        f"; name the one with the text: --text_field {texty[0]}" if texty else ", none of them a text")


PROMPTS = ("question", "query", "prompt", "instruction", "problem")  # a question / answer layout's names: a row
REPLIES = ("response", "answer", "answers", "output", "chat", "completion", "solution")  # holding one of them (a
BESIDE = ("system", "system_prompt", "input", "context", "document")  # reply's with one more) is no corpus row


def chat_like(obj: dict) -> str | None:
    """Where a row of no format read here holds a conversation (None for a corpus row: The Stack's `content`): a
    field of {role, content} / {from, value} turns (lmsys-chat-1m's `conversation`, Nemotron's `input`), or a
    question / answer layout (OpenOrca's question / response, xLAM's query / answers, glaive's system / chat)."""
    for k, v in obj.items():
        if isinstance(v, str) and v.lstrip().startswith("[{"):
            try:
                v = json.loads(v)
            except ValueError:
                continue
        if isinstance(v, list) and v and all(isinstance(t, dict) for t in v) and any(
                {"role", "content"} <= set(t) or {"from", "value"} <= set(t) or {"input", "output"} <= set(t) for t in v):
            return f"its turns in {k!r}"  # {input, output}: Capybara's `conversation`
        if isinstance(v, list) and len(v) > 1 and all(isinstance(t, str) and len(t.split()) > 1 for t in v) and not any(
                isinstance(x, str) and _texty(y, x) for y, x in obj.items()):  # stingning/ultrachat's `data`; beside a
            return f"its turns in {k!r}, a list of strings (user, assistant, ...)"  # text: a corpus row's tags
    filled = [k for k in PROMPTS + REPLIES + BESIDE if isinstance(obj.get(k), str | list) and obj[k]]
    asks = [k for k in filled if k in PROMPTS]
    if asks or len(filled) > 1 and any(k in REPLIES for k in filled):
        return f"fields {filled}"
    return None
