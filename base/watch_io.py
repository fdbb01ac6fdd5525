"""The abort channel's bounded I/O, which base/watcher.py's protocol runs on: a store request made by one daemon
thread (`_Asker`), so that a store that never answers (rank 0's process stopped, its node gone without a TCP reset)
blocks that thread and not the watcher; a line on stderr (`_say`), in the rank log or in the node launcher's folder
(`tell_launcher`), each written in a thread waited for at most its bound (`_bounded`: stderr may be a full pipe into
slurm-%j.out, the log and the launcher's folder on a file system that hangs, and an unbounded write would block the
watcher's os._exit); and the text of those lines (`one_line`, `_ranges`, `_hostname`).

Cost: one daemon thread per watcher for its requests (TCPStore's own timeout does not bound add/multi_get/set on a
silent server), one short-lived thread per bounded write (a handful per exit). Nothing here knows the channel's keys
or timings but LOG_WRITE_S (the launcher's file is bounded by it here; a patch of base.watcher.LOG_WRITE_S bounds the
watcher's own rank-log line only). base/watcher.py imports every name back: base/comm_channel.py, node_store.py,
host_wait.py and store_limits.py call them through it.
"""

from __future__ import annotations

import os
import queue
import sys
import threading

LOG_WRITE_S = 2.0  # the watcher's rank-log line before its hard exit (the log is on the shared file system)


class _Asker:
    """One daemon thread that makes the store requests: a request to a store that never answers (rank 0's process
    stopped, its node gone without a TCP reset) blocks there, not in the caller, which gives up after `timeout`
    (TCPStore's own timeout does not bound add/multi_get/set on a silent server: measured)."""

    def __init__(self):
        self.jobs: queue.Queue = queue.Queue()
        threading.Thread(target=self._run, name="abort-store", daemon=True).start()

    def _run(self) -> None:
        while True:
            fn, box = self.jobs.get()
            try:
                box.put((True, fn()))
            except BaseException as e:  # noqa: BLE001 -- handed to the caller
                box.put((False, e))

    def __call__(self, fn, timeout: float):
        box: queue.Queue = queue.Queue(1)
        self.jobs.put((fn, box))
        try:
            ok, value = box.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no answer from the store in {timeout:.0f} s") from None
        if not ok:
            raise value
        return value


def _ranges(ranks: list[int]) -> str:
    """[3] -> "rank 3"; [8, 9, 10, 12] -> "ranks 8-10, 12" (at most 8 runs shown)."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs[:8]) + (", ..." if len(runs) > 8 else "")
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"


def _hostname() -> str:
    import socket

    return socket.gethostname()


def one_line(e: BaseException | str) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else ""


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def tell_launcher(rank: int, what: str) -> None:
    """Leave this node's scripts/launch.sh what this rank knows of the job's store as it exits, in
    `$LAUNCH_EXIT_DIR/store<RANK>` (a node-local temp folder; nothing without it): `abort REASON`, the reason on record
    (the store answered: the launcher's own post then waits briefly for a store that may have gone since, node 0's
    launcher ending as soon as every rank has read it), or `gone` (unreachable: nothing to post to). Without it a
    launcher whose ranks read node 0's abort waited 37 s (torch's connect retries) to find that store gone."""
    where = os.environ.get("LAUNCH_EXIT_DIR")
    if not where:
        return

    def write(text: str) -> None:
        try:
            tmp = os.path.join(where, f".store{rank}.{os.getpid()}")
            with open(tmp, "w") as fh:
                fh.write(text + "\n")
            os.replace(tmp, os.path.join(where, f"store{rank}"))
        except OSError:
            pass

    _bounded(write, one_line(what), LOG_WRITE_S)


def _bounded(fn, arg, timeout_s: float) -> None:
    """fn(arg) in a daemon thread, waited for at most `timeout_s` (a write to a file system that hangs)."""
    t = threading.Thread(target=fn, args=(arg,), name="abort-log", daemon=True)
    t.start()
    t.join(timeout_s)
