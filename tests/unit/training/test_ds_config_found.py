"""DeepSpeed JSONs as found in other projects (Axolotl's deepspeed_configs, transformers' tests, DeepSpeedExamples,
the ALST tutorial), through the project's own config path (parse_config / load_run_config, build_ds_config) in one
process: what each did before (a late crash, a silent change, a false refusal) is now taken, or refused in one line
at start (an audit of 16 such files, reproduced here in their relevant keys)."""

from __future__ import annotations

import json

import pytest

from base.parallel import ParallelDims
from training.config import parse_config
from training.ds_config import build_ds_config

DIMS = ParallelDims(world=2, sp=1, rank=0, local_rank=0)
BASE = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
        "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                              "stage3_param_persistence_threshold": "auto"}}


def write(tmp_path, ds: dict, name: str = "ds.json") -> str:
    p = tmp_path / name
    p.write_text(json.dumps(ds))
    return str(p)


def build(tmp_path, ds: dict, flags=(), bf16: bool = True, **kw) -> dict:
    cfg = parse_config(["--deepspeed", write(tmp_path, ds), *flags])
    return build_ds_config(cfg, DIMS, bf16=bf16, hidden_size=64, planning=True, **kw)


# --- 1: monitors that log beside the run's own W&B ---

def test_a_wandb_monitor_block_is_refused_only_beside_the_runs_own_wandb(tmp_path, capsys):
    """DeepSpeed's WandbMonitor logged into this run's W&B run at step = samples seen: every record of the run (at
    the optimizer step, a lower number) was dropped by W&B. With --report_to none it is the user's only W&B logging
    (no clash): it passes with one note a run; comet (no Comet reporter here) passes with none."""
    block = {"enabled": True, "project": "ds-monitor"}
    with pytest.raises(ValueError, match=r'"wandb" monitor block .*drop the block .*or keep it with --report_to none') \
            as e:
        build(tmp_path, {**BASE, "wandb": block}, flags=("--report_to", "wandb"))
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match='"wandb" monitor block'):  # a stage's override alike
        build(tmp_path, BASE, flags=("--report_to", "wandb"), overrides={"wandb": {"enabled": True}})
    capsys.readouterr()
    for _ in range(2):  # one note a run, not one per stage
        assert build(tmp_path, {**BASE, "wandb": block}, flags=("--report_to", "none"))["wandb"] == block
    out = capsys.readouterr().out
    assert out.count('"wandb" monitor block is this run\'s only W&B logging (--report_to none)') == 1, out
    for report in ("wandb", "none"):
        assert build(tmp_path, {**BASE, "comet": block}, flags=("--report_to", report))["comet"] == block
    assert "comet" not in capsys.readouterr().out
    kept = {"enabled": True, "output_path": str(tmp_path), "job_name": "x"}
    ds = build(tmp_path, {**BASE, "tensorboard": kept, "csv_monitor": kept, "wandb": {"enabled": False}})
    assert ds["tensorboard"] == kept and ds["csv_monitor"] == kept


# --- 2: ZeRO++ hpZ ---

def test_zeropp_hpz_is_refused_for_a_curriculum_only(tmp_path, capsys):
    """zero_hpz_partition_size > 1 trained stage 0 and crashed building stage 1's engine ("ZeRO parameter intra
    parallel group is already initialized": once per process in DeepSpeed). A one-stage run builds one engine: it
    passes, with one note that the memory plan does not count the secondary partition (it was refused too)."""
    tutorial = {"reduce_scatter": True, "zero_quantized_weights": True, "zero_hpz_partition_size": 16,
                "zero_quantized_gradients": True}  # the ZeRO++ tutorial's block
    hpz = {**BASE, "zero_optimization": {**BASE["zero_optimization"], **tutorial}}
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"deepspeed: {write(tmp_path, hpz, 'hpz.json')}\nstages:\n  - name: a\n  - name: b\n")
    with pytest.raises(ValueError, match=r"zero_hpz_partition_size 16 \(ZeRO\+\+ hpZ\) cannot run 2 stages: .*one "
                                         r"engine per stage.*keep it for a one-stage run$") as e:
        build_ds_config(parse_config(["--config", str(recipe)]), DIMS, bf16=True, hidden_size=64, planning=True)
    assert "\n" not in str(e.value)
    capsys.readouterr()
    for _ in range(2):
        assert build(tmp_path, hpz)["zero_optimization"]["zero_hpz_partition_size"] == 16
    out = capsys.readouterr().out
    assert out.count("zero_hpz_partition_size 16 (ZeRO++ hpZ): the memory plan does not count its secondary "
                     "partition") == 1, out
    quantized = {k: v for k, v in tutorial.items() if k != "zero_hpz_partition_size"}
    ds = build(tmp_path, {**BASE, "zero_optimization": {**BASE["zero_optimization"], **quantized,
                                                        "zero_hpz_partition_size": 1}})
    assert ds["zero_optimization"]["zero_quantized_weights"] is True  # left to DeepSpeed


