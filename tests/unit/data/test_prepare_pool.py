"""prepare_data's pool (data/prepare_pool.py): results taken in input order while the workers keep pulling past a
slow head batch; finished results held bounded by bytes. A ThreadPool stands in for the processes (each batch's
cost a sleep), as the audit's balance.py did: 2 x workers batches in flight left every worker idle behind the head."""

import json
import multiprocessing.pool as mpp
import threading
import time
import types

import numpy as np

from data import prepare_data as pd
from data.prepare_pool import run_ordered
from data.store import Prepared

HEAD_S, LIGHT_S = 0.4, 0.002


def test_a_long_head_batch_leaves_no_worker_idle_and_rows_stay_in_order(tmp_path, monkeypatch):
    workers, rows = 4, 60
    with open(tmp_path / "in.jsonl", "w") as fh:
        for i in range(rows):
            fh.write(json.dumps({"input_ids": [i + 1, i + 2], "slow": i == 0}) + "\n")
    real, events, lock = pd._tokenize_batch, [], threading.Lock()

    def timed(items):
        with lock:
            events.append(("start", items[0][1], time.monotonic()))
        time.sleep(HEAD_S if b'"slow": true' in items[0][2] else LIGHT_S)
        with lock:
            events.append(("end", items[0][1], time.monotonic()))
        return real(items)

    monkeypatch.setattr(pd, "_tokenize_batch", timed)
    monkeypatch.setattr(pd, "mp", types.SimpleNamespace(get_context=lambda kind: types.SimpleNamespace(
        Pool=mpp.ThreadPool)))
    pd.prepare([str(tmp_path / "in.jsonl")], str(tmp_path / "out"), vocab_size=100, workers=workers, batch_docs=1,
               eos_id=0, log=lambda *a: None)
    head_end = next(t for kind, row, t in events if kind == "end" and row == 0)
    started = sum(kind == "start" and t < head_end for kind, row, t in events)
    assert started >= rows * 3 // 4, started  # before: 2 x workers + 1 = 9, the other workers idle behind the head
    p = Prepared(str(tmp_path / "out"))
    ids = p.tokens.read(0, len(p.tokens))
    assert ids.tolist() == [t for i in range(rows) for t in (i + 1, i + 2, 0)]  # input order, each doc + EOS


def test_finished_results_held_for_the_head_are_bounded_by_their_bytes():
    def fn(i):
        start = time.monotonic()
        time.sleep(HEAD_S if i == 0 else LIGHT_S)
        return {"i": i, "tokens": np.zeros(1000, np.uint32), "mask": None, "lens": [1000], "start": start,
                "end": time.monotonic()}

    def batches():  # reading takes time too: the reader looks at the buffer between batches
        for i in range(40):
            time.sleep(LIGHT_S / 2)
            yield i, 1

    for done_bytes, low, high in ((10_000, 0, 4 + 3), (1 << 30, 30, 40)):  # 4,000 bytes a result: ~3 held at most
        got = []
        with mpp.ThreadPool(4) as pool:
            run_ordered(pool, fn, batches(), got.append, 4, per_worker=16, done_bytes=done_bytes)
        assert [r["i"] for r in got] == list(range(40))
        started = sum(r["start"] < got[0]["end"] for r in got[1:])  # while the head ran: the running + the held
        assert low <= started <= high, (done_bytes, started)


def test_raw_rows_in_flight_are_bounded_by_their_bytes_past_one_batch_per_worker():
    """Rows over 1 MB are a batch each: 16 x workers of them were queued past a slow head (1M-token conversations,
    ~4 MB of JSON a row: ~8 GB queued at 128 workers, their ~10 GB of results arriving). Now their raw bytes in flight
    stay <= in_flight_bytes (+ the batch being read) once every worker has one; no worker waits for bytes."""
    workers, size, bound = 4, 1000, 10_000

    def fn(i):
        start = time.monotonic()
        time.sleep(HEAD_S if i == 0 else LIGHT_S)
        return {"i": i, "tokens": np.zeros(1, np.uint32), "mask": None, "lens": [1], "start": start,
                "end": time.monotonic()}

    got, peak = [], [0]

    def batches():
        for i in range(60):
            time.sleep(LIGHT_S / 2)
            peak[0] = max(peak[0], (i - len(got)) * size)  # the batches handed out and not yet consumed
            yield i, size

    with mpp.ThreadPool(workers) as pool:
        run_ordered(pool, fn, batches(), got.append, workers, per_worker=16, in_flight_bytes=bound)
    assert [r["i"] for r in got] == list(range(60))
    assert bound <= peak[0] <= bound + size, peak  # (before: 16 x 4 + 1 batches, 65,000 bytes)
    started = sum(r["start"] < got[0]["end"] for r in got[1:])  # while the head ran: every other worker kept busy
    assert started >= bound // size - 1, started
    tight = []  # a bound below one batch per worker still gives each worker one
    with mpp.ThreadPool(workers) as pool:
        run_ordered(pool, fn, ((i, size) for i in range(20)), tight.append, workers, in_flight_bytes=1)
    assert sum(r["start"] < tight[0]["end"] for r in tight[1:]) >= workers - 1
