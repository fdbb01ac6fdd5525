"""The Hugging Face Trainer's argument names a user carries over (`TrainingArguments`), and `--num_train_epochs`.

A command written for the HF Trainer (the seed guide's `deepspeed --num_gpus=32 train.py --deepspeed ds_config.json
--model_name_or_path meta-llama/Meta-Llama-3-8B --max_seq_length 524288 --per_device_train_batch_size 1
--learning_rate 2e-5 --num_train_epochs 1`) runs here as written. Most names are this project's own already
(`per_device_train_batch_size`, `gradient_accumulation_steps`, `learning_rate`, `weight_decay`, `max_grad_norm`,
`max_steps`, `warmup_steps`, `save_steps`, `save_total_limit`, `output_dir`, `seed`, `bf16`, `fp16`, `deepspeed`,
`gradient_checkpointing`, `report_to`, `run_name`: the W&B run's name); the others are mapped where they mean the
same (ALIASES, `num_train_epochs`, `warmup_ratio`, `do_train`/`do_eval`, `logging_steps 1`,
`per_device_eval_batch_size 1`, `lr_scheduler_kwargs` holding cosine_with_min_lr's floor, transformers 5's
`warmup_steps 0.1` as a ratio) and refused in one line naming this project's flag where they do not (REFUSED).
Never silently ignored. A name given on the command line replaces the recipe's setting of the same thing under
either name (SAME_SETTING: `--lr_scheduler_type` over a recipe's `lr_scheduler`, `--warmup_ratio` over its
`warmup_steps`); both names in one place are refused unless they agree.

`num_train_epochs` as the Trainer means it: a stage without its own `max_steps`/`max_tokens` trains that many epochs
over its packed training samples, `max(1, ceil(epochs x batches_per_epoch / gradient_accumulation_steps))` optimizer
steps where `batches_per_epoch = ceil(samples / (dp x per_device_train_batch_size))` (the sampler's own epoch, its last
batch padded: data/sampler.py); `max_steps` wins when both are set (recipe or flag); `max_steps -1` (the Trainer's "by epochs") without
`num_train_epochs` is the Trainer's default, 3 epochs, said in a note. The data's size is known only once the run
has opened its data: `epoch_stages` fixes the steps then (rank 0 counts, every rank receives the same numbers).
`warmup_ratio` (HF: `ceil(ratio x steps)` warmup steps) is applied there too, per stage, from its final steps.

A hub id as the model or tokenizer (`meta-llama/Meta-Llama-3-8B`) becomes its snapshot folder in the local Hugging
Face cache (`resolve_hub_ids`, model_utils/hub.py), offline, before anything reads it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os

ALIASES = {"lr_scheduler_type": "lr_scheduler", "resume_from_checkpoint": "resume", "ddp_timeout": "dist_timeout_s"}
# HF lr_scheduler_type -> ours (HF's "constant" has no warmup: the same only without warmup, checked in `apply`)
SCHEDULERS = {"cosine": "cosine", "linear": "linear", "constant_with_warmup": "constant", "constant": "constant",
              "cosine_with_min_lr": "cosine"}  # its floor: --min_lr, or lr_scheduler_kwargs' min_lr / min_lr_rate
# names of one setting: on the command line either replaces the recipe's either (a note says so), both in one place
# are refused unless they agree (an alias and ours: the same value; warmup_ratio and warmup_steps: `check`)
SAME_SETTING = [("lr_scheduler_type", "lr_scheduler"), ("resume_from_checkpoint", "resume"),
                ("ddp_timeout", "dist_timeout_s"), ("_min_lr_rate", "min_lr"), ("warmup_ratio", "warmup_steps")]
HF_EPOCHS = 3.0  # TrainingArguments.num_train_epochs' default: what max_steps -1 trains when no epochs are given
NO_OPS = ("do_train", "do_eval")  # train.py trains, and evaluates at each stage's end (--no-eval: not)
ONLY_ONE = {  # accepted at 1, what this project does; another value is refused with the reason
    "logging_steps": "every optimizer step's loss is written to OUTPUT_DIR/metrics.jsonl (and wandb): drop it",
    "per_device_eval_batch_size": "the held-out evaluation runs one sample per SP group (--eval_heldout_samples sets "
                                  "how many): drop it",
}
REFUSED = {
    "eval_steps": "evaluation runs at each stage's end: its eval: block or --eval_heldout_samples / --eval_tasks",
    "eval_strategy": "evaluation runs at each stage's end: its eval: block or --eval_heldout_samples / --eval_tasks",
    "evaluation_strategy": "evaluation runs at each stage's end: its eval: block or --eval_heldout_samples / "
                           "--eval_tasks",
    "save_strategy": "use --save_steps N and --save_interval_minutes M (0: at the end and on preemption only)",
    "logging_dir": "metrics go to OUTPUT_DIR/metrics.jsonl and the rank logs to OUTPUT_DIR/logs: use --output_dir",
    "logging_strategy": "every optimizer step is logged (OUTPUT_DIR/metrics.jsonl): drop it",
    "overwrite_output_dir": "a run continues its folder's newest checkpoint (--resume auto): use a new --output_dir, "
                            "or --resume none to start over in it",
    "warmup_steps_ratio": "use --warmup_ratio or --warmup_steps",
    "optim": "AdamW is built from the flags (ds_config.py); another optimizer goes in the DeepSpeed JSON's "
             "optimizer block (--deepspeed)",
    "adam_beta1": "set betas in the DeepSpeed JSON's optimizer block (--deepspeed)",
    "adam_beta2": "set betas in the DeepSpeed JSON's optimizer block (--deepspeed)",
    "adam_epsilon": "set eps in the DeepSpeed JSON's optimizer block (--deepspeed)",
    "dataloader_num_workers": "samples are read from the memory-mapped prepared folder in the training process",
    "push_to_hub": "the run exports OUTPUT_DIR/hf_model (--export_hf); push that folder yourself",
    "hub_model_id": "the run exports OUTPUT_DIR/hf_model (--export_hf); push that folder yourself",
    "torch_compile": "not supported under Ulysses SP here",
    "tf32": "TF32 matmuls follow torch's defaults here",
    "gradient_checkpointing_kwargs": "use --gradient_checkpointing or --checkpoint_every K (and --keep_attention)",
    "save_only_model": "a checkpoint holds the full training state so a requeue resumes exactly; --export_hf writes "
                       "the model alone at the end",
    "do_predict": "use scripts/evaluate.py on the exported model",
    "model_max_length": "use --max_seq_length",
    "block_size": "use --max_seq_length",
    "train_file": "prepare it with scripts/prepare_data.py and pass --dataset_path",
    "dataset_name": "prepare it with scripts/prepare_data.py and pass --dataset_path",
    "num_train_steps": "use --max_steps or --num_train_epochs",
    # TRL's SFTConfig / LLaMA-Factory / transformers names commonly copied over
    "max_length": "use --max_seq_length (tokens per packed sample)",
    "cutoff_len": "use --max_seq_length (tokens per packed sample)",
    "data_seed": "the data order follows --seed (each stage's sampler: seed + stage index)",
    "packing": "samples are always packed, padding-free (documents masked from each other): drop it",
    "padding_free": "samples are always packed, padding-free (documents masked from each other): drop it",
    "assistant_only_loss": "chat rows train the assistant's replies by default (scripts/prepare_data.py --loss_on; "
                           "docs/sft.md): drop it",
    "completion_only_loss": "a prompt/completion row trains its completion by default (scripts/prepare_data.py "
                            "--loss_on; docs/sft.md): drop it",
    "dataset_text_field": "prepare the data with scripts/prepare_data.py --text_field NAME and pass --dataset_path",
    "chat_template_path": "chat rows are rendered at preparation: scripts/prepare_data.py --chat_template FILE "
                          "(a jinja file or a tokenizer folder, as TRL takes it; docs/sft.md), then --dataset_path",
    "dataset_num_proc": "scripts/prepare_data.py --workers N tokenizes in parallel, before training",
    "use_liger_kernel": "use --tiled_logits (the loss never holds the full logits) or --memory_features auto",
    "include_num_input_tokens_seen": "every step's total_tokens is in OUTPUT_DIR/metrics.jsonl: drop it",
    "average_tokens_across_devices": "the loss is always the mean over the whole global batch's tokens "
                                     "(--loss_weighting token): drop it",
    "neftune_noise_alpha": "NEFTune embedding noise is not supported: drop it",
    "label_smoothing_factor": "label smoothing is not supported: drop it",
    "torch_dtype": "use --bf16 or --fp16 (neither: bf16 on a GPU, fp32 on CPU)",
    "dtype": "use --bf16 or --fp16 (neither: bf16 on a GPU, fp32 on CPU)",
}
HF_NAMES = (*ALIASES, *NO_OPS, *ONLY_ONE, *REFUSED, "lr_scheduler_kwargs")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The carried-over names on the command line (their values are checked in `apply`, with the recipe's)."""
    for name in HF_NAMES:  # nargs="?": a refused switch (--overwrite_output_dir) or one with a value, both parsed
        p.add_argument(f"--{name}", nargs="?", const=True, default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def bool_text(value: str) -> bool | str:
    """A boolean flag's value as HfArgumentParser takes it (`--bf16 True`, `--gradient_checkpointing false`); another
    text is returned as is, for `check_bools` to refuse in one line."""
    got = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}.get(value.strip().lower())
    return value if got is None else got