# --- 3: checkpoint.load_universal ---

def test_load_universal_key_is_dropped_with_one_note(tmp_path, capsys):
    """The JSON's load_universal made the first load universal: a same-world resume or stage change crashed."""
    ds = {**BASE, "checkpoint": {"load_universal": True, "use_node_local_storage": False}}
    path = write(tmp_path, ds)
    cfg = parse_config(["--deepspeed", path])
    for _ in range(2):  # one note a run, not one per stage
        built = build_ds_config(cfg, DIMS, bf16=True, hidden_size=64, planning=True)
        assert built["checkpoint"] == {"use_node_local_storage": False}
    out = capsys.readouterr().out
    assert out.count("checkpoint.load_universal is dropped") == 1


def test_a_same_world_load_is_never_universal(tmp_path):
    """checkpoint_load.Loader.load set load_universal_checkpoint only when the world changed: an engine whose config said True
    (the JSON's key) loaded a same-world checkpoint as universal. Now set for every load, from the world sizes."""
    from tests.unit.training.test_checkpoint import LoadEngine, model_bytes, save
    from training.checkpoint import Checkpointer

    ck = Checkpointer(str(tmp_path), keep=3)
    path = save(ck, 2)  # written by this world (one rank)
    engine = LoadEngine()
    engine._config.load_universal_checkpoint = True
    ck.load(engine, path)
    assert engine.loaded == [(False, model_bytes(path))]


# --- 4: the legacy "bfloat16" section ---

def test_legacy_bfloat16_section_is_bf16(tmp_path):
    """DeepSpeed reads bf16 and falls back to bfloat16: `{"enabled": false}` there trained bf16 unseen (the fill set
    bf16), `"auto"` there (transformers' ds_config_zero3_bf16.json) was refused as not derived."""
    from deepspeed.runtime.config import DeepSpeedConfig

    legacy = {k: v for k, v in BASE.items() if k != "bf16"}
    ds = build(tmp_path, {**legacy, "bfloat16": {"enabled": "auto"}})
    assert "bfloat16" not in ds and ds["bf16"] == {"enabled": True}
    ds = build(tmp_path, {**legacy, "bfloat16": {"enabled": False}}, bf16=False)
    assert "bfloat16" not in ds and DeepSpeedConfig({**ds, "train_batch_size": 1}).bfloat16_config.enabled is False
    with pytest.raises(ValueError, match=r"bf16.enabled=False but --bf16 gives True"):  # as bf16 false is
        build(tmp_path, {**legacy, "bfloat16": {"enabled": False}})
    with pytest.raises(ValueError, match=r'both bf16 \{"enabled": "auto"\} and its older name bfloat16'):
        parse_config(["--deepspeed", write(tmp_path, {**BASE, "bfloat16": {"enabled": False}})])
    ds = build(tmp_path, BASE, bf16=False, overrides={"bfloat16": {"enabled": False}})  # a stage's override too
    assert "bfloat16" not in ds and ds["bf16"] == {"enabled": False}


# --- 5: DeepSpeed's field names for the ZeRO-3 buckets ---

def test_zero3_bucket_autos_under_either_name_are_filled(tmp_path):
    """Axolotl's zero3_bf16.json writes prefetch_bucket_size / param_persistence_threshold (the pydantic names of
    stage3_*): "auto" there was refused as not derived."""
    zero = {"stage": 3, "reduce_bucket_size": "auto", "prefetch_bucket_size": "auto",
            "param_persistence_threshold": "auto", "max_live_parameters": 0, "max_reuse_distance": 0,
            "gather_16bit_weights_on_model_save": True}
    ds = build(tmp_path, {**BASE, "zero_optimization": zero})
    assert (ds["zero_optimization"]["prefetch_bucket_size"], ds["zero_optimization"]["param_persistence_threshold"]) \
        == (int(0.9 * 64 * 64), 10 * 64)
    ours = build(tmp_path, BASE)["zero_optimization"]
    assert (ours["stage3_prefetch_bucket_size"], ours["stage3_param_persistence_threshold"]) == (3686, 640)


# --- 6, 7: what the JSON decides where no flag did ---

