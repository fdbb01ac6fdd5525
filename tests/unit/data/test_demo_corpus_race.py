"""Two jobs starting together on a fresh cache built the demo corpus and tokenizer into the same fixed tmp names
(`stdlib.jsonl.tmp`, `stdlib_sp.tmp.model`): the second os.replace found nothing (FileNotFoundError), or a JSONL
interleaved two writers' lines. Each build writes its own tmp now (host, pid, random) and takes a target that appeared
meanwhile as done."""

from __future__ import annotations

import json
import os
import sys
import types

import pytest

from data import corpus


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus, "CACHE", str(tmp_path / "cache"))
    stdlib = tmp_path / "stdlib"
    stdlib.mkdir()
    for i in range(3):
        (stdlib / f"m{i}.py").write_text(f"# module {i}\n" + "x = 1\n" * 500)
    monkeypatch.setattr(corpus.sysconfig, "get_paths", lambda: {"stdlib": str(stdlib)})
    monkeypatch.setattr(os, "getpid", lambda: 7)  # both jobs' rank 0s are pid 7 in their containers
    built, state = [], types.SimpleNamespace(demo=tmp_path / "cache" / "demo", nest_in_training=True)

    def train(model_prefix, **kw):
        built.append(model_prefix)
        for ext in (".model", ".vocab"):
            with open(model_prefix + ext, "w") as fh:
                fh.write(f"tokenizer {len(built)}")
        if len(built) == 1 and state.nest_in_training:  # job A's files written, not moved: job B builds meanwhile
            corpus.build_demo_corpus()

    monkeypatch.setitem(sys.modules, "sentencepiece", types.SimpleNamespace(
        SentencePieceTrainer=types.SimpleNamespace(train=train)))
    return state


def test_two_jobs_building_the_tokenizer_at_once(fresh_cache):
    jsonl, model = corpus.build_demo_corpus()
    with open(model) as fh:
        assert fh.read() == "tokenizer 2"  # job B's, there first: kept (it may have been read), A's dropped
    assert sorted(os.listdir(fresh_cache.demo)) == ["stdlib.jsonl", "stdlib_sp.model", "stdlib_sp.vocab"]


def test_two_jobs_writing_the_corpus_at_once(fresh_cache, monkeypatch):
    relpath, calls, fresh_cache.nest_in_training = os.path.relpath, [], False

    def second_job_meanwhile(path, start=None):  # job A is writing its JSONL: job B builds everything meanwhile
        calls.append(path)
        if len(calls) == 1:
            corpus.build_demo_corpus()
        return relpath(path, start)

    monkeypatch.setattr(corpus.os.path, "relpath", second_job_meanwhile)
    jsonl, _ = corpus.build_demo_corpus()
    with open(jsonl) as fh:
        rows = [json.loads(line) for line in fh]  # whole lines of one writer
    assert [r["source"] for r in rows] == ["m0.py", "m1.py", "m2.py"]
    assert sorted(os.listdir(fresh_cache.demo)) == ["stdlib.jsonl", "stdlib_sp.model", "stdlib_sp.vocab"]
