"""base/host.py: the node size every launcher reports and the one the job agrees from all of them (uneven nodes
included: the curriculum, start-up's plan and evaluate.py take it), the job's host memory under a cgroup/container
limit and CPU quota (fake /proc/self/cgroup and /sys/fs/cgroup trees: v2, v1, nested, hybrid), the CPU placement verdict
from every rank's usable CPUs and each rank's threads (torchrun's / accelerate's default 1 is not a choice), and the
warning for a SLURM allocation whose nodes sit idle (a launcher started without srun)."""

from __future__ import annotations

import os

import pytest

from base import host
from base.host import ADAM_THREADS, cpu_placement, cpu_ranges, ranks_per_node, threads_per_rank

GiB = 2**30

LAUNCHER_VARS = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "WORLD_SIZE", "SLURM_NTASKS",
                 "SLURM_STEP_NUM_TASKS", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE",
                 "SLURM_GPUS_ON_NODE", "SLURM_NODEID")


@pytest.mark.parametrize("env, expect", [
    ({"LOCAL_WORLD_SIZE": "8", "WORLD_SIZE": "32"}, 8),  # torchrun
    ({"LOCAL_SIZE": "8", "CROSS_SIZE": "4", "WORLD_SIZE": "32"}, 8),  # the deepspeed launcher (launch.py)
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "4", "WORLD_SIZE": "8"}, 4),  # deepspeed --launcher openmpi
    ({"SLURM_STEP_NUM_TASKS": "32", "SLURM_STEP_TASKS_PER_NODE": "8(x4)", "WORLD_SIZE": "32"}, 8),  # srun, a rank/task
    # uneven nodes under srun: each node its own count (every rank read the first node's 8 before, so the job agreed
    # on 8 and Ulysses groups straddled the two 4-rank nodes); the job then agrees on their gcd, 4
    ({"SLURM_STEP_NUM_TASKS": "16", "SLURM_STEP_TASKS_PER_NODE": "8,4(x2)", "WORLD_SIZE": "16", "SLURM_NODEID": "2"},
     4),
    ({"SLURM_STEP_NUM_TASKS": "16", "SLURM_STEP_TASKS_PER_NODE": "8,4(x2)", "WORLD_SIZE": "16", "SLURM_NODEID": "0"},
     8),
    ({"SLURM_STEP_NUM_TASKS": "16", "SLURM_STEP_TASKS_PER_NODE": "8,x", "WORLD_SIZE": "16", "SLURM_NODEID": "0"}, 0),
    # slurm.sbatch: srun starts one launch.sh per node (1 task per node) and the deepspeed launcher the ranks
    ({"SLURM_STEP_NUM_TASKS": "4", "SLURM_NTASKS_PER_NODE": "1", "SLURM_GPUS_ON_NODE": "8", "LOCAL_SIZE": "8",
      "WORLD_SIZE": "32"}, 8),
    ({"SLURM_STEP_NUM_TASKS": "4", "SLURM_NTASKS_PER_NODE": "1", "WORLD_SIZE": "32"}, 0),  # ranks not srun's tasks
    ({"SLURM_NTASKS": "2", "SLURM_TASKS_PER_NODE": "1(x2)"}, 0),  # the batch shell (a dry run there): no ranks yet
    ({}, 0),  # no launcher: unknown
])
def test_ranks_per_node_under_every_launcher(env, expect):
    assert ranks_per_node(env) == expect


