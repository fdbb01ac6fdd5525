"""What a resume says about the run that wrote its checkpoint (training/resume_notes.py through Checkpointer.resume):
a finished run's folder reused with another dataset or base model is refused in one line; every setting a resume
applies from today's config is named when it changed; the --seed note says what keeps the saved seed and what takes
today's. One process, fake engine files (as tests/unit/training/test_checkpoint.py)."""

from __future__ import annotations

import os
import types

import pytest

from tests.unit.training.test_resume_branch import FakeConfig, FakeEngine
from training import restore
from training.checkpoint import Checkpointer
from training.resume_notes import RESOLVED_SP, batch_note, check_other_run, resume_notes, with_resolved_sp

OLD = {"dataset_path": "d1.jsonl", "model_name_or_path": "m1", "max_steps": 6, "num_train_epochs": None, "stages": [],
       "learning_rate": 1e-3, "seed": 0}


def saved_run(tmp_path, step=6, stage=0, stage_steps=(6,), config=OLD) -> Checkpointer:
    ck = Checkpointer(str(tmp_path), keep=2)
    ck.save(FakeEngine(), step, {"step": step, "tokens": 0, "stage": stage, "model_hash": "h", "config": config,
                                 "stage_steps": list(stage_steps)}, {"sampler": {}}, FakeConfig())
    return ck


def test_a_new_run_in_a_finished_folder_with_other_data_is_refused(tmp_path, capsys):
    """Before: a 6-step run finished on d1; the same folder started with d2 (and another LR) noted the change, trained
    0 steps and exited 0 with the old model exported."""
    ck = saved_run(tmp_path)
    with pytest.raises(ValueError) as e:
        ck.resume("auto", "h", "m1", {**OLD, "dataset_path": "d2.jsonl", "learning_rate": 5e-4})
    msg = str(e.value)
    assert "\n" not in msg and str(tmp_path) in msg and "dataset_path d1.jsonl -> d2.jsonl" in msg, msg
    assert "another --output_dir" in msg and "--resume none" in msg, msg
    with pytest.raises(ValueError, match="model_name_or_path m1 -> m2"):
        ck.resume("auto", "h", "m2", {**OLD, "model_name_or_path": "m2"})
    assert ck.resume("auto", "h", "m1", dict(OLD)).step == 6  # the same command again: exit 0, as before
    assert ck.resume("auto", "h", "m1", {**OLD, "learning_rate": 5e-4}).step == 6  # only an LR: noted, not refused
    # more steps on new data trains on: a continuation, noted as before
    assert ck.resume("auto", "h", "m1", {**OLD, "dataset_path": "d2.jsonl", "max_steps": 10}).step == 6
    assert "whose dataset_path, max_steps differed" in capsys.readouterr().out


def test_an_unfinished_run_on_other_data_continues_with_a_note(tmp_path, capsys):
    ck = saved_run(tmp_path, stage_steps=(10,), config={**OLD, "max_steps": 10})
    assert ck.resume("auto", "h", "m1", {**OLD, "max_steps": 10, "dataset_path": "d2.jsonl"}).step == 6
    assert "whose dataset_path differed" in capsys.readouterr().out


def test_a_curriculum_is_finished_at_its_last_stage_end(tmp_path):
    stages = [{"name": "a", "max_steps": 4}, {"name": "b", "max_tokens": 1000}]
    cfg = {**OLD, "stages": stages}
    ck = saved_run(tmp_path, step=4, stage=0, stage_steps=(4,), config=cfg)  # stage a's end: b is still to train
    assert ck.resume("auto", "h", "m1", {**cfg, "dataset_path": "d2.jsonl"}).step == 4
    ck = saved_run(tmp_path / "b", step=6, stage=1, stage_steps=(4, 2), config=cfg)
    with pytest.raises(ValueError, match="finished run"):
        ck.resume("auto", "h", "m1", {**cfg, "dataset_path": "d2.jsonl"})
    longer = [stages[0], {**stages[1], "max_tokens": 2000}]  # stage b made longer: it trains on
    assert ck.resume("auto", "h", "m1", {**cfg, "stages": longer, "dataset_path": "d2.jsonl"}).step == 6


def test_after_a_resume_none_branch_the_refusal_names_only_another_folder():
    trainer = {"step": 6, "stage": 0, "stage_steps": [6], "config": OLD}
    with pytest.raises(ValueError) as e:
        check_other_run("ck/step_6", "out", trainer, {**OLD, "dataset_path": "d2.jsonl"}, "none")
    assert "--resume none" not in str(e.value) and "another --output_dir" in str(e.value)


