"""Helpers for tests that run train.py in several processes: arguments, reading metrics, interrupting."""

from __future__ import annotations

import json
import os
import signal
import time

from tests.distributed import ROOT, spawn, wait

TRAIN = os.path.join(ROOT, "train.py")


def train_args(assets, out, sp, ga=1, steps=8, extra=()):
    return ["--model_name_or_path", assets["llama_gqa"], "--dataset_path", assets["data"], "--max_seq_length", "128",
            "--sequence_parallel_size", str(sp), "--gradient_accumulation_steps", str(ga), "--learning_rate", "1e-3",
            "--warmup_steps", "2", "--max_steps", str(steps), "--output_dir", str(out), "--report_to", "none",
            "--no-export_hf", "--seed", "0", *extra]


def losses(out) -> dict[int, float]:
    p = os.path.join(out, "metrics.jsonl")
    if not os.path.exists(p):
        return {}
    with open(p) as fh:
        recs = [json.loads(x) for x in fh if x.strip()]
    return {r["step"]: r["loss"] for r in recs if "loss" in r}


def wait_for(cond, timeout=300.0, every=0.01):
    t0 = time.time()
    while not cond():
        if time.time() - t0 > timeout:
            raise TimeoutError
        time.sleep(every)


def preempt_after(args, nproc, out, log_dir, steps: int, sig=signal.SIGTERM) -> int:
    """Start a run, signal every rank once `steps` steps are logged; returns the step it saved at."""
    procs = spawn(TRAIN, args, nproc, log_dir)
    wait_for(lambda: len(losses(out)) >= steps)
    for p in procs:
        p.send_signal(sig)
    codes = wait(procs, log_dir)
    assert codes == [75] * nproc, codes
    return max(losses(out))
