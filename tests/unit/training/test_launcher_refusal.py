"""Launchers that would run the job otherwise than they say (training/launcher.py `launcher_refusal`), refused in one line
before any process group: accelerate's DeepSpeed plugin, FSDP, Megatron-LM and fp8 (its ACCELERATE_* settings were
ignored, the run exiting 0), torchrun's in-place restarts (`--max_restarts N`, an elastic `--nnodes MIN:MAX`: a
stop's exit 75 restarted, the stop undone; the last attempt's store broke the next), MPI without a rank (N worlds of
one on one folder), `deepspeed --launcher mpich` (launcher_helper.py made every exit code 0). The launches that work
pass, `python -m torch.distributed.launch`'s `--local-rank=N` included. Reproduced by an audit with 2 CPU ranks for
each (accelerate, torchrun --max_restarts / --nnodes 1:2, Open MPI's environment, torch.distributed.launch)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.distributed import ROOT
from training.launcher import launcher_refusal


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
    {"OMPI_COMM_WORLD_SIZE": "8", "RANK": "3", "MASTER_ADDR": "n0"},  # deepspeed --launcher impi sets RANK
    {"ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_USE_FSDP": "false", "RANK": "0"},  # accelerate launch's default
])
def test_the_launches_that_run_as_said_pass(env):
    assert launcher_refusal(env, parent=[]) is None


PY = "/venv/bin/python3"
HELPER = "/venv/lib/python3.11/site-packages/deepspeed/launcher/launcher_helper.py"
MPICH_ENV = {"PMI_SIZE": "8", "PMI_RANK": "3", "MPI_LOCALRANKID": "3", "RANK": "3", "LOCAL_RANK": "3",
             "MASTER_ADDR": "n0", "WORLD_SIZE": "8"}  # what launcher_helper.py's env_mapping leaves a rank


@pytest.mark.parametrize("helper", [["--launcher", "mpich"], ["--launcher", "MPICH", "--module"], ["--launcher=mpich"],
                                    []])  # its default is mpich
def test_deepspeeds_mpich_helper_is_refused_as_launch_sh_refuses_it(helper):
    """deepspeed --launcher mpich runs each rank under launcher_helper.py, which waits for it and returns nothing:
    75, 1 and 2 all came out 0, and a signal that ended the helper left the rank running (launch.sh refused it;
    a plain deepspeed passed)."""
    why = launcher_refusal(MPICH_ENV, parent=[PY, "-u", HELPER, *helper, "train.py", "--max_steps", "1"])
    assert why.startswith("deepspeed --launcher mpich:") and "become 0" in why and "slurm.sbatch" in why, why


def test_deepspeeds_impi_launch_passes():
    """--launcher impi starts every rank from mpirun itself with RANK / LOCAL_RANK (deepspeed/launcher/
    multinode_runner.py IMPIRunner): the rank's own code reaches mpirun."""
    parent = ["/opt/intel/oneapi/mpi/latest/bin/hydra_pmi_proxy", "--control-port", "n0:40111", "--proxy-id", "0"]
    assert launcher_refusal(MPICH_ENV, parent=parent) is None


TORCHRUN = {"TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_MAX_RESTARTS": "0", "RANK": "0", "LOCAL_WORLD_SIZE": "2"}


