"""scripts/eval_summary.py (what `make demo` and `make demo-sft` end with): a torn or hand-edited record under
OUTPUT_DIR/eval/ is one line naming that file and exit 2 (was `error: Expecting value: ...`, naming no file); a record
is strict JSON, and one written before (a bare NaN) is still read."""

from __future__ import annotations

import importlib.util
import json
import os

from tests.distributed import ROOT

_spec = importlib.util.spec_from_file_location("eval_summary", os.path.join(ROOT, "scripts", "eval_summary.py"))
eval_summary = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(eval_summary)


def test_a_corrupt_record_is_named_in_one_line(tmp_path, capsys):
    (tmp_path / "eval").mkdir()
    record = tmp_path / "eval" / "stage0.json"
    for body, says in (('{"stage": 0,\n', "not a readable evaluation record (Expecting property name"),
                       ("[1, 2]", "not an evaluation record (a JSON object)")):
        record.write_text(body)
        assert eval_summary.main([str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {record}: {says}") and err.count("\n") == 1, err


def test_a_length_the_first_stage_never_tried_is_compared_and_a_drop_flagged():
    """128k -> 256k -> 1M -> SFT at 128k: the SFT stage's passkey at 1M falls 1.00 -> 0.08. The headline compared only
    the lengths the first stage tried (1.00 -> 1.00 at 128k, the drop in the table alone); now each length the last
    stage tried is compared with the latest earlier stage that tried it, and a fall of 0.2 or more says DROPPED."""
    lengths = {"s128k": ["131072"], "s256k": ["131072", "262144"], "s1m": ["131072", "262144", "1048576"],
               "sft": ["131072", "262144", "1048576"]}
    rows = [{"stage": i, "stage_name": name, "step": i + 1, "seq_len": int(ns[-1]) if name != "sft" else 131072,
             "task_mean": {"passkey": {n: 0.08 if name == "sft" and n == "1048576" else
                                       0.85 if name == "sft" and n == "262144" else 1.0 for n in ns}}}
            for i, (name, ns) in enumerate(lengths.items())]
    line = eval_summary.headline(rows)[0]
    assert line.startswith("stage 0 (s128k) -> stage 3 (sft): ")
    assert "passkey at 131072: 1.00 (after stage 2 s1m) -> 1.00;" in line
    assert "passkey at 262144: 1.00 (after stage 2 s1m) -> 0.85;" in line  # a fall under 0.2: not flagged
    assert line.endswith("passkey at 1048576: 1.00 (after stage 2 s1m) -> 0.08 DROPPED"), line
    assert line.count("DROPPED") == 1
    # two stages: the before is the first record, not named
    assert eval_summary.headline(rows[:1] + rows[3:])[0].endswith("passkey at 131072: 1.00 -> 1.00")


def _record(stage, hits):
    """A stage's passkey record at 131072 from {depth: "1101"} (each trial's exact match, as evaluate_tasks writes)."""
    acc = {d: h.count("1") / len(h) for d, h in hits.items()}
    return {"stage": stage, "stage_name": f"s{stage}", "step": stage + 1, "seq_len": 131072,
            "task_seeds": "task:length:depth:trial", "tasks": {"passkey": {"131072": acc}},
            "task_mean": {"passkey": {"131072": sum(acc.values()) / len(acc)}},
            "task_hits": {"passkey": {"131072": hits}}}


def test_tasks_are_compared_over_the_cells_both_records_asked():
    """tiny_cpu_extend: a stage of 3 depths x 4 trials, then one of 5 x 10 whose extra depths 0 and 1 fail. The means
    over each record's own depths said `1.00 -> 0.60 DROPPED` while every question both asked went 1.00 -> 1.00 (a
    trial is seeded by task, length, depth and index: the first 4 trials of a depth are the same questions). Now the
    shared (depth, trial) cells are compared, and the line says so where the records asked other sets."""
    before = _record(0, {d: "1111" for d in ("0.1", "0.5", "0.9")})
    after = _record(1, {"0": "0" * 10, "0.1": "1" * 10, "0.5": "1" * 10, "0.9": "1" * 10, "1": "0" * 10})
    (line,) = eval_summary.task_moves([before, after])
    assert line == ("passkey at 131072: 1.00 -> 1.00 (over the 3 x 4 depth x trial cells both asked; the records asked "
                    "3 x 4 and 5 x 10)"), line
    after["task_hits"]["passkey"]["131072"]["0.5"] = "0000111111"  # a real fall in the shared cells is still flagged
    (line,) = eval_summary.task_moves([before, after])
    assert line.startswith("passkey at 131072: 1.00 -> 0.67 (over the 3 x 4") and line.endswith(" DROPPED"), line
    same = _record(1, {d: "1101" for d in ("0.1", "0.5", "0.9")})  # the same cells: nothing to say
    assert eval_summary.task_moves([before, same]) == ["passkey at 131072: 1.00 -> 0.75 DROPPED"]
    for r in (before, after):  # records from before the hits were written: the depths both asked
        del r["task_hits"]
    after["tasks"]["passkey"]["131072"]["0.5"] = 1.0
    assert eval_summary.task_moves([before, after]) == [
        "passkey at 131072: 1.00 -> 1.00 (over the 3 depths both asked, of 3 and 5; trials per depth not recorded)"]


def _refuse(name):
    raise ValueError(f"bare {name} in strict JSON")


def test_a_record_with_an_empty_position_bucket_is_strict_json_and_both_forms_are_read(tmp_path, capsys):
    """evalG: eval/stage{N}.json wrote a position bucket no token reached as a bare NaN (metrics.jsonl wrote null; jq
    and most readers refuse NaN). Now null there too, and summary.md / eval_summary read it as `-`, as they read a
    record written before (NaN)."""
    from training.metrics import MetricsLogger

    m = MetricsLogger(str(tmp_path), True, "none", None, None, {}, 10, False)
    rec = {"stage": 0, "stage_name": "a", "step": 1, "seq_len": 16, "heldout_loss": 2.0, "position_by": "document",
           "heldout_loss_by_position": [2.5, 2.0, float("nan"), float("nan")]}
    m.log_eval(0, rec)
    text = (tmp_path / "eval" / "stage0.json").read_text()
    assert json.loads(text, parse_constant=_refuse)["heldout_loss_by_position"] == [2.5, 2.0, None, None]
    assert "| 0 | 16 | 2.500 | 2.000 | - | - |" in (tmp_path / "eval" / "summary.md").read_text()
    (tmp_path / "eval" / "stage1.json").write_text(json.dumps({**rec, "stage": 1, "stage_name": "b"}))  # bare NaN
    assert eval_summary.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| 0 | 16 | 2.500 | 2.000 | - | - |" in out and "| 1 | 16 | 2.500 | 2.000 | - | - |" in out, out
