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


def test_two_nodes_without_ssh(tmp_path):
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


def test_slurm_preemption_requeue_then_completion(tmp_path):
    out = tmp_path / "out"
    log = tmp_path / "scontrol.log"
    e = env(PATH=f"{ROOT}/tests/stubs:{os.environ['PATH']}", SCONTROL_LOG=str(log), SLURM_JOB_ID="4242",
            SLURM_NNODES="1", SLURM_JOB_NUM_NODES="1", SLURM_JOB_NODELIST="127.0.0.1", GPUS_PER_NODE="2",
            SLURM_SUBMIT_DIR=ROOT, MASTER_PORT="29631")
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
