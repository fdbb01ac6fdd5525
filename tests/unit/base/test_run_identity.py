"""Two runs on one MASTER_PORT (base/run_identity.py): the second run's ranks refuse the first run's store in one line
before they write anything into it, and the ranks of one run always agree on their identity."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import textwrap

from base import comm, run_identity
from tests.distributed import ROOT, free_port

RANK = textwrap.dedent("""
    import sys
    sys.path.insert(0, %r)
    from base import comm
    try:
        comm.open_channel()
    except ValueError as e:
        print(f"refused: {e}", flush=True)
        sys.exit(2)
    print("joined", flush=True)
    comm.abort("rank 1 failed: RuntimeError: job B's own error", 1)
    sys.exit(1)
""") % ROOT


def test_a_rank_of_another_run_refuses_the_store_and_writes_nothing(tmp_path):
    """The auditor's xjob: job A's rank 0 hosts the store on port P; job B's rank 1 (B's rank 0 could not bind P)
    joins it. It used to write hb/1, host/1 and then its own failure as A's abort (A's ranks exited with B's message)."""
    port = free_port()
    env_a = {"WORLD_SIZE": "2", "SLURM_JOB_ID": "100", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2"}
    mine = run_identity.identity(env_a, ["--output_dir", "a"])
    store = comm.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, multi_tenant=True,
                          timeout=datetime.timedelta(seconds=10))
    run_identity.publish(store, mine)  # what A's rank 0 does right after it creates the server
    comm.publish_fd_limit(store, 1 << 20)
    before = store.num_keys()
    script = tmp_path / "b1.py"
    script.write_text(RANK)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "ULYSSES_LAUNCH", "TORCHELASTIC"))}
    env.update(RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), SLURM_JOB_ID="101",
               SLURM_STEP_ID="0", SLURM_STEP_NUM_TASKS="2", ULYSSES_START_WAIT_S="20", TORCH_CPP_LOG_LEVEL="FATAL")
    p = subprocess.run([sys.executable, str(script), "--output_dir", "b"], env=env, capture_output=True, text=True,
                       timeout=60)
    out = p.stdout.splitlines()
    assert p.returncode == 2 and len(out) == 1, p.stdout + p.stderr
    assert out[0].startswith(f"refused: rank 1: the job's store at 127.0.0.1:{port} belongs to another run "
                             "(Slurm step 100.0, world 2") and "--master_port" in out[0], out
    assert store.num_keys() == before  # nothing of B's: no heartbeat, no host, no abort
    assert not store.check([f"ulysses_watch/{mine.digest}/abort"])


def test_the_ranks_of_one_run_agree_and_two_runs_differ():
    """What differs per rank or node (its rank, node, host, devices, threads, deepspeed's --local_rank=N) is never part
    of it; the Slurm step, the world, the arguments and launch.sh's id are."""
    base = {"WORLD_SIZE": "16", "SLURM_JOB_ID": "7", "SLURM_STEP_ID": "3", "SLURM_STEP_NUM_TASKS": "16"}
    args = ["--config", "r.yaml", "--output_dir", "out"]
    ranks = [run_identity.identity({**base, "RANK": str(r), "LOCAL_RANK": str(r % 8), "SLURM_PROCID": str(r),
                                    "SLURM_NODEID": str(r // 8), "SLURM_LOCALID": str(r % 8),
                                    "CUDA_VISIBLE_DEVICES": str(r % 8), "OMP_NUM_THREADS": str(r)},
                                   [f"--local_rank={r % 8}", *args]) for r in range(16)]
    assert len({i.digest for i in ranks}) == 1
    assert run_identity.identity(base, ["--local_rank", "3", *args]) == ranks[0]
    others = [{**base, "SLURM_STEP_ID": "4"}, {**base, "SLURM_JOB_ID": "8"}, {**base, "WORLD_SIZE": "8"}]
    assert all(run_identity.identity(e, args).digest != ranks[0].digest for e in others)
    assert run_identity.identity(base, [*args, "--lr", "1"]).digest != ranks[0].digest
    # a batch shell (no step id) and an ssh'd node (no Slurm at all) agree: a job id alone is not used
    assert run_identity.identity({"WORLD_SIZE": "16", "SLURM_JOB_ID": "7"}, args) == \
        run_identity.identity({"WORLD_SIZE": "16"}, args)
    # launch.sh's id stands for the whole launch: node 0's store (base/node_store.py serve) has other arguments
    launch = {"ULYSSES_LAUNCH_ID": "h 1 2"}
    assert run_identity.identity({**launch, "WORLD_SIZE": "16"}, args) == run_identity.identity(launch, ["serve"])
    assert run_identity.identity(launch, args) != run_identity.identity({"ULYSSES_LAUNCH_ID": "h 1 3"}, args)


def test_nodes_started_by_one_srun_each_agree():
    """torchrun / deepspeed --no_ssh on 2 nodes, each started by its own srun (`srun -N1 -w nodeK torchrun ...`), or
    node 0 from the batch shell (Slurm's batch step sets SLURM_STEP_ID, not SLURM_STEP_NUM_TASKS), or node 1 over ssh
    (no Slurm variables): the step was part of the identity ("Slurm step 7.0" / "7.1"), so node 1's ranks refused node
    0's store as another run's (exit 2). A step is the identity's only when srun started every rank."""
    args = ["--config", "r.yaml"]
    nodes = [{"SLURM_JOB_ID": "7", "SLURM_STEP_ID": str(k), "SLURM_STEP_NUM_TASKS": "1", "SLURM_STEP_NUM_NODES": "1"}
             for k in range(2)]
    nodes += [{"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "-5"}, {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "4294967291"}, {}]
    ids = {run_identity.identity({**n, "WORLD_SIZE": "16", "TORCHELASTIC_RUN_ID": "none"}, args) for n in nodes}
    assert len(ids) == 1 and "Slurm" not in ids.pop().said
    # srun started every rank (one task per rank): the step is the identity's, and it tells two steps apart
    step = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "16", "WORLD_SIZE": "16"}
    assert run_identity.identity(step, args).said.startswith("Slurm step 7.0, world 16")
    assert run_identity.identity(step, args) != run_identity.identity({**step, "SLURM_STEP_ID": "1"}, args)
