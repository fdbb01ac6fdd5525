"""Each stage's RoPE setting reaches the rotary embedding of the model on every rank under ZeRO-3, and the
inverse frequencies / attention factor follow the published formulas (checked at every frequency)."""

from __future__ import annotations

import math
import os

import pytest
import torch

from model_utils.rope import check_rope
from tests.distributed import ROOT
from tests.multiproc.joint_launch import WORLD2

pytestmark = pytest.mark.dist
D = 32  # tiny-llama head_dim = 128 / 4
BASE = 10000.0
ORIG = 4096
CASES = {
    "abf": {"rope_type": "default", "rope_theta": 500000.0},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": ORIG},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": ORIG},
}


def default_inv_freq(theta=BASE):
    return [theta ** (-2 * i / D) for i in range(D // 2)]


def llama3_inv_freq(factor=8.0, low=1.0, high=4.0):
    # Llama 3.1 (Meta's reference code): keep high frequencies, divide low ones by `factor`, blend between
    out = []
    for f in default_inv_freq():
        wavelen = 2 * math.pi / f
        if wavelen < ORIG / high:
            out.append(f)
        elif wavelen > ORIG / low:
            out.append(f / factor)
        else:
            s = (ORIG / wavelen - low) / (high - low)
            out.append((1 - s) * f / factor + s * f)
    return out


# the worker's run joins the fast modules' shared 2-rank launch (tests/multiproc/joint_launch.py)
WORLD2.join("rope", __name__, "tests/workers/rope.py",
            lambda assets, factory, d: {"model": assets["llama_gqa"], "cases": CASES, "out": str(d / "rope.pt"),
                                        "deepspeed": os.path.join(ROOT, "ds_configs/zero3_offload.json")},
            ("test_a_stage_engine_is_freed_when_released", "test_same_on_every_rank", "test_abf_raises_theta",
             "test_linear_interpolation_divides_every_frequency", "test_dynamic_ntk_starts_from_default",
             "test_yarn_interpolates_low_keeps_high_and_scales_attention", "test_llama3_scaling_follows_reference_formula"))


@pytest.fixture(scope="module")
def rotary(assets, tmp_path_factory):
    return torch.load(WORLD2.launched("rope", assets, tmp_path_factory)["out"])


def close(a, b, rel=1e-6):
    return all(abs(x - y) <= rel * abs(y) for x, y in zip(a, b)) and len(a) == len(b)


def test_a_stage_engine_is_freed_when_released(rotary):
    """Every engine (model and optimizer: ZeRO-3 partitions, CPU Adam's fp32 master and moments) is freed when its
    stage releases it. DeepSpeed keeps the top module on a module-level list (FWD_MODULE_STACK): before
    release_engine each stage's engine stayed alive, +2.5 GiB of host memory per stage for a 147M model here."""
    assert rotary["_released"] and all(all(r) for r in rotary["_released"]), rotary["_released"]


@pytest.mark.parametrize("name", list(CASES))
def test_same_on_every_rank(rotary, name):
    ranks = rotary[name]
    assert len(ranks) == 2 and ranks[0] == ranks[1]
    assert ranks[0]["rope_type"] == CASES[name]["rope_type"]


def test_abf_raises_theta(rotary):
    assert close(rotary["abf"][0]["inv_freq"], default_inv_freq(500000.0))
    assert rotary["abf"][0]["attention_scaling"] == 1.0


def test_linear_interpolation_divides_every_frequency(rotary):
    assert close(rotary["linear"][0]["inv_freq"], [f / 4.0 for f in default_inv_freq()])


def test_dynamic_ntk_starts_from_default(rotary):
    # dynamic NTK rescales theta only once a sequence exceeds the original length, at run time
    assert close(rotary["dynamic"][0]["inv_freq"], default_inv_freq())


def test_yarn_interpolates_low_keeps_high_and_scales_attention(rotary):
    got = rotary["yarn"][0]
    ref = default_inv_freq()
    assert math.isclose(got["attention_scaling"], 0.1 * math.log(8.0) + 1.0, rel_tol=1e-6)  # YaRN's mscale
    assert math.isclose(got["inv_freq"][0], ref[0], rel_tol=1e-6)  # wavelength << original: extrapolate
    assert math.isclose(got["inv_freq"][-1], ref[-1] / 8.0, rel_tol=1e-6)  # wavelength >> original: interpolate
    assert all(ref[i] / 8.0 * (1 - 1e-6) <= got["inv_freq"][i] <= ref[i] * (1 + 1e-6) for i in range(D // 2))


def test_llama3_scaling_follows_reference_formula(rotary):
    assert close(rotary["llama3"][0]["inv_freq"], llama3_inv_freq())
    assert rotary["llama3"][0]["attention_scaling"] == 1.0


@pytest.mark.parametrize("rope, match", [
    ({"rope_type": "ntk-by-parts"}, "not supported"),
    ({"rope_type": "llama3", "factor": 8.0}, "needs"),
    ({"rope_type": "linear", "factor": 0.5}, "factor must be >= 1"),
    ({"rope_type": "default", "rope_theta": -1}, "rope_theta must be > 0"),
])
def test_bad_rope_settings(rope, match):
    with pytest.raises(ValueError, match=match):
        check_rope(rope, "stage 1")


def test_dynamic_is_refused_under_sequence_parallelism():
    """transformers' dynamic NTK scales from the largest position in each rank's own forward: under Ulysses the
    ranks hold different shards of one sequence and would rotate it with different frequencies."""
    from training.config import Config, StageConfig
    from training.curriculum import check_stages, resolve_stages

    dynamic = {"rope_type": "dynamic", "factor": 4.0}
    check_rope(dynamic, "stage 0", sp=1)
    with pytest.raises(ValueError, match="use yarn or linear, or sequence_parallel_size 1"):
        check_rope(dynamic, "stage 0", sp=2)
    cfg = Config(stages=[StageConfig(name="short", max_seq_length=64, sequence_parallel_size=1, rope=dynamic),
                         StageConfig(name="long", max_seq_length=128, sequence_parallel_size=2, rope=dynamic)])
    stages = resolve_stages(cfg, dp_of_sp=lambda sp: 2 // sp)
    with pytest.raises(ValueError, match=r"^stage 1 \(long\): rope: rope_type dynamic .*sequence_parallel_size 2") as e:
        check_stages(stages, world=2, num_heads=4, num_kv_heads=2)
    assert "\n" not in str(e.value)
    check_stages(stages[:1], world=2, num_heads=4, num_kv_heads=2)  # SP 1: fine


def test_a_dynamic_model_without_stage_rope_is_refused_under_sp():
    """A model whose own config.json says dynamic keeps it in a stage without `rope`: the same refusal."""
    from training.config import Config, StageConfig
    from training.curriculum import check_stages, resolve_stages

    cfg = Config(stages=[StageConfig(name="s", max_seq_length=128, sequence_parallel_size=2)])
    stages = resolve_stages(cfg, dp_of_sp=lambda sp: 2 // sp)
    check_stages(stages, world=2, num_heads=4, num_kv_heads=2, model={"rope_type": "default", "rope_theta": 1e4})
    with pytest.raises(ValueError, match=r"^stage 0 \(s\): the model's rope_parameters: rope_type dynamic"):
        check_stages(stages, world=2, num_heads=4, num_kv_heads=2, model={"rope_type": "dynamic", "factor": 2.0})
