"""Config tree: precedence (flags > YAML > defaults), unknown keys, value checks, DeepSpeed 'auto' filling."""

import pytest

from base.parallel import ParallelDims, check_layout
from training.config import parse_config
from training.ds_config import build_ds_config


def test_precedence_cli_over_yaml_over_defaults(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("max_steps: 7\nlearning_rate: 0.001\nsequence_parallel_size: 2\n")
    cfg = parse_config(["--config", str(recipe), "--max_steps", "9", "--no-bf16"])
    assert cfg.max_steps == 9 and cfg.learning_rate == 0.001 and cfg.sequence_parallel_size == 2
    assert cfg.bf16 is False and cfg.per_device_train_batch_size == 1


@pytest.mark.parametrize("argv, match", [
    (["--max_stepz", "3"], "unknown command-line argument"),
    (["--max_steps", "0"], "--max_steps must be >= 1, got 0"),
    (["--save_total_limit", "1"], "keep at least 2"),
    (["--lr_scheduler", "step"], "use cosine, linear or constant"),
    (["--attn_implementation", "eager"], "eager cannot run under Ulysses"),
    (["--deepspeed", "nope.json"], "nope.json: file not found"),
    (["--dataset_path", "/no/such/data.jsonl"], "no such file or folder"),
    # argparse's own type errors: one line, not its usage block of every flag (before: SystemExit after ~60 lines)
    (["--max_steps", "abc"], r"argument --max_steps: invalid int value: 'abc': see `python train.py --help`"),
    (["--gpus_per_node", "1e-4"], r"argument --gpus_per_node: invalid int value"),
    (["--rope", "{rope_type: yarn, factor: 4"], r"argument --rope: invalid YAML value"),  # was a ParserError traceback
])
def test_bad_values_one_line(argv, match):
    with pytest.raises(ValueError, match=match) as e:
        parse_config(argv)
    assert "\n" not in str(e.value)


def test_unknown_yaml_key(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("max_steps: 3\nlearning_rat: 0.1\n")
    with pytest.raises(ValueError, match=r"unknown config key\(s\) \['learning_rat'\]"):
        parse_config(["--config", str(recipe)])
    recipe.write_text("stages:\n  - max_seq_length: 8\n    sp: 2\n")
    with pytest.raises(ValueError, match=r"stages\[0\]"):
        parse_config(["--config", str(recipe)])


@pytest.mark.parametrize("world, sp, heads, kv, sl, match", [
    (4, 3, 12, 12, 64, "does not divide world size 4"),
    (4, 4, 6, 6, 64, "6 attention heads, not divisible by sequence_parallel_size=4"),
    (8, 4, 12, 6, 64, "6 KV heads"),
    (2, 2, 4, 4, 1, "shorter than sequence_parallel_size=2"),
])
def test_layout_errors(world, sp, heads, kv, sl, match):
    with pytest.raises(ValueError, match=match):
        check_layout(world, sp, heads, kv, sl)


def test_layout_accepts_kv_replication():
    check_layout(world=4, sp=4, num_heads=8, num_kv_heads=2, seq_len=64)


def test_ds_config_auto_filled_in_one_place():
    cfg = parse_config(["--gradient_accumulation_steps", "3", "--per_device_train_batch_size", "2",
                        "--learning_rate", "1e-4", "--sequence_parallel_size", "2"])
    ds = build_ds_config(cfg, ParallelDims(world=8, sp=2, rank=0, local_rank=0), bf16=True, hidden_size=64)
    assert ds["train_batch_size"] == 2 * 3 * 4  # dp = 8 / 2
    assert ds["gradient_accumulation_steps"] == 3 and ds["train_micro_batch_size_per_gpu"] == 2
    assert ds["optimizer"]["params"]["lr"] == 1e-4 and ds["bf16"]["enabled"] is True
    assert ds["zero_optimization"]["stage"] == 3


def test_ds_config_conflict_is_an_error(tmp_path):
    import json

    p = tmp_path / "ds.json"
    p.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3}}))
    cfg = parse_config(["--deepspeed", str(p), "--per_device_train_batch_size", "1"])
    with pytest.raises(ValueError, match="train_micro_batch_size_per_gpu=4 but --per_device_train_batch_size gives 1"):
        build_ds_config(cfg, ParallelDims(world=1, sp=1, rank=0, local_rank=0), bf16=False, hidden_size=64)


