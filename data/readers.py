"""Corpus inputs for `prepare_data`: JSONL (`.jsonl`/`.ndjson`/`.json`, plain or .gz/.zst/.bz2/.xz; a `.json` holding one
array of rows too), Parquet, Hugging Face `datasets` folders (`save_to_disk`) and local data files through
`datasets.load_dataset(builder, data_files=...)`. A row is a
text, pre-tokenized ids, or a chat row (`messages`, `conversations`, `prompt` + `completion`: data/chat.py),
in any of these containers.

An input is a list of `Unit`s (one file, or one datasets folder: data/discover.py); a unit yields `(row, item)` pairs from a
given row on (resume). JSONL lines are passed on undecoded (`bytes`): the worker processes parse them, so
the reading process only moves bytes; an array's elements too, one at a time (data/jsonl.array_elements). A folder's
metadata files (README.md, dataset_info.json, ...: jsonl.NOT_DATA) are not data. Columnar inputs hand over `(value, source)` already extracted.
Every document has a source name: the unit's (`name=PATH` on the command line, else the file or folder
name without extensions), or the row's `--source_field` when given.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass

from base.log import cause
from data.chat import row_format
from data.chat_rows import PREFERENCE, UNREAD, without_nulls
from data.discover import Unit, damaged, unreadable
from data.ids_rows import BESIDE, BESIDE_IDS, beside_ids, plain_ids, processed
from data.jsonl import (
    COMPRESSED_END,
    array_elements,
    open_file,
)
from data.row_errors import SURROGATE, TREE, both, elsewhere, lone_surrogate, other_chat, tree_row

# The longest text document tokenized (UTF-8 bytes). The Rust tokenizer holds ~120 bytes per byte of text while it
# encodes one (its Encoding's tokens, offsets and alignments: a 16 MB document peaked at ~1.9 GB measured, 20 MB at 2.7
# GB in an audit; a 200 MB line allowed in-job took ~24 GB, an OOM kill naming no line). At the cap ~4 GB in its
# worker; 32 workers on 1M-token documents (~4 MB) hold ~0.5 GB each, ~15 GB together. A longer one is handed on as a
# Refused row, its text dropped here: refused naming its row, or skipped and counted under --skip_bad_rows. Not cut
# into pieces: a cut is exact only where the tokenizer's pre-tokenizer splits the whole text there too (GPT-2's regex
# joins "\n\n", a Metaspace prefix adds a "▁" at each piece's start).
MAX_DOC_BYTES = 32 << 20  # ~8M tokens: longer than any sample trained here (the packer cuts it at sample boundaries)
TEXT_DOC_MAX = MAX_DOC_BYTES  # --loader text: a file is one document, read whole; refused by its size before it is
# read (a compressed one's by its text's, once read)
PARQUET_BATCH_BYTES = 64 << 20  # Parquet decoded so much at a time, ~6x in Python (1024 rows of 800 KB took 4.9 GB)


@dataclass(frozen=True)
class Fields:
    text: str = "text"
    ids: str = "input_ids"
    source: str | None = None


def iter_rows(unit: Unit, fields: Fields, start: int = 0, batch_rows: int = 1024) -> Iterator[tuple[int, object]]:
    """`(row, item)` from row `start` on; item: raw JSON bytes, or `(value, source)` with value a str, a
    list of ints, or None (a bad row: missing/null field), or a Refused row (a text over MAX_DOC_BYTES: parse_item
    says why). A file that cannot be read to its end: one line."""
    try:
        yield from _rows(unit, fields, start, batch_rows)
    except unreadable() as e:
        raise damaged(unit.path, e) from None


def _rows(unit: Unit, fields: Fields, start: int, batch_rows: int) -> Iterator[tuple[int, object]]:
    if unit.kind == "jsonl":
        with open_file(unit.path) as fh:
            for row, line in enumerate(fh):
                if row >= start and line.strip():
                    yield row, _not_too_long(line, fields)
        return
    if unit.kind == "json_array":
        with open_file(unit.path) as fh:
            try:
                for row, element in enumerate(array_elements(fh)):
                    if row >= start:
                        yield row, _not_too_long(element, fields)
            except ValueError as e:  # a malformed array: nothing after it can be read (no line to skip to)
                raise ValueError(f"{unit.path}: {e}") from None
        return
    if unit.kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:  # a file cut short or a git-lfs pointer: Arrow's "magic bytes not found" named no file
            pf = pq.ParquetFile(unit.path, buffer_size=8 << 20, pre_buffer=False)  # column chunks read 8 MB at a time
        except pa.ArrowInvalid as e:
            raise damaged(unit.path, e) from None
        cols = _columns(unit, pf.schema_arrow.names, fields, lambda: next(pf.iter_batches(batch_size=1)).to_pylist()[0])
        row = 0
        for rg in range(pf.num_row_groups):
            meta = pf.metadata.row_group(rg)
            if row + (n := meta.num_rows) <= start:  # resume: whole row groups before the position are not decoded
                row += n
                continue
            size = max(1, min(batch_rows, PARQUET_BATCH_BYTES * n // max(meta.total_byte_size, 1)))  # by bytes a row
            try:
                for batch in pf.iter_batches(batch_size=size, row_groups=[rg], columns=_flat(cols)):
                    yield from _columnar(batch.to_pydict(), cols, row, start)
                    row += batch.num_rows
            except (pa.ArrowNotImplementedError, pa.ArrowCapacityError) as e:  # > 2 GB of strings in one batch
                raise ValueError(f"{unit.path}: row group {rg} ({n} rows): {cause(e)}: re-write the file with smaller "
                                 "row groups (pyarrow.parquet.write_table(..., row_group_size=100))") from None
        return
    import datasets

    if unit.kind == "hf_disk":
        ds = datasets.load_from_disk(unit.path)
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise ValueError(f"{unit.path}: a DatasetDict without a 'train' split ({list(ds)}); save one split")
            ds = ds["train"]
        ds = ds.with_format(None)  # saved with_format("pandas" / "arrow" / "numpy"): rows as Python values, not frames
        cols = _columns(unit, ds.column_names, fields, lambda: ds[0])
        ds = ds.select_columns(_flat(cols))
        if start:
            ds = ds.select(range(start, len(ds)))
    else:
        builder = unit.kind.split(":", 1)[1]
        # `text`: a file is one document (a book, a source file), as a long-context corpus means it; datasets'
        # default, a document a line, cut a book into line-long documents, each with its BOS and EOS
        extra = {"sample_by": "document"} if builder == "text" else {}
        if builder == "csv":  # a text "NA", "null", "" or "nan" is that text, not a missing value (pandas' default
            extra = {"keep_default_na": False}  # NA strings made them None: bad rows), a .tsv's columns split by tabs
            extra.update({"sep": "\t"} if COMPRESSED_END.sub("", unit.path.lower()).endswith(
                ".tsv") else {})
        if builder == "text" and os.path.getsize(unit.path) > TEXT_DOC_MAX:  # read whole: one file, one document
            if start == 0:  # refused unread (its row 0: a bad row, skipped under --skip_bad_rows)
                yield 0, Refused(f"{os.path.getsize(unit.path) / 2**20:.0f} MB read as one document (--loader text: "
                                 f"a file is a document), over the {TEXT_DOC_MAX >> 20} MB tokenized as one: split it "
                                 "into documents, or give JSONL with one document a row")
            return
        try:  # an unknown builder is a hub lookup offline (ConnectionError), a file it cannot parse its own error
            ds = datasets.load_dataset(builder, data_files=[unit.path], split="train", streaming=True, **extra)
            names = list(ds.column_names or []) or list(next(iter(ds)).keys())
        except Exception as e:  # noqa: BLE001 (a user's --loader / file: one line, not datasets' traceback)
            raise _not_read(builder, unit.path, e) from None
        cols = _columns(unit, names, fields, lambda: next(iter(ds)))
        if start:
            ds = ds.skip(start)
    row = start
    try:
        for batch in ds.iter(batch_size=batch_rows):
            yield from _columnar(batch, cols, row, start)
            row += len(next(iter(batch.values())))
    except UnicodeDecodeError as e:  # a --loader text / csv file's later rows: not UTF-8 past its first batch
        raise _not_read(unit.kind.split(":", 1)[-1], unit.path, e) from None


def _not_read(builder: str, path: str, e: BaseException) -> ValueError:
    """One line for a file datasets.load_dataset(builder) could not read: not UTF-8 (a latin-1 / cp1252 text), or
    another error (an unknown builder, a file it cannot parse)."""
    if isinstance(e, UnicodeDecodeError):
        return ValueError(f"--loader {builder}: {path} is not UTF-8 text ({cause(e)}): re-encode it as UTF-8 (e.g. "
                          "`iconv -f latin1 -t utf-8 FILE > FILE.utf8`, latin1 or the encoding it was written in)")
    return ValueError(f"--loader {builder}: datasets.load_dataset could not read {path} ({cause(e)}): use a builder "
                      "it has (csv, json, text, parquet, arrow, ...)")


@dataclass(frozen=True)
class Refused:
    """A row handed on without its content, only why it is refused (parse_item's error): a bad row as the workers
    report theirs, refused naming it, or skipped and counted under --skip_bad_rows (a 33 MB row among 100M ended a
    1 TB preparation, no skip possible). Its text never reaches a worker nor the tokenizer."""
    why: str


def _too_long(size: int) -> Refused:
    return Refused(f"a text document of {size / 2**20:.0f} MB, over the {MAX_DOC_BYTES >> 20} MB tokenized as one (the "
                   f"tokenizer holds ~120 bytes per byte of it: ~{size * 120 / 2**30:.0f} GB): split it into documents, "
                   "or give its input_ids pre-tokenized")


def _not_too_long(raw: bytes, fields: Fields) -> bytes | Refused:
    """A JSONL line or array element, Refused where its text is over MAX_DOC_BYTES. Only a raw row over the cap is
    parsed here (its ids or other fields may make it long): rare, one parse of it."""
    if len(raw) <= MAX_DOC_BYTES:
        return raw
    try:
        obj = json.loads(raw)
    except ValueError:  # the worker says what is wrong with it
        return raw
    over = _over_cap(obj.get(fields.text) if isinstance(obj, dict) else None)
    return raw if over is None else over


def _over_cap(text) -> Refused | None:
    """A text over MAX_DOC_BYTES as its Refused row, else None (a char is 1-4 bytes: only a long one is encoded to
    count them)."""
    if isinstance(text, str) and len(text) > MAX_DOC_BYTES // 4 and (n := len(text.encode("utf-8", "replace"))) > \
            MAX_DOC_BYTES:
        return _too_long(n)
    return None


CHAT_COLUMNS = (("messages",), ("conversations",), ("prompt", "completion"), ("instruction", "output"))  # data/chat.py's
# row formats
CHAT_EXTRAS = ("tools", "system", "system_prompt", "input", "history", "chat_template_kwargs", "label", "functions",
               "images", "image", "videos", "audios") + UNREAD + PREFERENCE  # carried with a chat row when the table has them
# (data/chat_tools.py reads the tools, data/chat_rows.py the system prompt, an Alpaca row's input and history, and
# refuses a KTO row's label, a legacy functions list, a filled media column (chat_rows.MEDIA: a text-only trainer; a
# media column's bytes are read only as far as the first filled row, which refuses the preparation) and a context or
# reply it does not read (chat_rows.UNREAD: ChatQA's document, answers) and a preference row's chosen / rejected;
# data/chat_template.py the template's arguments)


TEXT_BESIDE = "text\x00"  # marks a table's text column carried beside its chat columns (not a column name)


def _columns(unit: Unit, names: list[str], fields: Fields, first=None) -> tuple[str | tuple[str, ...], str | None,
                                                                               tuple[str, ...]]:
    """(the value column, or a chat format's columns; the source column or None; the columns read beside its ids:
    data/ids_rows.py). A table with both a text column and
    chat columns (pandas' to_parquet of mixed text and chat rows: each row fills one, the other null) carries both:
    each row is the one it fills; a row filling both is a bad row (which is meant?). A table of none: ValueError naming
    the chat format its first row holds (`first()`, read only then: lmsys-chat-1m's `conversation`), as JSONL's says;
    an OpenAssistant message table (its `text` beside `role` and `parent_id`: every token trained) too."""
    value = fields.text if fields.text in names else fields.ids if fields.ids in names else None
    # every chat format's columns the table has, each row read as the one it fills (row_format), as JSONL's rows are: a
    # table mixing formats (pandas' to_parquet of tulu, Alpaca and ShareGPT rows) had only the first format's read, the
    # other rows refused as "not a chat row"
    chat = tuple(dict.fromkeys(n for c in CHAT_COLUMNS if all(n in names for n in c) for n in c)) or None
    if chat is not None and fields.text not in names and processed(names, fields.ids):  # TRL's processed dataset:
        chat = None  # its ids and labels, as TRL trains them (data/ids_rows.processed)
    if chat is not None:
        value = chat + tuple(c for c in CHAT_EXTRAS if c in names and c not in chat) + (
            (TEXT_BESIDE + value,) if value else ())
    # labels, TRL's loss masks and packing columns beside the ids: carried with each row, checked in the workers
    beside = tuple(c for c in BESIDE_IDS if c in names) if value == fields.ids and chat is None else ()
    if value == fields.text and chat is None and tree_row(names):
        raise ValueError(f"{unit.path}: {TREE}")
    if value is None:
        try:
            row = first() if first else None
        except Exception:  # noqa: BLE001 (a hint only: the line below says what is wrong)
            row = None
        raise ValueError(f"{unit.path}: no column {fields.text!r} (--text_field), {fields.ids!r} (--ids_field), "
                         f"messages, conversations, prompt + completion or instruction + output (chat); columns are {names}"
                         + (other_chat(row) if isinstance(row, dict) else ""))
    return value, (fields.source if fields.source in names else None), beside


def _flat(cols: tuple) -> list[str]:
    return [c.removeprefix(TEXT_BESIDE) for c in ((*cols[0],) if isinstance(cols[0], tuple) else (cols[0],))
            + (cols[1],) + cols[2] if c]


def _columnar(batch: dict, cols: tuple, row: int, start: int) -> Iterator[tuple[int, object]]:
    chat = isinstance(cols[0], tuple)
    values = batch[cols[0][0] if chat else cols[0]]
    sources = batch[cols[1]] if cols[1] else None
    beside = {c: batch[c] for c in cols[2]}
    for i, v in enumerate(values):
        if row + i >= start:
            if (over := _over_cap(v)) is not None:
                yield row + i, over
                continue
            extra = {c: b[i] for c, b in beside.items() if b[i] is not None}
            if extra and not plain_ids(extra, v):  # else read by parse_item (data/ids_rows.py)
                v = {BESIDE: (v, extra)}
            if chat:  # a chat row travels as the dict data/chat.py reads
                v = {c.removeprefix(TEXT_BESIDE): batch[c.removeprefix(TEXT_BESIDE)][i] for c in cols[0]}
                name = next((c.removeprefix(TEXT_BESIDE) for c in cols[0] if c.startswith(TEXT_BESIDE)), None)
                text = v.pop(name) if name else None
                if text is not None:  # the row's text, beside chat columns: a text row, unless it fills those too
                    v = {**v, name: text, TEXT_BESIDE: True} if row_format(v) else text
                    if not isinstance(v, dict):
                        yield row + i, (v, str(sources[i]) if sources is not None and sources[i] is not None else None)
                        continue
                if v.get("tools") is not None and not isinstance(v["tools"], str):
                    v["tools"] = without_nulls(v["tools"])
                for key in ("messages", "conversations", "prompt", "completion"):  # each call's arguments too: a
                    for m in v.get(key) if isinstance(v.get(key), list) else ():  # reply's trained text
                        if isinstance(m, dict) and m.get("tool_calls") is not None and not isinstance(m["tool_calls"], str):
                            m["tool_calls"] = without_nulls(m["tool_calls"])
            yield row + i, (v, str(sources[i]) if sources is not None and sources[i] is not None else None)


def parse_item(item: object, fields: Fields) -> tuple[str | list | dict | None, str | None, str | None]:
    """(text, ids or a chat row (dict), source or None, error or None) for one row; runs in the worker processes."""
    if isinstance(item, Refused):  # refused by the reader, its content not handed on
        return None, None, item.why
    if isinstance(item, bytes):
        try:
            obj = json.loads(item)
        except ValueError as e:
            return None, None, f"not valid JSON ({getattr(e, 'msg', e)}); each line must be one JSON object"
        if not isinstance(obj, dict):
            return None, None, f"expected a JSON object, got {type(obj).__name__}"
        value = obj.get(fields.text, obj.get(fields.ids))
        if isinstance(value, str) and tree_row(obj) and not row_format(obj):  # oasst1 / oasst2's messages table
            return None, None, TREE
        if isinstance(value, dict) and not row_format(value):  # was read as a chat row: "chat row: not a chat row"
            return None, None, f"expected a string in {fields.text!r}{elsewhere(fields, obj)}"
        if value is not None and row_format(obj) and (fields.text in obj or not processed(obj, fields.ids)):
            return None, None, both(fields, obj)  # (ids with labels beside a chat field: TRL's, read as ids)
        extra = {c: obj[c] for c in BESIDE_IDS if obj.get(c) is not None} if fields.text not in obj else None
        if extra and value is not None and not plain_ids(extra, value):
            value, why = beside_ids(value, extra, fields.ids)  # labels, loss masks, packing, padding
            if why:
                return None, None, why
        if SURROGATE.search(item) and lone_surrogate(obj):  # a web crawl's cut emoji: the tokenizer's TypeError
            return None, None, ("a lone UTF-16 surrogate (\\ud800-\\udfff not in a pair) in a string: not valid "
                                "Unicode (a cut emoji?); fix or drop the row")
        if value is None and row_format(obj):
            value = obj  # a chat row: data/chat.py reads it
        src = obj.get(fields.source) if fields.source else None
        item = (value, None if src is None else str(src))
        if value is None and fields.text in obj and obj.get(fields.ids) is None:
            return None, None, f"{fields.text!r} is null (a row with no text): fill it, or drop the row"
        if value is None:
            return None, None, (f"expected {{\"{fields.text}\": str}}, {{\"{fields.ids}\": [int, ...]}} or a chat row "
                                f"(messages, conversations, prompt + completion, instruction + output), got keys {sorted(obj)}"
                                + (": a preference row; for SFT give the chosen conversation as messages"
                                   if "chosen" in obj else elsewhere(fields, obj)))
    value, src = item
    if isinstance(value, dict) and value.get(TEXT_BESIDE):
        return None, None, both(fields, value)  # a table's row filling its text and chat columns
    if isinstance(value, dict) and BESIDE in value:  # a table's ids with labels, a mask, packing or padding
        value, why = beside_ids(*value[BESIDE], fields.ids)
        if why:
            return None, None, why
    if isinstance(value, str):  # a UTF-8 BOM a Windows tool wrote at a file's start is no character of the text
        return value.removeprefix("\ufeff"), src, None
    if isinstance(value, dict):
        return value, src, None
    if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        return value, src, None
    if value is not None and hasattr(value, "tolist"):  # numpy / arrow arrays of ids
        return parse_item((value.tolist(), src), fields)
    if value is None:  # a table's null cell
        return None, None, (f"{fields.text!r} (or {fields.ids!r}) is null (a row with no text): fill it, or drop the "
                            "row")
    return None, None, (f"expected a string in {fields.text!r} or non-negative ints in {fields.ids!r}, got "
                        f"{type(value).__name__}")
