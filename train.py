"""ulysses-longtrain: train a Hugging Face causal LM on long sequences with DeepSpeed ZeRO-3 (+ CPU offload)
and Ulysses sequence parallelism (world = sp x dp), through a staged context-extension curriculum.

    deepspeed --num_gpus N train.py --deepspeed ds_configs/zero3_offload.json \
        --model_name_or_path PATH --dataset_path DATA --max_seq_length L --sequence_parallel_size SP \
        --per_device_train_batch_size 1 --gradient_accumulation_steps G --learning_rate 2e-5 \
        --max_steps S --output_dir checkpoints/RUN --seed 0          # or: --config recipes/NAME.yaml

The story, in order: config -> distributed init and layout -> data -> resume -> stages (each: engine, restore,
steps, saves, evaluation; training/stage.py) -> export. On CPU: `DS_ACCELERATOR=cpu` (gloo). All process-group
communication goes through base/comm.py. Exit codes (training/job.py): 0 done, 1 failure, 2 bad input (one
line, before any work) or a run that must not go on (non-finite steps or state: one line naming the checkpoint to
resume from; training/stage.py), 75 saved after a preemption signal or near the time limit (requeue, `--resume auto`).
"""

from __future__ import annotations

import os
import sys
import time
import warnings

from base import versions
from training.job import EXIT_OK, run_job

warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")


