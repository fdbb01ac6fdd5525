"""The process environment DeepSpeed's JIT-built ops need, set by `configure()` (train.py, set-up, tests), never
at import.

TORCH_EXTENSIONS_DIR: DeepSpeed's JIT-built ops (CPU Adam, the shared-memory comm op) go to this checkout's own
`.cache/torch_extensions` unless it is set: torch serializes JIT builds with a `lock` file and waits for it to
disappear with no time limit, so one process killed mid-build in the shared `~/.cache/torch_extensions` (or
another checkout rebuilding there with its own include paths) would stall every later launch on the machine.
`scripts/setup.sh` builds the ops there once.

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

EXTENSIONS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache", "torch_extensions")


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
