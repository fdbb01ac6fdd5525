"""The in-job path: a small `--dataset_path` (the demo, tests; any input scripts/prepare_data.py reads: JSONL, a JSON
array, Parquet, a `save_to_disk` folder, a folder of them) prepared inside the training job.

Rank 0 runs the same preparation as `scripts/prepare_data.py` (one process, no workers) into the data cache
while the others wait on the host (`base.comm.run_on_main`: a gloo group with a long timeout, never an
NCCL collective whose watchdog would kill the job); an error found on rank 0 reaches every rank as the same
one-line message before the model is built. Every rank then memory-maps the prepared folder itself (the
cache must be on a file system all nodes see). Whether `--dataset_path` is already prepared is rank 0's
answer too: a node with a stale view of the folder would otherwise take the other branch and its own
collectives. Inputs above `MAX_IN_JOB_BYTES` decompressed (`input_bytes`) are refused: a real corpus
is prepared once, before the job, with `scripts/prepare_data.py`, and passed by its folder.
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
import shlex
import shutil
import time

from base import comm
from base.atomic import named, tmp_name
from base.log import print0
from data import output_lock
from data.corpus import CACHE, build_demo_corpus
from data.discover import discover, stem
from data.packing import build_token_stream, cache_key, vocab_refusal
from data.store import is_prepared
from data.tokenizer import Tokenizer

MAX_IN_JOB_BYTES = 200 * 1024 * 1024  # of decompressed input (estimated: input_bytes)
FULL_HASH_BYTES = 4 * MAX_IN_JOB_BYTES  # stored bytes up to which the in-job key hashes every byte (content_identity)
# A compressed file's stored bytes understate what rank 0 tokenizes while every GPU waits (a 200 MB .jsonl.gz holds
# ~700 MB of JSONL). Where a file states its decompressed size it is read from a few bytes: gzip's ISIZE trailer (exact
# for one member under 4 GiB, what gzip writes), a zstd frame's content size (zstd's CLI writes it). Else (.bz2, .xz, a
# zstd stream of unknown size, a gzip trailer below the stored size: bgzip's members, past 4 GiB) and for Parquet (its
# footer's "uncompressed" bytes are after dictionary encoding: repeated rows count once; taken where larger) RATIO times
# the stored bytes: text compresses ~2-7x (Parquet's snappy ~2x, gzip ~3-4x, zstd / xz ~4-7x), so 10x overstates rather
# than understates, and an overstatement only sends a corpus to scripts/prepare_data.py sooner.
RATIO = 10
PARQUET_RATIO = 2  # Parquet states its own sizes: at least snappy's ~2x (tatsu-lab/alpaca: 24.5 MB stored, ~48 MB)
# A private folder left by a job killed mid-preparation (SIGKILL, a SIGTERM before the preemption handler, a node lost:
# a failure removes its own) is removed by a later job using the same input, prepared or not by then, once no process
# holds its lock (data/output_lock.py) and nothing in it changed for STALE_S; where the file system cannot lock, by
# age alone (a live preparation appends to its chunk file every batch, ~1 s of work). Never "every folder but mine":
# another job preparing the same input now keeps its own. Not adopted and resumed: two requeued jobs could pick one
# folder (the second refused as "being written by another process"), and a lock only this node sees (NFS
# local_lock, Lustre localflock) cannot tell a live one on another node.
STALE_S = 3600.0


def resolve_sources(dataset_path: str | None, tokenizer_path: str | None) -> tuple[str, str | None]:
    """(dataset, tokenizer); None dataset means the built-in demo corpus and its tokenizer."""
    if dataset_path is None:
        jsonl, model = build_demo_corpus()
        return jsonl, tokenizer_path or model
    return dataset_path, tokenizer_path


def ships_tokenizer(model_path: str | None) -> bool:
    """Whether the model folder holds a tokenizer's files (a HF model repo's tokenizer.json / tokenizer.model)."""
    return bool(model_path and os.path.isdir(model_path) and any(
        os.path.isfile(os.path.join(model_path, f)) for f in ("tokenizer.json", "tokenizer.model")))


def model_tokenizer(model_path: str | None) -> str | None:
    """The model folder itself where it ships a tokenizer that loads, else None (a tiktoken-format tokenizer.model,
    say: nothing is read from it)."""
    if not ships_tokenizer(model_path):
        return None
    try:
        Tokenizer(model_path)
    except ValueError:
        return None
    return model_path


def input_bytes(path: str) -> int:
    """The decompressed size of one input file, or an upper estimate of it (RATIO)."""
    stored, low = os.path.getsize(path), path.lower()
    try:
        if low.endswith(".parquet"):
            import pyarrow.parquet as pq

            meta = pq.ParquetFile(path).metadata  # its columns' uncompressed bytes, at least PARQUET_RATIO x stored
            # (dictionary pages count repeated values once); RATIO over it refused an Alpaca-sized set (a review)
            return max(stored * PARQUET_RATIO, sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups)))
        if low.endswith((".gz", ".gzip")):
            with open(path, "rb") as fh:
                fh.seek(-4, os.SEEK_END)
                size = int.from_bytes(fh.read(4), "little")
        elif low.endswith((".zst", ".zstd")):
            import zstandard

            with open(path, "rb") as fh:
                size = zstandard.frame_content_size(fh.read(18))  # -1: not stated
        elif not low.endswith((".bz2", ".xz")):
            return stored
        else:
            size = -1
    except Exception:  # noqa: BLE001 (a damaged file: estimated here, refused in one line when read)
        size = -1
    return size if size >= stored else stored * RATIO


def content_identity(units: list) -> list[str]:
    """Each unit's in-job key part: kind:source/file name:size:a hash of all its bytes (Unit.identity's first and last
    64 KiB keyed a same-size edit inside a file, one answer's `003000` -> `003001`, as the old input: its tokens were
    reused without a word). Its name and content only: a re-staged copy is the same input. Cost: one read of the
    input, ~0.2-0.5 s per 200 MB (the in-job limit) on rank 0, once per start; an input over FULL_HASH_BYTES stored
    (over the limit: refused unless prepared already or resumed) keeps Unit.identity's sample."""
    if sum(os.path.getsize(f) for u in units for f in u.files()) > FULL_HASH_BYTES:
        return [u.identity() for u in units]
    keys = []
    for u in units:
        digest, size = hashlib.sha256(), 0
        for f in u.files():
            with open(f, "rb") as fh:
                while chunk := fh.read(1 << 20):
                    digest.update(chunk)
                    size += len(chunk)
        keys.append(f"{u.kind}:{u.name}/{os.path.basename(u.path)}:{size}:all:{digest.hexdigest()[:16]}")
    return keys


