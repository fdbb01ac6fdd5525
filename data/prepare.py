"""The in-job path: a small `--dataset_path` (the demo, tests; any input scripts/prepare_data.py reads: JSONL, a JSON
array, Parquet, a `save_to_disk` folder, a folder of them) prepared inside the training job.

Rank 0 runs the same preparation as `scripts/prepare_data.py` (one process, no workers) into the data cache
while the others wait on the host (`base.comm.run_on_main`: a gloo group with a long timeout, never an
NCCL collective whose watchdog would kill the job); an error found on rank 0 reaches every rank as the same
one-line message before the model is built. Every rank then memory-maps the prepared folder itself (the
cache must be on a file system all nodes see). Whether `--dataset_path` is already prepared is rank 0's
answer too: a node with a stale view of the folder would otherwise take the other branch and its own
collectives. Inputs above `MAX_IN_JOB_BYTES` are refused: a real corpus is
prepared once, before the job, with `scripts/prepare_data.py --workers N`, and passed by its folder.
"""

from __future__ import annotations

import os
import shutil

from base import comm
from data.corpus import CACHE, build_demo_corpus
from data.packing import build_token_stream, cache_key
from data.readers import discover
from data.store import is_prepared
from data.tokenizer import Tokenizer

MAX_IN_JOB_BYTES = 200 * 1024 * 1024


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


def prepare_in_job(dataset_path: str | None, tokenizer_path: str | None, model_vocab: int,
                   model_path: str | None = None) -> tuple[str, str | None]:
    """(prepared folder, tokenizer path), decided by rank 0 (collective: every rank calls it): a prepared folder
    as it is, else the small JSONL input prepared by rank 0 into the cache, with --tokenizer_name_or_path, else the
    model folder's own tokenizer (as transformers and TRL default to it; before, text rows were refused as needing
    a tokenizer)."""

    def work() -> tuple[str, str | None]:
        from data.prepare_data import SKIP_FIX, prepare

        if is_prepared(dataset_path):
            return dataset_path, tokenizer_path

        fallback = model_tokenizer(model_path) if dataset_path is not None and tokenizer_path is None else None
        data, tok_path = resolve_sources(dataset_path, tokenizer_path or fallback)
        units = discover(data, flag="--dataset_path")  # what prepare_data reads there: .jsonl[.gz|.zst], .json
        # arrays, Parquet, a save_to_disk folder (only .jsonl / .json were read: the rest dropped without a word)
        files = [f for u in units for f in u.files()]  # the cache key's: every file read
        size = sum(os.path.getsize(f) for f in files)
        if size > MAX_IN_JOB_BYTES:
            raise ValueError(f"--dataset_path {data}: {size / 2**20:.0f} MB of input is too much to tokenize inside "
                             f"the job (limit {MAX_IN_JOB_BYTES >> 20} MB): run `python scripts/prepare_data.py "
                             f"--input {data} --output DIR --workers N` once and pass --dataset_path DIR")
        out = os.path.join(CACHE, "prepared", cache_key(files, tok_path, model_vocab))
        if not is_prepared(out):  # into a private folder renamed into place: concurrent jobs never share one
            tmp = f"{out}.tmp{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            # ids bound by the tokenizer named (or the demo's), else by the model: the model's own tokenizer taken by
            # default does not narrow what pre-tokenized rows may hold
            try:
                prepare([u.path for u in units], tmp, tok_path, workers=0, log=lambda _: None,
                        vocab_size=model_vocab if tok_path in (None, fallback) else None)
            except ValueError as e:  # a bad row: prepare_data's fix (--skip_bad_rows) is no flag of train.py's
                if not str(e).endswith(SKIP_FIX):
                    raise
                how = f"--tokenizer_name_or_path {tok_path}" if tok_path else f"--vocab_size {model_vocab}"
                raise ValueError(f"{str(e).removesuffix(SKIP_FIX)}(to skip and count such rows: python "
                                 f"scripts/prepare_data.py --input {data} --output DIR {how} --skip_bad_rows, then "
                                 "pass --dataset_path DIR)") from None
            try:
                os.rename(tmp, out)
            except OSError:  # another job finished first
                shutil.rmtree(tmp, ignore_errors=True)
        return out, tok_path

    return comm.run_on_main(work)


def prepare_token_stream(dataset_path: str | None, tokenizer_path: str | None, model_vocab: int,
                         is_main: bool = True) -> tuple[str, str, Tokenizer | None]:
    """Paths of a cached .npy token stream + doc starts, and the tokenizer (None for pre-tokenized data): the
    older single-file form, kept for tools and tests that read the whole demo stream at once."""

    def tokenize() -> tuple[str | None, str, str]:
        data, tok_path = resolve_sources(dataset_path, tokenizer_path)
        tok = Tokenizer(tok_path) if tok_path else None
        return (tok_path, *build_token_stream(data, tok, model_vocab, os.path.join(CACHE, "tokens")))

    tok_path, tokens, starts = comm.run_on_main(tokenize)
    return tokens, starts, (Tokenizer(tok_path) if tok_path else None)
