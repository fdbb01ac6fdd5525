"""Long-sequence memory features, each switchable from the config and each keeping loss/gradient parity:
tiled MLP, tiled logits + loss, activation checkpointing (optionally offloaded to CPU), and the CUDA
allocator setting ALST uses. These are the pieces of Arctic Long Sequence Training (ALST) on top of
Ulysses SP; every tensor below is a rank's sequence shard, `[bs, sl_local, ...]` with sl_local = sl/sp.

- `--tiled_mlp`: each decoder layer's MLP (any token-wise layout; not an MoE block) runs through DeepSpeed's
  `TiledMLP` over ceil(sl_local / hidden) sequence tiles (ALST's rule; tiles of at least 1024 tokens on tiny models, see
  planner.memory_model.MLP_MIN_TILE_TOKENS). Only the MLP input is saved; backward recomputes
  one tile at a time, so the `[bs, sl_local, intermediate]` activations never exist whole.
- `--tiled_logits`: the LM head and the cross-entropy run one sequence tile at a time
  (model_utils/tiled_loss.py; evaluation always uses it).
- `--gradient_checkpointing`: Hugging Face activation checkpointing of every decoder layer, non-reentrant.
- `--checkpoint_every K`: selective checkpointing, decoder layers 0, K, 2K, ... only (ceil(L/K) of L layers);
  the others keep their activations. K=1 is `--gradient_checkpointing`; 0 (default) defers to that flag.
  Backward then recomputes ~1/K of the layers' forward instead of all of it.
- `--keep_attention`: checkpointed layers keep the attention kernel's output (and its log-sum-exp) from the
  forward: backward recomputes the rest of the layer (norms, projections, RoPE, the all-to-alls, the MLP) but
  not attention, the quadratic part (a selective activation checkpoint that matches the attention kernels only;
  Megatron's selective recompute inverted: with flash attention the kernel saves little and costs the most). Costs one
  `[sl_local, heads * head_dim]` tensor per checkpointed layer, kept on the device even with
  --offload_activations (Llama-3-8B, 128k tokens per rank, bf16: 1 GiB per layer).
- `--lean_rmsnorm` (default on): RMSNorms that save their input and 1/rms only and run backward in chunks of
  rows (model_utils/rmsnorm.py); the same forward, bitwise.
- `--lean_mlp` (default on): the gated MLP keeps gate and up for backward, not act(gate) (model_utils/mlp.py);
  the same forward, bitwise; one [T, intermediate] tensor less per layer whose activations are kept.
- `--offload_activations`: the checkpointed layer inputs (`[bs, sl_local, hidden]` per layer) are held in
  page-locked CPU memory between forward and backward, each in an exact-size slot of the model's host arena
  (base/host_arena.py: not rounded up to a power of two as torch's pinned blocks are; reused every step). It
  offloads the checkpoints, so it turns checkpointing on by itself. On a CPU run the tensors are already in host
  memory and nothing moves.

`apply_memory_features(model, features)` runs after the model is built and before `deepspeed.initialize`;
`make_loss_fn(features)` returns the function `training.step.train_step` uses to get the local loss sum;
`configure_allocator()` belongs at the top of the entry point, before anything touches CUDA.
"""

from __future__ import annotations

import collections
import functools
import inspect
import os
import types
from collections.abc import Callable

import torch
from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP
from deepspeed.utils.z3_leaf_module import set_z3_leaf_module
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

from base.host_arena import HostArena
from model_utils import ring_attention
from model_utils.engagement import engaged, missing_norm_source
from model_utils.mlp import use_lean_mlp
from model_utils.rmsnorm import norm_source, renorm, use_lean_rmsnorm
from model_utils.tiled_loss import TileGradSum, agreed_tiles, install_loss_forward, loss_sum, tiled_loss_sum
from planner.memory_model import mlp_tiles
from planner.moe_keys import tiled_mlp_refusal

# Tile sizes. Module-level so the tests can force several tiles on tiny models.
MLP_TILE_TOKENS: int | None = None  # tokens per MLP tile; None: planner.memory_model.mlp_tiles's rule
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


