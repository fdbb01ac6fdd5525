"""How long a step takes, at the FLOP rate a GPU run measured (issue 49: every length with its time).

The cost model is planner.auto_features.step_seconds (the FLOP model at an MFU, plus the recompute of the
features, the head chunks' extra projections and all-to-alls, the checkpoint copies and the ZeRO-3 offloads). Its
MFU was an assumption (0.4). Here it is taken from a measured step instead: MEASURED names the run, and
`measured_mfu()` is the MFU at which step_seconds reproduces that step's time. That is a FIT TO ONE RUN (one
GPU, 2 layers, cuDNN's attention through SDPA, the headline's features), not a prediction: lengths far from it, other
splits (the all-to-all and ring costs are still the model's estimates) and other kernels are extrapolations.

Measured on one H200 capped at an H100's 78.5 GiB (docs/results/gpu.md, bench/results/gpu.json, 2026-11-28):
Llama-3-8B's width and vocabulary with 2 decoder layers, 1,109,646 tokens, every layer checkpointed and offloaded,
tiled MLP and logits, 32 head chunks, both ZeRO-3 offloads: 224.63 s for the step (the model said 231.32 at MFU
0.4, so the fitted MFU is 0.412).

The fitted rate includes that run's attention kernel (cuDNN's, SDPA's dispatch there). A row whose attention must run
another kernel charges its attention FLOPs at the ratio of the two kernels' rates (KERNEL_TFLOPS, the same GPU
check's kernel probe): the context-parallel ring runs flash-attn's FlashAttention-2 (model_utils/context_parallel.py
refuses sdpa there), ~1.7x slower than cuDNN at the headline's call, which at 17.6M on 32 GPUs (attention ~97% of
the FLOPs) makes a step ~1.7x longer. `--gpu_tflops` (peak_tflops) reuses the fitted MFU at another peak.
"""

from __future__ import annotations

from functools import lru_cache

from planner.auto_features import PEAK_TFLOPS, recompute_flops, step_seconds
from planner.cluster import longest_multiple
from planner.memory_model import Features, ModelShape
from planner.presets import PRESETS
from planner.shapes import ROPE_MAX_POSITIONS

MEASURED = {
    "run": "docs/results/gpu.md (one H200 capped at 78.5 GiB, 2026-11-28)",
    "model": dict(PRESETS["llama3-8b"], num_hidden_layers=2), "seq_len": 1_109_646, "step_s": 224.63,
    "features": dict(offload_params=True, offload_optimizer=True, tiled_mlp=True, tiled_logits=True,
                     checkpoint_every=1, offload_activations=True, lean_rmsnorm=True, lean_mlp=True,
                     attention_head_chunks=32),
    "kernel": "cudnn",  # its attention's kernels (bench/results/gpu.json headline.attention_kernels: sdpa:cudnn)
}
# TFLOP/s (forward, backward) of one causal call at the headline's (bf16, 1,048,576 tokens, one head of 128) on the
# same H200 (bench/results/gpu.json "kernels", 2026-11-28): "cudnn" SDPA forced to cuDNN, "flash" SDPA forced to its
# flash backend (torch's port of FlashAttention-2's kernels), which stands for flash-attn's FA2 until FA2 itself
# is measured (the probe times it where flash-attn is installed; it was not on that machine).
KERNEL_TFLOPS = {"cudnn": (500.5, 577.7), "flash": (301.8, 327.8)}
HOUR_S = 3600.0
TRAINABLE_S = 900.0  # the longest step a user would train at: 15 minutes (a 1,000-step stage is ~10 days)


@lru_cache(maxsize=1)
def measured_mfu() -> float:
    """The MFU at which step_seconds gives MEASURED's step time (bisection: the time falls as the MFU rises)."""
    shape = ModelShape.from_config(MEASURED["model"])
    f = Features.of(MEASURED["features"])
    lo, hi = 0.01, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        t = step_seconds(shape, MEASURED["seq_len"], 1, f, mfu=mid, world=1, ranks_per_node=1)["total"]
        lo, hi = (mid, hi) if t > MEASURED["step_s"] else (lo, mid)
    return round((lo + hi) / 2, 4)


def attention_kernel(f: Features, cp: int) -> str:
    """The kernel a row's attention runs on a GPU: "flash" (flash-attn's FA2) for the ring (ring_attention under
    cp > 1: the ring refuses sdpa on a GPU), else "cudnn" (SDPA; `--attn_implementation auto` takes the fastest
    kernel it measures, SDPA forced to cuDNN among them: model_utils/attention_pick.py)."""
    return "flash" if f.ring_attention and cp > 1 else "cudnn"


def kernel_seconds(shape: ModelShape, seq_len: int, sp: int, f: Features, *, cp: int = 1,
                   peak_tflops: float = PEAK_TFLOPS) -> float:
    """Seconds a step's attention takes beyond the fitted rate's where the row runs another kernel than the measured
    run's: its causal attention FLOPs (forward, the recompute's forward again, backward: planner.flops and
    recompute_flops count them) at KERNEL_TFLOPS[measured] / KERNEL_TFLOPS[row] times their time at the fitted MFU."""
    kernel = attention_kernel(f, cp)
    if kernel == MEASURED["kernel"]:
        return 0.0
    layers = shape.causal_attention_layers(seq_len)  # full layers' worth: a windowed layer its window's share
    fwd = 2.0 * layers * shape.num_heads * shape.head_dim * seq_len**2  # causal: half of 4 s^2 nh d
    fwd += recompute_flops(shape, seq_len, f, shape.active_layer_params())[1]
    bwd = 2 * 2.0 * layers * shape.num_heads * shape.head_dim * seq_len**2
    (mf, mb), (kf, kb) = KERNEL_TFLOPS[MEASURED["kernel"]], KERNEL_TFLOPS[kernel]
    return (fwd * (mf / kf - 1) + bwd * (mb / kb - 1)) / (sp * measured_mfu() * peak_tflops * 1e12)


def step_time(shape: ModelShape, seq_len: int, sp: int, f: Features, *, world: int, ranks_per_node: int,
              cp: int = 1, peak_tflops: float = PEAK_TFLOPS) -> float:
    """Seconds of one optimizer step (one sequence per SP group) at the measured FLOP rate: the fitted MFU at
    `peak_tflops`, the attention at its kernel's rate (kernel_seconds)."""
    return step_seconds(shape, seq_len, sp, f, mfu=measured_mfu(), peak_tflops=peak_tflops, world=world,
                        ranks_per_node=ranks_per_node, cp=cp)["total"] + kernel_seconds(
        shape, seq_len, sp, f, cp=cp, peak_tflops=peak_tflops)


def longest_within(seconds: float, shape: ModelShape, sp: int, f: Features, *, world: int, ranks_per_node: int,
                   cp: int = 1, upper: int = ROPE_MAX_POSITIONS, peak_tflops: float = PEAK_TFLOPS) -> int:
    """The longest length (a multiple of sp, of 2 sp under cp > 1; at most 2**24: planner/shapes.ROPE_MAX_POSITIONS)
    whose step at these FIXED features takes at most `seconds` (the time grows with the length); 0 where none does.
    What a run trains at takes auto's features at each length instead: planner/trainable.longest_trainable."""
    return longest_multiple(lambda n: step_time(shape, n, sp, f, world=world, ranks_per_node=ranks_per_node,
                                                cp=cp, peak_tflops=peak_tflops) <= seconds,
                            sp * (2 if cp > 1 else 1), upper)


def duration(seconds: float) -> str:
    """'52 s', '14.3 min', '3.4 h'."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * HOUR_S:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / HOUR_S:.1f} h"
