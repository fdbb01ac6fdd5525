"""Between-stage evaluation compares like with like (auditE3 findings 2-5): retention and the held-out conversation loss
are scored on one sample count for the whole run and record it, eval_summary / summary.md say when two records
differ (or predate the count); --eval_passkey_trials sets passkey's count in a tasks mapping; every trial is seeded by
its (task, length, depth, index); the loss-by-position table has a header per bucket count. Stand-in model
(test_heldout_chat.TokenEngine), no launch: ~2 s."""

from __future__ import annotations

import types

import numpy as np
import pytest

import training.evaluation as ev
from data.tokenizer import Tokenizer
from tests.unit.training.test_eval_settings import _evals
from tests.unit.training.test_eval_summary import eval_summary
from tests.unit.training.test_heldout_chat import DIMS1, SP, TokenEngine
from training.eval_tables import eval_tables
from training.evaluation import evaluate_stage, task_trials

METRICS = types.SimpleNamespace(log_eval=lambda *a: None, log_table=lambda *a, **k: None)


def _stage(i, n, kind, samples):
    return types.SimpleNamespace(index=i, name=f"s{i}", max_seq_length=n, kind=kind,
                                 eval={"heldout_samples": samples, "position_buckets": 0, "tasks": []})


def _sample(i, n, sft=False):
    """Held-out sample i of length n: other tokens per i, so that 2 samples and 4 give other mean losses."""
    ids = (np.arange(n) * (i + 1) + 3 * i) % 50 + 5
    labels = np.r_[ids[1:], -100]
    if sft:
        labels[: n // 2] = -100
    return {"input_ids": ids, "shift_labels": labels, "position_ids": np.arange(n)}


def _heldout_at(seq_len, n, sft=False):
    return [_sample(i + 10 * sft, seq_len, sft) for i in range(n)]


def test_retention_and_the_chat_loss_use_one_sample_count_for_the_run():
    """r4.yaml: stage a (500 tokens, 2 held-out samples), b (1000, 4): b's retention at 500 was scored on 4 samples,
    so a -> b compared other sets (shown gain 0.577, true 0.363). Now every stage scores the run's smallest count (2)
    and records it; the SFT stage asking 4 scores the same 2 conversations as the text stages before it."""
    engine = TokenEngine(64)
    stages = [_stage(0, 8, "text", 2), _stage(1, 16, "text", 4), _stage(2, 16, "sft", 4)]
    rows = [evaluate_stage(engine, st, DIMS1, _heldout_at(st.max_seq_length, st.eval["heldout_samples"],
                                                          st.kind == "sft"), None, METRICS, st.index, 1, 0, stages,
                           _heldout_at) for st in stages]
    assert rows[0]["heldout_loss_first_len"] == rows[0]["heldout_loss"]  # stage 0 asked the run's count: its own
    assert rows[1]["heldout_loss_first_len"] == pytest.approx(rows[0]["heldout_loss_first_len"])
    assert [r["heldout_first_len_samples"] for r in rows] == [2, 2, 2]
    assert rows[2]["heldout_chat_loss"] == pytest.approx(rows[0]["heldout_chat_loss"]) != rows[2]["heldout_loss"]
    assert [r["heldout_chat_samples"] for r in rows] == [2, 2, 2]


def test_eval_summary_and_the_table_say_when_counts_differ(tmp_path):
    a = {"stage": 0, "stage_name": "a", "step": 5, "seq_len": 500, "first_len": 500, "heldout_loss": 6.7523,
         "heldout_loss_first_len": 6.7523, "heldout_first_len_samples": 2}
    b = {"stage": 1, "stage_name": "b", "step": 10, "seq_len": 1000, "first_len": 500, "heldout_loss": 6.0,
         "heldout_loss_first_len": 6.1758, "heldout_first_len_samples": 4}
    line = eval_summary.headline([a, b])[0]
    assert "held-out loss at 500: 6.7523 and 6.1758 scored on 2 / 4 held-out samples" in line and "->" not in \
        line.split(": ", 1)[1], line
    assert "heldout_loss@500: scored on 2 / 4 held-out samples" in "\n".join(eval_tables([a, b]))
    old = [{k: v for k, v in r.items() if k != "heldout_first_len_samples"} for r in (a, b)]  # before the count
    assert "6.7523 -> 6.1758 (sample counts not recorded" in eval_summary.headline(old)[0]
    same = eval_summary.headline([a, {**b, "heldout_first_len_samples": 2}])[0]
    assert "held-out loss at 500: 6.7523 -> 6.1758;" in same and "samples" not in same


def test_the_passkey_trials_flag_sets_a_tasks_mappings_passkey_count(tmp_path):
    """recipes/tiny_cpu.yaml counts its tasks ({passkey: 5, ...}): --eval_passkey_trials 1 planned 5 passkey trials."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("eval_tasks: {passkey: 3}\nstages:\n"
                      "  - {name: a, max_seq_length: 64, eval: {tasks: {passkey: 5, niah_multikey: 1}}}\n"
                      "  - {name: b, max_seq_length: 128}\n  - {name: c, max_seq_length: 128, eval: {tasks: [passkey]}}\n")
    a, b, c = _evals(["--config", str(recipe), "--eval_passkey_trials", "1"])
    assert [task_trials(e, object()) for e in (a, b, c)] == [{"passkey": 1, "niah_multikey": 1}, {"passkey": 1},
                                                             {"passkey": 1}]
    with pytest.raises(ValueError, match=r"^--eval_tasks gives passkey 4 trials per depth and --eval_passkey_trials 1"):
        _evals(["--config", str(recipe), "--eval_tasks", "passkey:4", "--eval_passkey_trials", "1"])


def test_every_stage_asks_the_same_question_at_a_shared_length_depth_and_trial(monkeypatch):
    """Stage s512 (4 trials x 3 depths) and s2k (10 x 5) asked other passkeys at 256 tokens, depth 0.5: one RNG per
    (task, length) ran through the depths and trials before it."""
    asked = []

    def stats(engine, samples, *a, **k):
        asked.append(samples)
        return ev.torch.zeros(len(samples), 3)

    monkeypatch.setattr(ev, "sample_stats", stats)
    tok = Tokenizer(SP)
    ev.task_scores(None, DIMS1, 1, 0, tok, {"passkey": 4}, [0.1, 0.5, 0.9], 256)
    ev.task_scores(None, DIMS1, 1, 0, tok, {"passkey": 10}, [0.1, 0.3, 0.5, 0.7, 0.9], 256)
    short, long = asked
    at_half = [s["input_ids"].tolist() for s in short[4:8]], [s["input_ids"].tolist() for s in long[20:24]]
    assert at_half[0] == at_half[1]
    assert len({str(x) for x in at_half[0]}) == 4  # four different questions, not one repeated


def test_position_tables_are_headed_by_each_rows_bucket_count():
    rows = [{"stage": 0, "stage_name": "a", "step": 1, "seq_len": 8, "heldout_loss_by_position": [4.0, 3.0, 2.0, 1.0],
             "position_by": "document"},
            {"stage": 1, "stage_name": "b", "step": 2, "seq_len": 16, "position_by": "document",
             "heldout_loss_by_position": [8.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.0]}]
    md = "\n".join(eval_tables(rows))
    assert "| stage | seq_len | 1/4 | 2/4 | 3/4 | 4/4 |\n|---|---|---|---|---|---|\n| 0 | 8 | 4.000 | 3.000 |" in md, md
    assert "| 8/8 |\n|---|---|---|---|---|---|---|---|---|---|\n| 1 | 16 | 8.000 |" in md, md


def test_the_record_holds_each_trials_match_and_how_positions_were_bucketed():
    """task_hits: each trial's exact match in trial order (what eval_summary compares cell by cell); position_by:
    "document" where the held-out samples' positions restart at their documents, "sample" where they do not (a run
    with --reset_position_ids no: the buckets are offsets in the sample; it was recorded "document" either way)."""
    tok = Tokenizer(SP)
    out = ev.evaluate_tasks(TokenEngine(tok.vocab_size), DIMS1, 1, tok.pad_id, tok, {"passkey": 3}, [0.1, 0.5], [256])
    hits = out["task_hits"]["passkey"]["256"]
    assert sorted(hits) == ["0.1", "0.5"] and all(len(h) == 3 and set(h) <= {"0", "1"} for h in hits.values())
    assert {d: h.count("1") / 3 for d, h in hits.items()} == out["tasks"]["passkey"]["256"]
    st = types.SimpleNamespace(index=0, name="a", max_seq_length=16, kind="text",
                               eval={"heldout_samples": 2, "position_buckets": 4, "tasks": []})
    run_on = [_sample(i, 16) for i in range(2)]  # positions 0..15: one run of positions over the documents
    restarted = [{**s, "position_ids": np.r_[np.arange(6), np.arange(10)]} for s in run_on]
    got = [evaluate_stage(TokenEngine(64), st, DIMS1, held, None, METRICS, 1, 1, 0, [st], None)["position_by"]
           for held in (run_on, restarted)]
    assert got == ["sample", "document"]


def test_the_lengths_a_stage_evaluates_at_name_what_asks_them():
    """What training/device_fit.py plans a stage's evaluation at, with its own SP degree: a text stage before an SFT
    stage scores the held-out conversations at the SFT stage's longer length; eval.lengths all, the later lengths."""
    stages = [_stage(0, 8, "text", 2), _stage(1, 16, "sft", 2)]
    assert ev.eval_forward_lengths(stages[0], stages) == {
        8: ["the retention loss at the first stage's length"],
        16: ["the held-out conversation loss at the first SFT stage's length"]}
    stages[0].eval = {"heldout_samples": 0, "tasks": ["passkey"], "lengths": "all"}
    assert ev.eval_forward_lengths(stages[0], stages) == {8: ["eval.lengths all"], 16: ["eval.lengths all"]}


