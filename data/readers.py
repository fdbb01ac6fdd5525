"""Corpus inputs for `prepare_data`: JSONL (`.jsonl`/`.ndjson`/`.json`, plain or .gz/.zst/.bz2/.xz; a `.json` holding one
array of rows too), Parquet, Hugging Face `datasets` folders (`save_to_disk`) and local data files through
`datasets.load_dataset(builder, data_files=...)`. A row is a
text, pre-tokenized ids, or a chat row (`messages`, `conversations`, `prompt` + `completion`: data/chat.py),
in any of these containers.

An input is a list of `Unit`s (one file, or one datasets folder); a unit yields `(row, item)` pairs from a
given row on (resume). JSONL lines are passed on undecoded (`bytes`): the worker processes parse them, so
the reading process only moves bytes; an array's elements too, one at a time (data/jsonl.array_elements). A folder's
metadata files (README.md, dataset_info.json, ...: jsonl.NOT_DATA) are not data. Columnar inputs hand over `(value, source)` already extracted.
Every document has a source name: the unit's (`name=PATH` on the command line, else the file or folder
name without extensions), or the row's `--source_field` when given.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

from base.log import cause, print0
from base.run_lock import LOCK
from data import output_lock
from data.chat import row_format
from data.chat_rows import UNREAD, without_nulls
from data.ids_rows import BESIDE, BESIDE_IDS, beside_ids, plain_ids
from data.jsonl import (
    COMPRESSED,
    NOT_DATA,
    array_elements,
    hidden,
    matching,
    one_split,
    open_file,
    starts_array,
)
from data.row_errors import SURROGATE, both, elsewhere, lone_surrogate
from data.store import FORMAT, MANIFEST

JSONL_EXT = tuple(b + c for b in (".jsonl", ".json", ".ndjson") for c in COMPRESSED)  # matched in lower case
PARQUET_EXT = (".parquet",)
# a folder's files that look like data but that nothing here reads: refused by name, never dropped without a word
# (a .jsonl.lz4 or .zip of a corpus, datasets' cache-*.arrow files, a .csv beside the JSONL)
OTHER_DATA = (".arrow", ".zip", ".tar", ".tgz", ".7z", ".rar", ".lz4", ".gz", ".zst", ".bz2", ".xz", ".csv", ".tsv",
              ".feather", ".avro", ".orc")
# raw text documents (`.txt.gz`: OTHER_DATA's) beside JSONL / Parquet, refused by name (they were dropped without a word;
# a folder of only these: "no .jsonl ... (or use --loader)"); a snapshot's LICENSE.txt, CITATION.md, ... are no documents
TEXT_DOCS = (".txt", ".md", ".tex", ".html", ".htm")
DOC_META = {"readme", "license", "licence", "copying", "notice", "citation", "changelog", "changes", "authors",
            "requirements", "contributing", "code_of_conduct", "datasheet", "dataset_card", "terms", "terms_of_use",
            "security", "acknowledgements", "acknowledgments", "sha256sums", "sha1sums", "md5sums", "checksums"}
TEXT_DOC_MAX = 2**30  # --loader text: a file is one document, read whole (1M tokens are ~4 MB of text)
PARQUET_BATCH_BYTES = 64 << 20  # Parquet decoded so much at a time, ~6x in Python (1024 rows of 800 KB took 4.9 GB)


@dataclass(frozen=True)
class Fields:
    text: str = "text"
    ids: str = "input_ids"
    source: str | None = None


@dataclass(frozen=True)
class Unit:
    name: str  # source name of its documents (unless a row names its own)
    kind: str  # jsonl | json_array | parquet | hf_disk | hf_load:<builder>
    path: str

    def files(self) -> list[str]:
        """The files it reads: itself, or every file of its folder."""
        if os.path.isfile(self.path):
            return [self.path]
        return sorted(os.path.join(d, f) for d, _, fs in os.walk(self.path) for f in fs)

    def size(self) -> int:
        return sum(os.path.getsize(f) for f in self.files())

    def identity(self) -> str:
        """kind:source/file name:size:sample (a folder's: its files' sum, and a hash of each file's first and last 64
        KiB): a file rewritten at the same size is another input (its old tokens were kept, the log read as prepared).
        Its name and content, not its folder or mtime: a copy without -p, a re-download or a re-staging to node-local
        scratch at each requeue (/tmp/slurm-$JOBID/...) is the same input (by path and mtime, a half-done preparation
        lost its committed chunks). Cost: an open and two 64 KiB reads per file, ~7x a stat: ~17 s per million small
        files on a local disk, minutes on Lustre, once per shard's start."""
        digest, size = hashlib.sha256(), 0
        for f in self.files():
            with open(f, "rb") as fh:
                n = os.fstat(fh.fileno()).st_size
                digest.update(fh.read(1 << 16))
                fh.seek(max(n - (1 << 16), 0))
                digest.update(fh.read(1 << 16))
            size += n
        return f"{self.kind}:{self.name}/{os.path.basename(self.path)}:{size}:{digest.hexdigest()[:16]}"

    def where(self, row: int) -> str:
        """Row `row` as a message names it: a JSONL line (from 1), an array's element (its index), a table's row."""
        return f"{self.path}:{row + 1}" if self.kind == "jsonl" else f"{self.path}[{row}]" \
            if self.kind == "json_array" else f"{self.path}: row {row}"


