"""`memory_features: auto` (planner/auto_features.py): the chooser against budgets derived from the planner's
own predictions (never hard-coded), explicit settings winning, `sequence_parallel_size: auto`, and the choice
reaching the stage's config and the start-up plan. Pure unit tests except the last, a 2-rank train.py run
whose measured peak stays under the --mem_cap_gb it was given."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import replace

import pytest

from planner import auto_features as af
from planner.memory_model import Features, GiB, estimate, load_shape, logits_tile_bytes
from tests.conftest import ROOT
from training.config import Config, StageConfig
from training.curriculum import resolve_stages
from training.engine import stage_config

SHAPE = load_shape("llama3-8b")
OFF = Features(offload_params=True, offload_optimizer=True)
SL, WORLD = 131072, 32


def peak(f: Features, sp: int = 2, device: str = "cuda") -> int:
    return af.peak_bytes(SHAPE, SL, sp, WORLD, f, OFF, "bf16", device)


def run_peak(f: Features, sp: int = 2) -> int:
    """peak() as resolve_stages plans it: train.py's lean RMSNorm and MLP on (its defaults)."""
    return af.peak_bytes(SHAPE, SL, sp, WORLD, f, replace(OFF, lean_rmsnorm=True, lean_mlp=True), "bf16", "cuda")


def budget_for(nbytes: int) -> int:
    """The budget at which a predicted peak of `nbytes` just fits with the headroom."""
    return int(nbytes / (1 - af.HEADROOM)) + 1


def pick(budget: int, sp: int | None = 2, **kw) -> af.Choice:
    return af.choose(SHAPE, SL, WORLD, budget, sp=sp, sp_max=8, offloads=OFF, **kw)


def cands(sp: int = 2, pinned: dict | None = None) -> list[Features]:
    """Every set auto tries at `sp`, head chunk counts included."""
    return af.candidates(SHAPE.num_layers, pinned or {}, "cuda", af.head_chunk_options(SHAPE, sp))


def test_cost_model_ranks_recompute():
    speed = {k: af.relative_speed(SHAPE, SL, 2, Features(checkpoint_every=k)) for k in (1, 2, 4)}
    assert af.relative_speed(SHAPE, SL, 2, Features()) == 1.0
    assert speed[1] < speed[2] < speed[4] < 1.0
    assert 0.7 < speed[1] < 0.8  # full recompute: one more forward on top of 3 -> ~3/4
    assert af.relative_speed(SHAPE, SL, 2, af.ALL_FEATURES) < speed[1]  # tiling and offload cost on top
    # offload costs PCIe time on a GPU only
    off = Features(checkpoint_every=1, offload_activations=True)
    assert af.relative_speed(SHAPE, SL, 2, off, device="cpu") == speed[1] > af.relative_speed(SHAPE, SL, 2, off)


def test_fits_and_does_not_fit():
    none = peak(Features())
    assert pick(budget_for(none)).features == Features()  # everything fits: no feature, full speed
    c = pick(budget_for(none) - 2**20)  # 1 MiB short of the plain run: something must give
    assert c.features != Features() and c.peak_bytes <= c.budget_bytes * (1 - af.HEADROOM) and c.relative_speed < 1
    leanest = min(peak(f) for f in cands())
    assert pick(budget_for(leanest)).peak_bytes == leanest
    with pytest.raises(ValueError, match="nothing fits"):
        pick(budget_for(leanest) - 2**20)


def test_k_chosen_between_all_and_none():
    """With the tiling pinned on, the budget of checkpointing every 2nd layer picks K=2: faster than K=1,
    and K=3 (more layers keep their activations) no longer fits."""
    pins = {"tiled_mlp": True, "tiled_logits": True, "offload_activations": False, "keep_attention": False}
    tiled = Features(tiled_mlp=True, tiled_logits=True)
    k2, k3 = peak(Features(**{**tiled.__dict__, "checkpoint_every": 2})), peak(Features(**{**tiled.__dict__,
                                                                                           "checkpoint_every": 3}))
    assert k2 < k3
    c = pick(budget_for(k2), pinned=pins)
    assert c.features.every == 2 and c.peak_bytes == k2


