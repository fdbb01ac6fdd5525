"""comm.run_on_main's wait on rank 0 (base/host_wait.py), with two threads as ranks over a real gloo pair (the host
group is gloo on every backend, GPU runs included): a short call whose rank 0 hangs (a hung NFS read of the data
manifest at start-up) ends the waiting rank within the run's dist_timeout_s in one line naming rank 0's host and what
it runs, not after the host group's 6 h, node 0 named lost only when its heartbeat stalled too; known-long work
(`long=True`) waits past that bound; rank 0 gone mid-wait is the abort channel's to decide, never a crash."""

from __future__ import annotations

import datetime
import gc
import pickle
import re
import threading
import time

import pytest
import torch

from base import comm, host_wait, watcher


class FakeWatcher:
    """The abort channel's side that host_wait uses: the store (rank 0's host under `host/0`) and `post`."""

    stopped = False

    def __init__(self, beat_age=None):
        self.store = comm.dist.HashStore()
        self.store.set(watcher.key("host/0"), "node07")
        self.posted: list = []
        self.clock = time.monotonic
        # rank 0's heartbeat as the watcher last saw it move (value, when): `beat_age` s ago; None: never polled
        self.seen = {} if beat_age is None else {0: (b"17", time.monotonic() - beat_age)}

    def ask(self, fn, timeout=None):
        return fn(self.store)

    def post(self, reason, code=1):
        self.posted.append((reason, code))
        return self.posted[0][0]


@pytest.fixture
def ranks(monkeypatch):
    """`start(rank, fn)`: run `fn` as `rank` of a 2-rank world in its own thread; returns the thread's result box."""
    store = comm.dist.HashStore()
    pgs: list = [None, None]

    def make(r):
        pgs[r] = comm.dist.ProcessGroupGloo(comm.dist.PrefixStore("hw", store), r, 2, datetime.timedelta(seconds=2))

    made = [threading.Thread(target=make, args=(r,)) for r in range(2)]
    [t.start() for t in made]
    [t.join(30) for t in made]
    me = threading.local()

    def broadcast(t, src, group=None, async_op=False):
        opts = comm.dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        work = pgs[me.rank].broadcast([t], opts)
        return work if async_op else work.wait()

    def broadcast_object_list(box, src=0, group=None):  # the old run_on_main's collective, on the same gloo pair
        size = torch.zeros(1, dtype=torch.int64)
        data = torch.frombuffer(bytearray(pickle.dumps(box)), dtype=torch.uint8) if me.rank == src else None
        if data is not None:
            size[0] = data.numel()
        broadcast(size, src)
        data = data if data is not None else torch.empty(int(size[0]), dtype=torch.uint8)
        broadcast(data, src)
        box[:] = pickle.loads(data.numpy().tobytes())

    monkeypatch.setattr(comm, "initialized", lambda: True)
    monkeypatch.setattr(comm, "world", lambda group=None: 2)
    monkeypatch.setattr(comm, "rank", lambda group=None: me.rank)
    monkeypatch.setattr(comm.dist, "broadcast", broadcast)
    monkeypatch.setattr(comm.dist, "broadcast_object_list", broadcast_object_list)
    monkeypatch.setattr(comm, "_WAIT_S", 1.0, raising=False)  # the run's --dist_timeout_s
    monkeypatch.setattr(comm, "_WATCHER", None)
    threads = []

    def start(rank, fn):
        box: list = []

        def run():
            me.rank = rank
            try:
                box.append(("ok", fn()))
            except BaseException as e:  # noqa: BLE001 -- handed to the test
                box.append(("raised", e))

        t = threading.Thread(target=run, daemon=True)
        t.start()
        threads.append(t)
        return box, t

    start.pgs = pgs  # each rank's gloo group (a test drops rank 0's: its connections close, as at its death)
    yield start
    for t in threads:
        t.join(10)


def hang(ranks, monkeypatch, tmp_path, w):
    """Rank 0 hangs in a short call (its open() of a path whose read never returns) while rank 1 waits (bound 1 s):
    rank 1's box, the time it took, its error lines, what it aborted with."""
    hung = threading.Event()
    aborted: list = []
    monkeypatch.setattr(comm, "_WATCHER", w)
    monkeypatch.setattr(comm, "abort", lambda reason, code=1: aborted.append((reason, code)) or reason)
    monkeypatch.setattr(host_wait, "hard_exit", lambda code: (_ for _ in ()).throw(SystemExit(code)))
    monkeypatch.setenv("LAUNCH_LOST_FILE", str(tmp_path / "lost"))

    def read_manifest():
        hung.wait(20)
        return {"json": {}}

    ranks(0, lambda: comm.run_on_main(read_manifest))
    t0 = time.monotonic()
    box, t = ranks(1, lambda: comm.run_on_main(read_manifest))
    t.join(10)
    took = time.monotonic() - t0
    hung.set()
    return box, took, aborted


