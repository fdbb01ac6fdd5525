"""prepare_data's worker pool, its results taken in input order (a chunk is committed at a row position, and resume
starts after it) while the workers keep pulling batches.

Before, at most 2 x workers batches were in flight: one slow batch at the head (a long conversation, data/chat.py
renders its template once per turn's prefix) left every other worker idle until it finished (32 workers, 10 rows
of 10 s among light ones: 112 s of wall where ~10 s would do). Now up to PER_WORKER x workers batches are in
flight, and the finished ones wait for the head in a reorder buffer bounded by their bytes (DONE_BYTES).

Host memory of the reading process: the raw rows of the batches in flight are bounded by their bytes too
(IN_FLIGHT_BYTES beyond one batch per worker: a row over BATCH_BYTES is a batch of its own, and 16 x workers of them
were queued), and their results (tokens, masks) come only from those batches, the finished ones held <= DONE_BYTES.
Short rows (1 MB batches): <= 1 GiB + 1 MB queued and <= ~1.3 GB of results, ~2.3 GB at any worker count. 1M-token
conversations (~4 MB of JSON a row, ~5 MB of result): ~1 GiB queued (~256 rows) and <= ~1.3 GB of results, ~2.3 GB at
W=32 and at W=128 alike (before: ~2 + 2.5 GB at W=32, ~8 + 10 GB at W=128); past ~256 workers, one 4 MB row each and
its result, ~9 MB a worker. Against the ~0.5 GB each worker's tokenizer takes (16 GB at 32).

A worker that dies (the cgroup's out-of-memory killer SIGKILLs one process, a segfault in a tokenizer) never finishes
its batch: Pool starts a replacement and the batch's get() waited forever, holding the shard's lock for the rest of the
allocation (a requeue hung again at the same row). The head is waited on POLL_S at a time, and between waits the
workers the pool started are looked at: one gone ends the run in one line (`WorkerDied`), and the same command resumes
after the last committed chunk. Cost: one waitpid(WNOHANG) a worker a second, only while the head is unfinished.
"""

from __future__ import annotations

import signal
import threading
from collections import deque
from collections.abc import Callable, Iterable

PER_WORKER = 16  # batches in flight per worker at most (was 2): a head batch as slow as ~16 others is hidden
DONE_BYTES = 1 << 30  # finished results held for the in-order commit at most; past it the reader waits for the head
IN_FLIGHT_BYTES = 1 << 30  # raw rows of the batches in flight at most, beyond one batch per worker (kept busy)
POLL_S = 1.0  # a dead worker is seen within this long of the reader waiting on the head


class WorkerDied(ValueError):
    """A pool worker ended mid-run (its batch lost): one line for the user (a ValueError: prepare_data's exit 2)."""

    def __init__(self, exitcode: int, workers: int, committed: int):
        sig = -exitcode if -exitcode in signal.valid_signals() else None
        how = (f"was killed (signal {sig}, {signal.Signals(sig).name}" if sig else f"ended (exit code {exitcode}") + (
            f": likely out of memory with {workers} workers): give fewer --workers or more memory"
            if sig == signal.SIGKILL else "): its error is above, if it printed one")
        super().__init__(f"a tokenizer worker {how}; the same command resumes after its {committed} committed chunk(s)")


def dead_worker(procs: list) -> int | None:
    """The exit code of the first of `procs` (the pool's worker processes as started) that has ended, else None."""
    return next((p.exitcode for p in procs if p.exitcode is not None), None)


def result_bytes(res: dict) -> int:
    """A worker's result's size in the reading process: its tokens and mask, ~64 bytes a document of lists."""
    mask = res.get("mask")
    return res["tokens"].nbytes + (mask.nbytes if mask is not None else 0) + 64 * len(res["lens"])


def run_ordered(pool, fn: Callable, batches: Iterable, consume: Callable, workers: int,
                per_worker: int = PER_WORKER, done_bytes: int = DONE_BYTES,
                in_flight_bytes: int = IN_FLIGHT_BYTES, committed: Callable[[], int] = lambda: 0) -> None:
    """`consume(fn(batch))` for every (batch, its raw bytes) of `batches`, in input order; `fn` runs in `pool` (a
    multiprocessing Pool; None: in this process). In flight at most per_worker x workers batches, and past one per
    worker, in_flight_bytes of them; finished results held at most done_bytes. A worker's exception is raised here, at
    its batch's turn; a worker that died, as WorkerDied (`committed()`: the chunks the same command resumes after)."""
    if pool is None:
        for batch, _ in batches:
            consume(fn(batch))
        return
    pending: deque = deque()  # (the batch's result, its raw bytes)
    held, lock, queued = [0], threading.Lock(), [0]  # bytes of finished results not yet consumed; of raw rows in flight
    # the workers as started: Pool keeps its worker Process objects in the private `_pool` (CPython since 2.6) and
    # drops a dead one from it within 0.1 s (its replacement added), so the list is copied now; a Process keeps its
    # exit code once reaped. A ThreadPool's threads (tests) read None while alive
    procs = list(getattr(pool, "_pool", []))

    def finished(res: dict) -> None:  # the pool's result thread, before the result's get() returns
        with lock:
            held[0] += result_bytes(res)

    def take() -> None:
        got, size = pending.popleft()
        got.wait(POLL_S)  # (returns None: ready() says whether it finished)
        while not got.ready():  # no batch of a live pool is lost: only a dead worker's never finishes
            if (code := dead_worker(procs)) is not None:
                raise WorkerDied(code, workers, committed())
            got.wait(POLL_S)
        res = got.get()
        queued[0] -= size
        with lock:
            held[0] -= result_bytes(res)
        consume(res)

    for batch, size in batches:
        pending.append((pool.apply_async(fn, (batch,), callback=finished), size))
        queued[0] += size
        while pending and pending[0][0].ready():  # the head is done: commit it and whatever follows, done too
            take()
        while len(pending) > per_worker * workers or held[0] > done_bytes or (  # bounded: wait for the head
                len(pending) > workers and queued[0] > in_flight_bytes):
            take()
    while pending:
        take()
