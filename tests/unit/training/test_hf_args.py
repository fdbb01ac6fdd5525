"""The seed guide's launch command, as written, and the Hugging Face Trainer's argument names users carry over
(training/hf_args.py): `--num_train_epochs` as the Trainer counts it, `max_steps` winning, the names that mean the
same mapped, the others refused in one line naming this project's flag."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from data.sampler import ResumableSampler
from tests.distributed import ROOT
from tests.unit.model_utils.test_hub import HUB_ID, fill_cache
from training import config as config_mod
from training.config import parse_config
from training.curriculum import resolve_stages
from training.hf_args import epoch_stages, epoch_steps

# the seed guide's ds_config.json, less its "train_batch_size": 1, which contradicts its own micro-batch 1 x
# accumulation 4 x dp 4 on 32 GPUs (DeepSpeed refuses it too; here: one line, test_the_seed_json_as_written below)
SEED_DS = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10,
           "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
           "sequence_parallelism": {"enabled": True, "degree": 8, "sequence_parallel_type": "ulysses"},
           "fp16": {"enabled": True}, "gradient_accumulation_steps": 4, "gradient_clipping": 1.0}


def seed_command(ds_json: str, data: str) -> list[str]:
    """`deepspeed --num_gpus=32 train.py <these>`: the guide's arguments, a prepared dataset added."""
    return ["--deepspeed", ds_json, "--model_name_or_path", HUB_ID, "--max_seq_length", "524288",
            "--per_device_train_batch_size", "1", "--learning_rate", "2e-5", "--num_train_epochs", "1",
            "--dataset_path", data]


