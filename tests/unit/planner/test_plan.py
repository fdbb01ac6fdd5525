"""Pure unit tests of the memory model and the planner (no torch, no processes; well under a second)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from planner.flops import flops_per_sequence, tokens_per_sec_per_gpu
from planner.memory_model import (
    Features,
    GiB,
    ModelShape,
    estimate,
    eval_phase_bytes,
    eval_phases,
    eval_tile_rows,
    layer_activations,
    load_shape,
    parse_seq_len,
    predict_peak_bytes,
)

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), *[os.pardir] * 3))
_spec = importlib.util.spec_from_file_location("plan", os.path.join(ROOT, "scripts", "plan.py"))
plan = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plan)

# round numbers so every term below can be checked by hand
TOY = ModelShape(vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                 num_kv_heads=4, head_dim=16)
ALL_ACT = {"tiled_mlp", "tiled_logits", "gradient_checkpointing", "offload_activations"}


def test_param_count_by_hand():
    # layer: q,k,v 64*16*12 + o 64*64 + mlp 3*64*128 + norms 2*64
    assert TOY.layer_params() == 12288 + 4096 + 24576 + 128 == 41088
    # untied embedding + head, 2 layers, final norm
    assert TOY.num_params() == 2 * 64000 + 2 * 41088 + 64 == 210240
    assert load_shape("llama3-8b").num_params() == 8_030_261_248  # the published Llama-3-8B count


def test_breakdown_by_hand_no_features():
    est = estimate(TOY, seq_len=100, sp=1, world=2, features=Features(), precision="bf16")
    n = 210240
    assert est.gpu["params (partition)"] == n * 2 // 2
    assert est.gpu["grads (partition)"] == n * 2 // 2
    assert est.gpu["optimizer fp32 master+Adam m,v"] == 12 * n // 2
    assert est.gpu["zero3 gathered params+grads, buckets"] == 2 * (2 * 64000 + 2 * 64 * 64)
    # per layer saved: 2 RMSNorms x (fp32 input + normalized + output) [100,64], q,k,v,o [100,4,16], lse fp32,
    # 4 MLP [100,128]; no separate o_proj input without SP (a view of o)
    saved = 2 * 100 * 64 * (4 + 2 * 2) + 100 * 16 * 16 * 2 + 100 * 4 * 4 + 4 * 100 * 128 * 2
    assert saved == 257600
    assert est.gpu["saved activations (all layers)"] == 2 * saved
    # backward: 3 hidden grads + max(attention grads 51200 + fp32 dq 25600, MLP grads 51200,
    # RMSNorm's 5 fp32 [100,64] temporaries 128000 less the freed MLP tensors 102400)
    assert est.gpu_phases["layer working set (backward)"] == 3 * 12800 + 76800
    # logits: [100, 1000] x (log-softmax, its grad, nll's grad: fp32 each) + final norm + d(hidden)
    assert est.gpu_phases["logits + loss"] == 100 * 1000 * 12 + 100 * 64 * 8 + 12800
    assert est.gpu_phases["optimizer step (fp32 grad copy)"] == 4 * (n // 2)
    assert est.gpu_peak == 2 * 210240 + 1261440 + 272384 + 2 * saved + 1_264_000 == 3_733_504
    assert est.cpu_per_rank == {}


def test_eval_phases_by_hand():
    # no autograd: 2 hidden [100,64] + max(attention: q,k,v,o [100,4,16] + o back [100,64]; MLP: 3 [100,128])
    layer = 2 * 12800 + max(51200 + 12800, 3 * 100 * 128 * 2)
    assert layer == 102400
    # whole logits: [100, 1000] x (bf16 2 + fp32 upcast 4 + log-softmax 4 + its copy 4) + last hidden, its norm
    assert eval_phases(TOY, 100, 1, 2, tiled=False) == {"eval: one layer forward": layer,
                                                        "eval: whole logits + CE": 100 * 1000 * 14 + 2 * 12800}
    # a 100 KB tile is 25 rows of fp32 logits: 4 tiles of 25 rows
    assert eval_tile_rows(100, 1000, tile_bytes=100_000) == 25
    assert eval_phases(TOY, 100, 1, 2, tile_bytes=100_000)["eval: logits tile + CE"] == 25 * 1000 * 14 + 2 * 12800
    # Llama 3 at 128k, SP=2: 65536 x 128256 fp32 logits are 31.3 GiB -> 32 tiles of 2048 rows (tiled_loss's rule)
    assert eval_tile_rows(65536, 128256) == 2048


def test_eval_fits_where_the_training_step_does():
    shape = load_shape("llama3-8b")
    for feats in (set(), {"tiled_logits"}, ALL_ACT | {"offload_params", "offload_optimizer"}):
        est = estimate(shape, 131072, 8, 32, feats)
        assert 0 < est.eval_gpu_peak < est.gpu_peak, feats
        # (its logits tile alone can be larger than the step's: 14 B per logit against 12, since the step drops
        # the forward's logits before its backward; the step also holds activations, the evaluation none)
        assert est.to_dict()["eval_gpu_peak"] == est.eval_gpu_peak
    # selective checkpointing: neither the checkpoints nor the unchecked layers' activations exist in evaluation
    est = estimate(shape, 131072, 8, 32, Features(gradient_checkpointing=True, checkpoint_every=4))
    activations = sum(v for k, v in est.gpu.items() if k.startswith(("saved activations", "activation checkpoints")))
    assert activations > 0
    assert est.eval_gpu_peak == sum(est.gpu.values()) - activations + max(est.eval_phases.values())
    # evaluation holds no activations of other layers: it does not grow with the depth, the step does
    deep = ModelShape(**{**vars(shape), "num_layers": 2 * shape.num_layers})
    assert estimate(deep, 131072, 8, 32, set()).eval_phases == estimate(shape, 131072, 8, 32, set()).eval_phases


def test_a_stage_asked_at_a_longer_length_shows_its_evaluation_there():
    """A stage evaluates with its own split and features at every length it asks (eval.lengths all, or a list): a
    32k stage at sp 1 asked at 1M holds 102 GiB per rank there (Llama-3-8B, checkpointed, tiled logits). The plan
    printed the evaluation peak at the stage's own length only (5.9 GiB, fits); now also at the longest --seq_len."""
    rep = plan.plan(["--model", "llama3-8b", "--seq_len", "32k,1M", "--sp", "1", "--tiled_logits",
                     "--gradient_checkpointing"])
    short, long = (p["candidates"][0] for p in rep["plans"])
    at = short["eval_at_longest"]
    assert at["seq_len"] == 1048576 and not at["fits"] and 100 * GiB < at["eval_gpu_peak"] < 104 * GiB
    assert at["eval_gpu_peak"] == long["estimate"]["eval_gpu_peak"]  # the same split and features there
    assert "eval_at_longest" not in long
    text = plan.render(rep)
    assert re.search(r"evaluation at 1,048,576 tokens +10[0-4]\.\d\d  does NOT fit \(eval\.lengths all", text), text
    assert text.count("evaluation at 1,048,576") == 1


