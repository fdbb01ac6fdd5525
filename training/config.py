"""A run's config: defaults < `--config recipe.yaml` < command-line flags, read into the one typed tree
(training/config_tree.py: every field documented there) and validated before any process group.

Flag names follow the Hugging Face Trainer habits (`--per_device_train_batch_size`, `--gradient_accumulation_steps`,
...). Unknown keys are an error. The validated tree is saved with every checkpoint (`asdict`).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import typing

from training import hf_args
from training.config_tree import Config, StageConfig
from training.config_types import check_stages, typed_fields, yaml_flag, yaml_text
from training.ds_json import _load, _merge, check_sections, sp_sizes  # noqa: F401 (_merge, check_sections: re-exported)
from training.eval_flags import eval_flags_over_recipe
from training.eval_settings import run_eval


def _flag_type(tp):
    """argparse converter for a dataclass field annotation (Optional unwrapped)."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    base = args[0] if args else tp
    if base is dict:
        return yaml_flag
    return base


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line (train.py's input-error path), not argparse's usage block of every flag
        raise ValueError(f"{message}: see `python train.py --help`")


def _build_parser() -> argparse.ArgumentParser:
    p = _Parser(description="ulysses-longtrain: long-context training on DeepSpeed + Ulysses SP",
                allow_abbrev=False)  # a typo must not silently set another key
    p.add_argument("--config", default=None, help="YAML recipe; command-line flags override its keys")
    # set by the deepspeed launcher (--local_rank=N) and by `python -m torch.distributed.launch` (--local-rank=N, its
    # spelling since torch 2.0: torch/distributed/run.py); LOCAL_RANK in the environment is what is read
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    hf_args.add_arguments(p)  # the HF Trainer's names users carry over: mapped, or refused in one line
    hints = typing.get_type_hints(Config)
    for f in dataclasses.fields(Config):
        if f.name == "stages":
            continue
        tp = hints[f.name]
        if f.name in AUTO_OR_BOOL:  # --async_save (true), --no-async_save (false), --async_save auto|true|false
            p.add_argument(f"--{f.name}", nargs="?", const=True, default=argparse.SUPPRESS)
            p.add_argument(f"--no-{f.name}", dest=f.name, action="store_false", default=argparse.SUPPRESS)
        elif f.name in AUTO_OR_NUMBER:
            p.add_argument(f"--{f.name}", default=argparse.SUPPRESS)  # checked by validate
        elif f.name == "warmup_steps":  # transformers 5's --warmup_steps 0.1 is a ratio (hf_args.normalize)
            p.add_argument(f"--{f.name}", type=hf_args.steps_or_ratio, default=argparse.SUPPRESS)
        elif tp in (bool, bool | None):  # --bf16, --no-bf16, and the HF Trainer's --bf16 True / --bf16 false
            p.add_argument(f"--{f.name}", nargs="?", const=True, type=hf_args.bool_text, default=argparse.SUPPRESS)
            p.add_argument(f"--no-{f.name}", dest=f.name, action="store_false", default=argparse.SUPPRESS)
        else:
            p.add_argument(f"--{f.name}", type=_flag_type(tp), default=argparse.SUPPRESS)
    return p


def _check_keys(d: dict, cls, where: str) -> None:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"unknown config key(s) {unknown} in {where}: valid keys are {sorted(known)}")


def config_from_dict(d: dict, where: str = "config") -> Config:
    _check_keys(d, Config, where)
    d = typed_fields(d, Config, where)  # YAML's "1e-4" is a string: each value as its field declares (or one line)
    stages = []
    for i, s in enumerate(d.pop("stages", None) or []):
        if not isinstance(s, dict):
            raise ValueError(f"stage {i} in {where} must be a mapping, got {s!r}")
        _check_keys(s, StageConfig, f"{where} stages[{i}]")
        stages.append(StageConfig(**typed_fields(s, StageConfig, f"{where} stages[{i}]")))
    return Config(**d, stages=stages)


