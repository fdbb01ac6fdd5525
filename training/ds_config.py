"""DeepSpeed config assembly: the JSON in ds_configs/ plus values derived from the run config.

Batch sizes, LR, clipping and precision are filled here and nowhere else, so the run config and the
DeepSpeed config can never disagree: a key set to "auto" is filled, a concrete value that contradicts
the flags is an error naming both.
"""

from __future__ import annotations

import copy
import json

from training.config import Config
from training.parallel import ParallelDims


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def _fill(d: dict, path: str, value, source: str) -> None:
    keys = path.split(".")
    node = d
    for k in keys[:-1]:
        node = node.setdefault(k, {})
    cur = node.get(keys[-1], "auto")
    if cur == "auto":
        node[keys[-1]] = value
    elif cur != value:
        raise ValueError(f"DeepSpeed config sets {path}={cur} but {source} gives {value}: set it to \"auto\" "
                         "or make the two agree")


def build_ds_config(cfg: Config, dims: ParallelDims, bf16: bool, hidden_size: int,
                    overrides: dict | None = None) -> dict:
    """The DeepSpeed config dict for `deepspeed.initialize`, every "auto" resolved."""
    with open(cfg.deepspeed) as fh:
        ds = json.load(fh)
    if overrides:
        ds = _merge(ds, overrides)
    mb, ga = cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps
    _fill(ds, "train_micro_batch_size_per_gpu", mb, "--per_device_train_batch_size")
    _fill(ds, "gradient_accumulation_steps", ga, "--gradient_accumulation_steps")
    # one sample per SP group per micro-step: the global batch counts DP replicas only
    _fill(ds, "train_batch_size", mb * ga * dims.dp, "per_device_train_batch_size x grad_accum x dp")
    # read by DeepSpeedConfig when no mpu is at hand (zero.Init at model build) to size the batch by dp, not world
    _fill(ds, "sequence_parallel_size", dims.sp, "--sequence_parallel_size")
    _fill(ds, "gradient_clipping", cfg.max_grad_norm, "--max_grad_norm")
    _fill(ds, "bf16.enabled", bf16, "--bf16")
    if "optimizer" in ds:
        _fill(ds, "optimizer.params.lr", cfg.learning_rate, "--learning_rate")
        _fill(ds, "optimizer.params.weight_decay", cfg.weight_decay, "--weight_decay")
    if ds.get("seq_parallel_communication_data_type") == "auto":
        ds["seq_parallel_communication_data_type"] = "bf16" if bf16 else "fp32"
    zero = ds.get("zero_optimization", {})
    for key, value in (("reduce_bucket_size", hidden_size * hidden_size),
                       ("stage3_prefetch_bucket_size", int(0.9 * hidden_size * hidden_size)),
                       ("stage3_param_persistence_threshold", 10 * hidden_size)):
        if zero.get(key) == "auto":
            zero[key] = value
    if zero.get("stage") != 3:
        raise ValueError(f"{cfg.deepspeed}: zero_optimization.stage is {zero.get('stage')}; this project needs ZeRO-3")
    leftover = [k for k, v in _walk(ds) if v == "auto"]
    if leftover:
        raise ValueError(f"{cfg.deepspeed}: no value derived for {leftover}; set them explicitly")
    return ds


def _walk(d: dict, prefix: str = ""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _walk(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v