def test_a_hung_rank_0_ends_a_short_wait_in_one_line(ranks, monkeypatch, capfd, tmp_path):
    """The audit's reproduction (a FIFO as manifest.json, --dist_timeout_s 30: both ranks alive at 170 s, rank 1 in
    broadcast_object_list for the host group's 6 h), with a 1 s bound and rank 0's heartbeat stalled (100 s, past
    STALL_S): rank 1 stops at 1 s with one line naming rank 0's host and the read, posted on the abort channel, node 0
    named as lost (a requeue without it), exit 69. The old code waited the group's own timeout (2 s here), then a
    RuntimeError traceback."""
    w = FakeWatcher(beat_age=100)
    box, took, aborted = hang(ranks, monkeypatch, tmp_path, w)
    assert box and box[0][0] == "raised" and isinstance(box[0][1], SystemExit), box
    assert box[0][1].code == 69 and 0.9 <= took <= 2.5, (box, took)
    lines = [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: rank 0 (node07) hung: no answer for 1 s (--dist_timeout_s) from "
                               "tests/unit/base/test_host_wait.py:"), lines
    assert "(hang.<locals>.read_manifest)" in lines[0] and "no heartbeat for 10" in lines[0]
    assert w.posted == [(lines[0][len("error: "):], 69)] and aborted == [(lines[0][len("error: "):], 69)]
    assert (tmp_path / "lost").read_text() == "0\n"