def parse_config(argv: list[str] | None = None) -> Config:
    """Defaults < YAML recipe (`--config`) < flags. Raises ValueError on any bad key or value."""
    ns, unknown = _build_parser().parse_known_args(argv)
    if unknown:
        raise ValueError(f"unknown command-line argument(s) {unknown}: see `python train.py --help`")
    args = vars(ns)
    args.pop("local_rank", None)
    hf_args.check_bools(args, [f.name for f in dataclasses.fields(Config) if f.type in ("bool", "bool | None")])
    recipe = args.pop("config")
    merged: dict = {}
    if recipe:
        recipe = os.path.expanduser(recipe)  # a quoted '~/recipes/x.yaml' (the shell expands only a bare one)
        if not os.path.isfile(recipe):
            raise ValueError(f"--config {recipe}: file not found")
        try:
            with open(recipe, encoding="utf-8") as fh:
                text = fh.read()
        except (OSError, UnicodeDecodeError) as e:  # a recipe saved as UTF-16 by an editor: a traceback before
            why = "not UTF-8 text: save it as UTF-8" if isinstance(e, UnicodeDecodeError) else f"unreadable ({e})"
            raise ValueError(f"--config {recipe}: {why}") from None
        merged = yaml_text(text, f"--config {recipe}") or {}
        if not isinstance(merged, dict):
            raise ValueError(f"--config {recipe}: expected a mapping of keys at the top level")
        check_stages(merged.get("stages"), recipe)  # before the eval flags walk the stages
    # each source's HF forms, before they merge (and before the flags replace the recipe's: transformers 5's
    # `--warmup_steps 0.1` is a --warmup_ratio over the recipe's warmup_steps; an empty --lr_scheduler_kwargs, HF's
    # default, sets nothing)
    hf_args.normalize(args, "on the command line")
    eval_flags_over_recipe(merged, args)  # an eval flag wins over the recipe's eval_* and its stages' eval blocks
    if str(args.get("max_steps", "")).strip() == "-1" and hf_args.sized(merged):
        del args["max_steps"]  # HF's unset: the recipe's own max_steps / max_tokens size the run, as before
    flags_over_stages(merged, args)
    hf_args.normalize(merged, f"in {recipe}")
    merged.update(args)
    merged = hf_args.apply(merged, where=recipe or "the command line", default_lr=Config.learning_rate)
    cfg = config_from_dict(merged, where=recipe or "command line")
    home_paths(cfg)
    validate(cfg)
    hf_args.resolve_hub_ids(cfg)  # a hub id: its snapshot in the local Hugging Face cache, offline
    settle_from_file(cfg, given=set(merged))  # SP degree / fp16 the DeepSpeed JSON sets; precision checks
    return cfg


# a run-level flag and the stage keys it sets for every stage when given on the command line (a stage's max_tokens
# sizes it as max_steps does); HF's names too (warmup_ratio: each stage's warmup from its steps, hf_args.epoch_stages)
STAGE_FLAGS = {"max_steps": ("max_steps", "max_tokens"), "max_seq_length": ("max_seq_length",),
               "learning_rate": ("learning_rate",), "min_lr": ("min_lr",), "_min_lr_rate": ("min_lr",),
               "warmup_steps": ("warmup_steps",), "warmup_ratio": ("warmup_steps",),
               "lr_scheduler": ("lr_scheduler",), "lr_scheduler_type": ("lr_scheduler",), "rope": ("rope",),
               "sequence_parallel_size": ("sequence_parallel_size",), "context_parallel_size": ("context_parallel_size",)}
# (--memory_features and --loss_weighting stay the default of the stages without their own: a stage's own is its
# feature, data/sharding.py and planner/auto_features.py)


