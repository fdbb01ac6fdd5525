"""scripts/plan_vs_run.py (issue 49): the measured headline run of bench/results/gpu.json against the planner of this
checkout, recomputed (not copied from the JSON), each figure labelled fitted or out of sample; a user's bad file
refused in one line. Pure arithmetic on the stored JSON: well under a second."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from bench.gpu_compare import planner_phases
from bench.gpu_long import LLAMA3_8B
from planner.memory_model import ModelShape
from planner.presets import PRESETS

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), *[os.pardir] * 3))
_spec = importlib.util.spec_from_file_location("plan_vs_run", os.path.join(ROOT, "scripts", "plan_vs_run.py"))
pvr = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pvr)
GPU_JSON = os.path.join(ROOT, "bench", "results", "gpu.json")
GiB = 2**30


def headline() -> dict:
    with open(GPU_JSON) as fh:
        return json.load(fh)["headline"]


def rows_of(out: str) -> dict[str, list[str]]:
    return {cells[0]: cells[1:] for ln in out.splitlines() if ln.startswith("| ") and not ln.startswith("| segment")
            for cells in [[c.strip() for c in ln.strip("|").split("|")]]}


def test_the_plainest_run_sets_each_measured_segment_against_the_planner_now(capsys):
    assert pvr.main([GPU_JSON]) == 0
    rows = rows_of(capsys.readouterr().out)
    sec = headline()
    shape = ModelShape.from_config(dict(PRESETS["llama3-8b"], num_hidden_layers=2))
    plan = planner_phases(shape, sec["length"], sec["memory_choice"], "cuda")  # bench's own arithmetic
    by = {(r["phase"], r.get("norm"), r["layer"]): r for r in sec["rows"]}
    expect = {"recomputed forward (L1, L0)": ("recompute", None, "recompute"),
              "MLP backward (L1, L0)": ("mlp_backward", None, "mlp_backward"),
              "attention backward (L1, L0)": ("attention_backward", None, "attention_backward"),
              "norm backward, post-attention (L1, L0)": ("norm_backward", "post-attention", "norm_backward"),
              "norm backward, input (L1, L0)": ("norm_backward", "input", "norm_backward")}
    for label, (phase, norm, key) in expect.items():
        measured, now, ratio, now_is, then, then_is = rows[label]
        assert measured == f"{by[(phase, norm, 1)]['measured_gib']:.2f}"
        assert now == f"{plan['layers'][1][key] / GiB:.2f}"  # recomputed now, not the JSON's figure
        assert ratio == f"{by[(phase, norm, 1)]['measured_gib'] / (plan['layers'][1][key] / GiB):.3f}"
        assert then == f"{by[(phase, norm, 1)]['planner_gib']:.2f}" and then_is == "out of sample"
        assert now_is == ("out of sample (as at the run)" if now == then else "revised after the run")
    assert rows["logits + loss"][1] == f"{plan['logits'] / GiB:.2f}"
    step = next(v for k, v in rows.items() if k.startswith("the step"))
    assert step[:2] == [f"{sec['step']['measured_gib']:.2f}", f"{plan['step'] / GiB:.2f}"]
    assert rows["host: pinned blocks"][:2] == [f"{sec['host']['pinned']['measured_gib']:.2f}",
                                               f"{plan['pinned'] / GiB:.2f}"]
    assert rows["host: arena (registered)"][1] == f"{plan['arena'] / GiB:.2f}"
    # what was read off this very run is labelled so: the host runtime and the step time's MFU
    rss = next(v for k, v in rows.items() if k.startswith("host: peak RSS"))
    assert rss[3] == "runtime fitted to this run" and rss[5] == "out of sample"  # at the run: 2 GiB assumed
    assert next(v for k, v in rows.items() if k.startswith("step time"))[3] == "MFU fitted to this run"


@pytest.mark.parametrize("choice", [{}, {"checkpoint_every": 2, "offload_activations": False, "offload_params": False,
                                         "attention_head_chunks": 16}])
def test_its_planner_figures_are_bench_gpu_compares(choice):
    """scripts may not import bench (tests/unit/test_layers.py), so the script computes through planner/: here held
    byte for byte to bench/gpu_compare.planner_phases, for the headline's choice and one with a layer that keeps its
    activations."""
    sec = headline()
    rec = {**sec["memory_choice"], **choice}
    shape = ModelShape.from_config(dict(PRESETS["llama3-8b"], num_hidden_layers=2))
    mine = pvr.planner_now(shape, sec["length"], pvr.Features.from_choice(rec), "cuda")
    bench = planner_phases(shape, sec["length"], rec, "cuda")
    assert mine["layers"] == {i: {k: v for k, v in lay.items() if k not in ("checkpointed", "phase")}
                              for i, lay in bench["layers"].items()}
    assert [mine[k] for k in ("logits", "step", "peak_phase", "host", "pinned", "arena")] == \
        [bench[k] for k in ("logits", "step", "peak_phase", "host", "pinned", "arena")]


def test_the_bench_model_name_reads_as_bench_gpus_shape():
    # bench/gpu.py save_model: preset_config("tiny-llama", num_hidden_layers=N, **LLAMA3_8B)
    saved = ModelShape.from_config(dict(PRESETS["tiny-llama"], num_hidden_layers=3, **LLAMA3_8B))
    assert pvr.run_shape({"model": "llama3_8b_shape_l3"}, None) == saved


def test_the_fitted_run_is_labelled_fitted(tmp_path):
    """A run of the configuration the per-phase terms were fitted to (MEMORY_FIT) reads 'fitted' (and its step time,
    not the one the MFU was read off, 'out of sample'); another RSS than the one the runtime was read off reads 'out
    of sample'."""
    data = json.load(open(GPU_JSON))
    fit, other = copy.deepcopy(data), copy.deepcopy(data)
    fit["headline"]["length"] = pvr.MEMORY_FIT["length"]
    fit["headline"]["memory_choice"].update({k: v for k, v in pvr.MEMORY_FIT.items() if k != "length"})
    other["headline"]["host"]["rss"]["measured_gib"] += 1.0
    (tmp_path / "fit.json").write_text(json.dumps(fit))
    (tmp_path / "other.json").write_text(json.dumps(other))
    rows = rows_of(pvr.table(str(tmp_path / "fit.json")))
    assert rows["logits + loss"][3] == rows["host: pinned blocks"][3] == "fitted to this run"
    assert rows["logits + loss"][5] == rows["host: pinned blocks"][5] == "fitted to this run"
    assert next(v for k, v in rows.items() if k.startswith("step time"))[3] == "revised after the run"
    rows = rows_of(pvr.table(str(tmp_path / "other.json")))
    assert next(v for k, v in rows.items() if k.startswith("host: peak RSS"))[3] == "revised after the run"
    assert next(v for k, v in rows.items() if k.startswith("step time"))[3] == "MFU fitted to this run"