def test_json_bf16_true_is_taken_by_a_cpu_dry_run(tmp_path):
    """`bf16.enabled: true` (Axolotl's zero3_bf16.json) was refused by a CPU --dry_run, whose default is fp32,
    though no flag asked for it; fp16: true was taken already. A flag still wins, and is then a contradiction."""
    from training.startup import load_run_config

    path = write(tmp_path, {**BASE, "bf16": {"enabled": True}})
    cfg, model = load_run_config(["--deepspeed", path, "--dry_run", "--nodes", "1", "--gpus_per_node", "2"])
    assert model.bf16 is True
    assert build_ds_config(cfg, DIMS, model.bf16, 64, planning=True)["bf16"] == {"enabled": True}
    cfg = parse_config(["--deepspeed", path, "--dry_run", "--no-bf16"])
    with pytest.raises(ValueError, match="bf16.enabled=True but --bf16 gives False"):
        build_ds_config(cfg, DIMS, False, 64, planning=True)
    assert parse_config(["--deepspeed", write(tmp_path, BASE), "--dry_run"]).bf16 is None  # "auto": the default


def test_deepspeeds_own_sequence_parallel_size_sets_the_degree(tmp_path):
    """The ALST tutorial's top-level sequence_parallel_size was refused against the flag's default 1, while the
    project's sequence_parallelism block and the JSON's micro batch were taken."""
    alst = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, "sequence_parallel_size": 2}
    path = write(tmp_path, alst)
    cfg = parse_config(["--deepspeed", path])
    assert cfg.sequence_parallel_size == 2
    ds = build_ds_config(cfg, ParallelDims(world=2, sp=2, rank=0, local_rank=0), bf16=False, hidden_size=64)
    assert ds["sequence_parallel_size"] == 2
    with pytest.raises(ValueError, match=r"--sequence_parallel_size 4 contradicts .* sequence_parallel_size 2: "):
        parse_config(["--deepspeed", path, "--sequence_parallel_size", "4"])
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"deepspeed: {path}\nstages:\n  - sequence_parallel_size: 4\n")
    with pytest.raises(ValueError, match=r"stages\[0\] sets sequence_parallel_size 4 but .* sequence_parallel_size "
                                         r"is 2"):
        parse_config(["--config", str(recipe)])
    assert parse_config(["--deepspeed", write(tmp_path, {**alst, "sequence_parallel_size": "auto"})]) \
        .sequence_parallel_size == 1


def test_two_sp_keys_that_disagree_are_refused(tmp_path):
    """The project's sequence_parallelism block (degree 2) beside DeepSpeed's sequence_parallel_size 1: the first one
    was taken silently (settle_from_file's `given` is not updated after the first). Agreeing keys pass."""
    both = {**BASE, "sequence_parallelism": {"enabled": True, "degree": 2}, "sequence_parallel_size": 1}
    with pytest.raises(ValueError, match=r"ds.json: sequence_parallelism degree 2 and sequence_parallel_size 1 name "
                                         r"two SP degrees: keep one of the keys \(or make them agree\)$"):
        parse_config(["--deepspeed", write(tmp_path, both)])
    assert parse_config(["--deepspeed", write(tmp_path, {**both, "sequence_parallel_size": 2})]) \
        .sequence_parallel_size == 2


# --- 8: gradient accumulation dtype ---

def test_gradients_accumulate_in_fp32_under_bf16_and_fp16(tmp_path):
    """DeepSpeed sums the micro-steps' gradients in the model's dtype unless data_types.grad_accum_dtype names one:
    bf16 summed 16-64 micro-steps with 4e-3..9e-3 relative error (an audit's measurement, ~1e-7 in fp32)."""
    from deepspeed.runtime.config import DeepSpeedConfig

    for flags, bf16 in (((), True), (("--fp16", "--no-bf16", "--dry_run"), False)):
        ds = build(tmp_path, BASE, flags=("--gradient_accumulation_steps", "16", *flags), bf16=bf16)
        assert ds["data_types"] == {"grad_accum_dtype": "fp32"}
        assert DeepSpeedConfig({**ds, "train_batch_size": 16}).grad_accum_dtype == "fp32"
    assert "data_types" not in build(tmp_path, BASE, bf16=False)  # fp32 training: already fp32
    named = build(tmp_path, {**BASE, "data_types": {"grad_accum_dtype": "bf16"}})
    assert named["data_types"] == {"grad_accum_dtype": "bf16"}  # the JSON's choice stands


# --- 9: scheduler blocks (dropped: each stage's own schedule, training/schedule.py) ---