def prepare_in_job(dataset_path: str | None, tokenizer_path: str | None, model_vocab: int,
                   model_path: str | None = None, resumed: bool = False,
                   first: str | None = None) -> tuple[str, str | None]:
    """(prepared folder, tokenizer path), decided by rank 0 (collective: every rank calls it): a prepared folder
    as it is, else the small JSONL input prepared by rank 0 into the cache, with --tokenizer_name_or_path, else the
    model folder's own tokenizer (as transformers and TRL default to it; before, text rows were refused as needing
    a tokenizer)."""

    def work() -> tuple[str, str | None]:
        from data.prepare_data import SKIP_FIX, prepare

        if is_prepared(dataset_path):
            said_again(dataset_path)
            return dataset_path, tokenizer_path

        fallback = model_tokenizer(model_path) if dataset_path is not None and tokenizer_path is None else None
        if fallback is not None and (fb := Tokenizer(fallback)).vocab_size > model_vocab:  # tokens added after the
            raise ValueError(vocab_refusal(fb, model_vocab))  # model's save: one line here, not a bad row's error each
        data, tok_path = resolve_sources(dataset_path, tokenizer_path or fallback)
        units = discover(data, flag="--dataset_path")  # what prepare_data reads there: .jsonl[.gz|.zst], .json
        # arrays, Parquet, a save_to_disk folder (only .jsonl / .json were read: the rest dropped without a word)
        files = [f for u in units for f in u.files()]  # every file read
        # the tokenizer this run would use (scripts/prepare_data.py takes none by default: its command names it)
        how = f"--tokenizer_name_or_path {shlex.quote(tok_path)}" if tok_path else f"--vocab_size {model_vocab}"
        # keyed by the units' content (`content_identity`: name, size, a hash of every byte): by path and mtime, an
        # input re-staged to node-local scratch at each requeue (/tmp/slurm-$JOBID/..., a `cp` without -p) was
        # prepared again into another folder while every GPU waited, and the old one was kept. A folder keyed by an
        # earlier rule is prepared once more after the upgrade (data/pipeline.py's resume note says it holds the same
        # tokens)
        # the units' source names join the key where they are not each file's own (a folder's files are one source
        # named after it, `books=DIR`'s and a pattern's too, as prepare_data names them): before, each file was
        # prepared as its own source (`a`, `b` where prepare_data wrote `corpus`), and such a folder keyed without the
        # mark holds those names: prepared again once, into a folder of its own, never mixed with it. A resumed run
        # that trained on that folder keeps it (its sources, its data order: exact resume across the upgrade): the
        # folder its first start recorded (`first`, the split record's), or, recorded none (a checkpoint from before
        # the record), the old folder where it is still there; a run started since keeps the new one at its requeues
        keys = content_identity(units)
        out = os.path.join(CACHE, "prepared", cache_key(keys, tok_path, model_vocab))
        ran_on_old = resumed and is_prepared(out) and (first is None or os.path.basename(os.path.normpath(first)) ==
                                                       os.path.basename(out))
        if any(u.name != stem(u.path) for u in units) and not ran_on_old:
            out = os.path.join(CACHE, "prepared", cache_key(keys + ["sources:as-given"], tok_path, model_vocab))
        size = sum(input_bytes(f) for f in files)  # a stat a file, and <= 18 bytes or a Parquet footer read
        holder = data if os.path.exists(data) or "/" in data.partition("=")[0] else data.partition("=")[2]
        if os.path.isdir(holder) and os.path.commonpath([os.path.realpath(CACHE), real := os.path.realpath(holder)]) \
                == real and not is_prepared(out):  # (prepare_data refuses an --output inside its --input)
            raise ValueError(f"--dataset_path {data}: the data cache {CACHE} lies inside it: set ULYSSES_CACHE to a "
                             "folder outside it (its prepared folders are no rows of the input)")
        # one prepared already is used, and a resumed run's input is prepared again, whatever the limit (a run that
        # started under an earlier estimate, or cache key, must not end at its requeue on today's)
        if size > MAX_IN_JOB_BYTES and not resumed and not is_prepared(out):
            raise ValueError(f"--dataset_path {data}: {size / 2**20:.0f} MB of input (decompressed, or estimated at "
                             f"{RATIO}x a compressed file of unstated size) is too much to "
                             f"tokenize inside the job (limit {MAX_IN_JOB_BYTES >> 20} MB): run `python "
                             f"scripts/prepare_data.py --input {shlex.quote(data)} --output DIR {how}` once and pass "
                             "--dataset_path DIR")
        # a killed preparation's folder goes once STALE_S old, whether or not `out` is prepared since: a SIGTERM before
        # the preemption handler leaves one, and its requeue ~2 min later (still young) prepares `out` itself, after
        # which this line was never reached again and the folder stayed for good. Cost: one listing of the cache
        remove_stale(out)
        if is_prepared(out):
            said_again(out)
        else:  # into a private folder renamed into place: concurrent jobs never share one
            os.makedirs(os.path.dirname(out), exist_ok=True)
            # host, pid and random (a pid alone: two jobs' rank 0s in containers on one cache volume share it, and
            # removed and wrote each other's folder); a plain mkdir, as mkdtemp's mode 0700 would keep the cache's
            # other users out of the folder once renamed into place
            tmp = tmp_name(out)
            os.mkdir(tmp)

            def log(line: str) -> None:  # prepare_data's summary, notes and warnings (no stop token trained, the
                print0(line.replace(tmp, out))  # ChatML default...): said on rank 0, naming the folder trained on
            # ids bound by the tokenizer named (or the demo's), else by the model: the model's own tokenizer taken by
            # default does not narrow what pre-tokenized rows may hold
            try:  # the input as given (a folder, `name=PATH`, a pattern): the sources prepare_data names
                prepare([data], tmp, tok_path, workers=0, log=log,
                        vocab_size=model_vocab if tok_path in (None, fallback) else None)
            except BaseException as e:  # a full disk, a bad row, an interrupt: no <key>.tmp.* of ours left for good
                if isinstance(e, OSError):  # a full disk's write names no file: name the folder; a short write
                    named(e, tmp)  # without errno (numpy's) on a disk left with no block: ENOSPC, seen before the
                    # rmtree frees what filled it
                shutil.rmtree(tmp, ignore_errors=True)  # (a requeue's is another name: only remove_stale would)
                if not isinstance(e, ValueError):
                    raise
                # a bad row: prepare_data's fixes (--skip_bad_rows, --text_field) are not train.py's
                msg = str(e)
                field = re.search(r"--text_field (\S+)$", msg.rstrip())  # the text under another name (The Stack's
                if field:  # `content`): prepare_data names the field and no skip (skipping would drop every row)
                    raise ValueError(f"{msg.rstrip()} (python scripts/prepare_data.py --input {shlex.quote(data)} "
                                     f"--output DIR {how} {field[0]}, then pass --dataset_path DIR)") from None
                if not msg.endswith(SKIP_FIX):
                    raise
                raise ValueError(f"{msg.removesuffix(SKIP_FIX)}(to skip and count such rows: python "
                                 f"scripts/prepare_data.py --input {shlex.quote(data)} --output DIR {how} "
                                 "--skip_bad_rows, then pass --dataset_path DIR)") from None
            try:
                os.rename(tmp, out)
            except OSError:  # another job finished first
                shutil.rmtree(tmp, ignore_errors=True)
        return out, tok_path

    return comm.run_on_main(work, long=True)  # an in-job preparation: hours at scale


