"""scripts/evaluate.py's results: eval.json strict (null, never a bare NaN, which jq and most readers refuse: a held-out
set's non-finite loss was written as NaN, as eval/stage{N}.json was before training/metrics.strict), and the line a
model's result is printed in rounded as summary.md rounds it (it printed `0.15999999999999998`)."""

from __future__ import annotations

import json

from training.eval_report import said, write_results


def _result(loss: float) -> dict:
    return {"model": "m", "kind": "hf", "rope": None, "trials": {"passkey": 5}, "chat": "plain",
            "tasks": {"passkey": {"256": {"0.1": 0.2, "0.5": 0.12}}}, "task_mean": {"passkey": {"256": 0.15999999999999998}},
            "task_loss": {"passkey": {"256": {"0.1": float("nan"), "0.5": 1.5}}}, "heldout_chat_loss": loss,
            "heldout_chat_tokens": 10, "heldout_chat_conversations": 2, "heldout_chat_length": 256}


def test_eval_json_is_strict_and_the_printed_line_rounded(tmp_path):
    results = [_result(float("nan")), _result(2.5)]
    write_results(str(tmp_path), results, {"passkey": {"256": {"0.1": 0.0, "0.5": 0.0}}})

    def refuse(name):
        raise AssertionError(f"{name} in eval.json")

    got = json.loads((tmp_path / "eval.json").read_text(), parse_constant=refuse)
    assert got["models"][0]["heldout_chat_loss"] is None and got["models"][0]["heldout_chat_loss_nonfinite"] == "nan"
    assert got["models"][0]["task_loss"]["passkey"]["256"]["0.1"] is None and got["difference"]["passkey"]["256"] == {
        "0.1": 0.0, "0.5": 0.0}
    assert got["models"][1]["heldout_chat_loss"] == 2.5 and (tmp_path / "summary.md").is_file()
    assert results[0]["heldout_chat_loss"] != results[0]["heldout_chat_loss"]  # the results themselves untouched
    line = said(results[1])
    assert line == "passkey 256: 0.16, held-out conversation loss 2.5000", line
    assert said({"task_mean": {"passkey": {"256": 1.0, "512": 0.5}}}) == "passkey 256: 1.00 512: 0.50"
