"""One length's plan for scripts/plan.py: every valid SP split's memory estimate, fit, step time and communication
on the cluster (planner/cluster.py's Planner), the recommended split with its DeepSpeed config and recipe stage, the
longest length a run would train at, and (--auto) memory_features auto's choice. Torch-free, like the rest of the
planner; `args` is plan.py's parsed flags.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import replace

from base.parallel import split_sp
from planner.cluster import Planner, _int_or_auto, _valid_splits, split_label
from planner.flops import attention_flops, flops_per_sequence, tokens_per_sec_per_gpu
from planner.memory_model import Estimate, Features, GiB, ModelShape
from planner.step_time import TRAINABLE_S, step_time
from planner.trainable import ALST, AutoRun, longest_trainable

# host terms held page-locked (ZeRO-3's pinned offload buffers, the arena's checkpoint slots: base/host_arena.py)
PAGE_LOCKED = ("params (partition)", "grads fp32 (partition)", "activation checkpoints")


def page_locked_gib(est: Estimate, ranks_per_node: int) -> float:
    """GiB a node holds page-locked: its ranks' PAGE_LOCKED host terms."""
    return sum(v for k, v in est.cpu_per_rank.items() if k in PAGE_LOCKED) * ranks_per_node / GiB


def ds_recommendation(feats: Features) -> tuple[str, dict]:
    if not (feats.offload_params or feats.offload_optimizer):
        return "ds_configs/zero3.json", {}
    off = {}
    if not feats.offload_params:
        off["offload_param"] = {"device": "none"}
    if not feats.offload_optimizer:
        off["offload_optimizer"] = {"device": "none"}
    return "ds_configs/zero3_offload.json", ({"zero_optimization": off} if off else {})


