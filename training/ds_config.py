"""DeepSpeed config assembly: the JSON in ds_configs/ plus values derived from the run config.

Batch sizes, LR, clipping and precision are filled here and nowhere else, so the run config and the
DeepSpeed config can never disagree: a key set to "auto" is filled, a concrete value that contradicts
the flags is an error naming both.

Configs as users have them (e.g. Hugging Face's ZeRO-3 example, `ds_configs/hf_zero3_offload.json`):

- no `optimizer` block: AdamW from the flags (`optimizer_spec`, built by `make_optimizer` and passed to
  `deepspeed.initialize(optimizer=...)`): DeepSpeed's CPU Adam when the optimizer is offloaded, FusedAdam on
  GPU otherwise (what DeepSpeed itself builds for an AdamW block), torch AdamW on CPU. Betas (0.9, 0.95) and
  eps 1e-8 as in ds_configs/*.json, also what `"betas"`/`"eps": "auto"` become (no flag owns them).
- a `scheduler` block is dropped with one warning: the per-stage schedule of training/schedule.py is used (linear
  warmup, then --lr_scheduler cosine / linear / constant to --min_lr). A block that pins a schedule other than the
  flags' is refused in one line naming the flags that give it (`_check_scheduler`): its type's shape (WarmupLR =
  constant, WarmupDecayLR = linear, WarmupCosineLR = cosine; OneCycle and others have none), warmup_max_lr,
  warmup_num_steps, total_num_steps (the stage's steps), its decay's end (WarmupDecayLR's warmup_min_lr,
  cos_min_ratio x lr: --min_lr), a warmup from above 0 (WarmupLR's warmup_min_lr, warmup_min_ratio), warmup_type
  "log" (ours is linear). Said in the warning, not refused: DeepSpeed's log warmup where warmup_type is not named (its
  default), WarmupDecayLR's warmup from its warmup_min_lr, and the shape of a block that pins nothing (every value
  "auto" or a 0 start: Hugging Face's examples and ds_configs/hf_zero3_offload.json, which its Trainer fills).
- an `activation_checkpointing` block is refused (it acts only through deepspeed.checkpointing, not called here).
- `communication_data_type` also becomes the SP stages' `seq_parallel_communication_data_type` unless that is set
  (DeepSpeed replaces the one by the other, fp32 by default, when SP > 1).
- `fp16.enabled: "auto"` follows `--fp16` (off by default; GPU only, DeepSpeed's dynamic loss scaling).
- a top-level `sequence_parallelism` block (`{"enabled": true, "degree": N, "sequence_parallel_type":
  "ulysses"}`) sets the SP degree when flags and recipe left it unset and must agree with them otherwise
  (`settle_from_file`, called by config.parse_config before any process group); it never reaches DeepSpeed.
  DeepSpeed's own top-level `sequence_parallel_size` (the ALST tutorial's) is taken the same way, as are the JSON's
  concrete micro batch, accumulation and `fp16`/`bf16` `"enabled": true` where no flag set them.
- the legacy `"bfloat16"` section is read as `"bf16"` (training/ds_json.py; both, differing: one line).
- refused in one line at start (`validate`): a `wandb` monitor block when the run reports to W&B itself (DeepSpeed's
  monitor logs beside it at the sample count; with `--report_to none` it passes with one note: it is then the
  run's only W&B logging; `comet`, tensorboard and csv_monitor pass); ZeRO++ `zero_hpz_partition_size` > 1 in a
  curriculum of several stages (a process-wide group DeepSpeed makes once: the second stage's engine fails; one stage
  passes with one note: the memory plan has no secondary partition). `zero_quantized_weights`/`_gradients` pass.
- `checkpoint.load_universal` is dropped with one note: training/restore.py loads as universal exactly when the
  checkpoint's world differs. `zero_optimization.elastic_checkpoint` too (every rank read every rank's optimizer
  partition at each load).
- under bf16/fp16, `data_types.grad_accum_dtype` is fp32 unless the JSON names one (see build_ds_config).

Settings per accelerator (decided in `build_ds_config`, nowhere else): `zero_optimization.overlap_comm: "auto"`
(ds_configs/zero3*.json) is true on a GPU, where ZeRO-3's gradient reduce-scatter and parameter all-gathers run
on their own CUDA streams behind the compute (DeepSpeed's own ZeRO-3 default), and false on the CPU accelerator,
which has no side streams to overlap on. The buckets follow DeepSpeed's / Hugging Face's ZeRO-3 recommendations
for both: reduce_bucket_size h^2, stage3_prefetch_bucket_size 0.9 h^2, stage3_param_persistence_threshold 10 h (also
under DeepSpeed's field names prefetch_bucket_size / param_persistence_threshold). A concrete value in the JSON is
kept. ("auto" for other keys, e.g. stage3_max_live_parameters, is refused as not derived: nothing here, nor in the
Hugging Face Trainer, derives them.)
"""