@pytest.mark.parametrize("key, old, new", [
    ("rope", None, {"rope_type": "yarn", "factor": 4.0}), ("max_grad_norm", 1.0, 0.5),
    ("loss_weighting", "token", "conversation"), ("mask_cross_document_labels", False, True),
    ("reset_position_ids", False, True), ("bf16", True, False), ("fp16", False, True),
    ("deepspeed", "ds_configs/zero3.json", "ds_configs/zero3_offload.json")])
def test_every_setting_a_resume_applies_is_named_when_it_changed(tmp_path, capsys, key, old, new):
    """These are built from today's config at every stage's start (rope, precision, DeepSpeed JSON, clipping, the
    loss and the packing's positions): a resume took the changes without a note."""
    ck = saved_run(tmp_path, stage_steps=(10,), config={**OLD, key: old})
    ck.resume("auto", "h", "m1", {**OLD, key: new})
    assert f"whose {key} differed" in capsys.readouterr().out


def test_the_same_deepspeed_file_named_from_another_folder_is_no_change(tmp_path, capsys):
    from tests.conftest import ROOT

    ck = saved_run(tmp_path, stage_steps=(10,), config={**OLD, "deepspeed": "ds_configs/zero3.json"})
    ck.resume("auto", "h", "m1", {**OLD, "deepspeed": os.path.join(ROOT, "ds_configs", "zero3.json")})
    assert "differed" not in capsys.readouterr().out


def test_the_seed_note_says_what_keeps_the_saved_seed(tmp_path, capsys):
    """The note said today's seed "applies to a new run", but later stages (samplers, stage seeding) of this run
    take it too (training/stage.py): it now says what keeps the saved seed and what does not."""
    ck = saved_run(tmp_path, stage_steps=(10,))
    ck.resume("auto", "h", "m1", {**OLD, "seed": 7})
    out = capsys.readouterr().out
    assert "written with seed 0: the stage it resumes in keeps it for its data order" in out, out
    assert "every later stage use today's 7" in out and "applies to a new run" not in out, out


BATCH = {**OLD, "per_device_train_batch_size": 1, "gradient_accumulation_steps": 1, "sequence_parallel_size": 1}


def test_a_resume_on_another_data_parallel_size_notes_the_global_batch():
    """A resume with a node excluded (dp 2 -> 1) kept the LR schedule by steps at half the global batch (128 -> 64
    tokens per step in the audit) without a word, while a changed accumulation was named: one note now, with the
    accumulation that keeps the batch where one does (trainer.json's `world` and `sp`, today's world)."""
    trainer = {"step": 3, "stage": 0, "world": 2, "sp": 1, "config": BATCH}
    notes = resume_notes("ck/step_3", BATCH, BATCH, trainer, world=1)
    assert notes == ["note: ck/step_3: global batch 2 -> 1 samples per step (data parallel 2 -> 1); the LR schedule is "
                     "by steps; keep the batch with --gradient_accumulation_steps 2"], notes
    assert resume_notes("ck/step_3", BATCH, BATCH, trainer, world=2) == []  # the same world: nothing
    assert resume_notes("ck/step_3", BATCH, BATCH) == []  # no layout given (the pure settings notes)
    # 16 ranks at SP 8 -> 8 ranks, accumulation 4: the stage's own SP degree counts, and a recipe's "auto" one is
    # taken as the checkpoint's
    ga4 = {**BATCH, "gradient_accumulation_steps": 4}
    for stages in ([{"name": "a", "sequence_parallel_size": 8}], [{"name": "a", "sequence_parallel_size": "auto"}]):
        now = {**ga4, "stages": stages}
        note = batch_note("ck", {"stage": 0, "world": 16, "sp": 8, "config": now}, now, 8)
        assert note.endswith("global batch 8 -> 4 samples per step (data parallel 2 -> 1); the LR schedule is by "
                             "steps; keep the batch with --gradient_accumulation_steps 8"), note


