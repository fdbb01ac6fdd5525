"""scripts/slurm.sbatch under users' own #SBATCH lines (stub sbatch, srun, scontrol from tests/stubs; a stand-in
launch.sh): the per-task options Slurm exports into the batch shell (-c, --gpus-per-task, --gpu-bind,
--ntasks-per-gpu) were taken by the step's srun for its one task per node; GPU counts that differ between nodes;
`sbatch --export=NONE`, under which the variables set at submission never arrive."""

from __future__ import annotations

import os

import pytest

from tests.e2e.launchers import ROOT, STUBS, needs_2_cpus
from tests.e2e.test_sbatch import TWO_NODES, sbatch


def gpu_logging_launcher(tmp_path) -> str:
    """A LAUNCH_CMD that logs the GPUs the node's task was given, then runs the stand-in launcher."""
    show = tmp_path / "show_gpus"
    show.write_text('#!/usr/bin/env bash\necho "gpus: ${CUDA_VISIBLE_DEVICES-all} on=${SLURM_GPUS_ON_NODE-}'
                    ' bind=${SLURM_TRES_BIND-}${SLURM_GPU_BIND-}" >> "$FAKE_LOG"\n'
                    f'exec {os.path.join(STUBS, "fake_launch")} "$@"\n')
    show.chmod(0o755)
    return str(show)


@pytest.mark.parametrize("env, line", [
    # --ntasks-per-node=2 -c 1 (-c per rank; 23.11+ also exports it as SLURM_TRES_PER_TASK=cpu=1): the node's CPUs
    pytest.param({"SLURM_NTASKS_PER_NODE": "2", "SLURM_NTASKS": "2", "SLURM_CPUS_PER_TASK": "1",
                  "SLURM_TRES_PER_TASK": "cpu=1"}, None, marks=needs_2_cpus),
    ({"SLURM_TRES_PER_TASK": "gres/gpu=1"}, "SLURM_TRES_PER_TASK=gres/gpu=1"),  # --gpus-per-task=1, 23.11+
    ({"SLURM_GPUS_PER_TASK": "1"}, "SLURM_GPUS_PER_TASK=1"),  # the same before 23.11
    ({"SLURM_TRES_BIND": "gres/gpu:closest", "SLURM_GPU_BIND": "closest"}, "SLURM_TRES_BIND=gres/gpu:closest"),
    ({"SLURM_NTASKS_PER_GPU": "1", "SLURM_NTASKS": "8"}, "SLURM_NTASKS_PER_GPU=1"),  # --ntasks-per-gpu=1
    ({"SLURM_EXPORT_ENV": "NONE"}, "--export=NONE: OUTPUT_DIR, GPUS_PER_NODE, LAUNCH_CMD, MASTER_PORT, ULYSSES_*"),
], ids=["ntasks-per-node-c", "gpus-per-task", "gpus-per-task-22", "gpu-bind", "ntasks-per-gpu", "export-none"])
def test_a_users_per_task_sbatch_lines_leave_each_node_its_cpus_and_gpus(tmp_path, env, line):
    """The step is one launcher task per node, but srun reads the batch shell's SLURM_* as its own options: an
    `#SBATCH --ntasks-per-node=8 -c 10` (a rank's 10) confined all 8 ranks of a node to 10 CPUs; `--gpus-per-task=1`
    or `--gpu-bind` gave the node's task one GPU (launch.sh then refused: CUDA_VISIBLE_DEVICES=0 for 8 ranks);
    `--ntasks-per-gpu` made srun refuse --ntasks-per-node (the job failed, 1). Now the task gets the node's CPUs and
    GPUs, with one line naming what was ignored. Under `sbatch --export=NONE` one line at restart 0 names the
    variables that did not arrive and the --export=ALL,VAR=value form."""
    mine = sorted(os.sched_getaffinity(0))
    job = sbatch(tmp_path, "0", ["--output_dir", str(tmp_path / "out"), "--dry_run"], SRUN_LOG=str(tmp_path / "srun"),
                 SLURM_GPUS_ON_NODE="8", LAUNCH_CMD=gpu_logging_launcher(tmp_path), **env)
    text = job.communicate(timeout=60)[0]
    assert job.returncode == 0, text
    assert f" --cpus-per-task={len(mine)} --cpu-bind=none " in (tmp_path / "srun").read_text(), text
    log = (tmp_path / "fake.log").read_text().splitlines()
    assert log[0] == "gpus: all on=8 bind=" and "args: --no_ssh" in log[1], (log, text)
    said = [x for x in text.splitlines() if "#SBATCH --gpus-per-task/--gpu-bind/--ntasks-per-gpu ignored:" in x
            or "set at sbatch arrive only if named there: --export=ALL" in x]
    assert len(said) == (line is not None) and all(line in x for x in said), text


