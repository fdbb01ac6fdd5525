"""Lean RMSNorm: the same forward as Hugging Face's Llama-style RMSNorm, a fraction of its memory.

HF's RMSNorm (Llama, Mistral, Qwen2/3, Mixtral, Phi-3, Granite) runs through autograd op by op, so it saves an
fp32 copy of its input and the normalized x for backward, and its backward holds five `[T, h]` fp32 temporaries
(measured: tests/unit/planner/test_planner_tensor_bytes.py). On Llama-3-8B at 128k tokens per rank that is 4 GiB saved per norm
(65 norms; 2 GiB lean) and a 10 GiB transient in each norm's backward, the largest one once the MLP is tiled.

`LeanRMSNormFunction` computes the identical forward (the same ops in the same order, row by row: bitwise equal
output) but saves only its input, in the compute dtype, and the fp32 inverse RMS of each row (4 B per token). The
backward recomputes the normalized rows one chunk at a time (planner.memory_model.norm_chunk_rows: at most
64 MiB of fp32 per temporary, at least 8 chunks), so its fp32 temporaries are a few chunks, not five `[T, h]`.
This is what ALST gets from Liger's fused RMSNorm, without a Triton dependency (it runs on CPU too).

`--lean_rmsnorm` (on by default) replaces the forward of every norm whose class computes exactly the Llama
formula (LEAN_RMSNORM_CLASSES; a test compares their source with Llama's); other norms (Gemma's `1 + w`,
OLMo-2's cast order) are left as they are.
"""

from __future__ import annotations

import types
import weakref

import torch

from planner.memory_model import LEAN_RMSNORM_MODEL_TYPES, norm_chunk_rows

# The classes (one per model type in LEAN_RMSNORM_MODEL_TYPES) whose forward is LlamaRMSNorm's, character for character
LEAN_RMSNORM_CLASSES = {
    "llama": "LlamaRMSNorm", "mistral": "MistralRMSNorm", "mixtral": "MixtralRMSNorm", "qwen2": "Qwen2RMSNorm",
    "qwen2_moe": "Qwen2MoeRMSNorm", "qwen3": "Qwen3RMSNorm", "qwen3_moe": "Qwen3MoeRMSNorm", "phi3": "Phi3RMSNorm",
    "granite": "GraniteRMSNorm",
}
assert set(LEAN_RMSNORM_CLASSES) == set(LEAN_RMSNORM_MODEL_TYPES)


