"""scripts/prepare_data.py's command line (data/prepare_data.py runs it): the flags, their defaults."""

from __future__ import annotations

import argparse
import os

from base.host import usable_cpus

DEFAULT_CHUNK_TOKENS = 1 << 28  # 1 GiB of uint32 per chunk file: the resume granularity
DEFAULT_BATCH_DOCS = 256
# each worker holds its own tokenizer and the transformers import: ~0.5 GB with a 131k vocabulary (462 MB RSS
# measured); past 32, memory, not CPUs, bounds a job (a 128-CPU node's 127 workers were ~58 GB under srun -c 8
# --mem=32G): give --workers to go further
MAX_WORKERS = 32
# --text_specials: how special-token strings in a text document are read (data/tokenizer.py frame_texts), as the plan
# records it (a resume compares it: a preparation stopped under another reading, or under yesterday's refusal of a
# rendered conversation, "as text, a rendered conversation refused", starts again only with --overwrite). `text` is the
# reading before that refusal ("as text": same value, same ids), `parse` unchanged.
TEXT_SPECIALS = {"auto": "as text, a rendered conversation's as control tokens", "text": "as text",
                 "parse": "as control tokens"}


def specials_note(manifest: dict) -> list[str]:
    """The end-of-preparation notes on text documents holding special-token strings (data/prepare_data.py merge)."""
    notes, parsed = [], manifest.get("parsed_text_docs", 0)
    if parsed and manifest["text_specials"] == "auto":
        notes.append(f"note: {parsed} text document(s) start as a rendered conversation (<|im_start|>, "
                     "<|start_header_id|>, ...): read with their special-token strings as control tokens, as TRL and "
                     "tokenizer(text) read them; their loss is on every token: give `messages` rows to train only the "
                     "replies (docs/sft.md); --text_specials text keeps them as text")
    elif parsed:
        notes.append(f"note: {parsed} text document(s) hold a special-token string: read as control tokens "
                     "(--text_specials parse)")
    if manifest.get("special_text_docs"):
        notes.append(f"note: {manifest['special_text_docs']} text document(s) hold a special-token string (<s>, "
                     "<|endoftext|>, ...) kept as text, not as control tokens (docs/data.md)")
    return notes


def default_workers() -> int:
    """This process's CPUs (its affinity: SLURM's cgroup, taskset; not the node's; within its cgroup's CPU quota:
    docker --cpus, Kubernetes' CPU limit, base/host.py usable_cpus) minus the reading one, 1 to MAX_WORKERS."""
    return max(1, min(MAX_WORKERS, len(usable_cpus()) - 1))


