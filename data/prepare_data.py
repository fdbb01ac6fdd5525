"""Prepare a corpus once, before training: tokenize in parallel into a prepared folder (`data/store.py`).

    python scripts/prepare_data.py --input books=corpus/books/ --input code.jsonl.zst --output data/prep \\
        --tokenizer_name_or_path /models/Llama-3-8B --workers 16
    # across machines: one shard each (input files are split between shards by size), then the index
    python scripts/prepare_data.py ... --shard 3/8          # on machine 3 of 8
    python scripts/prepare_data.py --output data/prep --merge

Streaming: the reading process groups rows into batches (`--batch_docs` rows, 1 MB of rows, or 1 MB of work: ~1 s of
a worker, `row_cost`: a chat row's bytes plus what its template renders add per message) and keeps up to
16 x workers batches in flight; workers parse, tokenize and check each batch (data/prepare_worker.py); the reading
process appends the results, in input order, to the current chunk file, those finished early held up to 1 GiB
(data/prepare_pool.py: a slow batch leaves no worker idle). Peak memory is the batches in flight, not the corpus. A chunk
(`--chunk_tokens`) is committed by its record file after its data is fsynced; a killed run resumes after the last
committed chunk (same command), and `manifest.json` is written last, so a folder without it is never read as data.
"""

from __future__ import annotations

import glob
import hashlib
import multiprocessing as mp
import os
import sys
import time
from collections import Counter

from data import output_lock, packing, store
from data.chat_render import prefix_cost_note
from data.chat_template import given_template
from data.discover import Unit, discover
from data.ids_rows import BESIDE
from data.prepare_args import (
    DEFAULT_BATCH_DOCS,
    DEFAULT_CHUNK_TOKENS,
    TEXT_SPECIALS,
    parser,
    unquoted_pattern,
)
from data.prepare_checks import refusal, shard_of
from data.prepare_pool import run_ordered
from data.prepare_summary import manifest_lines
from data.prepare_worker import STATS, _init_worker, _tokenize_batch
from data.readers import Fields, Refused, iter_rows

BATCH_BYTES = 1 << 20  # a batch closes at this much raw text too (long documents): bounds memory in flight
SKIP_FIX = "(--skip_bad_rows skips and counts such rows)"  # ends a bad row's refusal: data/prepare.py names train.py's

# ------------------------------------------------------------------ the reading/writing process

def shard_units(units: list[Unit], shard: int, n_shards: int) -> list[Unit]:
    """This shard's input units: largest first to the least loaded shard, then in input order."""
    if n_shards > len(units):
        raise ValueError(f"--shard {shard}/{n_shards}: only {len(units)} input file(s); shards split inputs by "
                         "file, so use at most that many shards (or split the files)")
    load, owner = [0] * n_shards, {}
    for i in sorted(range(len(units)), key=lambda i: (-units[i].size(), i)):
        s = min(range(n_shards), key=lambda k: (load[k], k))
        owner[i], load[s] = s, load[s] + units[i].size()
    return [u for i, u in enumerate(units) if owner[i] == shard]


def _clear_shard(out: str, shard: int) -> None:
    for f in glob.glob(os.path.join(out, f"*-s{shard:05d}-c*")) + glob.glob(os.path.join(out, f"plan-s{shard:05d}.json")) \
            + glob.glob(os.path.join(out, f"shard-{shard:05d}-of-*.json")) + [os.path.join(out, store.MANIFEST)]:
        if os.path.exists(f):
            os.remove(f)


def _resume_point(out: str, shard: int) -> list[dict]:
    """Committed chunk records of this shard in order; anything after the last one is removed."""
    recs, k = [], 0
    while os.path.exists(p := os.path.join(out, f"chunk-{store.chunk_name(shard, k)}.json")):
        recs.append(store.read_json(p))
        k += 1
    for f in glob.glob(os.path.join(out, f"*-s{shard:05d}-c*")):  # (an atomic write's tmp, whose host may hold "-c",
        if ".tmp" not in os.path.basename(f) and int(f.rsplit("-c", 1)[1][:6]) >= k:  # is not a chunk's)
            os.remove(f)
    return recs


