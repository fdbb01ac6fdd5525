"""DeepSpeed configs as users have them: no optimizer block, Hugging Face's ZeRO-3 "auto" example, a
`sequence_parallelism` block, fp16 blocks. Unit tests of the resolution, then two short 2-rank SP=2 runs of
train.py: the HF config trains, and a config without an optimizer block gives the same step losses as the
project's own zero3_offload.json (the AdamW built from the flags is the one DeepSpeed builds from the JSON)."""

from __future__ import annotations

import glob
import json
import math
import os

import pytest

from base.parallel import ParallelDims
from tests.distributed import ROOT, run
from tests.runs import TRAIN, losses, train_args
from training.config import parse_config
from training.ds_config import build_ds_config, make_optimizer, optimizer_spec

HF = os.path.join(ROOT, "ds_configs/hf_zero3_offload.json")
OURS = os.path.join(ROOT, "ds_configs/zero3_offload.json")
DIMS = ParallelDims(world=2, sp=2, rank=0, local_rank=0)


def write(tmp_path, ds: dict, name="ds.json") -> str:
    p = tmp_path / name
    p.write_text(json.dumps(ds))
    return str(p)


def without_optimizer(tmp_path) -> str:
    with open(OURS) as fh:
        ds = json.load(fh)
    del ds["optimizer"]
    return write(tmp_path, ds, "no_optimizer.json")


def resolve(argv, bf16=False):
    cfg = parse_config(argv)
    return cfg, build_ds_config(cfg, DIMS, bf16=bf16, hidden_size=64)


# --- no optimizer block ---

def test_no_optimizer_block_gets_cpu_adam_from_flags_when_offloaded(tmp_path):
    cfg, ds = resolve(["--deepspeed", without_optimizer(tmp_path), "--learning_rate", "3e-4", "--weight_decay", "0.1"])
    assert "optimizer" not in ds
    assert optimizer_spec(ds, cfg) == {"type": "DeepSpeedCPUAdam", "lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8,
                                       "weight_decay": 0.1}
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    opt = make_optimizer(ds, cfg, [torch.nn.Parameter(torch.zeros(4))])
    assert isinstance(opt, DeepSpeedCPUAdam) and opt.adam_w_mode
    group = opt.param_groups[0]
    assert (group["lr"], tuple(group["betas"]), group["eps"], group["weight_decay"]) == (3e-4, (0.9, 0.95), 1e-8, 0.1)


def test_no_optimizer_block_without_offload_on_cpu_is_torch_adamw(tmp_path):
    cfg, ds = resolve(["--deepspeed", write(tmp_path, {"zero_optimization": {"stage": 3}})])
    assert optimizer_spec(ds, cfg)["type"] == "AdamW"
    import torch

    assert type(make_optimizer(ds, cfg, [torch.nn.Parameter(torch.zeros(4))])) is torch.optim.AdamW


def test_optimizer_block_is_left_to_deepspeed():
    cfg, ds = resolve(["--deepspeed", OURS])
    assert optimizer_spec(ds, cfg) is None and make_optimizer(ds, cfg, []) is None


# --- Hugging Face's ZeRO-3 offload example ---

def leaves(d, prefix=""):
    for k, v in d.items():
        yield from leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else [(f"{prefix}{k}", v)]


@pytest.mark.parametrize("drop_bf16", [False, True], ids=["as_committed", "docs_example_without_bf16"])
def test_hf_canonical_config_resolves_fully(tmp_path, capsys, drop_bf16):
    path = HF
    if drop_bf16:  # the HF docs' ZeRO-3 example itself has no bf16 block
        with open(HF) as fh:
            ds = json.load(fh)
        del ds["bf16"]
        path = write(tmp_path, ds)
    cfg, ds = resolve(["--deepspeed", path, "--learning_rate", "1e-4", "--weight_decay", "0.01",
                       "--gradient_accumulation_steps", "2", "--sequence_parallel_size", "2"])
    assert not [k for k, v in leaves(ds) if v == "auto"]
    assert "scheduler" not in ds
    out = capsys.readouterr().out.strip().splitlines()
    assert len([x for x in out if "scheduler" in x]) == 1 and "its own per-stage schedule" in out[0]
    # HF's Trainer fills "auto" betas with (0.9, 0.999): the other choice here is said (it was not)
    assert len([x for x in out if 'betas "auto" is [0.9, 0.95] here' in x]) == 1, out
    assert ds["optimizer"]["params"] == {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01}
    assert ds["fp16"]["enabled"] is False and ds["bf16"]["enabled"] is False
    assert ds["train_batch_size"] == 2 and ds["gradient_accumulation_steps"] == 2 and ds["gradient_clipping"] == 1.0
    assert ds["zero_optimization"]["reduce_bucket_size"] == 64 * 64
    assert optimizer_spec(ds, cfg) is None  # the block is there: DeepSpeed builds it


