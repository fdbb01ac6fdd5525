"""The process environment DeepSpeed's JIT-built ops need, set by `configure()` (train.py, set-up, tests), never
at import.

TORCH_EXTENSIONS_DIR: DeepSpeed's JIT-built ops (CPU Adam, the shared-memory comm op) go to this checkout's own
`.cache/torch_extensions` unless it is set: torch serializes JIT builds with a `lock` file and waits for it to
disappear with no time limit, so one process killed mid-build in the shared `~/.cache/torch_extensions` (or
another checkout rebuilding there with its own include paths) would stall every later launch on the machine.
`scripts/setup.sh` builds the ops there once. A checkout this user cannot write (a read-only container image, another
user's folder) makes both this default and the data cache's (`.cache`, data/corpus.py) fail at their first write, an
EROFS traceback minutes in: `check_writable_defaults` refuses that at start in one line naming TORCH_EXTENSIONS_DIR
and ULYSSES_CACHE (docs/containers.md).

PATH: the running interpreter's folder goes first, so every build of an op runs one `ninja`, the interpreter's own
(a venv holds pip's ninja 1.13 beside the system's 1.11; torch's JIT build calls whichever PATH finds first, and the
two record a build differently, so each rebuilds what the other built: ~1.5-3 min of every rank's start with the
`lock` held, whenever an activated shell and a plain `.venv/bin/python` take turns. Seen here 2026-11-28: the 2-task
srun test waited 91 s in a rebuild, and cpu_adam was rebuilt three times in an hour).

py-cpuinfo (`ask_cpu_once`): DeepSpeed asks `cpuinfo.get_cpu_info()` for the CPU at every CPU Adam it builds (the
vendor, for an fp16 warning) and at the first load of each op (-march and the SIMD flag). Each ask starts a new
Python process, which starts another to run CPUID and time the clock: ~1.1 s of CPU, 1 s of it the CPUID probe; 3
asks per rank's first engine and one more per engine after it (a curriculum builds one per stage). Measured with
py-spy on a 2-rank CPU test run: 3.2 of a rank's 13.5 CPU-s. The CPU does not change under a running process, so it
is asked once per process, and without the probe where the kernel answers (the probe's second is the parent
polling a child that sleeps 1 s to time the clock). py-cpuinfo reads /proc/cpuinfo first and takes from CPUID only
what is still missing, except the flags, where it adds CPUID's spellings of what the kernel also names (avx512vnni
beside the kernel's avx512_vnni). What DeepSpeed reads is the same either way: arch, vendor, and the avx512f / avx2 /
sve flags behind -march and the SIMD flag (tests/unit/training/test_ds_config.py compares the two answers through
DeepSpeed's own op builder). A changed answer would change the ops' build flags and with them the hash under which
torch finds a built op: a rebuild at every rank's start. Elsewhere than Linux, or when /proc/cpuinfo lacks them, the
full ask runs.

TORCH_CUDA_ARCH_LIST with arch-specific entries ("9.0a", "10.0f": what Hopper and Blackwell builds of
FlashAttention-3 and friends ask for) is rewritten to the plain ones DeepSpeed's JIT op builder can read: it
sorts the entries with int() on the minor part and fails on "0a" with a ValueError before the first step
whenever it builds an op on a GPU (FusedAdam without optimizer offload). Seen on an H200 whose image sets
TORCH_CUDA_ARCH_LIST=9.0a. The ops DeepSpeed builds use no arch-specific instructions.
"""

from __future__ import annotations

import copy
import os
import re
import sys

CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE_DIR = os.path.join(CHECKOUT, ".cache")  # the data cache unless ULYSSES_CACHE is set (data/corpus.py)
EXTENSIONS_DIR = os.path.join(CACHE_DIR, "torch_extensions")


def deepspeed_arch_list(value: str) -> str:
    """TORCH_CUDA_ARCH_LIST as DeepSpeed's JIT builder reads it: "9.0a 10.0f+PTX;9.0" -> "9.0;10.0+PTX"."""
    ccs = (re.sub(r"^(\d+\.\d+)[a-z]+", r"\1", cc) for cc in re.split(r"[;\s]+", value.strip()) if cc)
    return ";".join(dict.fromkeys(ccs))