from __future__ import annotations

import math

from base.log import print0
from base.parallel import ParallelDims
from training.config import Config, _load, _merge, check_precision, check_sections, no_gpu
from training.ds_json import renamed

ADAM_BETAS = [0.9, 0.95]  # as ds_configs/*.json; no flag owns them
ADAM_EPS = 1e-8
_SAID: set = set()  # the configs whose "auto" betas were said


# DeepSpeed's ZeRO-3 settings under both their names (the JSON spelling, and the pydantic field name it aliases in
# deepspeed/runtime/zero/config.py: Axolotl's zero3_bf16.json writes the latter), filled alike from "auto"
BUCKET_KEYS = (("stage3_prefetch_bucket_size", "prefetch_bucket_size"),
               ("stage3_param_persistence_threshold", "param_persistence_threshold"))


def _fill(d: dict, path: str, value, source: str) -> None:
    keys = path.split(".")
    node = d
    for k in keys[:-1]:
        node = node.setdefault(k, {})
    cur = node.get(keys[-1], "auto")
    if cur == "auto":
        node[keys[-1]] = value
    elif cur != value:
        raise ValueError(f"DeepSpeed config sets {path}={cur} but {source} gives {value}: set it to \"auto\" "
                         "or make the two agree")


def build_ds_config(cfg: Config, dims: ParallelDims, bf16: bool, hidden_size: int,
                    overrides: dict | None = None, planning: bool = False, quiet: bool = False) -> dict:
    """The DeepSpeed config dict for `deepspeed.initialize`, every "auto" resolved and validated by DeepSpeed's
    own config parser (`validate`). `planning`: a --dry_run for another machine (fp16 allowed without a GPU);
    `quiet`: no warnings (the start-up check of every stage, training/preflight.py, builds them all once)."""
    ds = _load(cfg.deepspeed)
    if overrides:
        if "sequence_parallelism" in overrides:  # read from the file alone (settle_from_file): dropped, unsaid
            raise ValueError(f"deepspeed_overrides: sequence_parallelism {overrides['sequence_parallelism']}: a stage's "
                             "SP degree is its sequence_parallel_size")
        ds = _merge(ds, renamed(dict(overrides), "deepspeed_overrides"))  # the stage's own "bfloat16" is its bf16
        check_sections(ds, f"--deepspeed {cfg.deepspeed} with the stage's deepspeed_overrides")
    check_precision(cfg, bf16, planning)
    ds.pop("sequence_parallelism", None)  # ours, read by settle_from_file; not a DeepSpeed key
    dropped = _check_scheduler(ds.pop("scheduler", None), cfg)  # refused, or said once a build
    if dropped and not quiet:
        print0(dropped)
    _drop_load_universal(ds, cfg.deepspeed, quiet)
    writer = ds["checkpoint"].get("writer") if isinstance(ds.get("checkpoint"), dict) else None
    if writer is not None or ds.get("datastates_ckpt", False) is not False:  # deepspeed checkpoint_engine/utils.py
        raise ValueError(f"{cfg.deepspeed}: {'checkpoint.writer' if writer is not None else 'datastates_ckpt'} picks "
                         "another DeepSpeed checkpoint engine (Fast / Decoupled / DataStates), whose files this run's "
                         "checkpoints cannot vouch for (their manifest is written from the files each rank's own save "
                         "recorded, and a decoupled write may still run at the commit); drop it (the saves are "
                         "asynchronous already: --async_save, docs/checkpoints.md)")
    if any((ds.get("activation_checkpointing") or {}).values()):  # read only by deepspeed.checkpointing.checkpoint
        raise ValueError(f"{cfg.deepspeed}: its activation_checkpointing block acts only through "
                         "deepspeed.checkpointing, which this project does not call: checkpoint layers with "
                         "--gradient_checkpointing / --checkpoint_every K, offload them with --offload_activations, "
                         "or let --memory_features auto choose (docs/memory.md); drop the block")
    if dims.sp > 1 and ds.get("communication_data_type") not in (None, "auto") \
            and ds.get("seq_parallel_communication_data_type", "auto") == "auto":  # DeepSpeed swaps in the SP key's fp32 default
        ds["seq_parallel_communication_data_type"] = ds["communication_data_type"]
    mb, ga = cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps
    _fill(ds, "train_micro_batch_size_per_gpu", mb, "--per_device_train_batch_size")
    _fill(ds, "gradient_accumulation_steps", ga, "--gradient_accumulation_steps")
    # one sample per SP group per micro-step: the global batch counts DP replicas only
    _fill(ds, "train_batch_size", mb * ga * dims.dp, "per_device_train_batch_size x grad_accum x dp")
    # read by DeepSpeedConfig when no mpu is at hand (zero.Init at model build) to size the batch by dp, not world
    _fill(ds, "sequence_parallel_size", dims.sp, "--sequence_parallel_size")
    _fill(ds, "gradient_clipping", cfg.max_grad_norm, "--max_grad_norm")
    _fill(ds, "bf16.enabled", bf16, "--bf16")
    if cfg.fp16 or "fp16" in ds:
        _fill(ds, "fp16.enabled", cfg.fp16, "--fp16")  # loss_scale 0 (DeepSpeed's default): dynamic scaling
    if "optimizer" in ds:
        _fill(ds, "optimizer.params.lr", cfg.learning_rate, "--learning_rate")
        _fill(ds, "optimizer.params.weight_decay", cfg.weight_decay, "--weight_decay")
        params = ds["optimizer"]["params"]
        if params.get("betas") == "auto":  # HF's Trainer fills its adam_beta1/2 there: (0.9, 0.999); ours is
            params["betas"] = list(ADAM_BETAS)  # the pretraining convention, said once
            if not quiet and cfg.deepspeed not in _SAID:  # once a run, not at every stage's build
                _SAID.add(cfg.deepspeed)
                print0(f"note: {cfg.deepspeed}: optimizer.params.betas \"auto\" is {ADAM_BETAS} here (the Hugging Face "
                       "Trainer fills [0.9, 0.999]): write the betas in the JSON to choose")
        if params.get("eps") == "auto":
            params["eps"] = ADAM_EPS
    # Gradients are reduced in fp32 unless the JSON names a dtype. With SP > 1 DeepSpeed reduces them in
    # seq_parallel_communication_data_type (engine.py: it replaces communication_data_type), otherwise in
    # communication_data_type, whose default is the training dtype. A bf16 sum over 32 ranks keeps 8 bits of
    # mantissa: small gradients next to large ones round away, and the error grows with the world (32 ranks'
    # gradients of mixed scales summed in turn: 6e-3 relative error in bf16, 1e-7 in fp32, measured). fp32 doubles
    # the reduce-scatter: Llama-3-8B, 32 ranks, 32 GB instead of 16 GB per micro-step, ~0.7 s more at 50 GB/s per
    # GPU against a 1M-token micro-step of ~20 s, and overlapped with the backward on GPUs (overlap_comm).
    if ds.get("seq_parallel_communication_data_type") == "auto":
        ds["seq_parallel_communication_data_type"] = "fp32"
    if (bf16 or cfg.fp16) and "communication_data_type" not in ds:
        ds["communication_data_type"] = "fp32"
    # Micro-steps' gradients are summed in grad_accum_dtype, which DeepSpeed takes from the model (bf16) unless
    # named: ZeRO-3 casts each fp32-reduced bucket back to bf16 and adds the micro-steps in a bf16 buffer (relative
    # error 4-5e-3 at accumulation 16, 8-9e-3 at 64; ~1e-7 in fp32, measured on DeepSpeed 0.19.8). fp32 costs
    # +2 B/param/world where the flat gradient buffer lives (the device; the host with the optimizer offloaded):
    # Llama-3-8B on 32 ranks, +0.5 GB per rank. A JSON that names a dtype keeps it.
    if (bf16 or cfg.fp16) and (ds.get("data_types") or {}).get("grad_accum_dtype", "auto") == "auto":
        ds.setdefault("data_types", {})["grad_accum_dtype"] = "fp32"
    zero = ds.get("zero_optimization", {})
    if zero.get("overlap_comm") == "auto":
        zero["overlap_comm"] = not no_gpu()  # see the module docstring: side streams exist on a GPU only
    for keys, value in ((("reduce_bucket_size",), hidden_size * hidden_size),
                        (BUCKET_KEYS[0], int(0.9 * hidden_size * hidden_size)),
                        (BUCKET_KEYS[1], 10 * hidden_size)):
        for key in keys:
            if zero.get(key) == "auto":
                zero[key] = value
    if zero.get("stage") != 3:
        raise ValueError(f"{cfg.deepspeed}: zero_optimization.stage is {zero.get('stage')!r}; this project needs ZeRO-3 "
                         "(the number 3)")
    leftover = [k for k, v in _walk(ds) if v == "auto"]
    if leftover:
        raise ValueError(f"{cfg.deepspeed}: no value derived for {leftover}; set them explicitly")
    validate(ds, cfg.deepspeed, cfg)
    return ds