def test_concrete_betas_are_kept(tmp_path):
    path = write(tmp_path, {"optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": [0.8, 0.999]}},
                            "zero_optimization": {"stage": 3}})
    _, ds = resolve(["--deepspeed", path])
    assert ds["optimizer"]["params"]["betas"] == [0.8, 0.999] and "eps" not in ds["optimizer"]["params"]


# --- sequence_parallelism block (as the seed build guide writes it) ---

def sp_file(tmp_path, block):
    return write(tmp_path, {"zero_optimization": {"stage": 3}, "sequence_parallelism": block})


def test_sp_block_sets_the_degree_when_flags_leave_it(tmp_path):
    path = sp_file(tmp_path, {"enabled": True, "degree": 2, "sequence_parallel_type": "ulysses"})
    cfg = parse_config(["--deepspeed", path])
    assert cfg.sequence_parallel_size == 2
    assert parse_config(["--deepspeed", path, "--sequence_parallel_size", "2"]).sequence_parallel_size == 2
    ds = build_ds_config(cfg, DIMS, bf16=False, hidden_size=64)
    assert "sequence_parallelism" not in ds and ds["sequence_parallel_size"] == 2
    assert parse_config(["--deepspeed", sp_file(tmp_path, {"enabled": False, "degree": 8})]).sequence_parallel_size == 1


def test_sp_block_from_recipe_and_contradictions(tmp_path):
    path = sp_file(tmp_path, {"enabled": True, "degree": 2})
    with pytest.raises(ValueError, match=r"--sequence_parallel_size 4 contradicts .* sequence_parallelism degree 2") as e:
        parse_config(["--deepspeed", path, "--sequence_parallel_size", "4"])
    assert "\n" not in str(e.value)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"deepspeed: {path}\nsequence_parallel_size: 1\n")  # the recipe sets it too: must agree
    with pytest.raises(ValueError, match="--sequence_parallel_size 1 contradicts"):
        parse_config(["--config", str(recipe)])
    recipe.write_text(f"deepspeed: {path}\nstages:\n  - sequence_parallel_size: 4\n")
    with pytest.raises(ValueError, match=r"stages\[0\] sets sequence_parallel_size 4 but .* degree is 2"):
        parse_config(["--config", str(recipe)])
    with pytest.raises(ValueError, match="only \"ulysses\""):
        parse_config(["--deepspeed", sp_file(tmp_path, {"degree": 2, "sequence_parallel_type": "ring"})])
    with pytest.raises(ValueError, match="unknown key"):
        parse_config(["--deepspeed", sp_file(tmp_path, {"degre": 2})])


# --- precision ---

