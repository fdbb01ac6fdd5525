"""One optimizer step over a sequence-sharded global batch, weighting every supervised token equally.

Each rank holds [bs, sl/sp] shards of its SP group's samples. The step's loss is

    L = sum of token cross-entropies over the whole global batch / number of labelled tokens in it

(all DP replicas, all accumulation micro-steps, all micro-batch rows, all SP shards): exactly the plain model's
mean loss over the same samples, never a mean of per-rank, per-sample or per-micro-batch means (under SFT most
SP ranks of a long prompt hold no label at all, and such means would weigh a 3-token shard like a 3000-token
one). Every rank backpropagates its *local* sum of cross-entropies; Ulysses' all-to-all carries the gradient
to the ranks that own the other parts of the sequence, so the sum of all ranks' gradients is the gradient of
the global sum. DeepSpeed then divides by the gradient accumulation steps and averages over the world (its
data-parallel group is the whole world when SP is on), so scaling each local sum by world * GA / n_tokens
yields the gradient of L.

With per-conversation weights (`loss_weights`, LongAlign: 1 / N_i on conversation i's supervised tokens,
computed on the whole sample before sharding, data/sharding.py) the same holds with weighted sums: L = sum of
w_t CE_t / sum of w_t, the mean over the global batch's conversations of each one's mean loss.

A rank, a micro-batch or a whole SP group without any supervised token adds 0 to the sums (and still runs its
forward and backward: every collective is called on every rank). A global batch without any supervised token is
skipped whole: no forward, no backward, no optimizer step (AdamW's momentum and weight decay would still move the
weights, and the LR schedule would advance), loss 0 and `skipped` in the result. Every rank decides it from the same
all-reduced count, so every rank skips the same collectives. Cost: one all-reduce of two numbers per step, before
the first forward.

A step's health (`bad_step`, `LossWatch`; training/stage.py acts on them): a non-finite loss or a skipped update
(DeepSpeed skips the optimizer step and the LR schedule on an invalid global gradient norm, inf / NaN / negative, in
bf16 and fp32 too, not only on fp16's overflow: deepspeed/runtime/zero/stage3.py `step`, runtime/utils.py
`is_invalid_grad_norm`) is a bad step; and a finite loss far above the stage's recent ones is a spike.
"""

from __future__ import annotations

import collections
import math
import statistics

import torch

from base import comm, progress, stopped
from model_utils.tiled_loss import loss_sum


def label_totals(micro_batches: list[dict[str, torch.Tensor]]) -> list[float]:
    """This rank's [supervised tokens, loss weight] over its micro-batches (the weight is the token count
    without `loss_weights`). Summed over the world they are the global batch's, each token counted once: SP
    ranks hold disjoint shards of their group's samples, DP groups disjoint samples."""
    tokens = sum(int((mb["shift_labels"] != -100).sum()) for mb in micro_batches)
    weight = sum(float(mb["loss_weights"].double().sum()) if "loss_weights" in mb
                 else float((mb["shift_labels"] != -100).sum()) for mb in micro_batches)
    return [float(tokens), weight]


def train_step(engine, micro_batches: list[dict[str, torch.Tensor]], world: int,
               loss_fn=loss_sum, before_step=None) -> dict[str, float]:
    """Forward/backward every micro-batch, then the optimizer step. Returns the loss, `label_tokens` (the
    global batch's supervised tokens, for the metrics) and, with conversation weights, `label_weight` (its
    conversations with a supervised token); `skipped` where the global batch had no supervised token (nothing run)."""
    t0 = stopped.now()  # a clock that stands still while this process is stopped (scontrol suspend: base/stopped.py)
    progress.mark(None, "forward")  # before the step's first collective: a rank that never gets here is behind
    device = engine.device
    n_tokens, n_weight = comm.all_reduce(label_totals(micro_batches)).tolist()
    if n_tokens == 0:  # the global count, the same on every rank: every rank skips (never a rank-local decision)
        return {"loss": 0.0, "label_tokens": 0, "skipped": True, "step_time": stopped.now() - t0}
    denom = n_weight if n_weight > 0 else 1.0  # guard only: a supervised token weighs > 0 (1 / N_i at most)
    scale = world * len(micro_batches) / denom
    total = torch.zeros((), dtype=torch.float64)
    for i, mb in enumerate(micro_batches):
        mb = {k: v.to(device) for k, v in mb.items()}
        progress.mark(None, "forward")  # where this rank is, for rank 0's hang detection (base/progress.py)
        local = loss_fn(engine, mb)
        progress.mark(None, "backward")
        engine.backward(local * scale)
        if before_step is not None and i == len(micro_batches) - 1:
            before_step(engine)  # e.g. tests reading the full gradients before the optimizer consumes them
        progress.mark(None, "optimizer")
        engine.step()
        total += local.detach().double().cpu()
    out = {"loss": comm.all_reduce(total).item() / denom, "label_tokens": int(n_tokens),
           "step_time": stopped.now() - t0}
    if any("loss_weights" in mb for mb in micro_batches):
        out["label_weight"] = n_weight
    applied = getattr(engine, "was_step_applied", None)
    if applied is not None and not applied():  # DeepSpeed skipped the update and the LR schedule on an invalid
        out["overflow"] = True  # gradient norm, in any precision (logged: the step counts, its update did not happen)
    return out


