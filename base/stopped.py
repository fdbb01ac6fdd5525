"""The seconds this process spent stopped (SIGSTOP: `scontrol suspend`, gang scheduling's PreemptMode=SUSPEND,GANG; a
debugger), so that a time measured across a stop counts only its running part.

The monotonic clock (time.monotonic, time.perf_counter) runs on while a process is stopped. Slurm moves the job's
EndTime later by the suspended time at the resume (src/slurmctld/job_mgr.c: end_time = now + limit - pre_sus_time),
so a step, save or evaluation timed across a suspend is that much longer than any the job will run again: kept as the
longest (training/preemption.py Deadline), one 2 h suspend inside a step stopped the job 2 h early for the rest of the
allocation (the extension thrown away), and a save's blocked time read 100 x longer made `auto`'s save interval
100 x the suspend (no timed save for 100 h after a 1 h suspend).

How: one daemon thread (started at the first use, never at import) wakes every TICK_S. A look (the thread's, or a
reader's) that comes LATE_S or more after it was due, while the process used less than CPU_SHARE of that lateness in
CPU time (all its threads together), was a stop: the lateness is added, placed as early in that look's interval as it
can lie (a window never holds more of it than it can have). A look late while the process ran is not a stop: a thread
starved of the GIL (DeepSpeed's CPU Adam holds it for a whole sub-group, base/watcher.py) waits while the holder's CPU
time runs on. Every reader looks first, so a read right after the SIGCONT, before the thread woke, counts the stop
too.

What it misses (the interval then counts the stop, as it did before): a stop shorter than LATE_S; one shorter than the
CPU time the process burns in one tick over CPU_SHARE (a GPU rank spinning on a synchronize and NCCL's proxy, ~2
cores: stops under ~20 s); the first ~TICK_S of each stop. Either way a time is over-counted, never under-counted,
except where a thread holds the GIL while it sleeps in the kernel for LATE_S or more with the process idle (no
collective, synchronize or file read of torch's holds it so): that stretch would be taken off as a stop. Cost: one
wake a second, two clock reads; each reader one lock and two clock reads. Per process: every rank counts its own
stops; the decisions they feed are rank 0's (training/preemption.py agreed()).
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque

TICK_S = 1.0  # how often the thread looks
LATE_S = 3.0  # a look this much later than due: a stop (or a starved thread: see CPU_SHARE)
CPU_SHARE = 0.1  # ... a stop only when the process's CPU time over the look's interval is below this x the lateness
KEEP = 256  # the stops kept for `within` (a window reaches back one step, save or evaluation: a few stops at most)


class StopCounter:
    """Counts this process's stops. Clocks injectable: tests look with `observe()` at fake times, no thread."""

    def __init__(self, clock=time.monotonic, cpu=time.process_time, tick_s: float = TICK_S, autostart: bool = True):
        self.clock, self.cpu, self.tick_s, self.autostart = clock, cpu, tick_s, autostart
        self.total_s = 0.0  # the stopped seconds counted so far
        self.stops: deque[tuple[float, float]] = deque(maxlen=KEEP)  # (start, end) of each stop, on `clock`
        self._lock = threading.Lock()
        self._last, self._last_cpu = clock(), cpu()
        self._pid: int | None = None  # the process whose thread looks (a forked child starts its own)

    def start(self) -> StopCounter:
        """Start the looking thread (once per process; a no-op when it runs or `autostart` is off)."""
        if not self.autostart or self._pid == os.getpid():
            return self
        with self._lock:
            if self._pid == os.getpid():
                return self
            self._pid = os.getpid()
            self._last, self._last_cpu = self.clock(), self.cpu()  # unwatched until now: nothing counted before
        threading.Thread(target=self._run, name="stopped-time", daemon=True).start()
        return self

    def _run(self) -> None:
        while True:
            time.sleep(self.tick_s)
            self.observe()

    def observe(self) -> tuple[float, float]:
        """Look now: a stop since the last look is counted (module docstring). (now, the stopped seconds so far)."""
        with self._lock:
            now, cpu = self.clock(), self.cpu()
            late = now - self._last - self.tick_s
            if late >= LATE_S and cpu - self._last_cpu < CPU_SHARE * late:
                self.stops.append((self._last, self._last + late))  # as early as it can lie (module docstring)
                self.total_s += late
            self._last, self._last_cpu = now, cpu
            return now, self.total_s

    def _look(self) -> tuple[float, float]:
        """observe(), the thread started first if it was not (a reader's look before it runs counts nothing)."""
        return self.start().observe()

    def now(self) -> float:
        """A clock that stands still while this process is stopped: `clock` less the stopped seconds counted. For an
        interval read at both ends (training/step.py's step time)."""
        now, total = self._look()
        return now - total

    def within(self, seconds: float) -> float:
        """The stopped seconds within the last `seconds` (an interval that ends now)."""
        now, _ = self._look()
        since = now - max(seconds, 0.0)
        return sum(max(0.0, min(end, now) - max(start, since)) for start, end in list(self.stops))

    def running(self, seconds: float) -> float:
        """`seconds` (an interval that ends now) less the stopped seconds within it."""
        return max(0.0, seconds - self.within(seconds))


COUNTER = StopCounter()  # this process's (its thread starts at the first read or start())


def now() -> float:
    return COUNTER.now()
