"""The inputs of one `--input` value (train.py's `--dataset_path`) for `prepare_data`: `[name=]PATH`, PATH a JSONL /
JSON / Parquet file, a glob, a folder of them, a Hugging Face `datasets` folder (`save_to_disk`) or local data files
through `--loader BUILDER`, as a list of `Unit`s (one file, or one datasets folder) that data/readers.py reads row by
row. A folder's hidden files, metadata (README.md, dataset_info.json, ...: jsonl.NOT_DATA), a run's or a preparation's
output folder inside it are no data; files that look like data but that nothing here reads are refused by name, never
dropped without a word. Split out of data/readers.py.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

from base.log import cause, print0
from base.run_lock import LOCK
from data import output_lock
from data.jsonl import COMPRESSED, NOT_DATA, hidden, matching, one_split, open_file, starts_array
from data.store import FORMAT, MANIFEST

JSONL_EXT = tuple(b + c for b in (".jsonl", ".json", ".ndjson") for c in COMPRESSED)  # matched in lower case
PARQUET_EXT = (".parquet",)
# a folder's files that look like data but that nothing here reads: refused by name, never dropped without a word
# (a .jsonl.lz4 or .zip of a corpus, datasets' cache-*.arrow files, a .csv beside the JSONL)
OTHER_DATA = (".arrow", ".zip", ".tar", ".tgz", ".7z", ".rar", ".lz4", ".gz", ".zst", ".zstd", ".bz2", ".xz", ".csv",
              ".tsv", ".feather", ".avro", ".orc", ".mds")  # .mds: Mosaic streaming's shards (_mds)
# raw text documents (`.txt.gz`: OTHER_DATA's) beside JSONL / Parquet, refused by name (they were dropped without a word;
# a folder of only these: "no .jsonl ... (or use --loader)"); a snapshot's LICENSE.txt, CITATION.md, ... are no documents
TEXT_DOCS = (".txt", ".md", ".tex", ".html", ".htm")
DOC_META = {"readme", "license", "licence", "copying", "notice", "citation", "changelog", "changes", "authors",
            "requirements", "contributing", "code_of_conduct", "datasheet", "dataset_card", "terms", "terms_of_use",
            "security", "acknowledgements", "acknowledgments", "sha256sums", "sha1sums", "md5sums", "checksums"}


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


def stem(path: str) -> str:
    """A file's or folder's source name: its name without its data extensions (`web.jsonl.zst` -> `web`)."""
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
    the input (`_folder`'s walk; --loader's too). A link to a folder is followed (`corpus/books -> /shared/books`, a
    linked save_to_disk folder: dropped without a word), each real folder walked once: a link back to a folder above
    it (a loop) or to one already walked is skipped, said once. Cost: a realpath per subfolder."""
    seen = {os.path.realpath(root)}
    for d, dirs, fs in os.walk(root, followlinks=True):
        keep = []
        for x in sorted(x for x in dirs if not x.startswith(".")):
            real = os.path.realpath(os.path.join(d, x))
            if real not in seen:
                seen.add(real)
                keep.append(x)
            elif flag and (link := os.path.join(d, x)) not in _SKIPPED:
                _SKIPPED.add(link)
                print0(f"{flag} {root}: skipping {os.path.relpath(link, root)}/: it is {real}, a folder read "
                       "already under another name (a link; each folder is read once)")
        dirs[:] = keep
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
    repo = os.path.dirname(os.path.normpath(path))
    if os.path.basename(os.path.normpath(path)) == "snapshots" and os.path.isdir(os.path.join(repo, "refs")):
        _one_snapshot(repo, path, flag)  # the cache's snapshots/ folder itself
    for d, dirs, fs in _walk(path, flag):
        if d != path and is_hf_folder(d):
            files.append(d)
            dirs[:] = []
            continue
        _mds(d, fs, path, flag)
        if {"snapshots", "refs"} <= set(dirs):  # a Hugging Face cache's repo folder: its snapshots, not its blobs
            _one_snapshot(d, path, flag)
            dirs[:] = ["snapshots"]
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


