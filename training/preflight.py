"""Start-up checks of the machines a run landed on, before any heavy work: one line each, decided once.

What a 32-rank job would otherwise find out late, or never:
- `check_network` (before the process group exists): gloo, the host-side group (and the whole world on CPU),
  binds the interface GLOO_SOCKET_IFNAME names, else the address this host's name resolves to. A name this host
  lacks fails inside init with "[enforce fail at .../device.cc:84] ifa != nullptr"; a multi-node world whose
  hostname resolves to loopback (Debian's `127.0.1.1 host` line) connects every node to itself and waits for
  the collective timeout. Gloo connects all ranks while the group is created, so this check cannot wait for a
  collective: each rank reads its own host and stops with one line naming it. scripts/launch.sh and
  scripts/slurm.sbatch carry the variable (and NCCL_*/FI_*/UCX_*) to every node. There too, before NCCL starts
  (deepspeed.init_distributed), a GPU run with more than one rank on a node whose /dev/shm is under 1 GiB (a
  container's default) gets a warning line from that node (`shm_warning`): NCCL's shared memory fails to start there.
- `preflight` (collective, right after the process group and the shared-folder probe): every rank reports its
  host, the host memory its job may still use (the node's MemAvailable and the job's cgroup/container memory
  limit: base.host.cgroup_memory), memlock limit and any torch-extensions build lock (`all_gather_object`); rank 0 decides
  over the reports (`run_on_main`), so every rank raises the same line or none does (DESIGN: one decider,
  never a rank's own reading):
  - a `lock` under TORCH_EXTENSIONS_DIR/<op>/: torch waits for it with no time limit before loading the op
    (a build killed mid-way leaves it); one older than STALE_LOCK_S (30 min) stops the run, a younger one (a build
    in progress, maybe another job's) is a warning line; scripts/setup.sh builds the ops ahead of time and clears them;
  - host memory per node: what the planner (planner/memory_model.estimate: ZeRO-3 CPU offload of params,
    fp32 grads, master weights and Adam moments, offloaded checkpoints; on a CPU run everything) puts in host
    memory per rank, on a GPU run plus the process runtime a rank does not hold yet (planner/cluster.RUNTIME_HOST_GIB,
    as plan.py and auto's budget count it, less the rank's RSS now, which the readings count already), over the
    node's ranks, at the stage that needs most, against what the job may still use there: min(MemAvailable, cgroup
    limit - usage). Under `sbatch --mem` or a container limit the node's MemAvailable is far above what the job
    may use, and the cgroup OOM-kills the ranks (after every requeue again) where the check read only
    /proc/meminfo; the refusal names the cgroup, its limit's file (memory.high where it is the lower) and the fix;
    and, where offload pins it (`pin_memory`, GPU runs), each rank's pinned bytes against RLIMIT_MEMLOCK (a
    warning line only: see `memlock_warning`);
  - --gpu_mem_gb against the smallest GPU the ranks report: a refusal below it (the plan is for memory these GPUs
    lack: OOM at the first step), a note well above it (> 1.25x: features kept for nothing). Not in a --dry_run;
  - the GPU memory of each stage under memory_features manual (training/device_fit.py: the plan's peak against the
    smallest GPU of the job or --gpu_mem_gb): a warning past the usable limit, a refusal past the planner's largest error;
  - every stage's DeepSpeed config (`check_stage_configs`: the assembly and validation `build_engine` runs),
    so a bad stage `deepspeed_overrides` stops the run at start, not when its stage starts days in.
    `--dry_run` runs it too (train.py).
"""

from __future__ import annotations

import glob
import ipaddress
import os
import resource
import socket
import sys
import time

from base.host import cgroup_memory, meminfo_available, memory_available, ranks_per_node, rss_bytes
from base.parallel import ParallelDims
from training.config import Config, no_gpu
from training.curriculum import Stage, gpus_per_node
from training.device_fit import GiB, check_device_fit, gpu_bytes
from training.ds_config import build_ds_config

