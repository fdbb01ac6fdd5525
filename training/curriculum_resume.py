"""The curriculum a resume continues (training/curriculum.py resolves today's stages; train.py applies these to them
once the checkpoint is chosen): the stages the checkpoint ran keep the step counts they ran with, the stage it is in
keeps the RoPE it trained with to its end (`keep_stage_steps`), and today's recipe must hold the checkpoint's stage and
every stage before it at the same positions (`check_resumed_stages`: a one-line ValueError otherwise, before the data
or a universal conversion). Both read the resumed TrainState (training/restore.py) and print what they keep.
"""

from __future__ import annotations

import dataclasses
import os

from base.log import print0
from model_utils.rope import check_rope, nested, normalized
from training.curriculum import Stage
from training.hf_args import ratio_steps


def keep_stage_steps(stages: list[Stage], state) -> list[Stage]:
    """On resume, the stages the checkpoint finished keep the step counts they ran with (`state.stage_steps`):
    recomputed from today's world, batch or accumulation, a finished stage grew or shrank, and with fewer nodes the run
    went back into a finished stage (trained again at its short length on later weights, LR re-warmed). The stage the
    run is in, where its steps came from tokens or epochs, keeps the steps it has done and trains the rest of its
    tokens / epochs at today's samples per step: done + (planned - done) x today's whole-stage count / the whole-stage
    count its rest was planned with (`state.stage_full`, written as `full_steps`; the count it began with in a
    checkpoint before it). Keeping the count it began with trained half of an epoch's remaining samples after a
    resume on half the nodes, and exited 0; twice them on twice the nodes. On the checkpoint's own layout
    (`state.same_layout`: world, SP, micro-batch, accumulation, length) it keeps its planned count, an exact resume: a
    count that differs there is this version's counting rule (since 2026-11-29 an epoch's remainders count: 18 planned
    steps became 19 mid-stage, the cosine stretched), said as that. A --warmup_ratio warmup follows the stage's final
    count. A stage's own max_steps, raised or lowered, or its max_tokens / epochs changed, still counts for the stage
    the run is in (a deliberate change); stages after it take today's settings. The stage the run is in keeps the
    RoPE its checkpoint trained with to its end (`_kept_rope`). Prints what it keeps."""
    ran, sized = state.stage_steps or [], getattr(state, "stage_sizes", None) or []
    full = getattr(state, "stage_full", None) or ran
    same = getattr(state, "same_layout", None) is True
    out = []
    for s in stages:
        same_size = s.index < len(sized) and sized[s.index] == s.steps_from != "steps"  # its max_tokens / epochs as then
        done = getattr(state, "step", 0) - sum(x.max_steps for x in out)  # the steps past this stage's start
        was = (full[s.index] if s.index < len(full) else ran[s.index]) if s.index < len(ran) else None
        # the current stage is rescaled whenever today's whole-stage count differs from the one its rest was planned
        # with (`was`), compared to that, not to the planned count: after a rescale the two differ at the same rate
        rescale = s.index == state.stage and same_size and was is not None and 0 <= done < ran[s.index] and (
            was != s.max_steps or ran[s.index] != s.max_steps) and not same
        keep = s.index < len(ran) and ran[s.index] != s.max_steps and (
            s.index < state.stage or (s.index == state.stage and same_size))
        if rescale:  # the rest at today's samples per step
            rest = -(-(ran[s.index] - done) * s.max_steps // max(1, was))
            keep = keep or done + rest != ran[s.index]
            if was != s.max_steps:  # (at the rate its rest was planned at: as planned, nothing to say)
                print0(f"note: stage {s.index} ({s.name}) planned {ran[s.index]} steps and has run {done}; its "
                       f"{s.steps_from.split(':')[0]} over another world, batch or accumulation (today's settings give "
                       f"{s.max_steps} for the whole stage): the rest of its data in {rest} more steps, {done + rest} in all")
            s = dataclasses.replace(s, max_steps=done + rest, full_steps=s.max_steps)
        elif keep and s.index == state.stage and same:  # an exact resume: today's count is another counting rule's
            if was != s.max_steps:
                print0(f"note: stage {s.index} ({s.name}) keeps the {ran[s.index]} steps it began with, {done} run (world, "
                       f"SP, micro-batch, accumulation, length as then): this version's counting rule gives {s.max_steps} "
                       f"(training/hf_args.epoch_steps: every sample, the accumulation's remainder a step"
                       f"{'; or its samples changed' if s.steps_from.startswith('epochs') else ''})")
            s = dataclasses.replace(s, max_steps=ran[s.index], full_steps=s.max_steps)
        elif keep:
            why = ("its " + s.steps_from.split(":")[0] + " over another world, batch or accumulation"
                   if s.steps_from != "steps" and not same else "a finished stage keeps what it ran")
            print0(f"note: stage {s.index} ({s.name}) keeps the {ran[s.index]} steps it "
                   f"{'ran' if s.index < state.stage else 'began'} with (today's settings give {s.max_steps}: {why})")
            s = dataclasses.replace(s, max_steps=ran[s.index])
        if s.index == state.stage and done > s.max_steps:  # lowered below where the run is: it ends here (its end
            print0(f"note: stage {s.index} ({s.name}) has run {done} steps and today's settings give it "  # saved and
                   f"{s.max_steps}: it ends at the {done} it has run (evaluated now; the next stage gets all its steps)")
            s = dataclasses.replace(s, max_steps=done)  # evaluated); the next stage began at its old end, cut short
        if s.warmup_ratio and keep:
            warm = ratio_steps(s.warmup_ratio, s.max_steps)
            if warm != s.warmup_steps:
                print0(f"note: stage {s.index} ({s.name}): warmup {warm} steps (--warmup_ratio {s.warmup_ratio:g} of "
                       f"its {s.max_steps}; today's settings gave {s.warmup_steps})")
                s = dataclasses.replace(s, warmup_steps=warm)
        if s.index == state.stage and (rope := _kept_rope(stages, state)) is not None:
            print0(f"note: {state.checkpoint} trained stage {s.index} ({s.name}) with RoPE {rope} (a stage without rope: "
                   f"ran the run's or the model's before 2026-11-30): it keeps it to the stage's end, an exact resume; "
                   f"from the next stage on, one without rope keeps the previous stage's (this version's rule: stage "
                   f"{s.rope_from} ({stages[s.rope_from].name})'s {s.rope} here)")
            s = dataclasses.replace(s, rope=rope, rope_from=None)
        out.append(s)
    return out


def check_resumed_stages(stages: list[Stage], state) -> None:
    """On resume, today's curriculum holds the checkpoint's stage and every stage before it at the same positions, by
    name (`state.stage_names`, None where the checkpoint did not record one); a one-line ValueError otherwise. The
    resume picks a stage by its index: with a stage removed before it, the stage now at that index loaded another
    stage's mid-stage engine, LR and data position (its own first steps and the removed stage's rest never trained);
    with the checkpoint's stage removed from the end, the run trained nothing and exported that unfinished stage.
    A later stage changed or appended, and the current stage's steps raised or lowered, pass."""
    if getattr(state, "checkpoint", None) is None:
        return
    k, names = state.stage, list(getattr(state, "stage_names", None) or [])
    names += [None] * (k + 1 - len(names))
    today = [s.name for s in stages]
    # a name the run never gave (a plain run's `main`, an unnamed stage's stage<i>) may be named now, where neither
    # name stands at another position (a plain run extended by a recipe): noted; a named stage replaced is refused
    wrong = next((i for i, n in enumerate(names[:k + 1]) if n is not None and (i >= len(today) or today[i] != n) and (
        i >= len(today) or not _unnamed(n, i) or n in today or today[i] in names[:k + 1])), None)
    if k < len(today) and wrong is None:
        renamed = [(n, today[i]) for i, n in enumerate(names[:k + 1]) if n is not None and today[i] != n]
        if renamed:
            print0(f"note: {state.checkpoint}'s stage(s) {', '.join(f'{a} -> {b}' for a, b in renamed)} renamed in "
                   "today's recipe: resumed by position")
        _kept_rope(stages, state)  # one that cannot be kept: refused here, before the data or a conversion
        return
    what = (f"today's recipe has {len(today)} stage(s) {today}" if wrong is None or wrong >= len(today)
            else f"today's stage {wrong} is {today[wrong]}, the checkpoint's was {names[wrong]}")
    ran = getattr(state, "stage_steps", None) or []
    done = k if len(ran) > k and sum(ran[:k + 1]) <= state.step else k - 1  # the last stage it finished
    export = ""
    if done >= 0 and names[done] is not None:  # its marker beside the checkpoint (training/checkpoint.py)
        marker = os.path.join(os.path.dirname(state.checkpoint.rstrip("/")), f"STAGE_{done}_{names[done]}")
        export = f", or export the model as stage {done} ({names[done]}) ended: python scripts/export_hf.py {marker}"
    into = f", {state.step - sum(ran[:k])} of its {ran[k]} steps" if len(ran) > k else ""
    raise ValueError(f"{state.checkpoint} is at step {state.step}, stage {k} ({names[k]}){into}, and {what}: put "
                     f"the checkpoint's stages {names[:k + 1]} back at the start of the recipe (a resume finds its "
                     f"stage by position){export}")


def _kept_rope(stages: list[Stage], state) -> dict | None:
    """The RoPE the checkpoint's stage keeps to its end (keep_stage_steps), None for today's: where the checkpoint is
    inside a stage that keeps an earlier stage's `rope` and its hf_config.json (`state.trained_rope`, rank 0's read)
    shows another (the code before that rule ran the run's or the model's). Switched mid-stage, the stage's rest ran
    another position encoding (an upgrade audit: losses 1.29 1.26 0.71 3.32 kept, 0.04 0.33 0.26 1.28 switched). One
    this version cannot set at the stage's SP (model_utils/rope.check_rope): a one-line ValueError naming the fix."""
    k, saved = state.stage, getattr(state, "trained_rope", None)
    s = stages[k] if k < len(stages) else None
    ran = getattr(state, "stage_steps", None) or []
    if s is None or getattr(s, "rope_from", None) is None or not s.rope or not isinstance(saved, dict) or (
            len(ran) > k and state.step >= sum(ran[:k + 1])):
        return None  # its own rope, nothing to compare, or the checkpoint is the stage's end: the next stage as today's
    try:
        flat = [(saved, normalized(s.rope, "rope"))] if not nested(s.rope) else [
            (saved.get(t), normalized(p, "rope")) for t, p in s.rope.items()]
    except (ValueError, AttributeError, TypeError):
        return None
    if all(isinstance(got, dict) and all(got.get(key) == v for key, v in own.items()) for got, own in flat):
        return None  # trained under today's rule
    try:
        for part in (saved.values() if nested(saved) else [saved]):
            check_rope(part, "rope", s.sp)
    except ValueError as e:
        raise ValueError(f"{state.checkpoint} trained stage {k} ({s.name}) with RoPE {saved}, which this version cannot "
                         f"keep for the rest of the stage ({e}): train the stage again from its start under this "
                         f"version's rule, --resume checkpoints/STAGE_{k - 1}_{stages[k - 1].name}") from None
    return saved


def _unnamed(name: str, i: int) -> bool:
    """A stage name the run never gave: `main` (no stages) or resolve_stages' default stage<i>."""
    return name in ("main", f"stage{i}")