def _no_cache_files(path: str, files: list[str], flag: str) -> None:
    """ValueError naming a datasets cache folder's `cache-<fingerprint>.arrow` files under --loader (a map's or a
    filter's results, each a transformed copy of the split beside them: `--loader arrow` on the folder read every row
    twice); without --loader every .arrow is refused by name (OTHER_DATA). A pattern naming them reads them."""
    cache = sorted(os.path.relpath(f, path) for f in files if fnmatch.fnmatch(os.path.basename(f), "cache-*.arrow"))
    if cache:
        own = [os.path.relpath(f, path) for f in files if os.path.relpath(f, path) not in cache]
        raise ValueError(f"{flag} {path}: {cache[0]}" + (f" and {len(cache) - 1} more" if len(cache) > 1 else "")
                         + (" are datasets' cache files" if len(cache) > 1 else " is a datasets cache file")
                         + " (a map's or filter's results: a copy of the split's rows): read beside the split's own "
                         "file, every row would be read twice; give the files meant, e.g. "
                         f"{flag} {os.path.join(path, own[0] if own else cache[0])}")


def _paper(rel: str) -> bool:
    """A dataset snapshot's own papers, not documents: README.md, README_zh.md, LICENSE-CODE.md, SHA256SUMS.txt (a
    DOC_META name, alone or before `_` / `-`), anything under a docs/ folder."""
    parts = rel.lower().split(os.sep)
    first = parts[-1].split(".")[0]
    return bool({"docs", "doc"} & set(parts[:-1])) or any(first == m or first.startswith((m + "_", m + "-"))
                                                           for m in DOC_META)


def _mds(d: str, names: list[str], path: str, flag: str) -> None:
    """ValueError for a folder of Mosaic streaming (MDS) shards (princeton-nlp/prolong-data: index.json and
    shard.00000.mds[.zstd]): its index.json was read as a row, the shards ignored (with --skip_bad_rows: gone)."""
    shards = sorted(f for f in names if ".mds" in f.lower())
    if "index.json" in names and shards:
        raise ValueError(f"{flag} {path}: {d} holds Mosaic streaming (MDS) shards (index.json, {shards[0]}"
                         f"{', ...' * (len(shards) > 1)}), not read here: convert them to JSONL / Parquet")


def _one_snapshot(d: str, path: str, flag: str) -> None:
    """ValueError for a Hugging Face cache's repo folder (`datasets--ORG--NAME/`: blobs/, refs/main, snapshots/<sha>/)
    holding several snapshots (a re-download of a newer revision keeps the older one, its files links to the same
    blobs): every snapshot was read, every row twice. Named, as several splits are: the one refs/main names."""
    snaps = sorted(x for x in os.listdir(os.path.join(d, "snapshots")) if not x.startswith("."))
    if len(snaps) < 2:
        return
    main = _head(os.path.join(d, "refs", "main")).strip()
    pick = os.path.join(d, "snapshots", main if main in snaps else snaps[-1])
    raise ValueError(f"{flag} {path}: {'it' if d == path else d} is a Hugging Face cache folder of {len(snaps)} "
                     f"snapshots (revisions), each read, every row {len(snaps)} times: give one snapshot, e.g. {flag} "
                     f"{pick}" + (" (refs/main's)" if main in snaps else ""))


def _one_each(path: str, files: list[str], flag: str) -> None:
    """ValueError naming two files of one input that are one file (links to it: a Hugging Face cache's snapshots, its
    blobs stored once): both were read, every row twice. Cost: an lstat per file, a realpath per folder and link."""
    real: dict[str, str] = {}
    folders: dict[str, str] = {}
    for f in sorted(files):
        d = os.path.dirname(f)
        if d not in folders:
            folders[d] = os.path.realpath(d)
        r = os.path.realpath(f) if os.path.islink(f) else os.path.join(folders[d], os.path.basename(f))
        if r in real:
            raise ValueError(f"{flag} {path}: {real[r]} and {f} are one file (links to {r}): both would be read, every "
                             "row twice; give one of them")
        real[r] = f


