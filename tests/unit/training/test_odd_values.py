"""Odd values a user's flags and recipes carry (an audit fuzzed every command's arguments): each is refused in one line
naming it and the fix before any heavy work, or read as what it means. Before: a TypeError / OverflowError /
UnicodeDecodeError traceback at start-up, or a setting silently read as unset (a NaN run that "succeeded")."""

from __future__ import annotations

import os
import shutil

import pytest

from model_utils.rope import apply_rope, check_rope
from tests.e2e.launchers import ROOT
from tests.unit.training.test_checkpoint import save
from tests.unit.training.test_curriculum_rope import _llama, _stages
from training.checkpoint import POINTER, Checkpointer
from training.config import Config, home_paths, parse_config
from training.config_types import yaml_text
from training.curriculum import check_stages


def _refused(argv: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=match) as e:
        parse_config(argv)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("argv, match", [
    # a peak LR past any AdamW's trained NaN from the first step and ended "successfully"; nan was caught late
    (["--learning_rate", "inf"], r"--learning_rate \(inf\) <= 1.0, lr > 0"),
    (["--learning_rate", "1e30"], r"--learning_rate \(1e\+30\) <= 1.0"),
    (["--learning_rate", "nan"], r"--learning_rate \(nan\) <= 1.0"),
    # read as unset (CPU Adam decays only > 0, clipping only > 0); FusedAdam applied a negative decay
    (["--weight_decay", "-1"], r"^--weight_decay -1.0: use 0 \(none\) or a decay"),
    (["--weight_decay", "nan"], r"^--weight_decay nan: use 0"),
    (["--max_grad_norm", "nan"], r"^--max_grad_norm nan: use"),
    (["--max_grad_norm", "inf"], r"^--max_grad_norm inf: use"),
    # '' passed the dry run; the run lock's makedirs('') was a FileNotFoundError traceback
    (["--output_dir", ""], r"^--output_dir '': name the run's folder"),
    # datetime.timedelta's OverflowError / ValueError traceback at the process group's start; nan/inf: no limit
    (["--dist_timeout_s", "inf"], r"^--dist_timeout_s inf: use seconds > 0 \(and <= 1e\+09\)$"),
    (["--dist_timeout_s", "nan"], r"^--dist_timeout_s nan: use"),
    (["--dist_timeout_s", "1e30"], r"^--dist_timeout_s 1e\+30: use"),
    (["--time_limit_s", "nan"], r"^--time_limit_s nan: use seconds >= 0 \(0: none\)$"),
    (["--time_limit_s", "inf"], r"^--time_limit_s inf: use"),
    # an OverflowError traceback once the data was open (hf_args.epoch_steps)
    (["--num_train_epochs", "inf", "--max_steps", "-1"], r"^--num_train_epochs inf: use a number > 0"),
    # the planner's parse_seq_len (planner/memory_model.py): inf an OverflowError traceback, 1.5 a length of 2
    (["--dry_run", "--eval_lengths", "inf"], r"^--eval_lengths 'inf': use earlier, all or a list of lengths"),
    (["--eval_lengths", "256,1.5"], r"^--eval_lengths '256,1.5': use earlier, all or a list of lengths"),
    # read as unset by the dry run and the memory plan
    (["--gpu_mem_gb", "-1"], r"^--gpu_mem_gb -1.0: use GB per rank, or 0 \(detected from the device\)"),
    (["--gpu_mem_gb", "nan"], r"^--gpu_mem_gb nan: use"),
    (["--mem_cap_gb", "-1"], r"^--mem_cap_gb -1.0: use"),
    (["--nodes", "-1"], r"^--nodes -1: use a count, or 0"),
    (["--gpus_per_node", "-1"], r"^--gpus_per_node -1: use"),
    (["--checkpoint_every", "-1"], r"^--checkpoint_every -1: use K >= 1"),
])
def test_an_odd_flag_is_one_line(argv, match):
    _refused(argv, match)


def test_the_documented_edges_still_stand():
    """0 keeps meaning off (no clipping, no decay, no limit, detected); a whole length written with k is a length."""
    cfg = parse_config(["--max_grad_norm", "0", "--weight_decay", "0", "--time_limit_s", "0", "--gpu_mem_gb", "0",
                        "--learning_rate", "1", "--dist_timeout_s", "604800", "--eval_lengths", "1.5k,256"])
    # LLaMA-Factory's ddp_timeout 180000000 and HF's --max_grad_norm -1 ("no clipping") ran before the odd-value
    # checks and were refused for a day (a review)
    assert parse_config(["--ddp_timeout", "180000000"]).dist_timeout_s == 180000000.0
    assert parse_config(["--max_grad_norm", "-1"]).max_grad_norm == 0.0
    assert (cfg.max_grad_norm, cfg.weight_decay, cfg.learning_rate) == (0.0, 0.0, 1.0)


def test_a_stages_learning_rate_past_1_is_one_line(tmp_path):
    """training/curriculum.py checks only its order with min_lr: inf passed."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("stages:\n  - {name: a, max_steps: 2, learning_rate: .inf}\n")
    _refused(["--config", str(recipe)], r"^stages\[0\].learning_rate inf: use a rate in \(0, 1.0\]")


def test_a_recipe_that_is_not_utf8_is_one_line(tmp_path):
    """An editor's UTF-16 recipe: a UnicodeDecodeError traceback at start-up."""
    recipe = tmp_path / "r.yaml"
    recipe.write_bytes("max_steps: 3\n".encode("utf-16"))
    _refused(["--config", str(recipe)], rf"^--config {recipe}: not UTF-8 text: save it as UTF-8$")