MEMINFO = "/proc/meminfo"
SHM = "/dev/shm"
# NCCL between the ranks of one node keeps shared-memory segments in /dev/shm (4194660 bytes in its guide's example)
# and fails to start when it cannot extend one: "failed to extend /dev/shm/nccl-*" (NVIDIA's NCCL user guide,
# troubleshooting/runtime_and_mpi_issues: Docker's limited default, fixed with --shm-size=1g --ulimit memlock=-1);
# Docker's default is 64 MiB (a segfault in ncclShmOpen there: pytorch/tutorials commit 0ba3e39). Below: a warning.
SHM_MIN = 1 << 30
NET_DIR = "/sys/class/net"


# --- network: before the process group ---

def interfaces(net_dir: str | None = None) -> list[str]:
    """The network interfaces of this host (/sys/class/net)."""
    try:
        return sorted(os.listdir(net_dir or NET_DIR))
    except OSError:
        return []


def _is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return addr == "localhost"


def multi_node() -> bool:
    """Whether the launcher put ranks on more than one node (deepspeed: CROSS_SIZE; torchrun: LOCAL_WORLD_SIZE).
    This process' own launcher's node size, not the job's agreed one (base.host.job_ranks_per_node): it runs before
    the process group, which gloo cannot form if this host's interface is wrong, so nothing can be agreed yet. It
    needs no agreement: it asks only whether this host's ranks have peers elsewhere, which every rank of an uneven
    job answers alike (nodes of 8 and 4 in a world of 16: both fewer than 16), and a refusal on any one host ends
    every rank through the abort channel; no layout depends on it."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = ranks_per_node() or world
    return int(os.environ.get("CROSS_SIZE", "1")) > 1 or local < world


def network_problem(host: str, ifname: str | None, present: list[str], multi: bool, host_addr: str | None,
                    master_addr: str) -> str | None:
    """The one-line problem with this host's gloo interface, or None. Pure (tests give it any host)."""
    if ifname:
        missing = [n for n in ifname.split(",") if n.strip() and n.strip() not in present]
        if missing:
            return (f"GLOO_SOCKET_IFNAME={ifname}: host {host} has no interface {missing[0]} (it has "
                    f"{', '.join(present) or 'none listed'}): set it to the interface the nodes reach each other on, "
                    "the same name on every node, or unset it")
        return None
    if multi and host_addr and _is_loopback(host_addr) and not _is_loopback(master_addr):
        return (f"host {host} resolves its own name to {host_addr} (loopback) and GLOO_SOCKET_IFNAME is unset: "
                "gloo would offer the other nodes a loopback address; set GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME) "
                "to the interface the nodes reach each other on, e.g. GLOO_SOCKET_IFNAME=eth0")
    return None


def check_network() -> None:
    """This host can create the gloo group: call before the process group (see the module docstring)."""
    host, ifname = socket.gethostname(), os.environ.get("GLOO_SOCKET_IFNAME")
    multi = multi_node()
    addr = None
    if multi and not ifname:
        try:
            addr = socket.gethostbyname(host)
        except OSError:
            addr = None
    problem = network_problem(host, ifname, interfaces(), multi, addr, os.environ.get("MASTER_ADDR", ""))
    if problem:  # the abort channel (open since the first line) carries it to every node; each node prints it too
        raise ValueError(problem)
    local = (os.environ.get("LOCAL_RANK") or os.environ.get("SLURM_LOCALID") or "0") == "0"  # once a node: its first
    # rank (no process group yet to agree in; srun starting the ranks itself sets SLURM_LOCALID)
    line = local and shm_warning(shm_bytes(), ranks_per_node(), not no_gpu(), host)
    if line:
        print(line, file=sys.stderr, flush=True)


