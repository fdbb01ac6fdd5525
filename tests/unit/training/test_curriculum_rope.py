"""What a stage without `rope:` runs (training/curriculum.resolve_stages): the previous stage's RoPE, the first stage
the run's `rope`, else the model's; `rope: {}` the model's own. Said at plan time, and on a resume whose checkpoint
trained such a stage under the older rule (the model's RoPE). A warmup as long as the stage is noted. No launch:
tiny transformers configs, the rotary frequencies transformers computes from them (auditE3 findings 1 and 6); a
resume inside such a stage keeps the RoPE its checkpoint trained with to the stage's end."""

from __future__ import annotations

import json
import types

from transformers import AutoConfig

from model_utils.rope import apply_rope
from training.config import Config, StageConfig
from training.curriculum import check_stages, resolve_stages
from training.curriculum_resume import check_resumed_stages

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
            vocab_size=128, pad_token_id=0, eos_token_id=1, bos_token_id=2, rope_theta=10000.0)
ABF = {"rope_type": "default", "rope_theta": 40000.0}


def _llama():
    return AutoConfig.for_model("llama", **TINY, max_position_embeddings=1024)


def _stages(*stages, **run):
    return resolve_stages(Config(max_steps=4, **run, stages=list(stages)), dp_of_sp=lambda sp: 1)


def _theta(stage) -> float:
    c = _llama()
    apply_rope(c, stage.rope, stage.max_seq_length)  # what training/stage.py builds each stage's engine with
    return c.rope_parameters["rope_theta"]


def test_a_stage_without_rope_keeps_the_previous_stages(capsys):
    """The audit's r3.yaml: a 1000 (none), b 2000 (ABF 40000), c 4000 (none): c trained and exported with the base
    theta 10000 again (the SFT stage after a recipe's ABF stages fine-tuned with the base RoPE); now c keeps 40000,
    the plan says whose it is, and `rope: {}` goes back to the model's own."""
    a, b, c, d = _stages(StageConfig(name="a", max_seq_length=1000), StageConfig(name="b", max_seq_length=2000, rope=ABF),
                         StageConfig(name="c", max_seq_length=4000), StageConfig(name="d", max_seq_length=4000, rope={}))
    assert [_theta(s) for s in (a, b, c, d)] == [10000.0, 40000.0, 40000.0, 10000.0]
    assert (a.rope, c.rope, c.rope_from, d.rope) == (None, ABF, 1, None)
    check_stages([a, b, c, d], world=1, num_heads=4, num_kv_heads=2, model=_llama())
    out = capsys.readouterr().out
    assert "note: stage 2 (c) has no rope of its own: it keeps stage 1 (b)'s" in out and "stage 3 (d) has no" not in out
    # the first stage: the run's rope, which the later ones keep until a stage gives its own
    x, y = _stages(StageConfig(name="x", max_seq_length=1000), StageConfig(name="y", max_seq_length=2000),
                   rope={"rope_type": "default", "rope_theta": 20000.0})
    assert [_theta(s) for s in (x, y)] == [20000.0, 20000.0] and x.rope_from is None is y.rope_from


def test_a_resume_mid_stage_keeps_the_rope_the_stage_trained_with(tmp_path, capsys):
    """A checkpoint written inside c by the code before this rule holds the base theta in its hf_config.json (an
    upgrade audit: s512b, after a yarn stage, stopped mid-stage on the code of 2026-11-29). Resumed today, c's rest
    switched to b's 40000 with a note only (losses 1.29 1.26 0.71 3.32 -> 0.04 0.33 0.26 1.28); now c keeps 10000 to
    its end, said in one line, and the stage after it (d, no rope) takes today's rule (b's)."""
    import dataclasses

    import pytest

    from training.curriculum_resume import keep_stage_steps
    from training.restore import trained_rope

    stages = _stages(StageConfig(name="a", max_seq_length=1000, max_steps=3),
                     StageConfig(name="b", max_seq_length=2000, max_steps=2, rope=ABF),
                     StageConfig(name="c", max_seq_length=4000, max_steps=4),
                     StageConfig(name="d", max_seq_length=4000, max_steps=4))
    ck = tmp_path / "step_6"
    ck.mkdir()
    (ck / "hf_config.json").write_text(json.dumps({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}))
    state = types.SimpleNamespace(checkpoint=str(ck), stage=2, step=6, stage_names=["a", "b", "c"], stage_steps=[3, 2, 4],
                                  trained_rope=trained_rope(str(ck)))  # rank 0's read at resume (training/restore.py)
    check_resumed_stages(stages, state)
    kept = keep_stage_steps(stages, state)
    out = capsys.readouterr().out
    assert [_theta(s) for s in kept] == [10000.0, 40000.0, 10000.0, 40000.0]
    assert out.count("\n") == 1 and "trained stage 2 (c) with RoPE" in out and "keeps it to the stage's end" in out, out
    assert "stage 1 (b)'s {'rope_type': 'default', 'rope_theta': 40000.0}" in out, out
    state.trained_rope = ABF  # trained under today's rule: nothing to keep, nothing to say
    assert [_theta(s) for s in keep_stage_steps(stages, state)] == [10000.0, 40000.0, 40000.0, 40000.0]
    state.step, state.trained_rope = 9, {"rope_type": "default", "rope_theta": 10000.0}  # c's end: d as today's
    assert [_theta(s) for s in keep_stage_steps(stages, state)] == [10000.0, 40000.0, 40000.0, 40000.0]
    assert capsys.readouterr().out == ""
    # one this version cannot keep at the stage's SP (dynamic NTK at sp 2): refused in one line at the resume's check
    state.step, state.trained_rope = 6, {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    wide = [*stages[:2], dataclasses.replace(stages[2], sp=2), stages[3]]
    with pytest.raises(ValueError) as e:
        check_resumed_stages(wide, state)
    assert "\n" not in str(e.value) and "--resume checkpoints/STAGE_1_b" in str(e.value), e.value


def test_a_warmup_as_long_as_the_stage_is_noted(capsys):
    """r1.yaml: max_steps 3, warmup_steps 10: the stage ended at 30% of its peak LR, never decayed, unsaid."""
    _stages(StageConfig(name="short", max_steps=3), StageConfig(name="long", max_steps=40), warmup_steps=10)
    out = capsys.readouterr().out
    assert "note: stage 0 (short): warmup_steps 10 >= its 3 steps: its LR rises to 30% of" in out, out
    assert "stage 1" not in out


def test_a_constant_stage_gets_no_warmup_note(capsys):
    """tiny_cpu_sft's `before` stage: learning_rate == min_lr is constant by design, nothing to decay or note."""
    _stages(StageConfig(name="before", max_steps=1, learning_rate=1e-5, min_lr=1e-5),
            StageConfig(name="sft", max_steps=40), warmup_steps=1)
    assert "warmup_steps" not in capsys.readouterr().out
