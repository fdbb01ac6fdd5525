"""scripts/slurm.sbatch with stub sbatch, srun and scontrol from tests/stubs on PATH and a stand-in launch.sh
(tests/stubs/fake_launch): one launcher per node with its node rank and master, requeue on 75 only (a `COMPLETE`
older than the job does not count), SLURM's warning signal forwarded, the time-limit cut, the interface variables
and the node's CPUs carried to every node's task, the give-up limit. With the real launchers: test_launch_scripts.py."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from tests.e2e.launchers import (
    INTERFACES,
    SBATCH_SCRIPT,
    STUBS,
    clean_env,
    cpu_set,
    needs_2_cpus,
    requeues,
    wait_for,
)


def sbatch(tmp_path, fake_exit: str, args: list[str], **env: str) -> subprocess.Popen:
    e = clean_env(PATH=f"{STUBS}:{os.environ['PATH']}", SLURM_SUBMIT_DIR=str(tmp_path),
                  SCONTROL_LOG=str(tmp_path / "scontrol.log"), FAKE_LOG=str(tmp_path / "fake.log"),
                  FAKE_EXIT=fake_exit, LAUNCH_CMD=os.path.join(STUBS, "fake_launch"), **env)
    return subprocess.Popen(["sbatch", SBATCH_SCRIPT, *args], cwd=tmp_path, env=e, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_sbatch_runs_one_launcher_per_node_with_node_rank_and_master(tmp_path):
    job = sbatch(tmp_path, "75", ["--config", "recipes/x.yaml", "--output_dir", str(tmp_path / "out")],
                 GPUS_PER_NODE="4", SLURM_JOB_ID="7")
    out = job.communicate(timeout=60)[0]
    assert job.returncode == 0, out
    assert (tmp_path / "fake.log").read_text().splitlines()[0] == (
        "args: --no_ssh --nnodes 1 --node_rank 0 --master_addr 127.0.0.1 --master_port 20007 --num_gpus 4 -- "
        f"--resume auto --config recipes/x.yaml --output_dir {tmp_path}/out")
    assert requeues(tmp_path) == ["requeue 7"]


@pytest.mark.parametrize("code, complete, job_rc, requeued", [
    ("75", None, 0, True),        # preempted after a save: requeue
    ("75", "during", 0, False),   # finished anyway: nothing to resume
    ("75", "before", 0, True),    # a COMPLETE older than the job (the line before a branch, a run since extended)
    ("0", "during", 0, False),    # done
    ("0", None, 1, False),        # 0 without COMPLETE: a launcher died of a signal; fail, do not loop
    ("0", "before", 1, False),    # ... also when an older COMPLETE is there
    ("3", None, 3, False),        # failure: no requeue
])
def test_sbatch_requeues_only_after_a_preemption_save(tmp_path, code, complete, job_rc, requeued):
    out_dir = tmp_path / "out"
    if complete == "before":
        out_dir.mkdir()
        (out_dir / "COMPLETE").write_text("")
    env = {"FAKE_COMPLETE": str(out_dir / "COMPLETE")} if complete == "during" else {}
    job = sbatch(tmp_path, code, ["--output_dir", str(out_dir)], **env)
    text = job.communicate(timeout=60)[0]
    assert job.returncode == job_rc, text
    assert requeues(tmp_path) == (["requeue 4242"] if requeued else []), text
    assert f"training exited with {code}" in text


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM])
def test_sbatch_forwards_the_warning_signal_and_requeues(tmp_path, sig):
    out_dir = tmp_path / "out"
    job = sbatch(tmp_path, "wait", ["--output_dir", str(out_dir)])
    try:
        wait_for(lambda: "ready" in (tmp_path / "fake.log").read_text() if (tmp_path / "fake.log").exists()
                 else False, 30, "the stand-in launcher")
        job.send_signal(sig)  # what --signal=B:USR1@120 does before the time limit
        text = job.communicate(timeout=30)[0]
    finally:
        job.kill()
    assert job.returncode == 0, text
    assert "got SIGUSR1" in (tmp_path / "fake.log").read_text(), text  # passed on as SIGUSR1
    assert (out_dir / "PREEMPT").exists()  # train.py's stop file, for ranks a signal cannot reach
    assert requeues(tmp_path) == ["requeue 4242"], text


@pytest.mark.parametrize("after, requeued", [("1", True), ("137", True), ("2", False)])
def test_sbatch_requeues_a_run_cut_by_the_time_limit(tmp_path, after, requeued):
    """After SLURM's warning, a run that ends without a preemption save and without COMPLETE (the time limit
    came first) is requeued to resume from its last save; bad input (2) never is."""
    job = sbatch(tmp_path, "wait", ["--output_dir", str(tmp_path / "out")], FAKE_EXIT_AFTER=after)
    try:
        wait_for(lambda: "ready" in (tmp_path / "fake.log").read_text() if (tmp_path / "fake.log").exists()
                 else False, 30, "the stand-in launcher")
        job.send_signal(signal.SIGUSR1)
        text = job.communicate(timeout=30)[0]
    finally:
        job.kill()
    assert f"training exited with {after}" in text, text
    assert requeues(tmp_path) == (["requeue 4242"] if requeued else []), text
    assert job.returncode == (0 if requeued else int(after)), text


@pytest.mark.parametrize("export", ["ALL", "NONE"])
def test_sbatch_carries_the_interface_variables_to_every_node(tmp_path, export):
    """Under `sbatch --export=NONE` (SLURM_EXPORT_ENV=NONE in the batch shell) srun starts its tasks without the
    batch environment unless told --export=ALL: the interface variables set in the job must still arrive."""
    env = {k: v for k, v in INTERFACES.items() if k != "TORCH_EXTENSIONS_DIR"}
    job = sbatch(tmp_path, "0", ["--output_dir", str(tmp_path / "out"), "--dry_run"], SLURM_EXPORT_ENV=export,
                 **env)
    text = job.communicate(timeout=60)[0]
    assert job.returncode == 0, text
    assert (tmp_path / "fake.log").read_text().splitlines()[1] == (
        "env: GLOO_SOCKET_IFNAME=eth1 NCCL_SOCKET_IFNAME=eth1 FI_PROVIDER=efa UCX_TLS=rc,sm")




@needs_2_cpus
@pytest.mark.parametrize("env, cpus", [
    ({}, "all"),  # the node's CPUs (SLURM_CPUS_ON_NODE / SLURM_JOB_CPUS_PER_NODE from the allocation)
    ({"SLURM_JOB_CPUS_PER_NODE": "1,2(x3)"}, 1),  # uneven nodes: what the smallest can give
    ({"SLURM_CPUS_PER_TASK": "1"}, 1),  # sbatch -c 1: the user's number
])
def test_sbatch_gives_each_nodes_task_the_nodes_cpus(tmp_path, env, cpus):
    """The srun stand-in confines the step's task as Slurm does (one CPU unless --cpus-per-task): the launcher of
    each node (here its stand-in) must run on the CPUs the job has there, not on one core."""
    job = sbatch(tmp_path, "0", ["--output_dir", str(tmp_path / "out"), "--dry_run"], SRUN_LOG=str(tmp_path / "srun"),
                 **env)
    text = job.communicate(timeout=60)[0]
    assert job.returncode == 0, text
    mine = sorted(os.sched_getaffinity(0))
    want = mine if cpus == "all" else mine[:1]
    assert f" --cpus-per-task={len(want)} --cpu-bind=none " in (tmp_path / "srun").read_text(), text
    seen = (tmp_path / "fake.log").read_text().splitlines()[2]
    assert seen.startswith("cpus: ") and cpu_set(seen[6:]) == want, (seen, text)


def test_sbatch_gives_up_after_max_requeues(tmp_path):
    job = sbatch(tmp_path, "75", ["--output_dir", str(tmp_path / "out")], SLURM_RESTART_COUNT="4",
                 MAX_REQUEUES="3")
    text = job.communicate(timeout=60)[0]
    assert job.returncode == 1 and "giving up" in text and requeues(tmp_path) == []
    assert not (tmp_path / "fake.log").exists()