def parser(description: str) -> argparse.ArgumentParser:
    """scripts/prepare_data.py's flags (data/prepare_data.py main)."""
    p = argparse.ArgumentParser(description=description, allow_abbrev=False)
    p.add_argument("--input", action="append", default=[], help="[name=]PATH: a file (.jsonl/.ndjson/.json, plain or "
                   ".gz/.zst/.bz2/.xz; .parquet), a folder of them (one source, the folder's name) or a datasets "
                   "save_to_disk folder; repeatable")
    p.add_argument("--output", required=True, help="the prepared folder")
    p.add_argument("--tokenizer_name_or_path", default=None, help="sentencepiece .model or HF tokenizer folder")
    p.add_argument("--vocab_size", type=int, default=None, help="every token id must be below this (default: the "
                   "tokenizer's); give the model's vocab_size to check pre-tokenized data")
    p.add_argument("--workers", type=int, default=default_workers(),
                   help=f"tokenizer processes (0: tokenize in this process; default: this process's CPUs (within a CPU "
                   f"quota) - 1, at most {MAX_WORKERS})")
    p.add_argument("--text_field", default="text")
    p.add_argument("--ids_field", default="input_ids", help="pre-tokenized documents (used when no text field)")
    p.add_argument("--source_field", default=None, help="take each document's source name from this field")
    p.add_argument("--loader", default=None, help="read inputs with datasets.load_dataset(LOADER, data_files=...), "
                   "e.g. csv, text, arrow")
    p.add_argument("--eos_id", type=int, default=None, help="the separator appended after each text and pre-tokenized "
                   "document (default: the tokenizer's EOS, or its family's end-of-text token where the EOS ends a "
                   "chat turn: <|eot_id|> -> <|end_of_text|>, <|im_end|> -> <|endoftext|>; none without a tokenizer)")
    p.add_argument("--skip_bad_rows", action="store_true", help="skip rows that cannot be read, count and report them")
    p.add_argument("--loss_on", default="auto", choices=["auto", "assistant", "completion", "all"],
                   help="chat rows: which tokens get loss (auto: the assistant's replies, the completion of a "
                   "prompt/completion pair; docs/sft.md)")
    p.add_argument("--chat_template", default="auto",
                   help="chat rows: the tokenizer's own template (auto: its `default` of named ones; ChatML when it has "
                   "none), always the ChatML default (chatml), none (refuse chat rows when the tokenizer has no "
                   "template), the name of one of the tokenizer's named templates (tool_use, ...), or a FILE: a jinja "
                   "template of your own (TRL's chat_template_path), a .json holding one, or a folder shipping one; "
                   "its text is recorded in the manifest and carried by the export")
    p.add_argument("--text_specials", default="auto", choices=list(TEXT_SPECIALS),
                   help="special-token strings in a text document (<s>, <|im_start|>): auto reads them as control tokens "
                   "in a text that starts as a rendered conversation (<|im_start|>user..., as TRL and tokenizer(text) "
                   "read it) and as text in any other (`<s>` in HTML, `<|endoftext|>` in code); text: always as text; "
                   "parse: always as control tokens; docs/data.md")
    p.add_argument("--shard", default="0/1", help="i/N: prepare this machine's share of the input files")
    p.add_argument("--merge", action="store_true", help="write the manifest from finished shards and stop")
    p.add_argument("--chunk_tokens", type=int, default=DEFAULT_CHUNK_TOKENS, help="tokens per chunk file (resume unit)")
    p.add_argument("--batch_docs", type=int, default=DEFAULT_BATCH_DOCS, help="documents per worker task")
    p.add_argument("--overwrite", action="store_true", help="start this shard again instead of resuming")
    p.add_argument("--verify", action="store_true", help="re-read a prepared folder and check its checksums")
    return p


def unquoted_pattern(inputs: list[str], rest: list[str]) -> str | None:
    """The one line for the arguments argparse left over where each is an existing path: `--input dir/*.jsonl`
    unquoted, which the shell expands to `--input dir/a.jsonl dir/b.jsonl ...` (--input takes one path: the others
    ended in argparse's "unrecognized arguments"). Not taken as more inputs: the pattern quoted is one source named
    after its folder (data/discover.py), each file given alone a source of its own. None where a leftover is no path
    (a mistyped flag: argparse's own message says it)."""
    if not rest or any(r.startswith("-") or not os.path.exists(r) for r in rest):
        return None
    files = inputs[-1:] + rest
    folders = {os.path.dirname(f) for f in files}
    ends = os.path.commonprefix([os.path.basename(f)[::-1] for f in files])[::-1]  # `.jsonl`, `-of-01024.json.gz`
    ext = ends[ends.index("."):] if "." in ends else ""
    pattern = os.path.join(folders.pop(), "*" + ext) if len(folders) == 1 else "DIR/*.jsonl"
    said = f"{' '.join(files[:3])}{' ...' if len(files) > 3 else ''}"
    what = f"--input {said}: {len(files)} paths after one --input" if inputs else f"{said}: {len(rest)} path(s) " \
        "without --input"
    return (f"{what} (a pattern the shell expanded?), which takes one: quote the pattern (--input '{pattern}': its "
            "files one source) or give --input once per file (a source each)")