@pytest.mark.parametrize("text, expected", [
    ("{rope_type: yarn, factor: 4, rope_theta: 1e6, original_max_position_embeddings: 256}",  # YAML 1.1: 1e6 is text
     {"rope_type": "yarn", "factor": 4, "rope_theta": 1e6, "original_max_position_embeddings": 256}),
    ("{rope_type: linear, factor: \"2\"}",
     {"rope_type": "linear", "factor": 2, "rope_theta": 10000.0, "original_max_position_embeddings": 1024}),
    ("{rope_type: yarn, factor: 4, original_max_position_embeddings: \"256\"}",
     {"rope_type": "yarn", "factor": 4, "rope_theta": 10000.0, "original_max_position_embeddings": 256}),
])
def test_numbers_written_as_text_in_a_rope_mapping_are_numbers(text, expected):
    """`rope_theta: 1e6` (PyYAML reads it as a string), a quoted factor or pretraining length: a TypeError traceback
    in the checks (model_utils/rope.py) at train.py's start-up and in evaluate.py --rope; now the numbers they are."""
    rope = yaml_text(text, "--rope")
    assert any(isinstance(v, str) for k, v in rope.items() if k != "rope_type")  # as the recipe hands it over
    check_rope(rope, "--rope")  # evaluate.py's check of --rope
    (stage,) = _stages(max_seq_length=512, rope=rope)
    check_stages([stage], world=1, num_heads=4, num_kv_heads=2, model=_llama())  # train.py's start-up check
    config = _llama()
    apply_rope(config, stage.rope, stage.max_seq_length)  # what the stage's engine is built with
    assert config.rope_parameters == expected
    assert all(type(config.rope_parameters[k]) is type(v) for k, v in expected.items())


@pytest.mark.parametrize("value", ["abc", "nan", ".nan", "null", "[1]", "true", ".inf"])
def test_a_rope_number_that_is_none_is_one_line(value):
    rope = yaml_text(f"{{rope_type: yarn, factor: {value}, original_max_position_embeddings: 256}}", "--rope")
    with pytest.raises(ValueError, match=r"^--rope: factor .* is not a finite number: write it as one \(e.g. factor: "
                                         r"4.0\)$"):
        check_rope(rope, "--rope")


def test_a_latest_that_is_not_text_resumes_from_the_listing(tmp_path):
    """checkpoints/LATEST saved as UTF-16 (or torn to binary): a UnicodeDecodeError traceback in train.py and
    export_hf.py; now read as an unreadable pointer is: the newest complete checkpoint listed."""
    ck = Checkpointer(str(tmp_path), keep=3)
    save(ck, 2)
    newest = save(ck, 4)
    (tmp_path / "checkpoints" / POINTER).write_bytes(b"\xff\xfes\x00")
    assert ck.find_resume("auto") == newest


def test_a_null_optional_rope_number_is_not_given():
    """`attention_factor: null` / `beta_fast: null` (transformers derives their defaults) were accepted before the
    text-number check, and must stay so; a null `factor` (yarn needs one) is refused above."""
    for extra in ({"attention_factor": None}, {"beta_fast": None, "beta_slow": None}):
        check_rope({"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 256, **extra}, "--rope")
    for extra in ({"rope_theta": None}, {"partial_rotary_factor": None}):  # not derived: one line, not a traceback
        with pytest.raises(ValueError, match="is not a finite number"):
            check_rope({"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 256, **extra}, "--rope")


def test_a_leading_tilde_in_a_path_is_the_home_folder(tmp_path, monkeypatch):
    """`--output_dir=~/runs/x` (no shell expands `~` there) or a recipe's `output_dir: ~/runs/x` made a folder named
    `~` in the working directory (transformers' TrainingArguments expands it); `--dataset_path '~/data.jsonl'` was
    'no such file'. Hub ids and preset names never begin with `~` and stay as they are."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "data.jsonl").write_text('{"text": "a"}\n')
    shutil.copy(os.path.join(ROOT, "ds_configs", "zero3.json"), tmp_path / "ds.json")
    (tmp_path / "r.yaml").write_text("output_dir: ~/runs/y\ndataset_path: ~/data.jsonl\n")
    cfg = parse_config(["--output_dir=~/runs/x", "--dataset_path", "~/data.jsonl", "--deepspeed", "~/ds.json",
                        "--model_name_or_path", "tiny-llama"])
    assert (cfg.output_dir, cfg.dataset_path, cfg.deepspeed) == (
        f"{tmp_path}/runs/x", f"{tmp_path}/data.jsonl", f"{tmp_path}/ds.json")
    assert cfg.model_name_or_path == "tiny-llama"
    cfg = parse_config(["--config", "~/r.yaml"])
    assert (cfg.output_dir, cfg.dataset_path) == (f"{tmp_path}/runs/y", f"{tmp_path}/data.jsonl")
    cfg = Config(model_name_or_path="~/models/m", tokenizer_name_or_path="~/tok", resume="~/runs/x/checkpoints/step4")
    home_paths(cfg)
    assert (cfg.model_name_or_path, cfg.tokenizer_name_or_path, cfg.resume) == (
        f"{tmp_path}/models/m", f"{tmp_path}/tok", f"{tmp_path}/runs/x/checkpoints/step4")