def _check_numbers(output: str, vocab_size, workers: int, chunk_tokens: int, batch_docs: int, inputs=()) -> None:
    """The command's numbers and --output, one line each, before anything is read."""
    for name, value, low in (("--vocab_size", vocab_size, 1), ("--workers", workers, 0),
                             ("--chunk_tokens", chunk_tokens, 1), ("--batch_docs", batch_docs, 1)):
        if value is not None and value < low:
            raise ValueError(f"{name} {value}: use an integer >= {low}")
    if not output or (os.path.exists(output) and not os.path.isdir(output)):
        raise ValueError(f"--output {output!r}: give a folder (it is created, or resumed when it holds this preparation)")
    for spec in inputs:  # `--input pd/sub --output pd/sub/prepared`: its second run read the first one's JSON as rows
        path = spec if os.path.exists(spec) or "/" in spec.partition("=")[0] else spec.partition("=")[2] or spec
        if os.path.isdir(path) and os.path.commonpath([os.path.realpath(output), real := os.path.realpath(path)]) == real:
            raise ValueError(f"--output {output} is inside --input {spec} (a later run would read this one's files as "
                             "rows): give an --output outside the input folder")


def _no_file_twice(per_spec: list[tuple[str, list[Unit]]]) -> None:
    """A file that two --input's read (the same path twice, a folder and a file in it, a link): its documents were
    prepared twice without a word. By real path, after folder expansion: one realpath per file."""
    seen: dict[str, int] = {}
    for k, (spec, units) in enumerate(per_spec):
        for f in (os.path.realpath(f) for u in units for f in u.files()):
            if (first := seen.setdefault(f, k)) != k:
                raise ValueError(f"--input {per_spec[first][0]} and --input {spec} both read {f}: give each file "
                                 "once (to repeat a source on purpose, weight or upsample it in the stage's data:, "
                                 "docs/data.md)")


