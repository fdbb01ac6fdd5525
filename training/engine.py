"""Model + DeepSpeed engine assembly for one stage: ds config -> partitioned model -> Ulysses -> engine."""

from __future__ import annotations

import deepspeed
import torch

from model_utils import ulysses
from model_utils.build import build_model
from training.config import Config
from training.ds_config import build_ds_config
from training.parallel import ParallelDims
from training.schedule import lambda_scheduler


def build_engine(cfg: Config, dims: ParallelDims, hf_config, attn: str, bf16: bool, seed: int,
                 ds_overrides: dict | None = None):
    """A DeepSpeed engine over the HF model (ZeRO-3, Ulysses SP when dims.sp > 1, our LR schedule)."""
    text_cfg = hf_config.get_text_config()
    ds_config = build_ds_config(cfg, dims, bf16, text_cfg.hidden_size, ds_overrides)
    torch.manual_seed(seed)  # same init on every rank (and the same as a plain from_config with this seed)
    model, handle = build_model(cfg.model_name_or_path, hf_config, ds_config, attn,
                                torch.bfloat16 if bf16 else torch.float32)
    ulysses.unregister()  # a previous stage may have registered another SP degree
    mpu = ulysses.register(model, dims.sp, attn, cfg.per_device_train_batch_size)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=ds_config, mpu=mpu,
        lr_scheduler=lambda_scheduler(cfg.learning_rate, cfg.min_lr, cfg.warmup_steps, cfg.max_steps,
                                      cfg.lr_scheduler))
    engine._hf_ds_config_handle = handle  # transformers reads ZeRO-3 settings through it while the engine lives
    engine.train()
    return engine