@pytest.mark.parametrize("beat_age", [2.0, None], ids=["beating", "unknown"])
def test_a_slow_but_alive_rank_0_is_not_named_lost(ranks, monkeypatch, capfd, tmp_path, beat_age):
    """Rank 0's heartbeat moved 2 s ago (its process alive, its read stuck: a shared file system stalled for every
    node, the usual cause): exit 69 with one line saying so and what slurm.sbatch does with it (a requeue on the same
    nodes), node 0 NOT named lost: the old code wrote it to LAUNCH_LOST_FILE, a requeue that shrank the pool for
    nothing. Without a reading of the heartbeat (no poll yet) no node is named either: only a stalled one is evidence."""
    w = FakeWatcher(beat_age=beat_age)
    box, took, _ = hang(ranks, monkeypatch, tmp_path, w)
    assert box and isinstance(box[0][1], SystemExit) and box[0][1].code == 69 and 0.9 <= took <= 2.5, (box, took)
    lines = [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and w.posted == [(lines[0][len("error: "):], 69)], lines
    if beat_age is not None:
        assert re.match(r"error: rank 0 \(node07\) is alive \(heartbeat [23] s ago\) but its "
                        r"tests/unit/base/test_host_wait.py:\d+ \(hang.<locals>.read_manifest\) ", lines[0]), lines
        assert lines[0].endswith("has not answered in 1 s (--dist_timeout_s; rank 1 waited): a stalled shared file "
                                 "system? exit 69, requeued on the same nodes (slurm.sbatch; "
                                 "ULYSSES_MAX_STALLED_REQUEUES)"), lines
    assert not (tmp_path / "lost").exists()


def test_rank_0_gone_mid_wait_is_a_peer_loss_not_a_crash(ranks, monkeypatch, capfd, tmp_path):
    """Rank 0 killed during the wait (a preemption's SIGTERM before the handler is installed, a SIGKILL): rank 1's
    wait failed at once with gloo's "Connection closed by peer", re-raised into training/job.py's _fail: a traceback,
    exit 1, a crash record `first` on this healthy node (slurm.sbatch then skipped the GraceTime requeue and excluded
    it, or failed the job). Now it leaves the watcher its verdict time (LOST_STORE_S + STALL_S, scaled here), then
    exits 69 with one line, posted, naming no node lost."""
    w = FakeWatcher(beat_age=1.0)
    monkeypatch.setattr(comm, "_WAIT_S", 5.0)
    monkeypatch.setattr(comm, "_WATCHER", w)
    monkeypatch.setattr(comm, "abort", lambda reason, code=1: reason)
    monkeypatch.setattr(host_wait, "hard_exit", lambda code: (_ for _ in ()).throw(SystemExit(code)))
    monkeypatch.setattr(host_wait, "VERDICT_TICK_S", 0.05)
    monkeypatch.setattr(watcher, "LOST_STORE_S", 0.4)
    monkeypatch.setattr(watcher, "STALL_S", 0.4)
    monkeypatch.setenv("LAUNCH_LOST_FILE", str(tmp_path / "lost"))

    def listing():  # rank 0 dies in it: its group dropped, its connections close
        time.sleep(0.2)
        ranks.pgs[0] = None
        gc.collect()
        raise SystemExit(143)

    ranks(0, lambda: comm.run_on_main(listing))
    t0 = time.monotonic()
    box, t = ranks(1, lambda: comm.run_on_main(listing))
    t.join(10)
    took = time.monotonic() - t0
    assert box and box[0][0] == "raised" and isinstance(box[0][1], SystemExit) and box[0][1].code == 69, box
    assert 0.2 + 0.8 <= took <= 3.0, took  # the watcher's time to decide was left to it
    lines = [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and re.match(
        r"error: rank 0 \(node07\) went away while rank 1 waited for it in tests/unit/base/test_host_wait.py:\d+ "
        r"\(test_rank_0_gone_mid_wait_is_a_peer_loss_not_a_crash.<locals>.listing\) \(Connection closed by peer "
        r"\[127.0.0.1\]:\d+\): killed, or its node lost; not a crash of this rank$", lines[0]), lines
    assert w.posted == [(lines[0][len("error: "):], 69)] and not (tmp_path / "lost").exists()


def test_known_long_work_waits_past_the_short_bound(ranks, monkeypatch):
    """`long=True` (a universal conversion, tokenizing in the job): rank 0's 1 s of work past the 0.5 s bound is waited
    for, and every rank returns its result; a ValueError of rank 0 is raised on every rank alike."""
    monkeypatch.setattr(comm, "_WAIT_S", 0.5)

    def convert():
        time.sleep(1.0)
        return {"dir": "u", "files": {"a": 1}}

    got = [ranks(r, lambda: comm.run_on_main(convert, long=True)) for r in range(2)]
    for box, t in got:
        t.join(10)
        assert box == [("ok", {"dir": "u", "files": {"a": 1}})], box

    def refuse():
        raise ValueError("--dataset_path x: no readable manifest.json")

    got = [ranks(r, lambda: comm.run_on_main(refuse)) for r in range(2)]
    for box, t in got:
        t.join(10)
        assert box[0][0] == "raised" and isinstance(box[0][1], ValueError), box
        assert str(box[0][1]) == "--dataset_path x: no readable manifest.json"


def test_what_rank_0_runs_is_named():
    class Restore:
        def listed(self):
            return []

    assert host_wait.describe(Restore().listed).startswith("tests/unit/base/test_host_wait.py:")
    assert host_wait.describe(Restore().listed).endswith("(test_what_rank_0_runs_is_named.<locals>.Restore.listed)")
    assert host_wait.main_host(None) == "host unknown"


def stall(ranks, monkeypatch, work_s: float):
    """Rank 0 runs `work_s` of work while rank 1 waits in run_on_main: rank 1's box, time taken, error lines, posts."""
    w = FakeWatcher()
    monkeypatch.setattr(comm, "_WATCHER", w)
    monkeypatch.setattr(comm, "abort", lambda reason, code=1: reason)
    monkeypatch.setattr(host_wait, "hard_exit", lambda code: (_ for _ in ()).throw(SystemExit(code)))
    monkeypatch.delenv("LAUNCH_LOST_FILE", raising=False)

    def work():
        time.sleep(work_s)
        return 42

    ranks(0, lambda: comm.run_on_main(work))
    t0 = time.monotonic()
    box, t = ranks(1, lambda: comm.run_on_main(work))
    t.join(10)
    return box, time.monotonic() - t0, w.posted


def test_a_dist_timeout_past_the_host_groups_own_is_still_one_line(ranks, monkeypatch, capfd):
    """--dist_timeout_s above the host group's timeout (HF's --ddp_timeout 180000 > LONG_WAIT_S, 6 h; here 5 s over a
    2 s group): the group's own error came first and was re-raised, a gloo traceback ("Timed out waiting 2000ms for
    recv") after 6 h. Now the same one-line stop, exit 69."""
    monkeypatch.setattr(comm, "_WAIT_S", 5.0)
    box, took, posted = stall(ranks, monkeypatch, 2.5)
    assert box and box[0][0] == "raised" and isinstance(box[0][1], SystemExit) and box[0][1].code == 69, box
    assert 1.8 <= took <= 3.0, took
    lines = [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and lines[0].startswith("error: rank 0 (node07) hung: no answer for 2 s (LONG_WAIT_S) from "
                                                   "tests/unit/base/test_host_wait.py:"), lines
    assert [p[1] for p in posted] == [69]


def test_a_short_call_waits_at_most_long_wait_s(ranks, monkeypatch, capfd):
    """The short bound is min(--dist_timeout_s, LONG_WAIT_S): with LONG_WAIT_S scaled to 1 s, a 5 s --dist_timeout_s
    stops rank 1 at 1 s (it waited the group's 2 s and raised its error)."""
    monkeypatch.setattr(comm, "_WAIT_S", 5.0)
    monkeypatch.setattr(host_wait, "LONG_WAIT_S", 1.0)
    box, took, _ = stall(ranks, monkeypatch, 2.5)
    assert box and isinstance(box[0][1], SystemExit) and box[0][1].code == 69 and 0.9 <= took <= 1.8, (box, took)
    assert "no answer for 1 s (LONG_WAIT_S)" in capfd.readouterr().err