def shm_bytes(path: str = SHM) -> int | None:
    """The size of /dev/shm (its tmpfs' total, statvfs), None where there is none."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_blocks * st.f_frsize


def shm_warning(size: int | None, ranks_here: int, gpu: bool, host: str, min_bytes: int = SHM_MIN) -> str | None:
    """A GPU run with more than one rank on this node (as its launcher says) and a /dev/shm of under `min_bytes`:
    NCCL's shared memory between those ranks fails to start (SHM_MIN). Before the process group: NCCL starts inside
    it, so no collective can carry this reading to rank 0; each node says its own. A warning, not a stop: NCCL may not
    need it (NCCL_SHM_DISABLE=1, or peers over NVLink P2P) and what it needs is NCCL's to say. CPU runs (gloo,
    DeepSpeed's shm op: a 2-rank CPU run trained with a 64 MiB /dev/shm) are not warned."""
    if not gpu or ranks_here < 2 or size is None or size >= min_bytes:
        return None
    return (f"warning: /dev/shm on {host} holds {_size(size)} for its {ranks_here} ranks: NCCL keeps its shared memory "
            "there and fails to start (ncclShmOpen, 'failed to extend /dev/shm/nccl-*') when it is this small, as in a "
            "container's default (Docker: 64 MiB): give the container --shm-size=1g or more, or --ipc=host (Kubernetes: "
            "an emptyDir of medium Memory mounted on /dev/shm)")


# --- what each rank reports ---

def mem_available_bytes(path: str | None = None) -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where the file or the line is missing): the whole node's, which
    a job under a cgroup limit may not have; report() takes the smaller of it and the cgroup's headroom."""
    return meminfo_available(path or MEMINFO)


def memory_limit() -> dict | None:
    """The job's cgroup/container memory limit where one applies (base.host.cgroup_memory: limit, used, headroom,
    the cgroup), None where none does."""
    return cgroup_memory()


