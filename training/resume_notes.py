"""What a resume says about the run that wrote its checkpoint (training/restore.py's `Restorer.resume` and
`restore_stage` print and raise them): the settings that differ from today's (one note naming them), the seed the
current stage keeps, the global batch of another data-parallel size, a finished run's folder reused for another
dataset or base model (refused), and the data that moved under a saved data position. Pure functions of
`trainer.json` (its `config`: training/config.to_dict) and the samplers' states; every rank holds the same copies
(rank 0 read them and broadcast), so every rank decides the same. A change of `stages` is named key by key, with
how to keep the old value where it reaches the stage being resumed; whether the job runs the checkpoint's layout
(`same_layout`) decides how an epoch- or token-sized stage keeps its count (training/curriculum_resume.keep_stage_steps).
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
PACKING_SAID = " (the same indices name other samples)"  # data_moved's words for another packing (moved_note)
RESOLVED_SP = "resolved_sp"  # beside today's settings (`with_resolved_sp`): each stage's SP as this job resolved it
# a stage key -> the run's setting a stage without it runs with (training/curriculum.resolve_stages; `rope` is the
# previous stage's, not the run's: not here)
RUN_OF = {k: k for k in ("max_seq_length", "sequence_parallel_size", "context_parallel_size", "learning_rate", "min_lr",
                         "warmup_steps", "lr_scheduler", "memory_features", "loss_weighting")}
RUN_OF["kind"] = "data_kind"
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
    training/curriculum_resume.keep_stage_steps). Anything else (more steps, a stage appended) may train on: False."""
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
    diffs = stage_changes(saved, now) if "stages" in changed else []
    if "stages" in changed and not diffs:  # only fields a newer version writes (None: the run's, as before)
        changed.remove("stages")
    if changed:  # continuing with new settings is allowed (an LR, more steps); a new run in an old folder is not
        what = ", ".join(f"stages ({'; '.join(f'stage {i} ({n}) {d}' for i, n, *_, d in diffs)})" if k == "stages" else k
                         for k in changed)
        out.append(f"note: {path} was written by a run whose {what} differed: this run continues it from its step "
                   "with today's (a new run: another --output_dir, or --resume none)")
    if trainer is not None:
        out += mid_stage_changes(path, trainer, diffs)
    for k in changed_settings(saved, now, KEPT_KEYS):  # data/sampler.py, data/mixture.py keep the saved seed
        out.append(f"note: {path} was written with {k} {saved[k]}: the stage it resumes in keeps it for its data order "
                   f"(today's {now[k]} would repeat some of its samples and skip others); that stage's synthetic task "
                   f"samples, its RNG streams when re-seeded (another world size) and every later stage use today's "
                   f"{now[k]}")
    batch = None if trainer is None or world is None else batch_note(path, trainer, now, world)
    return out + ([batch] if batch else [])


def _effective(conf: dict, stage: dict, key: str):
    """A stage key's value as the run applies it: the stage's own, else the run's same setting (RUN_OF), else the
    default (training/config.Config); a key no run setting backs (name, tasks, rope: the previous stage's) as given."""
    if stage.get(key) is not None or key not in RUN_OF:
        return stage.get(key)
    from training.config import Config

    field = Config.__dataclass_fields__.get(RUN_OF[key])
    return conf.get(RUN_OF[key], field.default if field is not None else None)


def stage_changes(saved: dict, now: dict) -> list[tuple[int, str, str, str, str]]:
    """What differs in `stages` between the saved settings and today's, key by key: (stage, its name, key, its old
    value as said, "loss_weighting token -> conversation"); a key the stage leaves unset is named by the value it runs
    with (the run's). A key whose value the stage runs with is the same (a field written by a newer version, a value
    given that the run's gave before) is not named; a stage added or removed is (key "")."""
    a, b = saved.get("stages") or [], now.get("stages") or []
    out = []
    for i in range(max(len(a), len(b))):
        x, y = (a[i] if i < len(a) else None), (b[i] if i < len(b) else None)
        if not isinstance(x, dict) or not isinstance(y, dict):
            name = (x if isinstance(x, dict) else y if isinstance(y, dict) else {}).get("name") or f"stage{i}"
            out.append((i, name, "", "", "removed" if isinstance(x, dict) else "added"))
            continue
        name = y.get("name") or x.get("name") or f"stage{i}"
        for k in sorted(set(x) | set(y)):
            was, got = _shown(_effective(saved, x, k)), _shown(_effective(now, y, k))
            if was != got:
                out.append((i, name, k, was, f"{k} {was} -> {got}"))
    return out


def _shown(v) -> str:
    return "unset" if v is None else json.dumps(v, sort_keys=True, default=str) if isinstance(v, dict | list) else str(v)


