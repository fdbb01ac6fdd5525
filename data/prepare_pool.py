"""prepare_data's worker pool, its results taken in input order (a chunk is committed at a row position, and resume
starts after it) while the workers keep pulling batches.

Before, at most 2 x workers batches were in flight: one slow batch at the head (a long conversation, data/chat.py
renders its template once per turn's prefix) left every other worker idle until it finished (32 workers, 10 rows
of 10 s among light ones: 112 s of wall where ~10 s would do). Now up to PER_WORKER x workers batches are in
flight, and the finished ones wait for the head in a reorder buffer bounded by their bytes (DONE_BYTES).

Host memory of the reading process at 32 workers: 512 batches of raw rows (a batch closes at 1 MB: <= ~0.5 GB, a
single longer row excepted) plus <= 1 GiB of finished results (tokens, masks), ~1.5 GB, against the ~16 GB the
workers' tokenizers take (~0.5 GB each).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable

PER_WORKER = 16  # batches in flight per worker at most (was 2): a head batch as slow as ~16 others is hidden
DONE_BYTES = 1 << 30  # finished results held for the in-order commit at most; past it the reader waits for the head


def result_bytes(res: dict) -> int:
    """A worker's result's size in the reading process: its tokens and mask, ~64 bytes a document of lists."""
    mask = res.get("mask")
    return res["tokens"].nbytes + (mask.nbytes if mask is not None else 0) + 64 * len(res["lens"])


def run_ordered(pool, fn: Callable, batches: Iterable, consume: Callable, workers: int,
                per_worker: int = PER_WORKER, done_bytes: int = DONE_BYTES) -> None:
    """`consume(fn(batch))` for every batch, in input order; `fn` runs in `pool` (a multiprocessing Pool; None: in
    this process). A worker's exception is raised here, at its batch's turn."""
    if pool is None:
        for batch in batches:
            consume(fn(batch))
        return
    pending: deque = deque()
    held, lock = [0], threading.Lock()  # bytes of finished results not yet consumed

    def finished(res: dict) -> None:  # the pool's result thread, before the result's get() returns
        with lock:
            held[0] += result_bytes(res)

    def take() -> None:
        res = pending.popleft().get()
        with lock:
            held[0] -= result_bytes(res)
        consume(res)

    for batch in batches:
        pending.append(pool.apply_async(fn, (batch,), callback=finished))
        while pending and pending[0].ready():  # the head is done: commit it and whatever follows, done too
            take()
        while len(pending) > per_worker * workers or held[0] > done_bytes:  # bounded: wait for the head
            take()
    while pending:
        take()
