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
"""

from __future__ import annotations

from functools import lru_cache

from planner.auto_features import PEAK_TFLOPS, step_seconds
from planner.cluster import longest_multiple
from planner.memory_model import Features, ModelShape
from planner.presets import PRESETS

MEASURED = {
    "run": "docs/results/gpu.md (one H200 capped at 78.5 GiB, 2026-11-28)",
    "model": dict(PRESETS["llama3-8b"], num_hidden_layers=2), "seq_len": 1_109_646, "step_s": 224.63,
    "features": dict(offload_params=True, offload_optimizer=True, tiled_mlp=True, tiled_logits=True,
                     checkpoint_every=1, offload_activations=True, lean_rmsnorm=True, lean_mlp=True,
                     attention_head_chunks=32),
}
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


def step_time(shape: ModelShape, seq_len: int, sp: int, f: Features, *, world: int, ranks_per_node: int,
              cp: int = 1, peak_tflops: float = PEAK_TFLOPS) -> float:
    """Seconds of one optimizer step (one sequence per SP group) at the measured FLOP rate."""
    return step_seconds(shape, seq_len, sp, f, mfu=measured_mfu(), peak_tflops=peak_tflops, world=world,
                        ranks_per_node=ranks_per_node, cp=cp)["total"]


def longest_within(seconds: float, shape: ModelShape, sp: int, f: Features, *, world: int, ranks_per_node: int,
                   cp: int = 1, upper: int = 1 << 27) -> int:
    """The longest length (a multiple of sp, of 2 sp under cp > 1) whose step at these features takes at most
    `seconds` (the time grows with the length)."""
    return longest_multiple(lambda n: step_time(shape, n, sp, f, world=world, ranks_per_node=ranks_per_node,
                                                cp=cp) <= seconds, sp * (2 if cp > 1 else 1), upper)


def duration(seconds: float) -> str:
    """'52 s', '14.3 min', '3.4 h'."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * HOUR_S:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / HOUR_S:.1f} h"