def test_nodes_with_different_gpu_counts_are_refused_in_one_line(tmp_path):
    """Every node's launch.sh runs node 0's SLURM_GPUS_ON_NODE ranks: a node with more GPUs left some idle, silently
    (one with fewer failed later). A node with fewer refuses in one line naming the fix: the job ends with 2, never
    requeued; one with more runs, its idle GPUs said (a review: refusing it ended runs that worked). A GPUS_PER_NODE
    of yours is taken as given."""
    job = sbatch(tmp_path, "0", ["--output_dir", str(tmp_path / "out"), "--dry_run"], **TWO_NODES,
                 SLURM_GPUS_ON_NODE="4", SRUN_GPUS_1="8")
    text = job.communicate(timeout=60)[0]
    assert job.returncode == 0 and "node 1: 8 GPUs, node 0 4 (SLURM_GPUS_ON_NODE), whose count every node runs " \
        "(4 idle): ask one" in text, text
    job = sbatch(tmp_path, "0", ["--output_dir", str(tmp_path / "out"), "--dry_run"], **TWO_NODES,
                 SLURM_GPUS_ON_NODE="8", SRUN_GPUS_1="4")
    text = job.communicate(timeout=60)[0]
    assert job.returncode == 2 and "bad input or a full disk (exit 2; the line above names it): not requeueing" \
        in text, text
    assert "node 1: 4 GPUs, node 0 8 (SLURM_GPUS_ON_NODE), whose count every node runs: ask one (sbatch " \
        "--gpus-per-node=N) or export GPUS_PER_NODE=4" in text, text
    job = sbatch(tmp_path, "0", ["--output_dir", str(tmp_path / "out"), "--dry_run"], **TWO_NODES,
                 SLURM_GPUS_ON_NODE="8", SRUN_GPUS_1="4", GPUS_PER_NODE="4")
    text = job.communicate(timeout=60)[0]
    assert job.returncode == 0 and "GPUs, node 0" not in text, text


def test_a_recipes_output_dir_is_read_without_the_notes_parse_config_prints(tmp_path):
    """The folder of a recipe's `output_dir` (no --output_dir, no OUTPUT_DIR) was read from all of parse_config's
    stdout: with a stage flag beside a staged recipe its "note: the command line wins ..." came first, the folder was
    `note: ...\\ncheckpoints/tiny_cpu`, and a run that finished was reported failed (no COMPLETE seen there); across
    requeues the folder read as unseen, the progress bound and the same-failure rule off."""
    done = tmp_path / "checkpoints" / "tiny_cpu" / "COMPLETE"
    job = sbatch(tmp_path, "0", ["--config", os.path.join(ROOT, "recipes", "tiny_cpu.yaml"), "--max_steps", "3"],
                 FAKE_COMPLETE=str(done))
    text = job.communicate(timeout=120)[0]
    assert job.returncode == 0 and "output dir checkpoints/tiny_cpu\n" in text and "output dir note" not in text, text


def test_an_output_dir_under_home_is_the_folder_train_py_writes(tmp_path):
    """`--output_dir=~/runs/x` (no shell expands `~` after `=`): train.py writes $HOME/runs/x (its expanduser), the
    batch shell looked for COMPLETE under ./~/runs/x and called a finished run failed (a review)."""
    home = tmp_path / "home"
    done = home / "runs" / "x" / "COMPLETE"
    job = sbatch(tmp_path, "0", ["--output_dir=~/runs/x"], HOME=str(home), FAKE_COMPLETE=str(done))
    text = job.communicate(timeout=120)[0]
    assert job.returncode == 0 and f"output dir {home}/runs/x\n" in text, text