@pytest.mark.parametrize("trainer, now, world, said", [
    ({"stage": 0, "world": 2, "sp": 1, "config": BATCH}, {**BATCH, "gradient_accumulation_steps": 2}, 1, None),  # kept
    ({"stage": 0, "world": 3, "sp": 1, "config": BATCH}, BATCH, 2,  # 3 samples at dp 2: no whole accumulation
     "global batch 3 -> 2 samples per step (data parallel 3 -> 2); the LR schedule is by steps; no whole "
     "--gradient_accumulation_steps gives 3 at micro-batch 1 x data parallel 2"),
    ({"stage": 0, "config": BATCH}, BATCH, 1, None),  # a checkpoint written before world / sp were recorded
    ({"stage": 0, "world": 4, "sp": 2, "config": BATCH}, {**BATCH, "sequence_parallel_size": 4}, 4,  # SP 2 -> 4
     "global batch 2 -> 1 samples per step (data parallel 2 -> 1; sequence parallel 2 -> 4); the LR"),
])
def test_the_batch_note_where_the_batch_is_kept_or_cannot_be(trainer, now, world, said):
    note = batch_note("ck", trainer, now, world)
    assert (note is None) if said is None else (said in note and "\n" not in note), note


def test_checkpointer_resume_prints_the_batch_note(tmp_path, capsys):
    """The note reaches the user: Checkpointer.resume hands batch_note the checkpoint's layout and today's world (1
    here: a checkpoint of world 2)."""
    ga4 = {**BATCH, "gradient_accumulation_steps": 4, "max_steps": 10}
    ck = Checkpointer(str(tmp_path), keep=2)
    ck.save(FakeEngine(), 6, {"step": 6, "tokens": 0, "stage": 0, "model_hash": "h", "config": ga4,
                              "stage_steps": [10], "world": 2, "sp": 1}, {"sampler": {}}, FakeConfig())
    assert ck.resume("auto", "h", "m1", dict(ga4)).step == 6
    out = capsys.readouterr().out
    assert "global batch 8 -> 4 samples per step (data parallel 2 -> 1)" in out, out
    assert "--gradient_accumulation_steps 8" in out, out


def test_an_auto_sp_resolved_otherwise_on_the_nodes_of_a_requeue_notes_the_batch(tmp_path, capsys, monkeypatch):
    """`sequence_parallel_size: auto` is resolved for the nodes a job lands on: a requeue under `-p h100,h200` of a run
    saved on H200s (Llama-3-8B at 1M on 32 ranks: sp 2) resolves sp 4 on H100s at the same world size, dp 16 -> 8,
    the global batch halved mid-stage without a word (the "auto" was taken as the checkpoint's SP). The SP this job
    resolved for the checkpoint's stage (train.py: with_resolved_sp) decides; the note names both."""
    stage = types.SimpleNamespace
    now = {**BATCH, "sequence_parallel_size": "auto", "stages": [{"name": "a"}, {"name": "b"}]}
    trainer = {"stage": 1, "world": 32, "sp": 2, "config": now}
    assert batch_note("ck", trainer, now, 32) is None  # nothing resolved given: as before, the saved SP
    today = with_resolved_sp(now, [stage(sp=8), stage(sp=4)])  # the checkpoint's stage (1) resolved sp 4 here
    assert today[RESOLVED_SP] == [8, 4]
    note = batch_note("ck", trainer, today, 32)
    assert note == ("note: ck: global batch 16 -> 8 samples per step (data parallel 16 -> 8; sequence parallel 2 -> 4 "
                    "(auto, resolved for the GPUs and memory of this job's nodes)); the LR schedule is by steps; keep "
                    "the batch with --gradient_accumulation_steps 2"), note
    assert batch_note("ck", trainer, with_resolved_sp(now, [stage(sp=4), stage(sp=2)]), 32) is None  # sp 2 again
    # through Checkpointer.resume (training/restore.py hands resume_notes today's settings as given; its world, 1 in
    # this process, read as the 32 of the audit's job): one note, and the resolved SP is no changed setting
    ck = Checkpointer(str(tmp_path), keep=2)
    ck.save(FakeEngine(), 6, {"step": 6, "tokens": 0, "stage": 1, "model_hash": "h", "config": now,
                              "stage_steps": [10, 10], "world": 32, "sp": 2}, {"sampler": {}}, FakeConfig())
    notes = restore.resume_notes
    monkeypatch.setattr(restore, "resume_notes", lambda path, saved, got, trainer, world: notes(path, saved, got,
                                                                                                  trainer, 32))
    assert ck.resume("auto", "h", "m1", today).step == 6
    out = capsys.readouterr().out
    assert "data parallel 16 -> 8; sequence parallel 2 -> 4 (auto" in out and "differed" not in out, out