# K non-finite steps in a row stop the run (training/stage.py). One is a bad batch (a corrupt document, an fp32
# overflow in one attention row): DeepSpeed skipped its update, the weights are as before and the next batch trains
# (the audit's NaN loss at step 5 trained on from step 6). K in a row is the state itself (a NaN weight, a NaN Adam
# moment): every later step is skipped. 5 tolerates a short run of bad documents and costs 5 wasted steps before
# the stop (1M tokens on 64 GPUs: ~25 min). Megatron stops at the first (--check-for-nan-in-loss-and-grad, on by
# default: megatron/training/arguments.py), torchtitan too (torchtitan/trainer.py "Loss or gradient norm is not finite
# on at least one rank"): neither skips a bad update and trains on as DeepSpeed does.
BAD_STEPS_STOP = 5
# A loss spike: a finite loss above SPIKE_FACTOR x the median of the stage's last SPIKE_WINDOW finite, non-spike
# losses, judged once SPIKE_WARMUP are in (a median of fewer is one batch's noise). The losses of single long
# documents can differ ~2x (code vs prose); 3x is a divergence or a broken batch (the audit's LR x1000: 74 vs a median of
# 7). The window restarts at every stage: a new length or RoPE moves the loss legitimately. 50 steps of floats on the
# host: no cost.
# A spike must also exceed the median by SPIKE_NATS (a ratio near zero means nothing: 0.0037 against 0.0005 on a
# passkey answer). Steps are judged against their own kind (`full`: at least half the step's tokens supervised, a text
# step; else a task or chat step, whose loss is on answers only): the extension demo's passkey steps (loss ~0.001, 80%
# of its steps) made every text step (~3.2) a "spike", 33 in one `make demo`. A pin is let go after SPIKE_RELEASE
# steps without a spike: the loss came back, and the extra checkpoint (~96 GB at Llama-3-8B) stops costing disk.
SPIKE_WINDOW, SPIKE_WARMUP, SPIKE_FACTOR, SPIKE_NATS, SPIKE_RELEASE = 50, 5, 3.0, 1.0, 100


def bad_step(out: dict, fp16: bool = False) -> bool:
    """Whether a step's result is non-finite: its loss (all-reduced) or its update skipped (DeepSpeed's all-reduced
    norm): the same on every rank, no collective of its own. Under fp16 a skipped update with a finite loss is the
    loss scaler's routine halving (several in a row at a start), not a bad step: DeepSpeed itself raises at the
    minimum scale (deepspeed/runtime/fp16/loss_scaler.py raise_error_at_min_scale)."""
    return not math.isfinite(out["loss"]) or bool(out.get("overflow")) and not fp16


class LossWatch:
    """A stage's recent finite losses (host floats); `spike(loss)` says whether `loss` starts a spike."""

    def __init__(self, window: int = SPIKE_WINDOW, warmup: int = SPIKE_WARMUP, factor: float = SPIKE_FACTOR):
        self.by_kind: dict = {}  # kind -> (its recent losses, whether its last step was in a spike)
        self.window, self.warmup, self.factor, self.spiking = window, warmup, factor, False
        self.losses: collections.deque = collections.deque(maxlen=window)  # the kind judged last (its window)
        self.spiked: int | None = None  # the step of the last spike said, and the checkpoint kept from before it
        self.pinned: str | None = None

    def spike(self, loss: float, kind: str = "full") -> float | None:
        """The median of `kind`'s window when `loss` starts a spike (that kind's step before was none), else None. A
        spike's losses stay out of the window: a divergence that lasts stays one spike, judged against the loss
        before it."""
        if not math.isfinite(loss):
            return None
        self.losses, self.spiking = self.by_kind.get(kind, (collections.deque(maxlen=self.window), False))
        median = statistics.median(self.losses) if len(self.losses) >= self.warmup else None
        spiked = median is not None and median > 0 and loss > self.factor * median and loss - median > SPIKE_NATS
        started = spiked and not self.spiking
        if not spiked:
            self.losses.append(loss)
        self.by_kind[kind] = (self.losses, spiked)
        return median if started else None


def nonfinite_state(engine) -> int:
    """How many of this rank's optimizer tensors hold a non-finite value: its partition of the fp32 master weights
    (ZeRO-3's `fp32_partitioned_groups_flat`, ZeRO-1/2's `single_partition_of_fp32_groups`, else the inner optimizer's
    parameters: what a checkpoint's optim states hold and the export consolidates) and Adam's moments (the next
    update's input). A save checks it before it writes (training/checkpoint.py): a NaN in a weight no loss touches
    (an embedding row no batch reads, silent data corruption) was saved, rotated the good ones away and exported.
    Cost: a float32 sum per tensor, on the device, or on the host where the offload keeps it (0.06 s per 250M values
    on 2 CPU cores, measured: Llama-3-8B's weights and two moments on 32 ranks, 750M values, ~0.2 s per save beside
    its ~95 s); only a non-finite sum is checked element by element (a float32 sum of finite values may overflow).
    Partitions swapped out to NVMe (offload_optimizer nvme: an empty placeholder in memory) are not read."""
    opt = getattr(engine, "optimizer", None)
    inner = getattr(opt, "optimizer", opt)
    flat = getattr(opt, "fp32_partitioned_groups_flat", None) or getattr(opt, "single_partition_of_fp32_groups", None) \
        or [p for g in getattr(inner, "param_groups", ()) for p in g["params"]]
    moments = [v for s in getattr(inner, "state", {}).values() if isinstance(s, dict) for v in s.values()
               if torch.is_tensor(v) and v.is_floating_point()]
    with torch.no_grad():
        return sum(1 for t in [*flat, *moments] if t.numel() and not math.isfinite(t.detach().sum().item())
                   and not bool(torch.isfinite(t).all()))
