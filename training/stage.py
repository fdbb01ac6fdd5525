"""One stage of the curriculum: its engine, its restore, its steps, its saves and its evaluation.

`train_stage` builds the engine at the stage's length, SP degree, RoPE and learning rate; restores what the stage
starts from (the checkpointer decides: the middle of this stage, or the previous stage's end); then steps until
the stage's last step, saving when due (steps, minutes, or an agreed stop); at the stage's end it evaluates.
Every decision to save or stop is agreed by all ranks (training/preemption.py); nothing here reads a clock,
a file or a signal on its own.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import json
import os
import time

import torch

from base.log import print0, rank_log
from data.pipeline import heldout_samples
from data.sharding import collate, shard
from model_utils.memory import kept_attention_line, make_loss_fn
from model_utils.rope import apply_rope, model_hash
from model_utils.ulysses import check_routed
from training.checkpoint import TrainState, rng_state
from training.config import to_dict
from training.curriculum import stage_start
from training.engine import build_engine, features_of, release_engine, stage_config
from training.evaluation import evaluate_stage
from training.job import EXIT_PREEMPTED
from training.metrics import peak_memory_gb, reset_peak_memory
from training.step import train_step


@dataclasses.dataclass
class Run:
    """What every stage of one run shares (built once in train.py)."""

    cfg: object
    dims: object
    data: object
    ckpt: object
    metrics: object
    preempt: object
    base_config: object
    attn: str
    bf16: bool

    def exit_preempted(self) -> int:
        print0(f"preempted ({self.preempt.received or 'on another rank'}): exiting with {EXIT_PREEMPTED}")
        self.metrics.close()
        return EXIT_PREEMPTED


def train_stage(run: Run, stage, stages, state: TrainState) -> None:
    """Train `stage` from `state` to the stage's end and evaluate it; `state` follows every step and save. On an
    agreed stop it returns right after the save, with `run.preempt.stopping` set."""
    cfg, dims, preempt = run.cfg, run.dims, run.preempt
    end = stage_start(stages, stage.index) + stage.max_steps
    t_build = time.perf_counter()
    reset_peak_memory()  # peak_mem_gb is this stage's own
    sdims = dataclasses.replace(dims, sp=stage.sp, cp=stage.cp)
    hf_config = copy.deepcopy(run.base_config)
    apply_rope(hf_config, stage.rope, stage.max_seq_length)
    scfg = stage_config(cfg, stage)
    engine = build_engine(scfg, sdims, hf_config, run.attn, run.bf16, seed=cfg.seed,
                          ds_overrides=stage.deepspeed_overrides, pretrained=state.checkpoint is None)
    _record_ds_config(run, stage, engine, state.step)
    dataset, sampler = run.data.stage_view(stage, sdims.dp, sdims.dp_rank, cfg.per_device_train_batch_size, cfg.seed)
    if not run.ckpt.restore_stage(engine, state, stage.index, sampler, stage.reset_optimizer):
        torch.manual_seed(cfg.seed + 1000 * stage.index + dims.rank)  # a stage's start: a seed per stage and rank
    preempt.deadline.record_build(time.perf_counter() - t_build)

    # --- the steps; the stop (and a save by time) is agreed after every step and after every save ---
    features = features_of(scfg)
    loss_fn, first = make_loss_fn(features), True  # the stage's tiled_logits
    while state.step < end:
        micro = [shard(collate([dataset[i] for i in sampler.next_batch()], sdims.seq_multiple, run.data.pad_id,
                               cfg.loss_weighting), sdims.sp, sdims.sp_rank, sdims.cp)
                 for _ in range(cfg.gradient_accumulation_steps)]
        lr = engine.get_lr()[0]
        out = train_step(engine, micro, dims.world, loss_fn=loss_fn)
        if first:  # after the engine's first step: every layer's attention went through Ulysses + masking
            _after_first_step(run, engine, features)
            first = False
        state.step += 1
        _log_step(run, stage, sdims, state, out, lr, sampler)
        _committed(run, state, run.ckpt.poll())  # a background save whose writes are durable on every rank
        # a background write still running must finish before the stop's own save: its time counts as one save more
        stopping = preempt.agreed(ahead_s=preempt.deadline.ahead_s(state.step + 1 >= end, run.ckpt.pending is not None))
        at_end = state.step == end
        if stopping or at_end or (cfg.save_steps and state.step % cfg.save_steps == 0) or preempt.save_due:
            _save(run, engine, stage, hf_config, state, sampler, at_end)
            stopping = stopping or preempt.agreed(ahead_s=preempt.deadline.evaluation_s() if at_end else 0.0)
        if stopping:
            _committed(run, state, run.ckpt.finish())  # a background save of this step: durable before exit 75
            release_engine(engine)
            del engine
            gc.collect()  # the engine's model, optimizer and partitions reference each other: free them now
            return

    # --- stage end: checkpoint written above; evaluate at this stage's length, then agree on a stop again ---
    t_eval = time.perf_counter()
    evaluate_stage(engine, stage, sdims, run.data.heldout(stage.max_seq_length, heldout_samples(stage.eval)),
                   run.data.tokenizer, run.metrics, state.step, cfg.per_device_train_batch_size, run.data.pad_id,
                   stages, run.data.heldout)
    preempt.deadline.record_eval(time.perf_counter() - t_eval)
    release_engine(engine)
    del engine
    gc.collect()  # before the next stage builds its engine: the host memory of this one goes back first
    preempt.agreed()


def _record_ds_config(run: Run, stage, engine, step: int) -> None:
    """OUTPUT_DIR/ds_config.stageN.json (rank 0) and, under memory_features auto, its choice in the metrics."""
    if run.dims.is_main:
        used = os.path.join(run.cfg.output_dir, f"ds_config.stage{stage.index}.json")
        with open(used, "w") as fh:
            json.dump(engine.ds_config_used, fh, indent=1)
        print0(f"stage {stage.index} ({stage.name}): DeepSpeed config used -> {used}")
    if stage.memory_choice:
        run.metrics.log({"event": "memory_choice", "stage": stage.index, "step": step, **stage.memory_choice})


def _after_first_step(run: Run, engine, features) -> None:
    check_routed(engine)  # Ulysses + document masking on every layer, or one line naming the model
    kept = kept_attention_line(features, run.attn)  # --keep_attention found its kernel?
    if kept:
        print0(kept)


def _log_step(run: Run, stage, sdims, state: TrainState, out: dict, lr: float, sampler) -> None:
    cfg = run.cfg
    run.preempt.deadline.record_step(out["step_time"])
    rank_log(f"step {state.step} stage {stage.index} loss {out['loss']:.6f} step_time {out['step_time']:.3f}s")
    n = sdims.dp * cfg.gradient_accumulation_steps * cfg.per_device_train_batch_size * stage.max_seq_length
    state.tokens += n
    run.metrics.log({"step": state.step, "stage": stage.index, "loss": out["loss"], "lr": lr, "tokens": n,
                     "label_tokens": out["label_tokens"],  # supervised tokens of the step (global; the loss's count)
                     **({"label_weight": out["label_weight"]} if "label_weight" in out else {}),
                     "tokens_per_s": n / out["step_time"], "seq_len": stage.max_seq_length, "sp": sdims.sp,
                     "cp": sdims.cp,
                     "dp": sdims.dp, "peak_mem_gb": peak_memory_gb(), "total_tokens": state.tokens,
                     "time": time.time(), **{f"share_{k}": v for k, v in sampler.source_shares().items()}})


def _save(run: Run, engine, stage, hf_config, state: TrainState, sampler, at_end: bool) -> None:
    """A checkpoint of `state` (collective); the stage's last one is kept for good. With `async_save` only the
    snapshot blocks here and the commit comes at a later step boundary (`_committed`); a stage's end and an agreed
    stop save synchronously (the next stage loads it; the job exits after it), after the write in flight."""
    if run.ckpt.pending:  # at most one save in flight: this one waits for it
        print0(f"save at step {state.step} waits for the background write of step {run.ckpt.pending.step}")
        _committed(run, state, run.ckpt.finish())
    t0 = time.perf_counter()
    state.stage, state.wandb_id = stage.index, run.metrics.run_id
    meta = {"stage_name": stage.name, "model_hash": model_hash(hf_config), "world": run.dims.world, "sp": stage.sp,
            "tokenizer": run.data.tokenizer.path if run.data.tokenizer else None, "config": to_dict(run.cfg)}
    background = run.cfg.async_save and not (at_end or run.preempt.stopping)
    path = run.ckpt.save(engine, state.step, {**state.state_dict(), **meta},
                         {"sampler": sampler.state_dict(), "rng": rng_state()}, hf_config,
                         stage_end=f"STAGE_{stage.index}_{stage.name}" if at_end else None, background=background)
    # the save interval starts at the snapshot (lost work <= interval + one background write); `auto` sizes it
    # from what this save blocked, when it is of the kind the interval makes (a stage's end under async is not)
    run.preempt.saved(time.perf_counter() - t0 if background == run.cfg.async_save else None)
    if path is not None:
        _committed(run, state, (path, time.perf_counter() - t0))
    else:
        p = run.ckpt.pending
        print0(f"snapshot of step {state.step} in {p.blocked_s:.2f}s ({p.snapshot.nbytes / 2**30:.2f} GiB of host "
               f"memory on this rank, copied in {p.snapshot.copy_s:.2f}s); serializing and writing in the background")


def _committed(run: Run, state: TrainState, got: tuple[str, float] | None) -> None:
    """A save was committed: it is the checkpoint a resume or the next stage loads; its whole time (the
    background write included) is what the time-limit stop reserves for a save."""
    if got is None:
        return
    path, seconds = got
    state.checkpoint = path
    run.preempt.deadline.record_save(seconds)
    print0(f"saved {path} in {seconds:.1f}s")