def _stem(path: str) -> str:
    base = os.path.basename(os.path.normpath(path))
    ext = next((e for e in sorted(JSONL_EXT + PARQUET_EXT, key=len, reverse=True) if base.lower().endswith(e)), "")
    return base[: len(base) - len(ext)]


def native(path: str) -> bool:
    """A file read as JSONL / JSON / Parquet whatever --loader says (`.JSONL`, `.ndjson`, `.jsonl.bz2` too)."""
    return path.lower().endswith(JSONL_EXT + PARQUET_EXT)


# a run's output folder (its RUN_LOCK; training/checkpoint_files.POINTER under checkpoints/, named here: training is a
# layer above; a finished run's metrics.jsonl beside its checkpoints/ or eval/) or a prepared folder (its manifest,
# prepare_data's plans and shard records, known by their first bytes: Beam's `shard-00000-of-00002.json` rows and an
# export's own manifest.json are data): its JSON is no training data. Cost: a few stats and <= 3 reads of 256 bytes a
# subfolder walked.
_OUTPUT_MARKS = (LOCK, os.path.join("checkpoints", "LATEST"))
_OURS = ((MANIFEST, re.compile(r'^\s*\{\s*"format"\s*:\s*"' + re.escape(FORMAT) + '"')),
         ("plan-s[0-9][0-9][0-9][0-9][0-9].json", re.compile(r'^\s*\{\s*"units"\s*:')),
         ("shard-[0-9][0-9][0-9][0-9][0-9]-of-[0-9][0-9][0-9][0-9][0-9].json", re.compile(r'^\s*\{\s*"chunks"\s*:')))
_SKIPPED: set[str] = set()  # subfolders already said skipped (once per process: discover runs once per shard)


def _head(path: str) -> str:
    try:
        with open(path, "rb") as fh:
            return fh.read(256).decode("utf-8", "replace")
    except OSError:
        return ""


def _output_folder(d: str, names: list[str]) -> bool:
    """Whether folder `d` (its file names `names`) is a run's or a preparation's output folder."""
    if any(os.path.isfile(os.path.join(d, m)) for m in _OUTPUT_MARKS) or ("metrics.jsonl" in names and any(
            os.path.isdir(os.path.join(d, x)) for x in ("checkpoints", "eval"))):
        return True
    for pattern, first in _OURS:
        f = next((f for f in names if fnmatch.fnmatch(f, pattern)), None)
        if f is not None and first.match(_head(os.path.join(d, f))):
            return True
    return False


def _walk(root: str, flag: str | None = None) -> Iterator[tuple[str, list[str], list[str]]]:
    """os.walk of `root` (folder, its subfolders, its file names), subfolders in order, its hidden subfolders and a
    run's or a preparation's output folder (and what lies in it) left out; the latter said once where `flag` names
    the input (`_folder`'s walk; --loader's too)."""
    for d, dirs, fs in os.walk(root):
        dirs[:] = sorted(x for x in dirs if not x.startswith("."))
        if d != root and _output_folder(d, fs):
            dirs[:] = []
            if flag and d not in _SKIPPED:
                _SKIPPED.add(d)
                print0(f"{flag} {root}: skipping {os.path.relpath(d, root)}/, a run's output folder or a prepared "
                       "folder, not data")
            continue
        yield d, dirs, fs


