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
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable

PER_WORKER = 16  # batches in flight per worker at most (was 2): a head batch as slow as ~16 others is hidden
DONE_BYTES = 1 << 30  # finished results held for the in-order commit at most; past it the reader waits for the head
IN_FLIGHT_BYTES = 1 << 30  # raw rows of the batches in flight at most, beyond one batch per worker (kept busy)


def result_bytes(res: dict) -> int:
    """A worker's result's size in the reading process: its tokens and mask, ~64 bytes a document of lists."""
    mask = res.get("mask")
    return res["tokens"].nbytes + (mask.nbytes if mask is not None else 0) + 64 * len(res["lens"])


def run_ordered(pool, fn: Callable, batches: Iterable, consume: Callable, workers: int,
                per_worker: int = PER_WORKER, done_bytes: int = DONE_BYTES,
                in_flight_bytes: int = IN_FLIGHT_BYTES) -> None:
    """`consume(fn(batch))` for every (batch, its raw bytes) of `batches`, in input order; `fn` runs in `pool` (a
    multiprocessing Pool; None: in this process). In flight at most per_worker x workers batches, and past one per
    worker, in_flight_bytes of them; finished results held at most done_bytes. A worker's exception is raised here, at
    its batch's turn."""
    if pool is None:
        for batch, _ in batches:
            consume(fn(batch))
        return
    pending: deque = deque()  # (the batch's result, its raw bytes)
    held, lock, queued = [0], threading.Lock(), [0]  # bytes of finished results not yet consumed; of raw rows in flight

    def finished(res: dict) -> None:  # the pool's result thread, before the result's get() returns
        with lock:
            held[0] += result_bytes(res)

    def take() -> None:
        got, size = pending.popleft()
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
