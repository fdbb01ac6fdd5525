"""The start-up summary (and `--dry_run` output): layout, stages, and the memory plan of each stage.

The plan comes from planner/memory_model.py (the formulas of scripts/plan.py, derived in
docs/memory_model.md): per-rank GPU peak and per-node CPU memory for every stage, with the features
and offloads this run actually uses; then what each stage's evaluation runs and, on a GPU plan, how long, each
stage's steps x the planner's predicted step and its saves (training/run_time.py), and the whole run's time.
"""

from __future__ import annotations

import json
import math

from data.pipeline import heldout_samples
from planner.auto_features import ALL_FEATURES, describe, describe_offloads, relative_speed
from planner.flops import flops_per_sequence, tokens_per_sec_per_gpu
from planner.memory_model import (
    GRAD_ACCUM_DEFAULT,
    Features,
    GiB,
    estimate,
    grad_accum_dtype,
    lean_mlp_applies,
    lean_norm_applies,
    load_shape,
)
from training.config import Config, _merge, no_gpu
from training.curriculum import Stage
from training.ds_config import ADAM_BETAS, ADAM_EPS
from training.engine import stage_config
from training.evaluation import DEFAULT_DEPTHS, eval_lengths, retention_samples, task_trials
from training.hf_args import ratio_steps
from training.run_time import HOUR_S, duration, run_line, time_line

PLAN_MFU, H100_TFLOPS = 0.4, 989.0  # the plan's throughput: 40% MFU of an H100's dense bf16 peak


def run_features(cfg: Config, ds_config: dict, stage: Stage | None = None) -> Features:
    """The features a stage runs with: the stage's resolved ones (training/curriculum.py), else the run's flags."""
    zero = ds_config.get("zero_optimization", {})
    if stage is not None and stage.checkpoint_every is not None:
        cfg = stage_config(cfg, stage)
    every = cfg.checkpoint_every or (1 if cfg.gradient_checkpointing or cfg.offload_activations else 0)
    return Features(
        offload_params=zero.get("offload_param", {}).get("device") == "cpu",
        offload_optimizer=zero.get("offload_optimizer", {}).get("device") == "cpu",
        tiled_mlp=cfg.tiled_mlp, tiled_logits=cfg.tiled_logits,
        gradient_checkpointing=every > 0, checkpoint_every=every if every > 1 else 0,
        offload_activations=cfg.offload_activations, keep_attention=cfg.keep_attention and every > 0,
        lean_rmsnorm=cfg.lean_rmsnorm, lean_mlp=cfg.lean_mlp, logits_tile_mb=cfg.logits_tile_mb,
        attention_head_chunks=cfg.attention_head_chunks if isinstance(cfg.attention_head_chunks, int) else 1,
        ring_attention=bool(cfg.ring_attention))


def feature_line(shape, s: Stage, feats: Features) -> str:
    """The stage's memory features; with auto, what was chosen against which budget (also in the metrics)."""
    c = s.memory_choice
    norm = "lean" if lean_norm_applies(shape, feats) else "Hugging Face's"  # --lean_rmsnorm, where the family allows
    norm += f"; MLP: {'lean' if lean_mlp_applies(shape, feats) else 'Hugging Face' + chr(39) + 's'}"  # --lean_mlp
    if not c:
        return f"memory features: {describe(feats)} (set by the flags); RMSNorm: {norm}"
    speed_all = relative_speed(shape, s.max_seq_length, s.sp, ALL_FEATURES, c["device"])
    sp = f" sp={c['sp']} (auto, the smallest that fits)" if c["sp_auto"] else ""
    return (f"memory features ({c['memory_features']}): {describe(feats)}{sp}; predicted peak "
            f"{c['predicted_peak_gb']:.2f} of {c['budget_gb']:.2f} GiB per rank ({c['device']}); predicted speed "
            f"{c['predicted_relative_speed']:.2f} of no-feature tokens/s (all features: {speed_all:.2f}); RMSNorm: {norm}")


def offload_line(s: Stage, feats: Features) -> str:
    """The stage's ZeRO-3 offloads and why: auto's reason (needed / pays / fits, pinned, the config's) with the
    predicted cost per step, else the DeepSpeed config's setting."""
    on = describe_offloads(feats.offload_params, feats.offload_optimizer)
    c = s.memory_choice
    if not c or not c.get("offload_why"):
        return f"offload: {on} (set by the DeepSpeed config and the stage's deepspeed_overrides)"
    cost = (f"; costs {c['offload_step_s']:.2f} s of a {c['predicted_step_s']:.1f} s step"
            if c.get("offload_step_s") else "")
    return f"offload: {on} ({c['offload_why']}{cost})"