def apply_memory_features(model, features) -> None:
    """Enable `features` (a planner.memory_model.Features value, built by training.engine.features_of; never the
    run's config) on `model` (in place). Raises ValueError for a model they do not fit.
    The tiled-loss forward is always installed: evaluation uses it whatever `--tiled_logits` says."""
    install_loss_forward(model)
    model._logits_tile_bytes = max(0, getattr(features, "logits_tile_mb", 0) or 0) * 2**20  # 0: LOGITS_TILE_BYTES
    if getattr(features, "lean_rmsnorm", False):
        use_lean_rmsnorm(model)  # before TiledMLP and checkpointing wrap the layers: they call the norms' forward
    if getattr(features, "lean_mlp", False):
        use_lean_mlp(model)  # before TiledMLP: its tiles run the MLP's forward as it is then
    if features.tiled_mlp:
        _tile_mlps(model)
    every = checkpoint_every(features)
    if every:
        # Non-reentrant: recomputation runs inside the one backward graph task (DeepSpeed's hook bookkeeping
        # then sees a single phase), and the inputs need not require grad.
        # every_n_layers: transformers leaves checkpointing on for decoder layers 0, K, 2K, ... only
        kwargs = {"use_reentrant": False}
        if getattr(features, "keep_attention", False):
            kwargs["context_fn"] = keep_attention_contexts
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, every_n_layers=every)
        if features.offload_activations:
            _offload_checkpoints(model)


def checkpoint_every(features) -> int:
    """K of `--checkpoint_every` (every K-th decoder layer checkpointed); --gradient_checkpointing and
    --offload_activations alone mean K=1; 0: no checkpointing."""
    every = getattr(features, "checkpoint_every", 0) or 0
    if every < 0:
        raise ValueError(f"--checkpoint_every {every}: use 0 (off), 1 (every layer) or K > 1 (every K-th layer)")
    return every or (1 if features.gradient_checkpointing or features.offload_activations else 0)


# --- checkpointing that keeps the attention output ------------------------------------------------------

def attention_ops() -> frozenset:
    """The fused attention kernels whose outputs --keep_attention saves: every SDPA backend (CPU, flash,
    memory-efficient, cuDNN, the overrideable one), the context-parallel ring's forward (one op: its block calls
    inside it are not seen) and flash-attn's own ops when that package registered them (flash-attn >= 2.7 under
    torch >= 2.4). A kernel not listed (SDPA's math fallback, flex_attention's
    higher-order op) is recomputed like any other op: the layer is then checkpointed in full, never wrong."""
    aten = torch.ops.aten
    names = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_fused_attention_overrideable")
    ops = {getattr(aten, n).default for n in names if hasattr(aten, n)}
    ops.add(ring_attention.forward_op())  # the ring's merged output, not its block calls (ring_attention.py)
    fa = getattr(torch.ops, "flash_attn", None)
    for n in ("_flash_attn_forward", "_flash_attn_varlen_forward"):
        try:
            ops.add(getattr(fa, n).default)
        except (AttributeError, RuntimeError):  # flash-attn absent or an older version: nothing to register
            pass
    return frozenset(ops)


# attention kernel outputs --keep_attention cached in forwards, and handed back by recomputes (train.py, the tests)
KEPT = {"saved": 0, "reused": 0}


class KeepKernels(TorchDispatchMode):
    """Below autograd, so the attention op's autograd node is built as usual and saves whatever the kernel call
    returns. Forward: run every op, cache the outputs of the attention kernels (`ops`: attention_ops) in call order.
    Recompute: answer the kernels from the cache, in the same order, and run every other op. Only the kernels are
    matched: torch's own selective checkpointing (create_selective_checkpoint_contexts) indexes every op of the
    region and fails when the recompute issues one the forward did not, which ZeRO-3's parameter gathers and
    prefetches inside a layer are free to do. Used by --keep_attention (keep_attention_contexts, counted in KEPT)
    and by head chunks (model_utils/head_chunks._Chunked, per chunk). `who` names the user in the one error."""

    def __init__(self, ops: frozenset, cache: collections.deque, recompute: bool, counts: dict | None = None,
                 who: str = "keep_attention"):
        super().__init__()
        self.ops, self.cache, self.recompute, self.counts, self.who = ops, cache, recompute, counts, who

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in self.ops:
            return func(*args, **(kwargs or {}))
        if self.recompute:
            if not self.cache:
                raise RuntimeError(f"{self.who}: the recompute called {func} more often than the forward did")
            if self.counts is not None:
                self.counts["reused"] += 1
            # a fresh alias, not the cached tensor: autograd sets the recomputed call's history (its grad_fn, which
            # holds q, k, v) on what this returns, and head chunks also keep the cached tensor among _Chunked's
            # saved tensors until its backward returns: handing it back tied every chunk's graph to that ctx
            # (16 GiB of projections at 1M tokens, 16 chunks, in a layer that kept its activations)
            return tree_map_only(torch.Tensor, torch.Tensor.detach, self.cache.popleft())
        out = func(*args, **(kwargs or {}))
        if self.counts is not None:
            self.counts["saved"] += 1
        self.cache.append(tree_map_only(torch.Tensor, torch.Tensor.detach, out))
        return out