def _folder(path: str, flag: str) -> list[str]:
    """A folder's inputs in order: its JSONL / JSON / Parquet files and the `save_to_disk` folders inside it (each its
    own unit, never read as rows of its state.json), not its hidden files or folders (`.ipynb_checkpoints/`' copies
    were read: a file trained twice) nor its metadata; ValueError naming the files that look like data but that nothing
    here reads (`.jsonl.lz4`, `.arrow`, `.zip`, ...: they were dropped without a word). A subfolder that is a run's
    output folder or a prepared folder is skipped, said once (`--output_dir D/run` with `--dataset_path D` read the
    run's metrics.jsonl, MANIFEST.json and eval/*.json as rows at its requeue: refused as not valid JSON)."""
    files, other, texts = [], [], []
    for d, dirs, fs in _walk(path, flag):
        if d != path and is_hf_folder(d):
            files.append(d)
            dirs[:] = []
            continue
        for f in fs:
            p = os.path.join(d, f)
            if f.startswith(".") or f in NOT_DATA:
                continue
            if native(f):
                files.append(p)
            elif f.lower().endswith(OTHER_DATA) or any(e in f.lower() for e in (".jsonl", ".ndjson", ".parquet")):
                other.append(os.path.relpath(p, path))
            elif f.lower().endswith(TEXT_DOCS) and not _paper(os.path.relpath(p, path)):
                texts.append(os.path.relpath(p, path))
    other += texts if files or other else []
    if other:
        raise ValueError(f"{flag} {path}: cannot read {sorted(other)[:5]}" + (f" and {len(other) - 5} more" if len(
            other) > 5 else "") + ": not .jsonl / .ndjson / .json (plain, .gz, .zst, .bz2, .xz), .parquet nor a "
            "save_to_disk folder; give the files to read as a glob (--input 'DIR/*.jsonl'), convert them, give them with "
            "--loader BUILDER (text: a .txt / .md file is one document), or move them out of the folder")
    _no_copies(path, files, flag)
    return sorted(files)


def _paper(rel: str) -> bool:
    """A dataset snapshot's own papers, not documents: README.md, README_zh.md, LICENSE-CODE.md, SHA256SUMS.txt (a
    DOC_META name, alone or before `_` / `-`), anything under a docs/ folder."""
    parts = rel.lower().split(os.sep)
    stem = parts[-1].split(".")[0]
    return bool({"docs", "doc"} & set(parts[:-1])) or any(stem == m or stem.startswith((m + "_", m + "-"))
                                                           for m in DOC_META)


def _no_copies(path: str, files: list[str], flag: str) -> None:
    """ValueError naming a file beside its compressed copy (`web.jsonl`, `web.jsonl.gz`: gunzip -k): both were read."""
    seen: dict[str, str] = {}
    for f in sorted(files):
        low = f.lower()
        key = next((low[: -len(c)] for c in COMPRESSED if c and low.endswith(c)), low)
        if key in seen:
            raise ValueError(f"{flag} {path}: {os.path.relpath(seen[key], path)} and {os.path.relpath(f, path)} are "
                             "copies of one file (by name, compressed or not): both would be read, every row twice; move "
                             "one out of the folder (to repeat a source on purpose, weight it in the mixture: docs/data.md)")
        seen[key] = f


def is_hf_folder(path: str) -> bool:
    return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, f))
                                       for f in ("state.json", "dataset_dict.json"))


def discover(spec: str, loader: str | None = None, flag: str = "--input") -> list[Unit]:
    """Units of one `--input` value (train.py's `--dataset_path`: `flag` names it in messages): `[name=]PATH`, PATH a
    file, a folder of files or a datasets folder."""
    name, eq, path = spec.partition("=")  # `name=PATH`: a name holds no `/` (`/data/lang=en` is a path, hive-style)
    if not eq or "/" in name or os.path.exists(spec):
        name, path = "", spec
    return _units(name, path, loader, flag)


