"""Long-sequence memory features, each switchable from the config and each keeping loss/gradient parity:
tiled MLP, tiled logits + loss, activation checkpointing (optionally offloaded to CPU), and the CUDA
allocator setting ALST uses. These are the pieces of Arctic Long Sequence Training (ALST) on top of
Ulysses SP; every tensor below is a rank's sequence shard, `[bs, sl_local, ...]` with sl_local = sl/sp.

- `--tiled_mlp`: each decoder layer's gated MLP runs through DeepSpeed's `TiledMLP` over
  ceil(sl_local / hidden) sequence tiles (ALST's rule). Only the MLP input is saved; backward recomputes
  one tile at a time, so the `[bs, sl_local, intermediate]` activations never exist whole.
- `--tiled_logits`: the LM head and the cross-entropy run one sequence tile at a time (about 1 GiB of
  fp32 logits per tile, ArcticTraining's rule), so the `[bs, sl_local, vocab]` logits never exist whole.
- `--gradient_checkpointing`: Hugging Face activation checkpointing of every decoder layer, non-reentrant.
- `--offload_activations`: the checkpointed layer inputs (`[bs, sl_local, hidden]` per layer) are held in
  pinned CPU memory between forward and backward. It offloads the checkpoints, so it turns checkpointing
  on by itself. On a CPU run the tensors are already in host memory and nothing moves.

`apply_memory_features(model, cfg)` runs after the model is built and before `deepspeed.initialize`;
`make_loss_fn(cfg)` returns the function `training.step.train_step` uses to get the local loss sum;
`configure_allocator()` belongs at the top of the entry point, before anything touches CUDA.
"""

from __future__ import annotations

import functools
import math
import os
import types
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

from training.step import loss_sum

# Tile sizes. Module-level so the tests can force several tiles on tiny models.
MLP_TILE_TOKENS: int | None = None  # tokens per MLP tile; None: the hidden size, ALST's ceil(sl_local / hidden) tiles
LOGITS_TILE_BYTES: int = 2**30  # fp32 logits per loss tile (ArcticTraining's 1 GiB)
ALLOCATOR_SETTINGS = "expandable_segments:True"


def configure_allocator() -> str | None:
    """Let the CUDA caching allocator grow segments in place instead of fragmenting as sequence lengths
    change (ALST sets this). Call it before the first CUDA allocation. A value the user put in
    PYTORCH_ALLOC_CONF or PYTORCH_CUDA_ALLOC_CONF wins. Returns the settings applied, or None when the
    user's are kept. Inert on CPU."""
    if os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF"):
        return None
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ALLOCATOR_SETTINGS  # for child processes
    # torch reads the variable once, at import (this module imported it), so set this process directly too
    if hasattr(torch._C, "_accelerator_setAllocatorSettings"):  # torch >= 2.9
        torch._C._accelerator_setAllocatorSettings(ALLOCATOR_SETTINGS)
    return ALLOCATOR_SETTINGS


def apply_memory_features(model, cfg) -> None:
    """Enable the features `cfg` asks for on `model` (in place). Raises ValueError for a model they do not fit."""
    if cfg.tiled_mlp:
        _tile_mlps(model)
    if cfg.tiled_logits:
        _add_tiled_loss_forward(model)
    if cfg.gradient_checkpointing or cfg.offload_activations:
        # Non-reentrant: recomputation runs inside the one backward graph task (DeepSpeed's hook bookkeeping
        # then sees a single phase), and the inputs need not require grad.
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        if cfg.offload_activations:
            _offload_checkpoints(model)


def make_loss_fn(cfg) -> Callable[..., torch.Tensor]:
    """(engine, micro_batch) -> sum of token cross-entropies over this rank's shard."""
    return tiled_loss_sum if cfg.tiled_logits else loss_sum


