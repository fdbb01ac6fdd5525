"""Hugging Face Trainer / TRL / LLaMA-Factory flags copied into a command (training/hf_args.py): what they mean there
is what they do here, a command-line name replaces the recipe's setting under either name, and the names that mean
nothing here are refused in one line naming the fix. Each test failed on the code before (audit a67)."""

from __future__ import annotations

import pytest

from training.config import Config, StageConfig, parse_config
from training.curriculum import resolve_stages
from training.hf_args import epoch_stages


class Data:
    def __init__(self, samples: int):
        self.samples = samples

    def train_set(self, seq_len: int, sft: bool = False):
        return range(self.samples)


def recipe(tmp_path, text: str) -> str:
    path = tmp_path / "r.yaml"
    path.write_text(text)
    return str(path)


def test_max_steps_minus_one_without_epochs_trains_the_trainers_3_epochs(tmp_path, capsys):
    """HF: max_steps -1 is "train num_train_epochs", 3 by default. Before, the flag trained 100 steps without a word
    and the recipe's `max_steps: -1` was refused as "--max_steps must be >= 1"."""
    for argv in (["--max_steps", "-1"], ["--config", recipe(tmp_path, "max_steps: -1\nlearning_rate: 2.0e-5\n")]):
        cfg = parse_config(argv)
        assert cfg.num_train_epochs == 3.0, argv
        assert "max_steps -1" in capsys.readouterr().out
        (st,) = epoch_stages(cfg, resolve_stages(cfg, dp_of_sp=lambda sp: 1), Data(10), 1)
        assert st.max_steps == 30 and st.steps_from == "epochs:3"  # 3 epochs of 10 samples, not 100 steps
    assert parse_config(["--max_steps", "-1", "--num_train_epochs", "1"]).num_train_epochs == 1
    assert parse_config(["--config", recipe(tmp_path, "max_steps: -1\n"), "--max_steps", "7"]).max_steps == 7


def test_a_command_line_warmup_ratio_replaces_the_recipes_warmup_steps(tmp_path, capsys):
    """Every shipped recipe has a top-level warmup_steps: `--config R --warmup_ratio 0.03` was refused naming a
    --warmup_steps never given, and a stage's own warmup_steps beat the flag without a word."""
    r = recipe(tmp_path, "warmup_steps: 20\nmax_steps: 40\nstages:\n  - {name: a, max_seq_length: 64, warmup_steps: 20}\n"
                         "  - {name: b, max_seq_length: 128}\n")
    cfg = parse_config(["--config", r, "--warmup_ratio", "0.1"])
    assert (cfg.warmup_ratio, cfg.warmup_steps, cfg.stages[0].warmup_steps) == (0.1, 0, None)
    out = capsys.readouterr().out
    assert "--warmup_ratio replaces the recipe's warmup_steps 20" in out
    assert "--warmup_ratio replaces the warmup_steps of stage(s) a" in out
    stages = epoch_stages(cfg, resolve_stages(cfg, dp_of_sp=lambda sp: 1), Data(10), 1)
    assert [s.warmup_steps for s in stages] == [4, 4]  # ceil(0.1 x 40), each stage
    ratio = recipe(tmp_path, "warmup_ratio: 0.1\n")  # and the other way: --warmup_steps over a recipe's ratio
    steps = parse_config(["--config", ratio, "--warmup_steps", "5"])
    assert (steps.warmup_steps, steps.warmup_ratio) == (5, 0.0)
    for argv in (["--config", r, "--warmup_ratio", "0.1", "--warmup_steps", "5"],  # both on the command line
                 ["--config", recipe(tmp_path, "warmup_ratio: 0.1\nwarmup_steps: 5\n")]):  # both in the recipe
        with pytest.raises(ValueError, match="both set the warmup: drop one"):
            parse_config(argv)


