"""Launch paths without the real train.py: scripts/launch.sh builds the right command for each mode,
writes .deepspeed_env and passes exit codes through; scripts/setup.sh reads its arguments first. The real
deepspeed/torchrun launchers with stand-ins for train.py: test_launch_real.py. slurm.sbatch with stub
sbatch/srun/scontrol alone: test_sbatch.py."""

from __future__ import annotations

import os
import socket
import subprocess

import pytest

from base.host import usable_cpus
from tests.e2e.launchers import (
    DS,
    INTERFACES,
    NUMA_STUB,
    ROOT,
    STUBS,
    TRAIN,
    allowed_cpus,
    clean_env,
    launch,
    needs_2_cpus,
)
from tests.e2e.test_launch_filters import one_port

# --- scripts/launch.sh: commands ---

# what a cluster sets so that gloo, NCCL, libfabric (EFA) and UCX pick the nodes' fabric; every node needs them
@pytest.mark.parametrize("opts, expect", [
    (["--num_gpus", "4"], f"{DS} --num_gpus 4 --master_port PORT {TRAIN} --max_steps 3"),
    (["-H", "hosts", "--include", "w0@w1:0,1", "--master_port", "29400"],
     f"{DS} --hostfile hosts --include w0@w1:0,1 --master_port 29400 {TRAIN} --max_steps 3"),
    # one host left, not this one: --force_multi (deepspeed would run its ranks here, on this machine)
    (["-H", "hosts", "--exclude", "w1", "--master_addr", "10.0.0.1"],
     f"{DS} --hostfile hosts --exclude w1 --force_multi --master_addr 10.0.0.1 --master_port 29500 {TRAIN} "
     "--max_steps 3"),
    (["-H", "hosts", "--nnodes", "1", "--launcher", "pdsh"],
     f"{DS} --hostfile hosts --num_nodes 1 --launcher pdsh --force_multi --master_port 29500 {TRAIN} --max_steps 3"),
    (["--no_ssh", "--nnodes", "2", "--node_rank", "1", "--master_addr", "10.0.0.1", "--num_gpus", "8"],
     f"{DS} --hostfile TMP/ulysses_hostfile.{os.getuid()}.2x8 --no_ssh --node_rank 1 --master_addr 10.0.0.1 "
     f"--master_port 29500 --num_gpus 8 {TRAIN} --max_steps 3"),
    # one node: node 0's address is this one (deepspeed would ssh to the hostfile's made-up first host to find it)
    (["--no_ssh", "--num_gpus", "2"], f"{DS} --hostfile TMP/ulysses_hostfile.{os.getuid()}.1x2 --no_ssh --node_rank 0 "
     f"--master_addr 127.0.0.1 --master_port PORT --num_gpus 2 {TRAIN} --max_steps 3"),
    # your hostfile: its lines are the nodes (node 1 of 2 accepted), its filters passed on
    (["-H", "hosts", "--no_ssh", "--node_rank", "1", "--master_addr", "10.0.0.1", "--num_gpus", "1"],
     f"{DS} --hostfile hosts --no_ssh --node_rank 1 --master_addr 10.0.0.1 --master_port 29500 --num_gpus 1 {TRAIN} "
     "--max_steps 3"),
    (["--num_gpus=4", "--master_port=29500"], f"{DS} --num_gpus 4 --master_port 29500 {TRAIN} --max_steps 3"),
    (["--torchrun", "--nnodes", "2", "--node_rank", "0", "--master_addr", "10.0.0.1", "--num_gpus", "8",
      "--master_port", "29555"],
     f"{ROOT}/.venv/bin/torchrun --nnodes 2 --nproc_per_node 8 --node_rank 0 --master_addr 10.0.0.1 "
     f"--master_port 29555 {TRAIN} --max_steps 3"),
], ids=["single-node", "hostfile-include", "hostfile-exclude", "hostfile-nnodes", "no-ssh", "no-ssh-one-node",
        "no-ssh-hostfile", "equals", "torchrun"])
