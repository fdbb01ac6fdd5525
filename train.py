"""ulysses-longtrain: train a Hugging Face causal LM on long sequences with DeepSpeed ZeRO-3 (+ CPU offload)
and Ulysses sequence parallelism (world = sp x dp), through a staged context-extension curriculum.

    deepspeed --num_gpus N train.py --deepspeed ds_configs/zero3_offload.json \
        --model_name_or_path PATH --dataset_path DATA --max_seq_length L --sequence_parallel_size SP \
        --per_device_train_batch_size 1 --gradient_accumulation_steps G --learning_rate 2e-5 \
        --max_steps S --output_dir checkpoints/RUN --seed 0          # or: --config recipes/NAME.yaml

Sections, in order: config -> distributed init and layout -> data -> resume -> for each stage: model and
engine, training loop, stage end (checkpoint, evaluation) -> export. On CPU: `DS_ACCELERATOR=cpu` (gloo).
Exit codes: 0 done, 2 bad input, 75 saved after a preemption signal (requeue and `--resume auto`).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import sys
import time
import warnings

warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")

EXIT_OK, EXIT_USAGE, EXIT_PREEMPTED = 0, 2, 75  # 75 = EX_TEMPFAIL: "temporary failure, retry later"


def main(argv: list[str] | None = None) -> int:
    import torch
    import torch.distributed as dist

    from data.packing import PackedDataset
    from data.prepare import prepare_token_stream
    from data.sampler import ResumableSampler
    from data.sharding import collate, shard
    from model_utils.build import load_hf_config, pick_attn_implementation
    from model_utils.export import export_hf
    from model_utils.memory import configure_allocator, make_loss_fn
    from model_utils.rope import apply_rope, model_hash
    from training.checkpoint import Checkpointer, rng_state, set_rng_state
    from training.config import parse_config, to_dict
    from training.curriculum import check_stages, resolve_stages, stage_start, total_steps
    from training.engine import build_engine, stage_config
    from training.evaluation import check_passkey_fits, evaluate_stage, heldout_count
    from training.metrics import MetricsLogger, open_rank_log, peak_memory_gb, print0, rank_log, set_main
    from training.parallel import init_distributed
    from training.preemption import PreemptionFlag
    from training.step import train_step
    from training.summary import plan_lines

    configure_allocator()  # expandable CUDA segments unless PYTORCH_(CUDA_)ALLOC_CONF is set
    # --- config: every user error surfaces here, before any heavy work ---
    cfg = parse_config(argv)
    base_config = load_hf_config(cfg.model_name_or_path)
    attn = pick_attn_implementation(cfg.attn_implementation, planning=cfg.dry_run)
    arch = base_config.get_text_config()

    bf16 = torch.cuda.is_available() if cfg.bf16 is None else cfg.bf16
    if cfg.dry_run:  # validate the whole recipe for the cluster it names and print the plan; no training
        world = cfg.nodes * cfg.gpus_per_node or int(os.environ.get("WORLD_SIZE", "1"))
        stages = resolve_stages(cfg, dp_of_sp=lambda sp: max(1, world // sp))
        check_stages(stages, world, arch.num_attention_heads, arch.num_key_value_heads)
        print(f"dry run: world={world} ({cfg.nodes or 1} node(s)) model={cfg.model_name_or_path} attn={attn} "
              f"precision={'bf16' if bf16 else 'fp32'} deepspeed={cfg.deepspeed}")
        print("\n".join(plan_lines(cfg, stages, world, cfg.gpus_per_node or world, bf16)))
        return EXIT_OK

    # --- distributed init and the parallel layout of every stage ---
    dims = init_distributed(cfg.sequence_parallel_size)
    set_main(dims.is_main)
    stages = resolve_stages(cfg, dp_of_sp=lambda sp: max(1, dims.world // sp))
    check_stages(stages, dims.world, arch.num_attention_heads, arch.num_key_value_heads)
    if cfg.nodes and cfg.nodes * cfg.gpus_per_node != dims.world:
        print0(f"warning: the recipe is written for {cfg.nodes} x {cfg.gpus_per_node} ranks, launched with {dims.world}")
    print0(f"world={dims.world} model={cfg.model_name_or_path} attn={attn} precision={'bf16' if bf16 else 'fp32'} "
           f"mb={cfg.per_device_train_batch_size} ga={cfg.gradient_accumulation_steps} deepspeed={cfg.deepspeed}")
    print0("\n".join(plan_lines(cfg, stages, dims.world, int(os.environ.get("LOCAL_WORLD_SIZE", dims.world)), bf16)))

    # --- data: tokenize once (rank 0, cached); each stage packs the same stream to its own length ---
    tokens, starts, tokenizer = prepare_token_stream(cfg.dataset_path, cfg.tokenizer_name_or_path,
                                                     arch.vocab_size, dims.is_main)
    reset_pos = cfg.reset_position_ids == "yes" or (cfg.reset_position_ids == "auto" and attn == "flash_attention_2")
    pad_id = tokenizer.pad_id if tokenizer else 0
    check_passkey_fits(stages, tokenizer)

    # --- resume: the newest complete checkpoint decides where the curriculum continues ---
    ckpt = Checkpointer(cfg.output_dir, cfg.save_total_limit)
    resume_from = ckpt.find_resume(cfg.resume)
    trainer = Checkpointer.read_trainer(resume_from) if resume_from else {"step": 0, "tokens": 0, "stage": 0}
    if resume_from and trainer.get("model_hash") != model_hash(base_config):
        raise ValueError(f"checkpoint {resume_from} was written for a different model architecture than "
                         f"{cfg.model_name_or_path}: use the same model, another --output_dir, or --resume none")
    step, tokens_seen = trainer["step"], trainer["tokens"]
    print0(f"rank logs: {open_rank_log(cfg.output_dir, dims.rank)}")
    print0(f"resuming from {resume_from} (step {step}, stage {trainer['stage']})" if resume_from else "starting fresh")
    metrics = MetricsLogger(cfg.output_dir, dims.is_main, cfg.report_to, cfg.wandb_project, trainer.get("wandb_id"),
                            to_dict(cfg), total_steps(stages), cfg.progress_bar, resume_step=step)
    stop_file = os.path.join(cfg.output_dir, "PREEMPT")
    if dims.is_main and os.path.exists(stop_file):
        os.remove(stop_file)  # the request that stopped the previous job has been honoured
    dist.barrier()
    preempt = PreemptionFlag(stop_file).install()

    for stage in stages:
        end = stage_start(stages, stage.index) + stage.max_steps
        if step >= end and metrics.has_eval(stage.index):
            continue  # finished and evaluated before this (resumed) run
        # --- model and engine for this stage (its length, SP degree, RoPE, LR schedule) ---
        sdims = dataclasses.replace(dims, sp=stage.sp)
        hf_config = copy.deepcopy(base_config)
        apply_rope(hf_config, stage.rope, stage.max_seq_length)
        scfg = stage_config(cfg, stage)
        engine = build_engine(scfg, sdims, hf_config, attn, bf16, seed=cfg.seed, ds_overrides=stage.deepspeed_overrides)
        if dims.is_main:
            used = os.path.join(cfg.output_dir, f"ds_config.stage{stage.index}.json")
            with open(used, "w") as fh:
                json.dump(engine.ds_config_used, fh, indent=1)
            print0(f"stage {stage.index} ({stage.name}): DeepSpeed config used -> {used}")
        dataset = PackedDataset(tokens, starts, stage.max_seq_length, reset_pos)
        n_train = len(dataset) - heldout_count(stage.eval, len(dataset))  # the last samples are held out
        sampler = ResumableSampler(n_train, sdims.dp, sdims.dp_rank, cfg.per_device_train_batch_size,
                                   seed=cfg.seed + stage.index)
        if resume_from and trainer["stage"] == stage.index:  # same stage: continue exactly where it stopped
            saved = ckpt.load(engine, resume_from)
            sampler.load_state_dict(saved["sampler"])
            if "rng" in saved:  # absent when the world size changed
                set_rng_state(saved["rng"])
        elif resume_from:  # previous stage's final checkpoint: its weights (+ Adam moments), a fresh schedule
            ckpt.load(engine, resume_from, load_optimizer=not stage.reset_optimizer, load_scheduler=False)
        torch.manual_seed(cfg.seed + 1000 * stage.index + dims.rank)

        # --- training loop ---
        while step < end:
            micro = [shard(collate([dataset[i] for i in sampler.next_batch()], sdims.sp, pad_id), sdims.sp,
                           sdims.sp_rank) for _ in range(cfg.gradient_accumulation_steps)]
            lr = engine.get_lr()[0]
            out = train_step(engine, micro, dims.world, loss_fn=make_loss_fn(cfg))
            step += 1
            rank_log(f"step {step} stage {stage.index} loss {out['loss']:.6f} step_time {out['step_time']:.3f}s")
            n = sdims.dp * cfg.gradient_accumulation_steps * cfg.per_device_train_batch_size * stage.max_seq_length
            tokens_seen += n
            metrics.log({"step": step, "stage": stage.index, "loss": out["loss"], "lr": lr, "tokens": n,
                         "tokens_per_s": n / out["step_time"], "seq_len": stage.max_seq_length, "sp": sdims.sp,
                         "dp": sdims.dp, "peak_mem_gb": peak_memory_gb(), "total_tokens": tokens_seen,
                         "time": time.time()})
            preempted = preempt.agreed()
            if preempted or step == end or (cfg.save_steps and step % cfg.save_steps == 0):
                t0 = time.perf_counter()
                trainer = {"step": step, "tokens": tokens_seen, "stage": stage.index, "stage_name": stage.name,
                           "wandb_id": metrics.run_id, "model_hash": model_hash(hf_config), "world": dims.world,
                           "sp": stage.sp, "tokenizer": tokenizer.path if tokenizer else None, "config": to_dict(cfg)}
                resume_from = ckpt.save(engine, step, trainer, {"sampler": sampler.state_dict(), "rng": rng_state()},
                                        hf_config, stage_end=f"STAGE_{stage.index}_{stage.name}" if step == end else None)
                print0(f"saved {resume_from} in {time.perf_counter() - t0:.1f}s")
            if preempted:
                print0(f"preempted (signal {preempt.received or 'on another rank'}): exiting with {EXIT_PREEMPTED}")
                metrics.close()
                return EXIT_PREEMPTED

        # --- stage end: checkpoint written above; evaluate at this stage's length ---
        evaluate_stage(engine, stage, sdims, dataset, tokenizer, metrics, step, cfg.per_device_train_batch_size)
        engine.destroy()
        del engine
        dist.barrier()

    # --- export: consolidated weights in Hugging Face format (the last stage's RoPE in its config) ---
    if dims.is_main:
        if cfg.export_hf:
            print0(f"exported {export_hf(resume_from, os.path.join(cfg.output_dir, 'hf_model'), tokenizer and tokenizer.path)}")
        with open(os.path.join(cfg.output_dir, "COMPLETE"), "w") as fh:
            fh.write(f"{step}\n")
    metrics.close()
    dist.barrier()
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