def said_again(folder: str) -> None:
    """A prepared folder's warnings (data/prepare_summary: no stop token trained, ...) said again on rank 0 at each
    start that reuses it: they were said once, by its preparation, often in another job's log. Cost: one manifest
    read (its chunk list: ~100 bytes a chunk)."""
    from data.prepare_summary import manifest_warnings
    from data.store import MANIFEST, read_json

    for line in manifest_warnings(folder, read_json(os.path.join(folder, MANIFEST))):
        print0(line)


def remove_stale(out: str) -> None:
    """Remove the `<out>.tmp*` folders of killed preparations (STALE_S): one stat per entry of each such folder."""
    for p in glob.glob(glob.escape(out) + ".tmp*"):
        try:
            newest = max([os.stat(p).st_mtime] + [e.stat().st_mtime for e in os.scandir(p)])
        except OSError:  # gone meanwhile (another job removed it, or it was renamed into place)
            continue
        if time.time() - newest > STALE_S and not output_lock.is_held(p):
            shutil.rmtree(p, ignore_errors=True)


def prepare_token_stream(dataset_path: str | None, tokenizer_path: str | None, model_vocab: int,
                         is_main: bool = True) -> tuple[str, str, Tokenizer | None]:
    """Paths of a cached .npy token stream + doc starts, and the tokenizer (None for pre-tokenized data): the
    older single-file form, kept for tools and tests that read the whole demo stream at once."""

    def tokenize() -> tuple[str | None, str, str]:
        data, tok_path = resolve_sources(dataset_path, tokenizer_path)
        tok = Tokenizer(tok_path) if tok_path else None
        return (tok_path, *build_token_stream(data, tok, model_vocab, os.path.join(CACHE, "tokens")))

    tok_path, tokens, starts = comm.run_on_main(tokenize, long=True)
    return tokens, starts, (Tokenizer(tok_path) if tok_path else None)