def _drop_load_universal(ds: dict, where: str, quiet: bool) -> None:
    """`checkpoint.load_universal` and `zero_optimization.elastic_checkpoint`: dropped, each said once a run. Here a
    checkpoint of another world size is converted and loaded as universal on its own (training/restore.py), so
    neither buys anything. load_universal made every load universal: DeepSpeed then looked for a conversion in a
    same-world checkpoint and crashed at the first stage change and at every resume. elastic_checkpoint (deprecated
    under ZeRO-3, a warning only) makes every rank torch.load every rank's optimizer partition at each load
    (DeepSpeed 0.19.8 engine._get_all_zero_checkpoint_state_dicts): the whole fp32 state a rank, 96 GB at Llama-3-8B,
    8 ranks a node: the node ran out of memory at the first stage change and again at every requeue."""
    for section, key, why in (("checkpoint", "load_universal", ""),
                              ("zero_optimization", "elastic_checkpoint",
                               " (it made every rank read every rank's optimizer partition at each load: the whole "
                               "fp32 optimizer state a rank)")):
        block = ds.get(section)
        if not isinstance(block, dict) or key not in block:
            continue
        if block.pop(key) and not quiet and (key, where) not in _SAID:
            _SAID.add((key, where))
            print0(f"note: {where}: {section}.{key} is dropped{why}: a checkpoint of another world size is converted "
                   "to DeepSpeed's universal format and loaded as one without it (docs/checkpoints.md)")


