"""Model + DeepSpeed engine assembly for one stage: ds config -> partitioned model -> Ulysses -> engine."""

from __future__ import annotations

import dataclasses

import deepspeed
import torch

from base.parallel import ParallelDims
from model_utils import engagement, ulysses
from model_utils.build import build_model
from model_utils.memory import apply_memory_features
from planner.memory_model import Features
from training.config import Config
from training.curriculum import Stage
from training.ds_config import build_ds_config, make_optimizer
from training.schedule import lambda_scheduler


def stage_config(cfg: Config, stage: Stage) -> Config:
    """The run config as seen by one stage (its length, SP degree, LR schedule and memory features: the ones
    resolve_stages fixed, e.g. by memory_features auto; None keeps the run's flags)."""
    memory = {k: getattr(stage, k) for k in ("tiled_mlp", "tiled_logits", "offload_activations", "keep_attention",
                                             "logits_tile_mb", "attention_head_chunks", "ring_attention")
              if getattr(stage, k, None) is not None}
    if getattr(stage, "checkpoint_every", None) is not None:
        memory.update(checkpoint_every=stage.checkpoint_every, gradient_checkpointing=stage.checkpoint_every > 0)
    return dataclasses.replace(cfg, max_seq_length=stage.max_seq_length, sequence_parallel_size=stage.sp,
                               learning_rate=stage.learning_rate, min_lr=stage.min_lr, warmup_steps=stage.warmup_steps,
                               lr_scheduler=stage.lr_scheduler, max_steps=stage.max_steps, rope=stage.rope, **memory)


def features_of(cfg: Config) -> Features:
    """The memory features a (stage's) config asks for, as the value the model patches take: model_utils reads
    features, never the run's config."""
    names = {f.name for f in dataclasses.fields(Features)} - {"offload_params", "offload_optimizer"}
    return Features(**{n: getattr(cfg, n) for n in names})


def build_engine(cfg: Config, dims: ParallelDims, hf_config, attn: str, bf16: bool, seed: int,
                 ds_overrides: dict | None = None, pretrained: bool = True):
    """A DeepSpeed engine over the HF model (ZeRO-3, Ulysses x context-parallel SP when dims.sp > 1, our LR schedule).
    `pretrained=False`: a checkpoint is loaded next and replaces every weight; the HF weights are not read."""
    text_cfg = hf_config.get_text_config()
    ds_config = build_ds_config(cfg, dims, bf16, text_cfg.hidden_size, ds_overrides)
    torch.manual_seed(seed)  # same init on every rank (and the same as a plain from_config with this seed)
    model, handle = build_model(cfg.model_name_or_path, hf_config, ds_config, attn,
                                torch.bfloat16 if bf16 else torch.float16 if cfg.fp16 else torch.float32, pretrained)
    features = features_of(cfg)
    apply_memory_features(model, features)
    ulysses.unregister()  # a previous stage may have registered another SP degree
    mpu = ulysses.register(model, dims, attn, cfg.per_device_train_batch_size, features.attention_head_chunks,
                           ring=features.ring_attention)
    engagement.arm(model, features)  # what each step's counters must reach (model_utils/engagement.py)
    params = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=params, config=ds_config, mpu=mpu,
        optimizer=make_optimizer(ds_config, cfg, params),  # AdamW from the flags when the JSON names none
        lr_scheduler=lambda_scheduler(cfg.learning_rate, cfg.min_lr, cfg.warmup_steps, cfg.max_steps,
                                      cfg.lr_scheduler))
    # ZeRO-3 partitions over the whole world whatever the SP degree, but DeepSpeed names checkpoint files
    # after the "model-parallel" rank, which the SP mpu aliases to the SP rank. Name them by world rank only,
    # so a checkpoint loads under another SP degree at the same world size (e.g. the next stage's).
    engine.checkpoint_mp_rank = 0
    engine._hf_ds_config_handle = handle
    engine.ds_config_used = ds_config  # transformers reads ZeRO-3 settings through it while the engine lives
    engine.train()
    return engine


def release_engine(engine) -> None:
    """End a stage's engine so that its memory goes back: DeepSpeed's destroy(), then the reference it keeps.

    ZeRO-3's parameter offload pushes the top module on a module-level list (deepspeed.runtime.zero.
    parameter_offload.FWD_MODULE_STACK) when it sets up and never pops it, so every stage's model, its ZeRO-3
    partitions, the optimizer (reached through the parameters) and CPU Adam's fp32 master and moments stayed alive
    until the process ended. Measured on this CPU: 2.5 GiB more RSS per rebuilt engine of a 147M-parameter model
    (one per stage); on an H200 a 1.27B model's fourth stage was killed by the host's OOM killer (bench/gpu.py's
    ladder). At Llama-3-8B on 32 ranks with both offloads, each stage would keep ~4.5 GiB per rank, 36 GiB per
    8-rank node: 108 GiB more by the fourth stage of 128k -> 1M."""
    from deepspeed.runtime.zero import parameter_offload

    module = engine.module
    engine.destroy()
    arena = module.__dict__.get("_host_arena")  # the offloaded checkpoints' page-locked slots (base/host_arena.py):
    if arena is not None:  # unregistered now, not when the model's cycle is collected (5M on 8 GPUs: 153 GiB a rank)
        arena.release()
    parameter_offload.FWD_MODULE_STACK[:] = [m for m in parameter_offload.FWD_MODULE_STACK if m is not module]
    # the model, the optimizer and the engine reference each other: the caller drops its reference and runs
    # gc.collect() so that the cycle is freed before the next engine is built, not at some later collection