def test_the_json_batch_settings_stand_where_no_flag_sets_them(tmp_path):
    """A DeepSpeed JSON written for the HF Trainer (the seed guide's: accumulation 4, micro-batch 1) sets them when
    no flag or recipe key does, as its sequence_parallelism block sets the SP degree (before: refused, 'gives 1')."""
    import json

    p = tmp_path / "ds.json"
    p.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
                             "zero_optimization": {"stage": 3}}))
    cfg = parse_config(["--deepspeed", str(p)])
    assert (cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps) == (2, 4)
    ds = build_ds_config(cfg, ParallelDims(world=2, sp=1, rank=0, local_rank=0), bf16=False, hidden_size=64)
    assert ds["train_batch_size"] == 2 * 4 * 2


def test_recipe_numbers_are_read_as_their_fields_declare(tmp_path):
    """YAML 1.1 reads `1e-4` (no dot) as a string: the learning rate every recipe writes so was a TypeError traceback
    in the checks. A number written as text is the number; an integer field takes 2e9 and 1000.0."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("learning_rate: 1e-4\nmin_lr: 1e-6\nmax_steps: 1e3\ncontext_parallel_size: 1\n"
                      "attention_head_chunks: 4\nstages:\n"
                      "  - max_seq_length: 64\n    max_tokens: 2e9\n    learning_rate: 3e-5\n")
    cfg = parse_config(["--config", str(recipe)])
    assert (cfg.learning_rate, cfg.min_lr, cfg.max_steps) == (1e-4, 1e-6, 1000)
    assert (cfg.stages[0].max_tokens, cfg.stages[0].learning_rate) == (2_000_000_000, 3e-5)
    assert isinstance(cfg.max_steps, int) and isinstance(cfg.stages[0].max_tokens, int)
    # keys declared str ("auto") that take N: the integer stays one (training/summary.py, the test workers check it)
    assert (cfg.context_parallel_size, cfg.attention_head_chunks) == (1, 4)


def test_the_documented_auto_and_yes_no_values_are_read_from_a_recipe(tmp_path):
    """A stage's `sequence_parallel_size: auto` (docs/memory.md) was refused as "not an integer", and
    `reset_position_ids: no` as "not a string" (YAML 1.1 reads a bare no as false). A helper's audit, reproduced."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("reset_position_ids: no\nstages:\n  - {max_seq_length: 64, sequence_parallel_size: auto}\n"
                      "  - {max_seq_length: 128, sequence_parallel_size: 2}\n")
    cfg = parse_config(["--config", str(recipe)])
    assert cfg.reset_position_ids == "no" and [s.sequence_parallel_size for s in cfg.stages] == ["auto", 2]
    recipe.write_text("reset_position_ids: yes\n")
    assert parse_config(["--config", str(recipe)]).reset_position_ids == "yes"
    recipe.write_text("stages:\n  - {max_seq_length: 64, sequence_parallel_size: ten}\n")
    from training.curriculum import resolve_stages

    with pytest.raises(ValueError, match=r"^stage 0: sequence_parallel_size 'ten': use an integer >= 1 or auto$"):
        resolve_stages(parse_config(["--config", str(recipe)]), dp_of_sp=lambda sp: 1)
    # a stage's 0 was read as unset (`x or run's x`): the stage ran the run's value without a word
    recipe.write_text("max_steps: 100\nstages:\n  - {max_seq_length: 64, max_steps: 0}\n")
    with pytest.raises(ValueError, match=r"^stage 0: max_steps 0: give a positive value, or leave it out"):
        resolve_stages(parse_config(["--config", str(recipe)]), dp_of_sp=lambda sp: 1)
    # HF's resume_from_checkpoint values were taken as a path, refused only after the process group started
    with pytest.raises(ValueError, match=r"^--resume latest: use auto .*, none .* or a checkpoint's path"):
        parse_config(["--resume", "latest"])


_WRONG = ["1e-4", "ten", 2.5, True, None, [1, 2], {"a": 1}]


