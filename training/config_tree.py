"""The typed config tree of a run: every field with its default and what it means, the run's settings (`Config`) and
each curriculum stage's (`StageConfig`: fields left None inherit the run's). Flag names follow the Hugging Face Trainer
habits (`--per_device_train_batch_size`, `--gradient_accumulation_steps`, ...); every field is a flag and a recipe key.
training/config.py fills it (defaults < `--config recipe.yaml` < command-line flags) and validates it; the validated
tree is saved with every checkpoint (`asdict`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StageConfig:
    """One stage of a context-extension curriculum (fields left None inherit the run's values)."""

    name: str = ""
    max_seq_length: int | None = None  # tokens per sample in this stage
    sequence_parallel_size: int | str | None = None  # SP degree of this stage (may grow stage to stage); auto: the
    # smallest that fits (memory_features auto)
    context_parallel_size: int | str | None = None  # cp factor of this stage's SP (ulysses = sp / cp); None: the run's
    rope: dict | None = None  # transformers `rope_parameters` for this stage (rope_type, rope_theta, factor, ...)
    learning_rate: float | None = None  # peak LR, re-warmed at the start of the stage
    min_lr: float | None = None  # LR at the end of the decay
    warmup_steps: int | None = None
    lr_scheduler: str | None = None  # cosine | linear | constant
    max_steps: int | None = None  # stage length in optimizer steps ...
    max_tokens: int | None = None  # ... or in tokens (whole world); one of the two
    reset_optimizer: bool = False  # False: carry Adam moments across the transition
    deepspeed_overrides: dict = field(default_factory=dict)  # merged into the DeepSpeed JSON for this stage
    eval: dict = field(default_factory=dict)  # e.g. {passkey_trials: 4, depths: [0.1, 0.5, 0.9], heldout_samples: 2}
    memory_features: str | dict | None = None  # auto | manual | {tiled_mlp: true, checkpoint_every: 2, ...}: this stage's (a mapping pins those, auto picks the rest)
    tasks: dict = field(default_factory=dict)  # synthetic task fractions, e.g. {passkey: 0.2} (data/tasks.py)
    data: dict | list | None = None  # mixture: {source_glob: weight} or [{source, weight, min_doc_tokens, ...}] (data/mixture.py); None: whole stream
    replay: dict | None = None  # short-context replay: {256: 0.3} or {share: 0.3, lengths: [256]}, token shares (data/replay.py)
    kind: str | None = None  # text | sft: how the stage packs its documents (None: the run's data_kind; docs/sft.md)
    loss_weighting: str | None = None  # token | conversation: this stage's loss (None: the run's --loss_weighting)


@dataclass
class Config:
    # --- model ---
    model_name_or_path: str = "tiny-llama"  # local HF folder (config.json + safetensors) or a preset name
    from_scratch: bool = False  # random weights meant: a preset past the tiny ones (its shape, no weights), and the demo corpus with a model past tiny; refused without it (training/startup.py)
    tokenizer_name_or_path: str | None = None  # sentencepiece .model or HF tokenizer folder; None: demo tokenizer
    attn_implementation: str = "auto"  # auto | sdpa | flash_attention_2 (auto: the faster of SDPA and FA2 measured on the GPU)
    rope: dict | None = None  # rope_parameters override for a single-stage run
    # --- data ---
    dataset_path: str | None = None  # JSONL file or folder of them; None: the built-in demo corpus
    max_seq_length: int = 2048  # tokens per packed sample (padded up to a multiple of SP)
    reset_position_ids: str = "auto"  # auto | yes | no: restart positions at document starts (auto: yes on every
    # backend that masks documents, i.e. all supported ones: model_utils.attention.resets_positions)
    mask_cross_document_labels: bool = False  # no loss on a document's last token predicting the next document (ProLong)
    data_kind: str = "text"  # text: documents packed end to end | sft: whole conversations packed, loss on the
    # prepared loss mask (the assistant's replies), positions restarted per conversation (data/packing.py ConvPack)
    loss_weighting: str = "token"  # token: mean over the global batch's supervised tokens | conversation: LongAlign's
    # mean of each packed document's (conversation's) mean, 1/N_i per token computed before sharding (data/sharding.py)
    # --- parallelism and batch ---
    sequence_parallel_size: int = 1  # SP degree; world = sp x dp, and sp = ulysses x cp
    context_parallel_size: str = "auto"  # cp factor of SP: auto (Ulysses as large as the heads and the node allow,
    # the rest context parallel: model_utils/context_parallel.py) or N dividing sp (1: pure Ulysses, sp: pure cp)
    ring_attention: bool = False  # under cp > 1, pass K/V around the cp group block by block instead of gathering the
    # whole sequence's (model_utils/ring_attention.py: sdpa only so far); fewer bytes held, more sent in backward
    per_device_train_batch_size: int = 1  # samples per SP group per micro-step
    gradient_accumulation_steps: int = 1
    # --- optimisation ---
    learning_rate: float = 2e-5
    min_lr: float = 0.0
    warmup_steps: int = 0
    lr_scheduler: str = "cosine"  # cosine | linear | constant
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0  # clip the global gradient norm to this; 0: no clipping
    max_steps: int = 100
    num_train_epochs: float | None = None  # epochs over each stage's data instead (HF Trainer's; max_steps wins if
    # both are set; a stage's own max_steps / max_tokens win): steps fixed once the data is open (training/hf_args.py)
    warmup_ratio: float = 0.0  # warmup as a fraction of each stage's steps (HF's ceil(ratio x steps)); or warmup_steps
    seed: int = 0
    bf16: bool | None = None  # None: bf16 on GPU, fp32 on CPU
    fp16: bool = False  # fp16 with DeepSpeed's dynamic loss scaling (GPU only; turns the bf16 default off)
    deepspeed: str = "ds_configs/zero3_offload.json"
    # --- memory features (issue: long-sequence memory) ---
    tiled_mlp: bool = False
    tiled_logits: bool = False
    gradient_checkpointing: bool = False
    offload_activations: bool = False
    checkpoint_every: int = 0  # checkpoint decoder layers 0, K, 2K, ... only; 0: off (1 if --gradient_checkpointing)
    keep_attention: bool = False  # checkpointed layers keep the attention output: backward recomputes all but attention
    lean_rmsnorm: bool = True  # RMSNorm that saves its input + 1/rms only, chunked fp32 backward (model_utils/rmsnorm.py); same forward
    logits_tile_mb: int = 0  # tiled logits: MiB of fp32 logits per tile; 0: 1024 (ArcticTraining's), under memory_features auto 1/64 of the budget up to 1024
    attention_head_chunks: str = "auto"  # auto (the planner's choice: 1 unless memory_features auto needs more) or N:
    # attention runs N chunks of heads at a time (model_utils/head_chunks.py); N must split the heads per rank
    lean_mlp: bool = True  # gated MLP product that keeps gate and up only, act(gate) recomputed in backward (model_utils/mlp.py)
    memory_features: str = "manual"  # manual: the flags above | auto: per stage, the fastest set that fits (planner/auto_features.py)
    gpu_mem_gb: float = 0.0  # accelerator memory per rank for memory_features auto (0: detected from the device)
    mem_cap_gb: float = 0.0  # memory cap per rank for memory_features auto on CPU runs (peak RSS)
    # --- output, checkpoints, tracking ---
    output_dir: str = "checkpoints/run"
    save_steps: int = 0  # 0: save only at the end and on preemption
    save_interval_minutes: float | str = "auto"  # also save once this long has passed since the last save (rank 0's
    # clock); 0: off; auto: 9 minutes, longer where the last save blocked the steps > 1% of it (training/preemption.py)
    save_total_limit: int = 2  # never fewer than 2 kept
    async_save: bool | str = "auto"  # only the snapshot (a copy in host memory) blocks the steps; a thread writes it and
    # the checkpoint commits at the first step boundary where every rank's write is durable (docs/checkpoints.md);
    # auto: on for a GPU run whose nodes' host memory fits the snapshot (training/preflight.py decides, once)
    resume: str = "auto"  # auto | none | PATH (a PATH in this run starts a branch: newer checkpoints moved aside)
    time_limit_s: float = 0.0  # stop, save, exit 75 before this many seconds from train.py's start (SLURM_JOB_END_TIME wins)
    dist_timeout_s: float = 1800.0  # collective timeout of the training process group (NCCL watchdog)
    report_to: str = "auto"  # auto (wandb if installed) | wandb | none
    wandb_project: str | None = None  # None: WANDB_PROJECT, else ulysses-longtrain (a flag or recipe key wins)
    run_name: str | None = None  # the W&B run's name; None: WANDB_NAME, else the output dir's basename
    progress_bar: bool = True
    export_hf: bool = True  # write OUTPUT_DIR/hf_model at the end
    dry_run: bool = False  # validate and print the plan (stages, memory per rank), no training
    nodes: int = 0  # the cluster the recipe is written for (dry run, memory plan); 0: the launched world
    gpus_per_node: int = 0
    # --- evaluation at each stage's end (training/evaluation.py): eval_X sets key X of every stage's `eval:`
    # block; a recipe's top-level eval_X is the default under each stage's own block, a command-line flag wins ---
    eval: bool = True  # --no-eval: no held-out loss and no task evaluation at any stage
    eval_heldout_samples: int | None = None  # held-out samples per stage (default 2; 0: no held-out loss)
    eval_tasks: str | list | dict | None = None  # passkey:5,niah_multikey:2 (trials per depth) | passkey,common_words | none
    eval_passkey_trials: int | None = None  # trials per depth of each task named without a count (default 2)
    eval_depths: str | list | None = None  # 0.1,0.5,0.9: where the needle sits (0: the start, 1: the end)
    eval_lengths: str | list | None = None  # earlier | all | 4096,8k: the lengths a stage's tasks are tried at
    # --- curriculum ---
    stages: list[StageConfig] = field(default_factory=list)
