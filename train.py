"""ulysses-longtrain: train a Hugging Face causal LM on long sequences with DeepSpeed ZeRO-3 (+ CPU offload)
and Ulysses sequence parallelism (world = sp x dp).

    deepspeed --num_gpus N train.py --deepspeed ds_configs/zero3_offload.json \
        --model_name_or_path PATH --dataset_path DATA --max_seq_length L --sequence_parallel_size SP \
        --per_device_train_batch_size 1 --gradient_accumulation_steps G --learning_rate 2e-5 \
        --max_steps S --output_dir checkpoints/RUN --seed 0

Sections, in order: config -> distributed init and parallel layout -> data -> model and engine ->
resume -> training loop -> export. CPU: `DS_ACCELERATOR=cpu` (gloo). See README.md.
"""

from __future__ import annotations

import os
import random
import sys
import time
import warnings

import numpy as np
import torch

warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")

EXIT_OK, EXIT_USAGE, EXIT_PREEMPTED = 0, 2, 75  # 75 = EX_TEMPFAIL: saved after a preemption signal, requeue me


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def main(argv: list[str] | None = None) -> int:
    from data.packing import PackedDataset
    from data.prepare import prepare_token_stream
    from data.sampler import ResumableSampler
    from data.sharding import collate, shard
    from model_utils.build import load_hf_config, pick_attn_implementation
    from training.config import parse_config, to_dict
    from training.engine import build_engine
    from training.metrics import MetricsLogger, peak_memory_gb, print0, set_main
    from training.parallel import check_layout, init_distributed
    from training.step import train_step

    # --- config: every user error surfaces here, before any heavy work ---
    cfg = parse_config(argv)
    hf_config = load_hf_config(cfg.model_name_or_path)
    attn = pick_attn_implementation(cfg.attn_implementation)
    text_cfg = hf_config.get_text_config()
    if cfg.rope:
        hf_config.rope_parameters = {**(hf_config.rope_parameters or {}), **cfg.rope}

    # --- distributed init and the parallel layout ---
    dims = init_distributed(cfg.sequence_parallel_size)
    set_main(dims.is_main)
    check_layout(dims.world, dims.sp, text_cfg.num_attention_heads, text_cfg.num_key_value_heads, cfg.max_seq_length)
    bf16 = torch.cuda.is_available() if cfg.bf16 is None else cfg.bf16
    print0(f"world={dims.world} sp={dims.sp} dp={dims.dp} model={cfg.model_name_or_path} attn={attn} "
           f"seq_len={cfg.max_seq_length} mb={cfg.per_device_train_batch_size} ga={cfg.gradient_accumulation_steps} "
           f"precision={'bf16' if bf16 else 'fp32'}")

    # --- data: tokenize once (rank 0), pack to the stage length, sample over DP ranks ---
    tokens, starts, tokenizer = prepare_token_stream(cfg.dataset_path, cfg.tokenizer_name_or_path,
                                                     text_cfg.vocab_size, dims.is_main)
    reset_pos = cfg.reset_position_ids == "yes" or (cfg.reset_position_ids == "auto" and attn == "flash_attention_2")
    dataset = PackedDataset(tokens, starts, cfg.max_seq_length, reset_pos)
    sampler = ResumableSampler(len(dataset), dims.dp, dims.dp_rank, cfg.per_device_train_batch_size, cfg.seed)
    pad_id = tokenizer.pad_id if tokenizer else 0

    # --- model and engine ---
    engine = build_engine(cfg, dims, hf_config, attn, bf16, seed=cfg.seed)
    seed_everything(cfg.seed + dims.rank)
    step, tokens_seen = 0, 0

    # --- training loop ---
    metrics = MetricsLogger(cfg.output_dir, dims.is_main, cfg.report_to, cfg.wandb_project, None, to_dict(cfg),
                            cfg.max_steps, cfg.progress_bar)
    while step < cfg.max_steps:
        micro = [shard(collate([dataset[i] for i in sampler.next_batch()], dims.sp, pad_id), dims.sp, dims.sp_rank)
                 for _ in range(cfg.gradient_accumulation_steps)]
        lr = engine.get_lr()[0]
        out = train_step(engine, micro, dims.world)
        step += 1
        step_tokens = dims.dp * cfg.gradient_accumulation_steps * cfg.per_device_train_batch_size * cfg.max_seq_length
        tokens_seen += step_tokens
        metrics.log({"step": step, "loss": out["loss"], "lr": lr, "tokens": step_tokens,
                     "tokens_per_s": step_tokens / out["step_time"], "seq_len": cfg.max_seq_length,
                     "sp": dims.sp, "dp": dims.dp, "peak_mem_gb": peak_memory_gb(), "stage": 0,
                     "total_tokens": tokens_seen, "time": time.time()})
    metrics.close()
    return EXIT_OK


def _single_process_defaults() -> None:
    """Let `python train.py ...` run as a world of one without a launcher."""
    if "RANK" not in os.environ:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", str(port)))


if __name__ == "__main__":
    _single_process_defaults()
    try:
        sys.exit(main())
    except ValueError as e:  # user errors: one line, no traceback, nothing saved touched
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(EXIT_USAGE)