def prepare(inputs: list[str], output: str, tokenizer: str | None = None, vocab_size: int | None = None,
            workers: int = 1, shard: tuple[int, int] = (0, 1), fields: Fields | None = None, skip_bad_rows: bool = False,
            chunk_tokens: int = DEFAULT_CHUNK_TOKENS, batch_docs: int = DEFAULT_BATCH_DOCS, loader: str | None = None,
            eos_id: int | None = None, overwrite: bool = False, command: list[str] | None = None,
            log=print, loss_on: str = "auto", chat_template: str = "auto", text_specials: str = "auto") -> dict:
    """Prepare this shard of `inputs` into `output`; with one shard, also write the manifest. Returns the
    manifest (one shard) or the shard record. ValueError (one line) on bad input. `text_specials`: TEXT_SPECIALS."""
    from data.tokenizer import Tokenizer

    if text_specials not in TEXT_SPECIALS:
        raise ValueError(f"--text_specials {text_specials!r}: use auto, text or parse")
    fields = fields or Fields()
    chat_template = given_template(chat_template)  # a FILE's text: what the manifest records (data/chat_template.py)
    i_shard, n_shards = shard
    _check_numbers(output, vocab_size, workers, chunk_tokens, batch_docs, inputs)
    per_spec = [(spec, discover(spec, loader)) for spec in inputs]
    _no_file_twice(per_spec)
    units = [u for _, us in per_spec for u in us]
    mine = shard_units(units, i_shard, n_shards)
    tok = Tokenizer(tokenizer) if tokenizer else None
    bound = vocab_size or (tok.vocab_size if tok else None)
    if bound is None:
        raise ValueError("give --tokenizer_name_or_path or --vocab_size (the bound every token id is checked against)")
    # the separator after each text and pre-tokenized document (a conversation ends with its template's end-of-turn):
    # --eos_id where given, else the tokenizer's (data/tokenizer.py `sep_id`)
    eos = eos_id if eos_id is not None or tok is None else tok.sep_id
    top = min(bound, tok.vocab_size) if tok else bound  # (a walrus after `0 <= eos` was unset for -1: a traceback)
    if eos is not None and not 0 <= eos < top:
        raise ValueError(f"--eos_id {eos}: not a token id below the vocabulary size {top}: give the model's EOS id, or "
                         "leave --eos_id out for the tokenizer's (no separator only without a tokenizer: --vocab_size)")
    tok_info = ({"path": os.path.abspath(tokenizer), "kind": tok.kind, "sha256": store.tokenizer_identity(tokenizer),
                 "vocab": store.vocab_identity(tokenizer),  # a text's ids: an edited config keeps them (data/pipeline.py)
                 "vocab_size": tok.vocab_size, "eos_id": tok.eos_id, "pad_id": tok.pad_id} if tok else None)
    dtype = store.token_dtype(bound)
    # the view of the inputs every shard's assignment is made from (order, names, sizes: not mount points nor mtimes,
    # which differ between machines): one stat per file, a second or so per 100k files
    view = "\n".join(f"{u.kind}:{u.name}:{os.path.basename(u.path)}:{u.size()}" for u in units)
    plan = {"units": [u.identity() for u in mine], "inputs": hashlib.sha256(view.encode()).hexdigest()[:16],
            "tokenizer": tok_info and tok_info["sha256"], "vocab_bound": bound,
            "eos_id": eos, "bos_id": tok.bos_id if tok else None, "dtype": dtype.name,
            "text_specials": TEXT_SPECIALS[text_specials], "fields": [fields.text, fields.ids, fields.source],
            "shard": [i_shard, n_shards], "chunk_tokens": chunk_tokens, "skip_bad_rows": skip_bad_rows,
            "loss_on": loss_on, "chat_template": chat_template, "rules": packing.RULES}
    if tok is not None:
        from data.chat import ChatEncoder

        ChatEncoder(tok, loss_on, chat_template)  # a bad --loss_on / --chat_template: one line, before any work
    if tok is not None and eos_id is None and tok.sep_note:
        log(f"note: {tok.sep_note}")
    if tok is not None and tok.file_bos is not None:
        log(f"note: {tokenizer} is a sentencepiece .model: text is written without its BOS (id {tok.file_bos}), which "
            "Llama 2 / Mistral v0.x / Gemma were trained with; give the model's Hugging Face tokenizer folder to write it")
    _lock = output_lock.hold(output, i_shard, n_shards, log)  # mkdir + one writer per shard (output_lock.py)
    plan_path = os.path.join(output, f"plan-s{i_shard:05d}.json")
    if overwrite:
        _clear_shard(output, i_shard)
    # the instant every chat render of the shard sees (a template's date: data/chat_render.FrozenClock), read once, kept
    old = store.read_json(plan_path) if os.path.exists(plan_path) else {}  # by a resumed shard (None: begun before)
    plan["clock"] = old.get("clock") if old else time.strftime("%Y-%m-%dT%H:%M:%S")
    shard_path = os.path.join(output, f"shard-{i_shard:05d}-of-{n_shards:05d}.json")
    output_lock.check_plan(output, i_shard, plan_path, plan, os.path.exists(shard_path), log)
    if not os.path.exists(shard_path):
        done = _resume_point(output, i_shard)
        if done:
            log(f"resuming shard {i_shard}/{n_shards} after {len(done)} committed chunk(s), "
                f"{sum(r['n_tokens'] for r in done)} tokens")
        record = _run_shard(mine, output, i_shard, done, tokenizer, fields, bound, eos, dtype, workers, skip_bad_rows,
                            chunk_tokens, batch_docs, log, loss_on, chat_template, text_specials, plan["clock"])
        record.update(plan=plan, tokenizer=tok_info, command=command or [])
        store.write_json_atomic(shard_path, record)
    if n_shards == 1:
        return merge(output, log=log)
    return store.read_json(shard_path)


