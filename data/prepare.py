"""Turning `--dataset_path` / `--tokenizer_name_or_path` into a cached token stream, once per run.

Rank 0 validates and tokenizes; the other ranks wait and read the cache. An error found on rank 0 is
sent to every rank so all of them stop with the same one-line message before the model is built.
"""

from __future__ import annotations

import os

import torch.distributed as dist

from data.corpus import CACHE, build_demo_corpus
from data.packing import build_token_stream
from data.tokenizer import Tokenizer


def resolve_sources(dataset_path: str | None, tokenizer_path: str | None) -> tuple[str, str | None]:
    """(dataset, tokenizer); None dataset means the built-in demo corpus and its tokenizer."""
    if dataset_path is None:
        jsonl, model = build_demo_corpus()
        return jsonl, tokenizer_path or model
    return dataset_path, tokenizer_path


def prepare_token_stream(dataset_path: str | None, tokenizer_path: str | None, model_vocab: int,
                         is_main: bool) -> tuple[str, str, Tokenizer | None]:
    """Paths of the cached token stream + doc starts, and the tokenizer (None for pre-tokenized data)."""
    result: list = [None, None]
    if is_main:
        try:
            data, tok_path = resolve_sources(dataset_path, tokenizer_path)
            tok = Tokenizer(tok_path) if tok_path else None
            result = [None, (data, tok_path, *build_token_stream(data, tok, model_vocab, os.path.join(CACHE, "tokens")))]
        except ValueError as e:
            result = [str(e), None]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(result, src=0)
    err, paths = result
    if err:
        raise ValueError(err)
    _, tok_path, tokens, starts = paths
    return tokens, starts, (Tokenizer(tok_path) if tok_path else None)
