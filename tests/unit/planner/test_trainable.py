"""The length a run would train at (planner/trainable.py, issue 49): the longest whose step stays within 15 minutes
with memory_features auto's choice AT THAT LENGTH, and one is given where the asked length does not fit. No torch;
about a second in all."""

from __future__ import annotations

import importlib.util
import os

from planner import step_time as st
from planner import trainable
from planner.memory_model import Features, load_shape
from planner.zero3_host import zero3_state_terms

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), *[os.pardir] * 3))
_spec = importlib.util.spec_from_file_location("plan", os.path.join(ROOT, "scripts", "plan.py"))
plan = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plan)
LLAMA = load_shape("llama3-8b")
ARGV_32 = ["--model", "llama3-8b", "--alst", "--attention_head_chunks", "max", "--gpus_per_node", "8", "--nodes", "4",
           "--cpu_mem_gb", "2048"]


def test_the_15_minute_length_is_autos_choice_there_not_the_longest_lengths_features():
    """--compare's second table kept each row's features (every layer's attention recomputed, the 32-GPU row's K/V in
    a ring): 549,312 / 1,631,328 / 2,534,080. At those lengths auto keeps the attention (and the 32-GPU row gathers
    K/V), ~1.3x faster, so a run trains longer within 15 minutes: on 32 GPUs ~3.8M."""
    rows = plan.compare()
    for r in rows:
        fixed = st.longest_within(st.TRAINABLE_S, LLAMA, r["sp"], Features(**r["features"]), world=r["gpus"],
                                  ranks_per_node=r["gpus"] // r["nodes"], cp=r["cp"])
        assert r["within_15_min"] >= fixed, (r["gpus"], r["within_15_min"], fixed)
    fixed32 = st.longest_within(st.TRAINABLE_S, LLAMA, 32, Features(**rows[2]["features"]), world=32,
                                ranks_per_node=8, cp=4)
    assert rows[2]["within_15_min"] > 1.4 * fixed32
    eight, thirty_two = rows[1]["within_15_min_at"], rows[2]["within_15_min_at"]
    assert "attention kept" in eight["features"] and "attention kept" in thirty_two["features"]
    assert "ring" not in thirty_two["features"] and rows[2]["features"]["ring_attention"]
    # the 8-GPU length is memory-bound: one unit longer, keeping the attention no longer fits and the step with the
    # attention recomputed is over 15 minutes
    run = trainable.AutoRun.of_args(plan.build_parser().parse_args(ARGV_32[:5] + ["--gpus_per_node", "8", "--cpu_mem_gb",
                                                                                  "2048", "--seq_len", "1M"]))
    c, t = trainable.auto_step(LLAMA, eight["seq_len"] + 8, 8, 1, run)
    assert not c.features.keep_attention and t > st.TRAINABLE_S > eight["step_s"]


def test_a_shorter_length_is_given_where_the_asked_one_does_not_fit():
    """16M on 32 GPUs without the ring fits no split: the line said 'none (nothing fits)'; now the length a run
    trains at the largest split (the same as --compare's 32-GPU row: same split, same auto)."""
    p = plan.plan(ARGV_32 + ["--seq_len", "16M"])["plans"][0]
    assert p["recommended_sp"] is None and p["within_15_min"] == plan.compare()[2]["within_15_min"]
    assert 0 < p["within_15_min"] < 16 * 2**20 and (p["within_15_min_at"]["sp"], p["within_15_min_at"]["cp"]) == (32, 4)
    text = plan.render(plan.plan(ARGV_32 + ["--seq_len", "16M"]))
    assert f"{p['within_15_min']:,} at the largest split, sp=32=8x4" in text
    assert "at 16,777,216 these features fit no split" in text and "nothing fits" not in text
    # nothing at any length: a GPU too small for the model states
    none = plan.plan(["--model", "llama3-8b", "--seq_len", "4k", "--gpus_per_node", "1", "--gpu_mem_gb", "3"])
    assert none["plans"][0]["within_15_min"] is None
    assert "at most 15.0 min: none (nothing fits at the largest split)" in plan.render(none)


def test_the_search_is_a_bracketed_bisection(monkeypatch):
    """Cost: ~log2(length / unit) calls of auto's choose, bracketed by the no-feature step time (the module
    docstring); the cached host terms make each call ~5x cheaper (zero3_state_terms ran for every feature set)."""
    calls = []
    real = trainable.choose
    monkeypatch.setattr(trainable, "choose", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    trainable.auto_step.cache_clear()
    run = trainable.AutoRun(world=8, ranks_per_node=8, budget_bytes=78 * 2**30,
                            offloads=Features(offload_params=True, offload_optimizer=True, lean_rmsnorm=True,
                                              lean_mlp=True), host_bytes_per_rank=250 * 2**30)
    got = trainable.longest_trainable(st.TRAINABLE_S, LLAMA, 8, 1, run)
    assert got["seq_len"] > 1_000_000 and len(calls) <= 22 and max(calls) < 2 * got["seq_len"]
    f = Features(offload_params=True, offload_optimizer=True)
    gpu, cpu = zero3_state_terms(LLAMA, 8, 2, f, True, True, 2**64 - 1, False, True)
    cpu["mutated"] = 1  # estimate adds its own terms to these dicts: each call gets its own
    assert "mutated" not in zero3_state_terms(LLAMA, 8, 2, f, True, True, 2**64 - 1, False, True)[1]