def check_bools(args: dict, names) -> None:
    """A boolean flag given a value that is not one: one line (argparse would print its whole usage)."""
    for name in names:
        if isinstance(args.get(name), str):
            raise ValueError(f"--{name} {args[name]!r}: use true or false (or --{name} / --no-{name})")


def _number(value, name: str):
    try:
        if isinstance(value, bool):
            raise ValueError
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"--{name} {value!r}: expected a number") from None


def steps_or_ratio(text: str) -> int | float | str:
    """--warmup_steps' text: a whole number, or transformers 5's ratio (a fraction below 1, which `normalize` makes
    warmup_ratio); another text is kept for `normalize` or the config's typing to refuse in one line."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _as_ours(hf: str, value):
    """An alias's value in this project's terms (for comparing it with this project's key)."""
    if hf == "lr_scheduler_type":
        return SCHEDULERS.get(str(value), value)
    if hf == "resume_from_checkpoint":
        return "auto" if value is True else value  # HF's bare flag: the newest checkpoint in output_dir
    return _number(value, hf)  # ddp_timeout


def _same(hf: str, value, ours) -> bool:
    return _as_ours(hf, value) == (_number(ours, ALIASES[hf]) if hf == "ddp_timeout" else ours)


def shown(name: str) -> str:
    """A setting's name as the user gave it (normalize's `_min_lr_rate` came from --lr_scheduler_kwargs)."""
    return "lr_scheduler_kwargs min_lr_rate" if name == "_min_lr_rate" else name


def sized(recipe: dict) -> bool:
    """Whether a recipe sizes its run itself: max_steps / max_tokens at the top or in a stage (HF's unset
    `--max_steps -1` then leaves it so, as it did before -1 meant the Trainer's 3 epochs)."""
    stages = [st for st in recipe.get("stages") or [] if isinstance(st, dict)]
    return any(str(d.get(k, "")).strip() not in ("", "-1", "None") for d in (recipe, *stages)
               for k in ("max_steps", "max_tokens"))


def command_line_over_recipe(recipe: dict, args: dict) -> list[str]:
    """The recipe's top-level setting of what a command-line flag sets, under either name (SAME_SETTING), dropped:
    `--lr_scheduler_type linear` over a recipe's `lr_scheduler: cosine` was refused as a contradiction, and
    `--warmup_ratio 0.03` over every shipped recipe's `warmup_steps` as one with a flag never given. Returns what a
    note should say (the settings under another name; an alias replaces its key as the key's own flag does)."""
    said = []
    for pair in SAME_SETTING:
        given = [name for name in pair if name in args]
        for name in pair:
            if given and name not in args and name in recipe:
                value = recipe.pop(name)
                if pair[0] not in ALIASES:
                    said.append(f"--{shown(given[0])} replaces the recipe's {name} {value}")
    return said


def normalize(src: dict, where: str) -> None:
    """One source's (the command line's or the recipe's) Hugging Face forms in this project's terms, in place, before
    the two merge: transformers 5's `warmup_steps 0.1` (a fraction below 1) is warmup_ratio; lr_scheduler_kwargs'
    floor is min_lr (min_lr_rate: x the learning rate, in `apply`); an alias beside this project's name of it must
    agree. `where`: "on the command line" or "in RECIPE"."""
    w = src.get("warmup_steps")
    if isinstance(w, float | str):
        try:
            number = float(w)
        except ValueError:
            number = None  # not a number: the config's typing refuses it in one line
        if number is not None and 0 < number < 1:
            if "warmup_ratio" in src:
                raise ValueError(f"--warmup_steps {w} (a ratio, as transformers 5 reads it) and --warmup_ratio "
                                 f"{src['warmup_ratio']} {where} both set the warmup: drop one")
            del src["warmup_steps"]
            src["warmup_ratio"] = number
        elif number is not None and not number.is_integer():
            raise ValueError(f"--warmup_steps {w}: use a whole number of steps (or a fraction below 1: a ratio of "
                             "the steps, as transformers 5 reads it)")
        elif number is not None and isinstance(w, float):
            src["warmup_steps"] = int(number)
    if "lr_scheduler_kwargs" in src:
        text = kw = src.pop("lr_scheduler_kwargs")
        if isinstance(kw, str):
            try:
                kw = json.loads(kw)  # HF parses a dict-typed flag's text as JSON
            except ValueError:
                kw = None
        if not (text is None or kw == {}):  # none or an empty mapping (YAML's `lr_scheduler_kwargs: {}`): nothing
            if not (isinstance(kw, dict) and len(kw) == 1 and next(iter(kw)) in ("min_lr", "min_lr_rate")):
                raise ValueError(f"--lr_scheduler_kwargs {text!r}: only cosine_with_min_lr's floor is read here, "
                                 '{"min_lr": X} or {"min_lr_rate": R}; otherwise use --lr_scheduler '
                                 "cosine|linear|constant, --warmup_steps and --min_lr")
            ((key, value),) = kw.items()
            value = _number(value, f"lr_scheduler_kwargs {key}")
            if "min_lr" in src and (key == "min_lr_rate" or _number(src["min_lr"], "min_lr") != value):
                raise ValueError(f"--lr_scheduler_kwargs {text!r} and --min_lr {src['min_lr']} {where} set the same "
                                 "thing: drop one")
            src["min_lr" if key == "min_lr" else "_min_lr_rate"] = value
    for hf, ours in ALIASES.items():
        if hf in src and ours in src and not _same(hf, src[hf], src[ours]):
            raise ValueError(f"--{hf} {src[hf]!r} and --{ours} {src[ours]!r} {where} set the same thing: drop one")


def apply(d: dict, where: str, default_lr: float) -> dict:
    """`d` (recipe keys and flags merged) with the HF names replaced by this project's; one-line ValueError for a
    name that does not mean the same here, or an alias that contradicts the project's own key. `default_lr`: the
    config's learning rate when `d` sets none (lr_scheduler_kwargs' min_lr_rate is a share of it)."""
    d = dict(d)
    for name in [k for k in d if k in REFUSED]:
        raise ValueError(f"--{name} (a Hugging Face training argument) is not taken by this project: {REFUSED[name]}")
    for name in [k for k in d if k in ONLY_ONE]:
        if _number(d.pop(name), name) != 1:
            raise ValueError(f"--{name} (a Hugging Face Trainer argument): only 1 means the same here: {ONLY_ONE[name]}")
    for name in NO_OPS:
        if d.pop(name, True) not in (True, "true", "True", "1"):
            raise ValueError(f"--{name} false: train.py always trains, and evaluates at each stage's end unless "
                             "--no-eval: drop it (or use --no-eval)")
    rate = d.pop("_min_lr_rate", None)  # lr_scheduler_kwargs' min_lr_rate: the floor as a share of each peak
    if rate is not None:
        d["min_lr"] = rate * _number(d.get("learning_rate", default_lr), "learning_rate")
        for st in d.get("stages") or []:  # a stage with its own peak (and no own floor) gets its own share
            if isinstance(st, dict) and "learning_rate" in st and "min_lr" not in st:
                st["min_lr"] = rate * _number(st["learning_rate"], "learning_rate")
    if "lr_scheduler_type" in d:
        kind = str(d["lr_scheduler_type"])
        if kind not in SCHEDULERS:
            raise ValueError(f"--lr_scheduler_type {kind!r}: this project has --lr_scheduler cosine, linear or "
                             "constant (with warmup: constant_with_warmup), decaying to --min_lr")
        if kind == "constant" and (d.get("warmup_steps") or d.get("warmup_ratio")):
            raise ValueError("--lr_scheduler_type constant has no warmup in the Hugging Face Trainer, and a warmup is "
                             "set: use constant_with_warmup (--lr_scheduler constant), or drop the warmup")
        stages = [st for st in d.get("stages") or [] if isinstance(st, dict)]
        if kind == "cosine_with_min_lr" and d.get("min_lr") is None and not (
                stages and all(st.get("min_lr") is not None for st in stages)):  # HF raises too: decayed to 0 here
            raise ValueError("--lr_scheduler_type cosine_with_min_lr needs its floor: give --min_lr X (or "
                             "--lr_scheduler_kwargs '{\"min_lr_rate\": R}'), or use cosine, which decays to 0")
    for hf, ours in ALIASES.items():  # one source set both only if they agree (`normalize`)
        if hf in d:
            value = _as_ours(hf, d.pop(hf))
            if ours in d and not _same(hf, value, d[ours]):
                raise ValueError(f"--{hf} {value!r} and --{ours} {d[ours]!r} in {where} set the same thing: drop one")
            d[ours] = value
    if str(d.get("max_steps")).strip() == "-1" and d.get("num_train_epochs") is None:
        from base.log import print0

        d["num_train_epochs"] = HF_EPOCHS  # HF's "train by epochs", its default count: the run as the Trainer runs it
        print0(f"note: max_steps -1 (the Hugging Face Trainer's \"by epochs\") without num_train_epochs: "
               f"{HF_EPOCHS:g} epochs, the Trainer's default (give --num_train_epochs N or --max_steps N to choose)")
    if d.get("num_train_epochs") is not None and d.get("max_steps") is not None:
        if str(d["max_steps"]).strip().lstrip("-").isdigit() and int(d["max_steps"]) <= 0:
            d.pop("max_steps")  # the Trainer's default -1: not set, the epochs count
        else:  # the Trainer's rule: max_steps wins (from a recipe, it beat a flag's epochs without a word)
            from base.log import print0

            n = d["num_train_epochs"]
            print0(f"note: --num_train_epochs {f'{n:g}' if isinstance(n, int | float) else n} is not used: max_steps "
                   f"{d['max_steps']} is set in {where} (max_steps wins, as in the Hugging Face Trainer)")
            d["num_train_epochs"] = None
    return d


def check(cfg) -> None:
    """num_train_epochs and warmup_ratio values (validate calls this)."""
    if cfg.num_train_epochs is not None and not 0 < cfg.num_train_epochs < math.inf:  # inf: a traceback in epoch_steps
        raise ValueError(f"--num_train_epochs {cfg.num_train_epochs}: use a number > 0 (or --max_steps)")
    if not 0 <= cfg.warmup_ratio < 1:
        raise ValueError(f"--warmup_ratio {cfg.warmup_ratio}: use a fraction of the steps in [0, 1)")
    if cfg.warmup_ratio and cfg.warmup_steps:  # (a stage's own warmup_steps wins over the run's ratio)
        raise ValueError(f"--warmup_ratio {cfg.warmup_ratio} and --warmup_steps {cfg.warmup_steps} both set the "
                         "warmup: drop one")


def epoch_steps(epochs: float, samples: int, dp: int, micro_batch: int, accum: int) -> int:
    """Optimizer steps of `epochs` epochs over `samples` packed samples: every sample of every epoch (the sampler pads
    an epoch's last batch, data/sampler.py, as the Trainer's does) in whole steps of `accum` micro-batches, counted over
    the run (the Trainer's last step of an epoch is partial; here a step takes the next epoch's first micro-batches,
    so a per-epoch ceil would compound: 4.8 epochs for 3). The floors before left up to 10% of an epoch untrained at
    long context (1,000 samples at dp 32 x accumulation 4: 896 trained). At most one step's micro-batches over."""
    batches = -(-samples // (dp * micro_batch))  # data/sampler.py's batches_per_epoch
    return max(1, math.ceil(epochs * batches / accum))


def ratio_steps(ratio: float, steps: int) -> int:
    """ceil(ratio x steps) without float noise (0.1 x 30 is 3.0000000000000004 in floats: 4 steps, not 3)."""
    return math.ceil(round(ratio * steps, 9))


def epoch_stages(cfg, stages: list, data, world: int) -> list:
    """`stages` with the steps of --num_train_epochs and the warmup of --warmup_ratio fixed, from the run's data (rank 0
    counts its samples, every rank receives the same stages); unchanged when neither is set."""
    if cfg.num_train_epochs is None and not cfg.warmup_ratio:
        return stages
    from base import comm
    from base.log import print0

    def decide() -> list:
        out, lines = [], []
        for st in stages:
            own = cfg.stages[st.index] if cfg.stages else None
            steps, source = st.max_steps, st.steps_from
            if cfg.num_train_epochs is not None and not (own and (own.max_steps or own.max_tokens)):
                source = f"epochs:{cfg.num_train_epochs:g}"
                mixed = [k for k in ("data", "tasks", "replay") if getattr(st, k, None)]
                if mixed:
                    raise ValueError(f"stage {st.index} ({st.name}): --num_train_epochs counts epochs over the whole "
                                     f"stream, and this stage samples by its {mixed[0]}: block: give the stage "
                                     "max_steps or max_tokens")
                samples = len(data.train_set(st.max_seq_length, sft=st.kind == "sft"))
                dp = max(1, world // st.sp)
                steps = epoch_steps(cfg.num_train_epochs, samples, dp, cfg.per_device_train_batch_size,
                                    cfg.gradient_accumulation_steps)
                lines.append(f"stage {st.index} ({st.name}): {cfg.num_train_epochs:g} epoch(s) of {samples} packed "
                             f"samples at {st.max_seq_length} = {steps} steps (dp {dp} x micro-batch "
                             f"{cfg.per_device_train_batch_size} x accumulation {cfg.gradient_accumulation_steps})")
            warm, ratio = st.warmup_steps, None
            if cfg.warmup_ratio and not (own and own.warmup_steps is not None):
                warm, ratio = ratio_steps(cfg.warmup_ratio, steps), cfg.warmup_ratio  # again if a resume keeps other
                lines.append(f"stage {st.index} ({st.name}): warmup {warm} steps (--warmup_ratio {cfg.warmup_ratio:g})")
            if warm >= steps and source.startswith("epochs"):  # (training/curriculum_resume.keep_stage_steps) steps
                lines.append(f"note: stage {st.index} ({st.name}): warmup {warm} steps >= its {steps} steps: its LR "
                             f"never reaches its peak nor decays (give it its own warmup_steps, or more epochs)")
            out.append(dataclasses.replace(st, max_steps=steps, warmup_steps=warm, steps_from=source,
                                           warmup_ratio=ratio))
        return [out, lines]

    out, lines = comm.run_on_main(decide, long=True)  # packs every stage's data on rank 0
    if cfg.num_train_epochs is not None and not any("epoch(s) of" in line for line in lines):
        lines.insert(0, f"note: --num_train_epochs {cfg.num_train_epochs:g} applies to no stage: each sets its own "
                        "max_steps or max_tokens")
    for line in lines:
        print0(line)
    return out


def _resuming(cfg) -> bool:
    """A rank's cheap guess, before the process group, that this start resumes a checkpoint (reads no base weights):
    --resume names an existing checkpoint, or this run's checkpoints/LATEST exists (a requeue, a re-run). One stat or
    two. A wrong guess costs no run: a fresh start's weights are looked for again on rank 0 after the resume decision
    (training/startup.check_base_weights), one line before the data, and on every rank at its build."""
    from training.checkpoint_files import POINTER

    resume = str(getattr(cfg, "resume", "auto") or "auto")
    if resume not in ("auto", "none"):
        return os.path.exists(resume)
    return os.path.isfile(os.path.join(str(getattr(cfg, "output_dir", "") or ""), "checkpoints", POINTER))


def resolve_hub_ids(cfg) -> None:
    """A Hugging Face hub id given as the model (or tokenizer) becomes its snapshot folder in the local cache, offline,
    so every later reader sees a folder (model_utils/hub.py); one line naming the download command when it is not
    there. A dry run needs the model's config only; so does a start with a checkpoint to resume (`_resuming`): a
    node-local cache holding config and tokenizer only resumes (it stopped a requeue on other nodes with exit 2). A
    fresh start reads the weight files on every rank (transformers under ZeRO-3: rank 0 their values, the others their
    tensor names and shapes), so every rank looks for them here, before any heavy work."""
    from model_utils.build import resolve_model
    from model_utils.hub import resolve

    given, main = cfg.model_name_or_path, os.environ.get("RANK", "0") == "0"
    # a hub id's snapshot must hold its weights where they will be read; a local folder's are looked for when they
    # are read (build_model with pretrained weights: a resume or a later stage builds from the config, whose folder
    # may hold no weights now)
    weights = not cfg.dry_run and not os.path.isdir(given) and not _resuming(cfg)
    cfg.model_name_or_path = resolve_model(given, weights=weights)
    if cfg.model_name_or_path != given and main:
        print(f"model {given}: {cfg.model_name_or_path} (the local Hugging Face cache)", flush=True)
    if cfg.tokenizer_name_or_path:
        cfg.tokenizer_name_or_path = resolve(cfg.tokenizer_name_or_path, weights=False, flag="--tokenizer_name_or_path")
    # a local path as an absolute one: checkpoints record it, and a later export from another folder read the
    # relative one against its own working directory (the base's generation_config.json silently not found)
    for key in ("model_name_or_path", "tokenizer_name_or_path"):
        value = getattr(cfg, key)
        if value and not os.path.isabs(value) and os.path.exists(value):
            setattr(cfg, key, os.path.abspath(value))
