"""What a resume says about the run that wrote its checkpoint (training/restore.py's `Restorer.resume` and
`restore_stage` print and raise them): the settings that differ from today's (one note naming them), the seed the
current stage keeps, the global batch of another data-parallel size, a finished run's folder reused for another
dataset or base model (refused), and the data that moved under a saved data position. Pure functions of
`trainer.json` (its `config`: training/config.to_dict) and the samplers' states; every rank holds the same copies
(rank 0 read them and broadcast), so every rank decides the same.
"""

from __future__ import annotations

import json
import os

# what a run is (the weights are the checkpoint's): each is applied from today's config on a resume (the engine, the
# data pipeline and the loss are built from it at every stage's start), so a change is said, not refused
RUN_KEYS = ("dataset_path", "stages", "max_seq_length", "max_steps", "num_train_epochs", "data_kind", "learning_rate",
            "lr_scheduler", "warmup_steps", "warmup_ratio", "min_lr", "per_device_train_batch_size",
            "gradient_accumulation_steps", "sequence_parallel_size", "weight_decay", "max_grad_norm", "loss_weighting",
            "mask_cross_document_labels", "reset_position_ids", "rope", "bf16", "fp16", "deepspeed",
            "model_name_or_path", "tokenizer_name_or_path")
KEPT_KEYS = ("seed",)  # the saved run's wins for the stage it resumes in: its data order (data/sampler.py)
OTHER_RUN_KEYS = ("dataset_path", "model_name_or_path")  # a finished run's folder reused with another: refused
SIZE_KEYS = ("max_steps", "num_train_epochs")  # with each stage's max_steps / max_tokens: how long the run is
STAGE_SIZE_KEYS = ("max_steps", "max_tokens")
RESOLVED_SP = "resolved_sp"  # beside today's settings (`with_resolved_sp`): each stage's SP as this job resolved it
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _deepspeed_file(path) -> str:
    """A --deepspeed JSON as training/config.py finds it (a relative path not found here: the repository's
    ds_configs/), so the same file named from another working folder is no change."""
    path = str(path)
    if not os.path.isabs(path) and not os.path.isfile(path) and os.path.isfile(os.path.join(REPO, path)):
        path = os.path.join(REPO, path)
    return os.path.realpath(path)


def changed_settings(saved: dict, now: dict, keys: tuple = RUN_KEYS) -> list[str]:
    """The `keys` whose values differ between the settings that wrote a checkpoint and this run's (both as
    training/config.to_dict writes them); a key either lacks is not compared."""
    def same(k) -> bool:
        if k == "deepspeed" and saved[k] and now[k]:
            return _deepspeed_file(saved[k]) == _deepspeed_file(now[k])
        return json.dumps(saved[k], sort_keys=True, default=str) == json.dumps(now[k], sort_keys=True, default=str)

    return [k for k in keys if k in saved and k in now and not same(k)]


def finished(trainer: dict) -> bool:
    """Whether a checkpoint is its run's end: the last stage of the recipe it was saved with, at that stage's last step
    (trainer.json's `stage_steps`, the step counts its stages ran with). False where it does not say (a checkpoint
    written before `stage_steps`)."""
    stages = (trainer.get("config") or {}).get("stages")
    n = len(stages) if isinstance(stages, list) and stages else 1  # a plain run: one stage, `main`
    ran = trainer.get("stage_steps")
    return (isinstance(ran, list) and len(ran) == n and int(trainer.get("stage", -1)) == n - 1
            and int(trainer.get("step", 0)) >= sum(int(s) for s in ran))


def same_length(saved: dict, now: dict) -> bool:
    """Whether today's settings give the run the steps the saved ones did (its steps, epochs, every stage's steps or
    tokens): a finished run resumed with them trains nothing (its stages keep the counts they ran,
    training/curriculum.keep_stage_steps). Anything else (more steps, a stage appended) may train on: False."""
    if any(saved.get(k) != now.get(k) for k in SIZE_KEYS):
        return False
    a, b = saved.get("stages") or [], now.get("stages") or []
    return len(a) == len(b) and all(isinstance(x, dict) and isinstance(y, dict) and all(
        x.get(k) == y.get(k) for k in STAGE_SIZE_KEYS) for x, y in zip(a, b))


def check_other_run(path: str, output_dir: str, trainer: dict, now: dict, resume: str) -> None:
    """A one-line ValueError when `path` is the end of a finished run, today's settings train it no further, and
    today's dataset_path or model_name_or_path differ from its own: a new run started in an old run's folder (the
    default --output_dir checkpoints/run makes that easy) trained nothing, exited 0 and left the old model exported.
    The same command run again on a finished folder passes (nothing differs)."""
    saved = trainer.get("config") or {}
    other = changed_settings(saved, now, OTHER_RUN_KEYS)
    if not other or not finished(trainer) or not same_length(saved, now):
        return
    what = "; ".join(f"{k} {saved[k]} -> {now[k]}" for k in other)
    fresh = "" if resume == "none" else ", or --resume none to start over in this folder (its checkpoints move to " \
                                        "checkpoints/abandoned/)"
    raise ValueError(f"{output_dir} holds a finished run ({path}, step {trainer.get('step')}) with another {what}: "
                     f"resuming it would train nothing; use another --output_dir{fresh}")