@pytest.fixture
def seed(tmp_path, monkeypatch):
    """A fake offline HF cache holding the model (HF_HOME), the seed's DeepSpeed JSON and a dataset."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    snap = fill_cache(tmp_path / "hf" / "hub", preset="llama3-8b")  # its config only (no weights read here)
    ds = tmp_path / "ds_config.json"
    ds.write_text(json.dumps(SEED_DS))
    data = tmp_path / "data.jsonl"
    data.write_text('{"input_ids": [5, 6, 7]}\n')
    return snap, str(ds), str(data)


def test_the_seed_guides_command_parses(seed, monkeypatch):
    """Before: 'unknown command-line argument(s) ['--num_train_epochs', '1']', and the hub id refused."""
    snap, ds, data = seed
    monkeypatch.setattr(config_mod, "no_gpu", lambda: False)  # the guide's 32 GPUs (its JSON asks for fp16)
    cfg = parse_config(seed_command(ds, data))
    assert cfg.model_name_or_path == snap and cfg.num_train_epochs == 1
    assert (cfg.sequence_parallel_size, cfg.gradient_accumulation_steps, cfg.fp16) == (8, 4, True)  # from its JSON
    assert (cfg.max_seq_length, cfg.learning_rate, cfg.max_grad_norm) == (524288, 2e-5, 1.0)


def test_the_seed_command_runs_as_a_dry_run_for_its_32_gpus(seed):
    """The whole start-up path of train.py on the guide's command (the plan for 4 x 8 GPUs; no weights read)."""
    _, ds, data = seed
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    env.pop("RANK", None)
    p = subprocess.run([sys.executable, "train.py", *seed_command(ds, data), "--dry_run", "--nodes", "4",
                        "--gpus_per_node", "8"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "dry run: world=32" in p.stdout and "sp=8 dp=4" in p.stdout and "precision=fp16" in p.stdout, p.stdout
    assert "1 epoch(s) of the data" in p.stdout, p.stdout


def test_the_seed_json_as_written_is_refused_in_one_line(seed, tmp_path):
    """Its "train_batch_size": 1 contradicts micro-batch 1 x accumulation 4 x dp 4: one line, as DeepSpeed would.
    train.py's dry run in this process (training.startup, as train.py calls it; a start of its own was ~12 s): how
    train.py turns such a ValueError into exit 2 and its last line is test_recipes::test_bad_stage_fails_before_work."""
    from training.startup import dry_run, load_run_config

    _, _, data = seed
    ds = tmp_path / "as_written.json"
    ds.write_text(json.dumps({**SEED_DS, "train_batch_size": 1}))
    with pytest.raises(ValueError) as e:
        dry_run(*load_run_config([*seed_command(str(ds), data), "--dry_run", "--nodes", "4", "--gpus_per_node", "8"]))
    assert "train_batch_size=1 but per_device_train_batch_size x grad_accum x dp gives 16" in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("samples, dp, mb, ga, epochs, steps", [
    (100, 4, 1, 4, 1, 7),  # 25 micro-batches per rank: ceil(25 / 4) = 7 steps (the floor, 6, left 4 untrained)
    (100, 4, 1, 4, 2.5, 16),  # ceil(2.5 x 25 / 4): counted over the run (a ceil per epoch, 18, trained 2.88)
    (10, 2, 1, 8, 1, 1),  # fewer micro-batches than one accumulation: at least one step
    (1000, 1, 2, 1, 0.5, 250),
    (1000, 32, 1, 4, 1, 8),  # 1M tokens, 1B-token set: 32 batches (the last padded), 8 steps (7 left 104 untrained)
    (160, 32, 1, 4, 3, 4),  # 3 epochs of 5 batches: 15 micro-batches, 4 steps (a ceil per epoch: 6, 4.8 epochs)
])
def test_epochs_train_every_sample_and_about_that_many_epochs(samples, dp, mb, ga, epochs, steps):
    """Every sample of each epoch trains (the sampler pads an epoch's last batch); the run draws `epochs` epochs of
    samples, over by less than one step's micro-batches (whole steps of `ga` micro-batches, counted over the run)."""
    assert epoch_steps(epochs, samples, dp, mb, ga) == steps
    samplers = [ResumableSampler(samples, dp, r, mb, seed=0) for r in range(dp)]  # the sampler's own epoch
    per_rank = samplers[0].batches_per_epoch
    drawn = [[i for _ in range(steps * ga) for i in s.next_batch()] for s in samplers]
    first = {i for d in drawn for i in d[: per_rank * mb]}
    assert first == set(range(samples)) or epochs < 1  # an epoch trains every sample (its last batch padded)
    total = sum(len(d) for d in drawn)
    assert epochs * samples <= total < epochs * samples + dp * mb * ga + dp * mb  # over by < one step (+ the padding)


class Data:
    """The run's data as epoch_stages reads it: a stage's packed training samples."""

    def __init__(self, samples: dict[int, int]):
        self.samples = samples

    def train_set(self, seq_len: int, sft: bool = False):
        return range(self.samples[seq_len])


def test_each_stage_trains_its_epochs_unless_it_sets_its_own_length(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("num_train_epochs: 2\ngradient_accumulation_steps: 2\nwarmup_ratio: 0.1\nstages:\n"
                      "  - {name: a, max_seq_length: 64}\n  - {name: b, max_seq_length: 128, sequence_parallel_size: 2}\n"
                      "  - {name: c, max_seq_length: 256, max_steps: 5}\n")
    cfg = parse_config(["--config", str(recipe)])
    stages = epoch_stages(cfg, resolve_stages(cfg, dp_of_sp=lambda sp: 4 // sp), Data({64: 80, 128: 40, 256: 9}), 4)
    # a: 80 // 4 // 1 = 20 micro-batches // 2 = 10 x 2 epochs; b (dp 2): 40 // 2 = 20 // 2 = 10 x 2; c: its own 5
    assert [s.max_steps for s in stages] == [20, 20, 5]
    assert [s.warmup_steps for s in stages] == [2, 2, 1]  # ceil(0.1 x steps), each stage's own


def test_max_steps_wins_over_epochs(tmp_path, capsys):
    cfg = parse_config(["--num_train_epochs", "3", "--max_steps", "7"])
    assert cfg.num_train_epochs is None and cfg.max_steps == 7
    # said (a recipe's max_steps beat a flag's epochs without a word), and so are epochs no stage uses
    assert "--num_train_epochs 3 is not used: max_steps 7 is set" in capsys.readouterr().out
    recipe = tmp_path / "r.yaml"
    recipe.write_text("stages:\n  - {name: a, max_seq_length: 64, max_steps: 4}\n")
    own = parse_config(["--config", str(recipe), "--num_train_epochs", "2"])
    epoch_stages(own, resolve_stages(own, dp_of_sp=lambda sp: 1), Data({64: 100}), 1)
    assert "--num_train_epochs 2 applies to no stage" in capsys.readouterr().out
    assert parse_config(["--num_train_epochs", "3", "--max_steps", "-1"]).num_train_epochs == 3  # HF's "not set"
    stages = epoch_stages(cfg, resolve_stages(cfg, dp_of_sp=lambda sp: 1), Data({2048: 1000}), 1)
    assert stages[0].max_steps == 7


def test_epochs_over_a_mixture_stage_are_refused():
    cfg = parse_config(["--num_train_epochs", "1"])
    stages = resolve_stages(cfg, dp_of_sp=lambda sp: 1)
    import dataclasses

    mixed = [dataclasses.replace(stages[0], data={"web": 1.0})]
    with pytest.raises(ValueError, match="give the stage max_steps or max_tokens"):
        epoch_stages(cfg, mixed, Data({2048: 100}), 1)


@pytest.mark.parametrize("argv, field, value", [
    (["--lr_scheduler_type", "linear"], "lr_scheduler", "linear"),
    (["--lr_scheduler_type", "constant_with_warmup", "--warmup_steps", "3"], "lr_scheduler", "constant"),
    (["--resume_from_checkpoint", "none"], "resume", "none"),
    (["--resume_from_checkpoint"], "resume", "auto"),
    (["--ddp_timeout", "600"], "dist_timeout_s", 600.0),
    (["--logging_steps", "1", "--per_device_eval_batch_size", "1", "--do_train", "--do_eval"], "max_steps", 100),
    (["--save_total_limit", "3", "--save_steps", "50", "--weight_decay", "0.1", "--max_grad_norm", "0.5", "--seed", "7",
      "--gradient_checkpointing", "--bf16", "--output_dir", "o", "--gradient_accumulation_steps", "2"], "seed", 7),
    (["--warmup_ratio", "0.03"], "warmup_ratio", 0.03),
    (["--bf16", "True", "--gradient_checkpointing", "true", "--fp16", "False"], "bf16", True),  # HfArgumentParser's
    (["--no-bf16", "--gradient_checkpointing"], "bf16", False),
])
def test_hf_names_that_mean_the_same_are_taken(argv, field, value):
    assert getattr(parse_config(argv), field) == value


@pytest.mark.parametrize("argv, match", [
    (["--logging_steps", "10"], "--logging_steps .*only 1 means the same here: every optimizer step's loss"),
    (["--per_device_eval_batch_size", "8"], "--eval_heldout_samples"),
    (["--lr_scheduler_type", "cosine_with_restarts"], "--lr_scheduler cosine, linear or constant"),
    (["--lr_scheduler_type", "constant", "--warmup_steps", "10"], "use constant_with_warmup"),
    (["--lr_scheduler_type", "cosine", "--lr_scheduler", "linear"], "set the same thing: drop one"),
    (["--eval_strategy", "steps"], "evaluation runs at each stage's end"),
    (["--overwrite_output_dir"], "--resume none"),
    (["--save_strategy", "epoch"], "--save_steps"),
    (["--optim", "adafactor"], "optimizer block"),
    (["--warmup_ratio", "0.1", "--warmup_steps", "5"], "both set the warmup: drop one"),
    (["--num_train_epochs", "0"], "--num_train_epochs 0.0: use a number > 0"),
    (["--bf16", "maybe"], "--bf16 'maybe': use true or false"),
])
def test_hf_names_that_do_not_are_refused_in_one_line(argv, match):
    with pytest.raises(ValueError, match=match) as e:
        parse_config(argv)
    assert "\n" not in str(e.value)
