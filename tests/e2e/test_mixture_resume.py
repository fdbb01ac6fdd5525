"""End to end: a stage with a 2-source mixture over a prepared folder and 30% short-context replay (64-token
samples packed in pairs), SIGTERM mid-stage, resume: the per-step losses equal an uninterrupted run's (fp32,
1e-6), i.e. the mixture and replay samplers resumed at the exact micro-batch; the replay share is in the metrics."""

from __future__ import annotations

import json

import pytest

from tests.conftest import write_token_jsonl
from tests.distributed import run
from tests.runs import TRAIN, losses, preempt_after, train_args

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def mixture_args(assets, tmp_path_factory):
    from data.prepare_data import main

    d = tmp_path_factory.mktemp("mix")
    a = write_token_jsonl(str(d / "a.jsonl"), n_docs=30, seed=1)
    b = write_token_jsonl(str(d / "b.jsonl"), n_docs=30, seed=2)
    assert main(["--input", a, "--input", b, "--output", str(d / "prep"), "--vocab_size", "2048", "--workers", "0"]) == 0
    (d / "recipe.yaml").write_text("stages:\n  - {name: mix, data: [{name: a, source: a, weight: 0.7}, "
                                   "{name: b, source: b, weight: 0.3}], replay: {64: 0.3}}\n")

    def args(out):
        x = train_args(assets, out, 2, extra=["--config", str(d / "recipe.yaml")])
        x[x.index("--dataset_path") + 1] = str(d / "prep")
        return x

    return args


@pytest.mark.slow  # make test's budget; exact resume: test_resume.py, the mixture's position: tests/unit/data
def test_mixture_sigterm_then_resume_matches_uninterrupted(mixture_args, tmp_path):
    ref_out = tmp_path / "ref"
    run(TRAIN, mixture_args(ref_out), 2, str(tmp_path / "ref_logs"))
    ref = losses(ref_out)
    assert sorted(ref) == list(range(1, 9))
    out = tmp_path / "out"
    saved = preempt_after(mixture_args(out), 2, out, str(tmp_path / "logs1"), steps=3)
    assert 3 <= saved < 8
    run(TRAIN, mixture_args(out), 2, str(tmp_path / "logs2"))
    got = losses(out)
    assert sorted(got) == list(range(1, 9))
    for s in ref:
        assert abs(got[s] - ref[s]) <= 1e-6 * abs(ref[s]), (s, got[s], ref[s])
    with open(ref_out / "metrics.jsonl") as fh:
        last = [json.loads(x) for x in fh if '"loss"' in x][-1]
    assert last["share_replay64"] == pytest.approx(0.25) and last["share_a"] + last["share_b"] == pytest.approx(0.75)
