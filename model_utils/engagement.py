"""Whether the memory savings the plan counts really engaged: per-step counters, and the stop when one did not.

The planner (planner/memory_model.py) sizes a stage assuming each feature it picked saves what it should. Five of
them can silently fall back to the costlier path at run time, so each counts its engagements here, in the forward
of a training micro-batch (grad on, outside backward: a checkpointed layer's recompute is not counted again):

| counter | engages when | expected per micro-batch |
|---|---|---|
| attention_head_chunks | a layer's attention runs its chunk loop (model_utils/head_chunks.py) | layers (chunks > 1) |
| norm_recompute | a consumer (chunked attention, tiled MLP) finds its input is a lean RMSNorm's output and keeps the norm's input instead (model_utils/rmsnorm.norm_source) | layers x (chunked attention + tiled MLP) whose norm is lean |
| tiled_mlp | a layer's MLP runs through the tiled Function | layers |
| tiled_logits | the loss runs through the tiled cross-entropy | 1 |
| offload_activations | a checkpointed layer's saved inputs went through the offload hooks | checkpointed layers |

`arm(model, features)` (training/engine.build_engine, after every patch) records on the model what it expects per
micro-batch; `take(model, micro)` (training/stage.py, after each step) returns {"engaged": {...}, "expected": {...}} for the step and starts the next.
The counters are a few Python integer increments per layer per micro-batch: nothing on the device, no sync.

Stops, each one line naming the feature and its fix (a ValueError: exit 2, no requeue; the condition is a property
of the model, the backend and the DeepSpeed version, so a requeue would only fail again):
- at once, in the first forward, when a consumer the plan counts on does not find its lean norm's output
  (`missing_norm_source`): at Llama-3-8B x 1M tokens on one GPU that layer would keep +16 GiB (82.8 GiB against 80:
  an OOM in the first backward's recompute, after minutes of forward). Every rank runs the same code on the same
  shapes, so every rank raises at the same layer; the abort channel (training/job.py) ends the job everywhere
  even if one did not.
- after every step, from counts agreed over ranks (`check`): any counted feature that engaged fewer times than
  expected. The minimum over ranks is folded into the step's existing peak-memory all-reduce (training/metrics.
  peak_memory_gb), so the decision costs no collective of its own and is the same on every rank.
"""

from __future__ import annotations

import math

import torch

FEATURES = ("attention_head_chunks", "norm_recompute", "tiled_mlp", "tiled_logits", "offload_activations")
FIX = {
    "attention_head_chunks": "set attention_head_chunks 1 (and memory_features auto re-plans without it)",
    "norm_recompute": "set lean_rmsnorm false so that the planner counts the norm outputs as kept, or use a "
                      "DeepSpeed version whose ZeRO-3 hooks hand the consumers an alias of the norm's output",
    "tiled_mlp": "set tiled_mlp false (the model's MLP is not the patched one)",
    "tiled_logits": "set tiled_logits false (the loss did not go through the tiled forward)",
    "offload_activations": "set offload_activations false (the checkpointed layers bypass the offload hooks)",
}
_ENGAGED = dict.fromkeys(FEATURES, 0)


def in_training_forward() -> bool:
    """Grad on and not inside backward (a non-reentrant checkpoint's recompute runs inside the backward's graph
    task): the one call per layer and micro-batch that the counters count."""
    return torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1


def engaged(feature: str) -> None:
    if in_training_forward():
        _ENGAGED[feature] += 1


def missing_norm_source(module, where: str) -> None:
    """A consumer the plan counts on (its input norm is lean, `module._expects_norm_source`) got an input that is not
    a live lean-norm output: stop now, in the first forward, before the layer's backward needs the [T, h] the plan
    did not count (see the module docstring)."""
    if getattr(module, "_expects_norm_source", False) and in_training_forward():
        raise ValueError(f"norm_recompute: {where}'s input is not its lean RMSNorm's output as the planner counts "
                         f"(the storage match did not survive the hooks around it), so each layer would keep one "
                         f"[T, h] more than planned (an OOM at the planned length); {FIX['norm_recompute']}")


def _is_lean(norm) -> bool:
    from model_utils.rmsnorm import _lean_forward

    return getattr(getattr(norm, "forward", None), "__func__", None) is _lean_forward


def arm(model, features) -> dict:
    """Record what `model` (patched: memory features and head chunks installed) expects per micro-batch, mark the
    consumers whose input norm is lean, and zero the counters. Returns the expectation."""
    layers = getattr(model.get_decoder(), "layers", None) or []
    n = len(layers)
    want = dict.fromkeys(FEATURES, 0)
    chunks = getattr(features, "attention_head_chunks", 1)
    chunks = chunks if isinstance(chunks, int) else max([getattr(getattr(layer, "self_attn", None), "_head_chunks", 1)
                                                         for layer in layers] or [1])  # "auto": as installed
    for layer in layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if chunks > 1 and getattr(attn, "_head_chunks", 1) > 1:
            want["attention_head_chunks"] += 1
            attn._expects_norm_source = _is_lean(getattr(layer, "input_layernorm", None))
            want["norm_recompute"] += attn._expects_norm_source
        if features.tiled_mlp and hasattr(mlp, "_untiled_forward"):
            want["tiled_mlp"] += 1
            mlp._expects_norm_source = _is_lean(getattr(layer, "post_attention_layernorm", None))
            want["norm_recompute"] += mlp._expects_norm_source
    # what the features ask for counts even where the patch found nothing to patch (expected > 0, engaged 0)
    if chunks > 1:
        want["attention_head_chunks"] = n
    if features.tiled_mlp:
        want["tiled_mlp"] = n
    want["tiled_logits"] = 1 if features.tiled_logits else 0
    every = getattr(features, "checkpoint_every", 0) or int(bool(features.gradient_checkpointing
                                                                   or features.offload_activations))  # memory.py's
    want["offload_activations"] = math.ceil(n / every) if every and features.offload_activations else 0
    model._engagement_expected = {k: v for k, v in want.items() if v}
    reset()
    return dict(model._engagement_expected)


def reset() -> None:
    for k in _ENGAGED:
        _ENGAGED[k] = 0


def take(model, micro_batches: int) -> dict | None:
    """This rank's counts since the last take (or arm), for the features `model`'s armed plan counts (None: it
    counts none), and a fresh start."""
    want = getattr(model, "_engagement_expected", None)
    got = {"engaged": {k: _ENGAGED[k] for k in want},
           "expected": {k: v * micro_batches for k, v in want.items()}} if want else None
    reset()
    return got


def fields(counts: dict) -> dict:
    """The metrics' keys: engaged/<feature> and expected/<feature> (W&B groups them by the prefix)."""
    return {**{f"engaged/{k}": v for k, v in counts["engaged"].items()},
            **{f"expected/{k}": v for k, v in counts["expected"].items()}}


def check(counts: dict) -> None:
    """One-line ValueError naming the first counted feature that engaged fewer times than expected (counts agreed
    over ranks: the minimum of each rank's engagements)."""
    for k, want in counts["expected"].items():
        got = counts["engaged"].get(k, 0)
        if got < want:
            raise ValueError(f"{k}: engaged {got} of {want} times in this step though the memory plan counts its "
                             f"saving every time (the run would use more memory than planned); {FIX[k]}")