def test_every_recipe_key_takes_a_sensible_value_or_refuses_it_in_one_line(tmp_path):
    """A sweep over every key of the config tree (top level and a stage's) with values of every YAML kind: each is
    taken (typed as the field declares) or refused with a one-line ValueError, never another exception (before: 96
    TypeError tracebacks at the top level alone)."""
    import dataclasses

    import yaml

    from training.config import Config, StageConfig

    recipe, bad = tmp_path / "r.yaml", []
    docs = [{f.name: v} for f in dataclasses.fields(Config) for v in _WRONG]
    docs += [{"stages": [{"max_seq_length": 64, "max_steps": 2, f.name: v}]} for f in dataclasses.fields(StageConfig)
             for v in _WRONG]
    for doc in docs:
        recipe.write_text(yaml.safe_dump(doc))
        try:
            parse_config(["--config", str(recipe)])
        except ValueError as e:
            if "\n" in str(e):
                bad.append((doc, str(e)))
        except Exception as e:  # noqa: BLE001 (what the sweep looks for)
            bad.append((doc, f"{type(e).__name__}: {e}"))
    assert not bad, bad[:5]


_NESTED = {"tasks": ["passkey", "bogus"], "replay": ["share", "lengths", 256], "data": ["*"],
           "memory_features": ["tiled_mlp", "checkpoint_every", "bogus"], "eval": ["passkey_trials", "depths", "tasks"],
           "rope": ["rope_type", "factor"]}


def test_every_stage_mapping_takes_a_sensible_value_or_refuses_it_in_one_line(tmp_path):
    """The same sweep one level down, through the stages' resolution: a stage's tasks, replay, data, memory_features,
    eval and rope mappings. Before, memory_features' checkpoint_every given null, a list or a mapping was a TypeError
    traceback, and tiled_mlp: "false" turned tiled MLP on (bool of a string)."""
    import yaml

    from training.curriculum import resolve_stages

    recipe, bad = tmp_path / "r.yaml", []
    for key, subs in _NESTED.items():
        for value in ["ten", 2.5, None, [1, 2], {"a": 1}, "false"]:
            for block in [{sub: value} for sub in subs] + [value]:
                recipe.write_text(yaml.safe_dump({"stages": [{"max_seq_length": 4096, "max_steps": 2, key: block}]}))
                try:
                    stages = resolve_stages(parse_config(["--config", str(recipe)]), dp_of_sp=lambda sp: 1)
                except ValueError as e:
                    if "\n" in str(e):
                        bad.append((key, block, str(e)))
                except Exception as e:  # noqa: BLE001 (what the sweep looks for)
                    bad.append((key, block, f"{type(e).__name__}: {e}"))
                else:
                    if block == {"tiled_mlp": "false"}:
                        bad.append((key, block, f"taken: tiled_mlp={stages[0].tiled_mlp}"))
    assert not bad, bad[:5]


