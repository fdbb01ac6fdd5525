"""Readings of this host: the process' own peak memory, the host memory the job may still use (the node's
MemAvailable and the job's cgroup/container memory limit), the ranks that share this node under whichever launcher
started them and the node size the whole job agreed, the CPUs this process may use (its affinity within its cgroup's
CPU quota) and whether the ranks of each node have the cores they need; the launcher above this process (its command
line, parent and environment, from /proc). Torch-free at import (the planner uses it); `agree_ranks_per_node` and
`check_cpu_placement` gather through base.comm when they run. ULYSSES_CGROUP_ROOT: a tree standing in for
/sys/fs/cgroup (a test's: tests/e2e/test_launch_scripts.py gives scripts/launch.sh a CPU quota)"""

from __future__ import annotations

import math
import os
import re
import resource
import socket
import sys
from collections.abc import Mapping

# Cores per rank below which start-up warns. ZeRO-3 with the optimizer offloaded runs DeepSpeed's CPU Adam on
# every rank at once; its OpenMP loop over the rank's fp32 partition (Llama-3-8B on 32 ranks: 250M parameters,
# ~28 bytes each read or written per step, ~7 GB) is memory-bound, and a node's memory bandwidth is shared by its
# ranks: 4 threads per rank reach a node's bandwidth on common 8-GPU nodes (96-128 cores), fewer leave the step
# waiting on Adam. Below one core per rank the ranks share cores: on a GPU node that is never what was meant
# (the whole node's Python, kernel launches and Adam on a handful of cores): refused.
ADAM_THREADS = 4


def peak_rss_bytes() -> int:
    """This process' own peak resident set size. /proc/self/status VmHWM, not getrusage's ru_maxrss: Linux
    carries the parent's high-water mark into ru_maxrss across fork + exec, so a rank started from a process
    that once held 1.5 GiB reads 1.5 GiB before it allocates anything (and auto's CPU budget went negative)."""
    peak = _status_bytes("VmHWM")
    if peak is None:  # no procfs (not Linux): ru_maxrss, bytes on macOS
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024
    return peak


def rss_bytes() -> int:
    """This process' resident set size now (/proc/self/status VmRSS; 0 where there is no procfs)."""
    return _status_bytes("VmRSS") or 0


def _status_bytes(field: str) -> int | None:
    """A kB field of /proc/self/status in bytes; None without procfs."""
    try:
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1]) * 1024 for line in fh if line.startswith(field + ":"))
    except (OSError, StopIteration):
        return None


def _node_count(value: str, node: str | None) -> int:
    """SLURM's per-node list ("8(x4)", "8,4(x2)" or "8": node i's count is the i-th once expanded) at this node
    (SLURM_NODEID); 0 when the list or the index does not parse. Uneven nodes (8,4,4) each report their own size, so
    the job's agreement (node_size_agreement: their gcd) sees them (every rank read the first node's 8 before)."""
    counts = []
    for item in (value or "").split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if not m:
            return 0
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    node = node or "0"  # no SLURM_NODEID: the first node's
    i = int(node) if node.isdigit() else -1
    return counts[i] if 0 <= i < len(counts) else 0


def ranks_per_node(env: Mapping[str, str] | None = None) -> int:
    """How many ranks share this node, as the launcher that started them says; 0 when no launcher says.

    torchrun: LOCAL_WORLD_SIZE. The deepspeed launcher (one node, pdsh, --no_ssh, hence launch.sh and
    slurm.sbatch): LOCAL_SIZE (it does not set LOCAL_WORLD_SIZE). Open MPI: OMPI_COMM_WORLD_LOCAL_SIZE. srun
    starting the ranks itself (one task per rank, the step's tasks are the world): SLURM_STEP_TASKS_PER_NODE
    (SLURM_NTASKS_PER_NODE). Not SLURM's numbers when a launcher runs under srun: slurm.sbatch's step is one
    launcher task per node, whose SLURM_NTASKS_PER_NODE=1 every rank inherits; nor SLURM_GPUS_ON_NODE, which
    counts GPUs, not ranks."""
    env = os.environ if env is None else env
    for key in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        if env.get(key):
            return int(env[key])
    step_tasks = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS")
    if step_tasks and env.get("WORLD_SIZE") == step_tasks:  # ranks started (WORLD_SIZE), one per srun task
        return _node_count(env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
                           or env.get("SLURM_NTASKS_PER_NODE", ""), env.get("SLURM_NODEID"))
    return 0


# --- the launcher above this process (/proc: Linux; elsewhere nothing is read) ---

def cmdline(pid: int, proc: str = "/proc") -> list[str]:
    """The command line of process `pid` (/proc/<pid>/cmdline, NUL-separated words); [] where it cannot be read."""
    try:
        with open(os.path.join(proc, str(pid), "cmdline"), "rb") as fh:
            data = fh.read()
    except OSError:
        return []
    return [w.decode(errors="replace") for w in data.removesuffix(b"\0").split(b"\0")] if data else []


def parent_of(pid: int, proc: str = "/proc") -> int | None:
    """The parent pid of `pid` (the 4th field of /proc/<pid>/stat, after the command name in parentheses, which may
    hold any character); None where `pid` is gone or unreadable."""
    try:
        with open(os.path.join(proc, str(pid), "stat")) as fh:
            return int(fh.read().rpartition(")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def environ_of(pid: int, proc: str = "/proc") -> dict[str, str] | None:
    """The environment process `pid` started with (/proc/<pid>/environ: what it was exec'ed with, not what it set
    in os.environ since; readable for one's own processes); None where it cannot be read."""
    try:
        with open(os.path.join(proc, str(pid), "environ"), "rb") as fh:
            words = fh.read().split(b"\0")
    except OSError:
        return None
    return dict(w.decode(errors="replace").partition("=")[::2] for w in words if b"=" in w)


# --- the node size, agreed once for the whole job ---

_JOB_NODE: list = []  # [(ranks per node, the line saying so)] once a multi-rank job agreed it (agree_ranks_per_node)


def node_size_agreement(readings: list[tuple[str, int]]) -> tuple[int, str]:
    """(the job's ranks per node, one line saying what it is and why) from every rank's (host, ranks_per_node()), in
    rank order; the same list on every rank, so the same answer. Pure: tests give it any cluster.

    Uneven nodes (hostfile slots 8/4/4) tell their ranks different sizes: from its own number each rank would
    split SP differently (split_sp at SP 16: Ulysses 8 x cp 2 on the 8-slot node, 4 x 4 on the others), hence
    mismatched collectives or silently wrong attention. The job takes the greatest common divisor of the sizes
    the launchers report: a Ulysses factor dividing it divides every node, and since a launcher gives each node
    consecutive ranks, no Ulysses group (consecutive ranks too) straddles two nodes (the smallest node would not
    do: nodes of 8 and 6 take 2, not 6). Where no launcher says, the ranks' hosts do when there are several (the
    gcd of the runs of consecutive ranks on one host); one host and no launcher: 0 (unknown, no node limit)."""
    runs, last = [], None  # the runs of consecutive ranks on one host
    for host, _ in readings:
        if host == last:
            runs[-1] += 1
        else:
            runs.append(1)
            last = host
    several = len({h for h, _ in readings}) > 1
    known = [n for _, n in readings if n > 0]
    if known and several and math.gcd(*runs) < math.gcd(*known):  # srun -m cyclic (or a hostfile's order): a node's
        size = math.gcd(*runs)  # ranks are not consecutive, every Ulysses group of the launchers' size spanned nodes
        return size, (f"node size: the launchers say {math.gcd(*known)} ranks per node, but a node's ranks are not "
                      f"consecutive (srun -m cyclic?): every rank takes {size}, so no Ulysses group straddles a node; "
                      "srun -m block keeps a node's ranks together")
    if known:
        size = math.gcd(*known)
        hosts: dict[int, list[str]] = {}
        for host, n in readings:
            if n > 0 and host not in hosts.setdefault(n, []):
                hosts[n].append(host)
        if len(hosts) == 1:
            return size, f"node size: {size} ranks per node (every rank's launcher says so)"
        said = ", ".join(f"{n} on {h[0]}" + (f" and {len(h) - 1} more host(s)" if len(h) > 1 else "")
                         for n, h in sorted(hosts.items(), reverse=True))
        return size, (f"node size: the launchers report different node sizes ({said}): every rank takes {size}, their "
                      "greatest common divisor, so no Ulysses group straddles a node; gpus_per_node in the recipe "
                      "overrides it")
    if several:
        size = math.gcd(*runs)
        return size, f"node size: no launcher says; {size} ranks per node from the ranks' hosts (consecutive ranks on one host)"
    return 0, "node size: no launcher says and every rank is on one host: no node limit on the Ulysses groups"


def idle_nodes_line(hosts: list[str], env: Mapping[str, str]) -> str | None:
    """A warning where a SLURM allocation of N nodes trains on fewer hosts (`hosts`: every rank's, gathered): a
    launcher started in the batch (or salloc) shell without srun (torchrun, a plain `deepspeed`, python train.py)
    starts its ranks on the node it runs on, and the other nodes sit idle, paid for, the whole job. Not inside an srun
    step (srun sets SLURM_STEP_NUM_NODES / _NUM_TASKS / _NODELIST, the batch step none: its nodes are the user's
    choice, `srun -N1 ...`); nodes reached over ssh (pdsh) have their own hostnames, so they count. Pure: rank 0
    decides (only its environment has the batch shell's variables)."""
    nodes = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or ""
    used = sorted(set(hosts))
    in_step = any(env.get(k) for k in ("SLURM_STEP_NUM_NODES", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NODELIST"))
    if not env.get("SLURM_JOB_ID") or in_step or not nodes.isdigit() or len(used) >= int(nodes):
        return None
    return (f"warning: SLURM job {env['SLURM_JOB_ID']} holds {nodes} nodes but its ranks run on {len(used)} "
            f"({', '.join(used[:4])}{', ...' if len(used) > 4 else ''}): a launcher started without srun runs on one "
            f"node, the others sit idle; start one per node with srun (scripts/slurm.sbatch does: `sbatch --nodes "
            f"{nodes} scripts/slurm.sbatch ARGS`, docs/launch.md)")


def agree_ranks_per_node() -> tuple[int, str]:
    """Collective, once per job (base.parallel.init_distributed runs it right after the process group, before
    anything is laid out): every rank's (host, ranks_per_node()) gathered, one answer for all (node_size_agreement),
    kept for job_ranks_per_node; rank 0 warns where a SLURM allocation's nodes sit idle (idle_nodes_line). Costs one all_gather_object of a (hostname, int) pair: at 512 ranks ~32 KB
    gathered per rank, milliseconds, once per job."""
    from base import comm

    readings = comm.all_gather_object((socket.gethostname(), ranks_per_node()))
    agreed = node_size_agreement(readings)
    idle = idle_nodes_line([h for h, _ in readings], os.environ) if comm.rank() == 0 else None
    if idle:
        from base.log import print0

        print0(idle)
    if comm.world() > 1:  # a one-rank "job" has nothing to agree: its own reading stays the answer (tests in-process)
        _JOB_NODE[:] = [agreed]
    return agreed


def job_ranks_per_node() -> int:
    """The node size every layout decision takes: the one the job agreed (agree_ranks_per_node), else (no
    multi-rank process group: a dry run, a one-rank run, scripts/plan.py) this process' own ranks_per_node()."""
    return _JOB_NODE[0][0] if _JOB_NODE else ranks_per_node()


def job_node_line() -> str | None:
    """The agreed node size's line (printed once by rank 0 at start-up); None before any agreement."""
    return _JOB_NODE[0][1] if _JOB_NODE else None


# --- host memory: the node's MemAvailable and the job's cgroup limit ---

MEMINFO = "/proc/meminfo"
PROC_CGROUP = "/proc/self/cgroup"  # this process' cgroups (injectable: tests give a fake tree)
CGROUP_ROOT = os.environ.get("ULYSSES_CGROUP_ROOT") or "/sys/fs/cgroup"
UNLIMITED = 2**60  # cgroup v1 writes "no limit" as PAGE_COUNTER_MAX pages (9223372036854771712 bytes)


def meminfo_available(path: str | None = None) -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where the file or the line is missing): the whole node's."""
    try:
        with open(path or MEMINFO) as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _read_int(path: str) -> int | None:
    """A cgroup file's number; None where it is missing, unreadable or "max" (no limit)."""
    try:
        with open(path) as fh:
            text = fh.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _inactive_file(folder: str, key: str) -> int:
    """Page cache the kernel reclaims before it OOM-kills anything (memory.stat's inactive file pages): what
    docker stats and the kubelet leave out of a container's usage. Without it a job that has read its data set
    or a checkpoint looks full."""
    try:
        with open(os.path.join(folder, "memory.stat")) as fh:
            for line in fh:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _cgroup_levels(controller: str, proc_cgroup: str | None, root: str | None) -> tuple[int, list[tuple[str, str]]]:
    """(cgroup version, [(folder, cgroup path)]) of this process' hierarchy for `controller`, from its own cgroup up
    to the mount's root; (0, []) where /proc/self/cgroup is unreadable or names neither version.

    cgroup v2: the `0::<path>` line, folders under <root>. cgroup v1: the line whose controllers include
    `controller`, folders under its mount (<root>/<controllers as listed>, e.g. cpu,cpuacct; else <root>/<controller>,
    the name the mounts link to); v1 wins on a hybrid host. Walked up to the mount's root: `sbatch --mem` limits the
    job's cgroup, above the step and task ones; a container's limit sits at the root of its cgroup namespace; a cgroup
    path that is not under the mount (a container without its own namespace) falls through to the root."""
    try:
        with open(proc_cgroup or PROC_CGROUP) as fh:
            lines = [ln.strip().split(":", 2) for ln in fh if ln.count(":") >= 2]
    except OSError:
        return 0, []
    root = root or CGROUP_ROOT
    v1 = [(ctl, path) for _, ctl, path in lines if controller in ctl.split(",")]
    v2 = [path for hid, ctl, path in lines if hid == "0" and ctl == ""]
    if v1:
        version, (ctl, path) = 1, v1[0]
        base = os.path.join(root, ctl) if os.path.isdir(os.path.join(root, ctl)) else os.path.join(root, controller)
    elif v2:
        version, base, path = 2, root, v2[0]
    else:
        return 0, []
    parts = [p for p in path.split("/") if p]
    return version, [(os.path.join(base, *parts[:depth]), "/" + "/".join(parts[:depth]))
                     for depth in range(len(parts), -1, -1)]


def cgroup_memory(proc_cgroup: str | None = None, root: str | None = None) -> dict | None:
    """The job's memory limit, as the kernel will enforce it: {"limit", "used", "headroom", "cgroup", "version",
    "file" (the file the limit is: memory.max, memory.high or memory.limit_in_bytes)} at the level of this process'
    cgroup hierarchy with the least headroom (limit - used), None where no level limits.

    cgroup v2: the lower of memory.max and memory.high ("max": none) and memory.current; cgroup v1:
    memory.limit_in_bytes and memory.usage_in_bytes (huge = none); at every level of _cgroup_levels. `used` leaves
    out the inactive page cache (reclaimed before an OOM kill). One small file read per level: microseconds.

    memory.high: Slurm's task/cgroup writes --mem there and --mem x AllowedRAMSpace% to memory.max (SchedMD/slurm
    src/plugins/task/cgroup/task_cgroup_memory.c _memcg_initialize: soft_limit_in_bytes, which
    src/plugins/cgroup/v2/cgroup_v2.c writes to memory.high). Above memory.high the kernel throttles the cgroup's
    allocations into direct reclaim (linux Documentation/admin-guide/cgroup-v2.rst; commit 0e4b01df8659 makes the
    throttle sleep): an offload sized to memory.max of AllowedRAMSpace=120 stalls every step in reclaim, and an
    8-rank node's stalled rank stalls the job's collectives. v1's memory.soft_limit_in_bytes acts only under the
    node's own memory pressure: not a limit of the job."""
    version, levels = _cgroup_levels("memory", proc_cgroup, root)
    files, stat_key = {1: (("memory.limit_in_bytes", "memory.usage_in_bytes"), "total_inactive_file"),
                       2: (("memory.max", "memory.current"), "inactive_file")}.get(version, ((), ""))
    best = None
    for folder, cgroup in levels:  # this process' own cgroup first, the mount's root last
        limit, used = _read_int(os.path.join(folder, files[0])), _read_int(os.path.join(folder, files[1]))
        file, high = files[0], _read_int(os.path.join(folder, "memory.high")) if version == 2 else None
        if high is not None and (limit is None or high < limit):
            limit, file = high, "memory.high"
        if limit is None or limit >= UNLIMITED or used is None:
            continue
        used = max(0, used - _inactive_file(folder, stat_key))
        headroom = max(0, limit - used)
        if best is None or headroom < best["headroom"]:
            best = {"limit": limit, "used": used, "headroom": headroom, "version": version, "cgroup": cgroup,
                    "file": file}
    return best


def cpu_quota(proc_cgroup: str | None = None, root: str | None = None) -> dict | None:
    """The job's CPU quota: {"cpus" (quota / period, CPUs' worth of time), "cgroup", "version"} at the level of this
    process' cgroup hierarchy (_cgroup_levels) with the smallest, None where no level has one.

    cgroup v2: cpu.max, "QUOTA PERIOD" ("max PERIOD": none); v1: cpu.cfs_quota_us (-1: none) over cpu.cfs_period_us.
    `docker --cpus 8` and Kubernetes' `resources.limits.cpu: 8` write 800000 100000 there: the container's processes
    together get 8 CPUs' time every period, whatever CPUs their affinity lists (a 128-core node's). A quota is not an
    affinity: sched_getaffinity and coreutils' nproc (9.1) do not see it. One or two small file reads per level."""
    version, levels = _cgroup_levels("cpu", proc_cgroup, root)
    best = None
    for folder, cgroup in levels:
        if version == 2:
            try:
                with open(os.path.join(folder, "cpu.max")) as fh:
                    words = fh.read().split()
            except OSError:
                continue
            quota, period = (int(w) if w.isdigit() else None for w in (words + ["", ""])[:2])
        else:
            quota, period = (_read_int(os.path.join(folder, f)) for f in ("cpu.cfs_quota_us", "cpu.cfs_period_us"))
        if not quota or not period:  # "max", -1, a missing file: no quota at this level
            continue
        cpus = quota / period
        if best is None or cpus < best["cpus"]:
            best = {"cpus": cpus, "cgroup": cgroup, "version": version}
    return best


def memory_available(meminfo: int | None, limit: dict | None) -> int | None:
    """What the job may still use on this node: min(MemAvailable, the cgroup's headroom); None where neither says.
    Pure (preflight's decision takes it over every rank's report)."""
    known = [v for v in (meminfo, (limit or {}).get("headroom")) if v is not None]
    return min(known) if known else None


def job_memory_available() -> int | None:
    """This process' reading of what its job may still allocate on this node (memory_available of its own files).
    A reading: a decision that depends on it is rank 0's over every rank's report (training/preflight.py)."""
    return memory_available(meminfo_available(), cgroup_memory())


# --- CPUs ---

def affinity_cpus() -> list[int]:
    """The CPUs this process may run on (SLURM's cgroup and binding, taskset, numactl -C), no quota applied."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def usable_cpus() -> list[int]:
    """The CPUs this process may use: its affinity (SLURM's cgroup and binding, taskset, numactl -C), capped at its
    cgroup's CPU quota rounded up (cpu_quota: docker --cpus, Kubernetes' CPU limit; 0.5 -> 1). A quota is time, not
    particular CPUs: the first N of the affinity stand for it, the same on every rank that shares it, so a pod's ranks
    count it once in their node's union (cpu_placement, threads_per_rank). Without the cap an 8-rank pod limited to 8
    CPUs on a 128-core node ran 16 OpenMP threads a rank (128 threads on 8 CPUs' time: throttled every period, CPU
    Adam's step waiting on the stragglers) and scripts/prepare_data.py started 32 tokenizer workers (~15 GB)."""
    cpus = affinity_cpus()
    quota = cpu_quota()
    return cpus[:max(1, math.ceil(quota["cpus"]))] if quota else cpus


def cpu_ranges(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5" (the Cpus_allowed_list form)."""
    out, cpus = [], sorted(cpus)
    i = 0
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        out.append(str(cpus[i]) if i == j else f"{cpus[i]}-{cpus[j]}")
        i = j + 1
    return ",".join(out)


def cpu_placement(readings: list[tuple[str, list[int]]], gpu: bool) -> tuple[str, str]:
    """("ok" | "warn" | "refuse", one line) from every rank's (host, usable CPUs), the same list on every rank.

    A node's cores are the union of its ranks' CPU sets (ranks bound to the same core count it once). Fewer cores
    than ranks on a node: refused on a GPU run (the srun step bound to one core, the case this check exists for),
    a warning on the CPU accelerator (where several ranks per core is how a laptop tests). Fewer than
    ADAM_THREADS cores per rank on a GPU run: a warning. Pure: tests give it any cluster."""
    nodes: dict[str, list] = {}
    for host, cpus in readings:
        n = nodes.setdefault(host, [0, set()])
        n[0] += 1
        n[1].update(cpus)
    host, (ranks, cores) = min(nodes.items(), key=lambda kv: (len(kv[1][1]) / kv[1][0], kv[0]))
    per = len(cores) / ranks
    where = f"{ranks} ranks on node {host} may run on {len(cores)} CPU(s) ({cpu_ranges(sorted(cores))})"
    fix = ("give each rank its cores: under SLURM srun --cpus-per-task=<the node's CPUs> --cpu-bind=none (or "
           "SRUN_CPUS_PER_TASK; scripts/slurm.sbatch does this), otherwise a wider taskset/cpuset or fewer ranks per node")
    if per < 1:
        return ("refuse" if gpu else "warn"), f"{where}: fewer cores than ranks; {fix}"
    if per < ADAM_THREADS and gpu:  # on the CPU accelerator every core is the ranks' anyway: nothing to add
        return "warn", (f"{where}: {per:.3g} per rank, CPU Adam (ZeRO optimizer offload) wants {ADAM_THREADS}; "
                        f"expect a slow optimizer step if it is offloaded; {fix}")
    return "ok", f"{where}: {per:.3g} per rank"


def threads_per_rank(readings: list[tuple[str, list[int]]], host: str, mine: list[int]) -> int:
    """This rank's share of its node's cores (the union of the node's ranks' CPUs over its ranks), within its own
    CPUs, at least 1."""
    node = [set(c) for h, c in readings if h == host]
    return max(1, min(len(mine), len(set().union(*node)) // max(1, len(node))))


def threads_defaulted(env: Mapping[str, str], launcher_env: Mapping[str, str] | None) -> bool:
    """Whether OMP_NUM_THREADS=1 is the launcher's default rather than anyone's choice: torchrun sets 1 for every
    worker when it starts more than one and the variable is unset (torch/distributed/run.py config_from_args), and
    accelerate launch sets it to 1 unless told (accelerate/commands/launch.py: get_int_from_env(["OMP_NUM_THREADS"],
    1)); CPU Adam under ZeRO offload then ran one thread per rank, silently (Llama-3-8B, 32 ranks: its ~7 GB per
    rank per step read on one core). The user's, kept, where the launcher's own environment (`launcher_env`: what it
    started with, /proc/<ppid>/environ) had it, or where that cannot be read."""
    started = env.get("TORCHELASTIC_RUN_ID") or env.get("ACCELERATE_MIXED_PRECISION")  # torchrun's, accelerate's
    return bool(started) and env.get("OMP_NUM_THREADS") == "1" and launcher_env is not None \
        and "OMP_NUM_THREADS" not in launcher_env


def check_cpu_placement(gpu: bool) -> str:
    """Collective: every rank's host and usable CPUs gathered, one verdict for all (cpu_placement), the line to
    print ("cpus: ..." or "warning: cpus: ..."); ValueError (exit 2) where the placement is refused. Each rank's own
    CPUs and OMP_NUM_THREADS go to its log (OUTPUT_DIR/logs/rankNNNNN.log); where no launcher set OMP_NUM_THREADS
    (or torchrun's / accelerate's default 1 stands in for it: threads_defaulted), the rank sets it (and torch's
    threads) to its share of the node's cores (threads_per_rank)."""
    from base import comm
    from base.log import rank_log

    mine, quota = usable_cpus(), cpu_quota()
    capped = f" of its affinity, capped by the CPU quota of cgroup {quota['cgroup']}: {quota['cpus']:g}" if quota else ""
    rank_log(f"cpus: this rank may run on {cpu_ranges(mine)} ({len(mine)}{capped}), "
             f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
    host = socket.gethostname()
    gathered = comm.all_gather_object((host, mine, affinity_cpus()))  # one gather: the quota-capped CPUs and the affinity
    readings = [(h, c) for h, c, _ in gathered]
    if os.environ.get("OMP_NUM_THREADS") == "1" and threads_defaulted(os.environ, environ_of(os.getppid())):
        rank_log("cpus: OMP_NUM_THREADS=1 is torchrun's / accelerate's default (their own environment had none)")
        os.environ.pop("OMP_NUM_THREADS")  # taken as unset: the share below
    if not os.environ.get("OMP_NUM_THREADS"):  # no launcher set a share (plain `deepspeed`, python): take this rank's
        import torch  # (else every rank's pool, and CPU Adam's OpenMP loaded later, starts a thread per CPU)

        n = threads_per_rank(readings, host, mine)
        os.environ["OMP_NUM_THREADS"] = str(n)
        torch.set_num_threads(n)
        rank_log(f"cpus: OMP_NUM_THREADS was unset: {n} (this rank's share of its node's CPUs)")
    verdict, line = cpu_placement(readings, gpu)
    if verdict == "refuse" and cpu_placement([(h, a) for h, _, a in gathered], gpu)[0] != "refuse":
        # only a CPU quota is short (docker --cpus 6 with 8 GPUs): time, not CPUs; the ranks run, slowly: said
        verdict, line = "warn", (f"{line.split(':')[0]}: a CPU quota of fewer CPUs than ranks (a quota is CPU time: the "
                                 "ranks may run on every core, throttled); raise the container's CPU limit (docker "
                                 "--cpus, Kubernetes limits.cpu)")
    if verdict == "refuse":
        raise ValueError(f"cpus: {line}")
    return f"cpus: {line}" if verdict == "ok" else f"warning: cpus: {line}"