def test_untiled_eval_grows_with_vocab_tiled_does_not():
    small = load_shape("llama3-8b")
    big = ModelShape(**{**vars(small), "vocab_size": 4 * small.vocab_size})
    untiled = [eval_phase_bytes(s, 131072, 2, 2, tiled=False) for s in (small, big)]
    tiled = [eval_phase_bytes(s, 131072, 2, 2, tiled=True) for s in (small, big)]
    assert untiled[1] > 3.9 * untiled[0] > 0
    assert abs(tiled[1] - tiled[0]) < 0.01 * tiled[0]  # one ~1 GiB tile of fp32 logits either way
    assert tiled[0] * 10 < untiled[0]


def test_sp_halves_activation_terms():
    shape = load_shape("llama3-8b")  # 8 KV heads: sp 2 -> 4 splits KV heads too, no replication
    for seq in (65536, 131072):
        s1, t1 = layer_activations(shape, seq // 2, 2, 2, tiled_mlp=False)
        s2, t2 = layer_activations(shape, seq // 4, 4, 2, tiled_mlp=False)
        assert (s2, t2) == (s1 // 2, t1 // 2)
        # from no SP to SP=2 the attention output gets its own [T, nh*d] (the all-to-all's result)
        s0, _ = layer_activations(shape, seq, 1, 2, tiled_mlp=False)
        assert s1 == s0 // 2 + seq // 2 * shape.num_heads * shape.head_dim * 2
    feats = Features(gradient_checkpointing=True)
    e1 = estimate(shape, 131072, 2, 8, feats)
    e2 = estimate(shape, 131072, 4, 8, feats)
    assert e2.gpu["activation checkpoints"] * 2 == e1.gpu["activation checkpoints"]
    assert e2.gpu_phases["logits + loss"] * 2 == e1.gpu_phases["logits + loss"]
    assert e2.gpu_phases["layer working set (recompute+backward)"] * 2 == \
        e1.gpu_phases["layer working set (recompute+backward)"]


def test_kv_replication_when_sp_exceeds_kv_heads():
    shape = load_shape("llama3-8b")
    s8, _ = layer_activations(shape, 1024, 8, 2, tiled_mlp=True)  # one KV head per rank
    s16, _ = layer_activations(shape, 512, 16, 2, tiled_mlp=True)  # KV replicated: still one per rank
    assert s16 > s8 // 2


def test_offload_moves_model_states_to_cpu():
    shape = load_shape("llama3-8b")
    n, world = shape.num_params(), 8
    on_gpu = estimate(shape, 32768, 8, world, Features())
    off = estimate(shape, 32768, 8, world, Features(offload_params=True, offload_optimizer=True), pinned_offloads=False)
    for key in ("params (partition)", "grads (partition)", "optimizer fp32 master+Adam m,v"):
        assert key not in off.gpu
    # pageable: ZeRO-3's fp32 gradient buffers of the sub-groups and its bf16 accumulation buffer, per partition
    part = sum(-(-x // world) for x in shape.param_numels())
    # + a checkpoint load's transient fp32 master copy (a stage's start, a resume), beside CPU Adam's own
    assert off.cpu_per_rank == {"params (partition)": 2 * n // world, "grads fp32 (partition)": 6 * part,
                                "optimizer fp32 master+Adam m,v": 12 * n // world,
                                "checkpoint load: fp32 master copy (transient)": 4 * n // world}
    assert sum(on_gpu.gpu.values()) - sum(off.gpu.values()) == 16 * n // world
    assert off.gpu_peak < on_gpu.gpu_peak
    assert off.cpu_per_node == 8 * (18 * n // world + 6 * part)
    # the offloaded checkpoints' arena is given back before a load, so the load holds its place, not both
    ck = estimate(shape, 32768, 8, world, Features(offload_params=True, offload_optimizer=True, gradient_checkpointing=True,
                                                   offload_activations=True), pinned_offloads=False)
    load = ck.cpu_per_rank.get("checkpoint load: fp32 master copy (transient)", 0)
    assert load == max(0, 4 * n // world - ck.cpu_per_rank["activation checkpoints"])


def test_tiled_features_reduce_their_terms():
    shape = load_shape("llama3-8b")
    base = Features(gradient_checkpointing=True)
    ref = estimate(shape, 262144, 8, 8, base)
    mlp = estimate(shape, 262144, 8, 8, Features(gradient_checkpointing=True, tiled_mlp=True))
    logits = estimate(shape, 262144, 8, 8, Features(gradient_checkpointing=True, tiled_logits=True))
    act = estimate(shape, 262144, 8, 8, Features(gradient_checkpointing=True, offload_activations=True))
    plain = estimate(shape, 262144, 8, 8, Features())
    ws = "layer working set (recompute+backward)"
    assert mlp.gpu_phases[ws] < ref.gpu_phases[ws]
    head_sum = 4 * shape.vocab_size * shape.hidden_size  # the tiled loss's fp32 sum of the head's gradient (TileGradSum)
    assert logits.gpu_phases["logits + loss"] - head_sum < ref.gpu_phases["logits + loss"] / 10
    assert act.gpu["activation checkpoints"] == ref.gpu["activation checkpoints"] * 2 // shape.num_layers
    assert act.cpu_per_rank["activation checkpoints"] == ref.gpu["activation checkpoints"]
    assert plain.gpu["saved activations (all layers)"] > 10 * ref.gpu["activation checkpoints"]
    for e in (mlp, logits, act):
        assert e.gpu_peak <= ref.gpu_peak


def test_monotonic_in_seq_len():
    shape = load_shape("qwen2.5-7b")
    for feats in (Features(), Features.of(ALL_ACT | {"offload_optimizer"}), Features(tiled_mlp=True)):
        peaks = [estimate(shape, s, 4, 8, feats) for s in (4096, 8192, 65536, 131072, 10**6, 4 * 10**6)]
        gpu = [e.gpu_peak for e in peaks]
        cpu = [e.cpu_per_node for e in peaks]
        assert gpu == sorted(gpu) and cpu == sorted(cpu)


@pytest.mark.parametrize("argv, needle", [
    (["--sp", "3"], "does not divide world size 8"),
    (["--sp", "16"], "does not divide world size 8"),
    (["--model", "qwen2.5-7b", "--gpus_per_node", "7", "--sp", "7", "--cp", "1"], "KV heads"),
    (["--model", "tiny-llama", "--sp", "8", "--cp", "1"], "not divisible by sequence_parallel_size=8"),
    (["--seq_len", "lots"], "sequence length"),
    (["--model", "no-such-model"], "not a preset"),
    (["--offload_activations"], "needs gradient_checkpointing"),
    # before: an IndexError traceback, max() of an empty sequence, int()'s own words, a JSON error naming no file,
    # and an empty --seq_len, a negative runtime overhead and an MFU above 1 planned as given
    (["--sp", "0"], "--sp '0': use an integer >= 1 or auto"),
    (["--attention_head_chunks", "0"], "--attention_head_chunks '0': use an integer >= 1 or max"),
    (["--attention_head_chunks", "x"], "--attention_head_chunks 'x': use an integer >= 1 or max"),
    (["--model", "README.md"], "README.md is not JSON"),
    (["--seq_len", ""], "--seq_len '': give a length"),
    (["--cpu_overhead_gb", "-1"], "--cpu_overhead_gb -1: use a size >= 0"),
    (["--mfu", "1.5"], "--mfu 1.5: use a fraction in (0, 1]"),
    # --sp auto with a cp no SP degree of 8 ranks takes (was "min() arg is an empty sequence")
    (["--cp", "3"], "--cp 3: no SP degree on 8 ranks takes it at 131072 tokens (cp divides sp, sp divides the world, "
                    "sp / cp suits the heads): use --cp 1, 2, 4, 8 or auto"),
])
def test_invalid_input_is_a_one_line_value_error(argv, needle):
    args = ["--model", "llama3-8b", "--seq_len", "128k"] + argv
    with pytest.raises(ValueError) as err:
        plan.plan(args)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_cli_error_is_one_line_on_stderr():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "plan.py"), "--model", "llama3-8b",
                           "--seq_len", "128k", "--sp", "3"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""  # a user's input: 2, as every script
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1


def test_json_output_parses_and_auto_sp(capsys):
    plan.main(["--model", "llama3-8b", "--seq_len", "128k,1M", "--nodes", "4", "--alst", "--json"])
    rep = json.loads(capsys.readouterr().out)
    assert rep["cluster"]["world"] == 32 and rep["features"]["tiled_mlp"]
    short, long = rep["plans"]
    # --cp auto (the default): beyond a node Ulysses stays at 8 and cp takes the rest; pure Ulysses next to it
    assert [(c["sp"], c["cp"]) for c in short["candidates"]] == [(1, 1), (2, 1), (4, 1), (8, 1), (16, 2), (16, 1),
                                                                 (32, 4), (32, 1)]
    assert set(long["fitting_sp"]) <= set(short["fitting_sp"])
    assert long["recommended_sp"] in long["fitting_sp"]
    stage = long["recipe"]["stages"][0]
    assert stage["max_seq_length"] == 1048576 and stage["sequence_parallel_size"] == long["recommended_sp"]
    assert os.path.isfile(os.path.join(ROOT, long["deepspeed_config"]))


def test_async_save_host_copy_is_in_the_plan(monkeypatch):
    """--async_save (train.py's background saves) keeps a host copy of each rank's checkpoint: 12 B/param / world per
    rank in the CPU budget (Llama-3-8B on 32 ranks: 2.8 GiB per rank, 22.4 GiB per 8-GPU node). With the optimizer
    on the GPU the copy is pinned, one block per ZeRO-3 sub-group's master, m and v, each held rounded up to a power
    of two (issue 43): 3 x 0.93 -> 3 x 1 GiB per rank on 32 ranks; from offloaded (host) states a pageable copy.
    (As pinned blocks: the host arena's fallback; the arena's exact bytes: tests/unit/model_utils/test_host_arena.py.)"""
    monkeypatch.setattr("planner.memory_model.HOST_ARENA", False)
    shape = load_shape("llama3-8b")
    n = shape.num_params()
    base = estimate(shape, 1 << 20, 8, 32, None, gpus_per_node=8)
    snap = estimate(shape, 1 << 20, 8, 32, None, gpus_per_node=8, async_save=True)
    term = snap.cpu_per_rank["async save: host copy of the rank's checkpoint"]
    assert term == 3 * 2**30 > 12 * n // 32 and snap.gpu_peak == base.gpu_peak
    assert snap.cpu_per_node - base.cpu_per_node == 8 * term
    host = estimate(shape, 1 << 20, 8, 32, {"offload_optimizer"}, gpus_per_node=8, async_save=True)
    assert host.cpu_per_rank["async save: host copy of the rank's checkpoint"] == 12 * (n // 32)
    cpu = estimate(shape, 1 << 20, 8, 32, None, gpus_per_node=8, async_save=True, device="cpu")
    assert cpu.cpu_per_rank["async save: host copy of the rank's checkpoint"] == 12 * (n // 32)
    # on 8 ranks the partition (1.004e9 elements) is one sub-group as DeepSpeed forms it (a group closes past 10^9 on
    # a parameter's boundary, here the last): 3 x 4 GiB, +7% (the old fixed groups of 10^9: 3 x (4 GiB + 16 MiB))
    eight = estimate(shape, 1 << 20, 8, 8, None, async_save=True).cpu_per_rank
    assert eight["async save: host copy of the rank's checkpoint"] == 3 * 4 * 2**30


def test_table_output_mentions_the_essentials(capsys):
    plan.main(["--model", "tiny-llama", "--seq_len", "4k", "--gpus_per_node", "2"])
    out = capsys.readouterr().out
    for needle in ("no seq^2 term", "SP degrees that fit: [1, 2]", "= peak", "tokens/s/GPU", "recipe:"):
        assert needle in out


def test_ds_recommendation():
    assert plan.ds_recommendation(Features()) == ("ds_configs/zero3.json", {})
    assert plan.ds_recommendation(Features(offload_params=True, offload_optimizer=True)) == \
        ("ds_configs/zero3_offload.json", {})
    assert plan.ds_recommendation(Features(offload_optimizer=True))[1] == \
        {"zero_optimization": {"offload_param": {"device": "none"}}}


def test_parse_seq_len_and_config_json(tmp_path):
    assert [parse_seq_len(s) for s in ("131072", "128k", "128K", "1M", "15_000_000")] == \
        [131072, 131072, 131072, 1048576, 15_000_000]
    from planner.presets import PRESETS

    (tmp_path / "config.json").write_text(json.dumps(PRESETS["qwen3-32b"]))
    assert load_shape(str(tmp_path)) == load_shape(str(tmp_path / "config.json")) == load_shape("qwen3-32b")


def test_flops_and_throughput_by_hand():
    # 6 * (2 layers + LM head) * s  +  6 * L * nh * d * s^2
    assert flops_per_sequence(TOY, 100) == 6 * (2 * 41088 + 64000) * 100 + 6 * 2 * 4 * 16 * 100**2
    assert tokens_per_sec_per_gpu(TOY, 100, 0.5, 1.0) == pytest.approx(100 * 0.5e12 / 95_385_600)


def test_the_plans_attention_share_counts_windowed_layers(tmp_path):
    """plan.py's attention_share was 6*L*nh*d*s^2 over the FLOPs, every layer full, while flops_per_sequence counts
    a windowed layer at its window's share: with a 4k window at 128k (Mistral's rule: every layer) it said 2.01, more
    than all the FLOPs, for 0.12. Now the planner's attention_flops."""
    from planner.flops import attention_flops
    from planner.presets import PRESETS

    (tmp_path / "config.json").write_text(json.dumps(dict(PRESETS["llama3-8b"], model_type="mistral",
                                                          architectures=["MistralForCausalLM"], sliding_window=4096)))
    shape, n = load_shape(str(tmp_path)), 131072
    got = plan.plan(["--model", str(tmp_path), "--seq_len", "128k"])["plans"][0]["throughput"]
    assert got["attention_share"] == pytest.approx(attention_flops(shape, n) / flops_per_sequence(shape, n))
    assert got["flops_per_sequence"] == flops_per_sequence(shape, n) and 0.12 < got["attention_share"] < 0.13


def test_predict_peak_bytes_for_tiny_models_on_cpu():
    for name in ("tiny-llama", "tiny-qwen2"):
        p1 = predict_peak_bytes(name, 2048, 1, features=None)
        p2 = predict_peak_bytes(name, 2048, 2, features={"gradient_checkpointing": True})
        assert 0 < p2 < p1
        # on CPU offloading changes nothing: every state lives in the same RAM
        off = {"offload_params", "offload_optimizer", "gradient_checkpointing", "offload_activations"}
        same = predict_peak_bytes(name, 2048, 2, features={"gradient_checkpointing"})
        assert predict_peak_bytes(name, 2048, 2, features=off) == pytest.approx(same, rel=0.2)
        assert predict_peak_bytes(name, 2048, 2, features=off, device="cuda") < same


def test_selective_checkpointing_term_by_hand():
    """checkpoint_every=K: ceil(L/K) layers keep only their input, the others all their saved activations."""
    shape = ModelShape(**{**vars(TOY), "num_layers": 5})
    saved, _ = layer_activations(shape, 100, 1, 2, False)
    hid = 100 * 64 * 2
    k1, k2 = estimate(shape, 100, 1, 1, Features(checkpoint_every=1)), estimate(shape, 100, 1, 1, {"checkpoint_every": 2})
    assert k1.gpu == estimate(shape, 100, 1, 1, Features(gradient_checkpointing=True)).gpu  # K=1 is today's flag
    assert k2.gpu["activation checkpoints"] == 3 * hid  # layers 0, 2, 4
    assert k2.gpu["saved activations (layers not checkpointed)"] == 2 * saved
    _, transient = layer_activations(shape, 100, 1, 2, False)
    assert k2.gpu_phases == k1.gpu_phases | {"layer working set (backward)": transient}  # layer 4 is checkpointed
    # K=3: layers 0, 3; layer 4 has finished its backward and freed its activations when layer 3 is recomputed
    k3 = estimate(shape, 100, 1, 1, {"checkpoint_every": 3})
    assert k3.gpu["saved activations (layers not checkpointed)"] == 3 * saved
    assert k3.gpu_phases["layer working set (recompute+backward)"] == \
        k1.gpu_phases["layer working set (recompute+backward)"] - saved
    off = estimate(shape, 100, 1, 1, {"checkpoint_every": 2, "offload_activations": True})
    # each offloaded checkpoint in an exact-size slot of the host arena (issue 43): 12800 B, where a pinned block of
    # the caching host allocator (the arena's fallback) is held rounded, 16384 B
    assert off.cpu_per_rank["activation checkpoints"] == 3 * hid and off.gpu["activation checkpoints"] == 2 * hid
    peaks = [estimate(shape, 100, 1, 1, Features(checkpoint_every=k)).gpu_peak for k in (1, 2, 3, 5)]
    assert peaks == sorted(peaks) and peaks[-1] < estimate(shape, 100, 1, 1, Features()).gpu_peak
    with pytest.raises(ValueError, match="checkpoint_every"):
        Features.of({"checkpoint_every": -1})


def test_auto_shows_the_dry_runs_choice(capsys):
    """--auto: per length the choice train.py --memory_features auto --gpu_mem_gb 80 makes, faster than all features."""
    from planner.auto_features import choose
    from training.curriculum import device_budget

    plan.main(["--model", "llama3-8b", "--seq_len", "128k,1M", "--nodes", "4", "--auto", "--json"])
    rep = json.loads(capsys.readouterr().out)
    for p, seq in zip(rep["plans"], (131072, 1048576)):
        a = p["auto"]
        want = choose(load_shape("llama3-8b"), seq, 32, device_budget(80.0, 0.0)[1], sp=None, sp_max=8,
                      offloads=Features(offload_params=True, offload_optimizer=True, lean_rmsnorm=True, lean_mlp=True),
                      host_bytes_per_rank=int((1024 / 8 - 2) * 2**30))  # plan.py's host bound (--cpu_mem_gb 1024)
        assert a["sp"] == want.sp and a["checkpoint_every"] == want.features.every
        assert (a["tiled_mlp"], a["tiled_logits"]) == (want.features.tiled_mlp, want.features.tiled_logits)
        assert a["predicted_peak_gb"] <= a["budget_gb"]
        assert a["tokens_per_sec_per_gpu"] >= a["all_features_tokens_per_sec_per_gpu"]
    # 2 head chunks (issue 33) whose lean norms' outputs are recomputed by the chunked attention and the tiled MLP
    # (2026-11-27) fit with no layer checkpointed: no recompute at all, cheaper than checkpointing every layer with
    # the attention kept (the choice before) or 1 layer in 4 (the choice without keep_attention before)
    for extra in ([], ["--no-keep_attention"]):
        plan.main(["--model", "llama3-8b", "--seq_len", "128k", "--nodes", "4", "--sp", "2", "--auto", *extra])
        assert ("memory_features auto: tiled_logits, tiled_mlp, attention in 2 head chunks at sp=2; "
                in capsys.readouterr().out)
    plan.main(["--model", "llama3-8b", "--seq_len", "128k", "--nodes", "4", "--sp", "2", "--auto", "--no-lean_rmsnorm",
               "--no-keep_attention"])
    assert "memory_features auto: tiled_logits, checkpoint every layer at sp=2" in capsys.readouterr().out


def test_every_length_comes_with_its_step_time():
    """Issue 49: plan.py's rows and --compare carry the step time at the measured FLOP rate (planner/step_time.py:
    the MFU that reproduces the GPU run's measured step), mark a step over an hour, and give per setup the longest
    length whose step stays within 15 minutes with memory_features auto's choice at that length (its step is
    within, one more unit's is not or nothing fits it: tests/unit/planner/test_trainable.py)."""
    from planner.step_time import MEASURED, TRAINABLE_S, measured_mfu, step_time
    from planner.trainable import auto_step

    shape = ModelShape.from_config(MEASURED["model"])
    f = Features.of(MEASURED["features"])
    assert abs(step_time(shape, MEASURED["seq_len"], 1, f, world=1, ranks_per_node=1) - MEASURED["step_s"]) < 0.1
    assert 0.2 < measured_mfu() < 0.6
    rows = plan.compare()
    for r in rows:
        assert r["step_s"] > 0 and r["over_an_hour"] == (r["step_s"] > 3600)
        n, sp, cp = r["within_15_min"], r["sp"], r["cp"]
        assert 0 < n < r["longest"] and r["within_15_min_at"]["seq_len"] == n
        run = plan.AutoRun.of_args(plan.build_parser().parse_args(
            ["--model", "llama3-8b", "--seq_len", "1M", "--alst", "--gpus_per_node", str(r["gpus"] // r["nodes"]),
             "--nodes", str(r["nodes"]), "--cpu_mem_gb", str(r["host_gib_per_node"])]))
        at, beyond = (auto_step(load_shape("llama3-8b"), m, sp, cp, run) for m in (n, n + sp * (2 if cp > 1 else 1)))
        assert at[1] <= TRAINABLE_S and (beyond is None or beyond[1] > TRAINABLE_S), (r["gpus"], n)
    assert rows[1]["over_an_hour"] and rows[2]["over_an_hour"]  # (the 1-GPU row: 70.5 min since its length is 1,240,480)
    out = plan.render_compare(rows)
    assert "(**over an hour**)" in out and f"MFU {measured_mfu()}" in out and "at most 15.0 min" in out
    rep = plan.plan(["--model", "llama3-8b", "--seq_len", "1M", "--alst", "--gpus_per_node", "1", "--nodes", "1",
                     "--cpu_mem_gb", "1024", "--attention_head_chunks", "max"])  # the headline's: 1M fits
    text = "\n".join(plan.render(rep).splitlines()[:10])
    assert "page-locked/node" in text and " min " in text and "MFU 0.412" in text
    # the plain run too: tokens/s per GPU beside each row's step (the same rate), the 15-minute length at its split
    (row,), p = rep["plans"][0]["candidates"], rep["plans"][0]
    assert abs(row["measured_tokens_per_sec_per_gpu"] * row["step_s"] - 1_048_576) < 1
    assert "tok/s/GPU" in text and f"{row['measured_tokens_per_sec_per_gpu']:,.0f}" in text
    assert 0 < p["within_15_min"] < 1_048_576 and f"at most 15.0 min (what a run would train at; --compare: per GPU " \
        f"count): {p['within_15_min']:,} at the recommended split, sp=1" in text
    assert "--compare" in plan.build_parser().format_help()
    # at 128k on 8 GPUs without the ALST features nothing fits: the length is auto's at the largest split (it said
    # "none (nothing fits)", though auto fits 128k and more there)
    short = plan.plan(["--model", "llama3-8b", "--seq_len", "128k"])["plans"][0]
    assert short["recommended_sp"] is None and short["within_15_min_at"]["sp"] == 8 and short["within_15_min"] > 131072
    assert "at the largest split, sp=8" in plan.render(plan.plan(["--model", "llama3-8b", "--seq_len", "128k"]))


def test_compare_table_has_one_row_per_setup_and_the_published_figures():
    """`plan.py --compare`: the docs/results table's shape (its figures are the planner's, tested elsewhere)."""
    rows = plan.compare()
    assert [r["gpus"] for r in rows] == [g for g, _, _ in plan.COMPARE_SETUPS]
    for r in rows:
        assert r["longest"] > 0 and 0 < r["relative_speed"] <= 1 and r["tokens_per_sec_per_gpu"] > 0
        assert r["published"] == plan.PUBLISHED.get(r["gpus"], {})
    table = plan.render_compare(rows).splitlines()
    first = table[:2 + len(rows)]
    assert all(line.count("|") == first[0].count("|") for line in first) and table[2 + len(rows)] == ""
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "plan.py"), "--compare"], capture_output=True,
                         text=True, check=True).stdout.splitlines()
    assert out == table


def test_a_family_head_chunks_cannot_run_is_planned_without_them(tmp_path, capsys):
    """OLMo-2's q/k norm spans all heads: train.py refuses chunks for it, and `--attention_head_chunks max` planned 4
    chunks and an SP degree that fit only with them (the third review). Planned with 1; an explicit N > 1 refused."""
    from planner.presets import PRESETS

    cfg = dict(PRESETS["llama3-8b"], model_type="olmo2", architectures=["Olmo2ForCausalLM"])
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    from planner.cluster import Planner
    from planner.memory_model import Features

    args = plan.build_parser().parse_args(["--model", str(tmp_path), "--seq_len", "1M", "--gpus_per_node", "8",
                                           "--attention_head_chunks", "max"])
    assert [Planner(args, load_shape(str(tmp_path)), Features()).chunks(sp, 1) for sp in (2, 4, 8)] == [1, 1, 1]
    assert Planner(args, load_shape("llama3-8b"), Features()).chunks(4, 1) > 1  # a family that runs them
    with pytest.raises(ValueError, match="--attention_head_chunks 4: olmo2 cannot run its attention in head chunks"):
        plan.plan(["--model", str(tmp_path), "--seq_len", "1M", "--gpus_per_node", "8", "--attention_head_chunks", "4"])
