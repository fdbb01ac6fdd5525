"""The descriptor limit (base/watcher.py raise_fd_limit / raise_fd_limit_of, base/comm.py's refusal): every rank and
the store's host raise RLIMIT_NOFILE to the hard limit; under torchrun rank 0 raises the agent that hosts the store;
a limit the world cannot fit is refused in one line before any work: through the abort channel's store
(tests/unit/base/fake_channel.py), and slow, a real launch and a real torchrun."""

from __future__ import annotations

import os
import subprocess

import pytest

from base import comm, watcher
from tests.distributed import ROOT
from tests.unit.base.fake_channel import open_fake_channel


@pytest.fixture
def channel(monkeypatch):
    yield from open_fake_channel(monkeypatch)


def test_every_rank_raises_its_descriptor_limit_to_the_hard_limit():
    """Nothing else raises RLIMIT_NOFILE: a soft limit of 1024 holds a store server's 3 connections per rank only up
    to about 330 ranks, and a rank's own gloo mesh (one socket per peer) up to about 800."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 256:
        pytest.skip(f"hard limit {hard}: nothing to raise")
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))  # a low `ulimit -n` (soft)
    try:
        got, _ = watcher.raise_fd_limit()
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == got > 256
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_rank0_finds_and_raises_the_limit_of_torchruns_agent_that_hosts_the_store(tmp_path):
    """Under torchrun the job's store lives in the agent (rank 0's parent), which never raises its soft limit and
    published nothing, so only each rank's own limit was checked. Rank 0 finds the ancestor listening on MASTER_PORT
    and raises that process' soft limit to its hard one (prlimit), the figure it publishes for every rank. A stand-in
    agent: a process listening on a port under a soft `ulimit -n` of 64, rank 0 its child (no torch: < 1 s)."""
    import resource
    import sys

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 64:
        pytest.skip(f"hard limit {hard}: nothing to raise")
    agent = tmp_path / "agent.py"
    agent.write_text(f"""
import os, resource, socket, subprocess, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
port, unused = s.getsockname()[1], socket.socket()
unused.bind(("127.0.0.1", 0))  # bound, not listening: held by nobody's listen
rank0 = ("import sys; sys.path.insert(0, {ROOT!r}); from base import watcher; "
         "pid = watcher.store_host_pid(int(sys.argv[1])); "
         "print(pid, watcher.raise_fd_limit_of(pid), watcher.store_host_pid(int(sys.argv[2])))")
out = subprocess.run([sys.executable, "-c", rank0, str(port), str(unused.getsockname()[1])], capture_output=True,
                     text=True).stdout.split()
