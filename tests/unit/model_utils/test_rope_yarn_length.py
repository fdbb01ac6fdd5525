"""A yarn stage's config says the length it extends to (model_utils/rope.apply_rope): max_position_embeddings =
factor x original_max_position_embeddings, as the export writes it. Before, the in-run config and every checkpoint's
hf_config.json kept the base's 131072 beside factor 2 over 256, and transformers warned at each config built from
them ("The explicitly set RoPE scaling factor ... does not match the ratio implicitly set", 6 times in `make
demo`). The rotation is what it was: YaRN reads the explicit factor, so the frequencies and the attention scaling
are the same as with the base's length."""

from __future__ import annotations

import pytest
import torch
from transformers import modeling_rope_utils
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from model_utils.build import preset_config
from model_utils.rope import apply_rope

YARN = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 256}


def _warnings(monkeypatch) -> list[str]:
    said: list[str] = []
    monkeypatch.setattr(modeling_rope_utils.logger, "warning_once", lambda msg, *a, **k: said.append(str(msg)))
    monkeypatch.setattr(modeling_rope_utils.logger, "warning", lambda msg, *a, **k: said.append(str(msg)))
    return said


@pytest.mark.parametrize("factor, seq", [(2.0, 512), (4.0, 1024), (8.0, 2048)])
def test_a_yarn_stage_says_its_length_and_rotates_as_before(monkeypatch, factor, seq):
    """tiny_cpu_extend's stages (base tiny_passkey256: max_position_embeddings 131072, yarn over 256)."""
    rope = {**YARN, "factor": factor}
    c = preset_config("tiny-llama")
    said = _warnings(monkeypatch)
    apply_rope(c, rope, seq)  # its start-up check builds the stage's config too (stage_rope's _accepted)
    assert c.max_position_embeddings == int(256 * factor) == seq
    rebuilt = type(c)(**c.to_dict())  # what a checkpoint's hf_config.json and the export load: no warning
    assert not [m for m in said if "RoPE scaling factor" in m], said
    # the same rotation as the base's length gave: inverse frequencies and attention scaling
    old = preset_config("tiny-llama")
    old.rope_parameters = dict(c.rope_parameters)  # what apply_rope set before, with the base's 131072
    assert old.max_position_embeddings == 131072
    new_f, new_s = ROPE_INIT_FUNCTIONS["yarn"](rebuilt, "cpu")
    old_f, old_s = ROPE_INIT_FUNCTIONS["yarn"](old, "cpu")
    assert torch.equal(new_f, old_f) and new_s == old_s


def test_a_scaling_shorter_than_the_stage_keeps_the_stages_length():
    """A yarn reaching fewer positions than the stage (said as a note by short_scaling) never shrinks the table below
    the stage's length; ABF keeps the base's length."""
    c = preset_config("tiny-llama")
    apply_rope(c, YARN, 1024)
    assert c.max_position_embeddings == 1024
    c = preset_config("tiny-llama")
    apply_rope(c, {"rope_type": "default", "rope_theta": 40000.0}, 2048)
    assert c.max_position_embeddings == 131072