def flags_over_stages(recipe: dict, args: dict) -> None:
    """Defaults < recipe < flags, for the recipe's stages too: a flag given on the command line replaces every
    stage's own value of it (`--config recipe.yaml --max_steps 2`, a smoke test, ran the whole curriculum; a stage's
    learning_rate beat --learning_rate), and the recipe's setting of the same thing under another name
    (hf_args.SAME_SETTING: --warmup_ratio over warmup_steps), in place, with one note naming what it replaced."""
    from base.log import print0

    stages = recipe.get("stages")
    said = hf_args.command_line_over_recipe(recipe, args)
    for flag, keys in STAGE_FLAGS.items():
        if flag not in args or flag == "max_steps" and str(args[flag]).strip() in ("-1", "0"):
            continue  # HF's unset --max_steps -1 (hf_args: epochs size the run) sets nothing
        names = [str(st.get("name") or f"stage {i}") for i, st in enumerate(stages or [])
                 if isinstance(st, dict) and any(k in st for k in keys)]
        for st in stages or []:
            for k in keys:
                if isinstance(st, dict):
                    st.pop(k, None)
        if names:
            said.append(f"--{hf_args.shown(flag)} replaces the {'/'.join(k for k in keys)} of stage(s) "
                        f"{', '.join(names)}")
    if said:
        print0("note: the command line wins over the recipe's stages and settings: " + "; ".join(said))