def main(argv: list[str] | None = None) -> int:
    from base import comm

    # the abort channel before anything that can fail on one node (an import, the config, a node's checks): a failure
    # from here on ends every node within seconds, not at the rendezvous' timeout (base/comm.py)
    comm.open_channel()

    from base.atomic import atomic_write
    from base.env import configure
    from base.log import print0
    from data.pipeline import open_run_data
    from model_utils.attention import resets_positions
    from model_utils.export import export_hf, recorded_or_none
    from model_utils.export_target import is_export_of
    from model_utils.memory import configure_allocator
    from model_utils.rope import model_hash
    from training.checkpoint import Checkpointer
    from training.checkpoint_files import manifest_sha256
    from training.config import to_dict
    from training.curriculum import stage_start, total_steps
    from training.curriculum_resume import check_resumed_stages, keep_stage_steps
    from training.evaluation import check_passkey_fits
    from training.hf_args import epoch_stages
    from training.metrics import MetricsLogger
    from training.preemption import Deadline
    from training.resume_notes import with_resolved_sp
    from training.stage import Run, train_stage
    from training.startup import check_room, dry_run, load_run_config, start_distributed, stop_flag

    started = time.time()  # --time_limit_s counts from here
    configure()  # DeepSpeed's JIT ops in this checkout's cache, TORCH_CUDA_ARCH_LIST as DeepSpeed reads it
    configure_allocator()  # expandable CUDA segments unless PYTORCH_(CUDA_)ALLOC_CONF is set

    # --- config: every user error surfaces here, in one line, before any heavy work ---
    cfg, model = load_run_config(argv)
    if cfg.dry_run:  # validate the whole recipe for the cluster it names and print the plan; no training
        dry_run(cfg, model)
        return EXIT_OK

    # --- distributed init (device first, then the process group), the layout of every stage, the attention kernel,
    # start-up checks ---
    dims, stages, model = start_distributed(cfg, model)

    # --- resume: the newest complete checkpoint (rank 0's listing, verified together) decides where we are ---
    ckpt = Checkpointer(cfg.output_dir, cfg.save_total_limit, deadline=Deadline(cfg.time_limit_s, now=started))
    state = ckpt.resume(cfg.resume, model_hash(model.config), cfg.model_name_or_path,
                        with_resolved_sp(to_dict(cfg), stages),  # an auto SP as this job resolved it: the batch note
                        check=lambda st: check_resumed_stages(stages, st))  # its stage and those before: today's
    check_room(ckpt, state, stages, model, cfg)  # a fresh start's base weights there; the first save's room (rotated
    # to today's limit first): before the data and any engine

    # --- data: one token stream, its held-out documents fixed for the whole run (a resume keeps its first start's),
    # each stage packs its length ---
    data = open_run_data(cfg.dataset_path, cfg.tokenizer_name_or_path, model.arch.vocab_size, stages,
                         resets_positions(cfg.reset_position_ids, model.attn), cfg.mask_cross_document_labels,
                         cfg.model_name_or_path, heldout=state.heldout, trained_on=state.tokenizer_vocab)
    check_passkey_fits(stages, data.tokenizer)
    stages = epoch_stages(cfg, stages, data, dims.world)  # --num_train_epochs / --warmup_ratio: steps from the data
    stages = keep_stage_steps(stages, state)  # the stages it ran keep their lengths, whatever today's world or batch
    # a stage too small: here; every stage's draw notes (repeats, unread sources) said now, not days in at its start
    data.check_batches(stages, dims.world, cfg.per_device_train_batch_size, done=state.step,
                       grad_accum=cfg.gradient_accumulation_steps)
    metrics = MetricsLogger(cfg.output_dir, dims.is_main, cfg.report_to, cfg.wandb_project, state.wandb_id,
                            to_dict(cfg), total_steps(stages), cfg.progress_bar, resume_step=state.step,
                            branch=ckpt.branched, home=state.wandb_home)
    preempt = stop_flag(cfg, dims, started)
    run = Run(cfg, dims, data, ckpt, metrics, preempt, model.config, model.attn, model.bf16)

    # --- the curriculum: each stage builds its engine, trains, saves its end, evaluates ---
    evaluated = metrics.evaluated(len(stages))  # rank 0's record, the same on every rank
    for stage in stages:
        if state.step >= stage_start(stages, stage.index) + stage.max_steps and stage.index in evaluated:
            continue  # finished and evaluated before this (resumed) run
        if preempt.agreed(ahead_s=preempt.deadline.build_s):  # before building the engine: nothing new to save
            return run.exit_preempted()
        train_stage(run, stage, stages, state)
        if preempt.stopping:
            return run.exit_preempted()

    # --- export: rank 0 alone, after every rank has left the process group (nobody waits in a collective
    # while 8B parameters are consolidated in fp32: 32 GB of host memory and minutes of I/O on Llama-3-8B) ---
    comm.barrier()
    comm.shutdown()
    ckpt.close()  # rank 0's background deletion of rotated checkpoints (training/rotation.py) ends with the run:
    # after the process group, where nobody waits on it (a slow metadata server's minutes past NCCL's timeout)
    if dims.is_main:
        out = os.path.join(cfg.output_dir, "hf_model")
        made = state.checkpoint and manifest_sha256(state.checkpoint)  # its content: moved or re-mounted, the same
        if cfg.export_hf and is_export_of(out, made):  # a finished run started again (a dependency chain's next link)
            print0(f"{out} is already the export of {state.checkpoint}")
        elif cfg.export_hf:  # (a branch's new step_N under an old name has another content hash: exported again)
            tok, source = recorded_or_none(data.tokenizer and data.tokenizer.path, cfg.model_name_or_path)
            out = export_hf(state.checkpoint, out, tok, source=source, owned=True, identity=made,
                            stops=data.reply_stops(),  # a chat SFT's end-of-turn: generation stops on it
                            template=data.trained_template())  # the chat template its rows were rendered with
            print0(f"exported {out}")
        # whole or absent (a full disk left an empty COMPLETE before, a finished run to `-f COMPLETE`), and named
        atomic_write(os.path.join(cfg.output_dir, "COMPLETE"), f"{state.step}\n".encode())
    metrics.close()
    return EXIT_OK


if __name__ == "__main__":
    versions.check()  # torch, deepspeed, transformers in the ranges the code needs, or one line and exit 2
    sys.exit(run_job(main))
