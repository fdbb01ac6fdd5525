"""The highest MFU a step can reach with the attention kernels a GPU run measured (issue 49's MFU goals checked
against the kernels, not hoped for).

MFU counts model FLOPs (planner.flops.flops_per_sequence: the forward's matmuls and its causal attention,
backward twice the forward, no recompute) over the peak rate. The hardware does more: a flash-attention backward
computes five s^2 x d products to the forward's two (2.5 x the forward's FLOPs, of which MFU counts 2), and the
memory features recompute (a checkpointed layer's forward again, the attention's too unless `keep_attention`; a tiled
MLP's and tiled logits' forwards). So, for one sequence,

    hardware seconds >= matmul work / matmul rate + attention forward work / its rate + backward work / its rate
    MFU <= model FLOPs / (peak x hardware seconds)

with the attention rates measured (bench.gpu's kernel probe at the headline's length: forward and backward TFLOP/s
of the kernel `auto` picks) and every matmul at the peak rate. Everything else a step does (the optimizer on the
host, offload copies, all-to-alls, norms, the loss, kernel launches) is left out, so this is an upper bound: a run
reaching it would be doing nothing but attention at the measured rate and matmuls at peak. Also assumed: the
attention rates at shorter lengths are no higher than at the probe's (flash kernels lose efficiency as sequences
shorten). Every measured MFU must lie under its bound (tests/unit/planner/test_mfu_bound.py checks the committed
run's).

`attention_rate_for(goal)`: the attention rate (forward and backward alike) a step would need for MFU `goal` with
matmuls at peak; None when even instantaneous attention would not do (the matmul work alone is too much).
"""

from __future__ import annotations

from planner.auto_features import recompute_flops
from planner.flops import flops_per_sequence
from planner.memory_model import Features, ModelShape

FLASH_BACKWARD = 2.5  # a flash-attention backward's FLOPs over its forward's (5 vs 2 products of s^2 x d)


def hardware_work(shape: ModelShape, seq_len: int, f: Features) -> dict[str, float]:
    """FLOPs the hardware does for one sequence under features `f`: {"matmul", "attention_forward",
    "attention_backward"} (causal attention: half of the s x s products; a windowed layer its window's share)."""
    s, L = seq_len, shape.causal_attention_layers(seq_len)  # L full layers' worth (the layer count without windows)
    att = 2.0 * shape.num_heads * shape.head_dim * s * s  # one full layer's causal QK^T and AV, forward
    extra_matmul, extra_att = recompute_flops(shape, s, f, shape.active_layer_params())  # the features' recompute
    return {"matmul": 3 * 2.0 * shape.matmul_params() * s + extra_matmul,  # forward and backward (twice) of every weight
            "attention_forward": L * att + extra_att, "attention_backward": L * FLASH_BACKWARD * att}


def mfu_bound(shape: ModelShape, seq_len: int, f: Features, attention_tflops: tuple[float, float],
              peak_tflops: float) -> float:
    """The MFU of a step doing only its matmuls at `peak_tflops` and its attention at `attention_tflops`
    (forward, backward)."""
    w = hardware_work(shape, seq_len, f)
    seconds = (w["matmul"] / peak_tflops + w["attention_forward"] / attention_tflops[0]
               + w["attention_backward"] / attention_tflops[1]) / 1e12
    return flops_per_sequence(shape, seq_len) / (peak_tflops * 1e12 * seconds)


def attention_rate_for(goal: float, shape: ModelShape, seq_len: int, f: Features, peak_tflops: float) -> float | None:
    """The attention TFLOP/s (forward and backward alike) at which the bound reaches `goal`; None if no rate does."""
    w = hardware_work(shape, seq_len, f)
    room = flops_per_sequence(shape, seq_len) / (goal * peak_tflops) - w["matmul"] / peak_tflops
    return (w["attention_forward"] + w["attention_backward"]) / room if room > 0 else None