def validate(cfg: Config) -> None:
    """Checks that need no process group; the parallel layout checks the rest."""

    def positive(name, v):
        if v is None or v < 1:
            raise ValueError(f"--{name} must be >= 1, got {v}")

    for name in ("max_seq_length", "sequence_parallel_size", "per_device_train_batch_size",
                 "gradient_accumulation_steps", "max_steps"):
        positive(name, getattr(cfg, name))
    for where, w in [("--warmup_steps", cfg.warmup_steps)] + [(f"stages[{i}].warmup_steps", st.warmup_steps)
                                                              for i, st in enumerate(cfg.stages)]:
        if w is not None and w < 0:  # -3 gave a schedule with no warmup, without a word
            raise ValueError(f"{where} {w}: use 0 (no warmup) or a number of steps >= 1")
    hf_args.check(cfg)
    if not (0 < cfg.learning_rate <= MAX_LR and 0 <= cfg.min_lr <= cfg.learning_rate):  # nan, inf, 1e30 trained NaN
        raise ValueError(f"need 0 <= --min_lr ({cfg.min_lr}) <= --learning_rate ({cfg.learning_rate}) <= {MAX_LR}, "
                         "lr > 0 (AdamW's are ~1e-6 to 1e-3)")
    for i, st in enumerate(cfg.stages):  # (their min_lr: training/curriculum.resolve_stages)
        if st.learning_rate is not None and not 0 < st.learning_rate <= MAX_LR:
            raise ValueError(f"stages[{i}].learning_rate {st.learning_rate}: use a rate in (0, {MAX_LR}]")
    settings_at_least_0(cfg)
    if not str(cfg.output_dir).strip():  # '' made the run lock's makedirs('') a traceback (the dry run took it)
        raise ValueError("--output_dir '': name the run's folder, e.g. --output_dir checkpoints/run")
    if cfg.lr_scheduler not in ("cosine", "linear", "constant"):
        raise ValueError(f"--lr_scheduler {cfg.lr_scheduler!r}: use cosine, linear or constant")
    if cfg.attn_implementation not in ("auto", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention"):
        raise ValueError(f"--attn_implementation {cfg.attn_implementation!r}: use auto, sdpa or flash_attention_2 "
                         "(eager cannot run under Ulysses SP)")
    cfg.context_parallel_size = cp_setting(cfg.context_parallel_size, "--context_parallel_size")
    for i, st in enumerate(cfg.stages):
        if st.context_parallel_size is not None:
            st.context_parallel_size = cp_setting(st.context_parallel_size, f"stages[{i}].context_parallel_size")
    cfg.attention_head_chunks = cp_setting(cfg.attention_head_chunks, "--attention_head_chunks")
    if cfg.reset_position_ids not in ("auto", "yes", "no"):
        raise ValueError(f"--reset_position_ids {cfg.reset_position_ids!r}: use auto, yes or no")
    if str(cfg.resume).lower() in ("true", "false", "yes", "no", "latest", "last") and not os.path.exists(cfg.resume):
        raise ValueError(f"--resume {cfg.resume}: use auto (the newest complete checkpoint), none (start fresh) or a "
                         "checkpoint's path")  # HF's resume_from_checkpoint true / latest, taken as a path later
    for where, kind in [("--data_kind", cfg.data_kind)] + [(f"stages[{i}].kind", st.kind) for i, st in enumerate(cfg.stages)]:
        if kind not in (None, "text", "sft") or (kind == "sft" and cfg.reset_position_ids == "no"):
            raise ValueError(f"{where} {kind!r}: use text or sft (sft packs conversations with document masking: "
                             "not with --reset_position_ids no)")
    for where, lw in [("--loss_weighting", cfg.loss_weighting)] + [
            (f"stages[{i}] ({st.name or f'stage{i}'}) loss_weighting", st.loss_weighting)
            for i, st in enumerate(cfg.stages) if st.loss_weighting is not None]:
        if lw not in ("token", "conversation"):
            raise ValueError(f"{where} {lw!r}: use token or conversation")
        if lw == "conversation" and cfg.reset_position_ids == "no":
            raise ValueError(f"{where} conversation finds conversations where position ids restart: drop "
                             f"--reset_position_ids no (or use {where} token)")
    if cfg.save_total_limit < 2:
        raise ValueError(f"--save_total_limit {cfg.save_total_limit}: keep at least 2 so the newest complete "
                         "checkpoint is never deleted before a newer one is committed")
    if cfg.logits_tile_mb < 0:
        raise ValueError(f"--logits_tile_mb {cfg.logits_tile_mb}: use MiB of fp32 logits per tile (> 0), or 0 for "
                         "the default (1024; under memory_features auto 1/64 of the memory budget)")
    cfg.save_interval_minutes = interval_setting(cfg.save_interval_minutes)
    cfg.async_save = auto_or_bool(cfg.async_save, "--async_save", "on for a GPU run whose host memory fits the snapshot")
    if cfg.save_steps < 0:
        raise ValueError(f"--save_steps {cfg.save_steps}: use 0 (end and preemption only) or a positive interval")
    # a nan / inf time limit meant none; a nan / inf / 1e30 timeout, datetime.timedelta's traceback at the group's start
    if not 0 <= cfg.time_limit_s < math.inf:
        raise ValueError(f"--time_limit_s {cfg.time_limit_s}: use seconds >= 0 (0: none)")
    if not 0 < cfg.dist_timeout_s <= MAX_TIMEOUT_S:
        raise ValueError(f"--dist_timeout_s {cfg.dist_timeout_s}: use seconds > 0 (and <= {MAX_TIMEOUT_S:.0e})")
    if cfg.report_to not in ("auto", "wandb", "none"):
        raise ValueError(f"--report_to {cfg.report_to!r}: use auto, wandb or none")
    shipped = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), cfg.deepspeed)
    if not os.path.isfile(cfg.deepspeed) and not os.path.isabs(cfg.deepspeed) and os.path.isfile(shipped):
        cfg.deepspeed = shipped  # the repository's ds_configs/, from a run folder (a recipe copied there names them so)
    if not os.path.isfile(cfg.deepspeed):
        raise ValueError(f"--deepspeed {cfg.deepspeed}: file not found (see ds_configs/)")
    if cfg.dataset_path is not None and not os.path.exists(cfg.dataset_path):
        dataset_input(cfg.dataset_path)
    run_eval(cfg)  # a bad eval_* value: one line now