def test_keep_attention_costs_memory_and_saves_the_attention_recompute():
    """Keeping the attention output of the checkpointed layers: the recompute no longer pays the attention
    forward (71% of a Llama-3-8B layer's forward FLOPs at 128k tokens), each checkpointed layer keeps [S, heads/sp, d] (+ fp32 lse) more,
    and auto takes it when that fits, plain checkpointing when only that does."""
    from planner.memory_model import kept_attention_bytes

    full, kept = Features(checkpoint_every=1), Features(checkpoint_every=1, keep_attention=True)
    assert af.relative_speed(SHAPE, SL, 2, full) < af.relative_speed(SHAPE, SL, 2, kept) < 1.0
    # the kernel's forward is what leaves the recompute: the extra time shrinks to the matmuls' third of it
    extra = {n: 1 / af.relative_speed(SHAPE, SL, 2, f) - 1 for n, f in (("full", full), ("kept", kept))}
    assert 0.27 < extra["kept"] / extra["full"] < 0.31
    per_layer = kept_attention_bytes(SHAPE, SL // 2, 2, 2)
    assert per_layer == SL * (SHAPE.num_heads // 2) * (SHAPE.head_dim * 2 + 4)
    est = {n: estimate(SHAPE, SL, 2, WORLD, f) for n, f in (("full", full), ("kept", kept))}
    assert est["kept"].gpu["activation checkpoints: kept attention outputs"] == SHAPE.num_layers * per_layer
    phase = "layer working set (recompute+backward)"  # the recompute reuses the cached output, allocates no other
    assert est["full"].gpu_phases[phase] - est["kept"].gpu_phases[phase] == per_layer
    pins = {"checkpoint_every": 1, "tiled_mlp": False, "tiled_logits": False, "offload_activations": False}
    assert pick(budget_for(peak(kept)), pinned=pins).features == kept
    assert pick(budget_for(peak(kept)) - 2**20, pinned=pins).features == full
    assert pick(budget_for(peak(full)), pinned={"keep_attention": True}).features.every >= 1  # pinned: ckpt on


def test_head_chunks_cost_time_and_are_taken_only_to_fit():
    """attention_head_chunks: each count costs time (projections and all-to-all again in backward, n launches of
    each collective), more chunks more; auto takes the smallest count that fits where no unchunked set does, none
    where one does, and a pinned count wins (refused in one line where it does not split the heads per rank)."""
    ck = Features(checkpoint_every=1, tiled_mlp=True, tiled_logits=True, offload_activations=True)
    speed = {n: af.relative_speed(SHAPE, SL, 8, replace(ck, attention_head_chunks=n)) for n in (1, 2, 4)}
    assert speed[1] > speed[2] > speed[4]
    t = {n: af.head_chunk_seconds(SHAPE, SL, 8, replace(ck, attention_head_chunks=n)) for n in (1, 2, 4)}
    assert t[1] == 0 < t[2] < t[4]
    assert 0 < af.head_chunk_seconds(SHAPE, SL, 1, replace(ck, attention_head_chunks=2))  # sp 1: FLOPs, no comm
    counts = af.head_chunk_options(SHAPE, 2)
    assert counts[0] == 1 and len(counts) > 2
    lean = {n: min(peak(f) for f in cands() if f.attention_head_chunks == n) for n in counts}
    assert lean[1] > lean[counts[1]] and all(lean[a] >= lean[b] for a, b in zip(counts, counts[1:]))  # fewer bytes
    assert pick(budget_for(lean[1])).features.attention_head_chunks == 1  # fits unchunked: no chunks
    c = pick(budget_for(lean[1]) - 2**20)
    assert c.features.attention_head_chunks == counts[1] and c.as_dict()["attention_head_chunks"] == counts[1]
    assert f"attention in {counts[1]} head chunks" in af.describe(c.features)
    least = min(lean.values())  # past the count where attention stops setting the peak, more chunks only cost
    assert pick(budget_for(least)).features.attention_head_chunks == min(n for n in counts if lean[n] == least)
    with pytest.raises(ValueError, match="nothing fits"):
        pick(budget_for(lean[1]) - 2**20, pinned={"attention_head_chunks": 1})
    assert pick(budget_for(lean[1]), pinned={"attention_head_chunks": 4}).features.attention_head_chunks == 4
    with pytest.raises(ValueError, match="attention_head_chunks=3"):
        pick(budget_for(lean[1]), pinned={"attention_head_chunks": 3})
    latent = replace(SHAPE, kv_lora_rank=512) if hasattr(SHAPE, "kv_lora_rank") else None
    if latent is not None:
        assert af.head_chunk_options(latent, 1) == [1]  # MLA: no per-head projections to chunk


def test_explicit_settings_win():
    roomy = budget_for(peak(Features()))
    c = pick(roomy, pinned={"tiled_mlp": True, "checkpoint_every": 4})
    assert c.features.tiled_mlp and c.features.every == 4 and not c.features.tiled_logits
    off = pick(roomy, pinned={"offload_activations": True}).features
    assert off.offload_activations and off.every >= 1  # offload implies checkpointing (auto picks K)
    tight = budget_for(peak(Features()) // 2)
    assert not pick(tight, pinned={"tiled_logits": False}).features.tiled_logits


def test_sp_auto_picks_the_smallest_degree_that_fits():
    lean = {sp: min(peak(f, sp) for f in cands(sp)) for sp in (1, 2, 4)}
    assert lean[1] > lean[2] > lean[4]
    c = pick(budget_for(lean[2]), sp=None)
    assert c.sp == 2  # sp=1 does not fit at all, 2 does
    assert pick(budget_for(lean[1]), sp=None).sp == 1
    assert pick(budget_for(lean[4]), sp=None, ).sp == 4
    with pytest.raises(ValueError, match="sp <= 2"):
        af.choose(SHAPE, SL, WORLD, budget_for(lean[4]), sp=None, sp_max=2, offloads=OFF)  # within a node


def _cfg(tmp_path, **kw) -> Config:
    return Config(model_name_or_path="llama3-8b", deepspeed="ds_configs/zero3_offload.json", bf16=True,
                  max_seq_length=SL, sequence_parallel_size=2, **kw)


def test_resolve_stages_and_stage_config(tmp_path):
    none = peak(Features())
    gpu = lambda nbytes: (lambda: ("cuda", nbytes))  # noqa: E731
    stages = [StageConfig(name="a", max_steps=1),
              StageConfig(name="b", max_steps=1, memory_features={"checkpoint_every": 2, "tiled_mlp": True}),
              StageConfig(name="c", max_steps=1, memory_features="manual")]
    cfg = _cfg(tmp_path, memory_features="auto", tiled_logits=True, stages=stages)
    a, b, c = resolve_stages(cfg, lambda sp: WORLD // sp, budget=gpu(budget_for(none)))
    assert (a.tiled_logits, a.tiled_mlp, a.checkpoint_every) == (True, False, 0)  # explicit flag kept, rest off
    assert a.memory_choice["predicted_peak_gb"] <= a.memory_choice["budget_gb"]
    assert (b.checkpoint_every, b.tiled_mlp, b.tiled_logits) == (2, True, True)
    tile = min(1024, budget_for(none) // 64 // 2**20)  # auto's tile of the budget (logits_tile_bytes)
    assert a.logits_tile_mb == b.logits_tile_mb == a.memory_choice["logits_tile_mb"] == tile
    assert stage_config(cfg, a).logits_tile_mb == tile  # what apply_memory_features gives the model
    assert c.memory_choice is None and (c.tiled_logits, c.checkpoint_every, c.tiled_mlp) == (True, 0, False)
    # a stage's sequence_parallel_size: auto, at a budget where only sp >= 2 fits
    lean2 = min(run_peak(f, 2) for f in cands(2, {"tiled_logits": True}))
    for _ in range(3):  # at the logits tile auto takes at that budget (1/64 of it): with the head's fp32 gradient sum
        mb = logits_tile_bytes(budget_for(lean2)) // 2**20  # in the logits phase, sp 1 fits the 1 GiB tile's budget
        lean2 = min(run_peak(replace(f, logits_tile_mb=mb), 2) for f in cands(2, {"tiled_logits": True}))
    assert min(run_peak(replace(f, logits_tile_mb=mb), 1) for f in cands(1, {"tiled_logits": True})) > lean2
    cfg_sp = _cfg(tmp_path, memory_features="auto", tiled_logits=True,
                  stages=[StageConfig(name="d", max_steps=1, sequence_parallel_size="auto")])
    (d,) = resolve_stages(cfg_sp, lambda sp: WORLD // sp, budget=gpu(budget_for(lean2)))
    assert d.memory_choice["sp_auto"] and d.sp == d.memory_choice["sp"] == 2 and d.max_steps == 1
    sc = stage_config(cfg, b)
    assert (sc.checkpoint_every, sc.gradient_checkpointing, sc.tiled_mlp, sc.sequence_parallel_size) == (2, True, True, 2)
    manual = resolve_stages(_cfg(tmp_path, gradient_checkpointing=True), lambda sp: WORLD // sp)[0]
    assert manual.checkpoint_every == 1 and manual.memory_choice is None  # no budget needed
    with pytest.raises(ValueError, match="mem_cap_gb"):
        resolve_stages(_cfg(tmp_path, memory_features="auto"), lambda sp: WORLD // sp)  # CPU, no cap given
    with pytest.raises(ValueError, match="memory_features"):
        resolve_stages(_cfg(tmp_path, memory_features="fast"), lambda sp: WORLD // sp)


def test_attention_head_chunks_auto_resolves_to_the_planners_count(tmp_path):
    """--attention_head_chunks auto (the default) is resolved once per stage in resolve_stages (from the agreed
    budget, so every rank gets the same count): the chooser's count under memory_features auto, 1 under manual;
    an explicit N is kept. The count reaches the stage's config (what ulysses.register gets) and the plan line."""
    from training.engine import features_of
    from training.summary import plan_lines

    lean1 = min(run_peak(f) for f in cands() if f.attention_head_chunks == 1)
    gpu = (lambda: ("cuda", budget_for(lean1) - 2**20))  # noqa: E731  (nothing unchunked fits)
    cfg = _cfg(tmp_path, memory_features="auto", stages=[StageConfig(name="a", max_steps=1)])
    (a,) = resolve_stages(cfg, lambda sp: WORLD // sp, budget=gpu)
    # the chooser's count (the fastest that fits; since FlashAttention-2's GQA backward is counted, issue 43, more
    # than the 2 chunks the smallest fitting count would be)
    n = a.memory_choice["attention_head_chunks"]
    assert a.attention_head_chunks == n and n in af.head_chunk_options(SHAPE, 2)[1:]
    assert stage_config(cfg, a).attention_head_chunks == features_of(stage_config(cfg, a)).attention_head_chunks == n
    text = "\n".join(plan_lines(replace(cfg, gpu_mem_gb=80.0), [a], WORLD, 8, True))
    assert f"attention in {n} head chunks" in text
    with pytest.raises(ValueError, match="nothing fits"):  # an explicit count is pinned: 1 does not fit
        resolve_stages(_cfg(tmp_path, memory_features="auto", attention_head_chunks=1), lambda sp: WORLD // sp,
                       budget=gpu)
    (m,) = resolve_stages(_cfg(tmp_path, gradient_checkpointing=True), lambda sp: WORLD // sp)
    assert m.attention_head_chunks == 1 and stage_config(cfg, m).attention_head_chunks == 1  # manual: auto is 1
    (p,) = resolve_stages(_cfg(tmp_path, attention_head_chunks=4), lambda sp: WORLD // sp)
    assert p.attention_head_chunks == 4


def test_plan_lines_print_the_choice(tmp_path):
    from training.summary import plan_lines

    cfg = _cfg(tmp_path, memory_features="auto", gpu_mem_gb=80.0, stages=[StageConfig(name="a", max_steps=1)])
    stages = resolve_stages(cfg, lambda sp: WORLD // sp)
    text = "\n".join(plan_lines(cfg, stages, WORLD, 8, True))
    c = stages[0].memory_choice
    assert f"memory features (auto): {af.describe(af.Features(tiled_logits=stages[0].tiled_logits, tiled_mlp=stages[0].tiled_mlp, checkpoint_every=stages[0].checkpoint_every, offload_activations=stages[0].offload_activations))}" in text
    assert f"predicted peak {c['predicted_peak_gb']:.2f} of {80 - af.GPU_RESERVED / GiB:.2f} GiB" in text



def test_plan_lines_quote_h100_throughput_only_for_a_gpu_plan(tmp_path, monkeypatch):
    """A CPU run's start-up plan has no H100 tokens/s (issue 27: it printed ~74M tokens/s/GPU for a 1M-parameter
    model on CPU); a dry run for the cluster a recipe names keeps it."""
    from training.summary import plan_lines

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    cfg = _cfg(tmp_path, stages=[StageConfig(name="a", max_steps=1)])
    stages = resolve_stages(cfg, lambda sp: WORLD // sp)
    cpu = "\n".join(plan_lines(cfg, stages, WORLD, 8, False))
    assert "tokens/s/GPU" not in cpu and "H100" not in cpu  # the evaluation's time line follows the same rule
    assert "      eval: 2 trials x 3 depths x 1 length + 2 held-out = 8 forward passes of " in cpu
    cluster = dataclasses.replace(cfg, nodes=4, gpus_per_node=8)
    gpu = "\n".join(plan_lines(cluster, stages, WORLD, 8, True))
    assert "tokens/s/GPU at 40% MFU of an H100" in gpu and f" on {WORLD} x H100 at 40% MFU (" in gpu

@pytest.mark.dist
@pytest.mark.slow
def test_train_auto_stays_under_the_cap(tmp_path):
    """2 ranks (SP=2), 8192 tokens, a 4-layer h256 Llama: --memory_features auto --mem_cap_gb 0.85 must choose
    a set that is neither none nor everything, and the measured peak (metrics peak_mem_gb, peak RSS max over
    ranks) must stay under the cap. MALLOC_MMAP_THRESHOLD_ as bench/memory.py (RSS follows the tensors)."""
    from bench.harness import bench_model
    from tests.distributed import ROOT, run

    cap, out = 0.85, tmp_path / "out"
    noeval = tmp_path / "noeval.yaml"
    noeval.write_text("stages:\n  - {name: s, eval: {passkey_trials: 0, heldout_samples: 0}}\n")
    args = ["--config", str(noeval), "--model_name_or_path", bench_model(256, 4), "--max_seq_length", "8192",
            "--sequence_parallel_size", "2", "--max_steps", "2", "--output_dir", str(out), "--report_to", "none",
            "--no-export_hf", "--resume", "none", "--no-progress_bar", "--memory_features", "auto",
            "--mem_cap_gb", str(cap)]
    run(os.path.join(ROOT, "train.py"), args, 2, str(tmp_path / "logs"),
        extra_env={"MALLOC_MMAP_THRESHOLD_": "65536"})
    with open(tmp_path / "logs" / "rank0.log") as fh:
        chosen = [line.split("memory features (auto): ")[1].split(";")[0] for line in fh if "features (auto)" in line]
    assert chosen and chosen[0] not in ("none", af.describe(af.ALL_FEATURES)), chosen
    with open(out / "metrics.jsonl") as fh:
        peaks = [r["peak_mem_gb"] for r in map(json.loads, fh) if "peak_mem_gb" in r]
    assert len(peaks) == 2 and max(peaks) < cap, (chosen, peaks)


@pytest.mark.parametrize("ds_file", ["zero3.json", "zero3_offload.json"])
def test_overlap_comm_per_accelerator(monkeypatch, tmp_path, ds_file):
    """training/ds_config.build_ds_config decides overlap_comm: on with a GPU (DeepSpeed's ZeRO-3 default), off
    on the CPU accelerator; a concrete value in the JSON wins; buckets from the hidden size either way."""
    from base.parallel import ParallelDims
    from training import ds_config

    path = os.path.join("ds_configs", ds_file)
    with open(path) as fh:
        assert json.load(fh)["zero_optimization"]["overlap_comm"] == "auto"
    cfg, dims = Config(deepspeed=path), ParallelDims(world=2, sp=2, rank=0, local_rank=0)
    for gpu in (True, False):
        monkeypatch.setattr(ds_config, "no_gpu", lambda gpu=gpu: not gpu)
        zero = ds_config.build_ds_config(cfg, dims, bf16=False, hidden_size=64)["zero_optimization"]
        assert zero["overlap_comm"] is gpu
        assert (zero["reduce_bucket_size"], zero["stage3_prefetch_bucket_size"]) == (64 * 64, int(0.9 * 64 * 64))
    monkeypatch.setattr(ds_config, "no_gpu", lambda: False)
    zero = ds_config.build_ds_config(cfg, dims, False, 64, {"zero_optimization": {"overlap_comm": False}})
    assert zero["zero_optimization"]["overlap_comm"] is False


def test_cpu_budget_reads_this_process_peak_not_its_parents():
    """Linux carries a parent's peak RSS into the child's ru_maxrss across fork + exec. A train.py started by a
    process that once held 2 GiB (here: the test suite after the exact-bytes tests) read 2 GiB of RSS before it
    allocated anything, and auto refused every stage ("nothing fits ... in -0.8 GiB"). The budget and the CPU
    peak in the metrics read the process' own VmHWM."""
    import subprocess
    import sys

    child = ("import resource; from training.curriculum import device_budget; "
             "from training.metrics import peak_rss_bytes; "
             "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, peak_rss_bytes(), "
             "device_budget(0, 2.5)[1])")
    fat_parent = ("import subprocess, sys; x = bytearray(2 * 2**30); x[::4096] = b'1' * len(x[::4096]); del x; "
                  f"print(subprocess.run([sys.executable, '-c', {child!r}], capture_output=True, text=True, "
                  "check=True).stdout)")
    out = subprocess.run([sys.executable, "-c", fat_parent], cwd=ROOT, capture_output=True, text=True, check=True,
                         env=dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=ROOT))
    inherited, own, budget = map(int, out.stdout.split())
    assert inherited >= 2 * GiB  # the inheritance is real: what the budget used to subtract
    assert own < 1.5 * GiB and budget > 0.8 * GiB, (own, budget)


def test_logits_tile_follows_the_budget():
    """Auto's tiled logits run tiles of 1/64 of the budget up to ArcticTraining's 1 GiB: an 80 GB GPU keeps 1 GiB
    tiles, a small budget gets small ones (and a lower predicted logits phase); a tile the user set wins."""
    from planner.memory_model import LOGITS_TILE_BYTES, logits_tile_bytes

    assert logits_tile_bytes(78 * GiB) == LOGITS_TILE_BYTES
    assert logits_tile_bytes(22 * GiB) == 22 * GiB // 64 and logits_tile_bytes(0) == 2**20
    small = af.choose(load_shape("tiny-llama"), 16384, 2, GiB // 2, sp=2, offloads=OFF, precision="fp32",
                      device="cpu", pinned={"tiled_logits": True})
    assert small.features.logits_tile_mb == 8 and "(8 MiB tiles)" in af.describe(small.features)
    assert small.as_dict()["logits_tile_mb"] == 8
    big = dict(pinned={"tiled_logits": True, "checkpoint_every": 1})
    f8 = pick(80 * GiB, **big).features
    assert f8.logits_tile_mb == 1024 and "MiB tiles" not in af.describe(f8)
    f1 = pick(80 * GiB, **{**big, "pinned": {**big["pinned"], "logits_tile_mb": 64}}).features
    assert f1.logits_tile_mb == 64
    # the planner sees the tile: 16 tiles of 64 MiB hold 1/16 of one 1 GiB tile's three fp32 buffers
    ph = {mb: estimate(SHAPE, SL, 2, WORLD, Features(tiled_logits=True, logits_tile_mb=mb)).gpu_phases["logits + loss"]
          for mb in (64, 1024)}
    assert ph[1024] - ph[64] == pytest.approx(12 * (LOGITS_TILE_BYTES - 64 * 2**20) / 4, rel=0.05)  # whole rows per tile


def test_the_model_runs_the_configured_logits_tile():
    """--logits_tile_mb (or the stage's auto tile) reaches the model's tiled-loss forward at build."""
    import types

    import torch
    from transformers import AutoModelForCausalLM

    from model_utils import tiled_loss
    from model_utils.build import preset_config
    from model_utils.memory import apply_memory_features

    cfg = Config(model_name_or_path="tiny-llama", max_seq_length=64, logits_tile_mb=3)
    model = AutoModelForCausalLM.from_config(preset_config("tiny-llama"))
    apply_memory_features(model, types.SimpleNamespace(tiled_mlp=False, tiled_logits=True, gradient_checkpointing=False,
                                                       checkpoint_every=0, offload_activations=False,
                                                       logits_tile_mb=cfg.logits_tile_mb))
    calls = []
    model.get_output_embeddings().register_forward_hook(lambda *a: calls.append(1))
    vocab = model.config.vocab_size
    sl = 3 * 2**20 // (vocab * 4) * 5 + 7  # five 3 MiB tiles and a bit
    ids = torch.randint(0, vocab, (1, sl))
    with torch.no_grad():
        model(input_ids=ids, tiled_loss_labels=ids, eval_stats=True)
    assert len(calls) == tiled_loss.logits_tiles(1, sl, vocab, 3 * 2**20) == 6
    with pytest.raises(ValueError, match="logits_tile_mb -1"):
        from training.config import validate

        validate(Config(logits_tile_mb=-1))


# OLMo-3-7B's config.json, the fields the planner reads: q/k norms over all 32 heads at once (Olmo3RMSNorm(nh * d))
OLMO3_7B = {"model_type": "olmo3", "vocab_size": 100278, "hidden_size": 4096, "intermediate_size": 11008,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32, "sliding_window": 4096,
            "layer_types": (["sliding_attention"] * 3 + ["full_attention"]) * 8}


def test_auto_never_chunks_a_family_head_chunks_cannot_run():
    """Auto offered head chunks to every family but MLA and GPT-OSS: OLMo-3-7B at 1M tokens on 8 GPUs got "attention
    in 2 head chunks" and its first chunked forward crashed (its q/k norms span all heads). Now only the families
    model_utils/head_chunks.py runs exactly get chunks (ModelShape.head_chunks_ok); a pinned count is refused."""
    from planner.shapes import ModelShape

    olmo = ModelShape.from_config(OLMO3_7B)
    same_as_llama = replace(olmo, model_type="llama")  # identical sizes, a chunkable family
    assert not olmo.head_chunks_ok and "all heads" in olmo.no_head_chunks and same_as_llama.head_chunks_ok
    assert af.head_chunk_options(olmo, 8) == [1] and len(af.head_chunk_options(same_as_llama, 8)) > 1
    with pytest.raises(ValueError, match="attention_head_chunks 2: olmo3 normalizes q and k over all heads"):
        af.head_chunk_options(olmo, 8, pinned=2)
    assert af.head_chunk_options(olmo, 8, pinned=1) == [1]
    command_r_plus = ModelShape.from_config(dict(OLMO3_7B, model_type="cohere", use_qk_norm=True))  # per-head LayerNorm
    assert "use_qk_norm" in command_r_plus.no_head_chunks and replace(command_r_plus, head_chunks_option="").head_chunks_ok
    ck = Features(checkpoint_every=1, tiled_mlp=True, tiled_logits=True, offload_activations=True)
    lean = {n: af.peak_bytes(same_as_llama, 2**20, 8, 8, replace(ck, attention_head_chunks=n), OFF, "bf16", "cuda")
            for n in (1, 2)}
    budget = budget_for(lean[2])  # fits in 2 chunks only
    assert lean[1] > lean[2]
    kw = dict(sp=8, offloads=OFF, ranks_per_node=8)
    assert af.choose(same_as_llama, 2**20, 8, budget, **kw).features.attention_head_chunks > 1
    try:
        got = af.choose(olmo, 2**20, 8, budget, **kw).features.attention_head_chunks
    except ValueError as e:  # nothing else fits: the one-line refusal, not a plan that crashes
        assert "nothing fits" in str(e)
    else:
        assert got == 1