# DeepSpeed's scheduler types (deepspeed/runtime/lr_schedules.py, 0.19.8) by the --lr_scheduler of the same shape:
# each warms up from its warmup_min_lr (WarmupCosineLR: warmup_min_ratio x lr) to the peak, then stays there
# (WarmupLR), decays linearly back to warmup_min_lr at total_num_steps (WarmupDecayLR) or along a cosine to
# cos_min_ratio x lr (WarmupCosineLR). Its warmup is logarithmic unless warmup_type says "linear"; ours is linear.
SCHEDULE_SHAPES = {"WarmupLR": ("constant", "constant"),
                   "WarmupDecayLR": ("linear", "a linear decay to warmup_min_lr"),
                   "WarmupCosineLR": ("cosine", "a cosine decay to cos_min_ratio x lr")}
# values that pin nothing of the schedule: what Hugging Face's Trainer fills "auto" with, DeepSpeed's own defaults
_UNPINNED = {"warmup_min_lr": 0, "warmup_min_ratio": 0, "last_batch_iteration": -1}


def _same(a, b) -> bool:
    try:
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)
    except (TypeError, ValueError):
        return a == b


def _check_scheduler(block, cfg: Config) -> str | None:
    """A `scheduler` block that trains otherwise than this run's flags (or the stage's own values in a recipe): refused
    in one line naming the flags that give its schedule (it was dropped with a warning: WarmupDecayLR's 3e-4 peak
    trained at the default 2e-5, a WarmupLR constant LR as a cosine to 0). The block is dropped either way
    (training/schedule.py schedules per stage); returned: the one warning line that says so and what it leaves out.
    A block whose values are all "auto" (Hugging Face's examples: their type is a shape the Trainer takes from the
    JSON) pins nothing: its type's shape is named in the warning, not refused."""
    if block is None:
        return None
    kind, params, name = cfg.lr_scheduler, block.get("params") or {}, block.get("type")
    warm = cfg.warmup_steps > 0 or cfg.warmup_ratio > 0
    given = {k: v for k, v in params.items() if v != "auto"}
    pinned = [k for k, v in given.items() if k != "warmup_type" and not (k in _UNPINNED and _same(v, _UNPINNED[k]))]
    diffs, fixes, said = [], [], []

    def differs(what: str, fix: str) -> None:
        diffs.append(what)
        fixes.append(fix)

    if name is not None and name not in SCHEDULE_SHAPES:  # OneCycle, LRRangeTest, a torch.optim.lr_scheduler class
        raise ValueError(f"{cfg.deepspeed}: its scheduler type {name!r} has no counterpart here: this run warms up "
                         "linearly, then decays each stage as --lr_scheduler cosine, linear or constant says to --min_lr "
                         "(--learning_rate, --warmup_steps): drop the block and choose with those flags")
    shape, desc = SCHEDULE_SHAPES.get(name, (kind, ""))
    if shape != kind:
        if pinned:
            differs(f"type {name}: warmup, then {desc}, this run --lr_scheduler {kind}", f"--lr_scheduler {shape}")
        else:
            said.append(f"its {name} is warmup, then {desc}: --lr_scheduler {shape} gives that")
    for key, field, flag in (("warmup_max_lr", "learning_rate", "--learning_rate"),
                             ("warmup_num_steps", "warmup_steps", "--warmup_steps"),
                             ("total_num_steps", "max_steps", "--max_steps")):
        if key in given and not _same(given[key], getattr(cfg, field)):
            differs(f"{key}={given[key]}: this run {flag} {getattr(cfg, field)}", f"{flag} {given[key]}")
    start = given.get("warmup_min_lr", 0)
    # its decay ends where its warmup starts; "auto" or 0 (what HF's Trainer fills) pins no end: any --min_lr
    if name == "WarmupDecayLR" and "warmup_min_lr" in pinned and not _same(start, cfg.min_lr):
        differs(f"warmup_min_lr={start}: the decay's end, this run --min_lr {cfg.min_lr}", f"--min_lr {start}")
    elif name == "WarmupDecayLR" and warm and not _same(start, 0):
        said.append(f"the warmup rises from --learning_rate / warmup steps, not from warmup_min_lr {start}")
    for key in ("warmup_min_lr", "warmup_min_ratio"):
        if key in given and warm and not _same(given[key], 0) and name != "WarmupDecayLR":
            differs(f"{key}={given[key]}: the warmup's start, this run's rises from --learning_rate / warmup steps",
                    f"set {key} 0")
    ratio = given.get("cos_min_ratio")
    if isinstance(ratio, (int, float)) and not _same(ratio * cfg.learning_rate, cfg.min_lr):
        differs(f"cos_min_ratio={ratio}: the decay's end {ratio * cfg.learning_rate:g}, this run --min_lr "
                f"{cfg.min_lr}", f"--min_lr {ratio * cfg.learning_rate:g}")
    log = given.get("warmup_type", "log") != "linear"  # DeepSpeed's default, and what it makes of an unknown name
    if warm and log and "warmup_type" in given:
        differs(f"warmup_type={given['warmup_type']}: this run's warmup is linear", 'set warmup_type "linear"')
    elif warm and log and name in SCHEDULE_SHAPES:
        said.append("its warmup is linear here (DeepSpeed's default warmup_type is log)")
    if diffs:
        raise ValueError(f"{cfg.deepspeed}: its scheduler block is not what this run trains ({'; '.join(diffs)}): this "
                         f"run schedules each stage from its flags (or a recipe stage's own values): "
                         f"{' and '.join(_joined(fixes))}, or drop the block (or set those values to \"auto\") to train "
                         "as the flags say")
    return (f"warning: {cfg.deepspeed}: its \"scheduler\" block is ignored; this run uses its own per-stage schedule "
            f"({kind}, warmup {cfg.warmup_steps}, --learning_rate/--min_lr)" + "".join(f"; {s}" for s in said))


