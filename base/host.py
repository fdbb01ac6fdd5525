"""Readings of this host: the process' own peak memory (torch-free, so the planner can use it)."""

from __future__ import annotations

import resource
import sys


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