def _units(name: str, path: str, loader: str | None, flag: str) -> list[Unit]:
    spec = f"{name}={path}" if name else path
    pattern = matching(path, flag)  # `DIR/data/train_sft-*.parquet`: one split's files
    if pattern is not None:
        name = name or _stem(path.split("*")[0].rstrip("-_."))
        return [u for f in pattern for u in _units(name, f, loader, flag)]
    if not os.path.exists(path):
        raise ValueError(f"{flag} {spec}: no such file or folder")
    output_lock.unfinished(path, flag)  # a preparation's own folder, preempted before its manifest: no rows to read
    # JSONL / Parquet read as such whatever --loader says (`--loader text` made a chat JSONL given beside a .txt folder
    # one raw-text document of JSON syntax, every token trained)
    if loader and not is_hf_folder(path) and not (os.path.isfile(path) and native(path)):
        if os.path.isfile(path):
            return [Unit(name or _stem(path), f"hf_load:{loader}", path)]
        # a folder's files as the other formats' (no metadata, one split), one source named after it
        files = one_split(path, sorted(os.path.join(d, f) for d, _, fs in _walk(path) for f in fs
                                       if f not in NOT_DATA and not f.startswith(".")
                                       and not hidden(os.path.relpath(d, path))), flag)  # a snapshot's .cache/ too
        # inside the folder the loader's files stay its own (a source tree's package.json is code, not rows): only
        # JSONL and Parquet files are read as such
        rows = tuple(e for e in JSONL_EXT if e != ".json" and not e.startswith(".json.")) + PARQUET_EXT
        return [u for f in files for u in (_units(name or _stem(path), f, None, flag) if f.lower().endswith(rows)
                                           else [Unit(name or _stem(path), f"hf_load:{loader}", f)])]
    if is_hf_folder(path):
        return [Unit(name or _stem(path), "hf_disk", path)]
    if os.path.isfile(path):
        files = [path]
    else:
        files = _folder(path, flag)
        if not files:
            raise ValueError(f"{flag} {spec}: folder has no .jsonl, .ndjson, .json or .parquet files" + (
                " (or use --loader for other formats datasets.load_dataset reads)" if flag == "--input" else ""))
        files = one_split(path, files, flag)
    units = []
    for f in files:
        if os.path.isdir(f):  # a save_to_disk folder inside the folder: a unit of the folder's source
            kind = "hf_disk"
        elif f.lower().endswith(PARQUET_EXT):
            kind = "parquet"
        elif f.lower().endswith(JSONL_EXT):
            try:
                with open_file(f) as fh:  # one array of rows (Alpaca's, LLaMA-Factory's files), or a row per line
                    kind = "json_array" if starts_array(fh) else "jsonl"
            except _unreadable() as e:
                raise damaged(f, e) from None
        else:
            raise ValueError(f"{flag} {f}: unknown format; expected .jsonl / .ndjson / .json (plain, .gz, .zst, .bz2, "
                             ".xz), .parquet, a datasets save_to_disk folder, or --loader BUILDER for "
                             "datasets.load_dataset")
        units.append(Unit(name or _stem(path), kind, f))  # a folder's files are one source: the folder's name
    return units


def damaged(path: str, e: BaseException) -> ValueError:
    """One line for a file that cannot be read to its end: a truncated .gz / .zst (a download cut short), a file named
    .gz that is not gzip, a datasets folder missing its .arrow files."""
    return ValueError(f"{path}: cannot be read ({cause(e)}): a truncated or damaged file? Fetch it again")


def _unreadable() -> tuple[type, ...]:
    from lzma import LZMAError

    try:
        from zstandard import ZstdError
    except ImportError:
        return OSError, EOFError, LZMAError
    return OSError, EOFError, LZMAError, ZstdError


def iter_rows(unit: Unit, fields: Fields, start: int = 0, batch_rows: int = 1024) -> Iterator[tuple[int, object]]:
    """`(row, item)` from row `start` on; item: raw JSON bytes, or `(value, source)` with value a str, a
    list of ints, or None (a bad row: missing/null field). A file that cannot be read to its end: one line."""
    try:
        yield from _rows(unit, fields, start, batch_rows)
    except _unreadable() as e:
        raise damaged(unit.path, e) from None


