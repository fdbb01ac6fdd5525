"""`srun python train.py` with a MASTER_ADDR the batch shell exported (the job's first node) for a step on other
nodes: one line (exit 2) at the first line of every rank (base/slurm_env.py master_refusal, from base/comm.py
open_channel), not 300 s of waiting for a rank 0 that is not there, then exit 69."""

from __future__ import annotations

import pytest

from base import comm, watcher
from base.slurm_env import master_refusal, srun_world

STEP = dict(SLURM_STEP_NUM_TASKS="16", SLURM_PROCID="9", SLURM_LOCALID="1", SLURM_STEP_NODELIST="node[03-04]",
            SLURM_JOB_NODELIST="node[01-04]", SLURM_JOB_ID="1234567", SLURM_STEP_ID="1", MASTER_PORT="29500")


def world(**env: str) -> dict:
    e = {**STEP, **env}
    return {**e, **srun_world(e)}  # what training/job.py puts in a rank's environment


def test_a_master_outside_the_step_is_one_line():
    line = master_refusal(world(MASTER_ADDR="node01"))
    assert line is not None and len(line.splitlines()) == 1
    assert line.startswith("MASTER_ADDR=node01 is not a host of this srun step (node03,node04): rank 0 runs on node03")
    assert master_refusal(world(MASTER_ADDR="node0-ib")) is not None  # node0 is no step host's name (node03's prefix)


@pytest.mark.parametrize("addr", ["node03", "NODE04.cluster.local", "node03-ib", "10.1.2.3", "::1", None])
def test_a_master_of_the_step_an_ip_or_none_is_kept(addr):
    env = world(**({"MASTER_ADDR": addr} if addr else {}))
    assert master_refusal(env) is None and env["MASTER_ADDR"] == (addr or "node03")


def test_other_launchers_are_not_judged():
    """launch.sh / deepspeed under srun (one task a node): RANK is not SLURM_PROCID, the world not the step's tasks."""
    assert master_refusal({**STEP, "MASTER_ADDR": "node01", "RANK": "13", "WORLD_SIZE": "16"}) is None
    assert master_refusal({**STEP, "MASTER_ADDR": "node01", "RANK": "9", "WORLD_SIZE": "64"}) is None


def test_open_channel_refuses_it_before_waiting(monkeypatch):
    for k, v in world(MASTER_ADDR="node01").items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(watcher, "START_WAIT_S", 2.0)  # the old code: waited this, then SystemExit 69
    monkeypatch.setattr(comm, "_WATCHER", None)
    with pytest.raises(ValueError, match=r"^MASTER_ADDR=node01 is not a host of this srun step"):
        comm.open_channel()
