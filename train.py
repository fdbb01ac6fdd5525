"""ulysses-longtrain: train a Hugging Face causal LM on long sequences with DeepSpeed ZeRO-3 (+ CPU offload)
and Ulysses sequence parallelism (world = sp x dp), through a staged context-extension curriculum.

    deepspeed --num_gpus N train.py --deepspeed ds_configs/zero3_offload.json \
        --model_name_or_path PATH --dataset_path DATA --max_seq_length L --sequence_parallel_size SP \
        --per_device_train_batch_size 1 --gradient_accumulation_steps G --learning_rate 2e-5 \
        --max_steps S --output_dir checkpoints/RUN --seed 0          # or: --config recipes/NAME.yaml

Sections, in order: config -> distributed init and layout -> data -> resume -> for each stage (`train_stage`):
model and engine, restore, training loop, stage end (checkpoint, evaluation) -> export. On CPU:
`DS_ACCELERATOR=cpu` (gloo). All process-group communication goes through base/comm.py.
Exit codes: 0 done, 1 failure (traceback in OUTPUT_DIR/logs/rankN.log), 2 bad input (one line, before any
work), 75 saved after a preemption signal or near the time limit (requeue and `--resume auto`).
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

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_PREEMPTED = 0, 1, 2, 75  # 75 = EX_TEMPFAIL: "temporary failure, retry later"
ROOT = os.path.dirname(os.path.abspath(__file__))


def main(argv: list[str] | None = None) -> int:
    import torch

    from base import comm
    from base.env import configure
    from base.log import open_rank_log, print0, set_main
    from base.parallel import check_shared_output, init_distributed
    from data.pipeline import open_run_data
    from model_utils.attention import check_config, resets_positions
    from model_utils.build import load_hf_config, pick_attn_implementation
    from model_utils.export import export_hf
    from model_utils.memory import configure_allocator
    from model_utils.rope import model_hash
    from training.checkpoint import Checkpointer
    from training.config import parse_config, to_dict
    from training.curriculum import check_stages, resolve_stages, stage_start, total_steps
    from training.evaluation import check_passkey_fits
    from training.metrics import MetricsLogger
    from training.preemption import Deadline, PreemptionFlag
    from training.preflight import check_network, check_stage_configs, preflight
    from training.summary import plan_lines

    started = time.time()  # --time_limit_s counts from here
    configure()  # DeepSpeed's JIT ops in this checkout's cache, TORCH_CUDA_ARCH_LIST as DeepSpeed reads it
    configure_allocator()  # expandable CUDA segments unless PYTORCH_(CUDA_)ALLOC_CONF is set
    # --- config: every user error surfaces here, before any heavy work ---
    cfg = parse_config(argv)
    base_config = load_hf_config(cfg.model_name_or_path)
    attn = pick_attn_implementation(cfg.attn_implementation, planning=cfg.dry_run)
    check_config(base_config, attn)  # the architecture has this attention and it can be document-masked
    arch = base_config.get_text_config()

    bf16 = (torch.cuda.is_available() and not cfg.fp16) if cfg.bf16 is None else cfg.bf16
    precision = "bf16" if bf16 else "fp16" if cfg.fp16 else "fp32"
    if cfg.dry_run:  # validate the whole recipe for the cluster it names and print the plan; no training
        world = cfg.nodes * cfg.gpus_per_node or int(os.environ.get("WORLD_SIZE", "1"))
        stages = resolve_stages(cfg, dp_of_sp=lambda sp: max(1, world // sp))
        check_stages(stages, world, arch.num_attention_heads, arch.num_key_value_heads, arch.rope_parameters)
        check_stage_configs(cfg, stages, world, bf16, arch.hidden_size, planning=True)  # every stage's DeepSpeed config
        print(f"dry run: world={world} ({cfg.nodes or 1} node(s)) model={cfg.model_name_or_path} attn={attn} "
              f"precision={precision} deepspeed={cfg.deepspeed}")
        print("\n".join(plan_lines(cfg, stages, world, cfg.gpus_per_node or world, bf16)))
        return EXIT_OK

    # --- distributed init (device first, then the process group) and the layout of every stage ---
    check_network()  # gloo can bind this host's interface (GLOO_SOCKET_IFNAME), before it tries
    dims = init_distributed(cfg.sequence_parallel_size, cfg.dist_timeout_s)
    set_main(dims.is_main)
    open_rank_log(cfg.output_dir, dims.rank)
    stages = resolve_stages(cfg, dp_of_sp=lambda sp: max(1, dims.world // sp))
    check_stages(stages, dims.world, arch.num_attention_heads, arch.num_key_value_heads,
                 arch.rope_parameters)
    check_shared_output(cfg.output_dir)  # every rank sees every other rank's files, or one line naming the hosts
    preflight(cfg, stages, dims, arch, bf16)  # build locks, host memory per node, every stage's DeepSpeed config
    if cfg.nodes and cfg.nodes * cfg.gpus_per_node != dims.world:
        print0(f"warning: the recipe is written for {cfg.nodes} x {cfg.gpus_per_node} ranks, launched with {dims.world}")
    print0(f"world={dims.world} model={cfg.model_name_or_path} attn={attn} precision={precision} "
           f"mb={cfg.per_device_train_batch_size} ga={cfg.gradient_accumulation_steps} deepspeed={cfg.deepspeed}")
    print0("\n".join(plan_lines(cfg, stages, dims.world, int(os.environ.get("LOCAL_WORLD_SIZE", dims.world)), bf16)))

    # --- data: one token stream, its held-out documents fixed for the whole run, each stage packs its length ---
    reset_pos = resets_positions(cfg.reset_position_ids, attn)  # auto: wherever documents are masked (all backends)
    data = open_run_data(cfg.dataset_path, cfg.tokenizer_name_or_path, arch.vocab_size, stages, reset_pos,
                         cfg.mask_cross_document_labels)
    check_passkey_fits(stages, data.tokenizer)

    # --- resume: the newest complete checkpoint decides where the curriculum continues ---
    ckpt = Checkpointer(cfg.output_dir, cfg.save_total_limit)
    resume_from = ckpt.find_resume(cfg.resume)
    trainer = Checkpointer.read_trainer(resume_from) if resume_from else {"step": 0, "tokens": 0, "stage": 0}
    if resume_from and trainer.get("model_hash") != model_hash(base_config):
        raise ValueError(f"checkpoint {resume_from} was written for a different model architecture than "
                         f"{cfg.model_name_or_path}: use the same model, another --output_dir, or --resume none")
    print0(f"resuming from {resume_from} (step {trainer['step']}, stage {trainer['stage']})" if resume_from
           else "starting fresh")
    metrics = MetricsLogger(cfg.output_dir, dims.is_main, cfg.report_to, cfg.wandb_project, trainer.get("wandb_id"),
                            to_dict(cfg), total_steps(stages), cfg.progress_bar, resume_step=trainer["step"])
    stop_file = os.path.join(cfg.output_dir, "PREEMPT")
    if dims.is_main and os.path.exists(stop_file):
        os.remove(stop_file)  # the request that stopped the previous job has been honoured
    comm.barrier()
    preempt = PreemptionFlag(stop_file, Deadline(cfg.time_limit_s, now=started), 60 * cfg.save_interval_minutes).install()
    run = Run(cfg, dims, data, ckpt, metrics, preempt, base_config, attn, bf16)

    # --- the curriculum: each stage builds its engine, trains, saves its end, evaluates ---
    evaluated = metrics.evaluated(len(stages))  # rank 0's record, the same on every rank
    for stage in stages:
        if trainer["step"] >= stage_start(stages, stage.index) + stage.max_steps and stage.index in evaluated:
            continue  # finished and evaluated before this (resumed) run
        if preempt.agreed(ahead_s=preempt.deadline.build_s):  # before building the engine: nothing new to save
            return run.exit_preempted()
        trainer, resume_from = train_stage(run, stage, stages, trainer, resume_from)
        if preempt.stopping:
            return run.exit_preempted()

    # --- export: rank 0 alone, after every rank has left the process group (nobody waits in a collective
    # while 8B parameters are consolidated in fp32: 32 GB of host memory and minutes of I/O on Llama-3-8B) ---
    comm.barrier()
    comm.shutdown()
    if dims.is_main:
        if cfg.export_hf:
            out = export_hf(resume_from, os.path.join(cfg.output_dir, "hf_model"),
                            data.tokenizer and data.tokenizer.path)
            print0(f"exported {out}")
        with open(os.path.join(cfg.output_dir, "COMPLETE"), "w") as fh:
            fh.write(f"{trainer['step']}\n")
    metrics.close()
    return EXIT_OK


@dataclasses.dataclass
class Run:
    """What every stage of one run shares (built once in main)."""
    cfg: object
    dims: object
    data: object
    ckpt: object
    metrics: object
    preempt: object
    base_config: object
    attn: str
    bf16: bool

    def exit_preempted(self) -> int:
        from base.log import print0

        print0(f"preempted ({self.preempt.received or 'on another rank'}): exiting with {EXIT_PREEMPTED}")
        self.metrics.close()
        return EXIT_PREEMPTED


def train_stage(run: Run, stage, stages, trainer: dict, resume_from: str | None) -> tuple[dict, str | None]:
    """One stage: engine at the stage's length/SP/RoPE/LR, restore, train to the stage's end (saving when due or
    on an agreed stop), evaluate. Returns the trainer counters and the newest checkpoint; on an agreed stop it
    returns right after the save, with `run.preempt.stopping` set."""
    import torch

    from base.log import print0, rank_log
    from data.pipeline import heldout_samples
    from data.sharding import collate, shard
    from model_utils.memory import kept_attention_line, make_loss_fn
    from model_utils.rope import apply_rope, model_hash
    from model_utils.ulysses import check_routed
    from training.checkpoint import rng_state, set_rng_state
    from training.config import to_dict
    from training.curriculum import stage_start
    from training.engine import build_engine, stage_config
    from training.evaluation import evaluate_stage
    from training.metrics import peak_memory_gb, reset_peak_memory
    from training.step import train_step

    cfg, dims, data, ckpt, metrics, preempt = run.cfg, run.dims, run.data, run.ckpt, run.metrics, run.preempt
    step, tokens_seen = trainer["step"], trainer["tokens"]
    end = stage_start(stages, stage.index) + stage.max_steps
    t_build = time.perf_counter()
    reset_peak_memory()  # peak_mem_gb is this stage's own
    sdims = dataclasses.replace(dims, sp=stage.sp)
    hf_config = copy.deepcopy(run.base_config)
    apply_rope(hf_config, stage.rope, stage.max_seq_length)
    engine = build_engine(stage_config(cfg, stage), sdims, hf_config, run.attn, run.bf16, seed=cfg.seed,
                          ds_overrides=stage.deepspeed_overrides, pretrained=resume_from is None)
    if dims.is_main:
        used = os.path.join(cfg.output_dir, f"ds_config.stage{stage.index}.json")
        with open(used, "w") as fh:
            json.dump(engine.ds_config_used, fh, indent=1)
        print0(f"stage {stage.index} ({stage.name}): DeepSpeed config used -> {used}")
    dataset, sampler = data.stage_view(stage, sdims.dp, sdims.dp_rank, cfg.per_device_train_batch_size, cfg.seed)
    if stage.memory_choice:  # what `memory_features: auto` chose for this stage, once per stage in the metrics
        metrics.log({"event": "memory_choice", "stage": stage.index, "step": step, **stage.memory_choice})

    # --- restore, and the RNG streams (dropout) of this stage: exactly one of the two below decides them ---
    saved = {}
    if resume_from and trainer["stage"] == stage.index:  # same stage: continue exactly where it stopped
        saved = ckpt.load(engine, resume_from)
        sampler.load_state_dict(saved["sampler"])
    elif resume_from:  # previous stage's final checkpoint: its weights (+ Adam moments), a fresh schedule
        ckpt.load(engine, resume_from, load_optimizer=not stage.reset_optimizer, load_scheduler=False)
    if "rng" in saved:  # mid-stage resume on the same world: every rank's RNG as it was at the save
        set_rng_state(saved["rng"])
    else:  # a stage's start (or another world size): a seed per stage and rank
        torch.manual_seed(cfg.seed + 1000 * stage.index + dims.rank)
    preempt.deadline.record_build(time.perf_counter() - t_build)

    # --- training loop; the stop flag is agreed after every step and after every save ---
    loss_fn, routed_checked = make_loss_fn(stage_config(cfg, stage)), False  # the stage's tiled_logits
    while step < end:
        micro = [shard(collate([dataset[i] for i in sampler.next_batch()], sdims.sp, data.pad_id), sdims.sp,
                       sdims.sp_rank) for _ in range(cfg.gradient_accumulation_steps)]
        lr = engine.get_lr()[0]
        out = train_step(engine, micro, dims.world, loss_fn=loss_fn)
        if not routed_checked:  # after the first step of this engine: every layer's attention went through
            check_routed(engine)  # Ulysses + document masking, or one line naming the model
            routed_checked = True
            kept = kept_attention_line(stage_config(cfg, stage), run.attn)  # --keep_attention found its kernel?
            if kept:
                print0(kept)
        step += 1
        preempt.deadline.record_step(out["step_time"])
        rank_log(f"step {step} stage {stage.index} loss {out['loss']:.6f} step_time {out['step_time']:.3f}s")
        n = sdims.dp * cfg.gradient_accumulation_steps * cfg.per_device_train_batch_size * stage.max_seq_length
        tokens_seen += n
        metrics.log({"step": step, "stage": stage.index, "loss": out["loss"], "lr": lr, "tokens": n,
                     "tokens_per_s": n / out["step_time"], "seq_len": stage.max_seq_length, "sp": sdims.sp,
                     "dp": sdims.dp, "peak_mem_gb": peak_memory_gb(), "total_tokens": tokens_seen,
                     "time": time.time(), **{f"share_{k}": v for k, v in sampler.source_shares().items()}})
        stopping = preempt.agreed(ahead_s=preempt.deadline.evaluation_s() if step + 1 >= end else 0.0)
        if stopping or step == end or (cfg.save_steps and step % cfg.save_steps == 0) or preempt.save_due:
            t0 = time.perf_counter()
            trainer = {"step": step, "tokens": tokens_seen, "stage": stage.index, "stage_name": stage.name,
                       "wandb_id": metrics.run_id, "model_hash": model_hash(hf_config), "world": dims.world,
                       "sp": stage.sp, "tokenizer": data.tokenizer.path if data.tokenizer else None,
                       "config": to_dict(cfg)}
            resume_from = ckpt.save(engine, step, trainer, {"sampler": sampler.state_dict(), "rng": rng_state()},
                                    hf_config, stage_end=f"STAGE_{stage.index}_{stage.name}" if step == end else None)
            preempt.deadline.record_save(time.perf_counter() - t0)
            preempt.saved()
            print0(f"saved {resume_from} in {time.perf_counter() - t0:.1f}s")
            stopping = stopping or preempt.agreed(ahead_s=preempt.deadline.evaluation_s() if step == end else 0.0)
        if stopping:
            engine.destroy()
            return trainer, resume_from

    # --- stage end: checkpoint written above; evaluate at this stage's length, then agree on a stop again ---
    t_eval = time.perf_counter()
    evaluate_stage(engine, stage, sdims, data.heldout(stage.max_seq_length, heldout_samples(stage.eval)),
                   data.tokenizer, metrics, step, cfg.per_device_train_batch_size, data.pad_id, stages, data.heldout)
    preempt.deadline.record_eval(time.perf_counter() - t_eval)
    engine.destroy()
    preempt.agreed()
    return trainer, resume_from


def _single_process_defaults() -> None:
    """Let `python train.py ...` run as a world of one without a launcher."""
    if "RANK" not in os.environ:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", str(port)))


def _is_input_error(e: BaseException) -> bool:
    """A ValueError raised by this project's own code (input validation), not inside a library."""
    if not isinstance(e, ValueError) or e.__traceback__ is None:
        return False
    tb = e.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    where = os.path.abspath(tb.tb_frame.f_code.co_filename)
    if not where.startswith(ROOT + os.sep) or f"{os.sep}site-packages{os.sep}" in where:
        return False
    import linecache

    # our own `raise ValueError(...)`, not a C extension (numpy, torch) raising from a call on our line
    return linecache.getline(where, tb.tb_lineno).lstrip().startswith("raise ")


