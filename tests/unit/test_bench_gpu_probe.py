"""bench/gpu_probe.py's Probe on its own events (no model): a phase whose closing event never came (what the dry
run's intermittent failure looks like: a stage without its `between` records) is named in the records' errors at the
next step's start and closed there, so the next step is measured whole; every record says which phases are open."""

from __future__ import annotations

import json

from bench.gpu_probe import Probe


def test_a_phase_left_open_is_named_and_closed_at_the_next_steps_start(tmp_path):
    path = tmp_path / "phases.jsonl"
    probe = Probe(str(path))
    step = [("open", "forward", 0), ("close", "forward", 0), ("open", "mlp_backward", 0), ("close", "mlp_backward", 0),
            ("open", "attention_backward", 0), ("close", "attention_backward", 0)]
    for ev in step[:3] + [("open", "mlp_backward", 0)] + step[3:]:  # one extra open: one close never comes
        probe.event(*ev)
    for ev in step:
        probe.event(*ev)
    probe.event("close", "exit", -1)
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    assert any("left open at a step's start: mlp_backward L0" in e for e in probe.errors), probe.errors
    second = recs[[i for i, r in enumerate(recs) if r["phase"] == "forward"][1]:]  # the second step's records
    assert [r["phase"] for r in second if r["phase"] == "between"] == ["between"] * 3  # its segments, and the exit's
    assert all(r["open"] == [] for r in second if r["phase"] == "between")
    assert recs[0]["open"] == [] and any(r["open"] == ["mlp_backward L0"] for r in recs)