def configure() -> str:
    """Point TORCH_EXTENSIONS_DIR at this checkout's cache (unless set), put the interpreter's folder first on PATH
    (one ninja for every build) and make TORCH_CUDA_ARCH_LIST readable for DeepSpeed; returns the extensions folder.
    Call it before the first DeepSpeed op is loaded."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", EXTENSIONS_DIR)
    here = os.path.dirname(sys.executable)
    rest = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p != here]
    os.environ["PATH"] = os.pathsep.join([here, *rest])
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        os.environ["TORCH_CUDA_ARCH_LIST"] = deepspeed_arch_list(os.environ["TORCH_CUDA_ARCH_LIST"])
    return os.environ["TORCH_EXTENSIONS_DIR"]


def _writable(folder: str) -> bool:
    """Whether this user may create files in `folder`, or in its nearest existing parent where it does not exist yet
    (access(2): a read-only mount answers EROFS, also to root; a mode or ACL, EACCES)."""
    while not os.path.exists(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    return os.access(folder, os.W_OK | os.X_OK)


def check_writable_defaults(need_cache: bool = True, env=None) -> None:
    """One-line ValueError where a folder this run writes by default lies in a checkout it cannot write (an Apptainer
    SIF, Kubernetes' readOnlyRootFilesystem, pyxis --container-readonly, another user's checkout) and the variable that
    moves it is unset: TORCH_EXTENSIONS_DIR (torch writes a `lock` file in an op's folder even to load one already
    built: torch/utils/cpp_extension.py _jit_compile, FileBaton.try_acquire: EROFS at the first op, exit 1), and, with
    `need_cache` (a demo corpus or a JSONL prepared in the job, which rank 0 alone writes: true there only; a prepared
    --dataset_path reads no cache), ULYSSES_CACHE (EROFS creating .cache/demo or .cache/prepared/<tmp>). Before any
    work: after `configure()`, once the config says whether the cache is written; a refusal on one node ends every
    rank through the abort channel (exit 2). Cost: a few access(2) calls and one listing."""
    env = os.environ if env is None else env
    bad = []
    if (env.get("TORCH_EXTENSIONS_DIR") or EXTENSIONS_DIR) == EXTENSIONS_DIR:  # unset, or configure()'s default
        ops = os.listdir(EXTENSIONS_DIR) if os.path.isdir(EXTENSIONS_DIR) else []  # each op's folder holds its lock
        if not all(_writable(f) for f in [EXTENSIONS_DIR, *(os.path.join(EXTENSIONS_DIR, d) for d in ops)]
                   if not os.path.isfile(f)):
            bad.append("TORCH_EXTENSIONS_DIR (DeepSpeed's JIT-built ops; scripts/setup.sh builds them there)")
    if need_cache and not env.get("ULYSSES_CACHE") and not all(
            _writable(os.path.join(CACHE_DIR, d)) for d in ("", "demo", "prepared")):
        bad.append("ULYSSES_CACHE (the demo corpus and data prepared in the job: a writable shared folder)")
    if bad:
        raise ValueError(f"this checkout ({CHECKOUT}) cannot be written here (a read-only container image or another "
                         f"user's folder): set {' and '.join(bad)} to a folder this user can write")


def cpu_info_without_cpuid() -> dict:
    """py-cpuinfo's answer from what the kernel and the OS report, its CPUID probe left out (in this process, 6 ms here
    against ~1.1 CPU-s); {} when that lacks arch, flags or vendor (not Linux, a bare /proc/cpuinfo) or when this
    py-cpuinfo has other internals: the caller then asks in full."""
    try:
        from cpuinfo import cpuinfo as impl

        impl.DataSource.can_cpuid, before = False, impl.DataSource.can_cpuid
        try:
            info = impl._get_cpu_info_internal()
        finally:
            impl.DataSource.can_cpuid = before
    except Exception:  # another py-cpuinfo, or a source failing in this process: the full ask decides
        return {}
    return info if info.get("arch") and info.get("flags") and info.get("vendor_id_raw") else {}


def ask_cpu_once() -> None:
    """Make `cpuinfo.get_cpu_info()` (how DeepSpeed asks for the CPU: `from cpuinfo import get_cpu_info` at each
    use) ask once in this process, without the CPUID probe where the kernel answers, and answer every later call from
    that (a copy: callers may edit it). Call it before DeepSpeed builds its optimizer or loads an op; calling it
    again changes nothing."""
    import cpuinfo

    if getattr(cpuinfo.get_cpu_info, "asked_once", False):
        return
    ask, answer = cpuinfo.get_cpu_info, []

    def get_cpu_info() -> dict:
        if not answer:
            answer.append(cpu_info_without_cpuid() or ask())
        return copy.deepcopy(answer[0])

    get_cpu_info.asked_once = True
    cpuinfo.get_cpu_info = get_cpu_info