def resume_notes(path: str, saved: dict, now: dict, trainer: dict | None = None, world: int | None = None) -> list[str]:
    """The notes a resume from `path` prints: the run's settings that differ (continued with today's), the seed the
    stage it resumes in keeps and, given the checkpoint's `trainer` (trainer.json) and today's `world`, another global
    batch (`batch_note`)."""
    out = []
    changed = changed_settings(saved, now)
    if changed:  # continuing with new settings is allowed (an LR, more steps); a new run in an old folder is not
        out.append(f"note: {path} was written by a run whose {', '.join(changed)} differed: this run continues it from"
                   " its step with today's (a new run: another --output_dir, or --resume none)")
    for k in changed_settings(saved, now, KEPT_KEYS):  # data/sampler.py, data/mixture.py keep the saved seed
        out.append(f"note: {path} was written with {k} {saved[k]}: the stage it resumes in keeps it for its data order "
                   f"(today's {now[k]} would repeat some of its samples and skip others); that stage's synthetic task "
                   f"samples, its RNG streams when re-seeded (another world size) and every later stage use today's "
                   f"{now[k]}")
    batch = None if trainer is None or world is None else batch_note(path, trainer, now, world)
    return out + ([batch] if batch else [])


def with_resolved_sp(config: dict, stages: list) -> dict:
    """Today's settings (training/config.to_dict) with the SP degree every stage resolved to (`Stage.sp`,
    training/curriculum.resolve_stages: an `auto` one from the GPUs, node size and host memory of the nodes this job
    got, agreed over its ranks), under RESOLVED_SP: what `batch_note` compares the checkpoint's layout with. Not a
    setting (no RUN_KEYS member): never named as a changed one."""
    return {**config, RESOLVED_SP: [int(s.sp) for s in stages]}


def _today_sp(now: dict, stage: int, saved_sp: int) -> int:
    """Today's SP degree of the stage a resume continues: as resolved for this job (`with_resolved_sp`), else the
    stage's own, else the run's; an "auto" one with nothing resolved taken as the checkpoint's."""
    resolved = now.get(RESOLVED_SP) or []
    if 0 <= stage < len(resolved) and isinstance(resolved[stage], int) and resolved[stage] >= 1:
        return resolved[stage]  # a requeue on H100s of a run saved on H200s: auto sp 2 -> 4 at the same world size
    sp = _setting_sp(now, stage)
    return sp if isinstance(sp, int) and sp >= 1 else saved_sp


def _setting_sp(now: dict, stage: int):
    """The SP degree today's settings give the stage: its own, else the run's (an int, "auto", or None)."""
    stages = now.get("stages") or []
    own = stages[stage].get("sequence_parallel_size") if 0 <= stage < len(stages) and isinstance(stages[stage],
                                                                                               dict) else None
    return own if own is not None else now.get("sequence_parallel_size")


def batch_note(path: str, trainer: dict, now: dict, world: int) -> str | None:
    """A resume on another data-parallel size (a node excluded: world 16 -> 8 at SP 8, dp 2 -> 1) goes on at another
    global batch with the LR schedule by optimizer steps: each step averages the gradient over half the samples (its
    noise grows, at the same LR), and a stage sized by max_steps trains half the tokens in its steps (one sized by
    tokens or epochs takes more steps: training/curriculum.keep_stage_steps says so). Said in one line with the
    accumulation that keeps the batch, where one does; a changed micro-batch or accumulation alone is named by
    `resume_notes` too. Today's data parallel is from the SP the checkpoint's stage resolved to in this job (`now`'s
    RESOLVED_SP: an `auto` SP moves with the nodes a requeue lands on, at the same world size), named beside the
    saved one where they differ. None for the same global batch or a checkpoint without `world`/`sp` (written before
    them)."""
    saved = trainer.get("config") or {}
    try:
        saved_sp = int(trainer["sp"])
        sp = _today_sp(now, int(trainer.get("stage", 0)), saved_sp)
        was_dp, dp = int(trainer["world"]) // saved_sp, world // sp
        mb, ga = int(now["per_device_train_batch_size"]), int(now["gradient_accumulation_steps"])
        was = int(saved["per_device_train_batch_size"]) * int(saved["gradient_accumulation_steps"]) * was_dp
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    if was_dp == dp or was == mb * ga * dp or dp < 1:
        return None
    keep = was // (mb * dp) if was % (mb * dp) == 0 else None
    # the SP said where it moved: at the same world size only SP moves dp, and an `auto` one moves with the nodes
    # (Llama-3-8B at 1M on 32 ranks: sp 2 on H200 141 GB, sp 4 on H100 80 GB; a requeue on `-p h100,h200` gets either)
    auto = _setting_sp(now, int(trainer.get("stage", 0))) == "auto"
    why = "" if sp == saved_sp else f"; sequence parallel {saved_sp} -> {sp}" + (
        " (auto, resolved for the GPUs and memory of this job's nodes)" if auto else "")
    return (f"note: {path}: global batch {was} -> {mb * ga * dp} samples per step (data parallel {was_dp} -> {dp}"
            f"{why}); the LR schedule is by steps" + (f"; keep the batch with --gradient_accumulation_steps {keep}" if keep else
                                              f"; no whole --gradient_accumulation_steps gives {was} at micro-batch "
                                              f"{mb} x data parallel {dp}"))


def data_moved(saved: dict, now: dict, where: str = "") -> list[str]:
    """What differs between a saved data position and today's sampler in the data it draws from: the packed sample
    count (data/sampler.py) or the mixture's component sizes (data/mixture.py), at any depth (replay, tasks)."""
    out = [f"{where}{k} {saved[k]} -> {now[k]}" for k in ("num_samples", "sizes")
           if k in saved and k in now and saved[k] != now[k]]
    if "packing" in now and saved.get("packing") != now["packing"] and ("num_samples" in saved or "sizes" in saved):
        out.append(f"{where}packing {saved.get('packing', 'best-fit-decreasing in stream order')} -> {now['packing']} "
                   "(the same indices name other samples)")
    for k, v in saved.items():
        if isinstance(v, dict) and isinstance(now.get(k), dict):
            out += data_moved(v, now[k], f"{where}{k}.")
    return out
