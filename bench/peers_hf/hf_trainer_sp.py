"""The Hugging Face Trainer with accelerate's DeepSpeed Ulysses sequence parallelism, as a peer for
bench/peers.py: same model folder, sequence length, ranks, ZeRO-3 + CPU offload config and fp32.

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 deepspeed --num_gpus 2 bench/peers_hf/hf_trainer_sp.py \
        --model PATH --seq_len 4096 --sp 2 --steps 3 --output_dir OUT [--gradient_checkpointing]

The SP layer is `TrainingArguments(parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=SP,
sp_handler=DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation="sdpa")))`
(accelerate >= 1.12 / transformers >= 5): accelerate registers `UlyssesSPAttentionHF` and wraps the
dataloader in `UlyssesSPDataLoaderAdapter`; the Trainer's `deepspeed_sp_compute_loss` averages the loss
over the SP group. `--sp 1` (one GPU): no ParallelismConfig, the plain Trainer with the same DeepSpeed config.
The data are random token ids (content changes neither memory nor speed).
Writes OUTPUT_DIR/metrics.jsonl (rank 0) with the fields train.py writes: step, tokens_per_s (tokens of
the whole world per second), peak_mem_gb (peak RSS in GiB on CPU, max_memory_allocated on GPU, max
over ranks).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def ds_config(sp: int) -> dict:
    """ds_configs/zero3_offload.json, the config train.py runs; the Trainer fills its "auto" keys itself,
    except the SP communication dtype and the SP degree, which it does not write: without
    `sequence_parallel_size` the zero.Init that from_pretrained opens checks train_batch_size against
    mb x ga x world instead of x (world / sp) and refuses (deepspeed/runtime/config.py)."""
    with open(os.path.join(ROOT, "ds_configs", "zero3_offload.json")) as fh:
        cfg = json.load(fh)
    cfg["seq_parallel_communication_data_type"] = "fp32"
    cfg["sequence_parallel_size"] = sp
    zero = cfg.get("zero_optimization", {})
    if zero.get("overlap_comm") == "auto":  # this project's "auto" (the Trainer fills only its own): as train.py
        from training.config import no_gpu

        zero["overlap_comm"] = not no_gpu()
    return cfg


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--seq_len", type=int, required=True)
    p.add_argument("--sp", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--gradient_checkpointing", action="store_true",
                   help="TrainingArguments(gradient_checkpointing=True): every decoder layer, non-reentrant")
    p.add_argument("--local_rank", type=int, default=None)  # set by the deepspeed launcher
    a = p.parse_args()

    import torch
    from accelerate.utils import DeepSpeedSequenceParallelConfig, ParallelismConfig
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from training.metrics import peak_memory_gb  # the measurement train.py logs, so the systems compare

    pc = None if a.sp == 1 else ParallelismConfig(sp_backend="deepspeed", sp_size=a.sp,
                           sp_handler=DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True,
                                                                      sp_attn_implementation="sdpa"))
    # TrainingArguments before the model: with a ZeRO-3 config it makes from_pretrained build partitioned
    args = TrainingArguments(output_dir=a.output_dir, per_device_train_batch_size=1, gradient_accumulation_steps=1,
                             max_steps=a.steps, learning_rate=1e-4, lr_scheduler_type="constant", max_grad_norm=1.0,
                             adam_beta1=0.9, adam_beta2=0.95,  # the betas of ds_configs/zero3_offload.json
                             logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
                             bf16=torch.cuda.is_available(), fp16=False, deepspeed=ds_config(a.sp),
                             parallelism_config=pc, remove_unused_columns=False, dataloader_num_workers=0,
                             seed=0, gradient_checkpointing=a.gradient_checkpointing,
                             gradient_checkpointing_kwargs={"use_reentrant": False} if a.gradient_checkpointing else None)
    model = AutoModelForCausalLM.from_pretrained(a.model, attn_implementation="sdpa",
                                                 dtype=torch.bfloat16 if args.bf16 else torch.float32)
    model.config.use_cache = False
    vocab, world = model.config.vocab_size, int(os.environ.get("WORLD_SIZE", "1"))
    dp = world // a.sp

    class RandomTokens(torch.utils.data.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            ids = torch.randint(4, vocab, (a.seq_len,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(a.seq_len)}

    class Meter(TrainerCallback):
        """Step time and peak memory per optimizer step, logged like train.py's metrics.jsonl."""

        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            dt = time.perf_counter() - self.t0
            rec = {"step": state.global_step, "tokens": a.seq_len * dp, "tokens_per_s": a.seq_len * dp / dt,
                   "seq_len": a.seq_len, "sp": a.sp, "dp": dp, "peak_mem_gb": peak_memory_gb(), "time": time.time(),
                   "attn": model.config._attn_implementation,  # "ulysses..." once accelerate registered SP
                   "gradient_checkpointing": bool(getattr(model, "is_gradient_checkpointing", False))}
            if int(os.environ.get("RANK", "0")) == 0:  # args.process_index is the DP rank: 0 on every SP rank
                with open(os.path.join(a.output_dir, "metrics.jsonl"), "a") as fh:
                    fh.write(json.dumps(rec) + "\n")
                print(f"step {rec['step']} tok/s {rec['tokens_per_s']:.0f} mem {rec['peak_mem_gb']:.3f}GB", flush=True)

    os.makedirs(a.output_dir, exist_ok=True)
    trainer = Trainer(model=model, args=args, train_dataset=RandomTokens(), callbacks=[Meter()])
    if torch.distributed.is_initialized():  # DeepSpeed's CPU SHM all-reduce segment, as train.py releases it
        from base.parallel import release_shm_buffer

        release_shm_buffer(torch.distributed.get_rank())
    trainer.train()
    from base.comm import shutdown

    shutdown()  # as train.py: a group alive at interpreter teardown can abort a finished run (exit -6)
    return 0


if __name__ == "__main__":
    sys.exit(main())
