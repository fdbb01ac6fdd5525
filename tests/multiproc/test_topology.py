"""Resuming under another layout. Same world, other SP degree: loads directly (checkpoint files are named by
world rank). Other world size: converted to DeepSpeed's universal checkpoint, which carries weights and
Adam moments; with the same DP degree the data order is unchanged, so losses continue as uninterrupted
(up to reduction-order rounding: 1e-4)."""

from __future__ import annotations

import pytest

from tests.distributed import run
from tests.runs import TRAIN, losses, preempt_after, train_args

pytestmark = pytest.mark.dist


def _ref(assets, tmp, sp, nproc):
    run(TRAIN, train_args(assets, tmp / "ref", sp, steps=6), nproc, str(tmp / "ref_logs"))
    return losses(tmp / "ref")


@pytest.mark.parametrize("before, after", [((2, 2), (1, 1)), ((1, 1), (2, 2))], ids=["world2to1", "world1to2"])
def test_world_size_change_carries_optimizer_state(assets, tmp_path, before, after):
    ref = _ref(assets, tmp_path, *before)
    out = tmp_path / "out"
    k = preempt_after(train_args(assets, out, before[0], steps=6), before[1], out, str(tmp_path / "l1"), 2)
    run(TRAIN, train_args(assets, out, after[0], steps=6), after[1], str(tmp_path / "l2"))
    log = (tmp_path / "l2" / "rank0.log").read_text()
    assert "converting it to a DeepSpeed universal checkpoint" in log and f"resuming from {out}" in log
    got = losses(out)
    assert sorted(got) == list(range(1, 7)) and k < 6
    for s in range(k + 1, 7):
        assert abs(got[s] - ref[s]) <= 1e-4 * ref[s], (s, got[s], ref[s])


def test_same_world_other_sp_degree_loads(assets, tmp_path):
    """sp 2 x dp 1 with 2 samples per micro-batch -> sp 1 x dp 2 with 1: each step still sees the same two
    samples, so after loading directly (no conversion) the losses continue as the uninterrupted run's."""
    mb2, mb1 = ["--per_device_train_batch_size", "2"], ["--per_device_train_batch_size", "1"]
    run(TRAIN, train_args(assets, tmp_path / "ref", 2, steps=6, extra=mb2), 2, str(tmp_path / "ref_logs"))
    ref = losses(tmp_path / "ref")
    out = tmp_path / "out"
    k = preempt_after(train_args(assets, out, 2, steps=6, extra=mb2), 2, out, str(tmp_path / "l1"), 2)
    run(TRAIN, train_args(assets, out, 1, steps=6, extra=mb1), 2, str(tmp_path / "l2"))
    log = (tmp_path / "l2" / "rank0.log").read_text()
    assert f"resuming from {out}/checkpoints/step_{k:06d}" in log and "universal" not in log
    got = losses(out)
    assert sorted(got) == list(range(1, 7)) and k < 6
    for s in range(k + 1, 7):
        assert abs(got[s] - ref[s]) <= 1e-4 * ref[s], (s, got[s], ref[s])


def test_other_model_is_refused_clearly(assets, tmp_path):
    out = tmp_path / "out"
    run(TRAIN, train_args(assets, out, 1, steps=2), 1, str(tmp_path / "l1"))
    args = train_args(assets, out, 1, steps=4)
    args[args.index("--model_name_or_path") + 1] = assets["qwen2_kv1"]
    run(TRAIN, args, 1, str(tmp_path / "l2"), expect=2)
    assert "written for a different model architecture" in (tmp_path / "l2" / "rank0.log").read_text()
