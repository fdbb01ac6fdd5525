"""What the start says of each stage's context (data/coverage.py `length_lines`, `start_notes`; the stage-data audit):
a stage whose documents are all shorter than the stage before trains no longer context, silently (with document
masking, what the stage before trained, at more cost): its share of tokens in pieces longer than the previous length
is said for every stage at the start and in `--dry_run` on a prepared folder, with a warning at 0%; the draw notes of
every stage are said at the start, once (they came when each stage began: at 1M, days in); whether document masking
is on is said. One process, small prepared folders: a few seconds."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest

from data.packing import DocPack
from data.prepare_data import main


def _prepared(tmp_path, lens, name="d") -> str:
    """A prepared folder of documents of `lens` tokens (ids < 100), in that order."""
    src = tmp_path / f"{name}.jsonl"
    src.write_text("".join(json.dumps({"input_ids": [5 + d % 50] * n}) + "\n" for d, n in enumerate(lens)))
    out = str(tmp_path / f"{name}_prep")
    assert main(["--input", str(src), "--output", out, "--vocab_size", "100", "--workers", "0"]) == 0
    return out


def _stage(i, n, steps=10, **kw):
    return types.SimpleNamespace(**{"index": i, "name": f"s{i}", "max_seq_length": n, "max_steps": steps, "sp": 1,
                                    "eval": {"heldout_samples": 1}, "data": None, "replay": None, "tasks": None,
                                    "kind": "text", **kw})


SHORT = [int(x) for x in np.random.default_rng(0).integers(20, 244, 3000)]  # the audit's corpus: every doc < 256


def test_a_stage_of_documents_shorter_than_the_stage_before_is_said_at_the_start(tmp_path, capsys):
    """Documents <= 244 tokens, stages 256 -> 512 (the audit's r_short): 0% of stage 1's tokens are in pieces longer
    than 256, said at the start with a warning naming the fix; nothing was said, at the start or ever."""
    from data.pipeline import open_run_data

    stages = [_stage(0, 256), _stage(1, 512)]
    capsys.readouterr()
    open_run_data(_prepared(tmp_path, SHORT), None, 100, stages, reset_position_ids=True)
    out = capsys.readouterr().out
    assert "\ndata: document masking on (positions restart at each document" in "\n" + out, out
    assert ("stage 1 (s1), 512 tokens: 0% of its tokens are in document pieces longer than 256 (stage 0's length), 0% "
            "of its samples hold one\n") in out, out
    warning = next(ln for ln in out.splitlines() if ln.startswith("warning: stage 1 (s1)"))
    assert "trains no context longer than stage 0's 256 tokens: its data holds no document longer than 256 (the " \
           "longest: 243 tokens); with document masking it trains what stage 0 trained, at more cost" in warning
    assert "min_doc_tokens: 256" in warning and "docs/data.md#choosing-length-buckets-per-stage" in warning
    # --reset_position_ids no (finding 6): positions reach 512, across unrelated documents only: said per stage
    open_run_data(_prepared(tmp_path, SHORT, "e"), None, 100, stages, reset_position_ids=False)
    out = capsys.readouterr().out
    assert "data: document masking off (--reset_position_ids no" in out
    assert "0% of its samples hold one (--reset_position_ids no: every sample's positions run to 512, but only " \
           "these pieces are one document's context" in out and "its positions past 256 see only unrelated" in out


def test_a_long_component_or_tasks_are_no_warning(tmp_path, capsys):
    """Books of 400-900 tokens among web pages: the whole stream trains a few percent past 256; a long component at
    60% (ProLong's split) most of it; a stage with `tasks:` is not warned of (its synthetic samples span it)."""
    from data.coverage import length_lines
    from data.pipeline import RunData

    lens = np.asarray(SHORT[:2000] + [600] * 12, np.int64)
    source = np.asarray([0] * 2000 + [1] * 12)
    prepared = types.SimpleNamespace(lens=lens, starts=np.concatenate([[0], np.cumsum(lens)[:-1]]), source=source,
                                     sources=["web", "books"], mask=None)
    data = RunData(prepared, lens.copy(), np.zeros(0, np.int64), None, reset_position_ids=True)
    mix = [{"name": "long", "source": "*", "weight": 0.6, "min_doc_tokens": 256},
           {"name": "short", "source": "web", "weight": 0.4}]
    lines = length_lines(data, [_stage(0, 256), _stage(1, 512), _stage(2, 512, data=mix)], header=False)
    assert len(lines) == 1 and " 0%" not in lines[0] and "stage 1 (s1)" in lines[0]  # 512 -> 512: not a longer stage
    lines = length_lines(data, [_stage(0, 256), _stage(1, 512, data=mix)], header=False)
    assert lines[0].startswith("stage 1 (s1), 512 tokens: ") and "60.0% of its samples hold one" in lines[0], lines
    few = RunData(types.SimpleNamespace(**{**vars(prepared), "lens": lens[:2000], "source": source[:2000]}),
                  lens[:2000].copy(), np.zeros(0, np.int64), None, reset_position_ids=True)
    lines = length_lines(few, [_stage(0, 256), _stage(1, 512, tasks={"passkey": 0.1})], header=False)
    assert lines == ["stage 1 (s1), 512 tokens: 0% of its tokens are in document pieces longer than 256 (stage 0's "
                     "length), 0% of its samples hold one; besides, its tasks' synthetic samples (passkey) span its "
                     "whole length"], lines


def test_piece_stats_counts_what_docpack_trains():
    """The lengths-only count against the samples DocPack builds (positions restart at documents and samples)."""
    from data import coverage
    from data.coverage import piece_stats

    rng = np.random.default_rng(1)
    for chunk in (3, 1 << 22):
        coverage._CHUNK, got, want = chunk, [], []
        for _ in range(30):
            lens = rng.integers(1, 1500, rng.integers(2, 30))
            n, longer = int(rng.choice([128, 512])), int(rng.integers(1, 500))
            if lens.sum() < n:
                continue
            pack = DocPack(np.zeros(int(lens.sum()), np.int64), np.concatenate([[0], np.cumsum(lens)[:-1]]), lens, n,
                           True)
            tok = hit = 0
            for i in range(len(pack)):
                runs = np.diff(np.flatnonzero(pack[i]["position_ids"] == 0).tolist() + [n])
                tok, hit = tok + int(runs[runs > longer].sum()), hit + bool(runs.max() > longer)
            t, total, h, samples = piece_stats(lens, n, longer)
            got.append((t, total, h, samples))
            want.append((tok, len(pack) * n, hit, len(pack)))
        assert got == want


def test_every_stages_draw_notes_are_said_at_the_start_once(tmp_path, capsys):
    """check_batches given the run's accumulation says every stage's draw notes at the start; the stage's own start
    (training/stage.py: draw_notes) then leaves them out. Without it, as before: said when the stage begins."""
    from data.coverage import draw_notes
    from data.pipeline import open_run_data

    stages = [_stage(0, 256, steps=40), _stage(1, 512, steps=40)]
    data = open_run_data(_prepared(tmp_path, SHORT), None, 100, stages, reset_position_ids=True)
    later = draw_notes(data, stages, stages[1], 1, 4, 1)
    assert later and any("draws its samples from the whole stream again" in n for n in later), later
    capsys.readouterr()
    data.check_batches(stages, world=1, micro_batch=4, grad_accum=1)
    out = capsys.readouterr().out
    assert all(n in out for n in later), out
    assert draw_notes(data, stages, stages[1], 1, 4, 1) == []  # said: not again at the stage's start
    data.check_batches(stages, world=1, micro_batch=4, done=80, grad_accum=1)  # a resume past both: nothing
    assert capsys.readouterr().out == ""


def test_the_start_notes_are_made_inside_rank_0s_bounded_wait(tmp_path, monkeypatch, capsys):
    """The notes rebuild each `data:` stage's mixture (minutes at 100M conversations): made after run_on_main, rank 0
    built them while the other ranks went on into a collective under NCCL's watchdog. Made inside run_on_main's
    function, the others wait on its bounded host wait."""
    import data.pipeline as pipeline
    from data.pipeline import open_run_data

    stages = [_stage(0, 256, steps=40), _stage(1, 512, steps=40)]
    data = open_run_data(_prepared(tmp_path, SHORT), None, 100, stages, reset_position_ids=True)
    inside, calls = [False], []

    def run_on_main(fn, long=False):
        inside[0] = True
        try:
            return fn()
        finally:
            inside[0] = False

    real = pipeline.start_notes
    monkeypatch.setattr(pipeline.comm, "run_on_main", run_on_main)
    monkeypatch.setattr(pipeline, "start_notes", lambda *a, **k: calls.append(inside[0]) or real(*a, **k))
    data.check_batches(stages, world=1, micro_batch=4, grad_accum=1)
    assert calls == [True]
    assert "draws its samples from the whole stream again" in capsys.readouterr().out


def test_the_dry_run_says_them_from_a_prepared_folder(tmp_path, capsys):
    """--dry_run on a prepared folder: the same per-stage lines and the draw notes, and the `data:` line says whether
    document masking is on (it never did)."""
    from training.startup import dry_run, load_run_config

    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model_name_or_path: tiny-llama\ndataset_path: {_prepared(tmp_path, SHORT)}\n"
                      "per_device_train_batch_size: 4\nstages:\n  - {name: a, max_seq_length: 256, max_steps: 40}\n"
                      "  - {name: b, max_seq_length: 512, max_steps: 40}\n")
    capsys.readouterr()
    dry_run(*load_run_config(["--dry_run", "--config", str(recipe), "--output_dir", str(tmp_path / "out")]))
    out = capsys.readouterr().out
    assert "(a prepared folder: text only); document masking on (--reset_position_ids auto)\n" in out, out
    assert "\nstage 1 (b), 512 tokens: 0% of its tokens are in document pieces longer than 256" in out, out
    assert "\nwarning: stage 1 (b) trains no context longer than stage 0's 256 tokens" in out
    assert "note: stage 1 (b) draws its samples from the whole stream again" in out


@pytest.fixture(autouse=True)
def _chunk():
    from data import coverage

    chunk = getattr(coverage, "_CHUNK", None)
    yield
    coverage._CHUNK = chunk
