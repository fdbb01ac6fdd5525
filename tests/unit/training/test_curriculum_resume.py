"""What the stage a resume continues keeps from its checkpoint when this version counts its steps by another rule
(training/curriculum_resume.keep_stage_steps with `state.same_layout`, set by training/restore.py's resume): an upgrade audit
resumed a --num_train_epochs 2 stage planned at 18 steps by the code of 2026-11-29 at the same world, SP, micro-batch
and accumulation; today's counting rule gives 19, and the stage was rescaled mid-stage (its cosine stretched, a 19th
step appended) with a note that blamed another world, batch or accumulation. No launch: Stage values."""

from __future__ import annotations

import dataclasses
import types

from training.curriculum import Stage
from training.curriculum_resume import keep_stage_steps

EPOCHS = Stage(index=0, name="main", max_seq_length=2048, sp=1, rope=None, learning_rate=2e-5, min_lr=0.0,
               warmup_steps=0, lr_scheduler="cosine", max_steps=19, reset_optimizer=False, steps_from="epochs:2")


def _at(step, same_layout, **kw):
    return types.SimpleNamespace(stage=0, step=step, stage_steps=[18], stage_sizes=["epochs:2"],
                                 same_layout=same_layout, **kw)


def test_an_exact_resume_keeps_the_planned_count_and_names_the_counting_rule(capsys):
    (kept,) = keep_stage_steps([EPOCHS], _at(5, True))
    assert kept.max_steps == 18 and kept.full_steps == 19  # its LR schedule as it began; today's rate recorded
    out = capsys.readouterr().out
    assert "keeps the 18 steps it began with, 5 run" in out and "counting rule gives 19" in out, out
    assert "another world" not in out and out.count("\n") == 1, out
    # resumed again on that layout (its checkpoint now records stage_full 19): as planned, nothing to say
    (kept,) = keep_stage_steps([EPOCHS], _at(9, True, stage_full=[19]))
    assert kept.max_steps == 18 and capsys.readouterr().out == ""
    # the stage's end checkpoint: kept, without blaming the layout either
    (kept,) = keep_stage_steps([EPOCHS], _at(18, True))
    assert kept.max_steps == 18 and "another world" not in capsys.readouterr().out


def test_a_real_layout_change_still_rescales(capsys):
    """Another world (or a checkpoint that does not say: same_layout None) trains the rest of the epochs at today's
    samples per step, as before."""
    half = dataclasses.replace(EPOCHS, max_steps=10)  # dp 2 today
    for same in (False, None):
        (kept,) = keep_stage_steps([half], _at(4, same))
        assert kept.max_steps == 4 + 8, kept  # 14 planned steps left x 10 / 18
        assert "over another world, batch or accumulation" in capsys.readouterr().out
