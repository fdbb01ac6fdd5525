"""Start-up checks (training/preflight.py), one line each, before any heavy work: the gloo interface of this host,
a stale torch-extensions build lock (a fresh one is a warning), host memory per node (MemAvailable, and the job's cgroup limit) and the
memlock limit against the plan, every stage's DeepSpeed config (also in --dry_run). Unit tests of each reading and
decision with the machine faked (/proc/meminfo, a /proc/self/cgroup + /sys/fs/cgroup tree, RLIMIT_MEMLOCK,
/sys/class/net, a lock file); a 2-rank world where only rank 1 sees the
trouble (every rank must stop with the same line); train.py's exit 2 with one line."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import threading
import time
import types

import pytest

from planner.memory_model import ModelShape
from tests.distributed import ROOT, run
from training import job, preflight
from training.config import parse_config
from training.curriculum import resolve_stages

GiB = 2**30


# --- network: this host's gloo interface, before the process group ---

def test_interface_missing_on_this_host_names_host_and_interface(tmp_path, monkeypatch, capsys):
    for name in ("lo", "eth0"):
        (tmp_path / name).mkdir()
    monkeypatch.setattr(preflight, "NET_DIR", str(tmp_path))
    monkeypatch.setattr(preflight.socket, "gethostname", lambda: "gpu-node-3")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "ib0")
    with pytest.raises(ValueError) as e:
        preflight.check_network()
    msg = str(e.value)
    assert "\n" not in msg and "GLOO_SOCKET_IFNAME=ib0: host gpu-node-3 has no interface ib0" in msg
    assert "(it has eth0, lo)" in msg
    # the bad host's local rank 0 prints the line (run_job, below), not only global rank 0
    # (the abort channel answers with the report on record: rank 8's, posted first)
    from base import comm

    monkeypatch.setattr(comm, "abort", lambda reason, code=1: f"rank 8 stopped on an input error: {msg}")
    for rank, local, printed in (("8", "0", True), ("9", "1", False), ("0", "0", True), ("8", "1", True)):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("LOCAL_RANK", local)
        assert job.run_job(preflight.check_network) == job.EXIT_USAGE
        assert capsys.readouterr().err == (f"error: {msg}\n" if printed else ""), (rank, local)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")
    preflight.check_network()  # present: fine
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0,ib1")  # gloo's list form: every name must exist
    with pytest.raises(ValueError, match="no interface ib1"):
        preflight.check_network()


@pytest.mark.parametrize("env, host_addr, expect", [
    ({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "MASTER_ADDR": "10.0.0.1"}, "127.0.1.1", True),  # torchrun, 2 nodes
    ({"WORLD_SIZE": "16", "CROSS_SIZE": "2", "MASTER_ADDR": "10.0.0.1"}, "127.0.1.1", True),  # deepspeed launcher
    ({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "MASTER_ADDR": "10.0.0.1"}, "10.0.0.7", False),  # routable name
    ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8", "MASTER_ADDR": "10.0.0.1"}, "127.0.1.1", False),  # one node
    ({"WORLD_SIZE": "4", "CROSS_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}, "127.0.1.1", False),  # "nodes" on one box
], ids=["torchrun-2-nodes", "deepspeed-2-nodes", "routable", "single-node", "all-local"])
def test_multi_node_without_interface_on_a_loopback_hostname(monkeypatch, env, host_addr, expect):
    for k in ("GLOO_SOCKET_IFNAME", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "CROSS_SIZE"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(preflight.socket, "gethostname", lambda: "gpu-node-3")
    monkeypatch.setattr(preflight.socket, "gethostbyname", lambda host: host_addr)
    if expect:
        with pytest.raises(ValueError, match=r"host gpu-node-3 resolves its own name to 127\.0\.1\.1 \(loopback\) and "
                                             "GLOO_SOCKET_IFNAME is unset"):
            preflight.check_network()
    else:
        preflight.check_network()


# --- what a rank reads of its host ---

def test_mem_available_from_meminfo(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       32000000 kB\nMemFree:         1000000 kB\nMemAvailable:   20971520 kB\n")
    monkeypatch.setattr(preflight, "MEMINFO", str(meminfo))
    assert preflight.mem_available_bytes() == 20 * GiB
    meminfo.write_text("MemTotal:       32000000 kB\n")  # an old kernel: no MemAvailable line
    assert preflight.mem_available_bytes() is None
    assert preflight.mem_available_bytes(str(tmp_path / "missing")) is None


def test_memlock_limit(monkeypatch):
    monkeypatch.setattr(preflight.resource, "getrlimit", lambda which: (65536, resource.RLIM_INFINITY))
    assert preflight.memlock_limit() == 65536
    monkeypatch.setattr(preflight.resource, "getrlimit", lambda which: (resource.RLIM_INFINITY,) * 2)
    assert preflight.memlock_limit() is None


def test_stale_build_lock_is_found_and_named(tmp_path):
    (tmp_path / "cpu_adam").mkdir()
    (tmp_path / "cpu_adam" / "cpu_adam.so").write_text("")
    assert preflight.build_locks(str(tmp_path)) == []
    lock = tmp_path / "cpu_adam" / "lock"
    lock.write_text("")
    os.utime(lock, (1, os.path.getmtime(lock) - 7200))  # killed mid-build two hours ago
    (tmp_path / "py311_cu124" / "fused_adam").mkdir(parents=True)  # torch's default layout, one level deeper
    (tmp_path / "py311_cu124" / "fused_adam" / "lock").write_text("")
    found = preflight.build_locks(str(tmp_path))
    assert [p for p, _ in found] == [str(lock), str(tmp_path / "py311_cu124" / "fused_adam" / "lock")]
    assert 7100 < found[0][1] < 7400
    msg = preflight.lock_problem([{"host": "a", "locks": []}, {"host": "b", "locks": found}])
    assert msg.startswith(f"stale torch-extensions build lock {lock} on b (120 min old, ") and "\n" not in msg
    assert f"rm {lock}" in msg and "scripts/setup.sh" in msg
    assert preflight.lock_problem([{"host": "a", "locks": []}]) is None


def test_a_fresh_build_lock_is_a_build_in_progress_not_stale(tmp_path):
    """A lock a minute old is another job compiling that op right now (the audit saw cc1plus running): the run goes
    on with a warning line (torch waits for that build); only one older than STALE_LOCK_S stops it."""
    lock = tmp_path / "cpu_adam" / "lock"
    lock.parent.mkdir()
    lock.write_text("")
    os.utime(lock, (1, os.path.getmtime(lock) - 60))
    fresh = [{"host": "b", "locks": preflight.build_locks(str(tmp_path))}]
    assert preflight.lock_problem(fresh) is None
    warn = preflight.lock_warning(fresh)
    assert warn.startswith(f"warning: torch-extensions build lock {lock} on b (1 min old): another process is building")
    assert "rm " not in warn and "\n" not in warn
    os.utime(lock, (1, os.path.getmtime(lock) - preflight.STALE_LOCK_S))  # now past the bound: a killed build
    old = [{"host": "b", "locks": preflight.build_locks(str(tmp_path))}]
    assert preflight.lock_problem(old).startswith(f"stale torch-extensions build lock {lock} on b (31 min old")
    assert preflight.lock_warning(old) is None


# --- host memory per node against the plan ---

def reports(*hosts: tuple[str, int | None, int | None]) -> list[dict]:
    """One report per rank: (host, MemAvailable bytes, memlock bytes or None = unlimited)."""
    return [{"host": h, "mem_available": m, "memlock": lock, "locks": []} for h, m, lock in hosts]


NEED = {"bytes": 10 * GiB, "pinned": 9 * GiB, "stage": "stage 2 (s512k)", "what": "offloaded optimizer"}


def test_host_memory_counts_the_ranks_of_each_node():
    ok = reports(("a", 50 * GiB, None), ("a", 50 * GiB, None), ("b", 50 * GiB, None), ("b", 50 * GiB, None))
    assert preflight.host_memory_problem(ok, NEED) is None
    # node b: 4 ranks x 10 GiB > 35 GiB (the smallest of its ranks' readings counts)
    tight = reports(("a", 50 * GiB, None), ("b", 36 * GiB, None), ("b", 35 * GiB, None), ("b", 36 * GiB, None),
                    ("b", 36 * GiB, None))
    msg = preflight.host_memory_problem(tight, NEED)
    assert msg.startswith("host memory: b has 35.0 GiB available (MemAvailable) but its 4 rank(s) will hold 40.0 GiB")
    assert "stage 2 (s512k): offloaded optimizer, 10.00 GiB per rank" in msg and "\n" not in msg
    assert preflight.host_memory_problem(tight, None) is None  # no plan: nothing to compare
    assert preflight.host_memory_problem(reports(("a", None, None)), NEED) is None  # no MemAvailable line


def cgroup_v2(tmp_path, limit: int, used: int, high: int | None = None) -> tuple[str, str]:
    """A fake /proc/self/cgroup and /sys/fs/cgroup (v2): this process in Slurm's task cgroup, the job's cgroup
    (sbatch --mem) holding `limit` with `used` in use (and memory.high `high`, where given). (The v1, nested and
    container layouts: tests/unit/base/test_host.py.)"""
    own, job = "/system.slice/slurmstepd.scope/job_7/step_0/user/task_0", "/system.slice/slurmstepd.scope/job_7"
    (tmp_path / "proc").mkdir(parents=True, exist_ok=True)
    (tmp_path / "proc" / "cgroup").write_text(f"0::{own}\n")
    for path, lim in ((job, str(limit)), (own, "max")):
        d = tmp_path / "cgroup" / path.strip("/")
        d.mkdir(parents=True, exist_ok=True)
        (d / "memory.max").write_text(lim + "\n")
        (d / "memory.current").write_text(f"{used}\n")
        if high is not None and path == job:
            (d / "memory.high").write_text(f"{high}\n")
    return str(tmp_path / "proc" / "cgroup"), str(tmp_path / "cgroup")


def test_host_memory_reads_the_jobs_cgroup_limit(tmp_path, monkeypatch):
    """sbatch --mem=16G on a node with 200 GiB MemAvailable: the report says what the job may still use (16 - 12 =
    4 GiB), and the start-up check refuses 4 ranks x 10 GiB in one line naming the cgroup's limit and the fix (it
    passed on MemAvailable alone, and the cgroup OOM-killed the ranks, after every requeue again)."""
    from base import host

    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: 263000000 kB\nMemAvailable: {200 * 2**20} kB\n")
    monkeypatch.setattr(preflight, "MEMINFO", str(meminfo))
    proc, root = cgroup_v2(tmp_path, 16 * GiB, 12 * GiB)
    monkeypatch.setattr(host, "PROC_CGROUP", proc)
    monkeypatch.setattr(host, "CGROUP_ROOT", root)
    mine = preflight.report()
    assert (mine["mem_available"], mine["mem_node"]) == (4 * GiB, 200 * GiB) and mine["rss"] > 0  # this process' RSS
    assert mine["mem_limit"]["limit"] == 16 * GiB and mine["mem_limit"]["cgroup"] == "/system.slice/slurmstepd.scope/job_7"
    node = [{**mine, "host": "gpu-7"}] * 4
    msg = preflight.host_memory_problem(node, NEED)
    assert msg.startswith("host memory: gpu-7 has 4.0 GiB available to the job (cgroup /system.slice/slurmstepd.scope/"
                          "job_7 memory limit 16.0 GiB (memory.max), 12.0 GiB in use; the node's MemAvailable 200.0 GiB "
                          "is not the job's) but its 4 rank(s) will hold 40.0 GiB in host memory"), msg
    assert "raise the job's memory limit (sbatch --mem=" in msg and "\n" not in msg
    on, why = preflight.auto_async(node[:1], NEED, cpu_run=False)  # 1 rank x 10 GiB > 4 GiB: no snapshot either
    assert not on and "available to the job (cgroup" in why and "\n" not in why
    (tmp_path / "cgroup" / "system.slice/slurmstepd.scope/job_7" / "memory.max").write_text("max\n")  # --mem=0
    free = preflight.report()
    assert free["mem_available"] == 200 * GiB and free["mem_limit"] is None
    assert preflight.host_memory_problem([{**free, "host": "gpu-7"}] * 4, NEED) is None


def test_host_memory_names_the_cgroups_memory_high(tmp_path, monkeypatch):
    """Slurm under cgroup v2 with AllowedRAMSpace=150: sbatch --mem=32G is memory.high (32 GiB), memory.max 48 GiB.
    The job has 32 - 12 = 20 GiB before the kernel throttles it into reclaim, not 36: 3 ranks x 10 GiB are refused,
    the line naming memory.high (the check passed on memory.max and every step stalled in reclaim)."""
    from base import host

    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemAvailable: {200 * 2**20} kB\n")
    monkeypatch.setattr(preflight, "MEMINFO", str(meminfo))
    proc, root = cgroup_v2(tmp_path, 48 * GiB, 12 * GiB, high=32 * GiB)
    monkeypatch.setattr(host, "PROC_CGROUP", proc)
    monkeypatch.setattr(host, "CGROUP_ROOT", root)
    mine = preflight.report()
    assert mine["mem_available"] == 20 * GiB and mine["mem_limit"]["file"] == "memory.high"
    msg = preflight.host_memory_problem([{**mine, "host": "gpu-7"}] * 3, NEED)
    assert msg.startswith("host memory: gpu-7 has 20.0 GiB available to the job (cgroup /system.slice/slurmstepd.scope/"
                          "job_7 memory limit 32.0 GiB (memory.high: above it the kernel throttles the job into "
                          "reclaim; Slurm writes --mem there), 12.0 GiB in use"), msg
    assert "sbatch --mem=" in msg and "\n" not in msg


def test_host_memory_counts_the_process_runtime_as_plan_py_does():
    """plan.py --model llama3-8b --seq_len 1M --gpus_per_node 8 --nodes 4 --cpu_mem_gb 64: 69.88 GiB per node, NO
    (its host terms and 1.98 GiB of measured process runtime per rank, planner/cluster.RUNTIME_HOST_GIB). The start-up
    check on a 64 GiB cgroup with 6 GiB in use counted the host terms alone (54.0 GiB <= 58) and let it start. It
    counts the runtime too, less what each rank holds already (its RSS is in the cgroup's usage): 8 x 0.26 GiB less
    than plan.py's figure, refused in one line saying what it counted; with no RSS yet, exactly plan.py's figure."""
    import importlib.util

    from planner.cluster import RUNTIME_HOST_GIB

    spec = importlib.util.spec_from_file_location("plan", os.path.join(ROOT, "scripts", "plan.py"))
    plan = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plan)
    est = plan.plan(["--model", "llama3-8b", "--seq_len", "1M", "--gpus_per_node", "8", "--nodes", "4",
                     "--gpu_mem_gb", "80", "--cpu_mem_gb", "64", "--sp", "32"])["plans"][0]["candidates"][-1]["estimate"]
    runtime = est["cpu_per_rank"].pop("process runtime (measured)")
    assert runtime == int(RUNTIME_HOST_GIB * GiB) and est["cpu_per_node"] / GiB == pytest.approx(69.88, abs=0.01)
    need = {**NEED, "bytes": sum(est["cpu_per_rank"].values()), "runtime": runtime}
    lim = {"limit": 64 * GiB, "used": 6 * GiB, "headroom": 58 * GiB, "cgroup": "/job_7", "file": "memory.max"}
    node = [{"host": "gpu-0", "mem_available": 58 * GiB, "mem_node": 900 * GiB, "mem_limit": lim, "locks": [],
             "rss": int(0.26 * GiB)}] * 8
    msg = preflight.host_memory_problem(node, need)
    assert msg and msg.startswith("host memory: gpu-0 has 58.0 GiB available to the job (cgroup /job_7 memory limit "
                                  "64.0 GiB (memory.max), 6.0 GiB in use"), msg
    total = (est["cpu_per_node"] - 8 * int(0.26 * GiB)) / GiB
    assert f"will hold {total:.1f} GiB in host memory" in msg and f"{total:.1f}" == "67.8"
    assert "; and 13.8 GiB of process runtime its ranks do not hold yet: 1.98 GiB per rank as plan.py counts it" in msg
    assert "\n" not in msg
    fresh = preflight.host_memory_problem([{**r, "rss": 0} for r in node], need)
    assert f"will hold {est['cpu_per_node'] / GiB:.1f} GiB" in fresh  # plan.py's per-node figure
    big = [{**r, "rss": 3 * GiB, "mem_available": 55 * GiB} for r in node]  # a rank past the runtime adds nothing
    assert preflight.runtime_to_come(big[0], need) == 0 and preflight.host_memory_problem(big, need) is None
    assert preflight.runtime_to_come(node[0], NEED) == 0  # a CPU run's need counts none (host_need: runtime 0)


def test_memlock_below_pinned_bytes_is_one_warning_line():
    low = reports(("a", 99 * GiB, None), ("b", 99 * GiB, 64 * 1024))
    msg = preflight.memlock_warning(low, NEED)
    assert msg.startswith("warning: memlock: b limits locked memory to 64 KiB per process (ulimit -l) and each rank "
                          "pins 9.00 GiB") and "\n" not in msg
    assert preflight.memlock_warning(reports(("a", 99 * GiB, 16 * GiB)), NEED) is None
    assert preflight.memlock_warning(low, {**NEED, "pinned": 0}) is None  # nothing pinned (CPU run, pin_memory off)


def test_host_need_is_the_planners_offloaded_states():
    """GPU run with optimizer and parameter offload: CPU Adam's fp32 master weights and moments (12 B/param, pageable)
    and ZeRO-3's pinned requests (the bf16 parameters, the fp32 gradients per sub-group and the fp32 accumulation
    buffer: planner.memory_model.zero3_pinned_requests, each block as the caching host allocator rounds it),
    partitioned over the world: what planner.memory_model.estimate says."""
    cfg = parse_config(["--output_dir", "/tmp/unused", "--max_seq_length", "256"])
    stages = resolve_stages(cfg, dp_of_sp=lambda sp: 4)
    from model_utils.build import load_hf_config

    arch = load_hf_config(cfg.model_name_or_path).get_text_config()
    configs = preflight.check_stage_configs(cfg, stages, 4, bf16=True, hidden_size=arch.hidden_size)
    need = preflight.host_need(cfg, stages, 4, True, configs, arch, cpu_run=False)
    n = ModelShape.from_config(arch.to_dict()).num_params()
    from planner.memory_model import pinned_block_bytes, zero3_pinned_requests

    pins = sum(pinned_block_bytes(x) for x in zero3_pinned_requests(ModelShape.from_config(arch.to_dict()), 4, 2,
                                                                    True, True, 4))  # fp32 accumulation buffer
    assert pins > 2 * n // 4 + 4 * n // 4  # the rounding and the accumulation buffer, beyond bytes per parameter
    load = 4 * n // 4  # a checkpoint load's transient fp32 master copy (pageable), beside CPU Adam's own
    assert need["bytes"] == pins + 12 * n // 4 + load
    assert need["pinned"] == need["bytes"] - load  # ds_configs/zero3_offload.json pins both offloads
    assert need["what"].startswith("offloaded params (partition)")
    from planner.cluster import RUNTIME_HOST_GIB

    assert need["runtime"] == int(RUNTIME_HOST_GIB * GiB)  # plan.py's process runtime per rank (a GPU run)
    cpu = preflight.host_need(cfg, stages, 4, True, configs, arch, cpu_run=True)
    assert cpu["bytes"] > need["bytes"] and cpu["pinned"] == 0  # a CPU run holds the whole step in host memory
    assert cpu["runtime"] == 0  # its process is loaded by the check (no CUDA runtime to come)
    cfg.async_save = True  # background saves keep a (pinned) host copy of the rank's checkpoint: 12 B/param / world
    snap = preflight.host_need(cfg, stages, 4, True, configs, arch, cpu_run=False)
    # (given back before a load, the snapshot makes room for the load's transient: the larger of the two is held)
    assert snap["bytes"] == need["bytes"] - load + 12 * n // 4 and snap["pinned"] == snap["bytes"]


def test_gpu_mem_gb_against_the_gpus_the_ranks_report(monkeypatch, capsys):
    """A recipe's gpu_mem_gb 80 on 40 GB GPUs planned for 80 and OOMed after the weights loaded; on 141 GB it kept
    needless features, unsaid. Rank 0 decides from the gathered reports (one faked here)."""
    smallest = [{"host": h, "locks": [], "gpu_bytes": g * GiB} for h, g in (("a", 80), ("b", 40))]
    msg = preflight.gpu_mem_mismatch(smallest, 80)[0]
    assert msg == "--gpu_mem_gb 80: the config plans for 80 GB GPUs, these have 40.0: set gpu_mem_gb 0 (detect) or 40"
    assert preflight.gpu_mem_mismatch([{"gpu_bytes": int(79.6 * GiB)}], 80) == (None, None)  # an "80 GB" H100
    assert preflight.gpu_mem_mismatch([{"gpu_bytes": 140 * GiB}], 80)[1].startswith("note: --gpu_mem_gb 80: the plan")
    assert preflight.gpu_mem_mismatch(smallest, 0) == (None, None)  # detected: nothing to compare
    assert preflight.gpu_mem_mismatch([{"gpu_bytes": None}], 80) == (None, None)  # a rank without a GPU reading
    cfg = parse_config(["--output_dir", "/tmp/unused", "--gpu_mem_gb", "80"])
    cfg.async_save = False
    for name, fake in {"report": lambda: smallest[1], "no_gpu": lambda: False, "check_stage_configs": lambda *a: [],
                       "host_need": lambda *a: None, "check_device_fit": lambda *a: None}.items():
        monkeypatch.setattr(preflight, name, fake)
    dims, arch = types.SimpleNamespace(world=1), types.SimpleNamespace(hidden_size=64)
    with pytest.raises(ValueError, match="these have 40.0: set gpu_mem_gb 0"):
        preflight.preflight(cfg, [], dims, arch, True)
    monkeypatch.setattr(preflight, "report", lambda: {**smallest[1], "gpu_bytes": 140 * GiB})
    preflight.preflight(cfg, [], dims, arch, True)
    assert "these have 140.0: gpu_mem_gb 0 (detect) may turn off" in capsys.readouterr().out


# --- every stage's DeepSpeed config at start ---

def test_bad_stage_override_fails_at_start_naming_the_stage(tmp_path):
    cfg = parse_config(["--output_dir", str(tmp_path), "--sequence_parallel_size", "1"])
    cfg.max_steps = 2
    from training.config import StageConfig

    cfg.stages = [StageConfig(name="short", max_seq_length=128, max_steps=1),
                  StageConfig(name="long", max_seq_length=256, max_steps=1,
                              deepspeed_overrides={"zero_optimization": {"stage3_prefetch_bucket": 10}})]
    stages = resolve_stages(cfg, dp_of_sp=lambda sp: 2)
    with pytest.raises(ValueError) as e:
        preflight.check_stage_configs(cfg, stages, 2, bf16=False, hidden_size=64)
    msg = str(e.value)
    assert msg.startswith("stage 1 (long) with its deepspeed_overrides: ds_configs/zero3_offload.json: DeepSpeed "
                          "rejects the config: DeepSpeedZeroConfig: stage3_prefetch_bucket: Extra inputs are not "
                          "permitted"), msg
    assert "\n" not in msg
    cfg.stages[1].deepspeed_overrides = {"zero_optimization": {"offload_optimizer": {"device": "none"}}}
    assert len(preflight.check_stage_configs(cfg, resolve_stages(cfg, dp_of_sp=lambda sp: 2), 2, False, 64)) == 2


def dry_run(recipe: str, tmp_path) -> subprocess.CompletedProcess:
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=ROOT)
    env.pop("RANK", None)
    return subprocess.run([sys.executable, "train.py", "--config", recipe, "--dry_run", "--nodes", "1",
                           "--gpus_per_node", "2", "--output_dir", str(tmp_path / "out")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


BAD_OVERRIDES = [
    ("{zero_optimization: {offload_optimizer: {device: gpu}}}",
     "DeepSpeedZeroConfig: offload_optimizer.device: Input should be 'none', 'cpu' or 'nvme' (got 'gpu')"),
    ("{zero_optimization: {stage: 2}}", "zero_optimization.stage is 2; this project needs ZeRO-3"),
    ("{optimizer: {type: AdamWW, params: {lr: auto}}}", "optimizer.type 'AdamWW' is neither a DeepSpeed optimizer"),
]
BAD_OVERRIDE_IDS = ["bad-offload-device", "zero-2", "unknown-optimizer"]


@pytest.mark.parametrize("override, match", BAD_OVERRIDES, ids=BAD_OVERRIDE_IDS)
def test_a_bad_stage_override_is_refused_in_one_line(tmp_path, override, match):
    """Every bad override, in this process: the check train.py --dry_run (and every start) makes of each stage's
    DeepSpeed config names the stage and its overrides in one line."""
    import yaml

    from training.config import StageConfig

    cfg = parse_config(["--output_dir", str(tmp_path), "--sequence_parallel_size", "2"])
    cfg.stages = [StageConfig(name="base", max_seq_length=128),
                  StageConfig(name="long", max_seq_length=256, deepspeed_overrides=yaml.safe_load(override))]
    with pytest.raises(ValueError) as e:
        preflight.check_stage_configs(cfg, resolve_stages(cfg, dp_of_sp=lambda sp: 2 // sp), 2, bf16=False,
                                      hidden_size=64)
    assert str(e.value).startswith("stage 1 (long) with its deepspeed_overrides: ") and match in str(e.value)
    assert "\n" not in str(e.value)


# each case is a train.py --dry_run start (~5 s): the path (exit 2, the last line, no traceback) once, the other
# overrides slow (fast sibling: test_a_bad_stage_override_is_refused_in_one_line, every override in this process)
@pytest.mark.parametrize("override, match", [o if i == 1 else pytest.param(*o, marks=pytest.mark.slow)
                                             for i, o in enumerate(BAD_OVERRIDES)], ids=BAD_OVERRIDE_IDS)
def test_dry_run_refuses_a_bad_stage_override_in_one_line(tmp_path, override, match):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("sequence_parallel_size: 2\nstages:\n  - name: base\n    max_seq_length: 128\n"
                      f"  - name: long\n    max_seq_length: 256\n    deepspeed_overrides: {override}\n")
    p = dry_run(str(recipe), tmp_path)
    assert p.returncode == 2, p.stderr[-2000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("error: stage 1 (long) with its deepspeed_overrides: ") and match in last, last
    assert "Traceback" not in p.stderr


# --- one decision for the whole world ---

MODES = ["ok", "lock", "memory", "cgroup", "memlock"]


@pytest.fixture(scope="module")
def decisions(tmp_path_factory):
    """One 2-rank launch runs every mode in turn: {mode: ([rank 0's error, rank 1's], rank 0's output for it)}."""
    d = tmp_path_factory.mktemp("preflight")
    cgroup_v2(d / "fake", 2**20, 2**19)  # rank 1's job: a 1 MiB cgroup limit, half of it in use (mode "cgroup")
    run(os.path.join(ROOT, "tests/workers/preflight.py"), [str(d), ",".join(MODES)], 2, str(d / "l"), timeout=300)
    out = (d / "l" / "rank0.log").read_text().split("=== mode ")[1:]
    logs = {part.split("\n", 1)[0].strip(): part for part in out}
    return {m: ([json.loads((d / f"result{r}_{m}.json").read_text())["error"] for r in range(2)], logs[m])
            for m in MODES}


@pytest.mark.parametrize("mode", MODES)
def test_every_rank_takes_rank_0s_decision(decisions, mode):
    """Only rank 1 (host node1) sees the trouble; both ranks stop with the same line (or both go on)."""
    results, rank0 = decisions[mode]
    assert results[0] == results[1], results
    expect = {"ok": None, "memlock": None, "lock": "stale torch-extensions build lock /ext/cpu_adam/lock on node1",
              "memory": "host memory: node1 has 0.0 GiB available (MemAvailable) but its 1 rank(s) will hold",
              "cgroup": "host memory: node1 has 0.0 GiB available to the job (cgroup /system.slice/slurmstepd.scope/"
                        "job_7 memory limit 0.0 GiB (memory.max), 0.0 GiB in use"}[mode]
    if expect is None:
        assert results[0] is None
    else:
        assert results[0].startswith(expect), results[0]
    assert ("warning: memlock: node1 limits locked memory to 64 KiB" in rank0) == (mode == "memlock"), rank0[-2000:]


def test_train_stops_on_a_stale_lock_in_one_line(tmp_path):
    """train.py itself: a lock in its TORCH_EXTENSIONS_DIR stops it with exit 2 and one line, before any data."""
    from base.env import EXTENSIONS_DIR

    ext = tmp_path / "ext"
    (ext / "cpu_adam").mkdir(parents=True)
    (ext / "cpu_adam" / "lock").write_text("")
    os.utime(ext / "cpu_adam" / "lock", (1, os.path.getmtime(ext / "cpu_adam" / "lock") - 7200))  # a killed build
    # the other ops this checkout built already (a fresh folder would JIT-build the shm comm op first: ~50 s)
    built = os.environ.get("TORCH_EXTENSIONS_DIR", EXTENSIONS_DIR)  # where this checkout's runs load them from
    if os.path.isdir(built):
        for op in os.listdir(built):
            if op != "cpu_adam":
                (ext / op).symlink_to(os.path.join(built, op))
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=ROOT, TORCH_EXTENSIONS_DIR=str(ext))
    env.pop("RANK", None)
    p = subprocess.run([sys.executable, "train.py", "--output_dir", str(tmp_path / "out"), "--report_to", "none"],
                       cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 2, p.stderr[-2000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: stale torch-extensions build lock {ext}/cpu_adam/lock on "), last
    assert "Traceback" not in p.stderr


def test_the_wait_for_a_young_lock_ends_when_it_turns_stale(tmp_path, monkeypatch):
    """A build killed by a preemption and requeued within 30 min: the young lock is a warning, and torch's wait for it
    looped while it existed: the job hung to its time limit (the third review). The wait now ends with one line once
    the lock is older than the bound; a lock released meanwhile ends it quietly."""
    from torch.utils.file_baton import FileBaton

    from training import preflight

    monkeypatch.setattr(FileBaton, "wait", FileBaton.wait)  # restored after the test
    preflight.bound_build_waits(stale_s=60)
    lock = tmp_path / "lock"
    lock.write_text("")
    old = time.time() - 120
    os.utime(lock, (old, old))
    with pytest.raises(RuntimeError, match=r"build lock .*lock is 2 min old: the build holding it is gone"):
        FileBaton(str(lock), wait_seconds=0.01).wait()
    os.utime(lock, None)  # young: waited for until released
    threading.Timer(0.1, lock.unlink).start()
    FileBaton(str(lock), wait_seconds=0.01).wait()
    assert not lock.exists()