def test_cosine_with_min_lr_needs_its_floor_and_takes_lr_scheduler_kwargs(tmp_path):
    """HF raises "One of min_lr or min_lr_rate should be set": here it decayed to 0, and the kwargs that set the
    floor were refused."""
    with pytest.raises(ValueError, match="cosine_with_min_lr needs its floor: give --min_lr") as e:
        parse_config(["--lr_scheduler_type", "cosine_with_min_lr"])
    assert "\n" not in str(e.value)
    kind = ["--lr_scheduler_type", "cosine_with_min_lr", "--learning_rate", "1e-4", "--lr_scheduler_kwargs"]
    assert parse_config([*kind, '{"min_lr": 1e-6}']).min_lr == 1e-6
    assert parse_config([*kind, '{"min_lr_rate": 0.1}']).min_lr == pytest.approx(1e-5)
    r = recipe(tmp_path, "lr_scheduler_type: cosine_with_min_lr\nlr_scheduler_kwargs: {min_lr_rate: 0.1}\nstages:\n"
                         "  - {name: a, max_seq_length: 64, learning_rate: 1.0e-3}\n  - {name: b, max_seq_length: 128}\n")
    cfg = parse_config(["--config", r])  # a stage with its own peak gets its own share of it
    assert cfg.stages[0].min_lr == pytest.approx(1e-4) and cfg.min_lr == pytest.approx(2e-6)
    for bad, match in (('{"num_cycles": 2}', "only cosine_with_min_lr's floor is read here"),
                       ("min_lr=1e-6", "only cosine_with_min_lr's floor"),
                       ('{"min_lr": 1e-6, "min_lr_rate": 0.1}', "only cosine_with_min_lr's floor")):
        with pytest.raises(ValueError, match=match):
            parse_config([*kind, bad])
    with pytest.raises(ValueError, match="set the same thing: drop one"):
        parse_config([*kind, '{"min_lr_rate": 0.1}', "--min_lr", "1e-6"])


def test_hf_aliases_on_the_command_line_replace_the_recipes_key(tmp_path):
    """`--lr_scheduler_type linear` over a recipe's `lr_scheduler: cosine` (and --resume_from_checkpoint,
    --ddp_timeout) was refused as "set the same thing: drop one", and constant_with_warmup quoted as 'constant'."""
    r = recipe(tmp_path, "lr_scheduler: cosine\nresume: auto\ndist_timeout_s: 1800\n")
    cfg = parse_config(["--config", r, "--lr_scheduler_type", "linear", "--resume_from_checkpoint", "/tmp/x",
                        "--ddp_timeout", "7200"])
    assert (cfg.lr_scheduler, cfg.resume, cfg.dist_timeout_s) == ("linear", "/tmp/x", 7200.0)
    aliased = recipe(tmp_path, "lr_scheduler_type: linear\n")  # and this project's flag over the recipe's alias
    assert parse_config(["--config", aliased, "--lr_scheduler", "cosine"]).lr_scheduler == "cosine"
    with pytest.raises(ValueError, match="'constant_with_warmup' and --lr_scheduler 'linear' on the command line"):
        parse_config(["--lr_scheduler_type", "constant_with_warmup", "--lr_scheduler", "linear"])
    both = recipe(tmp_path, "lr_scheduler_type: linear\nlr_scheduler: cosine\n")
    with pytest.raises(ValueError, match="set the same thing: drop one"):
        parse_config(["--config", both])
    assert parse_config(["--lr_scheduler_type", "constant_with_warmup", "--lr_scheduler", "constant"]).lr_scheduler == (
        "constant")  # the same setting twice, agreeing


