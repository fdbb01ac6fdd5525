"""The FLOP model: the model FLOPs one sequence costs, as MFU counts them (the forward's matmuls, each weight a token
multiplies by, and its causal attention, x3 for forward and backward; no recompute). What a step really runs on the
hardware, recompute and the flash backward's extra work included, is planner/mfu_bound.hardware_work; its time,
planner/auto_features.step_seconds.

Attention counts the query-key pairs each layer computes: s^2/2 for a full causal layer, s*w - w^2/2 for a layer with
a sliding window of w keys (gpt-oss: 12 of its 24 layers at w = 128), through ModelShape.causal_attention_layers.
Counting every layer as full put gpt-oss-20b's FLOPs 1.6x (128k) to 1.9x (1M) over what its kernels compute."""

from __future__ import annotations

from planner.shapes import ModelShape


def flops_per_sequence(shape: ModelShape, seq_len: int) -> float:
    """Model FLOPs of forward+backward of one sequence: 6*N_matmul*s + 6*L*nh*d*s^2 (causal attention; L counts a
    windowed layer as the share of a full one its window computes: attention_flops).

    Dense: 2 FLOPs per weight per token forward, twice that backward. Attention: QK^T and AV are
    2*s^2*nh*d each forward (4), x3 for forward+backward (12), halved by the causal mask (6).
    Activation recompute is not counted (MFU convention), so checkpointing lowers the MFU actually reached.
    """
    return 6.0 * shape.matmul_params() * seq_len + attention_flops(shape, seq_len)


def attention_flops(shape: ModelShape, seq_len: int) -> float:
    """The causal attention's part of flops_per_sequence: 6*L_eff*nh*d*s^2, L_eff = causal_attention_layers (L for
    a model without windows)."""
    s = seq_len
    return 6.0 * shape.causal_attention_layers(s) * shape.num_heads * shape.head_dim * s * s


def tokens_per_sec_per_gpu(shape: ModelShape, seq_len: int, mfu: float, peak_tflops: float) -> float:
    """Throughput at a given MFU: an SP group of sp GPUs shares one sequence, so sp cancels out."""
    return seq_len * mfu * peak_tflops * 1e12 / flops_per_sequence(shape, seq_len)