print(os.getpid(), *out, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
""")
    got = subprocess.run([sys.executable, str(agent)], capture_output=True, text=True, timeout=60)
    agent_pid, found, raised, other, after = got.stdout.split()
    assert found == agent_pid and other == "None", got.stdout + got.stderr
    assert int(raised) == int(after) > 64, got.stdout  # the agent's own soft limit, raised by its child


def test_a_world_the_store_cannot_hold_is_refused_in_one_line(channel):
    """The store's host publishes the descriptors it may hold; every rank compares them with 3 per rank of its
    WORLD_SIZE (the same number and world on every rank: the same decision) and refuses before any work."""
    make, _, server = channel
    assert watcher.store_fds(512) == 3 * 512 + 128
    comm.publish_fd_limit(server, 1024)
    w1, _ = make(1, 512)
    line = comm.fd_refusal(w1.store, 512, 1, 20000)
    assert line.startswith("the job's store (hosted by rank 0, or node 0's launcher) may open only 1024 file "
                           "descriptors (its hard limit, `ulimit -Hn`) but needs 1664 for this world"), line
    assert "ulimit -n 1664" in line and "LimitNOFILE" in line and "PropagateResourceLimits" in line
    assert comm.fd_refusal(w1.store, 256, 1, 20000) is None  # 3 x 256 + 128 = 896 fit
    assert "rank 1 " in comm.fd_refusal(w1.store, 256, 1, 300)  # this rank's own limit: 256 + 256 peers' sockets


@pytest.mark.slow  # fast siblings: test_a_world_the_store_cannot_hold_is_refused_in_one_line, ..._raises_its_descriptor_limit
def test_a_low_ulimit_refuses_the_job_in_one_line_before_it_starts(tmp_path):
    """A real low `ulimit -n` (soft = hard = 64, set in the rank's process) on rank 0, which hosts the store, for a
    world of 64: exit 2 with one line naming the limit and the fix, no traceback, before any work."""
    import resource
    import sys

    from tests.distributed import free_port

    script = tmp_path / "rank0.py"
    script.write_text(f"""
import sys
sys.path.insert(0, {ROOT!r})
from base import comm, watcher
from training.job import run_job
watcher.ABORT_WAIT_S = 0.5  # nobody else is there to read it
sys.exit(run_job(lambda: (comm.open_channel(), print("started", flush=True), 0)[2]))
""")
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="64", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()))
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64)))
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert proc.returncode == 2 and "started" not in proc.stdout, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr and len(errors) == 1, proc.stderr[-2000:]
    assert "may open only 64 file descriptors" in errors[0] and "needs 320" in errors[0], errors


@pytest.mark.slow  # fast sibling: test_rank0_finds_and_raises_the_limit_of_torchruns_agent_that_hosts_the_store
@pytest.mark.parametrize("ulimit", ["-Sn 200", "-n 120"])
def test_under_torchrun_the_limit_is_checked_where_the_store_lives(tmp_path, ulimit):
    """A real torchrun (one node, 2 ranks, static rendezvous: its agent hosts the store, TORCHELASTIC_USE_AGENT_STORE)
    started under a low `ulimit`. Soft 200, hard higher (the common case, a soft 1024): rank 0 raises the agent's soft
    limit to the hard one and the job starts (the agent used to stay at 200: a start-up hang near 330 ranks at 1024).
    Soft = hard = 120, below 3 x 2 + 128 = 134: every rank refuses with the same line naming torchrun's agent (each
    rank used to check only its own limit)."""

    from tests.distributed import free_port

    script = tmp_path / "rank.py"
    script.write_text(f"""
import os, resource, sys
sys.path.insert(0, {ROOT!r})
from base import comm
from training.job import run_job
def main():
    comm.open_channel()
    if os.environ["RANK"] == "0":
        print("agent soft", resource.prlimit(os.getppid(), resource.RLIMIT_NOFILE)[0], flush=True)
    return 0
sys.exit(run_job(main))
""")
    torchrun = os.path.join(ROOT, ".venv", "bin", "torchrun")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                                            "LOCAL_RANK", "TORCHELASTIC_USE_AGENT_STORE")}
    cmd = (f"ulimit {ulimit} && exec {torchrun} --nnodes 1 --nproc_per_node 2 --node_rank 0 --master_addr 127.0.0.1 "
           f"--master_port {free_port()} {script}")
    proc = subprocess.run(["bash", "-c", cmd], env=dict(env, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=300)
    text = proc.stdout + proc.stderr
    if ulimit == "-Sn 200":
        hard = resource_hard()
        assert proc.returncode == 0, text[-3000:]
        assert f"agent soft {hard}" in text, (hard, text[-3000:])
    else:
        errors = sorted(ln for ln in proc.stderr.splitlines() if ln.startswith("error: the job's store"))
        assert proc.returncode != 0 and len(errors) >= 1, text[-3000:]
        assert "(hosted by torchrun's agent on " in errors[0] and "may open only 120 file descriptors" in errors[0] \
            and "needs 134 for this world" in errors[0], errors


def resource_hard() -> int:
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY:
        with open("/proc/sys/fs/nr_open") as fh:
            hard = int(fh.read())
    return hard
