"""The GPU check's CPU dry mode (`python -m bench.gpu --dry`): the same script as on a GPU, tiny shapes. First the
issue-43 sections: one step under memory_features auto with the per-phase probe in the rank (bench/gpu_probe.py:
forward, the checkpointed layer's recomputed forward, MLP and attention backward of each layer, logits), each
against the planner's figure for the configuration the run chose, then the same at the gap run's length; then the
document-masking parity against the plain model on each document alone, the ladder's one train.py launch (throughput
rungs with auto's features, then the planner's longest length under the cap and one above it), and the page
rendered from the JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.distributed import ROOT

PHASES = [("forward", 0), ("forward", 1), ("logits", -1), ("mlp_backward", 1), ("attention_backward", 1),
          ("recompute", 0), ("mlp_backward", 0), ("attention_backward", 0)]
HEADLINE_PHASES = [("forward", 0), ("forward", 1), ("logits", -1), ("recompute", 1), ("mlp_backward", 1),
                   ("attention_backward", 1), ("recompute", 0), ("mlp_backward", 0), ("attention_backward", 0)]


# slow (out of make test) since 2026-11-29: intermittent, 3 of ~12 runs (CI, two clean clones): a stage's probe lacks
# its between-phase records (a phase left open: a probe bug, not found yet; stop 58's note). Fast siblings:
# tests/unit/planner/test_plan_vs_run.py, test_phase_bytes.py (compare, segment_phase, planner_phases)
@pytest.mark.slow
def test_gpu_check_dry_run(tmp_path):
    out, page = tmp_path / "gpu.json", tmp_path / "gpu.md"
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-m", "bench.gpu", "--dry", "--out", str(out), "--page", str(page),
                        "--work", str(tmp_path / "work")], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    data = json.loads(out.read_text())
    # the step ran with the probe in its rank, every phase in backward order, against the planner; the headline
    # (issue 49) with its features pinned, long and gap (issue 43) with auto's choice under the dry pins
    for name, length in (("headline", 1536), ("long", 2048), ("gap", 1024)):
        run = data[name]
        assert run["steps_done"] == 1 and run["length"] == length and not run["kernel_errors"], run.get("error")
        ch = run["memory_choice"]
        assert ch["attention_head_chunks"] == 2
        probed = [(r["phase"], r["layer"]) for r in run["rows"] if r["phase"] not in ("between", "norm_backward")]
        # every segment of the step is a row: each layer's two norm backwards (after its MLP's and its attention's)
        norms = [(r["layer"], r["norm"]) for r in run["rows"] if r["phase"] == "norm_backward"]
        # (CI once saw no norm row at all, never reproduced here: the message says which stage and what it had)
        seen = (name, run.get("probe_records"), run.get("probe_errors"),
                [(r["phase"], r["layer"], r.get("segment")) for r in run["rows"]])
        assert {(1, "post-attention"), (1, "input"), (0, "post-attention"), (0, "input")} <= set(norms), seen
        assert all(r["planner_gib"] and r["ratio"] for r in run["rows"] if r["phase"] not in ("forward", "between"))
        assert run["usable_gib"] and not run["over_usable"]  # 8 GiB budget: nothing near it
        assert any(k.startswith("sdpa:") and v["calls"] > 0 for k, v in run["attention_kernels"].items())
        if name == "headline":
            assert probed == [p if p[0] != "mlp_backward" or p[1] else p for p in HEADLINE_PHASES], probed
            assert (ch["checkpoint_every"], ch["offload_activations"], ch["keep_attention"], ch["offload_params"],
                    ch["tiled_mlp"], ch["tiled_logits"]) == (1, True, False, True, True, True), ch
            assert run["engagement"]["offload_activations"]["engaged"] == 2
            continue
        assert ch["checkpoint_every"] == 2 and probed == PHASES, probed
        assert run["planner"]["terms_gib"]["consistent"] and not run["probe_errors"]
        assert run["step"]["measured_gib"] >= max(r["measured_gib"] for r in run["rows"])
        assert run["host"]["rss"]["measured_gib"] > 0
        # the savings the plan counts engaged as often as it expects (model_utils/engagement.py's counters)
        eng = run["engagement"]
        assert {"attention_head_chunks", "norm_recompute", "tiled_mlp"} <= set(eng), eng
        assert all(v["engaged"] == v["expected"] > 0 for v in eng.values()), eng
    assert data["skipped_for_time"] == []
    # the kernel probe (the headline's call through SDPA's default dispatch, named) and the arena probe ran
    (k,) = data["kernels"]
    assert k["ok"] and k["backend"] == "sdpa default" and k["dispatch_at_length"] and k["length"] == 1536
    assert data["arena"]["path"] == "pageable" and "register_s" in data["arena"]["rows"][0]
    assert data["auto_attention"] == {"skipped": "no CUDA: the probe times GPU kernels"}  # a GPU times auto's probe
    assert [r["backend"] for r in data["parity"]] == ["sdpa"] and data["parity"][0]["ok"]
    # the check can see a bug: attention across documents is far outside the tolerance
    assert data["parity"][0]["wrong_rel_err"] > 100 * data["parity"][0]["loss_tol"]
    rungs = data["ladder"]["rungs"]
    assert [r["kind"] for r in rungs] == ["throughput"] + ["ladder"] * 2
    assert all(r["fits"] and r["tokens_per_s"] > 0 and r["predicted_gib"] > 0 for r in rungs)
    assert rungs[1]["length"] == data["ladder"]["planner_longest_leanest"] // 512 * 512
    # which attention kernel the rungs ran (their MFU depends on it): recorded by the ranks themselves
    assert any(n.startswith("sdpa:") and v["calls"] > 0 for n, v in data["ladder"]["attention_kernels"].items())
    # every stage's final checkpoint but the newest was deleted while the launch ran (the device's disk holds ~3)
    assert len(data["ladder"]["pruned_checkpoints"]) == 2, data["ladder"]["pruned_checkpoints"]
    # the throughput rung ran train.py's own auto (head chunks included) and reports the choice the run recorded
    assert "memory_features: auto" in (tmp_path / "work" / "ladder.yaml").read_text()
    assert rungs[0]["features"]["attention_head_chunks"] >= 1 and rungs[0]["predicted_gib"] > 0, rungs[0]
    text = page.read_text()
    assert "_gib(" not in text and "None GiB" not in text
    assert "| recomputed forward | 0 |" in text and "| attention backward | 1 |" in text and "| 256 | throughput |" in text
    assert "## The 1-GPU headline's configuration" in text and "| norm backward (input) | 0 |" in text
    assert "## Attention kernels at the headline's call" in text and "## Host arena on this machine" in text


def long_plan():
    """The 1M run's plan as the GPU check makes it: Llama-3-8B's width and vocabulary, 2 layers, auto's choice on an
    80 GB card with both ZeRO offloads free; (shape, auto's Choice, its memory_choice record, planner_phases of it)."""
    from bench import gpu
    from planner import auto_features as af
    from planner.memory_model import Features, ModelShape

    shape = ModelShape.from_config(dict(gpu.LLAMA3_8B, num_hidden_layers=2, model_type="llama", head_dim=128))
    off = Features(offload_params=True, offload_optimizer=True, lean_rmsnorm=True, lean_mlp=True)
    c = af.choose(shape, gpu.LONG["gpu"], 1, af.gpu_budget(gpu.PLAN_GPU_GB), sp=1, offloads=off, device="cuda",
                  precision="bf16", ranks_per_node=1, free_offloads=("offload_params", "offload_optimizer"))
    choice = c.as_dict() | {"lean_rmsnorm": True, "lean_mlp": True}
    return shape, c, choice, gpu.planner_phases(shape, gpu.LONG["gpu"], choice, "cuda")


def test_gpu_check_plans_the_real_run():
    """The arithmetic the GPU run does before its launches, at the real shape (Llama-3-8B's width and vocabulary,
    2 layers, 1M tokens, an 80 GB card): auto's choice, the planner's per-phase figures and their decomposition
    (bench.gpu_compare.backward_terms reads planner.memory_model.layer_phase_terms, whose largest term
    layer_activations returns: `consistent`), and the gap run's length."""
    from bench import gpu
    from planner import auto_features as af
    from planner.memory_model import GiB

    shape, c, choice, plan = long_plan()
    assert plan["terms"]["consistent"], plan["terms"]
    assert abs(plan["step"] - c.peak_bytes) < 2**20  # the same configuration the run's start-up predicts
    assert plan["step"] <= af.usable_bytes(af.gpu_budget(gpu.PLAN_GPU_GB))
    lay = plan["layers"]
    # (the H200 run of 2026-11-27 checkpointed layer 0 of 2 and measured 72.1 GiB, 16 of them the head chunks' leaked
    # q/k/v (fixed in 3d77bdb); the planner now predicts that choice at 69.2 and auto takes it again, with 8 chunks)
    assert lay[0]["checkpointed"] and all(("recompute" in x) == x["checkpointed"] for x in lay.values())
    assert max(max(v for k, v in x.items() if k not in ("checkpointed",)) for x in lay.values()) <= plan["step"]
    at = gpu.gap_length(None, False, 78.5, left=600, shape=shape)
    assert at and at[1] == round(78.5 / 0.9 + 2, 3) and at[0] in gpu.GAP_LENGTHS["gpu"], at
    assert plan["step"] / GiB > 60  # the 1M step is near the 70.2 GiB the run allows itself


def test_gpu_check_flags_and_host_figures():
    """What only a GPU run produces, from stand-in probe records at the 1M plan's own figures: pinned host stats
    (torch.cuda.host_memory_stats' keys) and peak RSS against the planner, a phase 5% over (not flagged) and one 20%
    over (flagged bold on the page as the planner's next fix), the reserved-minus-allocated gap."""
    from bench import gpu
    from bench.gpu_page import render
    from planner.memory_model import GiB

    shape, c, choice, plan = long_plan()
    lay = plan["layers"]

    def rec(phase, layer, peak, **kw):
        return {"phase": phase, "layer": layer, "peak": int(peak), "reserved": int(peak + GiB), "peak_incl": int(peak),
                "reserved_incl": int(peak + GiB), "pid": 1, "rss": 30 * GiB, "rss_hwm": 40 * GiB, **kw}

    probe = [rec("forward", 0, 20 * GiB), rec("forward", 1, 30 * GiB),
             rec("between", -1, plan["logits"], after="close forward L1", before="open mlp_backward L1"),
             rec("mlp_backward", 1, 1.05 * lay[1]["mlp_backward"]),
             rec("attention_backward", 1, 1.2 * lay[1]["attention_backward"]),
             rec("recompute", 0, lay[0]["recompute"]), rec("mlp_backward", 0, lay[0]["mlp_backward"]),
             rec("attention_backward", 0, lay[0]["attention_backward"],
                 pinned={"allocated_bytes.current": int(plan["pinned"]), "num_host_alloc": 3})]
    got = gpu.compare(probe, plan, 2)
    rows = {(r["phase"], r["layer"]): r for r in got["rows"]}
    assert rows[("mlp_backward", 1)]["ratio"] == 1.05 and not rows[("mlp_backward", 1)]["flag"]
    assert rows[("attention_backward", 1)]["flag"] and "attention_backward L1" in got["flags"]
    assert not {"mlp_backward L1", "recompute L0", "mlp_backward L0", "logits L-1", "pinned"} & set(got["flags"])
    assert rows[("logits", -1)]["ratio"] == 1.0 and rows[("recompute", 0)]["gap_gib"] == 1.0
    assert plan["pinned"] > 0 and got["host"]["pinned"]["ratio"] == 1.0 and got["host"]["rss"]["measured_gib"] == 40
    text = render({"environment": {"device": "NVIDIA H200"}, "long": {
        "model": "llama3_8b_shape_l2", "length": gpu.LONG["gpu"], "cap_gib": 78.5, "gpu_mem_gb": 80.0,
        "budget_args": "--gpu_mem_gb 80.0", "exit_code": 0, "wall_s": 300.0, "step_s": 190.0, "steps_done": 1,
        "memory_choice": choice, "engagement": {"tiled_mlp": {"engaged": 2, "expected": 2},
                                                 "norm_recompute": {"engaged": 1, "expected": 3}},
        "kernel_errors": [],
        "planner": {"resident_gib": 1.0, "terms_gib": {"consistent": True}}, **got}})
    assert "| **1.2** (the planner's next fix) |" in text and "| 1.05 |" in text
    assert "tiled_mlp 2 / 2," in text and "norm_recompute 1 / 3 **NOT ENGAGED**" in text
    assert "_gib(" not in text and "num_host_alloc 3" in text


def test_the_page_says_what_auto_attention_runs():
    """The GPU check times `--attn_implementation auto`'s own probe (model_utils/attention_pick.py) at the headline's
    call; the page names each backend's time and the pick."""
    from bench.gpu_page import render

    row = {"backend": "sdpa default", "length": 1048576, "heads": 1, "head_dim": 128, "dtype": "bfloat16", "ok": True,
           "forward_s": 0.6, "forward_tflops": 455.8, "backward_s": 1.3, "backward_tflops": 545.2, "kernels": []}
    auto = {"choice": "sdpa", "seconds": {"sdpa": 0.0021, "flash_attention_2": 0.0034},
            "call": {"heads": 1, "kv_heads": 1, "head_dim": 128, "tokens": 32768}}
    text = render({"environment": {"device": "NVIDIA H200"}, "kernels": [row], "auto_attention": auto})
    assert ("own probe (model_utils/attention_pick.py: one causal call forward + backward at 32,768 tokens, 1 head(s), "
            "median of 3): sdpa 2.1 ms, flash_attention_2 3.4 ms; it runs **sdpa**.") in text, text


def test_gpu_check_compares_the_host_arena_and_flags_its_fallback():
    """A plan that offloads its checkpoints (the ladder's leanest rungs, the gap run): they go to the host arena's
    exact-size registered slots (base/host_arena.py), which torch's pinned stats do not see, so the check compares
    the probe's `arena` record with the planner's exact bytes and flags a fallback to torch's rounded pinned blocks
    (a saving the plan counts that did not engage) or a wrong size; the pinned figure keeps ZeRO-3's blocks alone."""
    from bench import gpu
    from bench.gpu_compare import planner_phases
    from bench.gpu_page import render
    from planner.memory_model import GiB

    shape, c, choice, _ = long_plan()
    choice = {**choice, "offload_activations": True, "checkpoint_every": 1, "keep_attention": False}
    plan = planner_phases(shape, gpu.LONG["gpu"], choice, "cuda")
    assert plan["arena"] == 2 * gpu.LONG["gpu"] * shape.hidden_size * 2  # two checkpoints, exact bytes
    assert plan["pinned"] > 0 and plan["arena"] not in (0, plan["pinned"])

    def probe(arena):
        return [{"phase": "forward", "layer": 0, "peak": GiB, "reserved": GiB, "peak_incl": GiB, "reserved_incl": GiB,
                 "pid": 1, "rss": GiB, "pinned": {"allocated_bytes.current": int(plan["pinned"])}, "arena": arena}]

    ok = gpu.compare(probe({"registered_bytes": plan["arena"], "fallbacks": 0, "path": "registered"}), plan, 2)
    assert ok["host"]["arena"]["ratio"] == 1.0 and "arena" not in ok["flags"] and "pinned" not in ok["flags"]
    fell = gpu.compare(probe({"registered_bytes": plan["arena"], "fallbacks": 1, "path": "pinned-fallback"}), plan, 2)
    assert "arena" in fell["flags"]
    text = render({"environment": {"device": "NVIDIA H200"}, "long": {
        "model": "llama3_8b_shape_l2", "length": gpu.LONG["gpu"], "cap_gib": 78.5, "gpu_mem_gb": 80.0,
        "budget_args": "--gpu_mem_gb 80.0", "exit_code": 0, "wall_s": 300.0, "step_s": 190.0, "steps_done": 1,
        "memory_choice": choice, "engagement": {}, "kernel_errors": [],
        "planner": {"resident_gib": 1.0, "terms_gib": {"consistent": True}}, **fell}})
    assert "path pinned-fallback, 1 fallbacks (**a saving that did not engage**)" in text


def test_gpu_check_headline_is_plan_compare_row_and_flags_above_usable():
    """The headline section's length is plan.py --compare's 1-GPU row (the chooser train.py's start-up runs, with the
    headline's features pinned, accepts it and nothing longer), the same at 2 and at 32 layers (the GPU peak does
    not depend on the depth under these features); compare() names each norm backward against the planner's norm
    term, and flags a segment above the run's usable limit although its ratio is within 10%."""
    import json as _json

    from bench import gpu
    from bench.gpu_compare import planner_phases
    from planner import auto_features as af
    from planner.memory_model import GiB, ModelShape

    lens = []
    for layers in (2, 32):
        path = os.path.join(ROOT, ".cache", f"headline_l{layers}.json")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as fh:
            _json.dump(dict(gpu.LLAMA3_8B, num_hidden_layers=layers, model_type="llama", head_dim=128), fh)
        lens.append(gpu.headline_length(path, gpu.PLAN_GPU_GB, 32))
    assert lens[0] == lens[1] == 1_240_480, lens  # docs/results/memory.md's 1-GPU row
    shape = ModelShape.from_config(dict(gpu.LLAMA3_8B, num_hidden_layers=2, model_type="llama", head_dim=128))
    choice = {**gpu.HEADLINE, "offload_params": True, "offload_optimizer": True, "attention_head_chunks": 32,
              "lean_rmsnorm": True, "lean_mlp": True, "budget_gb": 78.0}
    plan = planner_phases(shape, lens[0], choice, "cuda")
    usable = af.usable_bytes(int(78.0 * GiB))
    near = plan["layers"][1]["norm_backward"]
    assert near * 1.09 > usable  # within the flag's 10% yet past the usable limit

    def rec(phase, layer, peak, **kw):
        return {"phase": phase, "layer": layer, "peak": int(peak), "reserved": int(peak), "peak_incl": int(peak),
                "reserved_incl": int(peak), "pid": 1, "rss": GiB, **kw}

    probe = [rec("mlp_backward", 1, plan["layers"][1]["mlp_backward"]),
             rec("between", -1, near * 1.09, after="close mlp_backward L1", before="open attention_backward L1"),
             rec("attention_backward", 1, plan["layers"][1]["attention_backward"]),
             rec("between", -1, near, after="close attention_backward L1", before="open recompute L0")]
    got = gpu.compare(probe, plan, 2, usable)
    norms = [r for r in got["rows"] if r["phase"] == "norm_backward"]
    assert [(r["layer"], r["norm"], r["flag"]) for r in norms] == [(1, "post-attention", False), (1, "input", False)]
    assert norms[0]["over_usable"] and got["over_usable"] == ["norm_backward L1", "step"], got["over_usable"]
    assert got["usable_gib"] == round(usable / GiB, 3)


def test_the_fitted_constants_are_the_committed_gpu_run():
    """The two figures fitted to the GPU run (planner/step_time.MEASURED's step, planner/cluster.RUNTIME_HOST_GIB) are
    read off the committed bench/results/gpu.json: a new run that moves them fails here until they follow it."""
    from planner.cluster import RUNTIME_HOST_GIB
    from planner.step_time import MEASURED

    with open(os.path.join(ROOT, "bench", "results", "gpu.json")) as fh:
        run = json.load(fh)["headline"]
    assert (run["length"], run["step_s"]) == (MEASURED["seq_len"], MEASURED["step_s"])
    assert run["memory_choice"]["attention_head_chunks"] == MEASURED["features"]["attention_head_chunks"]
    runtime = run["host"]["rss"]["measured_gib"] - sum(run["planner"]["host_terms_gib"].values())
    assert abs(runtime - RUNTIME_HOST_GIB) < 0.01, runtime


def test_a_later_runs_sections_are_merged_not_pasted_over(tmp_path):
    """`python -m bench.gpu --merge NEW.json`: a device session that runs some sections (the headline alone, say) used
    to be copied over bench/results/gpu.json, losing the ladder, the recheck and the notes the page cites. Its
    sections replace those there, the others stay, a note says which came from which run, and the page renders."""
    import json

    from bench import gpu

    old = json.loads(open(os.path.join(ROOT, "bench", "results", "gpu.json")).read())
    out, new = tmp_path / "gpu.json", tmp_path / "new.json"
    out.write_text(json.dumps(old))
    headline = {**old["headline"], "length": 1_240_480}
    new.write_text(json.dumps({"started": "2026-12-01 10:00:00 UTC", "budget_s": 500, "environment": {"gpu": "H200"},
                               "elapsed_s": 420.0, "skipped_for_time": [], "headline": headline}))
    assert gpu.main(["--merge", str(new), "--out", str(out), "--page", str(tmp_path / "gpu.md")]) == 0
    got = json.loads(out.read_text())
    assert got["headline"]["length"] == 1_240_480 and got["ladder"] == old["ladder"] and got["kernels"] == old["kernels"]
    assert got["notes"][:-1] == old["notes"] and "2026-12-01 10:00:00 UTC" in got["notes"][-1]
    assert got["notes"][-1].endswith("headline, replacing those of the run above.") and got["started"] == old["started"]
    assert "1,240,480" in (tmp_path / "gpu.md").read_text()