def _joined(fixes: list[str]) -> list[str]:
    """The flags to give as one command-line tail ("give --a 1 --b 2"), then the block's own edits."""
    flags = list(dict.fromkeys(f for f in fixes if f.startswith("--")))
    return ([f"give {' '.join(flags)}"] if flags else []) + [f for f in fixes if not f.startswith("--")]


class _OneReplica:
    """The `mpu` DeepSpeedConfig asks for the data-parallel size: 1, matching `validate`'s probe batch."""

    @staticmethod
    def get_data_parallel_world_size() -> int:
        return 1


def validate(ds: dict, where: str, cfg: Config | None = None) -> None:
    """What DeepSpeed checks when it parses a config (`DeepSpeedConfig`: the pydantic models of every block, e.g. an
    unknown zero_optimization key or an offload device it lacks, precision, batch arithmetic) and the optimizer
    type the engine accepts, here, without a process group: at start for every stage (training/preflight.py),
    not when `deepspeed.initialize` reaches a stage days into the run. One-line ValueError naming the setting.
    `cfg`: the run's (its stages and --report_to decide `_check_not_per_process`; None: refused as for several
    stages reporting to W&B)."""
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS, DeepSpeedConfig, DeepSpeedConfigError

    # the batch arithmetic (train = micro x accumulation x dp) is derived and checked by _fill above; the probe
    # restates it for one replica, which is what DeepSpeedConfig sees with or without a process group
    probe = {**ds, "train_batch_size": ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"]}
    try:
        parsed = DeepSpeedConfig(probe, mpu=_OneReplica())
    except (ValueError, AssertionError, TypeError, KeyError, DeepSpeedConfigError) as e:  # the last: removed blocks
        raise ValueError(f"{where}: DeepSpeed rejects the config: {_one_line(e)}") from None  # (sparse_attention)
    _check_not_per_process(parsed, where, cfg)
    zero = ds.get("zero_optimization", {})
    for part in ("offload_param", "offload_optimizer"):  # DeepSpeed's model takes nvme_path None, then zero.Init
        if (zero.get(part) or {}).get("device") == "nvme" and not zero[part].get("nvme_path"):  # asserts on it
            raise ValueError(f"{where}: zero_optimization.{part}.device nvme needs its nvme_path (a local NVMe "
                             "folder on every node), or device cpu")
    name = ds.get("optimizer", {}).get("type")
    if name is not None:
        import torch

        if str(name).lower() not in DEEPSPEED_OPTIMIZERS and getattr(torch.optim, str(name), None) is None:
            raise ValueError(f"{where}: optimizer.type {name!r} is neither a DeepSpeed optimizer "
                             f"({', '.join(DEEPSPEED_OPTIMIZERS)}) nor a torch.optim class: fix the name or drop the "
                             "block (AdamW from the flags)")


def _check_not_per_process(parsed, where: str, cfg: Config | None) -> None:
    """What DeepSpeed sets up once per process, or beside this run's own logging: refused in one line at start where it
    fails or misleads (each passed the start-up checks and failed later), else one note a run (the first build says
    it, the start-up check's or a dry run's quiet one too: it is about the plan).
    train.py builds one engine per stage in one process; scripts/evaluate.py one per source, from its own JSON."""
    if parsed.monitor_config.wandb.enabled:  # WandbMonitor: wandb.init at every engine build, wandb.log(step=samples)
        if cfg is None or reports_to_wandb(cfg.report_to):
            raise ValueError(f"{where}: its \"wandb\" monitor block logs DeepSpeed's numbers into this run's W&B run at "
                             "the sample count (this run's records, at the optimizer step, then fall behind it and "
                             "W&B drops them): drop the block (this run logs to W&B: --wandb_project NAME), or keep "
                             "it with --report_to none (tensorboard and csv_monitor blocks may stay)")
        _note_once(("wandb", where), f"note: {where}: its \"wandb\" monitor block is this run's only W&B "
                   "logging (--report_to none): DeepSpeed logs its own lr and loss there, stepped by global samples, "
                   "not optimizer steps")
    hpz = parsed.zero_config.zero_hpz_partition_size
    if hpz > 1 and (cfg is None or len(cfg.stages) > 1):  # _create_zero_param_parallel_group: once per process
        stages = f"{len(cfg.stages)} stages" if cfg is not None else "several stages"
        raise ValueError(f"{where}: zero_optimization.zero_hpz_partition_size {hpz} (ZeRO++ hpZ) cannot run {stages}: "
                         "DeepSpeed makes its secondary-partition group once per process and this run builds one "
                         "engine per stage (the second fails): drop it (or 1), or keep it for a one-stage run")
    if hpz > 1:  # the weights once more, partitioned over each hpz ranks (a node's, for its all-gathers)
        _note_once(("hpz", where), f"note: {where}: zero_optimization.zero_hpz_partition_size {hpz} (ZeRO++ "
                   f"hpZ): the memory plan does not count its secondary partition (a copy of the weights over each {hpz} "
                   f"ranks: parameters x 2 bytes in bf16 / {hpz} more a rank; 8B at hpZ 8: 2 GB); leave that headroom")


def reports_to_wandb(report_to: str) -> bool:
    """Whether this run logs to W&B itself (training/metrics_wandb.py wandb_enabled; "auto": wandb installed), unimported."""
    import importlib.util

    return report_to == "wandb" or (report_to == "auto" and importlib.util.find_spec("wandb") is not None)


def _note_once(what: tuple, line: str) -> None:
    if what not in _SAID:
        _SAID.add(what)
        print0(line)


def _one_line(e: Exception) -> str:
    """A pydantic ValidationError's errors, or any exception's text, on one line."""
    errors = getattr(e, "errors", None)
    if callable(errors):
        try:
            where = f"{e.title}: " if getattr(e, "title", None) else ""
            return where + "; ".join(f"{'.'.join(map(str, d['loc']))}: {d['msg']} (got {d.get('input')!r})"
                                     for d in errors())
        except (TypeError, KeyError):
            pass
    return " ".join(str(e).split()) or type(e).__name__


def optimizer_spec(ds: dict, cfg: Config) -> dict | None:
    """The AdamW to build from the flags when the DeepSpeed config has no `optimizer` block (None when it has one):
    the class DeepSpeed itself would build for `{"type": "AdamW"}` in the same config, with the same settings."""
    if "optimizer" in ds:
        return None
    offload = ds.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none")
    if offload in ("cpu", "nvme"):
        kind = "DeepSpeedCPUAdam"  # DeepSpeed refuses other client optimizers under optimizer offload
    else:
        kind = "AdamW" if no_gpu() else "FusedAdam"
    return {"type": kind, "lr": cfg.learning_rate, "betas": tuple(ADAM_BETAS), "eps": ADAM_EPS,
            "weight_decay": cfg.weight_decay}


def make_optimizer(ds: dict, cfg: Config, params: list):
    """The client optimizer for `deepspeed.initialize(optimizer=...)`, or None when the config names one."""
    spec = optimizer_spec(ds, cfg)
    if spec is None:
        return None
    kind, kw = spec.pop("type"), spec
    if kind == "DeepSpeedCPUAdam":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(params, adamw_mode=True, **kw)
    if kind == "FusedAdam":
        from deepspeed.ops.adam import FusedAdam

        return FusedAdam(params, adam_w_mode=True, **kw)
    import torch

    return torch.optim.AdamW(params, **kw)


def _walk(d: dict, prefix: str = ""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _walk(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v