@pytest.mark.parametrize("argv, fix", [
    (["--max_length", "4096"], "--max_seq_length"),
    (["--cutoff_len", "4096"], "--max_seq_length"),
    (["--data_seed", "42"], "follows --seed"),
    (["--packing", "True"], "always packed, padding-free"),
    (["--padding_free"], "always packed, padding-free"),
    (["--assistant_only_loss", "True"], "prepare_data.py --loss_on"),
    (["--completion_only_loss", "True"], "prepare_data.py --loss_on"),
    (["--dataset_text_field", "text"], "prepare_data.py --text_field"),
    (["--chat_template_path", "t.jinja"], "prepare_data.py --chat_template FILE"),
    (["--dataset_num_proc", "8"], "prepare_data.py --workers"),
    (["--use_liger_kernel", "True"], "--tiled_logits"),
    (["--include_num_input_tokens_seen", "True"], "total_tokens is in OUTPUT_DIR/metrics.jsonl"),
    (["--average_tokens_across_devices", "True"], "always the mean over the whole global batch"),
    (["--neftune_noise_alpha", "5"], "not supported"),
    (["--label_smoothing_factor", "0.1"], "not supported"),
    (["--torch_dtype", "bfloat16"], "--bf16 or --fp16"),
    (["--dtype", "bfloat16"], "--bf16 or --fp16"),
    (["--warmup_steps", "2.5"], "a whole number of steps"),
])
def test_commonly_copied_names_are_refused_naming_the_fix(argv, fix):
    """Before: "unknown command-line argument(s)", naming nothing to use instead."""
    with pytest.raises(ValueError, match=fix.replace(".", r"\.")) as e:
        parse_config(argv)
    assert "\n" not in str(e.value) and "unknown" not in str(e.value)


def test_transformers_5_warmup_steps_below_1_is_a_ratio(tmp_path):
    cfg = parse_config(["--warmup_steps", "0.1"])
    assert (cfg.warmup_steps, cfg.warmup_ratio) == (0, 0.1)
    assert parse_config(["--config", recipe(tmp_path, "warmup_steps: 0.1\n")]).warmup_ratio == 0.1
    assert parse_config(["--warmup_steps", "5"]).warmup_steps == 5


def test_the_plan_line_says_the_schedule_and_the_optimizer(tmp_path, monkeypatch):
    """Their defaults are not the HF Trainer's (cosine vs linear; betas 0.9,0.95 vs 0.9,0.999): the stage's plan
    line showed only lr=2e-05->0."""
    from training.summary import optimizer_text, plan_lines

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    cfg = Config(output_dir=str(tmp_path), stages=[StageConfig(name="a", max_seq_length=64, max_steps=10)],
                 weight_decay=0.1, warmup_ratio=0.1)
    (line,) = [x for x in plan_lines(cfg, resolve_stages(cfg, lambda sp: 1), 1, 1, False) if "stage 0" in x]
    assert "lr=2e-05->0 cosine warmup=1 (ratio 0.1) AdamW betas=0.9,0.95 eps=1e-08 wd=0.1 " in line, line
    block = {"optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "weight_decay": "auto"}}}
    assert optimizer_text(block, cfg) == "AdamW betas=0.9,0.95 eps=default wd=0.1"
    block = {"optimizer": {"type": "Adam", "params": {"betas": [0.9, 0.999], "eps": 1e-6, "weight_decay": 0.0}}}
    assert optimizer_text(block, cfg) == "Adam betas=0.9,0.999 eps=1e-06 wd=0"


def test_hf_defaults_over_a_recipe_change_nothing(tmp_path):
    """A review of the day: HF's unset `--max_steps -1` over a recipe's top-level max_steps gave 3 epochs (the recipe's
    1000 dropped); HF's default `--lr_scheduler_kwargs '{}'` dropped the recipe's and its stages' min_lr; transformers
    5's `--warmup_steps 0.1` over a recipe's warmup_steps was refused naming a flag never given."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("max_steps: 1000\nmin_lr: 2.0e-6\nwarmup_steps: 20\nstages:\n  - {name: a, max_seq_length: 256, "
                      "min_lr: 1.0e-5}\n  - {name: b, max_seq_length: 512}\n")
    cfg = parse_config(["--config", str(recipe), "--max_steps", "-1"])
    assert (cfg.max_steps, cfg.num_train_epochs) == (1000, None)
    cfg = parse_config(["--config", str(recipe), "--lr_scheduler_kwargs", "{}"])
    assert cfg.min_lr == 2e-6 and cfg.stages[0].min_lr == 1e-5
    cfg = parse_config(["--config", str(recipe), "--warmup_steps", "0.1"])
    assert cfg.warmup_ratio == 0.1 and cfg.warmup_steps in (0, None)