def agreed_tiles(n: int, device: torch.device) -> int:
    """max(1, n) agreed over all ranks: ZeRO-3 gathers each weight with a collective, so every rank must
    call the tiled module the same number of times. Shapes are equal on all ranks in this project (fixed
    length packing, sharded evenly), so this only guards against a future variable-length pipeline."""
    n = max(1, n)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        t = torch.tensor([n], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        n = int(t.item())
    return n


# --- tiled MLP ---------------------------------------------------------------------------------------

def _gated_mlp(mlp, x: torch.Tensor) -> torch.Tensor:
    return mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))


def _tiled_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    """x: [bs, sl_local, hidden] -> [bs, sl_local, hidden], the same MLP over sequence tiles."""
    tiles = agreed_tiles(math.ceil(x.shape[-2] / (MLP_TILE_TOKENS or x.shape[-1])), x.device)
    # All of the MLP's weights get one gradient per tile; TiledMLP tells ZeRO-3 to reduce them after the last.
    return TiledMLP.apply(_gated_mlp, self, x, tiles, list(self.parameters()))


def _tile_mlps(model) -> None:
    layers = getattr(model.get_decoder(), "layers", None)
    if layers is None:
        raise ValueError(f"--tiled_mlp: no decoder layers found in {type(model).__name__}")
    for layer in layers:
        mlp = getattr(layer, "mlp", None)
        if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            raise ValueError(f"--tiled_mlp supports gated MLPs (gate_proj/up_proj/down_proj: Llama, Qwen2/3, "
                             f"Mistral); {type(model).__name__} has {type(mlp).__name__}")
        mlp.forward = types.MethodType(_tiled_mlp_forward, mlp)  # this instance only: other models untouched


# --- tiled logits + loss -----------------------------------------------------------------------------

