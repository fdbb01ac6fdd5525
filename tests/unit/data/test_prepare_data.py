"""scripts/prepare_data.py: formats, workers, chunks, resume after a kill, shards + merge, bad rows, and the
training side reading a prepared folder by path (vocabulary check, in-job size limit)."""

from __future__ import annotations

import gzip
import json
import os
import types

import numpy as np
import pytest

from data import prepare_data as pd_mod
from data import store
from data.packing import build_token_stream
from data.prepare_data import main, merge, prepare
from data.readers import Fields
from data.store import Prepared, is_prepared

DOCS = [list(range(1 + i, 30 + 5 * i)) for i in range(12)]  # pre-tokenized, distinct lengths

def _write_jsonl(path, docs, key="input_ids", opener=open):
    with opener(path, "wt") as fh:
        for d in docs:
            fh.write(json.dumps({key: d}) + "\n")
    return str(path)


def _all(folder) -> np.ndarray:
    p = Prepared(str(folder))
    return p.tokens.read(0, len(p.tokens))


def _reference(tmp_path, docs, tok=None, vocab=100):
    src = _write_jsonl(tmp_path / "ref.jsonl", docs)
    t, s = build_token_stream(src, tok, vocab, str(tmp_path / "refcache"))
    return np.load(t), np.load(s)


@pytest.mark.parametrize("fmt", ["jsonl", "gz", "zst", "parquet", "array", "array_gz"])
def test_formats_give_the_in_job_stream(tmp_path, fmt):
    if fmt == "jsonl":
        src = _write_jsonl(tmp_path / "d.jsonl", DOCS)
    elif fmt.startswith("array"):  # one JSON array (Alpaca's alpaca_data.json: indented; a BOM as Windows tools write)
        src = str(tmp_path / ("d.json" if fmt == "array" else "d.json.gz"))
        with (open if fmt == "array" else gzip.open)(src, "wb") as fh:
            fh.write(b"\xef\xbb\xbf" + json.dumps([{"input_ids": d} for d in DOCS], indent=4).encode())
    elif fmt == "gz":
        src = _write_jsonl(tmp_path / "d.jsonl.gz", DOCS, opener=gzip.open)
    elif fmt == "zst":
        import zstandard

        src = str(tmp_path / "d.jsonl.zst")
        with open(src, "wb") as fh:
            fh.write(zstandard.ZstdCompressor().compress("".join(json.dumps({"input_ids": d}) + "\n" for d in DOCS).encode()))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        src = str(tmp_path / "d.parquet")
        pq.write_table(pa.table({"input_ids": DOCS}), src, row_group_size=5)
    m = prepare([src], str(tmp_path / "out"), vocab_size=100, workers=0, log=lambda _: None)
    ref, starts = _reference(tmp_path, DOCS)
    assert m["dtype"] == "uint16" and m["n_docs"] == len(DOCS) and m["sources"] == ["d"]
    assert np.array_equal(_all(tmp_path / "out"), ref)
    assert np.array_equal(Prepared(str(tmp_path / "out")).starts, starts)


def test_text_with_tokenizer_workers_and_chunks_match_in_process(tmp_path):
    from data.corpus import build_demo_corpus
    from data.tokenizer import Tokenizer

    jsonl, model = build_demo_corpus()
    lines = open(jsonl).readlines()[:30]
    src = tmp_path / "t.jsonl"
    src.write_text("".join(lines))
    a = prepare([str(src)], str(tmp_path / "w0"), model, workers=0, log=lambda _: None)
    b = prepare([str(src)], str(tmp_path / "w2"), model, workers=2, chunk_tokens=50_000, batch_docs=3,
                log=lambda _: None)
    assert len(b["chunks"]) > 3 and a["n_tokens"] == b["n_tokens"] and a["tokenizer"]["kind"] == "sentencepiece"
    t, _ = build_token_stream(str(src), Tokenizer(model), 2048, str(tmp_path / "c"))
    assert np.array_equal(_all(tmp_path / "w0"), np.load(t)) and np.array_equal(_all(tmp_path / "w2"), np.load(t))
    assert Prepared(str(tmp_path / "w2")).verify() == []