def test_only_the_figure_recorded_with_the_run_is_out_of_sample_where_the_planner_moved_since():
    """The planner now can hold terms re-derived after the run (the norm term of 2026-11-28), so one label per row
    called its figure out of sample too: each of the two figures is labelled on its own, the planner now's out of
    sample only where it still gives the figure recorded with the run."""
    rows = rows_of(pvr.table(GPU_JSON))
    assert "| planner now is |" in pvr.table(GPU_JSON)
    moved = [k for k, v in rows.items() if v[1] != v[4] and v[4] != "-"]
    kept = [k for k, v in rows.items() if v[1] == v[4]]
    assert moved and kept  # the committed run has both: the norm rows moved, the recompute did not
    assert all(rows[k][3] in ("revised after the run", "runtime fitted to this run", "MFU fitted to this run")
               and rows[k][5] == "out of sample" for k in moved)
    assert all(rows[k][3] == "out of sample (as at the run)" and rows[k][5] == "out of sample" for k in kept)


def test_a_bad_file_is_refused_in_one_line(tmp_path):
    good = json.load(open(GPU_JSON))
    cases = {"missing.json": None, "text.json": "not json", "no_headline.json": {"kernels": {}},
             "failed.json": {"headline": {**copy.deepcopy(good["headline"]), "rows": [], "error": "OOM"}},
             "odd_model.json": {"headline": {**copy.deepcopy(good["headline"]), "model": "my_model"}},
             "odd_choice.json": {"headline": {**copy.deepcopy(good["headline"]),
                                              "memory_choice": {"checkpoint_every": -1}}},
             "odd_length.json": {"headline": {**copy.deepcopy(good["headline"]), "length": "1M"}},
             "odd_step.json": {"headline": {**copy.deepcopy(good["headline"]), "step": {"measured_gib": "a lot"}}}}
    words = {"missing.json": "not a readable JSON", "text.json": "not a readable JSON",
             "no_headline.json": "no 'headline' section", "failed.json": "has no rows (error: OOM)",
             "odd_model.json": "pass --model", "odd_choice.json": "checkpoint_every -1",
             "odd_length.json": "length an integer", "odd_step.json": "not as bench.gpu writes it (TypeError"}
    for name, body in cases.items():
        path = tmp_path / name
        if body is not None:
            path.write_text(body if isinstance(body, str) else json.dumps(body))
        with pytest.raises(ValueError, match=re.escape(words[name])) as err:
            pvr.table(str(path))
        assert "\n" not in str(err.value)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "plan_vs_run.py"),
                           str(tmp_path / "no_headline.json")], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2 and proc.stdout == ""  # the user's input: 2, as every script (base/exits.py)
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr
