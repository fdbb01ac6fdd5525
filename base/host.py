"""Readings of this host: the process' own peak memory, the ranks that share this node under whichever launcher
started them, the CPUs this process may run on, and whether the ranks of each node have the cores they need.
Torch-free at import (the planner uses it); `check_cpu_placement` gathers through base.comm when it runs."""

from __future__ import annotations

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
    try:
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmHWM:"))
    except (OSError, StopIteration):  # no procfs (not Linux): ru_maxrss, bytes on macOS
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


def _first_count(value: str) -> int:
    """SLURM's per-node lists ("8(x4)", "8,4" or "8"): the first node's number."""
    m = re.match(r"\s*(\d+)", value or "")
    return int(m.group(1)) if m else 0


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
        return _first_count(env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
                            or env.get("SLURM_NTASKS_PER_NODE", ""))
    return 0


def usable_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity: SLURM's cgroup and binding, taskset, numactl -C)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


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


def check_cpu_placement(gpu: bool) -> str:
    """Collective: every rank's host and usable CPUs gathered, one verdict for all (cpu_placement), the line to
    print ("cpus: ..." or "warning: cpus: ..."); ValueError (exit 2) where the placement is refused. Each rank's own
    CPUs and OMP_NUM_THREADS go to its log (OUTPUT_DIR/logs/rankNNNNN.log); where no launcher set OMP_NUM_THREADS,
    the rank sets it (and torch's threads) to its share of the node's cores (threads_per_rank)."""
    from base import comm
    from base.log import rank_log

    mine = usable_cpus()
    rank_log(f"cpus: this rank may run on {cpu_ranges(mine)} ({len(mine)}), "
             f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
    host = socket.gethostname()
    readings = comm.all_gather_object((host, mine))
    if not os.environ.get("OMP_NUM_THREADS"):  # no launcher set a share (plain `deepspeed`, python): take this rank's
        import torch  # (else every rank's pool, and CPU Adam's OpenMP loaded later, starts a thread per CPU)

        n = threads_per_rank(readings, host, mine)
        os.environ["OMP_NUM_THREADS"] = str(n)
        torch.set_num_threads(n)
        rank_log(f"cpus: OMP_NUM_THREADS was unset: {n} (this rank's share of its node's CPUs)")
    verdict, line = cpu_placement(readings, gpu)
    if verdict == "refuse":
        raise ValueError(f"cpus: {line}")
    return f"cpus: {line}" if verdict == "ok" else f"warning: cpus: {line}"