def test_print_only_prints_the_command_and_writes_deepspeed_env(tmp_path, opts, expect):
    (tmp_path / "hosts").write_text("w0 slots=2\nw1 slots=2\n")
    p = launch(["--print-only", *opts, "--", "--max_steps", "3"], tmp_path, TMPDIR=str(tmp_path),
               WANDB_MODE="offline", NCCL_DEBUG="WARN", HF_HOME="/data/hf", DS_ACCELERATOR="cpu", **INTERFACES)
    assert p.returncode == 0, p.stderr
    out = one_port(p.stdout) if "PORT" in expect else p.stdout  # one node: a free port (scripts/launch_env.sh)
    assert out == f"DS_ACCELERATOR=cpu PYTHONPATH={ROOT} OMP_NUM_THREADS=1 {expect.replace('TMP', str(tmp_path))}\n"
    exported = (tmp_path / ".deepspeed_env").read_text().splitlines()
    pdsh = "hosts" in opts and "--no_ssh" not in opts  # one launcher for every node: its id goes with the variables
    assert len([e for e in exported if e.startswith("ULYSSES_LAUNCH_ID=")]) == pdsh, exported
    exported = [e for e in exported if not e.startswith("ULYSSES_LAUNCH_ID=")]
    assert {"WANDB_MODE=offline", "NCCL_DEBUG=WARN", "HF_HOME=/data/hf", "DS_ACCELERATOR=cpu",
            f"PYTHONPATH={ROOT}", "OMP_NUM_THREADS=1", *(f"{k}={v}" for k, v in INTERFACES.items())
            } == set(exported)  # nothing else, no blank lines
    if "--no_ssh" in opts and "--nnodes" in opts:
        assert (tmp_path / f"ulysses_hostfile.{os.getuid()}.2x8").read_text() == "node0 slots=8\nnode1 slots=8\n"