def keep_attention_contexts():
    """torch checkpoint's `context_fn` (non-reentrant): a fresh (forward, recompute) pair of dispatch modes per
    checkpointed call, sharing one cache that lives as long as torch keeps the call's recompute state (until that
    layer's backward). The op set is read per call (a few attribute reads per layer), so flash-attn's ops count
    whenever the package was imported, which transformers does when it builds a flash_attention_2 model."""
    ops, cache = attention_ops(), collections.deque()
    return KeepKernels(ops, cache, False, KEPT), KeepKernels(ops, cache, True, KEPT)


def kept_attention_line(features, attn: str) -> str | None:
    """After a first step with --keep_attention: how many attention outputs were kept, or, when none was (the
    backend's kernel is not one attention_ops knows), that those layers recompute attention as plain
    checkpointing does. None without --keep_attention or without checkpointing."""
    if not (getattr(features, "keep_attention", False) and checkpoint_every(features)):
        return None
    if KEPT["saved"]:
        return f"keep_attention: {KEPT['saved']} attention outputs kept so far ({attn}); backward does not rerun them"
    return (f"keep_attention: no attention kernel of {attn} was kept (not an SDPA kernel nor flash-attn's op): the "
            "checkpointed layers recompute attention like plain checkpointing; drop --keep_attention to save the "
            "dispatch overhead")


def make_loss_fn(features) -> Callable[..., torch.Tensor]:
    """(engine, micro_batch) -> sum of token cross-entropies over this rank's shard."""
    return tiled_loss_sum if features.tiled_logits else loss_sum


# --- tiled MLP ---------------------------------------------------------------------------------------

def _gated_mlp(mlp, x: torch.Tensor) -> torch.Tensor:
    """One tile through the MLP's own forward (HF's, whatever its layout, or the lean one: model_utils/mlp.py)."""
    out = mlp._untiled_forward(x)
    if not torch.is_tensor(out) or out.shape != x.shape:  # _tile_mlps refuses the layouts known to do this
        raise ValueError(f"--tiled_mlp: {type(mlp).__name__} returned {type(out).__name__} "
                         f"{tuple(getattr(out, 'shape', ()))} for a {tuple(x.shape)} tile, not a tensor of the same "
                         "shape (the tiled MLP needs a token-wise MLP); drop tiled_mlp")
    return out


