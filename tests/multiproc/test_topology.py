"""Resuming under another layout. Same world, other SP degree: loads directly (checkpoint files are named by
world rank). Other world size: converted to DeepSpeed's universal checkpoint, which carries weights and
Adam moments; with the same DP degree the data order is unchanged, so losses continue as uninterrupted
(up to reduction-order rounding: 1e-4). A conversion is keyed by its source's content: a branch's new checkpoint
under an old name is converted again. A rank that cannot see the conversion's files yet (another node, a stale view)
looks them up again instead of failing. The model of the world-size change carries a persistent buffer (a GLM-4.5-style
router's `e_score_correction_bias`, not zero): DeepSpeed's universal load restores parameters only, and it came back
as zeros (training/buffers.py)."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tests.conftest import write_token_jsonl
from tests.distributed import ROOT, run
from tests.runs import TRAIN, losses, preempt_after, train_args
from training.checkpoint import tag_for
from training.universal import source_id

LATE_S = 6  # rank 1 sees the conversion's files this long after its first look (a node's cached negative lookup)

pytestmark = pytest.mark.dist


def _ref(assets, tmp, sp, nproc, model=None):
    args = train_args(assets, tmp / "ref", sp, steps=6)
    if model:
        args[args.index("--model_name_or_path") + 1] = model
    run(TRAIN, args, nproc, str(tmp / "ref_logs"))
    return losses(tmp / "ref")


BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"


def _router_bias_model(assets) -> str:
    """A tiny GLM-4.5-style MoE (layer 1 routed) whose router bias is not its initial zeros; made once a session."""
    import torch
    from transformers import AutoModelForCausalLM, Glm4MoeConfig

    path = os.path.join(assets["dir"], "glm4_moe_bias")
    if not os.path.isdir(path):
        torch.manual_seed(0)
        cfg = Glm4MoeConfig(vocab_size=2048, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                            n_group=1, topk_group=1, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        model.model.layers[1].mlp.gate.e_score_correction_bias.copy_(torch.tensor([0.5, -0.5, 0.25, -0.25]))
        model.save_pretrained(path)
    return path


@pytest.mark.parametrize("before, after", [pytest.param((2, 2), (1, 1), marks=pytest.mark.slow),  # ~110 s
                                           pytest.param((1, 1), (2, 2), marks=pytest.mark.slow)],
                         ids=["world2to1", "world1to2"])  # 1 -> 2: 83 s, make test-slow
def test_world_size_change_carries_optimizer_state(assets, tmp_path, before, after):
    import torch

    model = _router_bias_model(assets)

    def args(sp):
        a = train_args(assets, out, sp, steps=6)
        a[a.index("--model_name_or_path") + 1] = model
        return a

    ref = _ref(assets, tmp_path, *before, model=model)
    out = tmp_path / "out"
    k = preempt_after(args(before[0]), before[1], out, str(tmp_path / "l1"), 2)
    # 1 -> 2: rank 1 (another node) sees the files rank 0 just converted only LATE_S after it first looks for them
    late = {"PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT}/tests/stubs/stale_view", "STALE_VIEW_RANK": "1",
            "STALE_VIEW_LATE": r"/universal/[0-9a-f]{24}/step_\d+/.+\.pt$", "STALE_VIEW_LATE_S": str(LATE_S)}
    run(TRAIN, args(after[0]), after[1], str(tmp_path / "l2"), extra_env=late if after[1] == 2 else None)
    log = (tmp_path / "l2" / "rank0.log").read_text()
    assert "converting it to a DeepSpeed universal checkpoint" in log and f"resuming from {out}" in log
    if after[1] == 2:  # the view really was late, and rank 1 waited instead of failing
        assert "did not see yet" in (out / "logs" / "rank00001.log").read_text()
    got = losses(out)
    assert sorted(got) == list(range(1, 7)) and k < 6
    for s in range(k + 1, 7):
        assert abs(got[s] - ref[s]) <= 1e-4 * ref[s], (s, got[s], ref[s])
    # the router bias the resumed run saved at its end is the model's, not the zeros it was built with
    states = torch.load(out / "checkpoints" / tag_for(6) / "zero_pp_rank_0_mp_rank_00_model_states.pt",
                        weights_only=False)
    assert states["module"][BIAS].tolist() == [0.5, -0.5, 0.25, -0.25], states["module"][BIAS]


@pytest.mark.slow  # 116 s on loaded cores; every curriculum stage that changes SP loads across it (test_curriculum.py)
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


@pytest.mark.slow  # ~50 s
def test_other_model_is_refused_clearly(assets, tmp_path):
    out = tmp_path / "out"
    run(TRAIN, train_args(assets, out, 1, steps=2), 1, str(tmp_path / "l1"))
    args = train_args(assets, out, 1, steps=4)
    args[args.index("--model_name_or_path") + 1] = assets["qwen2_kv1"]
    run(TRAIN, args, 1, str(tmp_path / "l2"), expect=2)
    assert "written for a different model architecture" in (tmp_path / "l2" / "rank0.log").read_text()


@pytest.mark.slow
def test_a_branch_is_converted_again_not_loaded_through_the_old_conversion(assets, tmp_path):
    """Issue 32's run: 2 ranks save steps 2 and 4; 1 rank resumes (step 4 converted); 1 rank branches from step 2 on
    another corpus and saves a new step 4; 2 ranks resume from it. The new step 4 is converted (the old branch's
    conversion carried the old weights and Adam state: step 5's loss differed by 5e-3) and step 5's loss equals
    that of the same checkpoint resumed on 1 rank. The abort channel's stall limit is lowered below the
    conversion's time: the ranks waiting for rank 0's conversion are not taken for dead."""
    out, save2 = tmp_path / "out", ["--save_steps", "2", "--save_total_limit", "4"]
    run(TRAIN, train_args(assets, out, 2, steps=4, extra=save2), 2, str(tmp_path / "l1"))
    run(TRAIN, train_args(assets, out, 1, steps=5, extra=save2), 1, str(tmp_path / "l2"))
    assert "converting it to a DeepSpeed universal checkpoint" in (tmp_path / "l2" / "rank0.log").read_text()
    other = write_token_jsonl(str(tmp_path / "other.jsonl"), seed=1)
    branch = train_args(assets, out, 1, steps=4, extra=[*save2, "--resume", str(out / "checkpoints" / tag_for(2))])
    branch[branch.index("--dataset_path") + 1] = other
    run(TRAIN, branch, 1, str(tmp_path / "l3"))
    shutil.copytree(out, tmp_path / "same_world")

    def resume(where, sp, nproc, logs, env=None):
        args = train_args(assets, where, sp, steps=5, extra=save2)
        args[args.index("--dataset_path") + 1] = other
        run(TRAIN, args, nproc, str(tmp_path / logs), extra_env=env)
        return losses(where)[5]

    stall_s = 3.0
    watch = {"PYTHONPATH": f"{ROOT}/tests/stubs/faults{os.pathsep}{ROOT}", "WATCH": f"0.5:{stall_s}:20"}
    got = resume(out, 2, 2, "l4", watch)
    assert "converting it to a DeepSpeed universal checkpoint" in (tmp_path / "l4" / "rank0.log").read_text()
    done = json.loads((out / "universal" / source_id(str(out / "checkpoints" / tag_for(4))) / "DONE").read_text())
    assert done["seconds"] > stall_s  # the others waited longer than the stall limit, and were not stopped
    ref = resume(tmp_path / "same_world", 1, 1, "l5")
    assert abs(got - ref) <= 1e-4 * ref, (got, ref)