def dataset_input(spec: str) -> None:
    """ValueError (one line) where `--dataset_path` names nothing to read: not a file or folder, nor `name=PATH` of one,
    nor a pattern naming at least one file (`DIR/data/train_sft-*.parquet`, what docs/data.md and the several-splits
    refusal offer: it was refused here as "no such file or folder"). What the pattern names is judged as prepare_data
    judges it (data/jsonl.matching: a split missing a shard). Cost: one glob, at parse time on every rank."""
    from data.jsonl import matching

    name, eq, path = spec.partition("=")  # data/discover.discover's reading: a name holds no `/`
    path = path if eq and "/" not in name else spec
    if not os.path.exists(path) and matching(path, "--dataset_path") is None:
        raise ValueError(f"--dataset_path {spec}: no such file or folder")


HOME_PATHS = ("output_dir", "dataset_path", "model_name_or_path", "tokenizer_name_or_path", "deepspeed", "resume")


def home_paths(cfg: Config) -> None:
    """A leading `~` in a path the user gives is their home folder, as transformers' TrainingArguments reads output_dir
    (training_args.py, expanduser): `--output_dir=~/runs/x` or a recipe's `output_dir: ~/runs/x` (no shell expands
    either) was a folder named `~` in the working directory (and `rm -rf ~` to clean it up removes the home folder).
    Hub ids and preset names never begin with `~`; auto / none stay."""
    for name in HOME_PATHS:
        value = getattr(cfg, name)
        if isinstance(value, str) and value.startswith("~"):
            setattr(cfg, name, os.path.expanduser(value))


MAX_LR = 1.0  # a larger peak LR trains NaN from the first step (and the run "succeeded")
MAX_TIMEOUT_S = 1e9  # inf / nan / 1e30 overflowed datetime.timedelta at the group's start; LLaMA-Factory's examples
# carry ddp_timeout: 180000000 (~6 years, "never"), which the waits on rank 0 cap at 6 h anyway (docs/multinode.md)


def settings_at_least_0(cfg: Config) -> None:
    """The numbers whose 0 means off or unset: a negative or NaN one was read as unset (or, weight decay under
    FusedAdam, applied: it grows the weights); one line naming the value."""
    if cfg.max_grad_norm < 0:  # -1: HF's / PaddleNLP's "no clipping", as DeepSpeed reads any value <= 0
        cfg.max_grad_norm = 0.0
    for name, fix in (("weight_decay", "0 (none) or a decay such as 0.1"),
                      ("max_grad_norm", "a norm to clip at such as 1.0, or 0 (no clipping)"),
                      ("gpu_mem_gb", "GB per rank, or 0 (detected from the device)"),
                      ("mem_cap_gb", "GB per rank, or 0 (none)"), ("nodes", "a count, or 0 (the launched world)"),
                      ("gpus_per_node", "a count, or 0 (the launched world's)"),
                      ("checkpoint_every", "K >= 1 (layers 0, K, 2K, ...), or 0 (off)")):
        value = getattr(cfg, name)
        if not 0 <= value < math.inf:
            raise ValueError(f"--{name} {value}: use {fix}")


AUTO_OR_BOOL = ("async_save",)  # auto | true | false (a recipe's bool, a flag's text)
AUTO_OR_NUMBER = ("save_interval_minutes",)


def auto_or_bool(value, where: str, auto: str) -> bool | str:
    """`auto`, or a bool (a flag arrives as text: true/false, yes/no, on/off, 1/0); `auto` says what auto does."""
    if isinstance(value, str):
        value = {"auto": "auto", "true": True, "yes": True, "on": True, "1": True,
                 "false": False, "no": False, "off": False, "0": False}.get(value.strip().lower(), value)
    if value == "auto" or isinstance(value, bool):
        return value
    raise ValueError(f"{where} {value!r}: use auto ({auto}), true or false")