def row_cost(item) -> tuple[int, int]:
    """(bytes, work) of one row as the reader sees it; work is a worker's time in bytes of text tokenized. A chat row
    of m messages (data/chat.py: the conversation tokenized once, the template rendered once per prefix) adds ~500
    bytes' worth per message (its prefix renders, spans and checks), 8 per message per render (the template loops
    over the prefix's messages: m^2 in all) and a copy of the text per render (m x bytes / 700): a 100-message 6 KB
    chat ~0.14 MB, a 1,000-message 60 KB trace ~8.6 MB (its own task), a 1M-token chat of 100 messages ~4.7 MB. Measured
    with the fixture tokenizers (tests/unit/data/chat_render_bench.py). Text: its bytes. Counted on the raw line
    (C-speed byte counts), never parsed here."""
    if isinstance(item, Refused):  # its text dropped by the reader: only why travels
        return len(item.why), len(item.why)
    if isinstance(item, bytes):
        turns = item.count(b'"role"') + item.count(b'"from"')  # messages / ShareGPT turns; 0 for a text row
        return len(item), len(item) + _chat_work(turns, len(item))
    value = item[0]
    if isinstance(value, dict) and BESIDE in value:  # a table's ids with columns beside them: their lengths
        return (n := len(value[BESIDE][0]) * (1 + len(value[BESIDE][1]))), n
    if isinstance(value, dict):  # a columnar chat row
        size = len(str(value))
        return size, size + _chat_work(sum(len(v) for v in value.values() if isinstance(v, list)), size)
    n = len(value) if isinstance(value, str | list) else len(str(value))
    return n, n


def _chat_work(messages: int, size: int) -> int:
    return 500 * messages + 8 * messages * messages + messages * size // 700


def _batches(units: list[Unit], fields: Fields, start: tuple[int, int], batch_docs: int):
    """(rows, their raw bytes) in input order, grouped into worker tasks: a task closes at `batch_docs` rows,
    BATCH_BYTES of raw rows (memory in flight: data/prepare_pool.py bounds their sum) or BATCH_BYTES of work
    (`row_cost`: a batch of long multi-turn chats is split over the workers instead of going whole to one of them; a
    single row is never split)."""
    batch, size, work = [], 0, 0
    for u in range(start[0], len(units)):
        for row, item in iter_rows(units[u], fields, start[1] if u == start[0] else 0):
            batch.append((u, row, item))
            b, w = row_cost(item)
            size, work = size + b, work + w
            if len(batch) >= batch_docs or size >= BATCH_BYTES or work >= BATCH_BYTES:
                yield batch, size
                batch, size, work = [], 0, 0
    if batch:
        yield batch, size


def _run_shard(units, out, i_shard, done, tokenizer, fields, bound, eos, dtype, workers, skip_bad_rows, chunk_tokens,
               batch_docs, log, loss_on="auto", chat_template="auto", text_specials="auto", now=None) -> dict:
    start = tuple(done[-1]["next"]) if done else (0, 0)
    stats = {"bad_rows": done[-1]["bad_rows"] if done else 0, "empty_docs": done[-1]["empty_docs"] if done else 0,
             "bad_examples": done[-1]["bad_examples"] if done else []}
    stats.update({k: done[-1].get(k, 0) if done else 0 for k in STATS})
    writer = store.ChunkWriter(out, i_shard, len(done), dtype, done[-1]["sources"] if done else [])
    writer.records = list(done)
    names = [u.name for u in units]
    init = (tokenizer, fields, bound, eos, dtype.name, loss_on, chat_template, text_specials, now)
    pool = mp.get_context("fork").Pool(workers, _init_worker, init) if workers > 0 else None
    if pool is None:
        _init_worker(*init)
    t0, last_log, tokens_here = time.time(), time.time(), 0
    sourced, slow = 0, 0  # rows whose --source_field named their source (none at all: a typo? said at the end)

    def consume(res):
        nonlocal last_log, tokens_here, sourced, slow
        sourced += sum(s is not None for _, s in res["srcs"])
        if res["long"] and not slow:  # once: the costliest rows, of a template without markers (data/chat_render.py)
            slow = 1
            log(prefix_cost_note(units[res["long"][0]].where(res["long"][1]), *res["long"][2:]))
        for u, row, err in res["bad"]:
            if not skip_bad_rows:
                # a text under another field or nested (data/readers.py names the fix): skipping would drop every row
                fix = "" if "--text_field" in err or "nested fields are not read" in err else f" {SKIP_FIX}"
                raise ValueError(f"{units[u].where(row)}: {err}{fix}")
            stats["bad_rows"] += 1
            if len(stats["bad_examples"]) < 20:
                stats["bad_examples"].append(f"{units[u].where(row)}: {err}")
        stats["empty_docs"] += res["empty"]
        for k in STATS:
            stats[k] += res["chat"][k]
        writer.add(res, names)
        tokens_here += len(res["tokens"])
        if writer.n_tokens >= chunk_tokens:
            writer.commit((res["last"][0], res["last"][1] + 1), dict(stats))
        if time.time() - last_log > 30:
            last_log = time.time()
            log(f"shard {i_shard}: {tokens_here} tokens this run, {tokens_here / (last_log - t0):.0f} tokens/s")

    try:  # in input order, workers kept busy past a slow batch; results held bounded (data/prepare_pool.py)
        run_ordered(pool, _tokenize_batch, _batches(units, fields, start, batch_docs), consume, workers,
                    committed=lambda: len(writer.records))  # a dead worker: one line, resumed after them
        if writer.n_tokens or not writer.records:
            writer.commit((len(units), 0), dict(stats))
        writer.abandon()  # the empty chunk opened after the last commit
    finally:
        if pool is not None:
            pool.terminate()
    recs = writer.records
    if fields.source and not sourced and not done:  # a typo gave every document its file's name, unsaid
        log(f"note: --source_field {fields.source!r}: no row of shard {i_shard} has it (a typo?): every document took "
            "its file's name as its source")
    if stats["bad_rows"]:
        log(f"shard {i_shard}: skipped {stats['bad_rows']} bad row(s), e.g. {stats['bad_examples'][0]}")
    return {"chunks": recs, "n_tokens": sum(r["n_tokens"] for r in recs), "n_docs": sum(r["n_docs"] for r in recs),
            **stats}