def test_a_recipe_that_is_not_valid_yaml_is_one_line_naming_the_line(tmp_path):
    """A recipe with a YAML syntax error (an unclosed flow mapping, a tab) was yaml's ParserError / ScannerError
    traceback; now one line naming the file and where."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("max_steps: 3\nstages:\n  - {max_seq_length: 64\n")
    with pytest.raises(ValueError, match=r"^--config .*r\.yaml: not valid YAML at line 4, column 1") as e:
        parse_config(["--config", str(recipe)])
    assert "\n" not in str(e.value)
    recipe.write_text("max_steps: 3\n\tlearning_rate: 1.0e-4\n")
    with pytest.raises(ValueError, match=r"not valid YAML at line 2"):
        parse_config(["--config", str(recipe)])


def test_a_resume_keeps_the_step_counts_its_stages_ran_with(tmp_path, capsys):
    """Stages sized by max_tokens, resumed with another accumulation (or world, or batch): their step counts
    recomputed moved every stage boundary, and the run went back into a finished stage (stage 0 trained again at its
    length on stage 1's weights, LR re-warmed) or cut the current one short. The checkpoint's counts win for the
    stages it ran and, sized by tokens, the one it is in; a stage's own max_steps still counts for the current one."""
    import types

    from training.config import parse_config
    from training.curriculum import resolve_stages, stage_start
    from training.curriculum_resume import keep_stage_steps

    recipe = tmp_path / "r.yaml"
    recipe.write_text("stages:\n  - {name: a, max_seq_length: 256, max_tokens: 1024}\n"
                      "  - {name: b, max_seq_length: 512, max_tokens: 1024}\n"
                      "  - {name: c, max_seq_length: 512, max_steps: 9}\n"
                      "  - {name: d, max_seq_length: 1024, max_tokens: 4096}\n")
    today = resolve_stages(parse_config(["--config", str(recipe), "--gradient_accumulation_steps", "1"]),
                           dp_of_sp=lambda sp: 1)
    assert [s.max_steps for s in today] == [4, 2, 9, 4]
    sizes = ["tokens:1024", "tokens:1024", "steps"]
    ran = types.SimpleNamespace(stage=1, stage_steps=[2, 1], stage_sizes=sizes[:2])  # at accumulation 2, in stage b
    kept = keep_stage_steps(today, ran)
    assert [s.max_steps for s in kept] == [2, 1, 9, 4] and stage_start(kept, 1) == 2
    assert "stage 0 (a) keeps the 2 steps it ran with" in capsys.readouterr().out
    in_c = types.SimpleNamespace(stage=2, stage_steps=[2, 1, 5], stage_sizes=sizes)  # c's max_steps 5 -> 9: taken
    assert [s.max_steps for s in keep_stage_steps(today, in_c)] == [2, 1, 9, 4]
    raised = types.SimpleNamespace(stage=1, stage_steps=[2, 1], stage_sizes=["tokens:1024", "tokens:512"])
    assert [s.max_steps for s in keep_stage_steps(today, raised)] == [2, 2, 9, 4]  # b's max_tokens raised: today's
    assert keep_stage_steps(today, types.SimpleNamespace(stage=0, stage_steps=None)) == today  # older checkpoints
    # the current stage's steps lowered below where the run is (killed at step 7 of c's 9, c set to 5: "good
    # enough"): c ends at the 7 it ran, evaluated; d begins there with all its steps (it began at c's old end,
    # cut short, never annealed; c had no end checkpoint); train_stage marks that checkpoint as c's end
    import dataclasses

    lowered = [*today[:2], dataclasses.replace(today[2], max_steps=5), today[3]]
    at = types.SimpleNamespace(stage=2, step=2 + 1 + 7, stage_steps=[2, 1, 9], stage_sizes=sizes)
    capsys.readouterr()
    kept = keep_stage_steps(lowered, at)
    assert [s.max_steps for s in kept] == [2, 1, 7, 4] and stage_start(kept, 3) == 10
    assert "stage 2 (c) has run 7 steps and today's settings give it 5: it ends at the 7" in capsys.readouterr().out
    import os

    from training.checkpoint import Checkpointer

    ck = Checkpointer(str(tmp_path / "run"), keep=2)
    os.makedirs(ck.root)
    ck.mark_stage_end(str(tmp_path / "elsewhere" / "step_000010"), "STAGE_2_c")  # another run's: not this one's end
    assert not os.path.exists(os.path.join(ck.root, "STAGE_2_c"))
    ck.mark_stage_end(os.path.join(ck.root, "step_000010"), "STAGE_2_c")
    ck.mark_stage_end(os.path.join(ck.root, "step_000012"), "STAGE_2_c")  # a marker there stays
    assert open(os.path.join(ck.root, "STAGE_2_c")).read() == "step_000010\n"


def test_flags_win_over_the_recipes_stages(tmp_path, capsys):
    """Defaults < recipe < flags, the stages included: `--config recipe --max_steps 2` (a smoke test) ran every
    stage's own max_steps / max_tokens, and --learning_rate changed only the stages without their own, without a word.
    Now the flag replaces the stages' values, with one note naming them; a flag not given leaves them."""
    from training.config import parse_config
    from training.curriculum import resolve_stages

    recipe = tmp_path / "r.yaml"
    recipe.write_text("stages:\n  - {name: a, max_seq_length: 256, max_tokens: 4096, learning_rate: 1.0e-4}\n"
                      "  - {name: b, max_seq_length: 512, max_steps: 40}\n")
    cfg = parse_config(["--config", str(recipe), "--max_steps", "2", "--learning_rate", "3e-4"])
    stages = resolve_stages(cfg, dp_of_sp=lambda sp: 1)
    assert [(s.max_steps, s.learning_rate, s.max_seq_length) for s in stages] == [(2, 3e-4, 256), (2, 3e-4, 512)]
    out = capsys.readouterr().out
    assert "--max_steps replaces the max_steps/max_tokens of stage(s) a, b" in out
    assert "--learning_rate replaces the learning_rate of stage(s) a" in out
    plain = resolve_stages(parse_config(["--config", str(recipe)]), dp_of_sp=lambda sp: 1)
    assert [(s.max_steps, s.learning_rate) for s in plain][1] == (40, plain[1].learning_rate) and plain[0].max_steps == 16
    unset = parse_config(["--config", str(recipe), "--max_steps", "-1", "--num_train_epochs", "1"])  # HF: unset
    assert [s.max_steps for s in resolve_stages(unset, dp_of_sp=lambda sp: 1)] == [16, 40]
    alone = parse_config(["--config", str(recipe), "--max_steps", "-1"])  # HF's unset, the recipe sizing its stages:
    assert alone.num_train_epochs is None  # nothing changes (without any length anywhere: 3 epochs, test_hf_flags)
    assert [s.max_steps for s in resolve_stages(alone, dp_of_sp=lambda sp: 1)] == [16, 40]
    cfg = parse_config(["--config", str(recipe), "--lr_scheduler_type", "cosine_with_min_lr", "--min_lr", "1e-6"])
    assert cfg.lr_scheduler == "cosine" and cfg.min_lr == 1e-6  # HF's name, its floor from --min_lr


def test_a_recipe_copied_to_a_run_folder_finds_the_shipped_deepspeed_config(tmp_path, monkeypatch):
    """A shipped recipe copied into a run folder (the sbatch-from-a-run-folder path) names
    `deepspeed: ds_configs/zero3_offload.json`, relative to the repository: it was refused there ("file not found").
    The repository's file is taken; a file of that name in the run folder still wins."""
    import os
    import shutil

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    shutil.copy(os.path.join(root, "recipes", "tiny_cpu.yaml"), tmp_path / "my.yaml")
    monkeypatch.chdir(tmp_path)
    cfg = parse_config(["--config", "my.yaml"])
    assert os.path.samefile(cfg.deepspeed, os.path.join(root, "ds_configs", os.path.basename(cfg.deepspeed)))
    (tmp_path / "ds_configs").mkdir()
    shutil.copy(cfg.deepspeed, tmp_path / "ds_configs")
    assert not os.path.isabs(parse_config(["--config", "my.yaml"]).deepspeed)  # the run folder's own


def test_a_local_model_and_tokenizer_are_recorded_as_absolute_paths(monkeypatch):
    """--model_name_or_path qwenbase (a folder, relative): checkpoints recorded it so, and an export run from another
    folder read it against its own working directory: the base's generation_config.json (an Instruct model's stops)
    was silently not found. Local paths are made absolute at start; a preset name stays a name."""
    import os

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    monkeypatch.chdir(root)
    cfg = parse_config(["--model_name_or_path", "recipes/base/tiny_passkey256",
                        "--tokenizer_name_or_path", "recipes/base/tiny_passkey256/tokenizer.model"])
    assert cfg.model_name_or_path == os.path.join(root, "recipes/base/tiny_passkey256")
    assert cfg.tokenizer_name_or_path == os.path.join(root, "recipes/base/tiny_passkey256/tokenizer.model")
    assert parse_config(["--model_name_or_path", "llama3-8b", "--dry_run"]).model_name_or_path == "llama3-8b"


@pytest.mark.parametrize("text, key, lines", [
    ("max_steps: 3\nlearning_rate: 1.0e-4\nmax_steps: 50\n", "max_steps", (1, 3)),
    ("stages:\n  - name: short\n    max_seq_length: 64\nlearning_rate: 1.0e-5\nstages:\n  - name: long\n"
     "    max_seq_length: 128\n", "stages", (1, 5)),
    ("stages:\n  - name: short\n    max_seq_length: 64\n    name: again\n", "name", (2, 4)),
    ("stages:\n  - {name: s, rope: {rope_type: yarn, factor: 2.0, factor: 4.0}, max_seq_length: 64}\n", "factor", (2, 2)),
], ids=["top-level", "stages-twice", "in-a-stage", "nested-flow"])
def test_a_recipe_key_given_twice_is_refused_naming_both_lines(tmp_path, text, key, lines):
    """YAML keeps the last of a key given twice without a word: `stages:` twice dropped the first list's stages,
    `max_steps` twice took the last. Refused in one line naming the key and both lines, at every depth."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(text)
    with pytest.raises(ValueError) as e:
        parse_config(["--config", str(recipe)])
    assert str(e.value) == (f"--config {recipe}: key {key!r} given twice (lines {lines[0]} and {lines[1]}): YAML keeps "
                            "only the last; keep one")


def test_a_yaml_merge_key_still_overrides(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("stages:\n  - &base {name: a, max_seq_length: 64}\n  - <<: *base\n    name: b\n")
    assert [s.name for s in parse_config(["--config", str(recipe)]).stages] == ["a", "b"]
    # an anchor that holds a merge itself, merged from a shallower node: PyYAML flattened it before its own check,
    # its merged key read as given twice (the third review)
    from training.config_types import yaml_text

    got = yaml_text("common: &common {learning_rate: 1.0e-5, warmup_steps: 10}\n"
                    "templates: {sft: {base: &base {<<: *common, warmup_steps: 20}}}\n"
                    "stages: [{<<: *base, name: short}]\n", "r.yaml")
    assert got["stages"] == [{"learning_rate": 1e-05, "warmup_steps": 20, "name": "short"}]


@pytest.mark.parametrize("argv, text, where", [
    (["--warmup_steps", "-3"], "", "--warmup_steps -3"),
    ([], "warmup_steps: -3\n", "--warmup_steps -3"),
    ([], "stages:\n  - {name: a, max_seq_length: 64}\n  - {name: b, max_seq_length: 128, warmup_steps: -2}\n",
     "stages[1].warmup_steps -2"),
])
def test_a_negative_warmup_is_refused(tmp_path, argv, text, where):
    """--warmup_steps -3 (a flag, a recipe's, a stage's) was accepted: only warmup_ratio was checked."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(text or "max_steps: 3\n")
    with pytest.raises(ValueError) as e:
        parse_config(["--config", str(recipe), *argv])
    assert str(e.value) == f"{where}: use 0 (no warmup) or a number of steps >= 1"
    assert parse_config(["--warmup_steps", "0"]).warmup_steps == 0


def test_a_resume_on_fewer_ranks_trains_the_rest_of_the_stages_epochs(capsys):
    """An epoch-sized stage began with 39 steps at dp 2 (78 samples), ran 4, resumed at dp 1 (today: 78 steps for the
    whole stage). It kept 39 and trained 43 of its 78 samples, then exited 0; now the 4 done stay and the 70 samples
    left take 70 steps. A --warmup_ratio warmup follows the final count (it took today's 78: 16, not 0.2 x 74)."""
    import dataclasses
    import types

    from training.curriculum import Stage
    from training.curriculum_resume import keep_stage_steps

    st = Stage(index=0, name="main", max_seq_length=128, sp=1, rope=None, learning_rate=1e-3, min_lr=0.0,
               warmup_steps=16, lr_scheduler="cosine", max_steps=78, reset_optimizer=False, steps_from="epochs:1",
               warmup_ratio=0.2)
    at = types.SimpleNamespace(stage=0, step=4, stage_steps=[39], stage_sizes=["epochs:1"])
    (kept,) = keep_stage_steps([st], at)
    assert (kept.max_steps, kept.warmup_steps) == (4 + 70, 15)
    out = capsys.readouterr().out
    assert "has run 4" in out and "70 more steps, 74 in all" in out and "warmup 15 steps" in out, out
    grown = types.SimpleNamespace(stage=0, step=4, stage_steps=[78], stage_sizes=["epochs:1"])  # dp 1 -> dp 2
    (kept,) = keep_stage_steps([dataclasses.replace(st, max_steps=39, warmup_steps=8)], grown)
    assert kept.max_steps == 4 + 37  # 74 samples left, 2 a step (it trained 78 - 4 steps: 152 samples of 78)
    same = types.SimpleNamespace(stage=0, step=4, stage_steps=[78], stage_sizes=["epochs:1"])  # same world: as it was
    assert keep_stage_steps([st], same) == [st]
    # resumed again at dp 1 after step 10 of the 74 planned (4 at dp 2 + 70 at dp 1): the 64 left stay 64 (the rate
    # its rest was planned at is recorded: stage_full 78; from the 74 alone it read as 67.5 -> 68 more)
    again = types.SimpleNamespace(stage=0, step=10, stage_steps=[74], stage_sizes=["epochs:1"], stage_full=[78])
    assert keep_stage_steps([st], again)[0].max_steps == 74
    # a review's case: planned 150 after one rescale (50 done at the first rate, the rest planned at a whole-stage 200),
    # resumed at 100 done where today's whole-stage count, 150, happens to equal the planned count: still rescaled
    # from the rate its rest was planned at (50 left x 150 / 200 = 38 more: it trained 50)
    odd = types.SimpleNamespace(stage=0, step=100, stage_steps=[150], stage_sizes=["epochs:1"], stage_full=[200])
    assert keep_stage_steps([dataclasses.replace(st, max_steps=150)], odd)[0].max_steps == 138
