"""RoPE positions past 2**24: transformers' rotary embedding (as vLLM's and Meta's reference) multiplies
position.float() by inv_freq in float32, which stops telling positions apart there (16,777,217 rounds to 16,777,216).
A RoPE model's stage longer than that is refused at start-up (training/curriculum.check_stages through
model_utils/rope.short_scaling) and at its build (apply_rope); the planner plans no longer length
(tests/unit/planner/test_rope_cap.py). Before: a 17.6M-token stage (the planner's 32-GPU headline) was accepted."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from model_utils.rope import apply_rope, check_positions
from planner.shapes import ROPE_MAX_POSITIONS
from training.config import Config, StageConfig
from training.curriculum import check_stages, resolve_stages

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
            vocab_size=128, pad_token_id=0, eos_token_id=1, bos_token_id=2)


def test_float32_positions_collapse_past_two_to_the_24():
    pos = torch.arange(ROPE_MAX_POSITIONS - 2, ROPE_MAX_POSITIONS + 4, dtype=torch.int64).float()
    assert pos[:3].unique().numel() == 3 and pos[2:].unique().numel() < 4  # distinct up to 2**24, not past it


def _stages(length: int, **eval_block):
    return resolve_stages(Config(stages=[StageConfig(name="s", max_seq_length=length, sequence_parallel_size=2,
                                                     eval=eval_block or None)]), dp_of_sp=lambda sp: 2 // sp)


def test_a_stage_past_two_to_the_24_tokens_is_refused_at_start_up():
    llama = {"rope_type": "default", "rope_theta": 5e5}
    check_stages(_stages(ROPE_MAX_POSITIONS), world=2, num_heads=4, num_kv_heads=2, model=llama)  # exactly 2**24: ok
    with pytest.raises(ValueError, match=r"^stage 0 \(s\): max_seq_length 16,777,218: positions >= 16,777,216 "
                                         r"collapse in float32 RoPE .*at most 16,777,216 tokens a sample$"):
        check_stages(_stages(ROPE_MAX_POSITIONS + 2), world=2, num_heads=4, num_kv_heads=2, model=llama)
    check_positions({}, ROPE_MAX_POSITIONS + 2)  # a model without RoPE: no positions to collapse


def test_apply_rope_refuses_it_too():
    c = AutoConfig.for_model("llama", **TINY, rope_theta=5e5, max_position_embeddings=8192)
    with pytest.raises(ValueError, match="positions >= 16,777,216 collapse"):
        apply_rope(c, {"rope_type": "default", "rope_theta": 8e6}, ROPE_MAX_POSITIONS + 1)


def test_an_eval_length_past_two_to_the_24_is_refused_at_start_up():
    """A 32M passkey length after a 16M stage (training accepted it) scored collapsed positions; refused like the
    stage's own length. A model without RoPE and a length at the cap pass."""
    llama = {"rope_type": "default", "rope_theta": 5e5}
    ok = _stages(4096, lengths=[4096, ROPE_MAX_POSITIONS])
    check_stages(ok, world=2, num_heads=4, num_kv_heads=2, model=llama)
    far = _stages(4096, lengths=[4096, 2 * ROPE_MAX_POSITIONS])
    with pytest.raises(ValueError, match=r"^stage 0 \(s\): evaluates at 33,554,432 tokens \(eval.lengths / "
                                         r"--eval_lengths\): positions >= 16,777,216 collapse .*up to 16,777,216$"):
        check_stages(far, world=2, num_heads=4, num_kv_heads=2, model=llama)
    check_stages(far, world=2, num_heads=4, num_kv_heads=2, model={})  # no RoPE: nothing collapses