def _rows(unit: Unit, fields: Fields, start: int, batch_rows: int) -> Iterator[tuple[int, object]]:
    if unit.kind == "jsonl":
        with open_file(unit.path) as fh:
            for row, line in enumerate(fh):
                if row >= start and line.strip():
                    yield row, line
        return
    if unit.kind == "json_array":
        with open_file(unit.path) as fh:
            try:
                for row, element in enumerate(array_elements(fh)):
                    if row >= start:
                        yield row, element
            except ValueError as e:  # a malformed array: nothing after it can be read (no line to skip to)
                raise ValueError(f"{unit.path}: {e}") from None
        return
    if unit.kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(unit.path, buffer_size=8 << 20, pre_buffer=False)  # column chunks read 8 MB at a time
        cols = _columns(unit, pf.schema_arrow.names, fields)
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
        cols = _columns(unit, ds.column_names, fields)
        ds = ds.select_columns(_flat(cols))
        if start:
            ds = ds.select(range(start, len(ds)))
    else:
        builder = unit.kind.split(":", 1)[1]
        # `text`: a file is one document (a book, a source file), as a long-context corpus means it; datasets'
        # default, a document a line, cut a book into line-long documents, each with its BOS and EOS
        extra = {"sample_by": "document"} if builder == "text" else {}
        if extra and os.path.getsize(unit.path) > TEXT_DOC_MAX:  # read whole by datasets: one file, one document
            raise ValueError(f"{unit.path}: {os.path.getsize(unit.path) / 2**30:.1f} GiB read as one document "
                             "(--loader text: a file is a document): split it into documents, or give JSONL with "
                             "one document a row")
        try:  # an unknown builder is a hub lookup offline (ConnectionError), a file it cannot parse its own error
            ds = datasets.load_dataset(builder, data_files=[unit.path], split="train", streaming=True, **extra)
            names = list(ds.column_names or []) or list(next(iter(ds)).keys())
        except Exception as e:  # noqa: BLE001 (a user's --loader / file: one line, not datasets' traceback)
            raise ValueError(f"--loader {builder}: datasets.load_dataset could not read {unit.path} "
                             f"({cause(e)}): use a builder "
                             "it has (csv, json, text, parquet, arrow, ...)") from None
        cols = _columns(unit, names, fields)
        if start:
            ds = ds.skip(start)
    row = start
    for batch in ds.iter(batch_size=batch_rows):
        yield from _columnar(batch, cols, row, start)
        row += len(next(iter(batch.values())))


CHAT_COLUMNS = (("messages",), ("conversations",), ("prompt", "completion"), ("instruction", "output"))  # data/chat.py's
# row formats
CHAT_EXTRAS = ("tools", "system", "system_prompt", "input", "history", "chat_template_kwargs", "label", "functions",
               "images", "image", "videos", "audios") + UNREAD  # carried with a chat row when the table has them
# (data/chat_tools.py reads the tools, data/chat_rows.py the system prompt, an Alpaca row's input and history, and
# refuses a KTO row's label, a legacy functions list, a filled media column (chat_rows.MEDIA: a text-only trainer; a
# media column's bytes are read only as far as the first filled row, which refuses the preparation) and a context or
# reply it does not read (chat_rows.UNREAD: ChatQA's document, answers); data/chat_template.py the template's arguments)


TEXT_BESIDE = "text\x00"  # marks a table's text column carried beside its chat columns (not a column name)


def _columns(unit: Unit, names: list[str], fields: Fields) -> tuple[str | tuple[str, ...], str | None, tuple[str, ...]]:
    """(the value column, or a chat format's columns; the source column or None; the columns read beside its ids:
    data/ids_rows.py). A table with both a text column and
    chat columns (pandas' to_parquet of mixed text and chat rows: each row fills one, the other null) carries both:
    each row is the one it fills; a row filling both is a bad row (which is meant?)."""
    value = fields.text if fields.text in names else fields.ids if fields.ids in names else None
    # every chat format's columns the table has, each row read as the one it fills (row_format), as JSONL's rows are: a
    # table mixing formats (pandas' to_parquet of tulu, Alpaca and ShareGPT rows) had only the first format's read, the
    # other rows refused as "not a chat row"
    chat = tuple(dict.fromkeys(n for c in CHAT_COLUMNS if all(n in names for n in c) for n in c)) or None
    if chat is not None:
        value = chat + tuple(c for c in CHAT_EXTRAS if c in names and c not in chat) + (
            (TEXT_BESIDE + value,) if value else ())
    # labels, TRL's loss masks and packing columns beside the ids: carried with each row, checked in the workers
    beside = tuple(c for c in BESIDE_IDS if c in names) if value == fields.ids and chat is None else ()
    if value is None:
        raise ValueError(f"{unit.path}: no column {fields.text!r} (--text_field), {fields.ids!r} (--ids_field), "
                         f"messages, conversations, prompt + completion or instruction + output (chat); columns are {names}")
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
    if isinstance(item, bytes):
        try:
            obj = json.loads(item)
        except ValueError as e:
            return None, None, f"not valid JSON ({getattr(e, 'msg', e)}); each line must be one JSON object"
        if not isinstance(obj, dict):
            return None, None, f"expected a JSON object, got {type(obj).__name__}"
        value = obj.get(fields.text, obj.get(fields.ids))
        if isinstance(value, dict) and not row_format(value):  # was read as a chat row: "chat row: not a chat row"
            return None, None, f"expected a string in {fields.text!r}{elsewhere(fields, obj)}"
        if value is not None and row_format(obj):
            return None, None, both(fields, obj)
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
    return None, None, (f"expected a string in {fields.text!r} or non-negative ints in {fields.ids!r}, got "
                        f"{type(value).__name__}")
