"""The FLOP model: the model FLOPs one sequence costs, as MFU counts them (the forward's matmuls, each weight a token
multiplies by, and its causal attention, x3 for forward and backward; no recompute). What a step really runs on the
hardware, recompute and the flash backward's extra work included, is planner/mfu_bound.hardware_work; its time,
planner/auto_features.step_seconds."""

from __future__ import annotations

from planner.shapes import ModelShape


def flops_per_sequence(shape: ModelShape, seq_len: int) -> float:
    """Model FLOPs of forward+backward of one sequence: 6*N_matmul*s + 6*L*nh*d*s^2 (causal attention).

    Dense: 2 FLOPs per weight per token forward, twice that backward. Attention: QK^T and AV are
    2*s^2*nh*d each forward (4), x3 for forward+backward (12), halved by the causal mask (6).
    Activation recompute is not counted (MFU convention), so checkpointing lowers the MFU actually reached.
    """
    s = seq_len
    return 6.0 * shape.matmul_params() * s + 6.0 * shape.num_layers * shape.num_heads * shape.head_dim * s * s


def tokens_per_sec_per_gpu(shape: ModelShape, seq_len: int, mfu: float, peak_tflops: float) -> float:
    """Throughput at a given MFU: an SP group of sp GPUs shares one sequence, so sp cancels out."""
    return seq_len * mfu * peak_tflops * 1e12 / flops_per_sequence(shape, seq_len)