def _no_copies(path: str, files: list[str], flag: str) -> None:
    """ValueError naming a file beside its compressed copy (`web.jsonl`, `web.jsonl.gz`: gunzip -k), or a link to
    another (_one_each): both were read."""
    _one_each(path, files, flag)
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
        _one_each(path, pattern, flag)
        name = name or stem(path.split("*")[0].rstrip("-_."))
        return [u for f in pattern for u in _units(name, f, loader, flag)]
    if not os.path.exists(path):
        raise ValueError(f"{flag} {spec}: no such file or folder")
    output_lock.unfinished(path, flag)  # a preparation's own folder, preempted before its manifest: no rows to read
    # JSONL / Parquet read as such whatever --loader says (`--loader text` made a chat JSONL given beside a .txt folder
    # one raw-text document of JSON syntax, every token trained)
    if loader and not is_hf_folder(path) and not (os.path.isfile(path) and native(path)):
        if os.path.isfile(path):
            return [Unit(name or stem(path), f"hf_load:{loader}", path)]
        # a folder's files as the other formats' (no metadata, one split), one source named after it
        files = one_split(path, sorted(os.path.join(d, f) for d, _, fs in _walk(path) for f in fs
                                       if f not in NOT_DATA and not f.startswith(".")
                                       and not hidden(os.path.relpath(d, path))), flag)  # a snapshot's .cache/ too
        _no_cache_files(path, files, flag)
        # inside the folder the loader's files stay its own (a source tree's package.json is code, not rows): only
        # JSONL and Parquet files are read as such
        rows = tuple(e for e in JSONL_EXT if e != ".json" and not e.startswith(".json.")) + PARQUET_EXT
        return [u for f in files for u in (_units(name or stem(path), f, None, flag) if f.lower().endswith(rows)
                                           else [Unit(name or stem(path), f"hf_load:{loader}", f)])]
    if is_hf_folder(path):
        return [Unit(name or stem(path), "hf_disk", path)]
    if os.path.isfile(path):
        _mds(os.path.dirname(path), os.listdir(os.path.dirname(path) or ".") if os.path.basename(path) == "index.json"
             else [], path, flag)
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
            except unreadable() as e:
                raise damaged(f, e) from None
            if lfs_pointer(f):  # its 3 lines were 3 bad rows ("not valid JSON"), skipped with --skip_bad_rows
                raise damaged(f, ValueError("a git-lfs pointer file"))
        else:
            raise ValueError(f"{flag} {f}: unknown format; expected .jsonl / .ndjson / .json (plain, .gz, .zst, .bz2, "
                             ".xz), .parquet, a datasets save_to_disk folder, or --loader BUILDER for "
                             "datasets.load_dataset")
        units.append(Unit(name or stem(path), kind, f))  # a folder's files are one source: the folder's name
    return units


LFS = b"version https://git-lfs"  # a git-lfs pointer's first bytes (a clone without `git lfs pull`: ~130 bytes each)


def lfs_pointer(path: str) -> bool:
    """Whether `path` is a file holding a git-lfs pointer, not the content it points to. Cost: one read of 23 bytes."""
    try:
        with open(path, "rb") as fh:
            return fh.read(len(LFS)) == LFS
    except OSError:  # a folder, a file gone: no pointer
        return False


def damaged(path: str, e: BaseException) -> ValueError:
    """One line for a file that cannot be read to its end: a truncated .gz / .zst / .parquet (a download cut short), a
    file named .gz that is not gzip, a datasets folder missing its .arrow files, a git-lfs pointer (a dataset repo
    cloned without `git lfs pull`)."""
    if lfs_pointer(path):
        return ValueError(f"{path}: cannot be read ({cause(e)}): a git-lfs pointer, not the file's content? Fetch it "
                          "with `git lfs pull` in its repository")
    return ValueError(f"{path}: cannot be read ({cause(e)}): a truncated or damaged file? Fetch it again")


def unreadable() -> tuple[type, ...]:
    from lzma import LZMAError

    try:
        from zstandard import ZstdError
    except ImportError:
        return OSError, EOFError, LZMAError
    return OSError, EOFError, LZMAError, ZstdError