def _same_inputs(output: str, plans: list[dict]) -> None:
    """Every shard assigned files from the same view of the inputs (its `inputs` hash): a file still downloading when
    one shard started and complete when another did moves files between shards, read twice or never."""
    views = sorted({p.get("inputs") for p in plans}, key=str)
    if len(views) < 2:
        return
    paths = [i.split(":", 1)[1].rsplit(":", 2)[0] for p in plans for i in p["units"]]  # kind:name/file:size:sample
    twice = sorted(f for f, k in Counter(paths).items() if k > 1)
    groups = " vs ".join(str([i for i, p in enumerate(plans) if p.get("inputs") == v]) for v in views)
    raise ValueError(f"{output}: shards {groups} saw different inputs (a file changed or appeared between their runs: "
                     "files read twice or never" + (f"; read by several: {twice[:5]}" if twice else "")
                     + "): once the inputs are final, run every shard again with --overwrite, then merge")


def merge(output: str, log=print) -> dict:
    """Write `manifest.json` from the finished shards' records (no token is read or copied)."""
    shards = sorted(glob.glob(os.path.join(output, "shard-*-of-*.json")))
    if not shards:
        raise ValueError(f"{output}: no finished shard (shard-*-of-*.json); run prepare_data.py --shard i/N first")
    n = int(shards[0].rsplit("-of-", 1)[1][:5])
    recs = {int(os.path.basename(p)[6:11]): store.read_json(p) for p in shards if p.endswith(f"-of-{n:05d}.json")}
    missing = [i for i in range(n) if i not in recs]
    if missing:
        raise ValueError(f"{output}: shard(s) {missing} of {n} are not finished; run them (--shard i/{n}), then merge")
    keys = ("tokenizer", "vocab_bound", "eos_id", "bos_id", "dtype", "fields", "chunk_tokens", "loss_on",
            "chat_template", "text_specials")
    first = recs[0]["plan"]
    _same_inputs(output, [recs[i]["plan"] for i in range(n)])
    output_lock.check_rules(output, [recs[i] for i in range(n)], log)
    for i in range(n):
        differs = [k for k in keys if recs[i]["plan"].get(k) != first.get(k)]
        if differs:
            raise ValueError(f"{output}: shard {i} was prepared differently from shard 0 ({differs}); redo it")
    chunks, sources, per_source = [], [], {}
    for i in range(n):
        for c in recs[i]["chunks"]:
            chunks.append({k: c.get(k) for k in ("tokens", "lens", "src", "n_tokens", "n_docs", "crc32_tokens",
                                                 "crc32_lens", "crc32_src", "sources", "max_token_id", "mask", "crc32_mask")})
            for s in c["sources"]:
                if s not in sources:
                    sources.append(s)
            for s, (d, t) in c["per_source"].items():
                acc = per_source.setdefault(s, {"docs": 0, "tokens": 0})
                acc["docs"], acc["tokens"] = acc["docs"] + d, acc["tokens"] + t
    n_tokens = sum(c["n_tokens"] for c in chunks)
    if n_tokens == 0:
        raise ValueError(f"{output}: no documents (every row blank, empty or skipped)")
    manifest = {
        "format": store.FORMAT, "tokenizer": recs[0]["tokenizer"], "vocab_size": first["vocab_bound"],
        "eos_id": first["eos_id"], "bos_id": first.get("bos_id"), "dtype": first["dtype"], "n_tokens": n_tokens,
        "n_docs": sum(c["n_docs"] for c in chunks), "max_token_id": max(c["max_token_id"] for c in chunks),
        "sources": sources, "per_source": per_source, "chunks": chunks,
        "bad_rows": sum(recs[i]["bad_rows"] for i in range(n)), "empty_docs": sum(recs[i]["empty_docs"] for i in range(n)),
        "bad_examples": [e for i in range(n) for e in recs[i].get("bad_examples", [])][:20],
        **{k: sum(recs[i].get(k, 0) for i in range(n)) for k in STATS},
        "loss_on": first.get("loss_on", "auto"), "chat_template": first.get("chat_template", "auto"),
        "text_specials": {v: k for k, v in TEXT_SPECIALS.items()}.get(  # a shard without one: before 2026-11-30,
            first.get("text_specials"), "parse" if first.get("text_specials") is None else "text"),  # all parsed
        "shards": n, "commands": [recs[i]["command"] for i in range(n)], "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "rules": list(dict.fromkeys(recs[i]["plan"].get("rules") for i in range(n))),  # a run's check (prepared_again)
    }
    store.write_json_atomic(os.path.join(output, store.MANIFEST), manifest)
    for line in manifest_lines(output, manifest) + _end_notes(manifest):
        log(line)
    return manifest