def plan_one(pl: Planner, seq_len: int, eval_len: int = 0) -> dict:
    """One length's plan; `eval_len` (the longest of --seq_len): a stage asked there too (its eval.lengths `all` or
    a list naming it) evaluates there with this split and features: its evaluation peak is shown where it is longer."""
    args, shape, feats = pl.args, pl.shape, pl.feats
    rows = []
    splits = _valid_splits(shape, pl.world, seq_len, args)
    if not splits:  # --sp auto with a --cp no SP degree takes (was min()'s "empty sequence")
        ok = [c for c in range(1, pl.world + 1) if pl.world % c == 0
              and _valid_splits(shape, pl.world, seq_len, argparse.Namespace(**{**vars(args), "cp": str(c)}))]
        raise ValueError(f"--cp {args.cp}: no SP degree on {pl.world} ranks takes it at {seq_len} tokens (cp divides sp, "
                         f"sp divides the world, sp / cp suits the heads): use --cp {', '.join(map(str, ok))} or auto")
    for sp, cp in splits:
        est, g, c = pl.evaluate(seq_len, sp, cp=cp)
        f = replace(feats, attention_head_chunks=pl.chunks(sp, cp))
        step_s = step_time(shape, seq_len, sp, f, world=pl.world, ranks_per_node=args.gpus_per_node, cp=cp,
                           peak_tflops=args.gpu_tflops)
        rows.append(dict(sp=sp, ulysses=sp // cp, cp=cp, fits_gpu=g, fits_cpu=c, fits=g and c,
                         longest_fitting_seq_len=pl.longest(sp, cp=cp), estimate=est.to_dict(),
                         comm_per_layer=pl.comm(seq_len, sp, cp), step_s=step_s,
                         measured_tokens_per_sec_per_gpu=seq_len / step_s / sp,
                         page_locked_gib_per_node=page_locked_gib(est, args.gpus_per_node)))
        if eval_len > seq_len:  # one estimate more per split (milliseconds); only its eval peak is read
            peak = pl.evaluate(eval_len, sp, cp=cp)[0].eval_gpu_peak
            rows[-1]["eval_at_longest"] = dict(seq_len=eval_len, eval_gpu_peak=peak, fits=peak <= pl.gpu_limit)
    fitting = list(dict.fromkeys(r["sp"] for r in rows if r["fits"]))
    roomy = [r for r in rows if r["fits"] and r["estimate"]["gpu_peak"] <= (1 - args.margin) * pl.gpu_limit]
    best = (roomy or [r for r in rows if r["fits"]] or [min(rows, key=lambda r: r["estimate"]["gpu_peak"])])[0]
    ds_file, overrides = ds_recommendation(feats)
    # what a run would train at: memory_features auto's choice at each length (the command's features pinned), at
    # the recommended split, or where the asked length fits none, at the largest (a shorter length may fit there)
    at = best if fitting else max(rows, key=lambda r: r["sp"])
    within = longest_trainable(TRAINABLE_S, shape, at["sp"], at["cp"], AutoRun.of_args(args))
    stage = dict(name=f"seq{seq_len}", max_seq_length=seq_len, sequence_parallel_size=best["sp"])
    if best["cp"] > 1 or split_sp(best["sp"], shape.num_heads, shape.num_kv_heads, args.gpus_per_node)[1] > 1:
        stage["context_parallel_size"] = best["cp"]  # explicit where it is not pure Ulysses or differs from auto
    if overrides:
        stage["deepspeed_overrides"] = overrides
    model_path = os.path.dirname(args.model) if args.model.endswith(".json") else args.model
    recipe = dict(model_name_or_path=model_path, deepspeed=ds_file, bf16=args.precision == "bf16",
                  **{k: getattr(feats, k) for k in ALST}, stages=[stage])
    flops = flops_per_sequence(shape, seq_len)
    attn = attention_flops(shape, seq_len)  # a windowed layer counts the share of a full one its window computes
    tps = tokens_per_sec_per_gpu(shape, seq_len, args.mfu, args.gpu_tflops)
    out = dict(seq_len=seq_len, candidates=rows, fitting_sp=fitting, recommended_sp=best["sp"] if fitting else None,
               recommended_split=[best["sp"], best["ulysses"], best["cp"]] if fitting else None,
               deepspeed_config=ds_file, deepspeed_overrides=overrides, recipe=recipe,
               throughput=dict(formula="6*N_matmul*s + 6*L_eff*nh*d*s^2 (causal; windows counted) FLOPs per sequence",
                               flops_per_sequence=flops, attention_share=attn / flops, mfu=args.mfu,
                               gpu_tflops=args.gpu_tflops, tokens_per_sec_per_gpu=tps,
                               seconds_per_sequence=seq_len / (tps * best["sp"]), at_sp=best["sp"]),
               within_15_min=within and within["seq_len"], within_15_min_at=within)
    if not fitting:
        everything = Features(offload_params=True, offload_optimizer=True, lean_rmsnorm=feats.lean_rmsnorm,
                              lean_mlp=feats.lean_mlp,
                              **dict.fromkeys(ALST, True))
        if everything != feats:
            out["fits_with_all_features_at_sp"] = [split_label(sp, cp) for sp, cp in splits
                                                   if all(pl.evaluate(seq_len, sp, everything, cp)[1:])]
    return out


def auto_plan(args: argparse.Namespace, shape: ModelShape, world: int, seq_len: int) -> dict:
    """--auto: planner/auto_features.py's choice with train.py's budget for --gpu_mem_gb, both ZeRO offloads kept on
    (train.py's auto, its dry run too, may turn them off), and tokens/s/GPU of it and of all features."""
    from planner import auto_features as af

    try:
        sp = None if args.sp == "auto" else int(args.sp)
        cp = args.cp if args.ulysses is None else sp // args.ulysses
        c = AutoRun.of_args(args).choose(shape, seq_len, sp, _int_or_auto("cp", str(cp)), sp_max=args.gpus_per_node)
    except ValueError as e:
        return {"error": str(e)}
    tps = tokens_per_sec_per_gpu(shape, seq_len, args.mfu, args.gpu_tflops)
    speed = dict(mfu=args.mfu, peak_tflops=args.gpu_tflops)
    all_speed = af.relative_speed(shape, seq_len, c.sp, af.ALL_FEATURES, **speed)
    return c.as_dict() | dict(features=af.describe(c.features),
                              predicted_relative_speed=af.relative_speed(shape, seq_len, c.sp, c.features, **speed),
                              tokens_per_sec_per_gpu=tps * af.relative_speed(shape, seq_len, c.sp, c.features, **speed),
                              all_features_tokens_per_sec_per_gpu=tps * all_speed)