def _fail(e: BaseException) -> int:
    """This rank's exception ends the job: post it on the abort channel first (every other rank stops within
    seconds instead of waiting in a collective for dist_timeout_s), then report it here. Returns the exit code."""
    rank = os.environ.get("RANK", "0")
    try:
        from base import comm
    except Exception:  # noqa: BLE001 -- the failure was importing our own stack: nothing to tell the others
        comm = None
    if _is_input_error(e):  # our validation of the user's input: one line, no traceback, nothing saved touched
        if comm is not None:
            comm.abort(f"rank {rank} stopped on an input error (its message is on rank 0's output)", EXIT_USAGE)
        if rank == "0":
            print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    # anything else is a failure: the traceback in this rank's log (and stderr), one summary line
    import traceback

    own = f"rank {rank} failed: {type(e).__name__}: {e}"
    first = comm.abort(own, EXIT_FAILED) if comm is not None else own
    text = traceback.format_exc()
    try:
        from base.log import rank_log

        rank_log(text)
    except Exception:  # noqa: BLE001
        pass
    print(text, file=sys.stderr, flush=True)
    print(f"error: rank {rank} failed with {type(e).__name__}: {e} (traceback above and in the rank log)",
          file=sys.stderr, flush=True)
    if not first.startswith(f"rank {rank} failed:"):
        print(f"error: the first failure of the job: {first}", file=sys.stderr, flush=True)
    return EXIT_FAILED


def _leave() -> None:
    """main() returned on every rank (0, or 75 after the agreed save): leave the abort channel cleanly."""
    if "base.comm" in sys.modules:
        sys.modules["base.comm"].leave()


def _exit(code: int) -> None:
    """Exit with `code`, first recording it where scripts/launch.sh reads it (LAUNCH_EXIT_DIR): a launcher that
    was signalled too (SLURM signals every process of a job) reports its own code, not the ranks'."""
    where = os.environ.get("LAUNCH_EXIT_DIR")
    if where and os.path.isdir(where):
        with open(os.path.join(where, f"rank{os.environ.get('RANK', '0')}"), "w") as fh:
            fh.write(f"{code}\n")
    sys.exit(code)


if __name__ == "__main__":
    _single_process_defaults()
    try:
        code = main()
    except (Exception, KeyboardInterrupt) as e:
        _exit(_fail(e))
    _leave()
    _exit(code)
