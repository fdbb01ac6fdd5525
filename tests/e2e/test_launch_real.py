"""The real deepspeed / torchrun launchers (and slurm.sbatch over them) under scripts/launch.sh, with stand-ins for
train.py (tests/stubs/fake_train.py, allreduce_world.py): a signal becomes a preemption save (75 through torchrun
too), node 0's store failing ends it at once, the sbatch chain, the node's CPUs spread over the ranks, the interface
variables, two nodes without ssh, `srun python train.py` as one world, launcher options it would drop (deepspeed's own
named with launch.sh's equivalent); a plain deepspeed run whose runner alone is killed saves (slow, the real train.py).
The commands launch.sh builds: test_launch_scripts.py."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess

import pytest

from tests.e2e.launchers import (
    DS,
    INTERFACES,
    LAUNCH,
    NUMA_STUB,
    ROOT,
    SBATCH_SCRIPT,
    STUBS,
    TRAIN,
    clean_env,
    launch,
    needs_2_cpus,
    requeues,
    wait_for,
)

# --- the real launchers with stand-ins for train.py ---

def fake_train_env(tmp_path, fake_exit: str, **kw: str) -> dict:
    return dict(TRAIN_SCRIPT=os.path.join(STUBS, "fake_train.py"), FAKE_DIR=str(tmp_path), FAKE_EXIT=fake_exit,
                DS_ACCELERATOR="cpu", **kw)


def ready(tmp_path, n: int) -> bool:
    return all((tmp_path / f"ready{r}").exists() for r in range(n))


@pytest.mark.dist
def test_deepspeed_launcher_signal_becomes_a_preemption_save(tmp_path):
    """SIGTERM to launch.sh (a container stop, `kill`): both ranks get SIGUSR1, exit 75, and the deepspeed
    launcher's 75 comes out of launch.sh."""
    p = subprocess.Popen([LAUNCH, "--num_gpus", "2", "--master_port", "29631", "--", "--max_steps", "1"],
                         cwd=tmp_path, env=clean_env(**fake_train_env(tmp_path, "wait")), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: ready(tmp_path, 2), 240, "both ranks")
        p.send_signal(signal.SIGTERM)
        text = p.communicate(timeout=120)[0]
    finally:
        p.kill()
    assert p.returncode == 75, text
    assert [(tmp_path / f"got{r}").read_text() for r in (0, 1)] == ["SIGUSR1", "SIGUSR1"], text


