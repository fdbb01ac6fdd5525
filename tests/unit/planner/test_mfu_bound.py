"""planner/mfu_bound.py and scripts/mfu_bound.py: the highest MFU the measured attention kernels allow (issue 49)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from planner.flops import flops_per_sequence
from planner.memory_model import Features, ModelShape
from planner.mfu_bound import FLASH_BACKWARD, attention_rate_for, hardware_work, mfu_bound
from planner.presets import PRESETS
from tests.distributed import ROOT

_spec = importlib.util.spec_from_file_location("mfu_bound_script", os.path.join(ROOT, "scripts", "mfu_bound.py"))
script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(script)
LLAMA = ModelShape.from_config(PRESETS["llama3-8b"])
PEAK = 989.0
NONE, CKPT = Features(), Features.of({"checkpoint_every": 1})
KEEP = Features.of({"checkpoint_every": 1, "keep_attention": True})


def test_the_bound_counts_the_work_the_hardware_does():
    """Without recompute: forward + backward of every weight, the causal attention's forward once and its flash
    backward at 2.5 x; everything at peak gives model FLOPs over that work (MFU counts the backward as 2 x), which
    tends to 1 where attention vanishes and to 3 / 3.5 where it dominates."""
    s = 1 << 20
    w = hardware_work(LLAMA, s, NONE)
    att = LLAMA.num_layers * 2.0 * LLAMA.num_heads * LLAMA.head_dim * s * s
    assert w["attention_forward"] == att and w["attention_backward"] == FLASH_BACKWARD * att
    assert w["matmul"] + 3 * att == flops_per_sequence(LLAMA, s)
    assert mfu_bound(LLAMA, s, NONE, (PEAK, PEAK), PEAK) == pytest.approx(
        flops_per_sequence(LLAMA, s) / (w["matmul"] + (1 + FLASH_BACKWARD) * att))
    assert mfu_bound(LLAMA, 64, NONE, (PEAK, PEAK), PEAK) > 0.999
    assert 3 / 3.5 < mfu_bound(LLAMA, 1 << 24, NONE, (PEAK, PEAK), PEAK) < 3 / 3.5 + 0.01


def test_recompute_lowers_the_bound_and_keep_attention_spares_the_attention():
    rates = (500.0, 578.0)
    b = {name: mfu_bound(LLAMA, 524_288, f, rates, PEAK) for name, f in
         (("none", NONE), ("ckpt", CKPT), ("keep", KEEP),
          ("ckpt2", Features.of({"checkpoint_every": 2})), ("tiled", Features.of({"tiled_mlp": True})))}
    assert b["ckpt"] < b["ckpt2"] < b["none"] and b["ckpt"] < b["keep"] < b["none"] and b["tiled"] < b["none"]
    # keep_attention leaves only the layer's matmuls to recompute: what it adds over none is that work alone
    extra = hardware_work(LLAMA, 524_288, KEEP)["matmul"] - hardware_work(LLAMA, 524_288, NONE)["matmul"]
    assert extra == LLAMA.num_layers * 2.0 * LLAMA.active_layer_params() * 524_288
    assert hardware_work(LLAMA, 524_288, KEEP)["attention_forward"] == hardware_work(LLAMA, 524_288, NONE)[
        "attention_forward"]


def test_the_rate_a_goal_needs_gives_that_goal_back():
    for goal, f in ((0.45, CKPT), (0.55, KEEP), (0.3, NONE)):
        r = attention_rate_for(goal, LLAMA, 524_288, f, PEAK)
        assert mfu_bound(LLAMA, 524_288, f, (r, r), PEAK) == pytest.approx(goal)
    matmul_only = flops_per_sequence(LLAMA, 524_288) / hardware_work(LLAMA, 524_288, CKPT)["matmul"]
    assert attention_rate_for(matmul_only * 1.01, LLAMA, 524_288, CKPT, PEAK) is None


def test_every_measured_mfu_of_the_committed_run_lies_under_its_bound(capsys):
    """The bound's assumptions against the H200 run: a measured MFU above its bound would mean the bound leaves out
    something the hardware does not do, or the probe's rates are wrong. (A 2-layer headline bounded as the 32-layer
    model would be: the layer count is read from the run's model name.)"""
    assert script.main([os.path.join(ROOT, "bench", "results", "gpu.json")]) == 0
    out = capsys.readouterr().out
    rows = [r for r in out.splitlines() if r.startswith("| ladder") or r.startswith("| headline")]
    assert len(rows) >= 4, out
    for r in rows:
        measured, bound, ratio = (float(x) for x in r.strip("|").split("|")[-3:])
        assert 0 < measured <= bound and ratio <= 1, r
    assert "| headline (llama3_8b_shape_l2) | 1,109,646 | checkpoint every 1, tiled_mlp, tiled_logits |" in out
    two = dataclasses.replace(LLAMA, num_layers=2)
    headline = Features.of({"checkpoint_every": 1, "tiled_mlp": True, "tiled_logits": True})
    rates = (500.5, 577.7)
    assert f"| {mfu_bound(two, 1_109_646, headline, rates, PEAK):.3f} |" in out
    assert f"| {mfu_bound(LLAMA, 1_109_646, headline, rates, PEAK):.3f} |" not in out
    assert re.search(r"MFU 0\.55 at 524,288 and 1,048,576, \+ keep_attention: bound [0-9.-]+: out of reach", out), out


