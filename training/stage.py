"""One stage of the curriculum: its engine, its restore, its steps, its saves and its evaluation.

`train_stage` builds the engine at the stage's length, SP degree, RoPE and learning rate; restores what the stage
starts from (the checkpointer decides: the middle of this stage, or the previous stage's end); then steps until
the stage's last step, saving when due (steps, minutes, or an agreed stop); at the stage's end it evaluates.
Every decision to save or stop is agreed by all ranks (training/preemption.py); nothing here reads a clock,
a file or a signal on its own. What it writes down of each step and of its engine's release, and `Run`:
training/stage_records.py.

A step's health (`_health`, from the all-reduced loss and DeepSpeed's all-reduced norm: the same on every rank, no
collective of its own): each non-finite step is said; while they last nothing is saved (a time save, a save_steps
one and a stop's are skipped: the newest checkpoint stays the one before them, never rotated away by saves of a NaN
state), and BAD_STEPS_STOP in a row stop the run in one line naming the first and that checkpoint (exit 2: a bug
is not requeued). A loss spike (training/step.LossWatch) is said and keeps the checkpoint before it (PINNED).
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import os
import time

import torch

from base import progress
from base.log import print0
from data.coverage import draw_notes
from data.pipeline import heldout_samples
from data.sharding import collate, shard
from model_utils import engagement
from model_utils.memory import kept_attention_line, make_loss_fn
from model_utils.rope import apply_rope, model_hash
from model_utils.ulysses import check_routed
from training.checkpoint import TrainState, rng_state, tag_for
from training.config import to_dict
from training.curriculum import stage_start
from training.engine import build_engine, features_of, release_engine, stage_config
from training.evaluation import evaluate_stage, stage_heldout
from training.metrics import reset_peak_memory
from training.preemption import EXIT_MARGIN_S, EvalStopped, StopChecked
from training.stage_records import Run, _log_step, _record_ds_config, _released, sample_length, step_tokens
from training.step import BAD_STEPS_STOP, SPIKE_RELEASE, LossWatch, bad_step, train_step


def _stopped_early(engine, line: str) -> None:
    """A stop agreed outside the steps (after the build and restore, or during the stage's evaluation): said, the
    engine released on every rank; the caller returns, train.py exits for the requeue."""
    print0(line)
    progress.mark(None, "idle")
    release_engine(engine)
    gc.collect()

def train_stage(run: Run, stage, stages, state: TrainState) -> None:
    """Train `stage` from `state` to the stage's end and evaluate it; `state` follows every step and save. On an
    agreed stop it returns right after the save (with nothing new to save: after its build and restore, or during its
    evaluation, left unrecorded), with `run.preempt.stopping` set."""
    cfg, dims, preempt = run.cfg, run.dims, run.preempt
    ended = None  # a stage finished before the resumed checkpoint's, its evaluation not on record: its own end
    if stage.index < state.stage:  # (rank 0's marker, verified together), or not evaluated at all (train.py)
        ended = run.ckpt.stage_end(stage.index, stage.name)
        if ended is None:
            return
    start = stage_start(stages, stage.index)
    end = start + stage.max_steps
    run.metrics.begin_stage(end, start=start)  # a resumed stage's bar counts from the stage's first step
    t_build = time.perf_counter()
    progress.mark(state.step, "build")  # never judged a hang: a restore or a conversion may hold the ranks for hours
    reset_peak_memory()  # peak_mem_gb is this stage's own
    sdims = dataclasses.replace(dims, sp=stage.sp, cp=stage.cp)
    hf_config = copy.deepcopy(run.base_config)
    apply_rope(hf_config, stage.rope, stage.max_seq_length)
    scfg = stage_config(cfg, stage)
    split = state.checkpoint is None or state.optimizer_groups == 2  # an older run's checkpoints hold one group
    if not split and cfg.weight_decay and stage.index == state.stage:
        print0("note: this run's checkpoints (written before optimizer groups) decay norm gains and biases too: kept "
               "so that they load; a new run leaves them undecayed, as the Hugging Face Trainer does")
    engine = build_engine(scfg, sdims, hf_config, run.attn, run.bf16, seed=cfg.seed,
                          ds_overrides=stage.deepspeed_overrides, pretrained=state.checkpoint is None, split_decay=split)
    state.optimizer_groups = 2 if split else 1
    _record_ds_config(run, stage, engine, state.step)
    dataset, sampler = run.data.stage_view(stage, sdims.dp, sdims.dp_rank, cfg.per_device_train_batch_size, cfg.seed)
    if dims.rank == 0:  # repeats and unread sources, said (data/coverage.py): printing only, and never a stop (the
        try:  # others wait for rank 0 in the restore's collectives)
            for line in draw_notes(run.data, stages, stage, dims.world, cfg.per_device_train_batch_size,
                                   cfg.gradient_accumulation_steps):
                print0(line)
        except Exception as e:  # noqa: BLE001
            print0(f"warning: stage {stage.index}'s data notes failed ({type(e).__name__}: {e}); training goes on")
    progress.mark(None, "restore")  # judged at RESTORE_S (base/progress.py): a rank stuck reading is named before
    # dist_timeout_s ends the others' collectives
    if not run.ckpt.restore_stage(engine, state, stage.index, sampler, stage.reset_optimizer, ended and ended[0]):
        torch.manual_seed(cfg.seed + 1000 * stage.index + dims.rank)  # a stage's start: a seed per stage and rank
    preempt.deadline.record_build(time.perf_counter() - t_build)
    preempt.deadline.record_rank_bytes(_rank_bytes(engine, dims.world))  # a save's guessed time before one is measured
    if state.step == end and state.checkpoint:  # its steps lowered to where the run was: that checkpoint is its end
        run.ckpt.mark_stage_end(state.checkpoint, f"STAGE_{stage.index}_{stage.name}")
    if _agree(run, state.step + 1 >= end):  # a stop during the build and restore (minutes at 8B), not left for the
        # first step's check (a 1M step: ~296 s more). Nothing trained since the checkpoint restored: nothing to save
        return _stopped_early(engine, f"stop agreed after stage {stage.index}'s build: nothing new to save; the resume "
                              f"point stays {state.checkpoint or 'a fresh start'}")

    # --- the steps; the stop (and a save by time) is agreed after every step and after every save ---
    features = features_of(scfg)
    loss_fn, first = make_loss_fn(features), True  # the stage's tiled_logits
    # the stage's loss weighting (its recipe key, else the run's flag): resolve_stages reads it from the recipe, so a
    # run resumed mid-curriculum weighs the stage it resumes in as that stage says
    weighting = getattr(stage, "loss_weighting", None) or cfg.loss_weighting
    watch = LossWatch()  # a spike is judged against this stage's losses: a new length or RoPE moves them
    state.bad_steps, state.first_bad = 0, None
    while state.step < end:
        progress.mark(state.step + 1, "data")  # rank 0 ends the job when a rank's marks stop (base/progress.py)
        micro, lengths = [], []  # each micro-step's sample length: a replay one's is shorter (its FLOPs, _log_step)
        for _ in range(cfg.gradient_accumulation_steps):
            batch = sampler.next_batch()
            lengths.append(sample_length(batch, stage.max_seq_length))
            micro.append(shard(collate([dataset[i] for i in batch], sdims.seq_multiple, run.data.pad_id, weighting),
                               sdims.sp, sdims.sp_rank, sdims.cp))
        lr = engine.get_lr()[0]
        out = train_step(engine, micro, dims.world, loss_fn=loss_fn)
        out["micro_lengths"] = lengths
        skipped = out.get("skipped", False)  # no supervised token in the global batch: nothing ran (training/step.py)
        out["engagement"] = engagement.take(engine.module, 0 if skipped else len(micro))  # savings engaged vs expected
        if first and not skipped:  # after the engine's first step: every layer's attention went through Ulysses + masking
            _after_first_step(run, engine, features)
            first = False
        state.step += 1
        _log_step(run, stage, sdims, state, out, lr, sampler, engine)
        _committed(run, state, run.ckpt.poll())  # a background save whose writes are durable on every rank
        full = out.get("label_tokens", 0) * 2 >= step_tokens(run, stage, sdims)  # a text step, judged among its kind
        _health(run, stage, state, out, watch, "full" if full else "part")  # a non-finite step said, a spike's
        progress.mark(None, "sync")
        stopping = _agree(run, state.step + 1 >= end)
        at_end = state.step == end
        in_window = stopping and preempt.window_left_s is not None  # SIGTERM: the launcher SIGKILLs every rank soon
        due = at_end or (cfg.save_steps and state.step % cfg.save_steps == 0) or preempt.save_due
        # non-finite steps open: no save. The stage's end is saved all the same (a bad last batch leaves the weights as
        # they were: DeepSpeed skipped its update), only if every rank's state is finite (Checkpointer._room checks)
        held = state.bad_steps and (stopping or not at_end)
        if held and (stopping or due):
            print0(f"step {state.step}: {'the stop' if stopping else 'the save due'} saves nothing: non-finite steps since "
                   f"step {state.first_bad}; the newest checkpoint, {state.checkpoint}, stays the resume point")
        elif (stopping or due) and not in_window:
            _save(run, engine, stages, stage, hf_config, state, sampler, at_end, by_time=preempt.save_due)
            # after a background snapshot the write it started is ahead too: the next step runs only if that
            # write, the stop's save and the step fit before the job's end (it used to reserve nothing for it)
            stopping = stopping or _agree(run, at_end)
        if stopping and preempt.window_left_s is not None:
            _stop_in_window(run, engine, stages, stage, hf_config, state, sampler, at_end)
        elif stopping:
            _committed(run, state, run.ckpt.finish())  # a background save of this step: durable before exit 75
        if stopping:
            progress.mark(None, "idle")
            release_engine(engine)
            del engine
            gc.collect()  # the engine's model, optimizer and partitions reference each other: free them now
            return

    # --- stage end: checkpoint written above; evaluate at this stage's length, then agree on a stop again ---
    progress.mark(None, "eval")  # judged by its forwards' layer ticks (base/progress.py)
    t_eval = time.perf_counter()
    # an SFT stage's held-out: whole conversations, loss on the assistant's tokens (training/evaluation.py)
    at = ended[1] if ended else state.step  # the step of the weights evaluated
    # a non-finite held-out loss refuses to go on (training/evaluation.py), naming the checkpoint before this one
    before = next((p for p in reversed(getattr(run.ckpt, "recent", [])) if p != state.checkpoint), None)
    # whether the run restarts positions at documents, said (its held-out buckets "document"), not guessed from the
    # samples (a 1M stage's documents, each longer than a sample, read as "sample": training/evaluation.position_by)
    try:  # the stop agreed between its forward batches (preemption.StopChecked): the stage's end is committed already
        evaluate_stage(StopChecked(engine, preempt), stage, sdims, stage_heldout(run.data, stage, heldout_samples(
            stage.eval)), run.data.tokenizer, run.metrics, at, cfg.per_device_train_batch_size, run.data.pad_id,
            stages, run.data.heldout, before, run.data.reset_position_ids)
    except EvalStopped:
        return _stopped_early(engine, f"stop agreed during stage {stage.index}'s evaluation: not recorded; the resume "
                              f"evaluates it again from {ended[0] if ended else state.checkpoint}")
    preempt.deadline.record_eval(time.perf_counter() - t_eval)
    if stage.index + 1 < len(stages):  # the checks up to the next stage's first step count its step, not this one's
        preempt.deadline.next_stage(step_cost_ratio(run.base_config, stage, stages[stage.index + 1]))
    progress.mark(None, "idle")  # the release, the stop's agreement and a run's teardown: not judged
    watch = release_engine(engine)
    del engine
    _released(run, stage, watch, state.step)  # before the next stage builds its engine: this one's memory goes back
    preempt.agreed()


def step_cost_ratio(base_config, old, new) -> float:
    """How many times one step (and one evaluation) of stage `new` costs one of stage `old` on the same ranks, for the
    time-limit checks before `new` has measured its own (training/preemption.py Deadline.next_stage): the planner's
    predicted step seconds where auto planned both stages (memory_choice: planner/auto_features.step_seconds, with its
    recompute, head chunks and offloads); else the model's FLOPs of one sequence at each length over each stage's SP
    degree (planner/flops.py: 6*N*s + 6*L*nh*d*s^2, attention's quadratic share from the model's own shape), which
    assumes the same MFU and the same recompute at both lengths. Llama-3-8B at sp 8, 512k -> 1M: x3.8 either way.
    A config the planner cannot read: the length ratio squared (all attention) for a longer stage, the length ratio
    for a shorter one, each over the SP degrees: never less than the FLOPs say."""
    predicted = [(s.memory_choice or {}).get("predicted_step_s") for s in (old, new)]
    if all(predicted):
        return predicted[1] / predicted[0]
    from planner.flops import flops_per_sequence
    from planner.shapes import ModelShape

    try:
        shape = ModelShape.from_config(base_config.to_dict())
    except (AttributeError, ValueError, TypeError):  # no HF config (a stand-in), or one without the planner's keys
        r = new.max_seq_length / old.max_seq_length
        return max(r, r * r) * old.sp / new.sp
    # a rank's share: its SP group splits each sequence sp ways (the micro-batch per group is the same in every stage)
    per_rank = [flops_per_sequence(shape, s.max_seq_length) / s.sp for s in (old, new)]
    return per_rank[1] / per_rank[0]


def _agree(run: Run, stage_ends: bool) -> bool:
    """The stop, agreed after a step or a save (collective), counting the work before the next check: the stage's
    evaluation when `stage_ends`, and a background write in flight (the stop waits for it before its own save)."""
    preempt = run.preempt
    return preempt.agreed(ahead_s=preempt.deadline.ahead_s(stage_ends, run.ckpt.pending is not None))


def _stop_in_window(run: Run, engine, stages, stage, hf_config, state: TrainState, sampler, at_end: bool) -> None:
    """A SIGTERM stop (every rank agreed, `window_left_s` seconds before the launcher's SIGKILL): commit what can be
    committed in the window, never start what cannot finish in it. The background write in flight is waited for
    (at most the window less EXIT_MARGIN_S; one all-reduce then says whether every rank's is durable) and committed;
    then the stop's own synchronous save only if the agreed save time (measured, else guessed from the rank's bytes)
    fits what is left. At Llama-3-8B on 32 ranks: the rest of a background write (~40-95 s in all) commits when it
    ends inside the window, the commit itself ~0.1 s; a synchronous save (~95 s projected) never fits 30 s, so the
    stop exits 75 within the window instead of being SIGKILLed mid-save. Lost work stays <= the save interval plus
    one step (training/preemption.py `due_after_s`)."""
    preempt, ckpt = run.preempt, run.ckpt
    if ckpt.pending is not None:
        p, wait_s = ckpt.pending, preempt.window_left_s - EXIT_MARGIN_S
        print0(f"SIGTERM: waiting up to {max(wait_s, 0):.0f} s for the background write of step {p.step} "
               f"({preempt.window_left_s:.0f} s before the launcher's SIGKILL)")
        got = ckpt.finish(timeout_s=wait_s)
        if got is None:
            print0(f"SIGTERM: the background write of step {p.step} is not durable on every rank "
                   f"{preempt.window_left_s:.0f} s before the launcher's SIGKILL: not committed; the newest committed "
                   f"checkpoint is {state.checkpoint}")
            return
        _committed(run, state, got)
        preempt.agreed()  # the window left after that wait, agreed again (one all-reduce)
    if state.checkpoint and os.path.basename(state.checkpoint) == tag_for(state.step):
        return  # this step is committed
    if state.bad_steps:  # said in the loop: non-finite steps are open, the newest checkpoint stays the resume point
        return
    left = preempt.window_left_s - EXIT_MARGIN_S
    if preempt.save_need_s > left:
        print0(f"SIGTERM: a save of step {state.step} takes ~{preempt.save_need_s:.0f} s, {max(left, 0):.0f} s are left "
               f"before the launcher's SIGKILL: not started; the newest committed checkpoint is {state.checkpoint}")
        return
    _save(run, engine, stages, stage, hf_config, state, sampler, at_end)


def _health(run: Run, stage, state: TrainState, out: dict, watch: LossWatch, kind: str = "full") -> None:
    """A step's health, the same decision on every rank (training/step.bad_step: all-reduced values). A non-finite
    step: one line, counted in `state.bad_steps` (the loop saves nothing while it is open); BAD_STEPS_STOP in a row:
    the background write in flight (a step before them) committed, then one line and exit 2. A finite one closes
    the run of them, said. A loss spike: one line, and the newest checkpoint two steps or more before it (a spike at
    step N is the loss of the weights after step N-1's update: step_N-1 may hold the divergence) kept against
    rotation (Checkpointer.pin), named in the line and in metrics.jsonl (`loss_spike`)."""
    if out.get("skipped"):  # no supervised token: nothing ran
        return
    loss, step = out["loss"], state.step
    if bad_step(out, getattr(run.cfg, "fp16", False)):
        state.bad_steps, state.first_bad = state.bad_steps + 1, state.first_bad or step
        what = f"loss {loss:.4g}" + ", its update skipped for a non-finite gradient norm" * bool(out.get("overflow"))
        print0(f"step {step}: {what}: non-finite step {state.bad_steps} in a row (the run stops at {BAD_STEPS_STOP}); "
               "no checkpoint is saved until a step is finite again")
        if state.bad_steps >= BAD_STEPS_STOP:
            _committed(run, state, run.ckpt.finish())  # a write in flight holds a step before them: durable first
            lr = getattr(stage, "learning_rate", None) or getattr(run.cfg, "learning_rate", None)
            lower = f"a lower --learning_rate (now {lr:g})" if lr else "a lower --learning_rate"
            ck, pin = state.checkpoint, (f"; the loss spiked at step {watch.spiked}, {watch.pinned} is kept from "
                                         "before it" if watch.pinned else "")
            raise ValueError(f"steps {state.first_bad}-{step}: {BAD_STEPS_STOP} non-finite steps in a row ({what}): the "
                             "weights or the optimizer state hold non-finite values and every later update would be "
                             "skipped; stopped, nothing saved since. " + (
                                 f"Resume from the newest checkpoint before them, {ck}: --resume {ck} with {lower} "
                                 "(a new branch from there: training/branches.py)" if ck else
                                 f"No checkpoint before them: start again with {lower}") + pin)
        return
    if state.bad_steps:
        print0(f"step {step}: finite again after {state.bad_steps} non-finite step(s) from step {state.first_bad}")
        state.bad_steps, state.first_bad = 0, None
    median = watch.spike(loss, kind)
    if median is None and watch.pinned and step - watch.spiked >= SPIKE_RELEASE and not watch.spiking:
        run.ckpt.pin(None, None)  # the loss came back: the kept checkpoint goes back to rotation
        print0(f"step {step}: no loss spike since step {watch.spiked}: {watch.pinned} is no longer kept against rotation")
        watch.pinned = None
    if median is not None:
        watch.spiked, watch.pinned = step, run.ckpt.pin(step - 2, state.checkpoint)
        print0(f"step {step}: loss {loss:.4g} is {loss / median:.1f}x the median {median:.4g} of this stage's last "
               f"{len(watch.losses)} steps (a spike: a divergence or a broken batch?): " + (
                   f"{watch.pinned} is kept against rotation (checkpoints/PINNED); if the loss does not come back, "
                   f"resume from it (--resume {watch.pinned}) with a lower learning rate" if watch.pinned else
                   "no checkpoint of this run before it to keep"))
        run.metrics.log({"event": "loss_spike", "step": step, "stage": stage.index, "spike_loss": loss,
                         "median_loss": median, "kept": watch.pinned})  # (no `loss` key: not a step's record)


def _rank_bytes(engine, world: int) -> float:
    """This rank's checkpoint bytes, for a save's guessed time before one is measured: 14 bytes per parameter / world
    under ZeRO-3 (bf16 weights 2, fp32 master 4, Adam moments 8). Llama-3-8B on 32 ranks: ~3.5 GB."""
    return 14.0 * sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters()) / world


def _after_first_step(run: Run, engine, features) -> None:
    check_routed(engine)  # Ulysses + document masking on every layer, or one line naming the model
    kept = kept_attention_line(features, run.attn)  # --keep_attention found its kernel?
    if kept:
        print0(kept)


def _save(run: Run, engine, stages, stage, hf_config, state: TrainState, sampler, at_end: bool,
          by_time: bool = True) -> None:
    """A checkpoint of `state` (collective); the stage's last one is kept for good. With `async_save` only the
    snapshot blocks here and the commit comes at a later step boundary (`_committed`); a stage's end and an agreed
    stop save synchronously (the next stage loads it; the job exits after it), after the write in flight.
    `by_time`: the save interval made it due, so its wait for the write in flight counts in what it blocked."""
    progress.mark(None, "save")
    t_wait = time.perf_counter()
    if run.ckpt.pending:  # at most one save in flight: this one waits for it (the steps are blocked meanwhile)
        print0(f"save at step {state.step} waits for the background write of step {run.ckpt.pending.step}")
        _committed(run, state, run.ckpt.finish())
    t0, taken = time.perf_counter(), time.monotonic()  # the state saved is this moment's
    state.stage, state.wandb_id, state.wandb_home = stage.index, run.metrics.run_id, run.metrics.home
    meta = {"stage_name": stage.name, "model_hash": model_hash(hf_config), "world": run.dims.world, "sp": stage.sp,
            "stage_names": [s.name for s in stages[:stage.index + 1]],  # a resume checks its stages by name
            "stage_steps": [s.max_steps for s in stages[:stage.index + 1]],  # as they began (curriculum_resume.keep_stage_steps)
            "stage_sizes": [s.steps_from for s in stages[:stage.index + 1]],  # what sized them (max_tokens, epochs)
            # the whole-stage count at the samples per step its rest was planned at (curriculum_resume.keep_stage_steps)
            "stage_full": [getattr(s, "full_steps", None) or s.max_steps for s in stages[:stage.index + 1]],
            "heldout": run.data.heldout_split,  # a resume keeps these held-out documents
            "tokenizer": run.data.tokenizer.path if run.data.tokenizer else None, "config": to_dict(run.cfg),
            "tokenizer_vocab": run.data.tokenizer_vocab,  # whose ids it trained on: its files, and what they mean
            # re-saved alike; rank 0's (it writes trainer.json): ~0.1 s once at 128k pieces, cached on the tokenizer
            "tokenizer_pieces": run.data.tokenizer.pieces_identity() if run.data.tokenizer and run.dims.is_main else None,
            # the BOS its texts were framed with (null: none), what the export's add_bos_token says whatever
            # transformers it runs under (its BOS rule for the same files differs by major: export_tokenizer.py)
            **({"bos_id": run.data.tokenizer.bos_id} if run.data.tokenizer else {}),
            "reply_stops": run.data.reply_stops(),  # what its export stops on (a chat SFT's end-of-turn)
            "trained_template": run.data.trained_template()}  # the chat template its export carries
    background = run.cfg.async_save and not (at_end or run.preempt.stopping)
    path = run.ckpt.save(engine, state.step, {**state.state_dict(), **meta},
                         {"sampler": sampler.state_dict(), "rng": rng_state()}, hf_config,
                         stage_end=f"STAGE_{stage.index}_{stage.name}" if at_end else None, background=background)
    # the save interval starts at the snapshot (the next save comes one measured write and step early: lost work <=
    # interval + one step); `auto` sizes it from what this save blocked when it is of the kind the interval makes (a
    # stage's end under async is not), the wait for the previous write included when the interval made it due. A
    # `save_steps` save's wait is not: a longer interval would not shorten it. (The recipes' save_steps 50 with a time
    # save at step 49 waited 47-69 s at step 50, and auto's interval became 100 x that: 115 min, lost work <= 22 min.)
    blocked = time.perf_counter() - (t_wait if by_time else t0)
    run.preempt.saved(blocked if background == run.cfg.async_save else None, at=taken)
    if path is not None:
        _committed(run, state, (path, time.perf_counter() - t0), background=False)
    else:
        p = run.ckpt.pending
        print0(f"snapshot of step {state.step} in {p.blocked_s:.2f}s ({p.snapshot.nbytes / 2**30:.2f} GiB of host "
               f"memory on this rank, copied in {p.snapshot.copy_s:.2f}s); serializing and writing in the background")


def _committed(run: Run, state: TrainState, got: tuple[str, float] | None, background: bool = True) -> None:
    """A save was committed: it is the checkpoint a resume or the next stage loads; its whole time (the
    background write included, to the commit) is what the time-limit stop reserves for a save. The save interval
    counts its write alone (a background one's: until every rank's bytes were durable, `Checkpointer.written_s`)."""
    if got is None:
        return
    path, seconds = got
    state.checkpoint = path
    run.preempt.deadline.record_save(seconds)
    run.preempt.committed(run.ckpt.written_s if background else seconds)
    print0(f"saved {path} in {seconds:.1f}s")