def _ce_sum(lm_head, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of cross-entropies of one tile ([bs, t, hidden], [bs, t]), in fp32 like training.step.loss_sum."""
    logits = lm_head(hidden).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100,
                           reduction="sum")


class TiledCrossEntropySum(torch.autograd.Function):
    """sum CE(lm_head(hidden), labels) with one tile of `[bs, tile, vocab]` logits alive at a time.

    Forward runs the tiles without autograd; backward recomputes one tile at a time and backpropagates the
    incoming gradient through it (DeepSpeed's SequenceTiledCompute pattern). DeepSpeed's
    TiledFusedLogitsLoss instead runs backward inside forward with an incoming gradient of 1, so its LM
    head gradient ignores any factor applied to the loss afterwards, and train_step scales the local
    sum by world * GA / n_tokens: it would give a wrong LM head gradient here.

    ZeRO-3 is told (`ds_grad_is_ready`) to reduce the LM head gradient once, after the last tile. When
    the head is tied to the input embedding, the embedding's backward still adds to the same gradient
    later in this backward pass, so it is reduced after that instead."""

    @staticmethod
    def forward(ctx, hidden, labels, lm_head, tiles: int, tied: bool):
        ctx.save_for_backward(hidden, labels)
        ctx.lm_head, ctx.tiles, ctx.tied = lm_head, tiles, tied
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for a, b in _spans(hidden.shape[1], tiles):
            total += _ce_sum(lm_head, hidden[:, a:b], labels[:, a:b])
        return total

    @staticmethod
    def backward(ctx, grad_total):
        hidden, labels = ctx.saved_tensors
        grad_hidden = torch.zeros_like(hidden)
        params = [p for p in ctx.lm_head.parameters() if p.requires_grad]
        spans = _spans(hidden.shape[1], ctx.tiles)
        for i, (a, b) in enumerate(spans):
            for p in params:
                p.ds_grad_is_ready = i == len(spans) - 1 and not ctx.tied
            tile = hidden[:, a:b].detach().requires_grad_()
            with torch.enable_grad():
                loss = _ce_sum(ctx.lm_head, tile, labels[:, a:b])
            torch.autograd.backward(loss, grad_total)
            grad_hidden[:, a:b] = tile.grad
        for p in params:
            p.ds_grad_is_ready = True  # tied: the embedding's gradient hook reduces the sum later
        return grad_hidden, None, None, None, None


def _spans(sl: int, tiles: int) -> list[tuple[int, int]]:
    """Exactly `tiles` [a, b) ranges covering 0..sl (trailing ones empty when tiles does not divide evenly),
    so every rank makes the same number of LM head calls."""
    step = math.ceil(sl / tiles)
    return [(min(i * step, sl), min((i + 1) * step, sl)) for i in range(tiles)]


def logits_tiles(bs: int, sl: int, vocab: int) -> int:
    """Tiles for about LOGITS_TILE_BYTES of fp32 logits each, at most one per token."""
    return max(1, min(sl, math.ceil(bs * sl * vocab * 4 / LOGITS_TILE_BYTES)))


def _forward_with_tiled_loss(self, *args, tiled_loss_labels: torch.Tensor | None = None, **kwargs):
    """The model's forward; given `tiled_loss_labels` ([bs, sl_local], already shifted, -100 ignored) it
    returns the summed cross-entropy instead of the logits, computed tile by tile."""
    if tiled_loss_labels is None:
        return self._untiled_forward(*args, **kwargs)
    hidden = self.get_decoder()(*args, **kwargs).last_hidden_state  # [bs, sl_local, hidden]
    lm_head = self.get_output_embeddings()
    tiles = agreed_tiles(logits_tiles(*tiled_loss_labels.shape, lm_head.out_features), hidden.device)
    tied = lm_head.weight is self.get_input_embeddings().weight
    return TiledCrossEntropySum.apply(hidden, tiled_loss_labels, lm_head, tiles, tied)


def _add_tiled_loss_forward(model) -> None:
    if model.get_output_embeddings() is None or model.get_decoder() is model:
        raise ValueError(f"--tiled_logits needs a causal LM with a separate LM head; got {type(model).__name__}")
    model._untiled_forward = model.forward
    model.forward = types.MethodType(_forward_with_tiled_loss, model)  # going through the engine keeps its hooks


def tiled_loss_sum(engine, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    """training.step.loss_sum without the whole [bs, sl_local, vocab] logits. It goes through the engine's
    forward, like loss_sum, because DeepSpeed starts its backward bookkeeping from hooks on the outputs."""
    out = engine(input_ids=mb["input_ids"], position_ids=mb["position_ids"], use_cache=False,
                 tiled_loss_labels=mb["shift_labels"])
    if not torch.is_tensor(out):
        raise RuntimeError("tiled_logits: the model's forward was not patched (apply_memory_features not run)")
    return out


# --- activation checkpoint offload -------------------------------------------------------------------

def _to_host(t: torch.Tensor):
    """Pack hook: a checkpointed layer input goes to pinned CPU memory; on CPU runs it stays where it is."""
    if t.device.type == "cpu":
        return t.device, t
    host = torch.empty(t.shape, dtype=t.dtype, layout=t.layout, pin_memory=True)
    host.copy_(t, non_blocking=True)  # same stream as the compute that reads it back: ordered, no sync
    return t.device, host


def _to_device(packed) -> torch.Tensor:
    device, t = packed
    return t.to(device, non_blocking=True)


def _checkpoint_with_offload(checkpoint_fn, function, *args, **kwargs):
    # torch's non-reentrant checkpoint saves the layer inputs under the hooks active here, and everything
    # computed inside the layer under its own (innermost) hooks: so only the inputs pass through _to_host.
    with torch.autograd.graph.saved_tensors_hooks(_to_host, _to_device):
        return checkpoint_fn(function, *args, **kwargs)


def _offload_checkpoints(model) -> None:
    """Wrap the checkpoint function transformers gave each checkpointed layer. (transformers' own
    `offload=True` pins memory unconditionally and fails on CPU-only torch builds.)"""
    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False) and hasattr(module, "_gradient_checkpointing_func"):
            module._gradient_checkpointing_func = functools.partial(_checkpoint_with_offload,
                                                                    module._gradient_checkpointing_func)