def test_killed_run_leaves_no_manifest_and_resumes(tmp_path, monkeypatch):
    src = _write_jsonl(tmp_path / "d.jsonl", DOCS * 5)
    out = str(tmp_path / "out")
    real, calls = store.ChunkWriter.commit, []

    def dying_commit(self, *a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # killed while the third chunk is being committed
        return real(self, *a, **k)

    monkeypatch.setattr(store.ChunkWriter, "commit", dying_commit)
    with pytest.raises(KeyboardInterrupt):
        prepare([src], out, vocab_size=100, workers=0, chunk_tokens=300, batch_docs=2, log=lambda _: None)
    assert not is_prepared(out) and os.path.exists(os.path.join(out, "tokens-s00000-c000002.bin"))
    monkeypatch.setattr(store.ChunkWriter, "commit", real)
    logs = []
    m = prepare([src], out, vocab_size=100, workers=0, chunk_tokens=300, batch_docs=2, log=logs.append)
    assert logs[0].startswith("resuming shard 0/1 after 2 committed chunk(s)")
    ref, _ = _reference(tmp_path, DOCS * 5)
    assert np.array_equal(_all(out), ref) and m["n_docs"] == 60
    with pytest.raises(ValueError, match="holds shard 0 of another preparation"):
        prepare([src], out, vocab_size=200, workers=0, chunk_tokens=300, log=lambda _: None)


def test_shards_then_merge(tmp_path):
    files = [_write_jsonl(tmp_path / f"p{i}.jsonl", DOCS[i::3]) for i in range(3)]
    out = str(tmp_path / "out")
    for i in range(2):
        assert main(["--input", str(tmp_path / "p0.jsonl"), "--input", files[1], "--input", files[2], "--output", out,
                     "--vocab_size", "100", "--shard", f"{i}/2", "--workers", "0"]) == 0
        assert not is_prepared(out)
    with pytest.raises(ValueError, match="not finished"):
        os.rename(f"{out}/shard-00001-of-00002.json", f"{out}/x")
        merge(out, log=lambda _: None)
    os.rename(f"{out}/x", f"{out}/shard-00001-of-00002.json")
    assert main(["--output", out, "--merge"]) == 0
    p = Prepared(out)
    assert p.manifest["shards"] == 2 and sorted(p.sources) == ["p0", "p1", "p2"]
    docs = sorted(tuple(p.tokens.read(int(s), int(s + n))) for s, n in zip(p.starts, p.lens))
    assert docs == sorted(tuple(d) for d in DOCS)
    by_src = {p.sources[k]: int(p.lens[p.source == k].sum()) for k in range(3)}
    assert by_src == {f"p{i}": sum(len(d) for d in DOCS[i::3]) for i in range(3)}
    assert p.manifest["text_specials"] == "auto"
    # shards finished by the code before 2026-11-30 (no text_specials in their plan): it read every text's special
    # strings as control tokens, recorded as parse (an upgrade audit: "text", the opposite)
    for i in range(2):
        rec = json.load(open(f"{out}/shard-{i:05d}-of-00002.json"))
        rec["plan"].pop("text_specials")
        json.dump(rec, open(f"{out}/shard-{i:05d}-of-00002.json", "w"))
    assert merge(out, log=lambda _: None)["text_specials"] == "parse"


def test_bad_rows_named_or_skipped_and_counted(tmp_path, capsys):
    src = tmp_path / "d.jsonl"
    src.write_text('{"input_ids": [1, 2]}\nnot json\n{"input_ids": [3, 500]}\n{"other": 1}\n{"input_ids": [4]}\n')
    out = str(tmp_path / "out")
    assert main(["--input", str(src), "--output", out, "--vocab_size", "100", "--workers", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {src}:2: not valid JSON") and "--skip_bad_rows" in err
    assert main(["--input", str(src), "--output", out, "--vocab_size", "100", "--workers", "0", "--skip_bad_rows",
                 "--overwrite"]) == 0
    m = Prepared(out).manifest
    assert m["bad_rows"] == 3 and m["n_docs"] == 2 and "skipped 3 bad row(s)" in capsys.readouterr().out
    assert [e.split(":")[1] for e in m["bad_examples"]] == ["2", "3", "4"]  # kept in the manifest, as docs/data.md says
    with pytest.raises(ValueError, match="not visible on this node"):  # a node-local cache, as another node sees it
        Prepared(str(tmp_path / "elsewhere"), m)
    src.write_text('{"input_ids": [1, 2]}\n\n{"input_ids": [3, 500]}\n')
    with pytest.raises(ValueError, match=r"d.jsonl:3: token id 500 >= the vocabulary size 100"):
        prepare([str(src)], str(tmp_path / "o2"), vocab_size=100, workers=0, log=lambda _: None)


def _stages(*lens, data=None):
    return [types.SimpleNamespace(index=i, name=f"s{i}", max_seq_length=n, eval={"heldout_samples": 1}, data=data)
            for i, n in enumerate(lens)]


def test_training_opens_a_prepared_folder_by_path(tmp_path, monkeypatch):
    from data import pipeline
    from data import prepare as in_job

    src = _write_jsonl(tmp_path / "d.jsonl", DOCS * 4)
    out = str(tmp_path / "prep")
    assert main(["--input", src, "--output", out, "--vocab_size", "100", "--workers", "0"]) == 0
    # rank 0 decides that the folder is prepared (a node with a stale view must not take the other branch), and
    # that decision prepares nothing: the folder is used as it is
    monkeypatch.setattr("data.prepare_data.prepare", lambda *a, **k: pytest.fail("a prepared folder is not prepared again"))
    assert in_job.prepare_in_job(out, None, 100) == (out, None)
    data = pipeline.open_run_data(out, None, 100, _stages(32, 64), reset_position_ids=False)
    ds, sampler = data.stage_view(_stages(32, 64)[1], 1, 0, 1, seed=0)
    ref, _ = _reference(tmp_path, DOCS * 4)
    st, ln, cut = data.starts, data.prepared.lens, data.cut  # the stream without the held-out documents trains
    train = np.concatenate([ref[a: a + c] for a, c in zip(st, cut)])
    held = np.concatenate([ref[st[i] + cut[i]: st[i] + ln[i]] for i in data.held])
    assert ds[0]["input_ids"].tolist() == train[:64].tolist() and sampler.source_shares() == {}
    assert data.heldout(32, 1)[0]["input_ids"].tolist() == held[:32].tolist()
    with pytest.raises(ValueError, match="token id 84 >= the model's vocab_size 64"):
        pipeline.open_run_data(out, None, 64, _stages(32), reset_position_ids=False)


def test_in_job_path_has_a_size_limit(tmp_path, monkeypatch):
    from data import pipeline
    from data import prepare as in_job

    monkeypatch.setattr(in_job, "CACHE", str(tmp_path / "cache"))
    src = _write_jsonl(tmp_path / "d.jsonl", DOCS * 4)
    data = pipeline.open_run_data(src, None, 100, _stages(32), reset_position_ids=False)
    assert data.prepared.path.startswith(str(tmp_path / "cache"))
    monkeypatch.setattr(in_job, "MAX_IN_JOB_BYTES", 1000)
    again = pipeline.open_run_data(src, None, 100, _stages(32), reset_position_ids=False)  # prepared: used as it is
    assert again.prepared.path == data.prepared.path
    other = _write_jsonl(tmp_path / "e.jsonl", DOCS * 5)
    with pytest.raises(ValueError, match=r"too much to tokenize inside the job .* run `python scripts/prepare_data.py"):
        pipeline.open_run_data(other, None, 100, _stages(32), reset_position_ids=False)


def test_hf_fast_tokenizer_direct_path_gives_the_transformers_ids(tmp_path):
    """Tokenizer.encode_batch calls the Rust tokenizer's encode_batch_fast (no offsets); it must give exactly
    what `tokenizer(texts)` gives, on real text and on the probe's edge cases."""
    from transformers import AutoTokenizer

    from bench.data import build_hf_tokenizer
    from data.corpus import build_demo_corpus
    from data.tokenizer import _PROBE, Tokenizer

    jsonl, _ = build_demo_corpus()
    texts = [json.loads(line)["text"] for line in open(jsonl).readlines()[:20]]
    small = tmp_path / "small.jsonl"
    small.write_text("".join(json.dumps({"text": t[:5000]}) + "\n" for t in texts))
    folder = build_hf_tokenizer(str(small), str(tmp_path / "bpe"), vocab=500)
    ours = Tokenizer(folder)
    assert ours.direct
    ref = AutoTokenizer.from_pretrained(folder)
    batch = texts + _PROBE
    assert ours.encode_batch(batch) == ref(batch, add_special_tokens=False)["input_ids"]


def test_token_caches_follow_the_tokenizers_content(tmp_path, monkeypatch):
    """The in-job prepared folder and the .npy token stream are derived from the input and the tokenizer: keyed by
    the tokenizer's files (issue 32), not by its folder's name and metadata. A HF tokenizer folder whose
    tokenizer.json is rewritten in place keeps the folder's size and mtime: the old key reused the old tokens, and
    the run was then refused as prepared with another tokenizer, with no way to prepare again."""
    from data import packing

    src = _write_jsonl(tmp_path / "d.jsonl", DOCS)
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text('{"version": "a"}')
    keys = [packing.cache_key([src], str(tok), 100), packing.cache_key([src], str(tok), 64)]
    st = os.stat(tok)
    (tok / "tokenizer.json").write_text('{"version": "b"}')  # in place: the folder's entry is unchanged
    assert os.stat(tok).st_mtime_ns == st.st_mtime_ns
    # the in-job prepared folder (data/prepare.py) and the token stream (data/packing.py) share the key
    assert packing.cache_key([src], str(tok), 100) != keys[0], "the cache of the old tokenizer"
    assert keys[0] != keys[1]  # validated per vocab


def test_long_multi_turn_chats_are_spread_over_worker_tasks(tmp_path):
    """Issue 47 item 12: a worker task closes at BATCH_BYTES of work (`row_cost`: a chat row's bytes plus what its
    prefix renders add per message, data/chat.py tokenizing the conversation once), so 40 agent traces of 100
    messages (~6 KB each, ~0.14 MB of work) go to several workers, ~7 a task (the bytes x turns of the old quadratic
    encoder made 20 tasks of 2, or one task when counted by rows); a 1,000-message trace is a task alone; short
    chats and text batch by rows as before."""
    from data.discover import discover

    turn = [{"role": r, "content": "step " * 10} for r in ("user", "assistant")] * 50
    chats = tmp_path / "traces.jsonl"
    chats.write_text("".join(json.dumps({"messages": turn}) + "\n" for _ in range(40)))
    batches = [b for b, _ in pd_mod._batches(discover(str(chats)), Fields(), (0, 0), 256)]
    assert sum(map(len, batches)) == 40 and 4 <= len(batches) <= 10, [len(b) for b in batches]
    assert all(sum(pd_mod.row_cost(it)[1] for _, _, it in b[:-1]) < pd_mod.BATCH_BYTES for b in batches)
    trace = tmp_path / "trace.jsonl"
    trace.write_text(json.dumps({"messages": turn * 10}) + "\n" + json.dumps({"messages": turn[:2]}) + "\n")
    assert [len(b) for b, _ in pd_mod._batches(discover(str(trace)), Fields(), (0, 0), 256)] == [1, 1]
    short = tmp_path / "short.jsonl"
    short.write_text("".join(json.dumps({"messages": turn[:2]}) + "\n" for _ in range(300)))
    assert [len(b) for b, _ in pd_mod._batches(discover(str(short)), Fields(), (0, 0), 256)] == [256, 44]
    text = _write_jsonl(tmp_path / "text.jsonl", DOCS * 30)
    assert [len(b) for b, _ in pd_mod._batches(discover(text), Fields(), (0, 0), 256)] == [256, 104]


def test_conversations_ending_with_no_end_of_turn_are_counted_and_warned(tmp_path):
    """A template that writes its end-of-turn only when a message follows (Qwen1.5) trains each conversation's last
    reply with no stop token: the manifest counts such rows and the summary says so in one warning line with the
    fix; before, nothing said it."""
    from data.tokenizer import Tokenizer
    from tests.unit.data.chat_fixtures import build_tokenizer
    from tests.unit.data.test_chat import QWEN15_SHAPE

    path = build_tokenizer(str(tmp_path / "tok"), "qwen25")
    tok = Tokenizer(path)
    tok.hf.chat_template = QWEN15_SHAPE
    tok.hf.save_pretrained(path)
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    src = _write_jsonl(tmp_path / "c.jsonl", [turns, turns + [{"role": "user", "content": "bye"}], turns], "messages")
    lines = []
    m = prepare([src], str(tmp_path / "out"), path, workers=0, log=lines.append)
    assert (m["chat_docs"], m["no_stop_rows"]) == (3, 2)
    warn = [x for x in lines if x.startswith("warning:")]
    assert len(warn) == 1 and "2 conversation(s)" in warn[0] and "or append it" in warn[0]


def test_rows_whose_tool_call_arguments_were_rewritten_or_turns_flagged_are_counted(tmp_path):
    """OpenAI's JSON-text arguments through a template that `tojson`s them (Qwen2.5's) are given to it as the object
    (data/chat_tools.fit_arguments), and a reply weighted 0 (OpenAI's fine-tuning flag) is context only: the manifest
    counts both and the summary names them."""
    from data.chat_sweep import CASES, build_tokenizer, families

    path = build_tokenizer(str(tmp_path), "qwen25", families()["qwen25"])
    src = _write_jsonl(tmp_path / "c.jsonl", [CASES["arguments as JSON text"], CASES["tool call"],
                                              CASES["multi-turn"], CASES["a reply weighted 0"]], "messages")
    lines = []
    m = prepare([src], str(tmp_path / "out"), path, workers=0, log=lines.append)
    assert (m["chat_docs"], m["rewritten_arguments"], m["flagged_turns"]) == (4, 1, 1)
    assert any("1 with tool-call arguments rewritten" in x for x in lines)
    assert any("1 assistant turn(s) in context with no loss" in x for x in lines)


_SP = "recipes/base/tiny_passkey256/tokenizer.model"


@pytest.mark.parametrize("args,match", [
    (["--tokenizer_name_or_path", "README.md"], r"--tokenizer_name_or_path README.md: not a sentencepiece \.model"),
    (["--tokenizer_name_or_path", "docs"], r"--tokenizer_name_or_path docs: not a Hugging Face tokenizer folder"),
    (["--tokenizer_name_or_path", _SP, "--workers", "-1"], r"--workers -1: use an integer >= 0"),
    (["--tokenizer_name_or_path", _SP, "--chunk_tokens", "0"], r"--chunk_tokens 0: use an integer >= 1"),
    (["--tokenizer_name_or_path", _SP, "--batch_docs", "0"], r"--batch_docs 0: use an integer >= 1"),
    (["--tokenizer_name_or_path", _SP, "--eos_id", "99999"], r"--eos_id 99999: not a token id below the vocabulary size 2000"),
    (["--vocab_size", "100", "--eos_id", "100"], r"--eos_id 100: not a token id below the vocabulary size 100"),
    # -1 (an UnboundLocalError traceback: the bound was computed after the `0 <=` that failed)
    (["--tokenizer_name_or_path", _SP, "--eos_id", "-1"], r"--eos_id -1: not a token id below the vocabulary size 2000: "
                                                          r"give the model's EOS id, or leave --eos_id out"),
    (["--vocab_size", "100", "--eos_id", "-1"], r"--eos_id -1: not a token id below the vocabulary size 100"),
    (["--tokenizer_name_or_path", _SP, "--output", "README.md"], r"--output 'README.md': give a folder"),
    (["--tokenizer_name_or_path", _SP, "--output", ""], r"--output '': give a folder"),
    (["--verify"], r"--output .*: not a prepared folder \(no manifest.json"),
])
def test_the_commands_own_values_are_refused_in_one_line(tmp_path, capsys, args, match):
    """prepare_data's flags as users mistype them: one line and exit 2 before anything is read. Before: a
    sentencepiece RuntimeError or a FileNotFoundError / FileExistsError traceback; --workers -1, --chunk_tokens 0 and
    --batch_docs 0 went on; an --eos_id past the vocabulary was written into every document (a GPU's index assert at
    the first step) or silently replaced by the tokenizer's."""
    import re

    from data.prepare_data import main

    src = _write_jsonl(tmp_path / "a.jsonl", [[5, 6, 7]], "input_ids")
    out = [] if "--output" in args else ["--output", str(tmp_path / "out")]
    assert main(["--input", src, *out, *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(match, err[0]), err


def _bos_tokenizer(root) -> str:
    """A Hugging Face tokenizer folder that puts <s> before a text, as Llama 3's, Mistral's and Gemma's do."""
    from tokenizers import Tokenizer as Bpe
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    t = Bpe(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(["a quick brown fox jumps over the lazy dog"] * 10, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    t.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", t.token_to_id("<s>"))])
    tok = PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>")
    tok.save_pretrained(str(root))
    return str(root)


def test_a_text_document_starts_with_the_tokenizers_bos(tmp_path):
    """A tokenizer that puts a BOS before a text (`tokenizer(text)`: Llama 3's <|begin_of_text|>, Gemma's <bos>, which
    Gemma needs) gets each text document written BOS + text + EOS, as the model was pretrained and as transformers,
    TRL and torchtitan tokenize; before, every document started without it. The in-job reference stream agrees; a
    tokenizer that adds none (the demo's sentencepiece model) is unchanged."""
    from data.tokenizer import Tokenizer

    path = _bos_tokenizer(tmp_path / "tok")
    tok = Tokenizer(path)
    bos, eos = tok.bos_id, tok.eos_id
    assert bos == tok.hf.convert_tokens_to_ids("<s>") and Tokenizer(_SP).bos_id is None
    texts = ["a quick brown fox", "the lazy dog"]
    src = _write_jsonl(tmp_path / "t.jsonl", texts, "text")
    m = prepare([src], str(tmp_path / "out"), path, workers=0, log=lambda _: None)
    p = Prepared(str(tmp_path / "out"))
    docs = [p.tokens.read(int(s), int(s) + int(n)).tolist() for s, n in zip(p.starts, p.lens)]
    assert [d[0] for d in docs] == [bos, bos] and [d[-1] for d in docs] == [eos, eos] and m["bos_id"] == bos
    assert [tok.decode(d[1:-1]) for d in docs] == texts
    ref = build_token_stream(src, tok, tok.vocab_size, str(tmp_path / "refcache"))[0]
    assert np.load(ref).tolist() == [t for d in docs for t in d]
    # a text that writes its own BOS (a conversation rendered with its template, saved as text) keeps one; a prompt /
    # completion of strings starts with the BOS too, untrained, as TRL tokenizes it (it had none)
    src2 = _write_jsonl(tmp_path / "own.jsonl", ["<s> a quick brown fox"], "text")
    with open(src2, "a") as fh:
        fh.write(json.dumps({"prompt": "the lazy", "completion": " dog"}) + "\n")
    prepare([src2], str(tmp_path / "out2"), path, workers=0, log=lambda _: None)
    p2 = Prepared(str(tmp_path / "out2"))
    own, pair = [p2.tokens.read(int(s), int(s) + int(n)).tolist() for s, n in zip(p2.starts, p2.lens)]
    assert own.count(bos) == 1 and own[0] == bos
    assert pair[0] == bos and pair.count(bos) == 1 and p2.mask.read(int(p2.starts[1]), int(p2.starts[1]) + 1)[0] == 0
    ref2 = build_token_stream(_write_jsonl(tmp_path / "own_only.jsonl", ["<s> a quick brown fox"], "text"), tok,
                              tok.vocab_size, str(tmp_path / "refcache2"))[0]
    assert np.load(ref2).tolist() == own


def test_conversations_rendered_with_the_chatml_default_are_said(tmp_path):
    """A tokenizer with no chat template renders chat rows with the ChatML default: right for a base model, a format
    an instruct model never saw. The summary says it once; before, nothing did."""
    from tests.unit.data.chat_fixtures import build_tokenizer

    path = build_tokenizer(str(tmp_path / "tok"), "none")
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    src = _write_jsonl(tmp_path / "c.jsonl", [turns, turns], "messages")
    with open(src, "a") as fh:  # a prompt / completion of strings: no template renders it, none is counted
        fh.write(json.dumps({"prompt": "hi", "completion": " hello"}) + "\n")
    lines = []
    m = prepare([src], str(tmp_path / "out"), path, workers=0, log=lines.append)
    assert (m["chat_docs"], m["chatml_rows"]) == (3, 2)
    note = [x for x in lines if "ChatML default" in x]
    assert len(note) == 1 and note[0].startswith("note: 2 conversation(s)")
    lines = []  # asked for (--chat_template chatml): counted, no note
    m = prepare([src], str(tmp_path / "out2"), path, workers=0, log=lines.append, chat_template="chatml")
    assert m["chatml_rows"] == 2 and not [x for x in lines if "ChatML default" in x]