def interval_setting(value) -> float | str:
    """`save_interval_minutes`: auto or minutes >= 0 (0: off); a flag arrives as text."""
    number = value
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            pass
    if isinstance(number, (int, float)) and not isinstance(number, bool) and number >= 0:
        return float(number)
    raise ValueError(f"--save_interval_minutes {value!r}: use auto (9 minutes, longer where a save blocks the steps "
                     "> 1% of it), 0 (off) or a positive number of minutes (the work a crash may lose)")


def cp_setting(value, where: str) -> int | str:
    """`auto` or an integer >= 1 (a flag arrives as text)."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value
    what = "the heads per rank" if "head" in where else "sequence_parallel_size"
    raise ValueError(f"{where} {value!r}: use auto or an integer >= 1 dividing {what}")


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


# --- what the DeepSpeed JSON decides before the process group exists (read here, so config and the DeepSpeed
# config assembly do not import each other; the file itself is read by training/ds_json.py) ---


def no_gpu() -> bool:
    import torch

    return not torch.cuda.is_available() or os.environ.get("DS_ACCELERATOR") == "cpu"


def settle_from_file(cfg: Config, given: set[str]) -> None:
    """Settings the DeepSpeed JSON decides before the process group exists; `given` are the keys the flags or the
    recipe set. Fills cfg in place (SP degree, micro batch, accumulation, fp16, bf16) where no flag or recipe key
    set them and checks precision; one-line ValueError otherwise."""
    ds = _load(cfg.deepspeed)
    for n, what in sp_sizes(ds, cfg.deepspeed):  # the seed guide's block, DeepSpeed's own key (ALST tutorial)
        if "sequence_parallel_size" not in given:
            cfg.sequence_parallel_size = n
        elif cfg.sequence_parallel_size != n:
            raise ValueError(f"--sequence_parallel_size {cfg.sequence_parallel_size} contradicts {cfg.deepspeed} "
                             f"{what} {n}: drop one of them or make them agree")
        for i, s in enumerate(cfg.stages):
            if s.sequence_parallel_size not in (None, n):
                raise ValueError(f"stages[{i}] sets sequence_parallel_size {s.sequence_parallel_size} but "
                                 f"{cfg.deepspeed} {what} is {n}: remove it from the JSON (stages set their own SP) "
                                 "or make them agree")
    for key, name in (("gradient_accumulation_steps", "gradient_accumulation_steps"),
                      ("train_micro_batch_size_per_gpu", "per_device_train_batch_size")):
        if isinstance(ds.get(key), int) and not isinstance(ds[key], bool) and name not in given:
            setattr(cfg, name, ds[key])  # the JSON's own value where no flag set it (a contradiction: ds_config.py)
    if ds.get("fp16", {}).get("enabled") is True and "fp16" not in given:
        cfg.fp16 = True  # the JSON asks for fp16 and no flag said otherwise
    if ds.get("bf16", {}).get("enabled") is True and "bf16" not in given and not cfg.fp16:
        cfg.bf16 = True  # likewise bf16 (a CPU --dry_run planning a GPU run defaulted to fp32 and refused it)
    if ds.get("bf16", {}).get("enabled") is False and "bf16" not in given:
        cfg.bf16 = False  # the JSON's fp32 wins over the GPU's (and a dry run's planning one) bf16 default
    if cfg.fp16 and cfg.bf16 is None:
        cfg.bf16 = False
    check_precision(cfg, bf16=bool(cfg.bf16), planning=cfg.dry_run)


def check_precision(cfg: Config, bf16: bool, planning: bool = False) -> None:
    if cfg.fp16 and bf16:
        raise ValueError("--fp16 and --bf16 are both on: pick one (--no-bf16 for fp16)")
    if cfg.fp16 and not planning and no_gpu():
        raise ValueError("fp16 needs a GPU with loss scaling: use --bf16 or fp32 on CPU")