def _end_notes(m: dict) -> list[str]:
    """How documents' ends were read (data/tokenizer.py frame_texts, data/ids_rows.py trained_end): said once, at the
    merge, beside data/prepare_summary.py's notes."""
    eos, out = (m.get("tokenizer") or {}).get("eos_id"), []
    if m.get("eos_text_docs"):
        out.append(f"note: {m['eos_text_docs']} text document(s) end with the tokenizer's EOS string (id {eos}, `text + "
                   f"tokenizer.eos_token`): read as the document's end, the separator (id {m['eos_id']}) written once")
    if m.get("eos_labels_trained"):
        out.append(f"note: {m['eos_labels_trained']} rows' labels masked their final EOS (pad == eos, id {eos}): trained")
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = parser(__doc__.split("\n")[0])
    a, rest = p.parse_known_args(argv)
    if rest:  # `--input dir/*.jsonl` unquoted: one line saying so; anything else argparse's usage and message
        if (why := unquoted_pattern(a.input, rest)) is None:
            p.error(f"unrecognized arguments: {' '.join(rest)}")
        print(f"error: {why}", file=sys.stderr)
        return 2
    try:
        if a.verify:
            if not os.path.isfile(os.path.join(a.output, store.MANIFEST)):
                raise ValueError(f"--output {a.output}: not a prepared folder (no {store.MANIFEST}; a preparation "
                                 "not finished has none: run it again to resume)")
            bad = store.Prepared(a.output).verify()
            print(f"{a.output}: " + ("intact" if not bad else f"checksum mismatch in {bad}"))
            return 1 if bad else 0
        if a.merge:
            merge(a.output)
            return 0
        i, n = shard_of(a.shard, argv)  # and against the SLURM step's tasks
        if not a.input:
            raise ValueError("give at least one --input")
        prepare(a.input, a.output, a.tokenizer_name_or_path, a.vocab_size, a.workers, (i, n),
                Fields(a.text_field, a.ids_field, a.source_field), a.skip_bad_rows, a.chunk_tokens, a.batch_docs,
                a.loader, a.eos_id, a.overwrite, command=["prepare_data.py", *argv], loss_on=a.loss_on,
                chat_template=a.chat_template, text_specials=a.text_specials)
    except (ValueError, OSError) as e:  # a user's input, a full disk or quota: one line (others raised again)
        print(f"error: {refusal(e, a.output)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