def test_deepspeed_launcher_keeps_ulysses_inside_a_node(monkeypatch):
    """Llama-3-8B (32 heads, 8 KV heads) at SP=16 on 4 nodes x 8 GPUs started by the deepspeed launcher (launch.sh,
    slurm.sbatch), no gpus_per_node in the recipe: Ulysses 8 inside the node, cp 2 across (it was Ulysses 16:
    an all-to-all over InfiniBand in every layer, LOCAL_WORLD_SIZE being torchrun's variable only)."""
    from training.config import Config
    from training.curriculum import check_stages, gpus_per_node, resolve_stages

    for k in LAUNCHER_VARS:
        monkeypatch.delenv(k, raising=False)
    for k, v in {"LOCAL_SIZE": "8", "CROSS_SIZE": "4", "WORLD_SIZE": "32", "RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    cfg = Config(model_name_or_path="llama3-8b", deepspeed="ds_configs/zero3_offload.json", bf16=True,
                 max_seq_length=131072, sequence_parallel_size=16)
    stages = check_stages(resolve_stages(cfg, lambda sp: 32 // sp), 32, 32, 8, None, gpus_per_node(cfg))
    assert [(s.sp // s.cp, s.cp) for s in stages] == [(8, 2)]
    assert gpus_per_node(cfg) == 8


# --- the node size, agreed once for the whole job ---

@pytest.mark.parametrize("readings, size, words", [
    # hostfile slots 8/4/4: rank 0-7 on n0, 8-11 on n1, 12-15 on n2; each rank's launcher says its own node's
    ([("n0", 8)] * 8 + [("n1", 4)] * 4 + [("n2", 4)] * 4, 4, "different node sizes (8 on n0, 4 on n1 and 1 more host(s))"),
    ([("n0", 8)] * 8 + [("n1", 6)] * 6, 2, "every rank takes 2, their greatest common divisor"),  # not the smallest (6)
    ([(f"n{r // 8}", 8) for r in range(32)], 8, "8 ranks per node (every rank's launcher says so)"),
    ([("n0", 8)] * 8 + [("n1", 0)] * 8, 8, "8 ranks per node"),  # a rank whose launcher says nothing: the others do
    ([("n0", 0)] * 8 + [("n1", 0)] * 4, 4, "4 ranks per node from the ranks' hosts"),  # no launcher, several hosts
    ([("n0", 0)] * 4, 0, "no node limit"),  # no launcher, one host: unknown (split_sp gets None)
    # srun -m cyclic: rank r on node r mod 2, the launchers saying 8: every Ulysses group of 8 spanned both nodes
    ([(f"n{r % 2}", 8) for r in range(16)], 1, "a node's ranks are not consecutive (srun -m cyclic?): every rank "
                                               "takes 1"),
])
def test_uneven_nodes_agree_on_one_node_size(readings, size, words):
    got, line = host.node_size_agreement(readings)
    assert got == size and words in line and "\n" not in line, line


def test_every_reader_takes_the_agreed_node_size(monkeypatch):
    """A rank of the 8-slot node of an 8/4/4 job (its launcher says LOCAL_SIZE=8) splits SP 16 as the job agreed
    (node size 4: Ulysses 4 x cp 4, as the 4-slot nodes' ranks do), not as its own launcher says (Ulysses 8 x cp 2,
    which the other ranks' collectives would not match); a recipe's gpus_per_node still wins. The multi-rank check: tests/multiproc/test_same_decision.py."""
    from training.config import Config
    from training.curriculum import check_stages, gpus_per_node, resolve_stages

    for k in LAUNCHER_VARS:
        monkeypatch.delenv(k, raising=False)
    for k, v in {"LOCAL_SIZE": "8", "CROSS_SIZE": "3", "WORLD_SIZE": "16", "RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    cfg = Config(model_name_or_path="llama3-8b", deepspeed="ds_configs/zero3_offload.json", bf16=True,
                 max_seq_length=131072, sequence_parallel_size=16)

    def layout(cfg):
        return [(s.sp // s.cp, s.cp) for s in check_stages(resolve_stages(cfg, lambda sp: 16 // sp), 16, 32, 8, None,
                                                           gpus_per_node(cfg))]
    assert layout(cfg) == [(8, 2)]  # no agreement yet (a dry run): this process' launcher
    monkeypatch.setattr(host, "_JOB_NODE", [host.node_size_agreement([("n0", 8)] * 8 + [("n1", 4)] * 4 + [("n2", 4)] * 4)])
    assert host.job_ranks_per_node() == 4 and gpus_per_node(cfg) == 4 and layout(cfg) == [(4, 4)]
    assert host.job_node_line().startswith("node size: the launchers report different node sizes")
    cfg.gpus_per_node = 8
    assert gpus_per_node(cfg) == 8 and layout(cfg) == [(8, 2)]


# --- host memory under a cgroup/container limit ---

def cgroup_tree(tmp_path, own: str, levels: dict[str, tuple], version: int = 2, hybrid: bool = False):
    """A fake /proc/self/cgroup (this process in cgroup `own`) and /sys/fs/cgroup tree whose `levels` ({cgroup path:
    (limit or "max", usage, inactive file bytes[, v2 memory.high or "max"])}) hold the files the kernel writes.
    Returns (proc file, root)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    proc, root = tmp_path / "proc_self_cgroup", tmp_path / "sys_fs_cgroup"
    if version == 2:
        proc.write_text(f"0::{own}\n")
        files, stat = ("memory.max", "memory.current"), "inactive_file"
        base = root
    else:  # v1 (hybrid: a v2 unified line too, without the memory controller)
        proc.write_text(f"12:pids:/\n4:cpu,memory:{own}\n1:name=systemd:{own}\n" + ("0::/\n" if hybrid else ""))
        files, stat = ("memory.limit_in_bytes", "memory.usage_in_bytes"), "total_inactive_file"
        base = root / "memory"
    for path, (limit, used, inactive, *high) in levels.items():
        d = base / path.strip("/") if path.strip("/") else base
        d.mkdir(parents=True, exist_ok=True)
        if high:
            (d / "memory.high").write_text(f"{high[0]}\n")
        (d / files[0]).write_text(f"{limit}\n")
        (d / files[1]).write_text(f"{used}\n")
        (d / "memory.stat").write_text(f"anon {used}\nfile 0\n{stat} {inactive}\n")
    return str(proc), str(root)


def test_cgroup_v2_limit_is_the_jobs_memory(tmp_path):
    """sbatch --mem=64G under cgroup v2: Slurm's job cgroup holds memory.max; the step and task cgroups below it
    say "max". The job may still use 64 - 60 = 4 GiB, whatever the node's MemAvailable says."""
    proc, root = cgroup_tree(tmp_path, "/system.slice/slurmstepd.scope/job_7/step_0/user/task_0", {
        "/": ("max", 200 * GiB, 0),  # a v2 root writes no memory.max; an unlimited level reads the same
        "/system.slice/slurmstepd.scope/job_7": (64 * GiB, 60 * GiB, 0),
        "/system.slice/slurmstepd.scope/job_7/step_0": ("max", 59 * GiB, 0),
        "/system.slice/slurmstepd.scope/job_7/step_0/user/task_0": ("max", 59 * GiB, 0)})
    got = host.cgroup_memory(proc, root)
    assert got == {"limit": 64 * GiB, "used": 60 * GiB, "headroom": 4 * GiB, "version": 2,
                   "cgroup": "/system.slice/slurmstepd.scope/job_7", "file": "memory.max"}
    assert host.memory_available(300 * GiB, got) == 4 * GiB  # min(MemAvailable, limit - usage)
    assert host.memory_available(3 * GiB, got) == 3 * GiB  # the node itself is shorter
    assert host.memory_available(None, None) is None and host.memory_available(5 * GiB, None) == 5 * GiB


def test_cgroup_v2_memory_high_below_memory_max_is_the_limit(tmp_path):
    """Slurm's task/cgroup under cgroup v2 with cgroup.conf AllowedRAMSpace=120 and sbatch --mem=64G writes 64 GiB to
    memory.high and 76.8 GiB to memory.max (SchedMD/slurm task_cgroup_memory.c, cgroup_v2.c): above memory.high the
    kernel throttles the job into reclaim, so the job's limit is 64 GiB (4 GiB left of it, not 16.8), named as
    memory.high. A memory.high of "max" leaves memory.max; one set where memory.max is not (systemd's MemoryHigh=)
    is the limit alone; v1 has no memory.high (its soft limit acts only under the node's pressure)."""
    job = "/system.slice/slurmstepd.scope/job_7"
    own = job + "/step_0/user/task_0"
    proc, root = cgroup_tree(tmp_path / "a", own, {"/": ("max", 200 * GiB, 0), job: (int(76.8 * GiB), 60 * GiB, 0, 64 * GiB),
                                                   own: ("max", 59 * GiB, 0, "max")})
    got = host.cgroup_memory(proc, root)
    assert (got["limit"], got["headroom"], got["file"], got["cgroup"]) == (64 * GiB, 4 * GiB, "memory.high", job)
    proc, root = cgroup_tree(tmp_path / "b", own, {job: (64 * GiB, 60 * GiB, 0, "max"), own: ("max", 59 * GiB, 0)})
    got = host.cgroup_memory(proc, root)
    assert (got["limit"], got["headroom"], got["file"]) == (64 * GiB, 4 * GiB, "memory.max")
    proc, root = cgroup_tree(tmp_path / "c", own, {job: ("max", 60 * GiB, 0, 62 * GiB)})
    got = host.cgroup_memory(proc, root)
    assert (got["limit"], got["headroom"], got["file"]) == (62 * GiB, 2 * GiB, "memory.high")
    proc, root = cgroup_tree(tmp_path / "d", own, {job: (32 * GiB, 30 * GiB, 0)}, version=1)
    (tmp_path / "d" / "sys_fs_cgroup" / "memory" / job.strip("/") / "memory.high").write_text(f"{GiB}\n")  # not v1's
    got = host.cgroup_memory(proc, root)
    assert (got["limit"], got["file"]) == (32 * GiB, "memory.limit_in_bytes")


def test_cgroup_nested_limits_take_the_least_headroom(tmp_path):
    """Nested limits: the tightest level counts: a smaller limit below (8 GiB task in a 100 GiB job), or a parent
    whose other children use most of its larger limit (job at 100 GiB with 97 in use: 3 GiB left for this task)."""
    own = "/slurm/uid_1/job_7/step_0"
    levels = {"/slurm/uid_1/job_7": (100 * GiB, 20 * GiB, 0), own: (8 * GiB, 1 * GiB, 0)}
    proc, root = cgroup_tree(tmp_path / "a", own, levels)
    assert host.cgroup_memory(proc, root)["headroom"] == 7 * GiB and host.cgroup_memory(proc, root)["limit"] == 8 * GiB
    levels["/slurm/uid_1/job_7"] = (100 * GiB, 97 * GiB, 0)
    proc, root = cgroup_tree(tmp_path / "b", own, levels)
    got = host.cgroup_memory(proc, root)
    assert (got["headroom"], got["limit"], got["cgroup"]) == (3 * GiB, 100 * GiB, "/slurm/uid_1/job_7")


@pytest.mark.parametrize("hybrid", [False, True], ids=["v1", "hybrid"])
def test_cgroup_v1_limit_and_unlimited(tmp_path, hybrid):
    """cgroup v1 (memory.limit_in_bytes / usage_in_bytes; "no limit" is PAGE_COUNTER_MAX pages), alone or beside a
    v2 unified hierarchy without the memory controller (this dev box's layout). Inactive page cache (a data set
    read once) is reclaimed before an OOM kill: not counted as used."""
    own = "/slurm/uid_1/job_9/step_0"
    proc, root = cgroup_tree(tmp_path, own, {"/": (9223372036854771712, 50 * GiB, 0),
                                             "/slurm/uid_1/job_9": (32 * GiB, 30 * GiB, 6 * GiB),
                                             own: (9223372036854771712, 30 * GiB, 6 * GiB)}, version=1, hybrid=hybrid)
    got = host.cgroup_memory(proc, root)
    assert (got["limit"], got["used"], got["headroom"], got["version"]) == (32 * GiB, 24 * GiB, 8 * GiB, 1)
    proc, root = cgroup_tree(tmp_path / "x", own,
                             {"/": (9223372036854771712, 50 * GiB, 0), own: (9223372036854771712, 1, 0)}, version=1)
    assert host.cgroup_memory(proc, root) is None  # no level limits


def test_cgroup_container_root_and_missing_files(tmp_path):
    """A container without its own cgroup namespace: /proc/self/cgroup names a path the mount does not have; the
    limit is at the mount's root (docker --memory). No cgroup file at all (not Linux, no mount): None."""
    proc, root = cgroup_tree(tmp_path, "/docker/0123abcd", {"/": (16 * GiB, 2 * GiB, 0)})
    got = host.cgroup_memory(proc, root)
    assert (got["limit"], got["headroom"], got["cgroup"]) == (16 * GiB, 14 * GiB, "/")
    assert host.cgroup_memory(str(tmp_path / "no_such_file"), root) is None
    assert host.cgroup_memory(proc, str(tmp_path / "no_mount")) is None


# --- CPUs under a cgroup CPU quota ---

def cpu_tree(tmp_path, own: str, levels: dict[str, tuple], version: int = 2, hybrid: bool = False):
    """A fake /proc/self/cgroup (this process in cgroup `own`) and /sys/fs/cgroup tree whose `levels` ({cgroup path:
    (quota, period)}: v2 writes them to cpu.max, "max" for none; v1 to cpu.cfs_quota_us / cpu.cfs_period_us, -1 for
    none, under the cpu,cpuacct mount). Returns (proc file, root)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    proc, root = tmp_path / "proc_self_cgroup", tmp_path / "sys_fs_cgroup"
    if version == 2:
        proc.write_text(f"0::{own}\n")
    else:  # v1 (hybrid: a v2 unified line too, without the cpu controller)
        proc.write_text(f"12:pids:/\n3:cpu,cpuacct:{own}\n1:name=systemd:{own}\n" + ("0::/\n" if hybrid else ""))
    base = root if version == 2 else root / "cpu,cpuacct"
    for path, (quota, period) in levels.items():
        d = base / path.strip("/") if path.strip("/") else base
        d.mkdir(parents=True, exist_ok=True)
        if version == 2:
            (d / "cpu.max").write_text(f"{quota} {period}\n")
        else:
            (d / "cpu.cfs_quota_us").write_text(f"{quota}\n")
            (d / "cpu.cfs_period_us").write_text(f"{period}\n")
    return str(proc), str(root)


@pytest.mark.parametrize("version, levels, cpus", [
    (2, {"/": ("max", 100000), "/kubepods/pod1": (800000, 100000)}, 8),  # Kubernetes' limits.cpu: 8 (docker --cpus 8)
    (2, {"/kubepods/pod1": ("max", 100000)}, None),  # "max": no quota
    (2, {"/kubepods": (1600000, 100000), "/kubepods/pod1": (2400000, 100000)}, 16),  # the smallest level binds
    (2, {"/kubepods/pod1": (150000, 100000)}, 1.5),
    (1, {"/": (-1, 100000), "/docker/abc": (50000, 100000)}, 0.5),  # v1: docker --cpus 0.5
    (1, {"/docker/abc": (-1, 100000)}, None),  # -1: no quota
])
def test_cpu_quota_is_read_from_the_cgroup_walk(tmp_path, version, levels, cpus):
    own = "/kubepods/pod1/ctr" if version == 2 else "/docker/abc"
    proc, root = cpu_tree(tmp_path, own, levels, version)
    got = host.cpu_quota(proc, root)
    assert (got and got["cpus"]) == cpus, got
    if version == 1:  # beside a unified v2 line (a hybrid host): v1's cpu controller decides
        proc, root = cpu_tree(tmp_path / "hybrid", own, levels, 1, hybrid=True)
        assert host.cpu_quota(proc, root) == got


def test_a_container_without_its_own_cgroup_namespace_finds_its_quota_at_the_root(tmp_path):
    proc, root = cpu_tree(tmp_path, "/docker/0123abcd", {"/": (400000, 100000)}, 1)  # a path the mount lacks
    assert host.cpu_quota(proc, root) == {"cpus": 4.0, "cgroup": "/", "version": 1}
    assert host.cpu_quota(str(tmp_path / "no_such_file"), root) is None


@pytest.mark.parametrize("levels, usable", [
    ({"/": (800000, 100000)}, list(range(8))),
    ({"/": (50000, 100000)}, [0]),  # half a CPU: one (an audit measured [0, 1] on a real v1 quota of 0.5)
    ({"/": (250000, 100000)}, [0, 1, 2]),  # rounded up
    ({"/": ("max", 100000)}, list(range(128))),
])
def test_usable_cpus_are_capped_at_the_quota(tmp_path, monkeypatch, levels, usable):
    """A pod limited to 8 CPUs on a 128-core node: 8 usable, not its affinity's 128 (launch.sh gave 8 ranks 16 threads
    each, the CPU check reported 16 a rank, prepare_data.py started 32 workers)."""
    proc, root = cpu_tree(tmp_path, "/", levels)
    monkeypatch.setattr(host, "PROC_CGROUP", proc)
    monkeypatch.setattr(host, "CGROUP_ROOT", root)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(128)), raising=False)
    assert host.usable_cpus() == usable
    # every rank of the pod lists the same CPUs, so their node counts the quota once: 8 ranks, 1 thread each
    if len(usable) == 8:
        readings = [("n0", host.usable_cpus())] * 8
        assert threads_per_rank(readings, "n0", usable) == 1 and "1 per rank" in cpu_placement(readings, False)[1]


@pytest.mark.parametrize("readings, gpu, verdict, words", [
    # slurm.sbatch's step bound to one CPU (no --cpus-per-task): 8 GPU ranks on CPU 0
    ([("n0", [0])] * 8, True, "refuse", "8 ranks on node n0 may run on 1 CPU(s) (0): fewer cores than ranks"),
    ([("n0", [0])] * 2, False, "warn", "fewer cores than ranks"),  # the CPU accelerator: slow, allowed
    ([("n0", list(range(16)))] * 8, True, "warn", f"2 per rank, CPU Adam (ZeRO optimizer offload) wants {ADAM_THREADS}"),
    ([("n0", [0, 1])] * 2, False, "ok", "1 per rank"),  # the CPU accelerator: the ranks are the compute
    # each rank bound to its own 12 cores (numactl -C): the node's cores are their union
    ([("n0", list(range(12 * r, 12 * r + 12))) for r in range(8)], True, "ok", "may run on 96 CPU(s) (0-95): 12 per"),
    # the worst node decides: n1's ranks share 2 cores
    ([("n0", list(range(96)))] * 8 + [("n1", [0, 1])] * 8, True, "refuse", "node n1 may run on 2 CPU(s) (0-1)"),
])
def test_cpu_placement_verdict(readings, gpu, verdict, words):
    got, line = cpu_placement(readings, gpu)
    assert got == verdict and words in line, line
    if verdict != "ok":
        assert "srun --cpus-per-task" in line and "\n" not in line


def test_cpu_ranges():
    assert cpu_ranges([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8" and cpu_ranges([3]) == "3" and cpu_ranges([]) == ""


def test_threads_per_rank_is_the_share_of_the_nodes_cores():
    node = [("n0", list(range(128)))] * 8 + [("n1", list(range(64)))] * 8
    assert threads_per_rank(node, "n0", list(range(128))) == 16 and threads_per_rank(node, "n1", list(range(64))) == 8
    bound = [("n0", list(range(4 * r, 4 * r + 4))) for r in range(8)]
    assert threads_per_rank(bound, "n0", [0, 1, 2, 3]) == 4  # within its own CPUs
    assert threads_per_rank([("n0", [0])] * 8, "n0", [0]) == 1  # at least one


TORCHRUN_RANK = {"TORCHELASTIC_RUN_ID": "none", "LOCAL_WORLD_SIZE": "8", "OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize("env, launcher_env, defaulted", [
    (TORCHRUN_RANK, {"PATH": "/usr/bin"}, True),  # torchrun set it: its own environment had none
    ({**TORCHRUN_RANK, "TORCHELASTIC_RUN_ID": ""}, {}, False),  # not torchrun's
    ({"ACCELERATE_MIXED_PRECISION": "no", "OMP_NUM_THREADS": "1"}, {}, True),  # accelerate's simple launcher
    (TORCHRUN_RANK, {"OMP_NUM_THREADS": "1"}, False),  # exported by the user (or launch.sh --torchrun): kept
    (TORCHRUN_RANK, None, False),  # the agent's environment unreadable: kept
    ({**TORCHRUN_RANK, "OMP_NUM_THREADS": "4"}, {}, False),  # not the default
])
def test_torchruns_default_of_one_thread_is_no_choice(env, launcher_env, defaulted):
    assert host.threads_defaulted(env, launcher_env) is defaulted


def test_a_rank_under_torchrun_takes_its_share_of_the_cores(monkeypatch):
    """torchrun starting 2+ workers sets OMP_NUM_THREADS=1 where it is unset (torch/distributed/run.py): CPU Adam under
    ZeRO offload then ran one thread per rank, silently (base/host.py kept any launcher's value). Now the rank takes
    its share as under a plain deepspeed: 4 CPUs, one rank here."""
    import torch

    monkeypatch.setattr(host, "usable_cpus", lambda: [0, 1, 2, 3])
    monkeypatch.setattr(host, "environ_of", lambda pid: {"PATH": "/usr/bin"})  # the agent's: no OMP_NUM_THREADS
    for k, v in TORCHRUN_RANK.items():
        monkeypatch.setenv(k, v)
    before = torch.get_num_threads()
    try:
        host.check_cpu_placement(gpu=False)
        assert os.environ["OMP_NUM_THREADS"] == "4" and torch.get_num_threads() == 4
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        monkeypatch.setattr(host, "environ_of", lambda pid: {"OMP_NUM_THREADS": "1"})  # the user's own 1
        host.check_cpu_placement(gpu=False)
        assert os.environ["OMP_NUM_THREADS"] == "1"
    finally:
        torch.set_num_threads(before)


def test_the_launchers_environment_is_what_it_started_with(tmp_path):
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "environ").write_bytes(b"PATH=/usr/bin\0A=b=c\0EMPTY=\0")
    assert host.environ_of(7, str(tmp_path)) == {"PATH": "/usr/bin", "A": "b=c", "EMPTY": ""}
    assert host.environ_of(8, str(tmp_path)) is None
    assert "PATH" in host.environ_of(os.getpid())  # this process' own, as it started


BATCH = {"SLURM_JOB_ID": "77", "SLURM_JOB_NUM_NODES": "4", "SLURM_NNODES": "4", "SLURM_STEP_ID": "4294967291"}


@pytest.mark.parametrize("hosts, env, idle", [
    (["n0"] * 8, BATCH, True),  # torchrun / deepspeed --num_gpus 8 in the batch shell: 3 nodes idle
    (["n0"], {**BATCH, "SLURM_JOB_NUM_NODES": "2"}, True),  # python train.py there
    ([f"n{i // 8}" for i in range(32)], BATCH, False),  # every node (pdsh from the batch shell, or slurm.sbatch)
    (["n0"] * 8, {**BATCH, "SLURM_STEP_NUM_NODES": "1"}, False),  # srun -N1 ...: the step's nodes are chosen
    (["n0"] * 8, {**BATCH, "SLURM_STEP_NUM_TASKS": "8"}, False),  # srun python train.py (srun sets all three)
    (["n0"] * 8, {**BATCH, "SLURM_JOB_NUM_NODES": "1"}, False),  # a one-node job
    (["n0"] * 8, {"SLURM_JOB_NUM_NODES": "4"}, False),  # no job
])
def test_an_allocations_idle_nodes_are_said(hosts, env, idle):
    """A SLURM allocation of N nodes launched without srun trained on one node, silently, the others paid for."""
    line = host.idle_nodes_line(hosts, env)
    assert (line is not None) is idle, line
    if idle:
        assert line.startswith("warning: SLURM job 77 holds") and "srun" in line and "scripts/slurm.sbatch" in line
        assert "\n" not in line


def test_rank_0_says_it_where_the_job_agrees_the_node_size(monkeypatch):
    from base import log

    said = []
    monkeypatch.setattr(log, "print0", said.append)
    for k, v in BATCH.items():
        monkeypatch.setenv(k, v)
    for k in ("SLURM_STEP_NUM_NODES", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NODELIST"):
        monkeypatch.delenv(k, raising=False)
    host.agree_ranks_per_node()  # one process: its own host only
    assert len(said) == 1 and said[0].startswith("warning: SLURM job 77 holds 4 nodes but its ranks run on 1 ("), said


def test_a_cpu_quota_short_of_the_ranks_is_a_warning_a_short_affinity_a_refusal(monkeypatch):
    """The review: `docker run --gpus 2 --cpus 1`: the quota caps the CPUs counted to 1 for 2 GPU ranks, and the run
    was refused as "may run on 1 CPU(s)... srun --cpus-per-task" (it ran before the quota was read): a quota is time,
    the ranks may run on every core. A warning naming the quota; an affinity of fewer CPUs than ranks stays refused."""
    from base import comm

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(host, "usable_cpus", lambda: [0])
    monkeypatch.setattr(host, "cpu_quota", lambda: None)
    monkeypatch.setattr(comm, "all_gather_object", lambda o: [("n1", [0], list(range(8)))] * 2)
    line = host.check_cpu_placement(gpu=True)
    assert line.startswith("warning: cpus: 2 ranks on node n1") and "a CPU quota of fewer CPUs than ranks" in line
    monkeypatch.setattr(comm, "all_gather_object", lambda o: [("n1", [0], [0])] * 2)
    with pytest.raises(ValueError, match="fewer cores than ranks"):
        host.check_cpu_placement(gpu=True)
