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
"""

from __future__ import annotations

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
    if applied is not None and not applied():  # fp16's overflow: DeepSpeed skipped the update and the LR schedule
        out["overflow"] = True  # (logged: the step counts, its update did not happen)
    return out
