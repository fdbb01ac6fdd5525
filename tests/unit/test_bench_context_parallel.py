"""bench/context_parallel.py's pure parts: the plan of (ulysses, cp) launches, the step summary, the other
processes' CPU share, the ratios against pure Ulysses and the docs page rendered from a run's JSON. Nothing is
launched."""

from __future__ import annotations

import pytest

from bench import context_parallel as bcp


def test_plan_groups_by_sp_pure_ulysses_first_hybrids_only_at_hybrid_sp():
    assert bcp.plan([2, 3, 4], 4, heads=12, kv_heads=12) == [(2, 1), (1, 2), (3, 1), (1, 3), (4, 1), (2, 2), (1, 4)]
    # 9 heads: Ulysses 2 and 4 impossible, so SP 2 and 4 run pure cp and (at 4) the hybrids the heads allow: none
    assert bcp.plan([2, 3], 4, heads=9, kv_heads=3) == [(1, 2), (3, 1), (1, 3), (1, 4)]
    assert bcp.plan([6], 6, heads=12, kv_heads=12) == [(6, 1), (3, 2), (2, 3), (1, 6)]  # every split of 6


def test_step_summary_leaves_out_warmup_and_keeps_the_max_peak():
    steps = [{"tokens_per_s": t, "peak_mem_gb": m} for t, m in ((100, 0.5), (300, 0.6), (900, 0.55), (1000, 0.6),
                                                                  (800, 0.6))]
    s = bcp.step_summary(steps, warmup=2)
    assert s["tokens_per_s"] == 900 and s["peak_mem_gb"] == 0.6 and len(s["step_tokens_per_s"]) == 5
    assert bcp.step_summary(steps[:2], warmup=2)["tokens_per_s"] == 200  # too few: all of them
    skipped = {"tokens_per_s": None, "peak_mem_gb": 0.1, "optimizer_skipped": True}  # ran nothing (training/stage.py)
    assert bcp.step_summary([*steps[:3], skipped, *steps[3:]], warmup=2) == s


def test_other_cpu_share():
    line = "cpu  100 5 50 1000 20 3 2 7 0 0"
    assert bcp.busy_jiffies(line) == 100 + 5 + 50 + 3 + 2 + 7  # idle and iowait left out
    assert bcp.other_cpu(busy_s=30, ours_s=10, wall_s=10, ncpu=2) == 1.0  # others used both cores throughout
    assert bcp.other_cpu(busy_s=10, ours_s=12, wall_s=10, ncpu=2) == 0.0  # never negative
    assert bcp.other_cpu(busy_s=1, ours_s=0, wall_s=0, ncpu=2) == 0.0


def _pt(u, cp, tps, peak, base=False, ok=True):
    return {"ulysses": u, "cp": cp, "sp": u * cp, "tokens_per_s": tps, "peak_mem_gb": peak, "baseline": base,
            "ok": ok, "other_cpu": 0.05, "error": "exit codes [1, 1]"}


@pytest.fixture
def result():
    points = [_pt(2, 1, 10, 0.5, base=True), _pt(2, 1, 1000, 0.9), _pt(1, 2, 800, 1.0),
              _pt(4, 1, 20, 0.45, base=True), _pt(4, 1, 1200, 0.75), _pt(2, 2, 1100, 0.8), _pt(1, 4, 900, 0.85),
              _pt(1, 3, 0, 0, ok=False)]
    bcp.add_net(points)
    return {"points": points, "comparisons": bcp.comparisons(points), "hybrid_sp": 4, "command": "python -m x",
            "started_utc": "2026-11-25 18:00", "sweep_seconds": 400, "seq_len": 6144, "steps": 6, "warmup": 2,
            "baseline_len": 384, "reset_position_ids": "no", "machine": {"cpus": 2},
            "model_config": {"hidden_size": 384, "num_hidden_layers": 2, "num_attention_heads": 12,
                             "num_key_value_heads": 12, "vocab_size": 2048},
            "load": {"before": [1.0, 1, 1], "after": [4.2, 3, 2], "other_cpu_min": 0.01, "other_cpu_max": 0.05}}


def test_comparisons_against_pure_ulysses_of_the_same_sp(result):
    c = {(x["ulysses"], x["cp"]): x for x in result["comparisons"]}
    assert set(c) == {(1, 2), (2, 2), (1, 4)}  # baselines, pure Ulysses and failed points are not compared
    assert c[(1, 2)] == {"sp": 2, "ulysses": 1, "cp": 2, "tokens_per_s_ratio": 0.8, "peak_ratio": 1.111,
                         "net_ratio": 1.25}
    assert c[(2, 2)]["tokens_per_s_ratio"] == round(1100 / 1200, 3) and c[(2, 2)]["net_ratio"] == round(0.35 / 0.3, 3)


def test_render_markdown_holds_the_table_ratios_and_load(result):
    md = bcp.render_markdown(result)
    assert "| 2 x 2 | hybrid | 4 | 1100 | 0.800 | 0.350 | 0.92 | 1.07 | 1.17 | 0.05 |" in md
    assert "| 4 x 1 | pure Ulysses | 4 | 1200 | 0.750 | 0.300 | 1 | 1 | 1 | 0.05 |" in md
    assert "| 1 x 3 | pure cp | 3 | FAILED |" in md
    assert all(len(ln) <= 110 for ln in md.splitlines() if not ln.startswith("|"))  # prose wrapped
    md = " ".join(md.split())
    assert "**(a) Hybrid vs pure Ulysses at SP=4**" in md
    assert "2 x 2: tokens/s 0.92x, peak 1.07x, net 1.17x; 1 x 4: tokens/s 0.75x" in md
    assert "**(b) The cost of cp" in md and "1 x 2: tokens/s 0.80x, peak 1.11x, net 1.25x" in md
    assert "load average 1.00 before, 4.20 after" in md and "0.01-0.05 (quiet)" in md
    result["load"]["other_cpu_max"] = 0.6
    assert "the machine was shared" in " ".join(bcp.render_markdown(result).split())
