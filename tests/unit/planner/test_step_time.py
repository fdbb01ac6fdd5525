"""Step times at the measured rate (planner/step_time.py, issue 49): each row's attention at the rate of the kernel
it runs, and plan.py's --gpu_tflops reaching every time it prints. No torch, well under a second a test."""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import replace

from planner import step_time as st
from planner.memory_model import Features, load_shape

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), *[os.pardir] * 3))
_spec = importlib.util.spec_from_file_location("plan", os.path.join(ROOT, "scripts", "plan.py"))
plan = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plan)
LLAMA = load_shape("llama3-8b")
RING = Features(offload_params=True, offload_optimizer=True, tiled_mlp=True, tiled_logits=True, checkpoint_every=1,
                offload_activations=True, lean_rmsnorm=True, lean_mlp=True, attention_head_chunks=4,
                ring_attention=True)


def test_kernel_rates_are_the_probes():
    """KERNEL_TFLOPS quotes the committed kernel probe (bench/results/gpu.json "kernels"): SDPA forced to cuDNN and
    to flash, forward and backward; the measured run's attention ran cuDNN."""
    data = json.load(open(os.path.join(ROOT, "bench", "results", "gpu.json")))
    rows = {r["backend"]: r for r in data["kernels"]}
    for kernel, backend in (("cudnn", "sdpa cudnn"), ("flash", "sdpa flash")):
        assert st.KERNEL_TFLOPS[kernel] == (rows[backend]["forward_tflops"], rows[backend]["backward_tflops"])
    assert list(data["headline"]["attention_kernels"]) == [f"sdpa:{st.MEASURED['kernel']}"]


def test_the_ring_is_charged_at_flash_attentions_rate():
    """The ring (cp > 1) runs FA2 (the ring refuses sdpa on a GPU): its attention FLOPs cost cuDNN / flash times their
    time at the fitted MFU. Before, every row was charged at the cuDNN run's rate: the 32-GPU row's step was 6.9 h
    at 17.6M and its 15-minute length at the ring's features 3.3M; now ~11.8 h and ~2.5M."""
    n, sp, cp = 8_000_000, 32, 4
    timing = dict(world=32, ranks_per_node=8, cp=cp)
    gather = replace(RING, ring_attention=False)
    assert st.attention_kernel(RING, 4) == "flash" and st.attention_kernel(RING, 1) == "cudnn"
    assert st.attention_kernel(gather, 4) == "cudnn" and st.kernel_seconds(LLAMA, n, sp, gather, cp=cp) == 0
    # by hand: forward (and its recompute, every layer checkpointed) 2 L nh d s^2 each, backward twice that
    attn = 2.0 * 32 * 32 * 128 * n**2
    (cf, cb), (ff, fb) = st.KERNEL_TFLOPS["cudnn"], st.KERNEL_TFLOPS["flash"]
    rate = sp * st.measured_mfu() * 989e12
    want = (2 * attn * (cf / ff - 1) + 2 * attn * (cb / fb - 1)) / rate
    assert abs(st.kernel_seconds(LLAMA, n, sp, RING, cp=cp) - want) < 1e-6 * want
    base = st.step_seconds(LLAMA, n, sp, RING, mfu=st.measured_mfu(), **timing)["total"]
    assert abs(st.step_time(LLAMA, n, sp, RING, **timing) - base - want) < 1e-6 * want
    rows = plan.compare()
    ring_row = rows[-1]
    assert ring_row["cp"] > 1 and ring_row["features"]["ring_attention"]
    assert ring_row["step_s"] > 10 * st.HOUR_S
    # at the ring's features a 15-minute step is under 3M; at ~3.8M auto gathers K/V instead (cuDNN's rate)
    ring_15 = st.longest_within(st.TRAINABLE_S, LLAMA, sp, Features(**ring_row["features"]), **timing)
    assert ring_15 < 3_000_000 < ring_row["within_15_min"] and "ring" not in ring_row["within_15_min_at"]["features"]
    assert rows[0]["cp"] == 1  # the 1-GPU row runs cuDNN as measured: its time is the fit's
    assert "FlashAttention-2" in plan.render_compare(rows)


def test_gpu_tflops_reaches_every_time():
    """--gpu_tflops was ignored by the step time, tokens/s per GPU and the 15-minute length (plan.py called
    step_time / longest_within at the default peak): at 312 (an A100's) a step takes longer than at 989, the fitted
    MFU reused."""
    argv = ["--model", "llama3-8b", "--seq_len", "512k", "--alst", "--gpus_per_node", "1", "--cpu_mem_gb", "1024",
            "--attention_head_chunks", "max"]
    fast, slow = (plan.plan(argv + ["--gpu_tflops", t])["plans"][0] for t in ("989", "312"))
    (f,), (s,) = fast["candidates"], slow["candidates"]
    assert s["step_s"] > 2 * f["step_s"] and s["measured_tokens_per_sec_per_gpu"] < f["measured_tokens_per_sec_per_gpu"]
    assert slow["within_15_min"] < fast["within_15_min"]
    assert "--gpu_tflops 312" in plan.render(plan.plan(argv + ["--gpu_tflops", "312"]))
    rows = plan.compare(extra=["--gpu_tflops", "312"])
    assert rows[0]["step_s"] > 2 * plan.compare()[0]["step_s"]


def test_the_gpu_checks_first_call_is_estimated_at_the_headlines_length():
    """docs/benchmarks.md's device budget: the first call runs the headline alone at the planner's 1-GPU longest,
    whose 2-layer step the cost model gives; with the measured start-up it fits 8 minutes with the machine's start
    (before: one call of headline, kernels, arena and parity at --budget_s 500, ~510 s at the new length)."""
    text = " ".join(open(os.path.join(ROOT, "docs", "benchmarks.md")).read().split())
    n = plan.compare()[0]["longest"]
    shape = load_shape("llama3-8b").__class__.from_config(st.MEASURED["model"])
    step = st.step_time(shape, n, 1, Features.of(st.MEASURED["features"]), world=1, ranks_per_node=1)
    first = 12 + (362 - 224.6) + step  # model init, the measured launch's start-up, the step
    assert f"{n:,} tokens, whose 2-layer step the cost model puts at {step:.0f} s" in text
    assert f"~{first:.0f} s, ~{first + 45:.0f} s of device time" in text and first + 45 <= 480
    assert "--budget_s 540 --sections headline`" in text and "--budget_s 500" not in text