@pytest.mark.parametrize("agent, refused", [
    ([PY, "/venv/bin/torchrun", "--nnodes", "1:2", "--nproc_per_node", "2", "train.py", "--max_steps", "1"], "1:2"),
    ([PY, "/venv/bin/torchrun", "--nnodes=2:4", "--rdzv-backend", "c10d", "train.py"], "2:4"),
    ([PY, "-u", "-m", "torch.distributed.run", "--nnodes", "1:2", "train.py"], "1:2"),
    ([PY, "/venv/bin/torchrun", "--nnodes", "2", "--nproc_per_node", "2", "train.py", "--nnodes", "1:2"], None),
    ([PY, "/venv/bin/torchrun", "--nnodes", "2:2", "train.py"], None),
    ([PY, "/venv/bin/torchrun", "--nproc_per_node", "2", "train.py"], None),  # its default: 1:1
    ([PY, "/venv/bin/accelerate", "launch", "--num_machines", "2", "train.py"], None),  # a fixed node count
])
def test_an_elastic_torchrun_range_is_refused(monkeypatch, agent, refused):
    """`torchrun --nnodes 1:2` restarts the workers in place when a node joins or leaves, even with --max_restarts 0
    (its TORCHELASTIC_MAX_RESTARTS says 0), and the re-attempt reuses the agent store (run_identity.publish returned
    the old identity). Read from the agent's own command line (this rank's parent) with torch's own parser."""
    monkeypatch.delenv("PET_NNODES", raising=False)
    why = launcher_refusal(TORCHRUN, parent=agent)
    assert (why is None) if refused is None else why.startswith(f"torchrun --nnodes {refused}: an elastic range"), why


def test_an_elastic_range_in_torchruns_variable_is_refused_too(monkeypatch):
    monkeypatch.setenv("PET_NNODES", "1:3")  # torchrun reads each option from PET_<NAME> too (torch/distributed/argparse_util.py)
    why = launcher_refusal(TORCHRUN, parent=[PY, "/venv/bin/torchrun", "--nproc_per_node", "2", "train.py"])
    assert why.startswith("torchrun --nnodes 1:3"), why


@pytest.mark.parametrize("env, words", [
    ({"ACCELERATE_USE_FSDP": "true", "ACCELERATE_MIXED_PRECISION": "no", "RANK": "0"}, "accelerate launch --use_fsdp"),
    ({"ACCELERATE_USE_MEGATRON_LM": "true", "RANK": "0"}, "accelerate launch --use_megatron_lm"),
    ({"ACCELERATE_MIXED_PRECISION": "fp8", "RANK": "0"}, "accelerate launch --mixed_precision fp8"),
])
def test_accelerates_modes_that_are_not_read_here_are_one_line(env, words):
    """accelerate launch without --use_deepspeed: its FSDP (ACCELERATE_USE_FSDP=true), Megatron-LM and fp8 were
    ignored, the run training as DeepSpeed ZeRO-3 in its own precision."""
    why = launcher_refusal(env, parent=[])
    assert why.startswith(words) and "\n" not in why, why


@pytest.mark.parametrize("mixed, said", [("fp16", True), ("BF16", True), ("no", False), (None, False)])
def test_accelerates_fp16_or_bf16_is_said_not_taken(mixed, said):
    """train.py's precision is resolved later (its flags, the DeepSpeed JSON, the GPU): accelerate's is not read, and
    one warning line says so rather than leaving it silent."""
    from training.launcher import launcher_note

    note = launcher_note({"ACCELERATE_MIXED_PRECISION": mixed} if mixed else {})
    assert (note is not None and note.startswith(f"warning: accelerate launch --mixed_precision {mixed.lower()}")
            if said else note is None), note


@pytest.mark.parametrize("argv", [["--local-rank=1"], ["--local-rank", "1"], ["--local_rank=1"]])
def test_torch_distributed_launch_local_rank_is_taken(argv):
    """`python -m torch.distributed.launch --nproc_per_node 2 train.py` appends `--local-rank=N` (its spelling since
    torch 2.0): every rank exited 2, "unknown command-line argument(s) ['--local-rank=0']"."""
    from training.config import parse_config

    assert parse_config([*argv, "--max_steps", "3"]).max_steps == 3


def test_train_py_says_it_before_any_work():
    env = dict(os.environ, DS_ACCELERATOR="cpu", TORCHELASTIC_MAX_RESTARTS="1")
    env.pop("RANK", None)
    p = subprocess.run([sys.executable, "train.py", "--max_steps", "1"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: torchrun --max_restarts 1"), lines
