"""Metrics helpers: the peak memory logged per step is the stage's own (reset at each stage's start); W&B's steps and mode."""

from __future__ import annotations

import json
import mmap
import sys

import numpy as np
import pytest

from base.host import peak_rss_bytes
from training.metrics import MetricsLogger, reset_peak_memory


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM reset through /proc/self/clear_refs")
def test_peak_memory_resets_at_a_stage_start():
    # anonymous pages of our own, touched then unmapped: their RSS goes back to the kernel at close, whatever the
    # allocator keeps (numpy's 300 MiB through malloc once stayed resident in a long-lived xdist worker, in CI)
    size = 300 * 2**20
    reset_peak_memory()
    before = peak_rss_bytes()
    m = mmap.mmap(-1, size)
    view = np.frombuffer(m, dtype=np.uint8)
    view[:] = 1
    during = peak_rss_bytes()
    assert during > before + 250 * 2**20
    del view
    m.close()
    assert peak_rss_bytes() > during - 10 * 2**20  # freed, still the peak
    reset_peak_memory()
    assert peak_rss_bytes() < during - 200 * 2**20


def test_wandb_gets_the_eval_table_at_its_step_and_says_it_is_offline(tmp_path, monkeypatch, capsys):
    """The evaluation's table was logged without a step: W&B's counter moved past the run's step and the next events
    at it (a stage end's release, the next stage's memory choice) were dropped ("Tried to log to step 2 that is less
    than the current step 3"). It is logged at the evaluation's step, on our own step axis (never wandb.log(step=):
    test_metrics_wandb). A run with report_to wandb and no WANDB_MODE / WANDB_API_KEY goes offline (a `wandb login`
    netrc alone does not sync): said once."""
    import types

    from training.metrics import MetricsLogger

    logged, axes = [], []
    run = types.SimpleNamespace(log=lambda data, **kw: logged.append((sorted(data), data.get("step"), kw)),
                                define_metric=lambda name, step_metric=None: axes.append((name, step_metric)),
                                finish=lambda **kw: None)
    fake = types.SimpleNamespace(init=lambda **kw: run, Settings=lambda **kw: None,
                                 Table=lambda columns, data: ("table", len(data)))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    m = MetricsLogger(str(tmp_path), True, "wandb", "p", None, {}, 10, False)
    assert "W&B offline" in capsys.readouterr().out
    m.log_table("eval/stage0", ["task"], [["passkey"]], step=2)
    assert logged[-1] == (["eval/stage0", "step"], 2, {}) and axes == [("step", None), ("*", "step")]
    m.close()


def test_a_branch_from_an_earlier_step_logs_to_a_new_wandb_run(tmp_path, monkeypatch, capsys):
    """W&B keeps a run's steps increasing: a branch (--resume PATH taken, after a loss spike) re-logging steps 5..10 of a run
    that logged up to 10 had them dropped, the abandoned curve shown in their place. Such a branch logs to a run of
    its own in the first run's group, said; a requeue (the same steps again, identical) keeps the run."""
    import json
    import types

    from training.metrics import MetricsLogger

    inits = []
    run = types.SimpleNamespace(log=lambda *a, **kw: None, define_metric=lambda *a, **kw: None, finish=lambda **kw: None)
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(
        init=lambda **kw: inits.append((kw["id"], kw.get("group"))) or run, Settings=lambda **kw: None))
    monkeypatch.setenv("WANDB_MODE", "offline")
    path = tmp_path / "metrics.jsonl"
    for branch, want in ((False, ("ab12", None)), (True, ("ab12-from4", "ab12"))):
        path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 11)))
        m = MetricsLogger(str(tmp_path), True, "wandb", "p", "ab12", {}, 10, False, resume_step=4, branch=branch)
        assert inits[-1] == want and m.run_id == want[0]  # the id every later checkpoint records
        m.close()
    assert "this branch from step 4 logs to run ab12-from4 (group ab12)" in capsys.readouterr().out


def test_a_non_finite_loss_is_strict_json_and_a_skipped_update_is_named(tmp_path, capsys):
    """metrics.jsonl held a bare NaN for a non-finite loss (jq and strict readers refuse the line) and the log line said
    "no supervised token" for DeepSpeed's skipped update too. Now null with loss_nonfinite, and the skip named."""
    m = MetricsLogger(str(tmp_path), True, "none", None, None, {}, 10, False)
    m.log({"step": 5, "stage": 0, "loss": float("nan"), "lr": 1e-3, "tokens_per_s": 10.0, "peak_mem_gb": 0.5,
           "optimizer_skipped": "overflow", "by": [1.0, float("inf")], "eval": {"x": float("-inf")}})
    rec = json.loads((tmp_path / "metrics.jsonl").read_text(), parse_constant=lambda c: pytest.fail(f"bare {c}"))
    assert rec["loss"] is None and rec["loss_nonfinite"] == "nan" and rec["by"] == [1.0, None]
    assert rec["eval"] == {"x": None, "x_nonfinite": "-inf"}
    line = capsys.readouterr().out
    assert "loss nan" in line and "(non-finite gradient norm: update skipped)" in line and "supervised" not in line
