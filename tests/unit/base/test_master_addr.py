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
    assert line.startswith("MASTER_ADDR=node01 is a node of this job but not of this srun step (node03,node04): rank 0 "
                           "runs on node03")
    assert master_refusal(world(MASTER_ADDR="Node02.cluster.local")) is not None  # the job's node02, short form


@pytest.mark.parametrize("addr", ["node03", "NODE04.cluster.local", "node03-ib", "10.1.2.3", "::1", None])
def test_a_master_of_the_step_an_ip_or_none_is_kept(addr):
    env = world(**({"MASTER_ADDR": addr} if addr else {}))
    assert master_refusal(env) is None and env["MASTER_ADDR"] == (addr or "node03")


@pytest.mark.parametrize("addr", ["node0-ib", "node01-ib0", "node01ib", "ib-node01", "node01.ib.cluster", "[fe80::1]",
                                  "fe80::1%ib0", "dgx-a-001", "localhost", "10"])
def test_a_name_that_is_no_node_of_the_job_is_taken_as_given(addr):
    """The reviewer's cases (mr.py): a name outside the job's node names may be a step host under another name (AWS
    ParallelCluster's NodeHostname dgx-a-001 for NodeName gpu001; an interface's name in any spelling) or an address;
    ib-node01, node01ib and [fe80::1] were refused. node01.ib.cluster is node01 by its short form: refused."""
    env = world(MASTER_ADDR=addr)
    assert (master_refusal(env) is None) == (addr != "node01.ib.cluster"), addr


def test_every_rank_decides_alike(monkeypatch):
    """The batch template's `export MASTER_ADDR=$(hostname)` on a cluster whose hosts are not named as Slurm's nodes
    (dgx-a-001 for gpu001): rank 0 on dgx-a-001 accepted it and rank 8 on dgx-a-002 refused it (its own host name was
    part of the accepted set), so rank 0 waited 300 s for rank 8, then exit 69."""
    import socket

    step = dict(SLURM_STEP_NODELIST="gpu[001-002]", SLURM_JOB_NODELIST="gpu[001-002]", SLURM_STEP_NUM_TASKS="16",
                WORLD_SIZE="16", MASTER_ADDR="dgx-a-001")
    said = set()
    for host, rank in (("dgx-a-001", "0"), ("dgx-a-002", "8")):
        monkeypatch.setattr(socket, "gethostname", lambda h=host: h)
        said.add(master_refusal({**step, "RANK": rank, "SLURM_PROCID": rank}))
    assert said == {None}


def test_other_launchers_are_not_judged():
    """launch.sh / deepspeed under srun (one task a node): RANK is not SLURM_PROCID, the world not the step's tasks."""
    assert master_refusal({**STEP, "MASTER_ADDR": "node01", "RANK": "13", "WORLD_SIZE": "16"}) is None
    assert master_refusal({**STEP, "MASTER_ADDR": "node01", "RANK": "9", "WORLD_SIZE": "64"}) is None


def test_open_channel_refuses_it_before_waiting(monkeypatch):
    for k, v in world(MASTER_ADDR="node01").items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(watcher, "START_WAIT_S", 2.0)  # the old code: waited this, then SystemExit 69
    monkeypatch.setattr(comm, "_WATCHER", None)
    with pytest.raises(ValueError, match=r"^MASTER_ADDR=node01 is a node of this job but not of this srun step"):
        comm.open_channel()


@pytest.fixture
def cloud_dns(monkeypatch):
    """A cluster whose NodeNames do not resolve (cloud nodes without cloud_dns): cloud-dy-1 has no address."""
    import socket

    real = socket.getaddrinfo

    def getaddrinfo(host, *a, **kw):
        if str(host).startswith("cloud-dy-"):
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return real(host, *a, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(socket, "gethostname", lambda: "cloud-dy-1")
    monkeypatch.setattr(comm, "_WATCHER", None)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    for k, v in {"WORLD_SIZE": "2", "MASTER_ADDR": "cloud-dy-1", "MASTER_PORT": "29511"}.items():
        monkeypatch.setenv(k, v)


def test_an_unresolvable_master_is_one_line_on_the_stores_host(cloud_dns, monkeypatch):
    """`srun python train.py` with the step's first NodeName as MASTER_ADDR that does not resolve: rank 0 died with a
    c10d DistNetworkError traceback after 10 s+ (torch's own connect to its store). Now one line (exit 2), at once."""
    from base.slurm_env import unresolved

    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match=r"^MASTER_ADDR cloud-dy-1 does not resolve on cloud-dy-1: set MASTER_ADDR to "
                                         r"an address the nodes reach \(e\.g\. `scontrol getaddrs`\)$"):
        comm.open_channel()
    assert unresolved("127.0.0.1", 29511) is None and unresolved("localhost", "29511") is None


def test_the_other_ranks_say_it_when_they_give_up(cloud_dns, monkeypatch, capfd):
    """Every other rank decides nothing of its own (the store's host alone refuses); it fails to connect, after
    START_WAIT_S, and its line says the name does not resolve there either."""
    from base import connect
    from base.exits import EXIT_PEER_LOST

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(watcher, "START_WAIT_S", 1.0)
    monkeypatch.setattr(connect, "rank_age_s", lambda: 0.0)
    with pytest.raises(SystemExit) as stop:
        comm.open_channel()
    assert stop.value.code == EXIT_PEER_LOST
    lines = [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and lines[0].endswith("(MASTER_ADDR cloud-dy-1 does not resolve on cloud-dy-1: set "
                                                 "MASTER_ADDR to an address the nodes reach (e.g. `scontrol "
                                                 "getaddrs`))"), lines