def _count(n: int, word: str) -> str:
    return f"{n} {word}{'s' * (n != 1)}"


def eval_line(shape, s: Stage, stages: list[Stage], world: int, micro_batch: int, gpu_plan: bool) -> str:
    return eval_plan(shape, s, stages, world, micro_batch, gpu_plan)[0]


def eval_plan(shape, s: Stage, stages: list[Stage], world: int, micro_batch: int,
              gpu_plan: bool) -> tuple[str, float]:
    """(the eval line, its seconds: 0 without a GPU plan). What the stage's evaluation runs (training/evaluation.py):
    trials x depths x lengths forward passes of the tasks (with a text tokenizer) plus the held-out samples (and
    again at the first stage's length), and on a GPU plan its time at 40% MFU of an H100: a forward is a third of
    the planner's flops_per_sequence, the
    passes of one call (a length's tasks, the held-out samples) split over the stage's DP groups (rounds of
    dp x micro_batch), each group of sp GPUs."""
    trials = task_trials(s.eval, tokenizer=True)  # counted as a run with a text tokenizer would run them
    depths, lengths = len(s.eval.get("depths", DEFAULT_DEPTHS)), eval_lengths(s, stages)
    held, first = heldout_samples(s.eval), stages[0].max_seq_length
    keep = retention_samples(stages, held)  # retention's count: one for the whole run (training/evaluation.py)
    again = held and (first != s.max_seq_length or keep != held)  # retention scored apart from the stage's own samples
    calls = [(n, sum(trials.values()) * depths) for n in lengths]  # (length, forwards) of each evaluation call
    if held:
        calls += [(s.max_seq_length, held)] + ([(first, keep)] if again else [])  # + retention
    calls = [(n, k) for n, k in calls if k]
    total = sum(k for _, k in calls)
    if not total:
        return "eval: none (no held-out samples, no tasks)", 0.0
    parts = []
    if trials:
        per = (_count(next(iter(trials.values())), "trial") if len(trials) == 1
               else "(" + " + ".join(f"{k} {t}" for t, k in trials.items()) + ") trials")
        parts.append(f"{per} x {_count(depths, 'depth')} x {_count(len(lengths), 'length')}")
    if held:
        parts.append(f"{held} held-out" + (f" + {keep} held-out at {first}" if again else ""))
    sizes = sorted({n for n, _ in calls})
    line = (f"eval: {' + '.join(parts)} = {total} forward passes of "
            + (f"{sizes[0]} tokens" if len(sizes) == 1 else f"{sizes[0]}-{sizes[-1]} tokens"))
    if not gpu_plan:
        return line, 0.0
    dp = max(1, world // s.sp)
    secs = sum(math.ceil(k / (dp * micro_batch)) * micro_batch * flops_per_sequence(shape, n) / 3
               / (s.sp * PLAN_MFU * H100_TFLOPS * 1e12) for n, k in calls)
    return line + f" ~ {duration(secs)} on {world} x H100 at 40% MFU ({dp} groups of sp={s.sp})", secs


def _g(value) -> str:
    return f"{value:g}" if isinstance(value, int | float) and not isinstance(value, bool) else str(value)


def optimizer_text(ds: dict, cfg: Config) -> str:
    """The stage's optimizer settings as the plan prints them: this project's defaults are not the Hugging Face
    Trainer's (betas 0.9,0.95 against its 0.9,0.999), so a command carried over says what it trains with. The flags'
    AdamW (training/ds_config.optimizer_spec), or the JSON's block ("auto" filled as build_ds_config fills it; a key
    the block omits: DeepSpeed's default for its type)."""
    block = ds.get("optimizer")
    if block is None:
        kind, params = "AdamW", {"betas": ADAM_BETAS, "eps": ADAM_EPS, "weight_decay": cfg.weight_decay}
    else:
        kind, params = block.get("type", "?"), dict(block.get("params") or {})
        params = {**params, "betas": ADAM_BETAS if params.get("betas") == "auto" else params.get("betas", "default"),
                  "eps": ADAM_EPS if params.get("eps") == "auto" else params.get("eps", "default"),
                  "weight_decay": cfg.weight_decay if params.get("weight_decay", "auto") == "auto"
                  else params["weight_decay"]}
    betas = params["betas"]
    betas = ",".join(map(_g, betas)) if isinstance(betas, list | tuple) else _g(betas)
    return f"{kind} betas={betas} eps={_g(params['eps'])} wd={_g(params['weight_decay'])}"


def _lr_text(s: Stage) -> str:
    """The stage's LR as it trains after warmup (training/schedule.lr_at): peak->min_lr where it decays, the peak alone
    for `constant` (it never reaches min_lr; the line printed lr=0.002->0.0002 for a stage training at 0.002)."""
    return f"{s.learning_rate:g}" if s.lr_scheduler == "constant" else f"{s.learning_rate:g}->{s.min_lr:g}"


def plan_lines(cfg: Config, stages: list[Stage], world: int, gpus_per_node: int, bf16: bool) -> list[str]:
    with open(cfg.deepspeed) as fh:
        ds = json.load(fh)
    lines = []
    gpu_plan = cfg.nodes > 0 or not no_gpu()  # a GPU run, or a dry run for the cluster the recipe names
    step_s = eval_s = 0.0  # the run's predicted seconds (a GPU plan's): run_time.run_line
    over_an_hour, unplanned, saved = [], [], False
    for s in stages:
        merged = _merge(ds, s.deepspeed_overrides)
        feats = run_features(cfg, merged, s)
        accum = grad_accum_dtype(merged)  # build_ds_config's default under bf16: fp32 accumulation
        accum = GRAD_ACCUM_DEFAULT if bf16 and accum in (None, "auto") else accum
        try:
            shape = load_shape(cfg.model_name_or_path)
            est = estimate(shape, s.max_seq_length, s.sp, world, feats, "bf16" if bf16 else "fp32",
                           gpus_per_node=gpus_per_node, cp=s.cp if isinstance(s.cp, int) else 1, grad_accum=accum)
            tps = tokens_per_sec_per_gpu(shape, s.max_seq_length, mfu=PLAN_MFU, peak_tflops=H100_TFLOPS)
            split = f" (ulysses {s.sp // s.cp} x cp {s.cp})" if isinstance(s.cp, int) and s.cp > 1 else ""
            warm = s.warmup_steps  # --warmup_ratio's: fixed with the steps once the data is open (hf_args)
            if cfg.warmup_ratio and not (cfg.stages and cfg.stages[s.index].warmup_steps is not None):
                warm = f"{ratio_steps(cfg.warmup_ratio, s.max_steps)} (ratio {cfg.warmup_ratio:g})"
            lines.append(f"  stage {s.index} {s.name}: seq_len={s.max_seq_length} sp={s.sp}{split} dp={world // s.sp} "
                         f"steps={s.max_steps} lr={_lr_text(s)} {s.lr_scheduler} "
                         f"warmup={warm} {optimizer_text(merged, cfg)} "
                         f"reset_optimizer={s.reset_optimizer} rope={s.rope}")
            lines.append(f"      memory plan: {est.gpu_peak / GiB:.1f} GiB per rank on the accelerator "
                         f"(peak phase: {est.peak_phase}), {est.cpu_per_node / GiB:.0f} GiB CPU per node"
                         + (f"; ~{tps:.0f} tokens/s/GPU at 40% MFU of an H100" if gpu_plan else ""))
            lines.append("      " + feature_line(shape, s, feats))
            lines.append("      " + offload_line(s, feats))
            line, secs = eval_plan(shape, s, stages, world, cfg.per_device_train_batch_size, gpu_plan)
            lines.append("      " + line)
            if gpu_plan:  # no H100 time on a CPU run's plan (as tokens/s above)
                line, step, saved = time_line(cfg, shape, s, world, saved)
                lines.append("      " + line)
                step_s, eval_s = step_s + s.max_steps * step, eval_s + secs
                if step > HOUR_S:
                    over_an_hour.append(s.index)
        except ValueError as e:  # a shape the planner cannot read: say so, do not stop the run
            lines.append(f"  stage {s.index} {s.name}: seq_len={s.max_seq_length} sp={s.sp} (no memory plan: {e})")
            unplanned.append(s.index)
    if gpu_plan and len(unplanned) < len(stages):
        lines.append("  " + run_line(step_s, eval_s, over_an_hour, unplanned))
    return lines