AUTO = "auto"
SHIPPED = {  # pin nothing: pass, with the type's shape said in the warning
    # transformers' docs and tests/deepspeed/ds_config_zero3.json, ds_configs/hf_zero3_offload.json
    "hf_warmuplr": ({"type": "WarmupLR", "params": {"warmup_min_lr": AUTO, "warmup_max_lr": AUTO,
                                                    "warmup_num_steps": AUTO}}, "constant"),
    "hf_docs_warmupdecaylr": ({"type": "WarmupDecayLR", "params": {
        "last_batch_iteration": -1, "total_num_steps": AUTO, "warmup_min_lr": AUTO, "warmup_max_lr": AUTO,
        "warmup_num_steps": AUTO}}, "linear"),
    "decay_from_0": ({"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": AUTO,
                                                          "warmup_num_steps": AUTO, "total_num_steps": AUTO}}, "linear"),
    "cosine_autos": ({"type": "WarmupCosineLR", "params": {"warmup_num_steps": AUTO, "total_num_steps": AUTO}}, "cosine"),
}


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_scheduler_blocks_as_shipped_train_with_their_shape_said(tmp_path, capsys, name):
    """Hugging Face's all-"auto" blocks (and a 0 start, what its Trainer fills) pin no schedule: they pass, and the
    warning names the flag of their type's shape where it is not the run's (it said only "ignored")."""
    block, shape = SHIPPED[name]
    assert "scheduler" not in build(tmp_path, {**BASE, "scheduler": block}, flags=("--warmup_steps", "5"))
    out = capsys.readouterr().out
    lines = [x for x in out.splitlines() if '"scheduler" block is ignored' in x]
    assert len(lines) == 1 and "its warmup is linear here (DeepSpeed's default warmup_type is log)" in lines[0], out
    assert (f"--lr_scheduler {shape} gives that" in lines[0]) == (shape != "cosine"), lines[0]
    build(tmp_path, {**BASE, "scheduler": block}, flags=("--lr_scheduler", shape))
    assert "gives that" not in capsys.readouterr().out
    # with a floor, as the shipped 128k -> 1M recipes set (min_lr 2e-6): an "auto" or 0 end pins none (was refused)
    build(tmp_path, {**BASE, "scheduler": block}, flags=("--min_lr", "2e-6"))
    build(tmp_path, {**BASE, "scheduler": block}, flags=("--lr_scheduler", shape, "--min_lr", "2e-6"))


@pytest.mark.parametrize("params, line, flags", [
    # WarmupLR: constant after the warmup (it trained a cosine to 0: its peak and warmup were the run's defaults)
    ({"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 2e-5, "warmup_num_steps": 0}},
     r"type WarmupLR: warmup, then constant, this run --lr_scheduler cosine\): .* give --lr_scheduler constant, or "
     r"drop the block", ["--lr_scheduler", "constant"]),
    # WarmupDecayLR to 1e-5 over 1000 steps (trained cosine to 0 over 100)
    ({"type": "WarmupDecayLR", "params": {"warmup_min_lr": 1e-5, "warmup_max_lr": AUTO, "warmup_num_steps": AUTO,
                                          "total_num_steps": 1000}},
     r"total_num_steps=1000: this run --max_steps 100; warmup_min_lr=1e-05: the decay's end, this run --min_lr 0.0\)"
     r".* give --lr_scheduler linear --max_steps 1000 --min_lr 1e-05,", ["--lr_scheduler", "linear", "--max_steps",
                                                                         "1000", "--min_lr", "1e-5"]),
    # WarmupCosineLR to 0.1 x lr
    ({"type": "WarmupCosineLR", "params": {"total_num_steps": 5000, "warmup_num_steps": 0, "cos_min_ratio": 0.1,
                                           "warmup_min_ratio": 0.0}},
     r"cos_min_ratio=0.1: the decay's end 2e-06, this run --min_lr 0.0\).* give --max_steps 5000 --min_lr 2e-06,",
     ["--max_steps", "5000", "--min_lr", "2e-6"]),
    # a log warmup, a warmup from above 0: no flag does them
    ({"type": "WarmupLR", "params": {"warmup_type": "log", "warmup_min_lr": 1e-6}},
     r"warmup_min_lr=1e-06: the warmup's start.*warmup_type=log: this run's warmup is linear\).* set warmup_min_lr 0 "
     r"and set warmup_type \"linear\", or drop", ["--lr_scheduler", "constant", "--warmup_steps", "0"]),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 1e-6, "cycle_max_lr": 1e-4}},
     r"scheduler type 'OneCycle' has no counterpart here: .*drop the block", None),
])
def test_scheduler_blocks_of_another_schedule_are_one_line(tmp_path, params, line, flags):
    """Each was dropped with one warning and the run trained a cosine to --min_lr 0 over --max_steps (the audit's
    WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle): refused in one line naming the flags of its schedule; with
    them given, it passes. A log warmup or a warmup from above 0 (nothing here does them) is refused while there is
    a warmup."""
    ds = {**BASE, "scheduler": params}
    with pytest.raises(ValueError, match=line) as e:
        build(tmp_path, ds, flags=("--warmup_steps", "5") if "warmup_type" in params["params"] else ())
    assert "\n" not in str(e.value)
    if flags is not None:
        assert "scheduler" not in build(tmp_path, ds, flags=flags)
