"""One optimizer step over a sequence-sharded global batch, weighting every real token equally.

Each rank holds [bs, sl/sp] shards of its SP group's samples. The step's loss is

    L = sum of token cross-entropies over the whole global batch / number of labelled tokens in it

(all DP replicas, all accumulation micro-steps, all SP shards): exactly the plain model's mean loss
over the same samples. Every rank backpropagates its *local* sum of cross-entropies; Ulysses'
all-to-all carries the gradient to the ranks that own the other parts of the sequence, so the sum of
all ranks' gradients is the gradient of the global sum. DeepSpeed then divides by the gradient
accumulation steps and averages over the world (its data-parallel group is the whole world when SP is
on), so scaling each local sum by world * GA / n_tokens yields the gradient of L.
"""

from __future__ import annotations

import time

import torch

from base import comm
from model_utils.tiled_loss import loss_sum


def train_step(engine, micro_batches: list[dict[str, torch.Tensor]], world: int,
               loss_fn=loss_sum, before_step=None) -> dict[str, float]:
    """Forward/backward every micro-batch, then the optimizer step. Returns loss and token counts."""
    t0 = time.perf_counter()
    device = engine.device
    n_local = sum(int((mb["shift_labels"] != -100).sum()) for mb in micro_batches)
    n_total = max(comm.all_reduce([float(n_local)]).item(), 1.0)
    scale = world * len(micro_batches) / n_total
    total = torch.zeros((), dtype=torch.float64)
    for i, mb in enumerate(micro_batches):
        mb = {k: v.to(device) for k, v in mb.items()}
        local = loss_fn(engine, mb)
        engine.backward(local * scale)
        if before_step is not None and i == len(micro_batches) - 1:
            before_step(engine)  # e.g. tests reading the full gradients before the optimizer consumes them
        engine.step()
        total += local.detach().double().cpu()
    return {"loss": comm.all_reduce(total).item() / n_total, "label_tokens": n_total, "step_time": time.perf_counter() - t0}
