"""The start-up summary (and `--dry_run` output): layout, stages, and the memory plan of each stage.

The plan comes from training/memory_model.py (the formulas of scripts/plan.py, derived in
docs/memory_model.md): per-rank GPU peak and per-node CPU memory for every stage, with the features
and offloads this run actually uses.
"""

from __future__ import annotations

import json

from training.config import Config
from training.curriculum import Stage
from training.memory_model import Features, GiB, estimate, load_shape, tokens_per_sec_per_gpu


def run_features(cfg: Config, ds_config: dict) -> Features:
    zero = ds_config.get("zero_optimization", {})
    return Features(
        offload_params=zero.get("offload_param", {}).get("device") == "cpu",
        offload_optimizer=zero.get("offload_optimizer", {}).get("device") == "cpu",
        tiled_mlp=cfg.tiled_mlp, tiled_logits=cfg.tiled_logits,
        gradient_checkpointing=cfg.gradient_checkpointing or cfg.offload_activations,
        offload_activations=cfg.offload_activations)


def plan_lines(cfg: Config, stages: list[Stage], world: int, gpus_per_node: int, bf16: bool) -> list[str]:
    with open(cfg.deepspeed) as fh:
        ds = json.load(fh)
    lines = []
    for s in stages:
        feats = run_features(cfg, {**ds, **s.deepspeed_overrides})
        try:
            shape = load_shape(cfg.model_name_or_path)
            est = estimate(shape, s.max_seq_length, s.sp, world, feats, "bf16" if bf16 else "fp32",
                           gpus_per_node=gpus_per_node)
            tps = tokens_per_sec_per_gpu(shape, s.max_seq_length, mfu=0.4, peak_tflops=989.0)
            lines.append(f"  stage {s.index} {s.name}: seq_len={s.max_seq_length} sp={s.sp} dp={world // s.sp} "
                         f"steps={s.max_steps} lr={s.learning_rate:g}->{s.min_lr:g} warmup={s.warmup_steps} "
                         f"reset_optimizer={s.reset_optimizer} rope={s.rope}")
            lines.append(f"      memory plan: {est.gpu_peak / GiB:.1f} GiB per rank on the accelerator "
                         f"(peak phase: {est.peak_phase}), {est.cpu_per_node / GiB:.0f} GiB CPU per node; "
                         f"~{tps:.0f} tokens/s/GPU at 40% MFU of an H100")
        except ValueError as e:  # a shape the planner cannot read: say so, do not stop the run
            lines.append(f"  stage {s.index} {s.name}: seq_len={s.max_seq_length} sp={s.sp} (no memory plan: {e})")
    return lines