def test_a_file_without_a_kernel_probe_is_one_line(tmp_path):
    bad = tmp_path / "gpu.json"
    bad.write_text(json.dumps({"headline": {}}))
    with pytest.raises(ValueError, match=r"gpu\.json: it has no kernel probe with timings \(python -m bench\.gpu"):
        script.main([str(bad)])
    bad.write_text("not json")
    with pytest.raises(ValueError, match="not JSON"):
        script.main([str(bad)])
    with pytest.raises(ValueError, match=r"^--peak_tflops -5: use the GPU's dense bf16 peak, finite and > 0"):  # was taken
        script.main([os.path.join(ROOT, "bench", "results", "gpu.json"), "--peak_tflops", "-5"])
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "mfu_bound.py"), str(bad)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == "" and proc.stderr.startswith("error: ")  # the user's: 2, not 1
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


def test_a_windowed_layer_counts_the_keys_its_window_reaches():
    """gpt-oss-20b's 12 windowed layers (128 keys) were counted as full causal attention by every FLOP count: its
    FLOPs (so MFU, predicted step and eval times) 1.6x over at 128k and 1.9x at 1M. A windowed layer now counts
    s*w - w^2/2 query-key pairs (s^2/2 for a full one) in flops_per_sequence, hardware_work, the recompute of the
    checkpointed layers, kernel_seconds and the per-layer compute; a model without windows is unchanged."""
    from planner.comm_model import layer_compute_seconds
    from planner.flops import attention_flops
    from planner.shapes import load_shape
    from planner.step_time import kernel_seconds

    oss = load_shape("gpt-oss-20b")
    full = dataclasses.replace(oss, sliding_window=0, window_layers=())
    att_pair = 4.0 * oss.num_heads * oss.head_dim  # QK^T and AV of one query-key pair, forward
    for s, over in ((131_072, 1.64), (1 << 20, 1.93)):
        pairs = 12 * s * s / 2 + 12 * (s * 128 - 128 * 128 / 2)  # 12 full layers, 12 windowed
        assert attention_flops(oss, s) == pytest.approx(3 * att_pair * pairs)
        assert flops_per_sequence(oss, s) == pytest.approx(6.0 * oss.matmul_params() * s + 3 * att_pair * pairs)
        assert flops_per_sequence(full, s) / flops_per_sequence(oss, s) == pytest.approx(over, abs=0.01)
        w = hardware_work(oss, s, NONE)
        assert w["attention_forward"] == pytest.approx(att_pair * pairs)
        assert w["attention_backward"] == pytest.approx(FLASH_BACKWARD * att_pair * pairs)
    s = 1 << 20
    # checkpointing every 2nd layer recomputes layers 0, 2, ...: gpt-oss's windowed ones, almost no attention
    ckpt2 = Features.of({"checkpoint_every": 2})
    extra = hardware_work(oss, s, ckpt2)["attention_forward"] - hardware_work(oss, s, NONE)["attention_forward"]
    assert extra == pytest.approx(att_pair * 12 * (s * 128 - 128 * 128 / 2))
    ring = Features.of({"checkpoint_every": 2, "ring_attention": True})
    assert kernel_seconds(oss, s, 8, ring, cp=2) < kernel_seconds(full, s, 8, ring, cp=2) / 1.9
    assert layer_compute_seconds(full, s, 8)["attention_fwd_s"] / layer_compute_seconds(oss, s, 8)[
        "attention_fwd_s"] == pytest.approx(2.0, rel=1e-3)
    # a window at least the length is full attention; a model without windows keeps its figures
    assert flops_per_sequence(oss, 128) == flops_per_sequence(full, 128)
    assert LLAMA.causal_attention_layers(s) == 32 and isinstance(LLAMA.causal_attention_layers(s), int)
    assert flops_per_sequence(LLAMA, s) == 6.0 * LLAMA.matmul_params() * s + 6.0 * 32 * 32 * 128 * s * s
