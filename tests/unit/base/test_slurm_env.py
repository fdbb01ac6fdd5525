"""base/slurm_env.py: SLURM's hostlist syntax expanded as `scontrol show hostnames` does, the world `srun python
train.py` describes in its tasks' variables, and the job's default port outside the ephemeral range."""

from __future__ import annotations

import pytest

from base.slurm_env import expand_hostlist, job_port, srun_world


@pytest.mark.parametrize("text, hosts", [
    ("gpu[01-03,07],login", ["gpu01", "gpu02", "gpu03", "gpu07", "login"]),
    ("a,b", ["a", "b"]),
    ("node7", ["node7"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("x[8-10]", ["x8", "x9", "x10"]),
])
def test_hostlists_expand_as_scontrol_does(text, hosts):
    assert expand_hostlist(text) == hosts


def test_srun_tasks_are_one_world_with_the_steps_first_host_as_master():
    env = {"SLURM_STEP_NUM_TASKS": "512", "SLURM_PROCID": "9", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "123",
           "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "gpu[017-080]", "SLURM_JOB_NODELIST": "gpu[001-080]"}
    assert srun_world(env) == {"RANK": "9", "LOCAL_RANK": "1", "WORLD_SIZE": "512", "MASTER_ADDR": "gpu017",
                               "MASTER_PORT": str(job_port(123, 0))}
    assert srun_world({**env, "MASTER_PORT": "29999"})["MASTER_PORT"] == "29999"
    # a heterogeneous step: the step's list is both components sorted together; task 0 runs on component 0's first
    # node (gpu05), not the list's first (gpu02): every rank waited for a store that was not there
    het = {**env, "SLURM_STEP_NODELIST": "gpu[02,05]", "SLURM_HET_SIZE": "2",
           "SLURM_JOB_NODELIST_HET_GROUP_0": "gpu05", "SLURM_JOB_NODELIST_HET_GROUP_1": "gpu02"}
    assert srun_world(het)["MASTER_ADDR"] == "gpu05"
    assert srun_world({**het, "SLURM_JOB_ID_HET_GROUP_0": "123"})["MASTER_ADDR"] == "gpu05"
    # a job submitted from inside a het job (leader 99) inherits its _HET_GROUP_ variables: its own first node
    assert srun_world({**het, "SLURM_JOB_ID_HET_GROUP_0": "99"})["MASTER_ADDR"] == "gpu02"


@pytest.mark.parametrize("env", [
    {},  # no SLURM
    {"SLURM_NTASKS": "8", "SLURM_PROCID": "0", "SLURM_JOB_NODELIST": "a"},  # the batch shell of `sbatch -n 8`
])
def test_outside_an_srun_step_there_is_no_srun_world(env):
    assert srun_world(env) is None


def test_the_jobs_port_is_never_in_the_ephemeral_range():
    """Linux's default ip_local_port_range is 32768-60999; 20000 + job % 20000 reached 39999."""
    ports = {job_port(j, s) for j in range(0, 200000, 7) for s in (0, 1, 5)}
    assert min(ports) >= 1024 and max(ports) < 32768
    assert job_port(123, 0) != job_port(123, 1)  # two steps of one job


@pytest.mark.parametrize("nodes", ["gpu[01-03,07],login", "rack[1-2]-n[08-10]", "a,b", "node[8-10]x", "n[1-2],m[3]"])
def test_the_scontrol_stand_in_expands_hostlists_as_slurm_does(tmp_path, nodes):
    """tests/stubs/scontrol `show hostnames` (what slurm.sbatch's tests read) expands as expand_hostlist, which follows
    hostlist.c: several bracket groups in one name each expand, the first outermost (the stand-in's greedy match
    turned rack[1-2]-n[08-10] into rack[1-2]-n08, ...)."""
    import os
    import subprocess

    from base.slurm_env import expand_hostlist
    from tests.e2e.launchers import STUBS

    out = subprocess.run([os.path.join(STUBS, "scontrol"), "show", "hostnames", nodes], capture_output=True, text=True,
                         check=True, env=dict(os.environ, SCONTROL_LOG=str(tmp_path / "scontrol.log")), timeout=30)
    assert out.stdout.split() == expand_hostlist(nodes)
