"""A rank's first connection to the job's store as one bounded wait, counted from the rank's start.

torch's TCPStore client is not bounded by its `timeout`: after a connect that fails for `timeout` it retries once
more after a random delay (TCPStore.cpp: "TCP client failed to connect/validate ... retrying (try=0, timeout=...,
delay=...)"), so a 300 s timeout waited 600-900 s (measured here with torch 2.13: timeout 1 s -> 2.2 s, 3 s -> 8 s),
and a node 1 whose node 0 never started its store was still waiting after 381 s with no line naming anyone (issue
48). base/comm.py's `_connect` waits instead until `deadline` at most: a plain TCP connect is tried until the port
accepts (each try bounded by what is left), then torch's handshake runs in a daemon thread waited for what is left
(its constructor releases the GIL); a thread still inside torch's retry at the deadline is left to the exit.

The deadline is START_WAIT_S (5 min, ULYSSES_START_WAIT_S) from the rank's start (/proc/self/stat), so a slow import
counts against it, and at least MIN_CONNECT_S from now. No torch.distributed here (base/comm.py owns it).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable

MIN_CONNECT_S = 1.0  # a rank that started later than its bound still tries this long


def rank_age_s() -> float:
    """Seconds since this process started (/proc/self/stat starttime, on the boot clock); 0 where unknown."""
    try:
        with open("/proc/self/stat") as fh:
            ticks = int(fh.read().rpartition(")")[2].split()[19])
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return 0.0


def deadline(wait_s: float) -> float:
    """The monotonic time by which this rank's first connection must have succeeded: `wait_s` from the rank's start
    (its imports count), at least MIN_CONNECT_S from now. Monotonic is system-wide: a forked child shares it."""
    return time.monotonic() + max(wait_s - rank_age_s(), min(wait_s, MIN_CONNECT_S))


def wait_for_port(addr: str, port: int, by: float) -> None:
    """Return once addr:port accepts a TCP connection; TimeoutError naming the last error at `by` (monotonic)."""
    last: OSError | None = None
    while True:
        left = by - time.monotonic()
        if left <= 0:
            why = str(last).strip().splitlines()[0] if last else "nothing accepted the connection"
            raise TimeoutError(f"no answer: {why}")
        try:
            socket.create_connection((addr, port), timeout=min(left, 10.0)).close()
            return
        except OSError as e:
            last = e
        time.sleep(max(0.0, min(0.5, by - time.monotonic())))


def by_deadline(fn: Callable, by: float, what: str):
    """fn() in a daemon thread, waited for until `by` (monotonic); its result, its exception, or TimeoutError(what)."""
    box: list = []

    def run() -> None:
        try:
            box.append((True, fn()))
        except BaseException as e:  # noqa: BLE001 -- handed to the caller
            box.append((False, e))

    t = threading.Thread(target=run, name="store-connect", daemon=True)
    t.start()
    t.join(max(0.0, by - time.monotonic()))
    if not box:
        raise TimeoutError(what)
    ok, value = box[0]
    if not ok:
        raise value
    return value
