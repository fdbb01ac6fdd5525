"""Worker for tests/multiproc/test_memory_features.py: parity.run_case per case, with the memory features' tiles
made small enough to split the test's short sequences, and a record of what the features did.

argv: JSON list of parity cases, each with an extra "knobs" dict ({"MLP_TILE_TOKENS": 12, ...}).
Beside each case's "out" file, rank 0 writes OUT.stats.pt: MLP tile counts, loss tile counts (and
whether the head was tied), how many checkpointed tensors went through the offload hooks, how many
layer calls ran under torch's checkpoint (selective checkpointing: only every K-th layer), and how often
ZeRO-3 gathered the parameters of a tiled MLP, as a whole and per projection (gate/up/down_proj), and how many
attention kernel outputs --keep_attention saved in the forward and handed back in the recompute; and the step's
engagement counters (model_utils/engagement.py) with what the built model expected per micro-batch.
"""

import json
import sys
import warnings

import torch
import torch.distributed as dist
import transformers.modeling_utils as hf_modeling
from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

warnings.filterwarnings("ignore")

from model_utils import engagement, memory, tiled_loss  # noqa: E402
from tests.workers.parity import run_case  # noqa: E402

STATS: dict = {}
_tiled_mlp, _tiled_ce, _to_host = memory.TiledMLP, tiled_loss.TiledCrossEntropySum, memory._to_host
_norm_tiled_mlp = memory.NormTiledMLP


class _SpyTiledMLP:
    @staticmethod
    def apply(fn, mlp, x, shards, params):
        STATS["mlp_tiles"].add(shards)
        return _tiled_mlp.apply(fn, mlp, x, shards, params)


class _SpyNormTiledMLP:  # the tiled MLP that recomputes its lean norm's output (model_utils/rmsnorm.norm_source)
    @staticmethod
    def apply(fn, mlp, x, shards, params, source):
        STATS["mlp_tiles"].add(shards)
        STATS["mlp_renorm"] += 1
        return _norm_tiled_mlp.apply(fn, mlp, x, shards, params, source)


class _SpyTiledCE:
    @staticmethod
    def apply(hidden, labels, lm_head, tiles, tied):
        STATS["logits_tiles"].add((tiles, tied))
        return _tiled_ce.apply(hidden, labels, lm_head, tiles, tied)


def _counting_checkpoint(function, *args, **kwargs):
    STATS["checkpointed"] += 1
    return _checkpoint(function, *args, **kwargs)


_checkpoint = hf_modeling.checkpoint
_fetch, _tile_mlps = PartitionedParameterCoordinator.fetch_sub_module, memory._tile_mlps


def _counting_fetch(self, current_submodule, forward):
    """ZeRO-3 gathers a module's parameters here, before its forward and before its backward."""
    if getattr(current_submodule, "_spy_tiled_mlp", False):
        STATS["mlp_fetches"] += 1
    if getattr(current_submodule, "_spy_mlp_projection", False):
        STATS["projection_fetches"] += 1
    return _fetch(self, current_submodule, forward)


def _marking_tile_mlps(model):
    _tile_mlps(model)
    for layer in model.get_decoder().layers:
        layer.mlp._spy_tiled_mlp = True
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(layer.mlp, name)._spy_mlp_projection = True


_arm = engagement.arm


def _recording_arm(model, features):
    """What the built model expects per micro-batch (model_utils/engagement.py), for the case's stats."""
    STATS["expected"] = _arm(model, features)
    return STATS["expected"]


def _copying_to_host(t: torch.Tensor, *arena):
    """Count the offloaded tensors and really copy them, so the unpacked copy is what backward uses."""
    if t.numel():
        STATS["offloaded"] += 1
    device, host = _to_host(t, *arena)
    return device, host.clone()


if __name__ == "__main__":
    memory.TiledMLP, tiled_loss.TiledCrossEntropySum, memory._to_host = _SpyTiledMLP, _SpyTiledCE, _copying_to_host
    memory.NormTiledMLP = _SpyNormTiledMLP
    hf_modeling.checkpoint = _counting_checkpoint  # what activation_checkpointing_enable hands the layers
    engagement.arm = _recording_arm
    PartitionedParameterCoordinator.fetch_sub_module, memory._tile_mlps = _counting_fetch, _marking_tile_mlps
    for case in json.loads(sys.argv[1]):
        for name, value in case.pop("knobs").items():
            setattr(memory if hasattr(memory, name) else tiled_loss, name, value)
        STATS.update(mlp_tiles=set(), mlp_renorm=0, logits_tiles=set(), offloaded=0, checkpointed=0, mlp_fetches=0,
                     projection_fetches=0)
        kept = dict(memory.KEPT)
        run_case(case, case["sequence_parallel_size"])
        STATS.update({f"attention_{k}": memory.KEPT[k] - kept[k] for k in kept})
        STATS["engaged"] = dict(engagement._ENGAGED)  # the case's one step (arm zeroed the counters)
        if dist.get_rank() == 0:
            torch.save(dict(STATS), case["out"] + ".stats.pt")
        dist.barrier()
