"""Metrics helpers: the peak memory logged per step is the stage's own (reset at each stage's start); W&B's steps and mode."""

from __future__ import annotations

import mmap
import sys

import numpy as np
import pytest

from base.host import peak_rss_bytes
from training.metrics import reset_peak_memory


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
    than the current step 3"). It is logged at the evaluation's step. A run with report_to wandb and no WANDB_MODE /
    WANDB_API_KEY goes offline (a `wandb login` netrc alone does not sync): said once."""
    import types

    from training.metrics import MetricsLogger

    logged = []
    run = types.SimpleNamespace(log=lambda data, **kw: logged.append((sorted(data), kw.get("step"))), finish=lambda: None)
    fake = types.SimpleNamespace(init=lambda **kw: run, Settings=lambda **kw: None,
                                 Table=lambda columns, data: ("table", len(data)))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    m = MetricsLogger(str(tmp_path), True, "wandb", "p", None, {}, 10, False)
    assert "W&B offline" in capsys.readouterr().out
    m.log_table("eval/stage0", ["task"], [["passkey"]], step=2)
    assert logged[-1] == (["eval/stage0"], 2)
    m.close()