def memlock_limit() -> int | None:
    """This process's soft RLIMIT_MEMLOCK in bytes; None when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else soft


def extensions_dir() -> str:
    from base.env import EXTENSIONS_DIR  # base.env.configure() (train.py's first step) sets it when unset

    return os.environ.get("TORCH_EXTENSIONS_DIR", EXTENSIONS_DIR)


def build_locks(ext_dir: str | None = None) -> list[tuple[str, float]]:
    """(path, age in seconds) of every torch build `lock` under TORCH_EXTENSIONS_DIR/<op>/ (and one level deeper,
    torch's own py3X_cuXXX/<op>/ layout when the variable points at its default root)."""
    root = ext_dir or extensions_dir()
    now = time.time()
    out = []
    for path in sorted(glob.glob(os.path.join(root, "*", "lock")) + glob.glob(os.path.join(root, "*", "*", "lock"))):
        try:
            out.append((path, now - os.path.getmtime(path)))
        except OSError:  # removed meanwhile: the build it belonged to finished
            pass
    return out


def report() -> dict:
    """What this rank sees of its host. `mem_available`: what its job may still use there, min(MemAvailable, the
    cgroup's limit - usage); `mem_node`: MemAvailable; `mem_limit`: the cgroup reading (None: no limit); `rss`: this
    process' resident set now (in both readings' usage already: the runtime still to come is the rest)."""
    node, limit = mem_available_bytes(), memory_limit()
    return {"host": socket.gethostname(), "mem_available": memory_available(node, limit), "mem_node": node,
            "mem_limit": limit, "memlock": memlock_limit(), "locks": build_locks(), "gpu_bytes": gpu_bytes(),
            "rss": rss_bytes()}


# --- the decisions (pure: rank 0 takes them over every rank's report) ---

# torch's FileBaton writes the lock when a build starts and never touches it again, and records no holder (no pid,
# no host), so its age is the only evidence: our ops (cpu_adam, fused_adam, the shm comm op) build in 1-5 minutes
# each, so a lock older than this outlived any build and is taken for one killed mid-way. A younger one is another
# job (or a rank of this one) compiling right now: torch waits for it, so the run goes on after a warning line.
STALE_LOCK_S = 30 * 60


def lock_problem(reports: list[dict], stale_s: float = STALE_LOCK_S) -> str | None:
    """The first build lock older than `stale_s` (a build killed mid-way: torch would wait for it forever)."""
    for r in reports:
        for path, age in r["locks"]:
            if age >= stale_s:
                return (f"stale torch-extensions build lock {path} on {r['host']} ({age / 60:.0f} min old, older than "
                        f"any build of an op, {stale_s / 60:.0f} min): loading that op would wait for it forever; "
                        f"remove it (rm {path}) or rerun scripts/setup.sh, once no build of that op runs anywhere")
    return None


def lock_warning(reports: list[dict], stale_s: float = STALE_LOCK_S) -> str | None:
    """A build lock younger than `stale_s`: a build in progress, which torch waits for when it loads that op."""
    for r in reports:
        for path, age in r["locks"]:
            if age < stale_s:
                return (f"warning: torch-extensions build lock {path} on {r['host']} ({age / 60:.0f} min old): "
                        f"another process is building that op; loading it waits for that build (a start after "
                        f"{stale_s / 60:.0f} min with the lock still there stops as stale)")
    return None


def bound_build_waits(stale_s: float = STALE_LOCK_S) -> None:
    """torch's wait for another process's op build (FileBaton.wait, cpp_extension.load) ends once the lock is older
    than `stale_s`, with one line: it looped while the lock existed, so a build killed by a preemption and requeued
    within `stale_s` (a warning at the start, not a refusal) hung the job to its time limit. Every rank, once; the
    error is a crash (requeued), the next start refuses the lock as stale."""
    from torch.utils import file_baton

    def wait(self) -> None:
        while os.path.exists(self.lock_file_path):
            try:
                age = time.time() - os.path.getmtime(self.lock_file_path)
            except OSError:  # released meanwhile
                break
            if age > stale_s:
                raise RuntimeError(f"torch-extensions build lock {self.lock_file_path} is {age / 60:.0f} min old: the "
                                   "build holding it is gone; remove it (once no build of that op runs) or rerun "
                                   "scripts/setup.sh")
            time.sleep(self.wait_seconds)

    file_baton.FileBaton.wait = wait


def runtime_to_come(report: dict, need: dict) -> int:
    """The process runtime (need["runtime"]: planner/cluster.RUNTIME_HOST_GIB on a GPU run, 0 on a CPU run) this
    rank does not hold yet: its RSS now (report's `rss`; none: 0) is in MemAvailable's and the cgroup's usage already.
    At the check a rank holds ~0.26 GiB; the CUDA context, NCCL and the model's load come after it."""
    return max(0, need.get("runtime", 0) - (report.get("rss") or 0))


def _memory_shortfall(reports: list[dict], need: dict | None) -> tuple[str, str] | None:
    """(what does not fit, the fix) for the first node whose ranks' need["bytes"] and runtime_to_come exceed the
    least memory its ranks may still use (report's mem_available: MemAvailable, or the job's cgroup headroom where
    that is less). plan.py's figure per node: ranks x (host terms + RUNTIME_HOST_GIB); this one counts the same
    less what the ranks hold already, which the readings count (Llama-3-8B at 1M on 4 x 8 GPUs under a 64 GiB
    cgroup: plan.py says 69.88 GiB, NO; without the runtime this check let it start on 58 GiB of headroom)."""
    if not need:
        return None
    for host, rs in _by_host(reports).items():
        known = [r for r in rs if r["mem_available"] is not None]
        runtime = sum(runtime_to_come(r, need) for r in rs)
        total = len(rs) * need["bytes"] + runtime
        if not known or total <= min(r["mem_available"] for r in known):
            continue
        r = min(known, key=lambda r: r["mem_available"])
        counted = (f"; and {runtime / GiB:.1f} GiB of process runtime its ranks do not hold yet: "
                   f"{need['runtime'] / GiB:.2f} GiB per rank as plan.py counts it (planner/cluster.RUNTIME_HOST_GIB) "
                   "less each rank's RSS now") if runtime else ""
        holds = (f"but its {len(rs)} rank(s) will hold {total / GiB:.1f} GiB in host memory ({need['stage']}: "
                 f"{need['what']}, {need['bytes'] / GiB:.2f} GiB per rank{counted})")
        fix = ("run fewer ranks per node, more nodes, or turn the ZeRO offload off for that stage "
               "(deepspeed_overrides)")
        lim = r.get("mem_limit")
        if lim and lim["headroom"] <= r["mem_available"]:  # the cgroup binds, not the node
            node = f"; the node's MemAvailable {r['mem_node'] / GiB:.1f} GiB is not the job's" if r.get("mem_node") else ""
            which = f" ({lim['file']})" if lim.get("file") else ""  # the file the limit is (base.host.cgroup_memory)
            if lim.get("file") == "memory.high":
                which = " (memory.high: above it the kernel throttles the job into reclaim; Slurm writes --mem there)"
            return (f"host memory: {host} has {r['mem_available'] / GiB:.1f} GiB available to the job (cgroup "
                    f"{lim['cgroup']} memory limit {lim['limit'] / GiB:.1f} GiB{which}, {lim['used'] / GiB:.1f} GiB in use"
                    f"{node}) {holds}"), (f"raise the job's memory limit (sbatch --mem=<GB per node>, or --mem=0 for "
                                          f"the whole node; a container's --memory), {fix}")
        return (f"host memory: {host} has {r['mem_available'] / GiB:.1f} GiB available (MemAvailable) {holds}",
                f"{fix}, or free memory on the node")
    return None


def host_memory_problem(reports: list[dict], need: dict | None) -> str | None:
    """`need`: host bytes per rank at the stage that needs most ({"bytes", "pinned", "stage", "what", "runtime"});
    None when the planner cannot say. Per node: its ranks x bytes, and the runtime they do not hold yet
    (runtime_to_come), against the least memory its ranks' job may still use there (MemAvailable, or the job's
    cgroup limit less its usage where that is less); one line with the fix."""
    short = _memory_shortfall(reports, need)
    return f"{short[0]}: {short[1]}" if short else None


def memlock_warning(reports: list[dict], need: dict | None) -> str | None:
    """Each rank's pinned offload bytes against the smallest RLIMIT_MEMLOCK of a node. A warning, not a stop:
    CUDA's pinned host allocations (what ZeRO offload's pin_memory makes) are not charged to RLIMIT_MEMLOCK, so a
    container's 64 KiB default trains; what is charged is memory registered with InfiniBand (NCCL over IB) or
    locked by mlock, which then fails with "Cannot allocate memory" mid-run."""
    if not need or not need["pinned"]:
        return None
    for host, rs in _by_host(reports).items():
        limits = [r["memlock"] for r in rs if r["memlock"] is not None]
        if limits and min(limits) < need["pinned"]:
            return (f"warning: memlock: {host} limits locked memory to {_size(min(limits))} per process "
                    f"(ulimit -l) and each rank pins {need['pinned'] / GiB:.2f} GiB of offloaded states "
                    f"({need['stage']}): fine for CUDA's pinned buffers, but InfiniBand registration needs more; "
                    "raise it (ulimit -l unlimited; containers: --ulimit memlock=-1) if NCCL reports ibv_reg_mr errors")
    return None


GPU_MEM_SLACK = 0.05  # an "80 GB" H100 reports 79.6 GiB: --gpu_mem_gb 80 on it is what it means, not a wrong plan
GPU_MEM_WASTE = 1.25  # smallest GPU above this many times --gpu_mem_gb: a note (the plan keeps needless features)


def gpu_mem_mismatch(reports: list[dict], gpu_mem_gb: float) -> tuple[str | None, str | None]:
    """(refusal, note): --gpu_mem_gb > 0 is taken as given by auto's budget and the device-fit check; against the
    smallest GPU the ranks report. Below it (by more than GPU_MEM_SLACK): the run plans for memory it lacks and
    OOMs at the first step after the weights load; well above it: a note (offloads and recompute kept for nothing,
    each costs step time at scale). Nothing without --gpu_mem_gb (detected) or without every rank's reading."""
    got = [r.get("gpu_bytes") for r in reports]
    if gpu_mem_gb <= 0 or not got or any(g is None for g in got):
        return None, None
    have = min(got) / GiB
    if have < gpu_mem_gb * (1 - GPU_MEM_SLACK):
        return (f"--gpu_mem_gb {gpu_mem_gb:g}: the config plans for {gpu_mem_gb:g} GB GPUs, these have {have:.1f}: "
                f"set gpu_mem_gb 0 (detect) or {int(have)}"), None
    if have > gpu_mem_gb * GPU_MEM_WASTE:
        return None, (f"note: --gpu_mem_gb {gpu_mem_gb:g}: the plan is for {gpu_mem_gb:g} GB GPUs, these have "
                      f"{have:.1f}: gpu_mem_gb 0 (detect) may turn off offloads and recompute it keeps")
    return None, None


def _size(n: int) -> str:
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def _by_host(reports: list[dict]) -> dict[str, list[dict]]:
    nodes: dict[str, list[dict]] = {}
    for r in reports:
        nodes.setdefault(r["host"], []).append(r)
    return nodes


def host_need(cfg: Config, stages: list[Stage], world: int, bf16: bool, configs: list[dict], arch,
              cpu_run: bool, async_save: bool | None = None) -> dict | None:
    """What the run holds in host memory per rank at its most demanding stage, from the planner (None when it
    cannot read the model's shape): the ZeRO-3 offloaded states and checkpoints, and on a CPU run everything.
    `arch`: the model's (text) config; `configs`: each stage's DeepSpeed config (check_stage_configs);
    `async_save`: count the background saves' host copy (None: as `cfg.async_save` is set to true). `runtime`: the
    process runtime per rank on a GPU run (planner/cluster.RUNTIME_HOST_GIB, measured: CUDA's host allocations,
    torch, DeepSpeed), counted as plan.py counts it, less each rank's RSS (runtime_to_come); 0 on a CPU run, whose
    process is loaded by the check and whose step the planner counts whole."""
    async_save = cfg.async_save is True if async_save is None else async_save
    from planner.cluster import RUNTIME_HOST_GIB
    from planner.memory_model import ModelShape, estimate, grad_accum_dtype
    from training.summary import run_features

    best = None
    for s, ds in zip(stages, configs):
        try:
            shape = ModelShape.from_config(arch.to_dict())
            est = estimate(shape, s.max_seq_length, s.sp, world, run_features(cfg, ds, s), "bf16" if bf16 else "fp32",
                           cp=s.cp if isinstance(s.cp, int) else 1, async_save=async_save, grad_accum=grad_accum_dtype(ds),
                           device="cpu" if cpu_run else "cuda")  # cuda: pinned host blocks as the allocator holds them
        except ValueError:  # a shape the planner cannot read: no plan to check against (the plan lines say so)
            return None
        held = sum(est.cpu_per_rank.values()) + (est.gpu_peak if cpu_run else 0)
        zero = ds.get("zero_optimization", {})
        pins = {"params (partition)": zero.get("offload_param", {}).get("pin_memory", False),
                "grads fp32 (partition)": zero.get("offload_optimizer", {}).get("pin_memory", False),
                "optimizer fp32 master+Adam m,v": zero.get("offload_optimizer", {}).get("pin_memory", False),
                "async save: host copy of the rank's checkpoint": True}  # pinned on a GPU (training/async_save.py)
        pinned = 0 if cpu_run else sum(v for k, v in est.cpu_per_rank.items() if pins.get(k))
        if best is None or held > best["bytes"]:
            what = ", ".join(k for k in est.cpu_per_rank) or "nothing offloaded"
            best = {"bytes": held, "pinned": pinned, "stage": f"stage {s.index} ({s.name})",
                    "runtime": 0 if cpu_run else int(RUNTIME_HOST_GIB * GiB),
                    "what": "the whole step (CPU run)" if cpu_run else f"offloaded {what}"}
    return best


def auto_async(reports: list[dict], need: dict | None, cpu_run: bool) -> tuple[bool, str]:
    """`async_save: auto`: on, or off with the line that says why; `need`: host_need with the snapshot counted.
    Off on a CPU run: its host memory holds the whole step and the writer thread takes cores from it (tests and
    demos keep their synchronous saves). Off where the planner cannot size the snapshot, or a node's host memory
    would not hold it (Llama-3-8B on 32 ranks: 3.0 GB per rank, 24 GB per 8-GPU node; planner/memory_model.py)."""
    force = "--async_save true forces it"
    if cpu_run:
        return False, f"async_save auto: off on a CPU run (the background writer would share the step's cores); {force}"
    if not need:
        return False, f"async_save auto: off (the planner cannot size the snapshot for this model); {force}"
    short = _memory_shortfall(reports, need)  # the same memory figures as the start-up check (cgroup included)
    if short:
        return False, f"async_save auto: off, the host copy would not fit: {short[0]}; {force}"
    return True, (f"async_save auto: on ({need['stage']} holds {need['bytes'] / GiB:.2f} GiB of host memory per rank "
                  f"with the snapshot, and every node has it); --async_save false turns it off")


# --- the checks ---

def check_stage_configs(cfg: Config, stages: list[Stage], world: int, bf16: bool, hidden_size: int,
                        planning: bool = False) -> list[dict]:
    """Every stage's DeepSpeed config, assembled and validated as training/engine.build_engine does when the stage
    starts (build_ds_config: our checks and DeepSpeed's parser), and flex_attention's BlockMask within its bound
    (model_utils/attention.check_flex_length: (length / 128)^2, not in the plan). One line naming the stage otherwise."""
    from model_utils.attention import check_flex_length
    from training.engine import stage_config

    out = []
    for s in stages:
        check_flex_length(cfg.attn_implementation, s.max_seq_length, cfg.per_device_train_batch_size,
                          f"stage {s.index} ({s.name})", s.cp)
        dims = ParallelDims(world=world, sp=s.sp, rank=0, local_rank=0)
        try:
            out.append(build_ds_config(stage_config(cfg, s), dims, bf16, hidden_size, s.deepspeed_overrides,
                                       planning=planning, quiet=True))
        except ValueError as e:
            how = " with its deepspeed_overrides" if s.deepspeed_overrides else ""
            raise ValueError(f"stage {s.index} ({s.name}){how}: {e}") from None
    return out


def preflight(cfg: Config, stages: list[Stage], dims: ParallelDims, arch, bf16: bool) -> None:
    """The start-up checks of a launched run (collective; see the module docstring); `arch`: the model's (text)
    config. Every rank returns, or every rank raises the same one-line ValueError."""
    from base import comm
    from base.log import print0

    reports = comm.all_gather_object(report())

    def decide() -> bool:
        configs = check_stage_configs(cfg, stages, dims.world, bf16, arch.hidden_size)
        cpu_run = no_gpu()
        on, why, with_snapshot = cfg.async_save, None, None
        if on == "auto":
            with_snapshot = host_need(cfg, stages, dims.world, bf16, configs, arch, cpu_run, True)
            on, why = auto_async(reports, with_snapshot, cpu_run)
        # the host need of what runs: the one just computed when auto turned the snapshot on
        need = with_snapshot if on and with_snapshot is not None else host_need(cfg, stages, dims.world, bf16,
                                                                                 configs, arch, cpu_run, on)
        gpu_problem, gpu_note = (None, None) if cpu_run else gpu_mem_mismatch(reports, cfg.gpu_mem_gb)
        problem = lock_problem(reports) or gpu_problem or host_memory_problem(reports, need)
        if problem:
            raise ValueError(problem)
        if not cpu_run:  # the manual stages' plans against the smallest GPU (auto chose against it already)
            check_device_fit(cfg, stages, dims.world, bf16, configs, arch, gpus_per_node(cfg) or dims.world, reports, print0)
        for line in (lock_warning(reports), memlock_warning(reports, need), why, gpu_note):
            if line:
                print0(line)
        return on

    cfg.async_save = comm.run_on_main(decide)  # rank 0's decision on every rank (`auto` resolved)
    bound_build_waits()  # a young lock let through above: its wait ends when it turns stale
