"""Launch paths: scripts/launch.sh builds the right command for each mode; two "nodes" started with
--no_ssh train with SP spanning both; scripts/slurm.sbatch turns SLURM's warning into a preemption save
and requeues (stub srun/scontrol on PATH, the training real); plots mark stage boundaries."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from tests.distributed import ROOT
from tests.runs import losses, wait_for

LAUNCH = os.path.join(ROOT, "scripts/launch.sh")
TINY = ["--model_name_or_path", "tiny-llama", "--sequence_parallel_size", "2", "--max_seq_length", "256",
        "--report_to", "none", "--no-export_hf"]


def env(**kw):
    e = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", **kw)
    e.pop("RANK", None)
    return e


@pytest.mark.parametrize("opts, expect", [
    (["--num_gpus", "4"], ".venv/bin/deepspeed --num_gpus 4 --master_port 29500 train.py --max_steps 3"),
    (["-H", "hosts", "--include", "w0@w1:0,1"], ".venv/bin/deepspeed --hostfile hosts --include w0@w1:0,1 "
                                                "--master_port 29500 train.py --max_steps 3"),
    (["--no_ssh", "--nnodes", "2", "--node_rank", "1", "--master_addr", "10.0.0.1", "--num_gpus", "8"],
     "--no_ssh --node_rank 1 --master_addr 10.0.0.1 --master_port 29500 train.py --max_steps 3"),
    (["--torchrun", "--nnodes", "2", "--node_rank", "0", "--master_addr", "10.0.0.1", "--num_gpus", "8"],
     "-m torch.distributed.run --nnodes 2 --node_rank 0 --nproc_per_node 8 --master_addr 10.0.0.1 "
     "--master_port 29500 train.py --max_steps 3"),
])
def test_launch_prints_the_command(opts, expect):
    p = subprocess.run([LAUNCH, "--print-only", *opts, "--", "--max_steps", "3"], cwd=ROOT, capture_output=True,
                       text=True, env=env(WANDB_MODE="offline", NCCL_DEBUG="WARN"))
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("DS_ACCELERATOR=cpu ") and expect in p.stdout
    exported = open(os.path.join(ROOT, ".deepspeed_env")).read()
    assert "WANDB_MODE=offline" in exported and "NCCL_DEBUG=WARN" in exported and "DS_ACCELERATOR=cpu" in exported


def test_launch_rejects_unknown_option():
    p = subprocess.run([LAUNCH, "--nproc", "2"], cwd=ROOT, capture_output=True, text=True, env=env())
    assert p.returncode == 2 and "unknown launch option --nproc" in p.stderr


@pytest.mark.dist
def test_two_nodes_without_ssh(tmp_path):
    """Node ranks 0 and 1 on 127.0.0.1, one process each; SP=2 spans both nodes."""
    out = tmp_path / "out"
    procs = [subprocess.Popen([LAUNCH, "--no_ssh", "--nnodes", "2", "--node_rank", str(r), "--master_addr",
                               "127.0.0.1", "--master_port", "29617", "--num_gpus", "1", "--", *TINY,
                               "--max_steps", "3", "--output_dir", str(out)], cwd=ROOT, env=env(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][-2000:] + outs[1][-2000:]
    recs = [r for r in map(json.loads, open(out / "metrics.jsonl")) if "loss" in r]
    assert [(r["step"], r["sp"], r["dp"]) for r in recs] == [(1, 2, 1), (2, 2, 1), (3, 2, 1)]
    assert (out / "COMPLETE").exists()


@pytest.mark.dist
def test_slurm_preemption_requeue_then_completion(tmp_path):
    out = tmp_path / "out"
    log = tmp_path / "scontrol.log"
    e = env(PATH=f"{ROOT}/tests/stubs:{os.environ['PATH']}", SCONTROL_LOG=str(log), SLURM_JOB_ID="4242",
            SLURM_NNODES="1", SLURM_JOB_NODELIST="127.0.0.1", GPUS_PER_NODE="2", SLURM_SUBMIT_DIR=ROOT)
    args = [*TINY, "--max_steps", "30", "--output_dir", str(out)]
    job = subprocess.Popen(["bash", os.path.join(ROOT, "scripts/slurm.sbatch"), *args], cwd=ROOT, env=e,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for(lambda: len(losses(out)) >= 3, timeout=300)
    job.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@N does before the time limit
    text = job.communicate(timeout=300)[0]
    assert job.returncode == 0, text[-3000:]
    assert log.read_text() == "requeue 4242\n", text[-3000:]
    assert "training exited with 75" in text and not (out / "COMPLETE").exists()
    saved = max(losses(out))
    assert saved < 30
    # the requeued job: resumes, completes, does not requeue again
    t0 = time.time()
    again = subprocess.run(["bash", os.path.join(ROOT, "scripts/slurm.sbatch"), *args], cwd=ROOT, env=e,
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:]
    assert f"resuming from {out}/checkpoints/step_{saved:06d}" in again.stdout
    assert log.read_text() == "requeue 4242\n" and (out / "COMPLETE").exists()
    assert sorted(losses(out)) == list(range(1, 31)) and time.time() - t0 < 600


def test_plot_marks_stage_boundaries(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("plot_metrics", os.path.join(ROOT, "scripts/plot_metrics.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    m = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "stage": 0 if s <= 4 else 1, "loss": 5 - s * 0.1, "tokens_per_s": 100.0, "peak_mem_gb": 1.0,
             "seq_len": 64 if s <= 4 else 128, "sp": 2} for s in range(1, 9)]
    rows.insert(4, {"event": "eval", "stage": 0, "step": 4, "heldout_loss": 4.0})
    m.write_text("".join(json.dumps(r) + "\n" for r in rows))
    steps = mod.read_steps(str(m))
    assert mod.stage_boundaries(steps) == [5]
    p = subprocess.run([os.path.join(ROOT, ".venv/bin/python"), "scripts/plot_metrics.py", str(m), "-o",
                        str(tmp_path / "m.png")], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0 and (tmp_path / "m.png").stat().st_size > 10_000