def mid_stage_changes(path: str, trainer: dict, diffs: list[tuple[int, str, str, str, str]]) -> list[str]:
    """One line where a stage key that shapes training changed for the stage the checkpoint is inside
    (`stage_changes`): its rest trains with today's value from the checkpoint's step on; the line names how to keep
    the old one. A stage's own key beats the run's flag for loss_weighting, memory_features and kind
    (training/curriculum.resolve_stages); a flag of training/config.STAGE_FLAGS replaces every stage's
    (flags_over_stages): the recipe's stage key is the fix that touches this stage alone. Its length (max_steps /
    max_tokens: training/curriculum_resume.keep_stage_steps says it) and eval (run at its end) are not named here; nothing
    where the checkpoint ends its stage (the next one starts as today's settings say)."""
    from training.config import STAGE_FLAGS

    try:
        k, step, ran = int(trainer["stage"]), int(trainer["step"]), [int(x) for x in trainer.get("stage_steps") or []]
    except (KeyError, TypeError, ValueError):
        return []
    mine = [(key, was, words) for i, _, key, was, words in diffs
            if i == k and key not in ("", "name", "eval", "max_steps", "max_tokens")]
    if not mine or len(ran) > k and step >= sum(ran[:k + 1]):
        return []
    keep = []
    for key, was, _ in mine:
        how = f"the stage `{key}: {was}` in the recipe" if was != "unset" else f"the stage no `{key}` in the recipe"
        flag = RUN_OF.get(key)
        keep.append(how if flag is None else f"{how} (a stage's own {key} beats --{flag})" if flag not in STAGE_FLAGS
                    else f"{how} (--{flag} would set every stage's)")
    name = next(n for i, n, *_ in diffs if i == k)
    return [f"note: stage {k} ({name}) changes mid-stage, {path} being inside it: {'; '.join(w for *_, w in mine)} "
            f"from step {step + 1} on; to keep what it began with, give {'; '.join(keep)}"]


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
    return _stage_value(now, stage, "sequence_parallel_size")


def same_layout(trainer: dict, now: dict, world: int) -> bool | None:
    """Whether today's job runs the checkpoint's stage on its layout: the same world, SP degree (as this job resolved
    it: `_today_sp`), micro-batch, accumulation and sequence length. Then a stage sized by tokens or epochs counts its
    steps from the same samples per step, and a count that differs is this version's counting rule, not the job
    (training/curriculum_resume.keep_stage_steps keeps the planned one). None where the checkpoint does not say (written
    before `world` / `sp`)."""
    saved = trainer.get("config") or {}
    try:
        k, saved_sp = int(trainer.get("stage", 0)), int(trainer["sp"])
        was = (int(trainer["world"]), saved_sp, int(saved["per_device_train_batch_size"]),
               int(saved["gradient_accumulation_steps"]), _stage_value(saved, k, "max_seq_length"))
        got = (int(world), _today_sp(now, k, saved_sp), int(now["per_device_train_batch_size"]),
               int(now["gradient_accumulation_steps"]), _stage_value(now, k, "max_seq_length"))
    except (KeyError, TypeError, ValueError):
        return None
    return was == got


def _stage_value(conf: dict, stage: int, key: str):
    """A setting as stage `stage` runs it: its own, else the run's."""
    stages = conf.get("stages") or []
    own = stages[stage].get(key) if 0 <= stage < len(stages) and isinstance(stages[stage], dict) else None
    return own if own is not None else conf.get(key)


def batch_note(path: str, trainer: dict, now: dict, world: int) -> str | None:
    """A resume on another data-parallel size (a node excluded: world 16 -> 8 at SP 8, dp 2 -> 1) goes on at another
    global batch with the LR schedule by optimizer steps: each step averages the gradient over half the samples (its
    noise grows, at the same LR), and a stage sized by max_steps trains half the tokens in its steps (one sized by
    tokens or epochs takes more steps: training/curriculum_resume.keep_stage_steps says so). Said in one line with the
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
        out.append(f"{where}packing {saved.get('packing', 'best-fit-decreasing in stream order')} -> {now['packing']}"
                   + PACKING_SAID)
    for k, v in saved.items():
        if isinstance(v, dict) and isinstance(now.get(k), dict):
            out += data_moved(v, now[k], f"{where}{k}.")
    return out


def moved_note(path: str, moved: list[str]) -> str:
    """The one line a mid-stage resume prints for `data_moved`'s list. A packing rule of this version that differs from
    the one that wrote `path` (the permuted SFT packing of 2026-11-30) is said as that, not as a change of the user's
    data: the same documents, and the saved position's indices name other samples; counts that moved beside it are
    named too (another packing may fill another number of samples). Without a packing change: the data changed."""
    rule = [m.replace(PACKING_SAID, "") for m in moved if m.endswith(PACKING_SAID)]
    rest = [m for m in moved if not m.endswith(PACKING_SAID)]
    order = ("this epoch goes on at the same fraction of a new order (some of its samples repeat, others wait for the "
             "next epoch)")
    if not rule:
        return f"note: the data changed since {path} ({'; '.join(rest)}): {order}"
    also = f"; beside it {'; '.join(rest)}" if rest else ""
    return (f"note: this version packs the conversations into samples by another rule than the one that wrote {path} "
            f"({'; '.join(rule)}{also}): the same indices name other samples, so {order}")