class LeanRMSNormFunction(torch.autograd.Function):
    """y = w * (x_fp32 * rsqrt(mean(x_fp32^2) + eps)).to(x.dtype), over the last dim; saves x and rstd only."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        h = x.shape[-1]
        x2 = x.reshape(-1, h)
        out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
        rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
        step = norm_chunk_rows(x2.shape[0], h)
        for s in range(0, x2.shape[0], step):
            xf = x2[s:s + step].to(torch.float32)
            r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
            rstd[s:s + step] = r.squeeze(-1)
            _output_rows(xf, r, weight, x.dtype, out[s:s + step])
        ctx.save_for_backward(x, weight, rstd)
        out = out.view(*x.shape[:-1], h)
        _remember(out, x, weight, rstd)
        return out

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        h = x.shape[-1]
        x2, dy2 = x.reshape(-1, h), dy.reshape(-1, h)
        dx = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
        dw = torch.zeros(h, dtype=torch.float32, device=x.device) if ctx.needs_input_grad[1] else None
        step = norm_chunk_rows(x2.shape[0], h)
        for s in range(0, x2.shape[0], step):
            n = x2[s:s + step].to(torch.float32) * rstd[s:s + step, None]  # the normalized rows, recomputed
            g = dy2[s:s + step]
            if dw is not None:  # autograd's: d(w * n_c) / dw = g * n_c in the output dtype, summed over rows
                dw += (g * n.to(x.dtype)).to(torch.float32).sum(0)
            dn = (g * weight).to(x.dtype).to(torch.float32)
            # d/dx of x * rsqrt(mean(x^2) + eps) applied to dn: rstd * (dn - n * mean(dn * n))
            dx[s:s + step] = (rstd[s:s + step, None] * (dn - n * (dn * n).mean(-1, keepdim=True))).to(x.dtype)
        return dx.view(x.shape), None if dw is None else dw.to(weight.dtype), None


# ---- the norm's output, recomputed by its consumer --------------------------------------------------------------
# A lean norm already keeps its input and 1/rms for its own backward, and its output is bitwise a function of them.
# A consumer that would save the output for its backward (model_utils/head_chunks.py's chunked attention,
# model_utils/memory.py's tiled MLP) saves those instead and recomputes the output there: one [T, h] tensor fewer
# kept per norm (Llama-3-8B at 1M tokens on one GPU: 8 GiB per norm, 16 GiB per layer), for one elementwise pass
# over [T, h] in backward (under 0.1% of a layer's FLOPs). The consumers receive the output through ZeRO-3's and
# the module hooks' wrappers (detach, identity Functions): aliases of the same memory, so the output is known by
# its storage, offset, shape and strides while that storage is alive and the output unmodified (its version
# counter, shared by every alias).

_OUTPUTS: dict = {}  # (device, storage pointer, offset, shape, strides, dtype) -> (weakref to the output's storage,
# its version, x, weight, rstd)


def _key(t: torch.Tensor) -> tuple:
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def _remember(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor) -> None:
    # A weak reference to the output's STORAGE (torch keeps one Python object per live storage, the same through
    # every alias; ZeRO-3's module hooks replace the output tensor itself by a detached alias at once): the entry,
    # which holds the norm's own saved x and 1/rms, goes when the output's memory does, never later.
    key = _key(out)
    ref = weakref.ref(out.untyped_storage(),
                      lambda r, key=key: _OUTPUTS.pop(key) if _OUTPUTS.get(key, (None,))[0] is r else None)
    # the weight's values as they are now (gathered, inside the norm's forward): ZeRO-3 may release the parameter
    # before the consumer's backward whatever its persistence threshold (h elements: 8 KiB per norm for Llama-3-8B)
    _OUTPUTS[key] = (ref, out._version, x, weight.detach().clone(), rstd)


def norm_source(t: torch.Tensor):
    """(x, weight values, rstd) when `t` is (an alias of) a live, unmodified lean RMSNorm output; else None (the
    consumer saves `t` itself). The weight is a copy of its values at the norm's forward, so a ZeRO-3 parameter
    released since (a CPU run showed it: size 0 in the consumer's backward) does not matter."""
    entry = _OUTPUTS.get(_key(t)) if isinstance(t, torch.Tensor) else None
    if entry is None or entry[0]() is not t.untyped_storage() or t._version != entry[1]:
        return None
    return entry[2:]


def renorm(x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, start: int = 0, stop: int | None = None):
    """Rows [start, stop) of the norm's output, [rows, h], bitwise equal to what its forward returned (the same
    elementwise ops on the same values; 1/rms is the saved one, no reduction is rerun)."""
    h = x.shape[-1]
    x2 = x.detach().reshape(-1, h)
    stop = x2.shape[0] if stop is None else stop
    out = torch.empty((stop - start, h), dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    step = norm_chunk_rows(x2.shape[0], h)
    with torch.no_grad():
        for s in range(start, stop, step):
            e = min(s + step, stop)
            _output_rows(x2[s:e].to(torch.float32), rstd[s:e, None], weight, x.dtype, out[s - start:e - start])
    return out


def _output_rows(xf: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype, out: torch.Tensor):
    """w * (x_fp32 * 1/rms).to(dtype) into `out`: the forward's output rows, and renorm's (one op sequence for both,
    so the recomputed output is the forward's bit for bit)."""
    torch.mul(weight, (xf * r).to(dtype), out=out)


def _lean_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return LeanRMSNormFunction.apply(hidden_states, self.weight, self.variance_epsilon)


def use_lean_rmsnorm(model) -> int:
    """Replace the forward of every RMSNorm of `model` whose class is in LEAN_RMSNORM_CLASSES (this instance
    only, before deepspeed.initialize). Returns how many were replaced (0: the family's norm is not the Llama
    formula, and HF's is kept)."""
    names = set(LEAN_RMSNORM_CLASSES.values())
    count = 0
    for module in model.modules():
        if type(module).__name__ in names and hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(_lean_forward, module)
            count += 1
    return count
