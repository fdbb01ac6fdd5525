"""Long-sequence memory features, each switchable from the config and each keeping loss/gradient parity:
tiled MLP, tiled logits + loss, activation checkpointing (optionally offloaded to CPU).

`apply_memory_features(model, cfg)` runs after the model is built and before `deepspeed.initialize`;
`make_loss_fn(cfg)` returns the function `training.step.train_step` uses to get the local loss sum.
"""

from __future__ import annotations

from training.step import loss_sum


def apply_memory_features(model, cfg) -> None:
    """Enable the features `cfg` asks for on `model` (in place)."""
    if cfg.tiled_mlp or cfg.tiled_logits or cfg.gradient_checkpointing or cfg.offload_activations:
        raise ValueError("memory features (tiled_mlp, tiled_logits, gradient_checkpointing, offload_activations) "
                         "are not implemented yet")


def make_loss_fn(cfg):
    """(engine, micro_batch) -> sum of token cross-entropies over this rank's shard."""
    return loss_sum