def test_a_stages_overrides_are_checked_as_the_file_is(tmp_path):
    """A stage's deepspeed_overrides `bf16: true` (not an object) was an AttributeError traceback in the fill; its
    `sequence_parallelism` block was dropped without a word (the stage ran at SP 1); an NVMe offload without its
    nvme_path passed the start-up checks and failed at the model build (DeepSpeed's assertion). One line each now
    (a helper's audit, reproduced)."""
    from training.ds_config import validate

    cfg = parse_config(["--deepspeed", OURS])
    with pytest.raises(ValueError, match=r"with the stage's deepspeed_overrides: bf16 is a bool, not an object"):
        build_ds_config(cfg, DIMS, bf16=False, hidden_size=64, overrides={"bf16": True})
    with pytest.raises(ValueError, match=r"^deepspeed_overrides: sequence_parallelism .*its sequence_parallel_size"):
        build_ds_config(cfg, DIMS, bf16=False, hidden_size=64, overrides={"sequence_parallelism": {"degree": 2}})
    with pytest.raises(ValueError, match=r"offload_param.device nvme needs its nvme_path"):
        build_ds_config(cfg, DIMS, bf16=False, hidden_size=64,
                        overrides={"zero_optimization": {"offload_param": {"device": "nvme"}}})
    ds = build_ds_config(cfg, DIMS, bf16=False, hidden_size=64, overrides={"zero_optimization": {
        "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}}})
    validate(ds, "stage 0")  # with its folder: DeepSpeed's own checks pass


def test_fp16_auto_is_off_and_fp16_is_refused_on_cpu(tmp_path):
    _, ds = resolve(["--deepspeed", HF])
    assert ds["fp16"]["enabled"] is False
    with pytest.raises(ValueError, match="fp16 needs a GPU with loss scaling: use --bf16 or fp32 on CPU"):
        parse_config(["--fp16"])
    with pytest.raises(ValueError, match="--fp16 and --bf16 are both on"):
        parse_config(["--fp16", "--bf16"])
    seed = write(tmp_path, {"zero_optimization": {"stage": 3}, "fp16": {"enabled": True}})  # the seed guide's block
    with pytest.raises(ValueError, match="fp16 needs a GPU"):
        parse_config(["--deepspeed", seed])
    cfg = parse_config(["--deepspeed", seed, "--dry_run"])  # planning for a GPU cluster from a laptop
    assert cfg.fp16 and cfg.bf16 is False
    cfg = parse_config(["--deepspeed", seed, "--no-fp16"])  # the flag says no: a conflict, named when built
    with pytest.raises(ValueError, match="fp16.enabled=True but --fp16 gives False"):
        build_ds_config(cfg, DIMS, bf16=False, hidden_size=64)


# --- end to end: 2 ranks, SP=2, 3 steps ---

def train(assets, tmp_path, name, ds_path):
    out = tmp_path / name
    run(TRAIN, train_args(assets, out, sp=2, steps=3, extra=["--deepspeed", ds_path, "--weight_decay", "0.1"]), 2,
        str(tmp_path / f"{name}_logs"))
    return losses(out)


def adam_state(out, rank: int):
    """This rank's Adam hyper-parameters and moments from the run's final checkpoint (DeepSpeed's own file)."""
    import torch

    (path,) = glob.glob(os.path.join(out, "checkpoints", "step_*", f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"))
    sd = torch.load(path, map_location="cpu", weights_only=False)["optimizer_state_dict"]["optimizer_state_dict"]
    groups = [{k: list(v) if k == "betas" else v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]
    return groups, [(st["exp_avg"], st["exp_avg_sq"]) for st in sd["state"].values()]


@pytest.mark.dist
def test_hf_canonical_config_trains(assets, tmp_path):
    got = train(assets, tmp_path, "hf", HF)
    assert sorted(got) == [1, 2, 3] and all(math.isfinite(v) for v in got.values()), got
    with open(tmp_path / "hf" / "ds_config.stage0.json") as fh:
        used = json.load(fh)
    assert "scheduler" not in used and used["optimizer"]["params"]["betas"] == [0.9, 0.95]


@pytest.mark.slow  # two 3-step runs (~40 s); the HF canonical config's run stays fast
@pytest.mark.dist
def test_no_optimizer_block_matches_project_config(assets, tmp_path):
    import torch

    ours = train(assets, tmp_path, "ours", OURS)
    flags = train(assets, tmp_path, "flags", without_optimizer(tmp_path))
    assert sorted(flags) == [1, 2, 3] and all(math.isfinite(v) for v in flags.values()), flags
    for step in (1, 2, 3):
        assert abs(flags[step] - ours[step]) <= 1e-5 * abs(ours[step]), (step, flags, ours)
    # three steps barely feel beta2 in the loss; the Adam moments and hyper-parameters do
    for rank in (0, 1):
        (g_ours, m_ours), (g_flags, m_flags) = adam_state(tmp_path / "ours", rank), adam_state(tmp_path / "flags", rank)
        assert g_flags == g_ours and g_ours[0]["weight_decay"] == 0.1
        for (a, b), (c, d) in zip(m_flags, m_ours, strict=True):
            assert torch.allclose(a, c, rtol=1e-6, atol=0) and torch.allclose(b, d, rtol=1e-6, atol=0)


def test_arch_specific_cuda_arch_list_is_made_readable_for_deepspeed(monkeypatch):
    """TORCH_CUDA_ARCH_LIST=9.0a (an H200 image here sets it) made DeepSpeed's JIT builder raise ValueError
    ('0a') before the first step of a run without optimizer offload; importing `training` rewrites it."""
    import subprocess
    import sys

    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder

    from base.env import deepspeed_arch_list

    assert deepspeed_arch_list("9.0a 10.0f+PTX;9.0") == "9.0;10.0+PTX"
    assert deepspeed_arch_list("8.0;8.6") == "8.0;8.6"
    builder = FusedAdamBuilder()
    builder.jit_mode = True
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a;10.0f")
    with pytest.raises(ValueError, match="0a"):
        builder.compute_capability_args()
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", deepspeed_arch_list("9.0a;10.0f"))
    builder.compute_capability_args()

    env = dict(os.environ, TORCH_CUDA_ARCH_LIST="9.0a")
    code = "import os; from base.env import configure; configure(); print(os.environ['TORCH_CUDA_ARCH_LIST'])"
    out = subprocess.run([sys.executable, "-c", code],
                         cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert out == "9.0"


def test_one_ninja_builds_every_op():
    """base.env.configure puts the interpreter's folder first on PATH, so torch's JIT build runs the venv's ninja
    whether or not the shell activated it (two ninjas record builds differently and rebuild each other's: minutes of
    every rank's start). The old configure left PATH as it was (a plain `.venv/bin/python` found /usr/bin/ninja)."""
    import subprocess
    import sys

    here = os.path.dirname(sys.executable)
    env = dict(os.environ, PATH=os.pathsep.join(["/usr/bin", "/bin", here]))
    code = "import os; from base.env import configure; configure(); print(os.environ['PATH'])"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         check=True).stdout.strip().split(os.pathsep)
    assert out == [here, "/usr/bin", "/bin"], out


def test_deepspeed_asks_for_the_cpu_once_per_process(monkeypatch):
    """DeepSpeed's CPU Adam (at each build) and its op builder (-march, SIMD flag) each call py-cpuinfo, which starts
    two processes per call (~1.1 CPU-s): 3 per rank at its first engine, one more per later engine. After
    base.env.ask_cpu_once (build_engine's first step) py-cpuinfo is asked once and each caller gets its own copy of
    the answer; on Linux without py-cpuinfo's CPUID probe (0 full asks). Before: every call below asked in full (6
    asks)."""
    import cpuinfo
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from deepspeed.ops.op_builder import CPUAdamBuilder

    from base.env import ask_cpu_once, cpu_info_without_cpuid

    asks = []

    def counted():
        asks.append(1)
        return real()

    real = cpuinfo.get_cpu_info
    monkeypatch.setattr(cpuinfo, "get_cpu_info", counted)
    ask_cpu_once()
    ask_cpu_once()  # again: still one ask
    first = cpuinfo.get_cpu_info()
    first["flags"] = []  # a caller editing its answer does not edit the next caller's
    builder = CPUAdamBuilder()
    assert builder.cpu_arch() and builder.simd_width()
    DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(4))])
    assert len(asks) == (0 if cpu_info_without_cpuid() else 1), len(asks)
    assert cpuinfo.get_cpu_info()["arch"] == first["arch"] and cpuinfo.get_cpu_info()["flags"] != []


def test_the_cpu_without_cpuid_builds_deepspeeds_ops_with_the_same_flags(monkeypatch):
    """ask_cpu_once's answer leaves out py-cpuinfo's CPUID probe (1 of its 1.1 CPU-s). DeepSpeed's op builder derives
    the same -march and SIMD flag from it as from the full answer, and the vendor and arch are the same: a
    different one would change the build flags' hash, and torch would rebuild the op at every rank's start."""
    import cpuinfo
    from deepspeed.ops.op_builder import CPUAdamBuilder

    from base.env import cpu_info_without_cpuid

    full, fast = cpuinfo.get_cpu_info(), cpu_info_without_cpuid()
    if not fast:  # not Linux: the full ask runs, nothing to compare
        pytest.skip("no /proc/cpuinfo answer here")
    assert (fast["arch"], fast["vendor_id_raw"]) == (full["arch"], full["vendor_id_raw"])
    builder, derived = CPUAdamBuilder(), []
    for answer in (full, fast):
        monkeypatch.setattr(cpuinfo, "get_cpu_info", lambda answer=answer: answer)
        derived.append((builder.cpu_arch(), builder.simd_width()))
    assert derived[0] == derived[1], derived


def test_gradients_are_reduced_in_fp32_under_bf16():
    """DeepSpeed reduces gradients in seq_parallel_communication_data_type when SP > 1 and in
    communication_data_type otherwise: both fp32 under bf16 training unless the JSON names one."""
    import torch
    from deepspeed.runtime.config import DeepSpeedConfig

    cfg = parse_config(["--deepspeed", "ds_configs/zero3_offload.json", "--bf16"])
    for sp in (1, 2):
        ds = build_ds_config(cfg, ParallelDims(world=2, sp=sp, rank=0, local_rank=0), True, 64, planning=True)
        parsed = DeepSpeedConfig({**ds, "train_batch_size": ds["train_micro_batch_size_per_gpu"]})
        assert parsed.communication_data_type == torch.float32
        assert parsed.seq_parallel_communication_data_type == torch.float32
    ds = build_ds_config(cfg, ParallelDims(world=2, sp=2, rank=0, local_rank=0), True, 64, planning=True,
                         overrides={"communication_data_type": "bf16"})
    assert ds["communication_data_type"] == "bf16"  # the user's choice stands, at SP > 1 too (DeepSpeed reduces in
    assert DeepSpeedConfig({**ds, "train_batch_size": 1}).seq_parallel_communication_data_type == torch.bfloat16  # it)


def test_blocks_this_run_would_not_honour_are_one_line(tmp_path):
    """A scheduler block's concrete peak LR / warmup (it was dropped with a warning: WarmupDecayLR's 3e-4 trained at
    the default 2e-5), an activation_checkpointing block (nothing calls deepspeed.checkpointing), a block DeepSpeed
    removed (its own error escaped as a traceback): one line each; the run's own values pass."""
    with open(OURS) as fh:
        base = json.load(fh)
    sched = {"type": "WarmupDecayLR", "params": {"warmup_max_lr": 3e-4, "warmup_num_steps": 2000,
                                                 "total_num_steps": 100000}}
    path = write(tmp_path, {**base, "scheduler": sched})
    with pytest.raises(ValueError, match=r"its scheduler block is not what this run trains \(type WarmupDecayLR: "
                                         r"warmup, then a linear decay .*warmup_max_lr=0.0003: this run --learning_rate "
                                         r"2e-05; .*give --lr_scheduler linear --learning_rate 0.0003 --warmup_steps "
                                         r"2000 --max_steps 100000, or drop the block"):
        resolve(["--deepspeed", path])
    assert "scheduler" not in resolve(["--deepspeed", path, "--learning_rate", "3e-4", "--warmup_steps", "2000",
                                       "--lr_scheduler", "linear", "--max_steps", "100000"])[1]
    ckpt = write(tmp_path, {**base, "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True}})
    with pytest.raises(ValueError, match="activation_checkpointing block acts only through deepspeed.checkpointing"):
        resolve(["--deepspeed", ckpt])
    removed = write(tmp_path, {**base, "sparse_attention": {"mode": "fixed", "block": 16}})
    with pytest.raises(ValueError, match="DeepSpeed rejects the config: .*Sparse Attention has been removed"):
        resolve(["--deepspeed", removed])


@pytest.mark.parametrize("text, line", [
    ("{bad json", "not valid JSON (Expecting property name"),  # json's words named no file
    ("[]", "a list, not an object of sections"),  # was an AttributeError traceback
    ('{"zero_optimization": []}', "zero_optimization is a list, not an object"),  # the same, later
    ('{"gradient_accumulation_steps": "auto", "gradient_accumulation_steps": 4}',  # json kept the last: DeepSpeed's
     "key(s) ['gradient_accumulation_steps'] given twice in one object"),  # own loader refuses it
])
def test_a_deepspeed_json_that_is_not_an_object_of_sections_is_one_line(tmp_path, text, line):
    from training.config import parse_config

    path = tmp_path / "ds.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"^--deepspeed {path}: ") as e:
        parse_config(["--deepspeed", str(path)])
    assert line in str(e.value) and "\n" not in str(e.value)


def test_norm_gains_and_biases_are_not_decayed_as_the_hf_trainer_decides():
    """--weight_decay 0.1 decayed every parameter: RMSNorm gains pulled toward 0, Qwen's q/k/v biases decayed. Two
    groups now, the Trainer's own rule (names it decays, the rest at 0); one group for checkpoints written before."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer

    from training.engine import param_groups

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "qwen2", hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=64))
    groups = param_groups(model, split=True)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = sorted(names[id(p)] for p in groups[0]["params"])
    assert decayed == sorted(Trainer.get_decay_parameter_names(None, model))
    assert groups[1]["weight_decay"] == 0.0 and {"model.norm.weight", "model.layers.0.self_attn.q_proj.bias"} <= {
        names[id(p)] for p in groups[1]["params"]}
    assert [g["weight_decay"] for g in torch.optim.AdamW(groups, weight_decay=0.1).param_groups] == [0.1, 0.0]
    assert len(param_groups(model, split=False)) == len(list(model.parameters()))  # the older checkpoints' one group
