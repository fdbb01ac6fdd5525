"""Chat data through the offline preparation (JSONL, Parquet, HF datasets; bad rows; resume; the manifest) and
the SFT packer (ConvPack): whole conversations, positions restarted, no conversation predicting the next one's
first token, truncation dropping samples left without a supervised token (counted)."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from data.chat import ChatEncoder, build_demo_chats
from data.packing import ConvPack, DocPack
from data.prepare_data import prepare
from data.store import Prepared
from data.tokenizer import Tokenizer
from tests.unit.data.chat_fixtures import build_tokenizer

SP = ".cache/demo/stdlib_sp.model"
CONV = [{"role": "user", "content": "Repeat these words: apple river"}, {"role": "assistant", "content": "apple river"}]


def _jsonl(path, rows):
    with open(path, "w") as fh:
        for r in rows:
            fh.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def test_prepare_jsonl_parquet_hf_chat(tmp_path):
    """The three containers, three row formats and a text corpus in one folder: the chat documents' masks are the
    encoder's, the text document's chunk region all ones; bad rows skipped and counted in the manifest."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    tok_path = build_tokenizer(str(tmp_path / "tok"), "qwen25")
    rows = [{"messages": CONV}, {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
            {"prompt": "2+2=", "completion": " 4"}, "{not json", {"messages": [{"role": "user", "content": "no reply"}]},
            {"messages": [{"role": "wizard", "content": "x"}]}]
    _jsonl(tmp_path / "chat.jsonl", rows)
    _jsonl(tmp_path / "text.jsonl", [{"text": "The quick brown fox jumps over the lazy dog."}])
    pq.write_table(pa.table({"messages": [CONV, CONV]}), tmp_path / "chat.parquet")
    datasets.Dataset.from_dict({"conversations": [[{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]]}) \
        .save_to_disk(str(tmp_path / "hf"))
    with pytest.raises(ValueError, match="chat.jsonl:4: not valid JSON"):  # refused by default, as text rows are
        prepare([str(tmp_path / "chat.jsonl")], str(tmp_path / "refused"), tok_path, workers=0, log=lambda _: None)
    m = prepare([f"text={tmp_path / 'text.jsonl'}", f"chat={tmp_path / 'chat.jsonl'}", str(tmp_path / "chat.parquet"),
                 str(tmp_path / "hf")], str(tmp_path / "out"), tok_path, workers=2, skip_bad_rows=True,
                log=lambda _: None)
    assert (m["bad_rows"], m["chat_docs"], m["n_docs"], m["untrained_turns"]) == (3, 6, 7, 0)
    p = Prepared(str(tmp_path / "out"))
    assert p.verify() == [] and p.mask is not None
    enc = ChatEncoder(Tokenizer(tok_path))
    docs = [p.tokens.read(int(s), int(s + n)).tolist() for s, n in zip(p.starts, p.lens)]
    masks = [p.mask.read(int(s), int(s + n)) for s, n in zip(p.starts, p.lens)]
    assert masks[0].all()  # the text document: every token a target
    want = [{"messages": CONV}, rows[1], rows[2], {"messages": CONV}, {"messages": CONV},
            {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}]
    for d, row in enumerate(want, start=1):
        ids, mask, _ = enc.encode(row)
        assert docs[d] == ids and masks[d].tolist() == mask.tolist()
    assert m["supervised_tokens"] == sum(int(x[1:].sum()) for x in masks[1:])


def test_prepare_resume_keeps_masks(tmp_path):
    """A run killed after its first committed chunk resumes (same command) to the same manifest and mask files."""
    data = build_demo_chats(str(tmp_path / "chats.jsonl"), 120, seed=1)
    kw = dict(tokenizer=SP, workers=0, chunk_tokens=2000, batch_docs=16, log=lambda _: None)
    whole = prepare([data], str(tmp_path / "a"), **kw)
    assert len(whole["chunks"]) >= 3 and all(c["mask"] for c in whole["chunks"])
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    b = tmp_path / "b"
    for f in ["manifest.json", "shard-00000-of-00001.json"] + [f for f in os.listdir(b) if "-c000001" in f or "-c000002" in f]:
        os.remove(b / f)  # as if killed while writing chunk 1
    resumed = prepare([data], str(b), **kw)
    key = ("tokens", "mask", "n_tokens", "crc32_tokens", "crc32_mask", "crc32_lens")
    assert [[c[k] for k in key] for c in resumed["chunks"]] == [[c[k] for k in key] for c in whole["chunks"]]
    assert resumed["supervised_tokens"] == whole["supervised_tokens"] > 0
    mask = b / resumed["chunks"][1]["mask"]  # --verify reads the masks too; a truncated one is refused on open
    raw = bytearray(mask.read_bytes())
    raw[5] ^= 1
    mask.write_bytes(bytes(raw))
    assert Prepared(str(b)).verify() == [str(mask)]
    mask.write_bytes(bytes(raw[:-1]))
    with pytest.raises(ValueError, match="not .* bytes as the manifest says"):
        Prepared(str(b))


def _store(docs):
    """(tokens, mask, starts, lens) of documents given as (ids, mask) pairs laid end to end."""
    toks = np.concatenate([np.asarray(i, np.int64) for i, _ in docs])
    mask = np.concatenate([np.asarray(m, np.uint8) for _, m in docs])
    lens = np.asarray([len(i) for i, _ in docs], np.int64)
    return toks, mask, np.concatenate([[0], np.cumsum(lens)[:-1]]), lens


def test_convpack_whole_conversations_restart_and_no_cross_label():
    docs = [([10, 11, 12, 13], [0, 0, 1, 1]), ([20, 21, 22], [0, 1, 1]), ([30, 31, 32, 33, 34], [0, 0, 0, 1, 1])]
    toks, mask, starts, lens = _store(docs)
    pack = ConvPack(toks, mask, starts, lens, 8, pad_id=0)
    assert len(pack) == 2 and (pack.truncated, pack.dropped) == (0, 0)
    a, b = pack[0], pack[1]
    # best-fit decreasing: the longest (5) first, the 3 fills its sample exactly, the 4 alone: never split
    assert a["input_ids"].tolist() == [30, 31, 32, 33, 34, 20, 21, 22]
    assert a["position_ids"].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]  # restarted per conversation
    # targets: 33, 34 of the first, 21, 22 of the second; 34 never predicts 20
    assert a["shift_labels"].tolist() == [-100, -100, 33, 34, -100, 21, 22, -100]
    assert b["input_ids"].tolist() == [10, 11, 12, 13, 0, 0, 0, 0]
    assert b["position_ids"].tolist() == [0, 1, 2, 3, 0, 1, 2, 3]  # the padding a document of its own
    assert b["shift_labels"].tolist() == [-100, 12, 13, -100, -100, -100, -100, -100]


def test_convpack_best_fit_fills_and_cuts_the_padding_into_short_documents():
    """Issue 47 item 9: 8k-64k conversations into 64k samples fill >= 0.95 (next-fit in stream order filled 0.75);
    every conversation is in exactly one sample, whole, in the order of a pure function of the lengths; the padding
    tail is documents of at most PAD_PIECE tokens (it was one document, tail^2 of attention)."""
    from data.packing import PAD_PIECE

    rng = np.random.default_rng(0)
    lens = rng.integers(8 << 10, (64 << 10) + 1, 2000)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    pack = ConvPack(None, None, starts, lens, 64 << 10, pad_id=0)
    assert pack.fill() >= 0.95, pack.fill()
    assert sorted(pack.order.tolist()) == list(range(len(lens)))  # each once
    per = [int(lens[pack.order[a:b]].sum()) for a, b in zip(pack.bounds[:-1], pack.bounds[1:])]
    assert max(per) <= 64 << 10
    again = ConvPack(None, None, starts, lens, 64 << 10, pad_id=0)
    assert np.array_equal(again.order, pack.order) and np.array_equal(again.bounds, pack.bounds)
    # a length-sorted set (datasets' sort("length"); nothing shuffles before the packer): each window held one length
    # and nothing to fill its gaps (0.85 of 64k samples filled, the packing audit); packed as a permutation: full
    mixed = np.sort(np.concatenate([np.minimum(rng.lognormal(np.log(2048), 1.0, 20000), 64 << 10).astype(np.int64),
                                    rng.integers(8 << 10, (64 << 10) + 1, 2000)]))
    for ordered in (mixed, mixed[::-1]):
        got = ConvPack(None, None, np.concatenate([[0], np.cumsum(ordered)[:-1]]), ordered, 64 << 10, pad_id=0)
        assert got.fill() >= 0.98, got.fill()
    docs = [([5] * 7, [0] + [1] * 6), ([6] * 3, [0, 1, 1])]
    toks, mask, st, ln = _store(docs)
    s = ConvPack(toks, mask, st, ln, 7 + 3 + 2 * PAD_PIECE + 5, pad_id=0)[0]
    restarts = np.flatnonzero(s["position_ids"] == 0).tolist()
    assert restarts == [0, 7, 10, 10 + PAD_PIECE, 10 + 2 * PAD_PIECE]  # two conversations, three padding pieces
    assert (s["shift_labels"][10:] == -100).all()


def test_convpack_truncation_drops_and_counts():
    long_late = ([1] * 10, [0] * 8 + [1, 1])  # its reply lies past the cut at 6: dropped
    long_early = ([2] * 10, [0, 0, 1] + [1] * 7)  # cut, keeps its first supervised tokens
    short = ([3, 4, 5], [0, 1, 1])
    toks, mask, starts, lens = _store([long_late, long_early, short])
    pack = ConvPack(toks, mask, starts, lens, 6, pad_id=0)
    assert (pack.truncated, pack.dropped, len(pack)) == (1, 1, 2)
    assert pack.lost_targets == 2 + 4  # long_late's reply (dropped), long_early's targets at 6..9 (said at the stage)
    s = pack[0]
    assert s["input_ids"].tolist() == [2] * 6 and s["shift_labels"].tolist() == [-100, 2, 2, 2, 2, -100]
    assert pack[1]["input_ids"].tolist()[:3] == [3, 4, 5]


def test_docpack_honours_the_mask():
    docs = [([10, 11, 12, 13], [0, 0, 1, 1]), ([20, 21, 22, 23], [1, 1, 1, 1])]
    toks, mask, starts, lens = _store(docs)
    plain = DocPack(toks, starts, lens, 8, True, mask_cross_document_labels=True)
    masked = DocPack(toks, starts, lens, 8, True, mask_cross_document_labels=True, mask=mask)
    assert plain[0]["shift_labels"].tolist() == [11, 12, 13, -100, 21, 22, 23, -100]
    assert masked[0]["shift_labels"].tolist() == [-100, 12, 13, -100, 21, 22, 23, -100]


def _stage(i, n, kind):
    import types

    return types.SimpleNamespace(index=i, name=f"s{i}", max_seq_length=n, eval={"heldout_samples": 1}, data=None,
                                 tasks={}, replay=None, kind=kind)


def test_sft_stage_in_the_run(tmp_path, capsys):
    """A text stage then an SFT stage on one chat folder: the SFT stage's samples are whole conversations with
    labels only on the prepared targets; an SFT stage without chat data, or without document masking, stops the
    run in one line before any model."""
    from data.pipeline import open_run_data

    chats = build_demo_chats(str(tmp_path / "chats.jsonl"), 200, seed=2)
    vocab = Tokenizer(SP).vocab_size
    data = open_run_data(chats, SP, vocab, [_stage(0, 128, "text"), _stage(1, 256, "sft")], reset_position_ids=True)
    ds, sampler = data.stage_view(_stage(1, 256, "sft"), 1, 0, 2, seed=0)
    assert isinstance(ds, ConvPack) and len(ds) > 10
    p = data.prepared
    targets = {int(s): p.mask.read(int(s), int(s + n)) for s, n in zip(p.starts, p.lens)}
    for i in sampler.next_batch():
        s = ds[i]
        restarts = np.flatnonzero(s["position_ids"] == 0)
        assert (s["shift_labels"][restarts[1:] - 1] == -100).all()  # nothing predicts another conversation's start
        sup = s["shift_labels"] != -100
        assert sup.any() and (s["shift_labels"][sup] == s["input_ids"][1:][sup[:-1]]).all()
    for s in data.heldout(256, 1):  # held-out samples score the targets only, as training does
        sup = s["shift_labels"] != -100
        assert 0 < sup.sum() < 0.5 * len(sup)
    conv = data.heldout(256, 2, sft=True)  # an SFT stage's: whole held-out conversations, as it trains
    d0 = int(data.held[0])  # the first held-out conversation, whole, at the start of the first sample
    first = p.tokens.read(int(p.starts[d0]), int(p.starts[d0] + p.lens[d0]))
    whole = [(s, r) for s in conv for r in np.flatnonzero(s["position_ids"] == 0).tolist()  # whole, at a restart
             if s["input_ids"][r:r + len(first)].tolist() == first.tolist()]
    assert len(conv) == 2 and len(whole) == 1 and whole[0][0]["position_ids"][whole[0][1] + len(first) - 1] == len(first) - 1
    assert all((s["shift_labels"][np.flatnonzero(s["position_ids"] == 0)[1:] - 1] == -100).all() for s in conv)
    n_target = sum(int(m[1:].sum()) for s, m in targets.items() if data.cut[np.searchsorted(p.starts, s)])
    assert sum(int((ds[i]["shift_labels"] != -100).sum()) for i in range(len(ds))) == n_target
    text = tmp_path / "text.jsonl"
    _jsonl(text, [{"text": "hello world " * 40}] * 30)
    with pytest.raises(ValueError, match="kind sft: the dataset has no chat documents"):
        open_run_data(str(text), SP, vocab, [_stage(0, 128, "sft")], reset_position_ids=True)
    with pytest.raises(ValueError, match="drop --reset_position_ids no"):
        open_run_data(chats, SP, vocab, [_stage(0, 128, "sft")], reset_position_ids=False)


def test_packing_bench_reaches_the_fills_docs_data_md_cites(tmp_path, capsys):
    """bench/packing.py (lengths only, ~1 s): best-fit >= 0.95 at 64k and 128k where next-fit filled 0.75 / 0.78."""
    from bench.packing import main as bench

    rows = bench(["--out", str(tmp_path / "packing.json")])["distributions"]
    assert rows["longalign_64k"]["fill_before"] < 0.8 <= 0.95 <= rows["longalign_64k"]["fill_after"]
    assert rows["mix90_128k"]["fill_before"] < 0.8 and rows["mix90_128k"]["fill_after"] >= 0.95
    assert all(r["pad_attention_after"] < 0.001 for r in rows.values()) and "longalign_64k" in capsys.readouterr().out


def test_sft_stage_resumes_exactly(tmp_path):
    """A restart rebuilds the SFT stage's packing (best-fit decreasing: a pure function of the folder) and continues
    from the sampler's state: the same samples, token for token, as the uninterrupted run, across an epoch's end."""
    from data.pipeline import open_run_data

    chats = build_demo_chats(str(tmp_path / "chats.jsonl"), 200, seed=3)
    vocab, stages = Tokenizer(SP).vocab_size, [_stage(0, 256, "sft")]

    def view():
        return open_run_data(chats, SP, vocab, stages, reset_position_ids=True).stage_view(stages[0], 2, 1, 2, seed=5)

    ds, sampler = view()
    for _ in range(3):
        sampler.next_batch()
    state = sampler.state_dict()
    assert state["packing"] == "best-fit-decreasing, permuted"  # a resume across a packing change says it
    want = [ds[i] for _ in range(len(ds) // 4 + 2) for i in sampler.next_batch()]  # past the epoch's end
    ds2, resumed = view()
    resumed.load_state_dict(state)
    got = [ds2[i] for _ in range(len(ds2) // 4 + 2) for i in resumed.next_batch()]
    assert len(got) == len(want) > 0 and all(np.array_equal(a[k], b[k]) for a, b in zip(got, want) for k in a)


def test_stage_kind_config():
    """`kind: sft` per stage (or the run's --data_kind) reaches the resolved stages; a bad kind is one line."""
    from training.config import config_from_dict, validate
    from training.curriculum import resolve_stages

    cfg = config_from_dict({"data_kind": "text", "max_steps": 2, "stages": [
        {"name": "long", "max_seq_length": 256}, {"name": "chat", "max_seq_length": 256, "kind": "sft"}]})
    validate(cfg)
    assert [s.kind for s in resolve_stages(cfg, lambda sp: 1)] == ["text", "sft"]
    with pytest.raises(ValueError, match=r"stages\[0\].kind 'chat': use text or sft"):
        validate(config_from_dict({"stages": [{"name": "x", "kind": "chat"}]}))
    with pytest.raises(ValueError, match="--data_kind 'sft'.*reset_position_ids no"):
        validate(config_from_dict({"data_kind": "sft", "reset_position_ids": "no"}))


@pytest.mark.parametrize("family", ["qwen25", "llama3"])
def test_tasks_rendered_as_chat(tmp_path, family):
    """A synthetic retrieval trial as one chat exchange in the stage's template: exactly the stage's length, the
    loss on the answer and its end-of-turn token only, the padding a document of its own without labels."""
    import random

    from data.tasks import TASKS, chat_sample

    tok = Tokenizer(build_tokenizer(str(tmp_path), family))
    enc = ChatEncoder(tok)
    eot = {"qwen25": "<|im_end|>", "llama3": "<|eot_id|>"}[family]
    for task in TASKS:
        s = chat_sample(task, tok, enc, 1024, 0.5, random.Random(3))
        ids, lab, pos = s["input_ids"], s["shift_labels"], s["position_ids"]
        assert len(ids) == len(lab) == len(pos) == 1024
        assert tok.hf.decode([t for t in lab if t >= 0]) == s["answer"] + eot
        pad = int(np.flatnonzero(pos == 0)[-1])  # where the padding starts (positions restart there)
        assert pad > 900 and (ids[pad:] == tok.pad_id).all() and (lab[pad - 1:] == -100).all()
        head = tok.hf.decode(ids[:pad])
        assert head.rstrip().endswith(s["answer"] + eot)  # the exchange ends with the reply, then padding


def test_sft_stage_tasks_plain_or_chat(tmp_path):
    """An SFT stage's tasks are plain text (answer-only loss, as the retrieval evaluation asks them) unless
    `chat: true` renders them as chat exchanges; a non-boolean `chat` is one line."""
    from data.pipeline import open_run_data
    from data.tasks import parse_tasks

    chats = build_demo_chats(str(tmp_path / "chats.jsonl"), 200, seed=4)
    vocab = Tokenizer(SP).vocab_size
    for chat in (False, True):
        st = _stage(0, 512, "sft")
        st.tasks = {"passkey": 0.5, "chat": chat}
        data = open_run_data(chats, SP, vocab, [st], reset_position_ids=True)
        ds, sampler = data.stage_view(st, 1, 0, 1, seed=0)
        sample = next(ds[i] for i in (sampler.next_batch()[0] for _ in range(4)) if i >= ds.n_base)
        text = data.tokenizer.decode(sample["input_ids"])
        assert ("<|im_start|>assistant" in text) == chat and sample["task"] == "passkey"
    assert parse_tasks({"passkey": 0.1, "chat": True}) == {"passkey": 0.1}
    with pytest.raises(ValueError, match="chat must be true or false"):
        parse_tasks({"passkey": 0.1, "chat": "yes"})


def test_cli_chat_rows_need_a_tokenizer(tmp_path, capsys):
    """scripts/prepare_data.py: chat rows without a tokenizer stop with one line (exit 2), naming file and line."""
    from data.prepare_data import main

    chats = _jsonl(tmp_path / "c.jsonl", [{"messages": CONV}])
    assert main(["--input", chats, "--output", str(tmp_path / "o"), "--vocab_size", "100", "--workers", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "c.jsonl:1: a text or chat document needs a tokenizer" in err[0]


def test_chat_template_is_part_of_the_tokenizer_identity(tmp_path):
    """transformers saves the template as chat_template.jinja: a folder whose template changed after the data was
    prepared is not the tokenizer the masks were computed with, and the run says so in one line."""
    from data.pipeline import open_run_data
    from data.store import tokenizer_identity

    tok = build_tokenizer(str(tmp_path / "tok"), "qwen25")
    chats = _jsonl(tmp_path / "c.jsonl", [{"messages": CONV}] * 40)
    out = str(tmp_path / "prep")
    prepare([chats], out, tok, workers=0, log=lambda _: None)
    before = tokenizer_identity(tok)
    with open(os.path.join(tok, "chat_template.jinja"), "a") as fh:
        fh.write("{# edited #}")
    assert tokenizer_identity(tok) != before
    with pytest.raises(ValueError, match="was prepared with tokenizer .*, whose files changed since"):
        open_run_data(out, tok, 1000, [_stage(0, 64, "sft")], reset_position_ids=True)


def test_convpack_splits_a_long_text_document_as_a_text_stage_does():
    """An SFT stage's text documents (pretraining replay, a `long*` component kept for retention: every token a
    target) longer than the length were cut to their head, the same head every epoch, the rest never trained. They
    are split into pieces of the length now; a conversation longer than it is still cut (its end-of-turn kept)."""
    text = (list(range(100, 114)), [1] * 14)  # 14 tokens, every one a target
    chat = ([9] * 8, [0, 0] + [1] * 6)  # a conversation: cut at 6
    toks, mask, starts, lens = _store([text, chat])
    pack = ConvPack(toks, mask, starts, lens, 6, pad_id=0)
    assert (pack.split, pack.truncated, pack.dropped) == (1, 1, 0)
    seen = sorted(int(t) for i in range(len(pack)) for t, p in zip(pack[i]["input_ids"], pack[i]["position_ids"])
                  if t >= 100)
    assert seen == list(range(100, 114))  # every token of the text, once
    firsts = [pack[i]["input_ids"].tolist()[0] for i in range(len(pack))]
    assert {100, 106} <= set(firsts)  # pieces of 6 from the document's start
    assert pack.state_dict()["text_split"] == 1