def test_threads_per_rank_are_the_nodes_cpus_over_its_ranks(tmp_path):
    cores = len(os.sched_getaffinity(0))
    (tmp_path / "hosts").write_text("w0 slots=1\nw1 slots=1\n")
    for opts, ranks in ((["--num_gpus", "1"], 1), (["--num_gpus", str(cores + 1)], cores + 1),
                        (["-H", "hosts"], 1), (["--torchrun", "--num_gpus", "1"], 1)):
        p = launch(["--print-only", *opts, "--", "--x"], tmp_path, DS_ACCELERATOR="cpu", OMP_NUM_THREADS=None,
                   ULYSSES_CGROUP_ROOT=str(tmp_path / "no_quota"))  # this host's own quota, if any, left out
        threads = max(1, cores // ranks)
        assert p.returncode == 0 and f" OMP_NUM_THREADS={threads} " in p.stdout, (opts, p.stdout, p.stderr)
        assert f"OMP_NUM_THREADS={threads}" in (tmp_path / ".deepspeed_env").read_text().splitlines()
    p = launch(["--print-only", "--num_gpus", "1", "--", "--x"], tmp_path, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="3")
    assert " OMP_NUM_THREADS=3 " in p.stdout  # a value the user set wins


@pytest.mark.parametrize("opts, binds", [
    (["--num_gpus", "1"], True),
    (["--no_ssh", "--nnodes", "2", "--node_rank", "1", "--master_addr", "10.0.0.1", "--num_gpus", "1"], True),
    (["-H", "hosts"], False),  # deepspeed 0.19.8's pdsh runner does not pass --bind_cores_to_rank on
    (["--torchrun", "--num_gpus", "1"], False),
], ids=["single-node", "no-ssh", "pdsh", "torchrun"])
def test_cores_are_bound_per_rank_where_the_launcher_can(tmp_path, opts, binds):
    (tmp_path / "hosts").write_text("w0 slots=1\nw1 slots=1\n")
    path = f"{NUMA_STUB}:{os.environ['PATH']}"
    p = launch(["--print-only", *opts, "--", "--x"], tmp_path, DS_ACCELERATOR="cpu", PATH=path, BIND_CORES="auto",
               TMPDIR=str(tmp_path), ULYSSES_CGROUP_ROOT=str(tmp_path / "no_quota"))  # no CPU quota here
    assert p.returncode == 0, p.stderr
    assert (f" --bind_cores_to_rank --bind_core_list {allowed_cpus()} {TRAIN} --x" in p.stdout) == binds, p.stdout
    assert ("--bind_cores_to_rank" in p.stdout) == binds, p.stdout
    p = launch(["--print-only", *opts, "--", "--x"], tmp_path, DS_ACCELERATOR="cpu", PATH=path, BIND_CORES="0",
               TMPDIR=str(tmp_path))
    assert p.returncode == 0 and "--bind_cores_to_rank" not in p.stdout, p.stdout


def quota_tree(root, quota: str) -> str:
    """A /sys/fs/cgroup stand-in (ULYSSES_CGROUP_ROOT, base/host.py) holding a CPU quota at its root for whichever
    hierarchy this host's /proc/self/cgroup names: v2's cpu.max, v1's cfs files under cpu and cpu,cpuacct (the walk
    from this process' cgroup ends at the mount's root, where a container's quota sits)."""
    q, period = quota.split()
    (root / "cpu").mkdir(parents=True)
    (root / "cpu,cpuacct").mkdir()
    (root / "cpu.max").write_text(quota + "\n")
    for d in ("cpu", "cpu,cpuacct"):
        (root / d / "cpu.cfs_quota_us").write_text(("-1" if q == "max" else q) + "\n")
        (root / d / "cpu.cfs_period_us").write_text(period + "\n")
    return str(root)


@needs_2_cpus
@pytest.mark.skipif(not os.path.exists("/proc/self/cgroup"), reason="no cgroups (not Linux)")
def test_a_cpu_quota_sets_the_threads_and_keeps_ranks_unbound(tmp_path):
    """A container's CPU quota (docker --cpus, Kubernetes' limits.cpu: cpu.max) is not in the affinity nproc counts: a
    pod limited to 8 CPUs on a 128-core node gave its 8 ranks 16 threads each (128 on 8 CPUs' time). launch.sh now
    takes base/host.py's count (the quota, rounded up) and does not bind the ranks to cores (a quota is time on any
    CPU; deepspeed's binding would deal out the whole affinity and set that many threads); BIND_CORES=1 binds them to
    the CPUs counted. Here a quota of one CPU on this host's 2+."""
    one = quota_tree(tmp_path / "cg", "100000 100000")
    path = f"{NUMA_STUB}:{os.environ['PATH']}"
    first = allowed_cpus().split(",")[0].split("-")[0]
    p = launch(["--print-only", "--num_gpus", "1", "--", "--x"], tmp_path, DS_ACCELERATOR="cpu", OMP_NUM_THREADS=None,
               PATH=path, BIND_CORES="auto", ULYSSES_CGROUP_ROOT=one)
    assert p.returncode == 0 and " OMP_NUM_THREADS=1 " in p.stdout and "--bind_cores_to_rank" not in p.stdout, p.stdout
    assert f"a CPU quota of 1 of {len(os.sched_getaffinity(0))} CPUs: ranks not bound" in p.stderr, p.stderr
    p = launch(["--print-only", "--num_gpus", "1", "--", "--x"], tmp_path, DS_ACCELERATOR="cpu", PATH=path,
               BIND_CORES="1", ULYSSES_CGROUP_ROOT=one)
    assert p.returncode == 0 and f" --bind_cores_to_rank --bind_core_list {first} {TRAIN}" in p.stdout, p.stdout
    p = launch(["--print-only", "--num_gpus", "1", "--", "--x"], tmp_path, DS_ACCELERATOR="cpu", OMP_NUM_THREADS=None,
               ULYSSES_CGROUP_ROOT=quota_tree(tmp_path / "max", "max 100000"))  # "max": no quota
    assert f" OMP_NUM_THREADS={len(os.sched_getaffinity(0))} " in p.stdout, p.stdout


@pytest.mark.parametrize("env, message", [
    ({"KMP_AFFINITY": "compact"}, "unset KMP_AFFINITY"),
    ({"BIND_CORES": "yes"}, "BIND_CORES=yes: use auto, 0 or 1"),
    ({"NUM": "many"}, "ranks but"),
])
def test_insisting_on_core_binding_fails_in_one_line_where_it_cannot(tmp_path, env, message):
    num = str(len(usable_cpus()) + 1) if env.pop("NUM", None) else "1"
    p = launch(["--print-only", "--num_gpus", num, "--", "--x"], tmp_path, DS_ACCELERATOR="cpu",
               PATH=f"{NUMA_STUB}:{os.environ['PATH']}", **{"BIND_CORES": "1", **env})
    assert p.returncode == 2 and message in p.stderr and len(p.stderr.splitlines()) == 1, p.stderr
    p = launch(["--print-only", "--torchrun", "--num_gpus", "1", "--", "--x"], tmp_path, DS_ACCELERATOR="cpu",
               BIND_CORES="1")
    assert p.returncode == 2 and "only the local deepspeed launcher binds cores" in p.stderr, p.stderr


def test_accelerator_choice(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    smi = bindir / "nvidia-smi"
    path = f"{bindir}:{os.environ['PATH']}"
    # an nvidia-smi that finds no GPU (a driver without devices): cpu, 2 processes (the CPU recipes' SP=2)
    smi.write_text("#!/bin/sh\necho 'No devices were found'\nexit 6\n")
    os.chmod(smi, 0o755)
    p = launch(["--print-only", "--", "--x"], tmp_path, PATH=path)
    assert p.stdout.startswith("DS_ACCELERATOR=cpu ") and " --num_gpus 2 " in p.stdout, p.stderr
    # an nvidia-smi that lists 3 GPUs: cuda, 3 processes
    smi.write_text("#!/bin/sh\nfor i in 0 1 2; do echo \"GPU $i: NVIDIA H100 (UUID: x)\"; done\n")
    p = launch(["--print-only", "--", "--x"], tmp_path, PATH=path)
    assert p.stdout.startswith("DS_ACCELERATOR=cuda ") and " --num_gpus 3 " in p.stdout, p.stderr
    # a value the user set wins
    p = launch(["--print-only", "--num_gpus", "1", "--", "--x"], tmp_path, PATH=path, DS_ACCELERATOR="cpu")
    assert p.stdout.startswith("DS_ACCELERATOR=cpu "), p.stderr
    assert "DS_ACCELERATOR=cpu" in (tmp_path / ".deepspeed_env").read_text()
    # deepspeed over pdsh (-H) from a login node without GPUs: what was detected here is not sent to the nodes (its
    # `cpu` made every GPU node train on CPU); each node's deepspeed detects its own. A value the user set goes.
    (tmp_path / "hosts").write_text("gpu0 slots=8\ngpu1 slots=8\n")
    smi.write_text("#!/bin/sh\necho 'No devices were found'\nexit 6\n")
    p = launch(["--print-only", "-H", "hosts", "--", "--x"], tmp_path, PATH=path)
    assert p.returncode == 0 and "DS_ACCELERATOR" not in (tmp_path / ".deepspeed_env").read_text(), p.stderr
    p = launch(["--print-only", "-H", "hosts", "--", "--x"], tmp_path, PATH=path, DS_ACCELERATOR="cuda")
    assert "DS_ACCELERATOR=cuda" in (tmp_path / ".deepspeed_env").read_text().splitlines(), p.stderr


ADDRESS = (subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split() or ["127.0.0.1"])[0]


@pytest.mark.parametrize("host, force", [("gpu7", True), ("localhost", False), (socket.gethostname(), False),
                                         (ADDRESS, False)])  # this machine by its address (cloud hostfiles)
def test_one_host_left_in_a_hostfile_runs_there_not_here(tmp_path, host, force):
    """deepspeed's runner runs a single active host's ranks on the machine it runs on, whatever the host's name
    (runner.py: multi_node_exec only for more than one host): `-H hosts` naming one GPU node, started from a login
    node, trained on the login node. Now --force_multi goes over pdsh to it; a hostfile of this machine stays local."""
    (tmp_path / "hosts").write_text(f"{host} slots=2\n")
    p = launch(["--print-only", "-H", "hosts", "--", "--x"], tmp_path, DS_ACCELERATOR="cpu")
    assert p.returncode == 0 and (" --force_multi " in p.stdout) == force, p.stdout + p.stderr


def test_cuda_visible_devices_are_respected(tmp_path):
    # deepspeed: no --num_gpus, so the runner turns the selection into --include localhost:2,3
    p = launch(["--print-only", "--", "--x"], tmp_path, CUDA_VISIBLE_DEVICES="2,3", DS_ACCELERATOR="cuda")
    assert one_port(p.stdout).endswith(f" {DS} --master_port PORT {TRAIN} --x\n"), p.stdout + p.stderr
    p = launch(["--print-only", "--torchrun", "--", "--x"], tmp_path, CUDA_VISIBLE_DEVICES="2,3",
               DS_ACCELERATOR="cuda")
    assert " --nproc_per_node 2 " in p.stdout, p.stdout + p.stderr


def test_several_copies_under_one_srun_step_are_one_world_or_refused(tmp_path):
    """`srun -N2 scripts/launch.sh -- ARGS` ran two one-node worlds into one output folder (and the run lock took the
    live first run's lock over as 'an earlier run of this job'): refused in one line naming the per-node form; that
    form (what slurm.sbatch runs) passes."""
    p = launch(["--print-only", "--num_gpus", "2", "--", "--x"], tmp_path, DS_ACCELERATOR="cpu", SLURM_STEP_NUM_TASKS="2")
    assert p.returncode == 2 and "runs 2 copies of launch.sh" in p.stderr and "--no_ssh --nnodes 2" in p.stderr
    p = launch(["--print-only", "--no_ssh", "--nnodes", "2", "--node_rank", "1", "--master_addr", "a", "--num_gpus", "2",
                "--", "--x"], tmp_path, DS_ACCELERATOR="cpu", SLURM_STEP_NUM_TASKS="2", TMPDIR=str(tmp_path))
    assert p.returncode == 0, p.stderr
    p = launch(["--print-only", "--num_gpus", "2", "--", "--x"], tmp_path, DS_ACCELERATOR="cpu", SLURM_STEP_NUM_TASKS="1")
    assert p.returncode == 0, p.stderr  # one task: a plain launch


STEP = {"SLURM_JOB_ID": "5", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NUM_NODES": "2",
        "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_STEP_NODELIST": "gpu[01-02]", "SLURM_NODEID": "1", "SLURM_PROCID": "1"}


@pytest.mark.parametrize("opts, words", [
    (["--no_ssh", "--nnodes", "2", "--node_rank", "0"], "--node_rank 0 but this is node 1 of the srun step (SLURM_NODEID):"
     " the batch shell expanded $SLURM_NODEID; write \\$SLURM_NODEID or single-quote it"),
    (["--torchrun", "--nnodes", "2", "--node_rank", "0"], "--node_rank 0 but this is node 1 of the srun step"),
    (["--no_ssh", "--nnodes", "4", "--node_rank", "1"], "--nnodes 4 but this srun step runs on 2 nodes, one launch.sh "
     "each (SLURM_STEP_NUM_NODES): give --nnodes 2, or srun --nodes 4"),
    (["--no_ssh", "--nnodes", "2", "--node_rank", "1"], None),
    (["--no_ssh", "--nnodes", "2", "--node_rank", "$SLURM_NODEID"], None),  # srun runs no shell: the word itself
])
def test_each_node_of_an_srun_step_is_its_own_node_rank(tmp_path, opts, words):
    """`srun scripts/launch.sh --no_ssh --nnodes 2 --node_rank $SLURM_NODEID ...` in a batch script: the batch shell
    expands $SLURM_NODEID (0) for every node, whose ranks all claimed RANK 0..G-1 on node 0's store; after 300 s every
    rank exited 69 naming node 1 lost (a requeue without a healthy node). Refused in one line on node 1."""
    p = launch(["--print-only", *opts, "--master_addr", "gpu01", "--num_gpus", "2", "--", "--x"], tmp_path,
               DS_ACCELERATOR="cpu", TMPDIR=str(tmp_path), **STEP)
    if words:
        assert p.returncode == 2 and p.stderr.startswith(f"launch.sh: error: {words}"), p.stderr
        assert p.stderr.rstrip().endswith("(or use scripts/slurm.sbatch)") and p.stderr.count("\n") == 1, p.stderr
    else:
        assert p.returncode == 0 and " --node_rank 1 " in p.stdout, p.stdout + p.stderr
    if "$SLURM_NODEID" in opts:  # outside srun: no SLURM_NODEID to read
        p = launch(["--print-only", *opts, "--master_addr", "a", "--", "--x"], tmp_path, DS_ACCELERATOR="cpu")
        assert p.returncode == 2 and "--node_rank $SLURM_NODEID outside an srun task" in p.stderr, p.stderr


def test_your_own_deepspeed_env_keeps_its_other_lines(tmp_path):
    """./.deepspeed_env is the file deepspeed users keep for what remote nodes need (LD_LIBRARY_PATH=...): the launch
    writes its own names (from this environment: a stale NCCL_ value not set now goes) and keeps the others (before:
    the file was replaced, the user's lines lost on every node)."""
    (tmp_path / ".deepspeed_env").write_text("LD_LIBRARY_PATH=/opt/mylibs\nNCCL_IB_HCA=stale\n# a comment\nMY_FLAG=a=b")
    p = launch(["--print-only", "--num_gpus", "1", "--", "--x"], tmp_path, DS_ACCELERATOR="cpu")
    assert p.returncode == 0, p.stderr
    lines = (tmp_path / ".deepspeed_env").read_text().splitlines()
    assert lines[:2] == ["LD_LIBRARY_PATH=/opt/mylibs", "MY_FLAG=a=b"] and "DS_ACCELERATOR=cpu" in lines
    assert not any(x.startswith("NCCL_IB_HCA") or x.startswith("#") for x in lines), lines


def runner_env_files(ds_env_file: str | None, home: str) -> list[str]:
    """The files deepspeed's runner reads, from its own source (runner.py DEEPSPEED_ENVIRONMENT_NAME / _PATHS: the
    name DS_ENV_FILE gives, joined to ~ and '.'), without importing it (that imports torch)."""
    import ast
    import importlib.util

    path = os.path.join(importlib.util.find_spec("deepspeed").submodule_search_locations[0], "launcher", "runner.py")
    with open(path) as fh:
        tree = ast.parse(fh.read())
    nodes = [n for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "").startswith(
        "DEEPSPEED_ENVIRONMENT_")]
    assert len(nodes) == 2, f"{path}: DEEPSPEED_ENVIRONMENT_NAME / _PATHS moved"
    env = {k: v for k, v in {"DS_ENV_FILE": ds_env_file, "HOME": home}.items() if v is not None}
    fake_os = type("os", (), {"getenv": staticmethod(env.get), "path": type("p", (), {
        "expanduser": staticmethod(lambda p: p.replace("~", home, 1))})})
    ns: dict = {"os": fake_os}
    exec(compile(ast.Module(nodes, []), path, "exec"), ns)  # noqa: S102 (deepspeed's own two lines)
    return [os.path.join(d, ns["DEEPSPEED_ENVIRONMENT_NAME"]) for d in ns["DEEPSPEED_ENVIRONMENT_PATHS"]]


def test_a_read_only_working_folder_gets_its_deepspeed_env_under_tmpdir(tmp_path):
    """A read-only working folder (a container's image, readOnlyRootFilesystem) was mktemp's bare "failed to create
    file via template", exit 1. Now .deepspeed_env goes under TMPDIR, named to deepspeed's runner by an absolute
    DS_ENV_FILE (the one file it then reads, from ~ and '.' alike: your lines of ~/.deepspeed_env are carried in), in
    one line; over pdsh the printed command names it. /proc stands in for the folder: nobody writes there, root
    included (a read-only mount needs privileges)."""
    home = tmp_path / "home"
    home.mkdir()
    (home / ".deepspeed_env").write_text("LD_LIBRARY_PATH=/opt/mine\n")
    (tmp_path / "hosts").write_text("w0 slots=1\nw1 slots=1\n")
    for opts in (["--num_gpus", "1"], ["-H", str(tmp_path / "hosts")]):
        p = launch(["--print-only", *opts, "--", "--x"], "/proc", DS_ACCELERATOR="cpu", TMPDIR=str(tmp_path),
                   HOME=str(home))
        assert p.returncode == 0 and p.stderr.count("\n") == 1, p.stderr
        made = p.stderr.split(" written to ")[1].split(" (")[0]
        assert "/proc is not writable" in p.stderr and "DS_ENV_FILE" in p.stderr and made.startswith(str(tmp_path))
        assert f" DS_ENV_FILE={made} " in p.stdout, p.stdout  # the printed command runs with it
        lines = open(made).read().splitlines()
        assert "LD_LIBRARY_PATH=/opt/mine" in lines and "DS_ACCELERATOR=cpu" in lines, lines
        assert runner_env_files(made, str(home)) == [made, made]  # what the runner reads: that file alone
        os.remove(made)
    assert runner_env_files(None, str(home)) == [str(home / ".deepspeed_env"), "./.deepspeed_env"]
    p = launch(["--print-only", "--num_gpus", "1", "--", "--x"], "/proc", DS_ACCELERATOR="cpu", TMPDIR=str(tmp_path),
               DS_ENV_FILE=".ds_env")  # yours, where it cannot be written: one line naming it
    assert p.returncode == 2 and p.stderr.startswith("launch.sh: error: DS_ENV_FILE=.ds_env: cannot write"), p.stderr
    assert p.stderr.count("\n") == 1, p.stderr


def runner_exports(files: list) -> dict:
    """What deepspeed's runner exports from its .deepspeed_env files, read in order (runner.py lines 604-611: each line
    split at its first `=`, into one dict: a later file's key wins)."""
    out: dict = {}
    for f in files:
        if os.path.isfile(f):
            out.update(line.split("=", 1) for line in open(f).read().splitlines())
    return out


def test_a_read_only_working_folder_exports_what_a_writable_one_would(tmp_path):
    """From a read-only working folder the one file the runner reads is launch.sh's (DS_ENV_FILE under TMPDIR), and
    ~/.deepspeed_env's lines were carried into it only where their name is none of launch.sh's: a home
    NCCL_SOCKET_IFNAME=ib0 with none set here was dropped (a remote node's NCCL on another interface), though from a
    writable folder the runner reads it there. The nodes now get the same from either folder: the home file's lines
    but those this launch writes (OMP_NUM_THREADS, set here, wins)."""
    home, wd = tmp_path / "home", tmp_path / "wd"
    home.mkdir()
    wd.mkdir()
    (home / ".deepspeed_env").write_text("LD_LIBRARY_PATH=/opt/mine\nNCCL_SOCKET_IFNAME=ib0\nOMP_NUM_THREADS=99\n")
    env = dict(DS_ACCELERATOR="cpu", TMPDIR=str(tmp_path), HOME=str(home), NCCL_SOCKET_IFNAME=None)
    p = launch(["--print-only", "--num_gpus", "1", "--", "--x"], wd, **env)
    assert p.returncode == 0, p.stderr
    writable = runner_exports([home / ".deepspeed_env", wd / ".deepspeed_env"])
    p = launch(["--print-only", "--num_gpus", "1", "--", "--x"], "/proc", **env)
    assert p.returncode == 0 and "/proc is not writable" in p.stderr, p.stderr
    made = p.stderr.split(" written to ")[1].split(" (")[0]
    assert runner_exports([made]) == writable, open(made).read()
    assert writable["NCCL_SOCKET_IFNAME"] == "ib0" and writable["OMP_NUM_THREADS"] != "99", writable


def test_train_args_are_printed_so_a_shell_reads_them_back(tmp_path):
    args = ["--run_name", "it's a run", "--note", "$HOME", ""]
    p = launch(["--print-only", "--num_gpus", "1", "--", *args], tmp_path, DS_ACCELERATOR="cpu")
    back = subprocess.run(["bash", "-c", f"printf '%s\\n' {p.stdout.strip()}"], capture_output=True, text=True)
    assert back.stdout.splitlines()[-len(args):] == args


@pytest.mark.parametrize("args, message", [
    (["--nproc", "2", "--", "--x"], "unknown launch option --nproc"),
    (["--num_gpus", "2"], "no train.py arguments"),
    (["--no_ssh", "--nnodes", "2", "--node_rank", "0", "--", "--x"], "needs --master_addr"),
    (["--no_ssh", "--nnodes", "2", "--node_rank", "2", "--master_addr", "a", "--", "--x"], "--node_rank 2 is not in"),
    (["-H", "hosts", "--include", "w0", "--num_gpus", "2", "--", "--x"], "cannot be combined"),
    (["-H", "missing", "--", "--x"], "hostfile missing not found"),
    (["--nnodes", "2", "--", "--x"], "needs -H HOSTFILE, --no_ssh or --torchrun"),
    (["--torchrun", "-H", "hosts", "--", "--x"], "torchrun takes no hostfile"),
    (["-H", "hosts", "--no_ssh", "--nnodes", "2", "--master_addr", "a", "--", "--x"], "--nnodes 2 but hostfile hosts "
     "has 1 hosts"),
    (["-H", "hosts", "--include", "w0", "--nnodes", "2", "--", "--x"], "cannot be combined"),  # not deepspeed's traceback
    (["-H", "empty", "--no_ssh", "--", "--x"], "hostfile empty names no host"),  # was exit 1, no word (set -e)
    # 0 was deepspeed's "every GPU" (8 ranks on an 8-GPU node); abc / 1.5 a division or unbound-variable error
    *[(["--num_gpus", n, "--", "--x"], f"--num_gpus {n}: a number of ranks >= 1") for n in ("0", "abc", "1.5")],
])
def test_bad_options_exit_2(tmp_path, args, message):
    (tmp_path / "hosts").write_text("w0 slots=2\n")
    (tmp_path / "empty").write_text("# no host yet\n")
    p = launch(["--print-only", *args], tmp_path)
    assert p.returncode == 2 and message in p.stderr, p.stderr


@pytest.mark.parametrize("code", [0, 3, 75])
def test_exit_code_of_the_launcher_is_passed_on(tmp_path, code):
    log = tmp_path / "fake.log"
    p = launch(["--num_gpus", "1", "--", "--max_steps", "1"], tmp_path, DEEPSPEED=os.path.join(STUBS, "fake_launch"),
               FAKE_LOG=str(log), FAKE_EXIT=str(code))
    assert p.returncode == code, p.stderr
    assert one_port(log.read_text().splitlines()[0]) == f"args: --num_gpus 1 --master_port PORT {TRAIN} --max_steps 1"


# --- scripts/setup.sh: its arguments ---

@pytest.mark.parametrize("args, code", [(["--help"], 0), (["-h"], 0), (["--with-flash"], 2), (["-h", "x"], 2)])
def test_setup_reads_its_arguments_before_any_work(tmp_path, args, code):
    """`bash scripts/setup.sh --help` ran the whole set-up (pip, the op builds). Run as a copy in an empty folder, with
    stand-ins for python3 and pip that fail loudly: a set-up that starts never reaches the checkout's .venv."""
    (tmp_path / "scripts").mkdir()
    script = tmp_path / "scripts" / "setup.sh"
    script.write_text(open(os.path.join(ROOT, "scripts", "setup.sh")).read())
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name in ("python3", "python", "pip", "pip3"):
        (stubs / name).write_text("#!/bin/sh\necho SETUP RAN >&2\nexit 97\n")
        (stubs / name).chmod(0o755)
    env = clean_env(PATH=f"{stubs}:{os.environ['PATH']}", PYTHON=str(stubs / "python3"))
    p = subprocess.run(["bash", str(script), *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=30)
    assert p.returncode == code and "SETUP RAN" not in p.stderr and not (tmp_path / ".venv").exists(), p.stderr
    if code == 0:
        assert p.stdout.startswith("One-command set-up") and "WITH_FLASH_ATTN" in p.stdout and not p.stderr, p.stdout
    else:
        assert not p.stdout and len(p.stderr.splitlines()) == 1 and f"takes no arguments, got: {' '.join(args)}" \
            in p.stderr, p.stderr
