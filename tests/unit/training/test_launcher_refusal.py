"""Launchers that would run the job otherwise than they say (training/job.py `launcher_refusal`), refused in one line
before any process group: accelerate's DeepSpeed plugin (its ACCELERATE_* settings were ignored, the run exiting 0),
torchrun's in-place restarts (a stop's exit 75 restarted, the stop undone; the last attempt's store broke the next),
MPI without a rank (N worlds of one on one folder). The launches that work pass. Reproduced by an audit with 2 CPU
ranks for each (accelerate, torchrun --max_restarts, Open MPI's environment)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.distributed import ROOT
from training.job import launcher_refusal


@pytest.mark.parametrize("env, words", [
    ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": "my_ds.json", "RANK": "0"},
     "accelerate launch --use_deepspeed"),
    ({"TORCHELASTIC_MAX_RESTARTS": "3", "RANK": "1", "TORCHELASTIC_USE_AGENT_STORE": "True"},
     "torchrun --max_restarts 3"),
    ({"OMPI_COMM_WORLD_SIZE": "16", "OMPI_COMM_WORLD_RANK": "3"}, "started by MPI (OMPI_COMM_WORLD_SIZE=16)"),
    ({"PMI_SIZE": "8"}, "started by MPI (PMI_SIZE=8)"),
    # mpirun / hydra under Slurm start one daemon a node with srun: the ranks inherit that step (2 tasks, 16 ranks)
    ({"PMI_SIZE": "16", "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "0"}, "started by MPI (PMI_SIZE=16)"),
])
def test_a_launch_that_would_not_run_as_said_is_one_line(env, words):
    assert words in launcher_refusal(env)


@pytest.mark.parametrize("env", [
    {}, {"RANK": "0", "WORLD_SIZE": "8"},  # python train.py; deepspeed / launch.sh
    {"TORCHELASTIC_MAX_RESTARTS": "0", "RANK": "0", "TORCHELASTIC_USE_AGENT_STORE": "True"},  # torchrun's default
    {"ACCELERATE_USE_DEEPSPEED": "false", "RANK": "0"},  # accelerate launch without the plugin
    {"PMI_SIZE": "8", "SLURM_STEP_NUM_TASKS": "8", "SLURM_PROCID": "2"},  # srun --mpi=pmi2 python train.py
    {"OMPI_COMM_WORLD_SIZE": "8", "RANK": "3", "MASTER_ADDR": "n0"},  # deepspeed --launcher mpich / impi set RANK
])
def test_the_launches_that_run_as_said_pass(env):
    assert launcher_refusal(env) is None


def test_train_py_says_it_before_any_work():
    env = dict(os.environ, DS_ACCELERATOR="cpu", TORCHELASTIC_MAX_RESTARTS="1")
    env.pop("RANK", None)
    p = subprocess.run([sys.executable, "train.py", "--max_steps", "1"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: torchrun --max_restarts 1"), lines
