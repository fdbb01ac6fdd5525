"""Lean gated MLP: Hugging Face's gated MLP forward, one [T, I] tensor fewer kept for backward.

HF's gated MLP, `down_proj(act_fn(gate_proj(x)) * up_proj(x))`, runs op by op, so autograd keeps four [T, I]
tensors per layer until backward: gate (the activation's input), act(gate) and up (the product's inputs) and the
product (down_proj's input). `GatedProductFunction` computes act(gate) * up as one autograd node that keeps gate
and up only and recomputes act(gate) in backward, a chunk of rows at a time; the forward runs the same two ops
(bitwise equal output), the backward the same kernels (silu_backward, the two products) on those chunks.

Cost and gain at Llama-3-8B, 128k tokens per rank (I = 14336, bf16): 3.5 GiB less per decoder layer whose
activations are kept (no checkpointing, or the layers between checkpointed ones under --checkpoint_every K),
and inside a tiled-MLP tile or a checkpointed layer's recompute the same fraction of their working set; the
price is one elementwise activation per MLP in backward, under 0.1% of a layer's FLOPs, run in chunks of
at most 64 MiB of fp32-equivalent rows (there 1170 rows: 112 chunks per MLP, each a few kernels and one
autograd.grad call; estimated at most 1% of a ~57 s step, not yet measured on a GPU). This is the saving
Liger's fused SwiGLU gives ALST, without Triton (it runs on CPU too).

`--lean_mlp` (on by default) replaces the forward of the MLPs whose class computes exactly Llama's formula
(LEAN_MLP_CLASSES: a test compares their source with Llama's); other MLPs (Phi-3's fused gate_up_proj, GPT-style
ones, MoE experts) run Hugging Face's.
"""

from __future__ import annotations

import types

import torch

from planner.memory_model import LEAN_MLP_MODEL_TYPES, norm_chunk_rows

# The class (one per model type in LEAN_MLP_MODEL_TYPES) whose forward is LlamaMLP's, character for character
LEAN_MLP_CLASSES = {
    "llama": "LlamaMLP", "mistral": "MistralMLP", "qwen2": "Qwen2MLP", "qwen3": "Qwen3MLP", "granite": "GraniteMLP",
    "gemma": "GemmaMLP", "gemma2": "Gemma2MLP", "olmo2": "Olmo2MLP",
}
assert set(LEAN_MLP_CLASSES) == set(LEAN_MLP_MODEL_TYPES)


class GatedProductFunction(torch.autograd.Function):
    """act(gate) * up for an elementwise `act`; keeps gate and up, recomputes act(gate) in backward."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, act) -> torch.Tensor:
        ctx.act = act
        ctx.save_for_backward(gate, up)
        return act(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        width = gate.shape[-1]
        g2, u2, d2 = gate.reshape(-1, width), up.reshape(-1, width), grad.reshape(-1, width)
        dgate = torch.empty_like(g2) if ctx.needs_input_grad[0] else None
        dup = torch.empty_like(u2) if ctx.needs_input_grad[1] else None
        # chunks as the lean RMSNorm's: at most 64 MiB of fp32 per temporary (act(gate), d(act)), >= 8 chunks
        step = norm_chunk_rows(g2.shape[0], width)
        for s in range(0, g2.shape[0], step):
            rows = slice(s, s + step)
            with torch.enable_grad():
                g = g2[rows].detach().requires_grad_(True)
                a = ctx.act(g)
            if dup is not None:  # autograd's mul backward: d(up) = grad * act(gate)
                torch.mul(d2[rows], a.detach(), out=dup[rows])
            if dgate is not None:  # d(gate) = act'(gate) applied to grad * up, by the activation's own backward
                dgate[rows] = torch.autograd.grad(a, g, d2[rows] * u2[rows])[0]
        return (None if dgate is None else dgate.view(gate.shape), None if dup is None else dup.view(up.shape), None)


def _lean_forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(GatedProductFunction.apply(self.gate_proj(x), self.up_proj(x), self.act_fn))


def use_lean_mlp(model) -> int:
    """Replace the forward of every MLP of `model` whose class is in LEAN_MLP_CLASSES (this instance only, before
    deepspeed.initialize and before --tiled_mlp wraps it). Returns how many were replaced (0: the family's MLP
    is not Llama's formula, and HF's is kept)."""
    names = set(LEAN_MLP_CLASSES.values())
    count = 0
    for module in model.modules():
        if type(module).__name__ in names and all(hasattr(module, n) for n in ("gate_proj", "up_proj", "down_proj",
                                                                               "act_fn")):
            module.forward = types.MethodType(_lean_forward, module)
            count += 1
    return count