def _rng_state(device: torch.device) -> tuple:
    return torch.get_rng_state(), (torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


def _set_rng_state(state: tuple, device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


class _ReplayedTiles:
    """The tile function of one tiled-MLP call: backward's recompute of the tiles draws the random numbers the
    forward's tiles drew (an MLP's own dropout: Starcoder2's residual_dropout), so the gradients are those of the
    output the forward returned. Both run the same tiles in the same order (torch.chunk of the flattened rows), so
    the generator's state before the first tile is all it keeps (~5 KB per layer), restored around backward's tiles."""

    def __init__(self, device: torch.device):
        self.device, self.start, self.tiles, self.done, self.outer = device, None, 0, 0, None

    def __call__(self, mlp, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():  # the forward (TiledMLP / NormTiledMLP run it under no_grad)
            if self.tiles == 0:
                self.start = _rng_state(self.device)
            self.tiles += 1
            return _gated_mlp(mlp, x)
        if self.done == 0:  # backward's first tile: the forward's draws from here on
            self.outer = _rng_state(self.device)
            _set_rng_state(self.start, self.device)
        self.done += 1
        try:
            return _gated_mlp(mlp, x)
        finally:
            if self.done == self.tiles:  # the last tile: the generator continues where it was
                _set_rng_state(self.outer, self.device)
                self.done = 0


class NormTiledMLP(torch.autograd.Function):
    """DeepSpeed's TiledMLP for an input that is a lean RMSNorm's output: the same forward and gradients, but it
    keeps what the norm keeps (its input and 1/rms, model_utils/rmsnorm.norm_source) instead of the input itself,
    and its backward recomputes each tile's input rows from them (bitwise equal). One [T, h] tensor fewer kept per
    layer (Llama-3-8B at 1M tokens on one GPU: 8 GiB), for one elementwise pass over [T, h] in backward. The tile
    loop, the zeroed x_grad the tiles write into and ZeRO-3's ds_grad_is_ready handshake are TiledMLP's."""

    @staticmethod
    def forward(ctx, fn, mlp, x, shards, compute_params, source) -> torch.Tensor:
        ctx.fn, ctx.self, ctx.shards, ctx.shape = fn, mlp, shards, x.shape
        ctx.compute_params = [p for p in compute_params if p.requires_grad]
        ctx.x_requires_grad = x.requires_grad
        ctx.save_for_backward(*source)
        # tiles of the flattened rows, as the backward's (bs 1: TiledMLP's tiles along the sequence; bs > 1 used to
        # keep its input, a [T, h] per layer the planner did not count)
        with torch.no_grad():
            x2 = x.reshape(-1, x.shape[-1])
            return torch.cat([fn(mlp, t) for t in torch.chunk(x2, chunks=shards, dim=0)], dim=0).view(x.shape)

    @staticmethod
    def backward(ctx, *grads):
        xr, weight, rstd = ctx.saved_tensors
        h = ctx.shape[-1]
        rows = xr.numel() // h
        incoming = grads[0].reshape(-1, h)
        x_grad = torch.zeros((rows, h), dtype=incoming.dtype, device=incoming.device)
        step = -(-rows // ctx.shards)  # torch.chunk's split, as the forward's tiles
        starts = list(range(0, rows, step))
        sums = TileGradSum(ctx.compute_params, len(starts))  # gate / up / down's gradients summed in fp32
        for i, s in enumerate(starts):
            e, last = min(s + step, rows), i + 1 == len(starts)
            for p in ctx.compute_params:  # ZeRO-3: reduce the weights' gradients after the last tile only
                p.ds_grad_is_ready = last
            tile = renorm(xr, weight, rstd, s, e).requires_grad_(ctx.x_requires_grad)
            if ctx.x_requires_grad:
                tile.grad = x_grad[s:e]
            with torch.enable_grad():
                out = ctx.fn(ctx.self, tile)
            sums.before(last)
            torch.autograd.backward(out, incoming[s:e])
            sums.after(last)
        return None, None, x_grad.view(ctx.shape), None, None, None


def _tiled_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    """x: [bs, sl_local, hidden] -> [bs, sl_local, hidden], the same MLP over sequence tiles."""
    tiles = agreed_tiles(mlp_tiles(x.shape[-2], x.shape[-1], MLP_TILE_TOKENS), x.device)
    # All of the MLP's weights get one gradient per tile; TiledMLP tells ZeRO-3 to reduce them after the last.
    source = norm_source(x) if torch.is_grad_enabled() else None
    engaged("tiled_mlp")  # per layer and micro-batch (model_utils/engagement.py)
    fn = _ReplayedTiles(x.device)
    if source is not None:  # x is the post-attention lean RMSNorm's output: keep what the norm keeps, not x
        engaged("norm_recompute")
        return NormTiledMLP.apply(fn, self, x, tiles, list(self.parameters()), source)
    missing_norm_source(self, "the tiled MLP")  # the plan counted it: stop before its backward needs the [T, h]
    # rows flattened: TiledMLP's forward then tiles as its backward does (bs > 1: along -2 it would tile [bs, t, h],
    # its backward rows), so backward replays the forward's random draws tile for tile (_ReplayedTiles)
    rows = x.reshape(-1, x.shape[-1])
    return TiledMLP.apply(fn, self, rows, tiles, list(self.parameters())).view(x.shape)


def _mlp_refusal(model, layer) -> str:
    """Why `layer`'s MLP cannot be tiled ("": it can). The tiled MLP runs the MLP's own forward on tiles of rows, right
    for any token-wise [.., h] -> [.., h] MLP: gated (gate/up/down_proj), fused (Phi-3's gate_up_proj), plain
    (Starcoder2's c_fc/c_proj, Phi's fc1/fc2, Nemotron's up/down_proj). Not for a mixture of experts: its router
    picks experts per token (an `experts` / `router` submodule in every transformers 5.x MoE block)."""
    mlp = getattr(layer, "mlp", None)
    if mlp is None:
        return (f"{type(layer).__name__} has no `mlp` ({', '.join(n for n, _ in layer.named_children())}), "
                "the module the tiled MLP tiles")
    if any(name.rsplit(".", 1)[-1] in ("experts", "router") for name, _ in mlp.named_modules()):
        return tiled_mlp_refusal(getattr(model.config, "model_type", ""))
    returns = inspect.signature(mlp.forward).return_annotation
    if "tuple" in str(returns).lower():  # (hidden, router logits): not one [.., h] tensor per tile
        return f"{type(mlp).__name__}'s forward returns a tuple ({returns}), not one [.., hidden] tensor"
    return ""


def _tile_mlps(model) -> None:
    layers = getattr(model.get_decoder(), "layers", None)
    if layers is None:
        raise ValueError(f"--tiled_mlp: no decoder layers found in {type(model).__name__}")
    for layer in layers:
        why = _mlp_refusal(model, layer)
        if why:
            raise ValueError(f"--tiled_mlp: {type(model).__name__}: {why}; drop tiled_mlp (--tiled_mlp, the stage's "
                             "memory_features)")
        mlp = layer.mlp
        mlp._untiled_forward = mlp.forward
        mlp.forward = types.MethodType(_tiled_mlp_forward, mlp)  # this instance only: other models untouched
        # ZeRO-3 leaf: the MLP's weights are gathered once per forward and once per backward of the whole MLP,
        # not per call of gate/up/down_proj. Without it every tile re-gathers them (with offload_param, a host
        # -> device copy of the three matrices per tile, twice per step): measured on an H200 at 65536 tokens
        # (h1024, 8 layers, 64 tiles), 0.36 of the tokens/s without tiled MLP, 23 ms per extra tile.
        set_z3_leaf_module(mlp, True)


# --- activation checkpoint offload -------------------------------------------------------------------

_STAYS = ("cpu",)  # device types whose tensors are host memory already: nothing moves (a test empties it)


def _to_host(t: torch.Tensor, arena: HostArena | None = None):
    """Pack hook: a checkpointed layer input goes to an exact-size page-locked slot of `arena` (pinned CPU memory
    without one); on CPU runs it stays where it is. Llama-3-8B at 5M tokens on 8 GPUs: 32 slots of 4.77 GiB per
    rank, 153 GiB, where torch's pinned blocks held 256 (8 GiB each); registered once, at the stage's first step."""
    if t.device.type in _STAYS:
        return t.device, t
    host = arena.take(t.shape, t.dtype) if arena is not None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)  # same stream as the compute that reads it back: ordered, no sync
    return t.device, host


def _to_device(packed, arena: HostArena | None = None) -> torch.Tensor:
    device, t = packed
    out = t.to(device, non_blocking=True)
    if arena is not None and out is not t:  # the slot's next writer (next step's forward) waits for this copy
        arena.read(t)
    return out


def _checkpoint_with_offload(arena: HostArena, checkpoint_fn, function, *args, **kwargs):
    # torch's non-reentrant checkpoint saves the layer inputs under the hooks active here, and everything
    # computed inside the layer under its own (innermost) hooks: so only the inputs pass through _to_host.
    packed = []

    def pack(t):
        packed.append(True)
        return _to_host(t, arena)

    with torch.autograd.graph.saved_tensors_hooks(pack, functools.partial(_to_device, arena=arena)):
        out = checkpoint_fn(function, *args, **kwargs)
    if packed:  # the layer's inputs went through the offload hooks (model_utils/engagement.py)
        engaged("offload_activations")
    return out


def _offload_checkpoints(model) -> None:
    """Wrap the checkpoint function transformers gave each checkpointed layer. (transformers' own
    `offload=True` pins memory unconditionally and fails on CPU-only torch builds.) The checkpoints go to one host
    arena per model (`model._host_arena`), released with the model at stage end (release_engine + gc.collect)."""
    arena = model.__dict__.setdefault("_host_arena", HostArena("activation checkpoints"))
    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False) and hasattr(module, "_gradient_checkpointing_func"):
            module._gradient_checkpointing_func = functools.partial(_checkpoint_with_offload, arena,
                                                                    module._gradient_checkpointing_func)
