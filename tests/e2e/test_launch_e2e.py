"""The launch paths with the real training: two "nodes" started with scripts/launch.sh --no_ssh (node ranks 0
and 1 on 127.0.0.1, one process each) train with SP=2 spanning both; scripts/slurm.sbatch turns SLURM's
warning (USR1 to the batch shell) into a preemption save and a requeue, and the requeued job resumes and
completes (stub srun/scontrol on PATH: tests/stubs)."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

from tests.distributed import ROOT
from tests.runs import losses, wait_for

pytestmark = pytest.mark.dist
LAUNCH = os.path.join(ROOT, "scripts/launch.sh")
SBATCH = os.path.join(ROOT, "scripts/slurm.sbatch")
TINY = ["--model_name_or_path", "tiny-llama", "--sequence_parallel_size", "2", "--max_seq_length", "256",
        "--report_to", "none", "--no-export_hf"]


def env(**kw):
    e = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", **kw)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        e.pop(k, None)
    return e


def test_two_nodes_without_ssh(tmp_path, assets):
    """Launched as the seed guide's command is written (issue 48): the model a Hugging Face hub id in the nodes' local
    hub cache (HF_HOME, offline), the length `--num_train_epochs 1`, counted from the data (before: 'unknown
    command-line argument(s) ['--num_train_epochs', '1']', and the hub id refused)."""
    import re
    import shutil

    out, repo = tmp_path / "out", tmp_path / "hf" / "hub" / "models--org--tiny-llama"
    shutil.copytree(assets["llama_gqa"], repo / "snapshots" / "c0ffee")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("c0ffee")
    seed = ["--model_name_or_path", "org/tiny-llama", "--dataset_path", assets["data"], "--num_train_epochs", "1",
            "--gradient_accumulation_steps", "4", *TINY[2:]]
    procs = [subprocess.Popen([LAUNCH, "--no_ssh", "--nnodes", "2", "--node_rank", str(r), "--master_addr",
                               "127.0.0.1", "--master_port", "29617", "--num_gpus", "1", "--", *seed,
                               "--output_dir", str(out)], cwd=ROOT, env=env(HF_HOME=str(tmp_path / "hf")),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][-2000:] + outs[1][-2000:]
    steps = int(re.search(r"1 epoch\(s\) of (\d+) packed samples at 256 = (\d+) steps", outs[0]).group(2))
    recs = [r for r in map(json.loads, open(out / "metrics.jsonl")) if "loss" in r]
    assert steps >= 2 and [(r["step"], r["sp"], r["dp"]) for r in recs] == [(s, 2, 1) for s in range(1, steps + 1)]
    assert (out / "COMPLETE").exists()


def test_slurm_preemption_requeue_then_completion(tmp_path):
    out = tmp_path / "out"
    log = tmp_path / "scontrol.log"
    e = env(PATH=f"{ROOT}/tests/stubs:{os.environ['PATH']}", SCONTROL_LOG=str(log), SLURM_JOB_ID="4242",
            SLURM_NNODES="1", SLURM_JOB_NUM_NODES="1", SLURM_JOB_NODELIST="127.0.0.1", GPUS_PER_NODE="2",
            SLURM_SUBMIT_DIR=ROOT, MASTER_PORT="29631", SLURM_CPUS_ON_NODE=str(len(os.sched_getaffinity(0))))
    args = [*TINY, "--max_steps", "30", "--output_dir", str(out)]
    job = subprocess.Popen(["bash", SBATCH, *args], cwd=ROOT, env=e, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    wait_for(lambda: len(losses(out)) >= 3, timeout=300)
    job.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@N does before the time limit
    text = job.communicate(timeout=300)[0]
    assert job.returncode == 0, text[-3000:]
    assert log.read_text() == "requeue 4242\n", text[-3000:]
    assert not (out / "COMPLETE").exists()
    saved = max(losses(out))
    assert saved < 30 and (out / "checkpoints" / f"step_{saved:06d}" / "MANIFEST.json").exists()
    again = subprocess.run(["bash", SBATCH, *args], cwd=ROOT, env=dict(e, SLURM_RESTART_COUNT="1"),
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:]
    assert f"resuming from {out}/checkpoints/step_{saved:06d}" in again.stdout
    assert log.read_text() == "requeue 4242\n" and (out / "COMPLETE").exists()
    assert sorted(losses(out)) == list(range(1, 31))


@pytest.mark.slow  # 86 s in the suite on 2 cores (2026-11-26); the branch rules: tests/unit/training/test_resume_branch.py
def test_slurm_requeue_continues_a_branch_once(assets, tmp_path):
    """The real slurm.sbatch (stand-in sbatch/srun/scontrol on PATH; srun confines its task as Slurm does) submitted
    with `--resume <branch point>` in a folder whose run had finished: the branch trains, saves steps 6 and 8 (the
    branch point, step 4, rotated away), is preempted (SIGTERM to the batch shell), saves, and is requeued; the
    requeue runs the same arguments and continues from the branch's own save to COMPLETE. (It was not requeued at
    all, the old line's COMPLETE being there; and its requeue asked for step 4 again: exit 2, "bad input".)"""
    from tests.distributed import run
    from tests.runs import TRAIN, train_args

    out = tmp_path / "out"
    ck = out / "checkpoints"
    keep = ["--save_steps", "2", "--save_total_limit", "2"]
    run(TRAIN, train_args(assets, out, 2, steps=6, extra=keep), 2, str(tmp_path / "l0"))  # the line branched from
    assert (out / "COMPLETE").exists() and sorted(p.name for p in ck.glob("step_*")) == ["step_000004", "step_000006"]
    args = train_args(assets, out, 2, steps=20, extra=[*keep, "--resume", str(ck / "step_000004")])
    log = tmp_path / "scontrol.log"
    e = env(PATH=f"{ROOT}/tests/stubs:{os.environ['PATH']}", SCONTROL_LOG=str(log), SLURM_SUBMIT_DIR=ROOT,
            GPUS_PER_NODE="2", MASTER_PORT="29651")
    e.pop("OMP_NUM_THREADS")  # launch.sh's share of the step's CPUs
    job = subprocess.Popen(["sbatch", SBATCH, *args], cwd=ROOT, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
    wait_for(lambda: (ck / "step_000008" / "MANIFEST.json").exists(), timeout=400)
    job.send_signal(signal.SIGTERM)  # SLURM's preemption (or the time-limit warning)
    text = job.communicate(timeout=300)[0]
    assert job.returncode == 0 and log.exists() and log.read_text() == "requeue 4242\n", text[-3000:]
    saved = max(losses(out))
    assert 8 <= saved < 20 and not (ck / "step_000004").exists() and not (out / "COMPLETE").exists(), text[-3000:]
    rank0 = (out / "logs" / "rank00000.log").read_text()
    if len(os.sched_getaffinity(0)) >= 2:  # the step's CPUs reached the ranks (srun --cpus-per-task)
        assert f"may run on {len(os.sched_getaffinity(0))} CPU(s)" in rank0, rank0[-3000:]
    again = subprocess.run(["sbatch", SBATCH, *args], cwd=ROOT, env=dict(e, SLURM_RESTART_COUNT="1"),
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:]
    assert "this branch was taken" in again.stdout and f"resuming from {ck}/step_{saved:06d}" in again.stdout
    assert log.read_text() == "requeue 4242\n" and (out / "COMPLETE").exists()
    assert sorted(losses(out)) == list(range(1, 21))


@pytest.mark.slow  # ~45 s; the launcher signal path: test_launch_scripts (fast)
def test_sigterm_to_every_process_of_the_job(tmp_path):
    """What SLURM does on preemption or scancel: SIGTERM to every process of the step at once, the launchers
    included (launch.sh, the deepspeed runner, launch.py, the ranks). The job still ends with one committed
    checkpoint at the step it reached and exit 75 (requeue)."""
    import psutil

    out = tmp_path / "out"
    job = subprocess.Popen([LAUNCH, "--num_gpus", "2", "--", *TINY, "--max_steps", "200", "--output_dir", str(out)],
                           cwd=ROOT, env=env(MASTER_PORT="29643"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, start_new_session=True)
    wait_for(lambda: len(losses(out)) >= 3, timeout=300)
    tree = [job.pid, *(c.pid for c in psutil.Process(job.pid).children(recursive=True))]
    for pid in tree:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    text = job.communicate(timeout=300)[0]
    assert job.returncode == 75, text[-3000:]
    saved = max(losses(out))
    assert (out / "checkpoints" / "LATEST").read_text().strip() == f"step_{saved:06d}", text[-3000:]
    assert (out / "checkpoints" / f"step_{saved:06d}" / "MANIFEST.json").exists()