class _RunData:
    """A stand-in RunData: evaluate_stage reads whether the run restarts positions from the one `heldout_at` is of."""

    def __init__(self, restarts: bool):
        self.reset_position_ids = restarts

    def heldout(self, seq_len, n, sft=False):
        return _heldout_at(seq_len, n, sft)


def test_a_run_that_restarts_positions_records_document_buckets_with_one_document_samples():
    """evalG: held-out samples of one document each (a document longer than the sample) show no restart, and a run
    that restarts positions recorded "sample": the table's * blamed --reset_position_ids no on a run that never set
    it. The two readings agree there; the run's setting decides (given, or read from the RunData of `heldout_at`,
    as training/stage.py passes it); a run that does not restart still records "sample"."""
    st = types.SimpleNamespace(index=0, name="a", max_seq_length=16, kind="text",
                               eval={"heldout_samples": 2, "position_buckets": 4, "tasks": []})
    one_doc = [_sample(i, 16) for i in range(2)]  # positions 0..15: one document, no restart inside

    def by(**kw):
        return evaluate_stage(TokenEngine(64), st, DIMS1, one_doc, None, METRICS, 1, 1, 0, [st], **kw)["position_by"]

    assert by(heldout_at=_RunData(True).heldout) == "document"
    assert by(heldout_at=_RunData(False).heldout) == "sample"
    assert by(heldout_at=None, restarts=True) == "document"
    assert ev.position_by(one_doc, True) == "document" and ev.position_by(one_doc, False) == "sample"
    sft = types.SimpleNamespace(**{**vars(st), "kind": "sft"})  # conversations: restarted whatever the samples show
    assert evaluate_stage(TokenEngine(64), sft, DIMS1, one_doc, None, METRICS, 1, 1, 0, [sft], None)[
        "position_by"] == "document"
    md = "\n".join(eval_tables([{"stage": 0, "stage_name": "a", "step": 1, "seq_len": 16, "position_by": "document",
                                 "heldout_loss_by_position": [2.0, 1.0, 1.0, 1.0]}]))
    assert "| 0 | 16 | 2.000 |" in md  # no * on it


def test_a_depth_given_twice_asks_its_trials_once():
    """`--depths 0.5,0.5` (or eval.depths [0.5, 0.5]) asked each trial twice: twice the forwards, the cell's hits
    string twice as long. The depths are asked once each, in the order given."""
    tok = Tokenizer(SP)
    out = ev.evaluate_tasks(TokenEngine(tok.vocab_size), DIMS1, 1, tok.pad_id, tok, {"passkey": 2}, [0.5, 0.1, 0.5],
                            [256])
    assert list(out["task_hits"]["passkey"]["256"]) == ["0.5", "0.1"]
    assert all(len(h) == 2 for h in out["task_hits"]["passkey"]["256"].values())
    assert ev.stage_depths({"depths": [0.5, 0.5, 0.9]}) == [0.5, 0.9]
