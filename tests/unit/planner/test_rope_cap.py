"""The planner plans no sample past 2**24 tokens (planner/shapes.ROPE_MAX_POSITIONS: float32 RoPE positions collapse
there; a run refuses such a stage, tests/unit/model_utils/test_rope_positions.py). Before: `plan.py --compare` gave
17,580,160 tokens as the 32-GPU longest, a length no run could train with positions it tells apart."""

from __future__ import annotations

import importlib.util
import os

from planner.memory_model import Features, load_shape
from planner.shapes import ROPE_MAX_POSITIONS
from planner.step_time import TRAINABLE_S, longest_within

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), *[os.pardir] * 3))
_spec = importlib.util.spec_from_file_location("plan", os.path.join(ROOT, "scripts", "plan.py"))
plan = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plan)


def test_the_longest_lengths_stop_at_two_to_the_24():
    rows = plan.compare()
    assert max(r["longest"] for r in rows) == ROPE_MAX_POSITIONS == 16_777_216  # the 32-GPU row fits more memory-wise
    assert all(r["within_15_min"] <= ROPE_MAX_POSITIONS for r in rows)
    out = plan.render_compare(rows)
    assert "16,777,216 (RoPE cap)" in out and "float32 RoPE positions collapse past it" in out
    # a step-time bound alone (a tiny model, one hour) stops there too
    tiny = load_shape("llama3-8b").__class__(**{**vars(load_shape("llama3-8b")), "num_layers": 1})
    assert longest_within(100 * TRAINABLE_S, tiny, 64, Features(), world=64, ranks_per_node=8) <= ROPE_MAX_POSITIONS