@pytest.mark.dist
@pytest.mark.parametrize("code", [75, *[pytest.param(c, marks=pytest.mark.slow) for c in (69, 130)]])  # as 75
def test_torchrun_preemption_exit_code_is_75_not_1(tmp_path, code):
    """torchrun reports any failing worker as 1: launch.sh passes on the ranks' own 75 (preempted), 69 (a peer
    lost, base/exits.py: slurm.sbatch requeues it; it used to come out as 1, a crash) and 130 (a Ctrl-C at start-up:
    a user's stop, not the crash that a 1 would make this node the origin of)."""
    p = subprocess.run([LAUNCH, "--torchrun", "--num_gpus", "2", "--master_port", "29632", "--", "--x"],
                       cwd=tmp_path, env=clean_env(**fake_train_env(tmp_path, str(code))), capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == code, p.stderr[-3000:]
    # torchrun's summary (both ranks exited 75), or, when torchrun SIGTERMed the slower rank after the first one
    # exited (a race, seen under load), the ranks' own records in LAUNCH_EXIT_DIR (75; a watcher's 69 records nothing)
    assert (f"torchrun exited 1 but every failed rank exited {code}" in p.stderr
            or f"the launcher exited 1 but every rank here exited {code}" in p.stderr), p.stderr[-3000:]


@pytest.mark.dist
def test_node_0_ends_at_once_when_its_store_cannot_start(tmp_path):
    """Node 0's launch.sh hosts the job's store (base/node_store.py serve): when it cannot start (here its port is
    held by another process, as another job's store would hold it; a broken venv or torch on node 0 is the same:
    tests/e2e/test_failure.py) launch.sh says so in one line and exits 1 within seconds, no rank started. It used to
    start its ranks anyway, which then waited for a store (or joined a stranger's) until their start-up timeout."""
    import time

    squat = socket.socket()
    squat.bind(("127.0.0.1", 0))
    squat.listen(1)
    port = str(squat.getsockname()[1])
    t0 = time.time()
    try:
        p = subprocess.run([LAUNCH, "--no_ssh", "--nnodes", "2", "--node_rank", "0", "--master_addr", "127.0.0.1",
                            "--master_port", port, "--num_gpus", "1", "--", "--x"], cwd=tmp_path,
                           env=clean_env(**fake_train_env(tmp_path, "wait"), TMPDIR=str(tmp_path)),
                           capture_output=True, text=True, timeout=90)
    finally:
        squat.close()
    assert p.returncode == 1, p.stderr[-3000:]
    assert f"node 0 ({os.uname().nodename}): the job's store did not start on 127.0.0.1:{port}" in p.stderr, p.stderr
    assert time.time() - t0 < 60 and not (tmp_path / "ready0").exists(), p.stderr[-3000:]


@pytest.mark.dist
@pytest.mark.parametrize("how", ["warning", "scancel --full --signal=USR2"])
def test_sbatch_chain_with_real_launcher(tmp_path, how):
    """sbatch -> srun -> launch.sh -> deepspeed -> 2 ranks: SLURM's USR1 to the batch shell reaches the
    ranks, 75 comes back up and the job is requeued. A user's USR2 to every process of the job (`--full`: the batch
    shell, launch.sh, the deepspeed launcher, the ranks) is a save and a stop: no process dies of it (the launcher
    and its ranks start with USR2 ignored, as with USR1), the job ends 0, never requeued."""
    e = clean_env(PATH=f"{STUBS}:{os.environ['PATH']}", SLURM_SUBMIT_DIR=str(tmp_path), GPUS_PER_NODE="2",
                  SCONTROL_LOG=str(tmp_path / "scontrol.log"), LAUNCH_CMD=LAUNCH, MASTER_PORT="29633",
                  **fake_train_env(tmp_path, "wait"))
    job = subprocess.Popen(["sbatch", SBATCH_SCRIPT, "--output_dir", str(tmp_path / "out")], cwd=tmp_path, env=e,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: ready(tmp_path, 2), 240, "both ranks")
        if how == "warning":
            job.send_signal(signal.SIGUSR1)
        else:
            subprocess.run([*how.split(), "4242"], env=e, check=True, timeout=30)
        text = job.communicate(timeout=120)[0]
    finally:
        job.kill()
    assert job.returncode == 0, text
    got = {(tmp_path / f"got{r}").read_text() for r in (0, 1)}
    assert got == {"SIGUSR1"} if how == "warning" else got <= {"SIGUSR1", "SIGUSR2"}, text
    assert "training exited with 75" in text, text
    assert requeues(tmp_path) == (["requeue 4242"] if how == "warning" else []), text


@pytest.mark.dist
@needs_2_cpus
def test_sbatch_ranks_spread_over_the_nodes_cpus(tmp_path):
    """sbatch -> srun (confining its task as Slurm does) -> launch.sh -> deepspeed (numactl stand-in binding with
    taskset) -> 2 ranks: each rank runs on its own share of the job's CPUs and together they cover them, with
    OMP_NUM_THREADS = CPUs / ranks. (With no --cpus-per-task both ranks ran on one CPU, OMP_NUM_THREADS=1.)"""
    cores = sorted(os.sched_getaffinity(0))
    # submitted from a run folder, not the repository: launch.sh is the submitted file's (the job's Command=)
    e = clean_env(PATH=f"{STUBS}:{NUMA_STUB}:{os.environ['PATH']}", SLURM_SUBMIT_DIR=str(tmp_path), GPUS_PER_NODE="2",
                  SCONTROL_LOG=str(tmp_path / "scontrol.log"), MASTER_PORT="29636",
                  TRAIN_SCRIPT=os.path.join(STUBS, "env_train.py"), FAKE_DIR=str(tmp_path), DS_ACCELERATOR="cpu",
                  TMPDIR=str(tmp_path), BIND_CORES="auto", OMP_NUM_THREADS=None)
    job = subprocess.run(["sbatch", SBATCH_SCRIPT, "--output_dir", str(tmp_path / "out"), "--dry_run"], cwd=tmp_path,
                         env=e, capture_output=True, text=True, timeout=300)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    seen = [json.loads((tmp_path / f"env{r}.json").read_text()) for r in (0, 1)]
    per = len(cores) // 2
    assert [s["OMP_NUM_THREADS"] for s in seen] == [str(per)] * 2, seen
    assert sorted(c for s in seen for c in s["cpus"]) == cores[:2 * per], seen  # disjoint, all of them
    assert all(len(s["cpus"]) == per for s in seen), seen


@pytest.mark.dist
@pytest.mark.parametrize("opts", [
    ["--num_gpus", "2"],
    ["--no_ssh", "--nnodes", "1", "--node_rank", "0", "--master_addr", "127.0.0.1", "--num_gpus", "2"],
    ["--torchrun", "--num_gpus", "2"],
], ids=["single-node", "no-ssh", "torchrun"])
def test_ranks_get_the_interface_variables_threads_and_cores(tmp_path, opts):
    """The real launchers: every rank sees the interface variables, OMP_NUM_THREADS = CPUs / ranks; under the
    deepspeed launcher (numactl stand-in on PATH) each rank starts under numactl with its own cores."""
    cores = sorted(os.sched_getaffinity(0))
    env = clean_env(TRAIN_SCRIPT=os.path.join(STUBS, "env_train.py"), FAKE_DIR=str(tmp_path), DS_ACCELERATOR="cpu",
                    TMPDIR=str(tmp_path), PATH=f"{NUMA_STUB}:{os.environ['PATH']}", BIND_CORES="auto",
                    NUMACTL_LOG=str(tmp_path / "numactl.log"), OMP_NUM_THREADS=None, **INTERFACES)
    p = subprocess.run([LAUNCH, *opts, "--master_port", "29635", "--", "--x"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    seen = [json.loads((tmp_path / f"env{r}.json").read_text()) for r in (0, 1)]
    for s in seen:
        assert {k: s[k] for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "FI_PROVIDER",
                                  "UCX_TLS")} == {k: v for k, v in INTERFACES.items() if k in s}, s
        assert s["OMP_NUM_THREADS"] == str(max(1, len(cores) // 2)), s
    bound = "--torchrun" not in opts and len(cores) >= 2
    log = (tmp_path / "numactl.log").read_text().splitlines() if bound else []
    assert len(log) == (2 if bound else 0), log
    if bound:  # the launcher's numactl -C per local rank: disjoint halves of this process' CPUs
        per = len(cores) // 2
        assert sorted(line.split(" -C ")[1] for line in log) == sorted(
            (f"{cores[i * per]}-{cores[i * per + per - 1]}" if per > 1 else str(cores[i * per])) for i in (0, 1))


@pytest.mark.slow  # a stub of test_launch_e2e.py::test_two_nodes_without_ssh, which trains (fast)
@pytest.mark.dist
def test_two_nodes_without_ssh(tmp_path):
    """launch.sh --no_ssh started twice on this machine (node ranks 0 and 1): one world of 2."""
    cmd = [LAUNCH, "--no_ssh", "--nnodes", "2", "--master_addr", "127.0.0.1", "--master_port", "29634",
           "--num_gpus", "1", "--node_rank"]
    env = clean_env(TRAIN_SCRIPT=os.path.join(STUBS, "allreduce_world.py"), DS_ACCELERATOR="cpu",
                    TMPDIR=str(tmp_path))
    procs = [subprocess.Popen([*cmd, str(r), "--", "--x"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=540)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs[0][-2000:] + outs[1][-2000:]
    assert "world 2 rank 0 sum 2" in outs[0] and "world 2 rank 1 sum 2" in outs[1]


@pytest.mark.dist
def test_srun_python_starts_one_world(tmp_path):
    """`srun python train.py` on 2 nodes (the srun stand-in: a task per node here, SLURM_PROCID 0 and 1,
    SLURM_STEP_NODELIST "127.0.0.1,localhost", no RANK): one world of 2 whose master is the step's first host, each
    rank its PROCID (SLURM_LOCALID as the local rank: tests/unit/base/test_slurm_env.py). It used to be 2 worlds of one
    (training/job.py without RANK): 2 runs writing one output folder. DeepSpeed's shared-memory comm op (built at
    deepspeed.init_distributed on CPU) comes from the checkout's cache, which scripts/setup.sh built: it came from
    ~/.cache/torch_extensions, which every clone shares and rebuilds with its own paths (this test took 80-99 s, 90 s of
    them compiling, whenever another clone had run it last)."""
    import re

    from tests.distributed import free_port

    e = clean_env(PATH=f"{STUBS}:{os.environ['PATH']}", SLURM_JOB_ID="77", SLURM_JOB_NUM_NODES="2",
                  SLURM_JOB_NODELIST="127.0.0.1,localhost", MASTER_PORT=str(free_port()), DS_ACCELERATOR="cpu",
                  PYTHONPATH=ROOT, SRUN_CPUS_PER_TASK="1", TORCH_EXTENSIONS_DIR=None)  # a user's shell sets none
    job = subprocess.run(["srun", os.path.join(ROOT, ".venv", "bin", "python"), os.path.join(STUBS, "srun_world.py")],
                         cwd=tmp_path, env=e, capture_output=True, text=True, timeout=240)
    assert job.returncode == 0, job.stdout + job.stderr[-3000:]
    assert sorted(re.findall(r"world \d+ rank \d+ local \d+ sum \d+ master [\d.]+", job.stdout)) == [
        f"world 2 rank {r} local 0 sum 2 master 127.0.0.1" for r in range(2)], job.stdout
    assert re.findall(r"ops (\S+)", job.stdout) == [os.path.join(ROOT, ".cache", "torch_extensions")] * 2, job.stdout


@pytest.mark.parametrize("opts", [["--num_gpus", "2"], ["--torchrun", "--num_gpus", "2"],
                                  ["--no_ssh", "--nnodes", "2", "--node_rank", "0", "--master_addr", "127.0.0.1"]])
def test_a_launcher_option_it_would_drop_is_one_line(tmp_path, opts):
    """`--launcher X` was passed on only with a hostfile (deepspeed's pdsh runner): elsewhere it was dropped,
    the job launched otherwise than asked, exit 0."""
    p = launch(["--print-only", *opts, "--launcher", "pdsh", "--", "--x"], tmp_path, DS_ACCELERATOR="cpu")
    assert p.returncode == 2 and "--launcher pdsh is deepspeed's multi-node runner" in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
    # openmpi / mvapich: deepspeed's runner sets no RANK there, which train.py refuses: said before pdsh or mpirun
    hosts = tmp_path / "hosts"
    hosts.write_text("n0 slots=2\n")
    p = launch(["--print-only", "-H", str(hosts), "--launcher", "openmpi", "--", "--x"], tmp_path, DS_ACCELERATOR="cpu")
    assert p.returncode == 2 and "--launcher openmpi starts the ranks without RANK" in p.stderr, p.stderr


@pytest.mark.parametrize("opt, instead", [("--ssh_port", "~/.ssh/config"), ("--bind_cores_to_rank", "BIND_CORES=1"),
                                          ("--bind_core_list=0-3", "taskset -c LIST"), ("--save_pid", "own pid"),
                                          ("--enable_each_rank_log", "logs/rankN.log"), ("--force_multi", "nothing")])
def test_deepspeeds_own_options_name_launch_shs_equivalent(tmp_path, opt, instead):
    """deepspeed's runner options were "unknown launch option" with no way forward: the line names what to use."""
    p = launch([opt, "--", "--x"], tmp_path, DS_ACCELERATOR="cpu")
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "is deepspeed's own option, not launch.sh's; instead:" in p.stderr and instead in p.stderr, p.stderr


@pytest.mark.slow  # ~40 s of training; the decision: tests/unit/training/test_preemption_launcher.py (fast)
@pytest.mark.dist
def test_a_plain_deepspeed_runner_killed_alone_leaves_a_saved_stop(tmp_path):
    """README's plain `deepspeed --num_gpus 2 train.py`: `kill -TERM <runner pid>` ends the runner alone (runner.py
    handles SIGTERM only for pdsh on several nodes). The ranks trained on to the end, unsaved, under a reparented
    launch.py; now they agree a stop, save the step they reached and exit 75."""
    from tests.runs import losses

    out = tmp_path / "out"
    args = ["--model_name_or_path", "tiny-llama", "--sequence_parallel_size", "2", "--max_seq_length", "256",
            "--report_to", "none", "--no-export_hf", "--max_steps", "400", "--output_dir", str(out)]
    runner = subprocess.Popen([DS, "--num_gpus", "2", "--master_port", "29637", TRAIN, *args], cwd=tmp_path,
                              env=clean_env(DS_ACCELERATOR="cpu", PYTHONPATH=ROOT), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        wait_for(lambda: len(losses(out)) >= 3, 300, "3 steps")
        runner.send_signal(signal.SIGTERM)
        text = runner.communicate(timeout=300)[0]  # the pipe closes once launch.py and both ranks are gone
    finally:
        try:
            os.killpg(runner.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    saved = max(losses(out))
    assert saved < 400 and "preempted (the deepspeed runner" in text, text[-3000:]
    assert (out / "checkpoints" / "LATEST").read_text().strip() == f"step_{saved:06d}", text[-3000:]