def test_a_stage_key_that_changed_is_named_with_both_values_and_the_fix_mid_stage(tmp_path, capsys):
    """The shipped 128k SFT recipe gained `loss_weighting: conversation` in its stage (2026-11-29): a run resumed
    mid-stage across that pull was told only "stages differed", and --loss_weighting token could not undo it (a
    stage's own beats the flag). The note names the key and both values, says it reaches the stage being resumed, and
    how to keep the old value; fields a newer version writes (None: the run's) are no change."""
    saved, now = {**OLD, "loss_weighting": "token", "stages": [{}]}, {**OLD, "stages": [{"loss_weighting": "conversation"}]}
    trainer = {"step": 4, "stage": 0, "stage_steps": [10], "config": saved}
    out = "\n".join(resume_notes("ck", saved, now, trainer))
    assert "stage 0 (stage0) loss_weighting token -> conversation" in out, out
    assert "stage 0 (stage0) changes mid-stage, ck being inside it" in out and "from step 5" in out, out
    assert "`loss_weighting: token`" in out, out
    assert "beats --loss_weighting" in out, out
    trainer["step"] = 10  # the stage's end: the next stage starts as today's settings say
    assert "mid-stage" not in "\n".join(resume_notes("ck", saved, now, trainer))
    # a key a flag sets for every stage is named with that flag; a field written by a newer version is no change
    lr = resume_notes("ck", {**OLD, "stages": [{"learning_rate": None}]}, {**OLD, "stages": [{"learning_rate": 5e-4}]},
                      {"step": 1, "stage": 0, "stage_steps": [10]})
    assert "learning_rate 0.001 -> 0.0005" in lr[0] and "--learning_rate would set every stage's" in lr[1], lr
    assert resume_notes("ck", {**OLD, "stages": [{"name": "a"}]}, {**OLD, "stages": [{"name": "a", "kind": None}]}) == []


def test_an_exact_layout_is_told_to_the_stage_counts(tmp_path):
    """Checkpointer.resume records whether today's job runs the checkpoint's stage on its world, SP, micro-batch,
    accumulation and length (training/curriculum_resume.keep_stage_steps keeps the planned count of an epoch-sized stage
    there: a count that differs is this version's counting rule)."""
    from training.resume_notes import same_layout

    conf = {**BATCH, "gradient_accumulation_steps": 3, "max_seq_length": 2048, "max_steps": 100}
    trainer = {"step": 5, "stage": 0, "world": 1, "sp": 1, "config": conf}
    assert same_layout(trainer, dict(conf), 1) is True
    assert same_layout(trainer, dict(conf), 2) is False
    assert same_layout(trainer, {**conf, "gradient_accumulation_steps": 1}, 1) is False
    assert same_layout(trainer, {**conf, "max_seq_length": 4096}, 1) is False
    assert same_layout({k: v for k, v in trainer.items() if k != "sp"}, dict(conf), 1) is None  # older: not known
    ck = Checkpointer(str(tmp_path), keep=2)
    ck.save(FakeEngine(), 5, {**trainer, "tokens": 0, "model_hash": "h", "stage_steps": [18], "stage_sizes": ["epochs:2"]},
            {"sampler": {}}, FakeConfig())
    assert ck.resume("auto", "h", "m1", dict(conf)).same_layout is True


def test_a_packing_rule_change_is_said_as_this_versions_not_as_changed_data():
    """The permuted SFT packing (2026-11-30) read as "the data changed since ..." though the user's data had not: the
    code's rule had. The same facts, worded as the packing rule's change; a count that moved is named beside it."""
    from training.resume_notes import moved_note

    rule = "base.packing best-fit-decreasing in stream order -> best-fit-decreasing, permuted (the same indices name " \
           "other samples)"
    note = moved_note("ck", [rule])
    assert note.startswith("note: this version packs the conversations into samples by another rule than the one "
                           "that wrote ck (base.packing best-fit-decreasing in stream order -> best-fit-decreasing, "
                           "permuted)"), note
    assert "data changed" not in note and "the same indices name other samples" in note, note
    assert "beside it num_samples 40 -> 38" in moved_note("ck", [rule, "num_samples 40 -> 38"])
    assert moved_note("ck", ["num_samples 20 -> 24"]).startswith("note: the data changed since ck (num_samples 20 -> 24)")
