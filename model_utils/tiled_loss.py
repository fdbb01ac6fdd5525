"""The LM head and cross-entropy one sequence tile at a time: the `[bs, sl_local, vocab]` logits never exist
whole (about 1 GiB of fp32 logits per tile, ArcticTraining's rule; `--logits_tile_mb`, and memory_features auto
takes 1/64 of the per-rank budget when that is less: planner.memory_model.logits_tile_bytes). Training uses it with `--tiled_logits`;
evaluation always does (`eval_stats`), so an evaluation never holds more logits than a training step.

Cost at the target scale (Llama 3, vocab 128256, 128k tokens, SP=2): one shard's full fp32 logits would be
65536 x 128256 x 4 B = 31 GiB (and a copy per masked index); a tile is 1 GiB, 32 tiles.

`install_loss_forward(model)` patches the model's forward once at build (before `deepspeed.initialize`);
without `tiled_loss_labels` the forward is the model's own.
"""

from __future__ import annotations

import math
import types

import torch
import torch.nn.functional as F

from base import comm
from model_utils.engagement import engaged

LOGITS_TILE_BYTES: int = 2**30  # fp32 logits per loss tile (ArcticTraining's 1 GiB); module-level for tests


def loss_sum(engine, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    """Sum of next-token cross-entropies over this rank's shard (labels -100 ignored), each weighted by
    `mb["loss_weights"]` when the micro-batch has them (per-conversation weighting, data/sharding.py).

    shift_labels are already shifted (inside the full sample, before sharding), so no shift here. A shard with
    no supervised token gives 0 (a sum, never a mean: no 0/0), and its backward still runs every collective."""
    out = engine(input_ids=mb["input_ids"], position_ids=mb["position_ids"], use_cache=False)
    return _weighted_ce_sum(out.logits.float(), mb["shift_labels"], mb.get("loss_weights"))


def _weighted_ce_sum(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """sum_t w_t CE_t over [bs, t, vocab] fp32 logits (w = 1 without weights). The weighted form keeps a [bs, t]
    fp32 vector of per-token losses: 4 B a token, nothing next to the logits' 4 x vocab B."""
    flat, y = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
    if weights is None:
        return F.cross_entropy(flat, y, ignore_index=-100, reduction="sum")
    ce = F.cross_entropy(flat, y, ignore_index=-100, reduction="none")  # 0 where ignored
    return (ce * weights.reshape(-1).to(ce.dtype)).sum()


def agreed_tiles(n: int, device: torch.device | None = None) -> int:
    """max(1, n) agreed over all ranks: ZeRO-3 gathers each weight with a collective, so every rank must
    call the tiled module the same number of times. Shapes are equal on all ranks in this project (fixed
    length packing, sharded evenly), so this only guards against a future variable-length pipeline."""
    return int(comm.all_reduce([float(max(1, n))], op="max").item())


def _ce_sum(lm_head, hidden: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """(Weighted) sum of cross-entropies of one tile ([bs, t, hidden], [bs, t]), in fp32 like loss_sum."""
    return _weighted_ce_sum(lm_head(hidden).float(), labels, weights)


class TileGradSum:
    """fp32 sums of the weights' gradients across the tiles of one tiled backward (the tiled loss's LM head, the
    tiled MLP's gate / up / down). Each tile's backward still accumulates into `p.grad` (so ZeRO-3's hooks and its
    `ds_grad_is_ready` handshake see what they always did), but after every tile but the last its bf16 gradient is
    moved into an fp32 sum and `p.grad` zeroed; before the last tile the sum is written back into `p.grad`, which that
    tile's backward adds to. Summed in bf16 the relative error of the head's gradient grew with the tiles (against
    fp64, Llama-3-like shapes: 1.8e-3 untiled, 8.1e-3 at 64 tiles, 1.8e-2 at 256, 3.0e-2 at 512; the MLP's 3.9e-3 ->
    1.9e-2 at 256); now two roundings at most, whatever the count. In place on `p.grad`, never assigned: under ZeRO-3
    the weight is partitioned between tiles while its full-size gradient stays. Costs 4 B per weight while the tiled
    backward runs (Llama-3-8B: 2 GiB for the head, 0.7 GB for one layer's MLP; planner.memory_model counts both);
    nothing for fp32 weights or a single tile."""

    def __init__(self, params, tiles: int):
        self.params = [p for p in params if p.dtype in (torch.bfloat16, torch.float16)] if tiles > 1 else []
        self.sums: list[torch.Tensor | None] = [None] * len(self.params)

    def before(self, last: bool) -> None:
        """Call before a tile's backward: the last one starts from the fp32 sum of the others."""
        if last:
            for p, acc in zip(self.params, self.sums):
                if acc is not None and p.grad is not None:
                    p.grad.copy_(acc)
            self.sums = []

    def after(self, last: bool) -> None:
        """Call after a tile's backward: its gradient (and any earlier one in p.grad) into the fp32 sum."""
        if last:
            return
        for k, p in enumerate(self.params):
            if p.grad is None:
                continue
            if self.sums[k] is None:
                self.sums[k] = p.grad.to(torch.float32, copy=True)
            else:
                self.sums[k].add_(p.grad)
            p.grad.zero_()


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
    def forward(ctx, hidden, labels, lm_head, tiles: int, tied: bool, weights=None):
        ctx.save_for_backward(hidden, labels, weights)
        ctx.lm_head, ctx.tiles, ctx.tied = lm_head, tiles, tied
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for a, b in _spans(hidden.shape[1], tiles):
            total += _ce_sum(lm_head, hidden[:, a:b], labels[:, a:b], None if weights is None else weights[:, a:b])
        return total

    @staticmethod
    def backward(ctx, grad_total):
        hidden, labels, weights = ctx.saved_tensors
        grad_hidden = torch.zeros_like(hidden)
        params = [p for p in ctx.lm_head.parameters() if p.requires_grad]
        spans = _spans(hidden.shape[1], ctx.tiles)
        sums = TileGradSum(params, len(spans))  # the head's gradient summed over the tiles in fp32
        for i, (a, b) in enumerate(spans):
            last = i == len(spans) - 1
            for p in params:
                p.ds_grad_is_ready = last and not ctx.tied
            tile = hidden[:, a:b].detach().requires_grad_()
            with torch.enable_grad():
                loss = _ce_sum(ctx.lm_head, tile, labels[:, a:b], None if weights is None else weights[:, a:b])
            sums.before(last)
            torch.autograd.backward(loss, grad_total)
            sums.after(last)
            grad_hidden[:, a:b] = tile.grad
        for p in params:
            p.ds_grad_is_ready = True  # tied: the embedding's gradient hook reduces the sum later
        return grad_hidden, None, None, None, None, None


def _spans(sl: int, tiles: int) -> list[tuple[int, int]]:
    """Exactly `tiles` [a, b) ranges covering 0..sl (trailing ones empty when tiles does not divide evenly),
    so every rank makes the same number of LM head calls."""
    step = math.ceil(sl / tiles)
    return [(min(i * step, sl), min((i + 1) * step, sl)) for i in range(tiles)]


def logits_tiles(bs: int, sl: int, vocab: int, tile_bytes: int = 0) -> int:
    """Tiles for about `tile_bytes` (0: LOGITS_TILE_BYTES) of fp32 logits each, at most one per token."""
    return max(1, min(sl, math.ceil(bs * sl * vocab * 4 / (tile_bytes or LOGITS_TILE_BYTES))))


@torch.no_grad()
def _stats(lm_head, hidden: torch.Tensor, labels: torch.Tensor, tiles: int,
           buckets: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
    """Per sample: [sum CE, labelled tokens, labelled tokens whose argmax is wrong] -> [bs, 3] float64, one tile
    of logits at a time. With `buckets` = (bucket_ids [bs, sl_local], n), n CE sums then n labelled-token counts
    per bucket follow ([bs, 3 + 2n]; a bucket id outside 0..n-1 counts in no bucket)."""
    nb = buckets[1] if buckets is not None else 0
    out = torch.zeros(hidden.shape[0], 3 + 2 * nb, dtype=torch.float64, device=hidden.device)
    for a, b in _spans(hidden.shape[1], tiles):
        logits = lm_head(hidden[:, a:b]).float()  # [bs, tile, vocab]
        y = labels[:, a:b]
        mask = y != -100
        ce = F.cross_entropy(logits.transpose(1, 2), y, ignore_index=-100, reduction="none")  # [bs, tile]
        out[:, 0] += ce.sum(1).double()
        out[:, 1] += mask.sum(1)
        out[:, 2] += ((logits.argmax(-1) != y) & mask).sum(1)
        if nb:
            ids = buckets[0][:, a:b].long()
            ok = mask & (ids >= 0) & (ids < nb)
            onehot = F.one_hot(ids.clamp(0, nb - 1), nb).double() * ok.unsqueeze(-1)  # [bs, tile, nb]
            out[:, 3:3 + nb] += (onehot * ce.double().unsqueeze(-1)).sum(1)
            out[:, 3 + nb:] += onehot.sum(1)
        del logits, ce
    return out


def _forward_with_tiled_loss(self, *args, tiled_loss_labels: torch.Tensor | None = None, eval_stats: bool = False,
                             eval_buckets: tuple[torch.Tensor, int] | None = None,
                             tiled_loss_weights: torch.Tensor | None = None, **kwargs):
    """The model's forward; given `tiled_loss_labels` ([bs, sl_local], already shifted, -100 ignored) it
    returns the summed cross-entropy instead of the logits (weighted per token by `tiled_loss_weights` when
    given), computed tile by tile (with `eval_stats`, no autograd, the `_stats` triple, plus per-bucket CE sums
    and counts given `eval_buckets`)."""
    if tiled_loss_labels is None:
        return self._untiled_forward(*args, **kwargs)
    hidden = self.get_decoder()(*args, **kwargs).last_hidden_state  # [bs, sl_local, hidden]
    scale = logit_scale(self.config)
    if scale != 1.0:  # the model's own forward scales its logits (a copy of the shard's hidden states: 1 GiB at 128k
        hidden = hidden * scale  # tokens x 4096 in bf16; these families only); its LM head has no bias: the same
    lm_head = self.get_output_embeddings()
    tile_bytes = getattr(self, "_logits_tile_bytes", 0)  # --logits_tile_mb (auto: from the budget), set at build
    tiles = agreed_tiles(logits_tiles(*tiled_loss_labels.shape, lm_head.out_features, tile_bytes), hidden.device)
    if eval_stats:
        return _stats(lm_head, hidden, tiled_loss_labels, tiles, eval_buckets)
    tied = lm_head.weight is self.get_input_embeddings().weight
    weights = () if tiled_loss_weights is None else (tiled_loss_weights,)  # unweighted: the 5-argument call as before
    engaged("tiled_logits")  # per training micro-batch (model_utils/engagement.py)
    return TiledCrossEntropySum.apply(hidden, tiled_loss_labels, lm_head, tiles, tied, *weights)


# the families whose CausalLM forward scales the logits (transformers 5.23's modeling files; MPT's config has a
# logit_scale its forward never reads): logits x logit_scale; logits x logits_scaling (HyperCLOVA X's muP); / it
LOGIT_SCALE = {"cohere", "cohere2", "cohere2_moe", "cohere_compass"}
LOGITS_SCALING_MULTIPLIES = {"hyperclovax"}
LOGITS_SCALING_DIVIDES = {"granite", "granite_swa", "granitemoe", "granitemoe_swa", "granitemoehybrid",
                          "granitemoeshared", "minicpm3"}


def logit_scale(config) -> float:
    """The factor a family's forward puts on its logits after the LM head (Cohere's `logit_scale`: 0.0625 for
    Command-R; Granite's and MiniCPM3's `logits_scaling`, divided: 16 for Granite 8B). Without it the tiled loss, which
    evaluation always uses and `--tiled_logits` trains with, scored logits 16x too sharp: held-out losses ~9x HF's."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    kind = getattr(cfg, "model_type", "")
    if kind in LOGIT_SCALE:
        return float(getattr(cfg, "logit_scale", None) or 1.0)
    if kind in LOGITS_SCALING_MULTIPLIES:
        return float(getattr(cfg, "logits_scaling", None) or 1.0)
    if kind in LOGITS_SCALING_DIVIDES:
        return 1.0 / float(getattr(cfg, "logits_scaling", None) or 1.0)
    return 1.0


def install_loss_forward(model) -> None:
    """Give `model` the tiled-loss forward (in place, this instance only; idempotent)."""
    if hasattr(model, "_untiled_forward"):
        return
    if model.get_output_embeddings() is None or model.get_decoder() is model:
        raise ValueError(f"{type(model).__name__} has no separate LM head over a decoder: not a causal LM this "
                         "project can train (AutoModelForCausalLM with get_decoder() and lm_head)")
    model._untiled_forward = model.forward
    model.forward = types.MethodType(_forward_with_tiled_loss, model)  # going through the engine keeps its hooks


def tiled_loss_sum(engine, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    """loss_sum without the whole [bs, sl_local, vocab] logits. It goes through the engine's
    forward, like loss_sum, because DeepSpeed starts its backward bookkeeping from hooks on the outputs."""
    weights = {"tiled_loss_weights": mb["loss_weights"]} if "loss_weights" in mb else {}
    out = engine(input_ids=mb["input_ids"], position_ids=mb["position_ids"], use_cache=False,
                 tiled_loss_labels=mb["shift_labels"], **weights)
    if not torch.is_tensor(out):
        raise RuntimeError("tiled loss: the model's forward was not patched (install_loss_forward not run)")
    return out


def eval_stats(engine, mb: dict[str, torch.Tensor], buckets: int = 0) -> torch.Tensor:
    """Per sample [sum CE, labelled tokens, wrong argmax] ([bs, 3]) over this rank's shard of `mb`, without
    gradients and without the whole logits: evaluation's version of the training loss. With `buckets` = n,
    `mb["bucket_ids"]` ([bs, sl_local], e.g. the position's eighth of the sequence) adds n CE sums and n
    labelled-token counts per sample ([bs, 3 + 2n])."""
    extra = {"eval_buckets": (mb["bucket_ids"], buckets)} if buckets else {}
    with torch.no_grad():
        return engine(input_ids=mb["input_ids"], position_ids=mb["position_ids"], use_cache=False,
                      tiled_loss_labels=mb["shift_labels"], eval_stats=True, **extra)
