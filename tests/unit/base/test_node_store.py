"""base/node_store.py's `post --wait` (node 0's launcher after a failure) with a store stand-in and a fake clock:
it keeps the job's store while live ranks may still read the reason, but a rank whose heartbeat has stopped has
left, and so, the abort being EXIT_PEER_LOST, has a rank that never arrived; a node gone that way is named lost."""

from __future__ import annotations

from base import node_store
from base.exits import EXIT_PEER_LOST
from base.watcher import DONE, key


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


class Store:
    """The TCPStore calls post() makes. `beating`: ranks whose heartbeat advances at every read (alive);
    `done_at`: rank -> the time it marks itself done."""

    def __init__(self, clock, values: dict[str, str], beating=(), done_at=None):
        self.clock, self.kv = clock, {k: v.encode() for k, v in values.items()}
        self.beating, self.done_at = set(beating), done_at or {}

    def set(self, k, v):
        self.kv[k] = str(v).encode()

    def compare_set(self, k, expected, desired):
        if self.kv.get(k, b"") == expected.encode():
            self.kv[k] = desired.encode()
        return self.kv[k]

    def check(self, keys):
        return all(k in self.kv for k in keys)

    def multi_get(self, keys):
        for r in self.beating:
            name = key(f"hb/{r}")
            if self.done_at.get(r, float("inf")) <= self.clock():
                self.kv[name] = DONE
            elif self.kv.get(name) != DONE:
                self.kv[name] = str(int(self.kv.get(name, b"0")) + 1).encode()
        return [self.kv[k] for k in keys]


def run(store, clock, code=EXIT_PEER_LOST, nnodes=3):
    t0 = clock()
    got = node_store.post("a", 1, code, "node 0: its ranks exited", 0, nnodes, 2, wait=True, store=store, clock=clock,
                          sleep=clock.sleep)
    return got, clock() - t0


def test_a_lost_nodes_ranks_have_left_and_the_node_is_named():
    """The issue's case: node 2 SIGKILLed (its ranks' heartbeats frozen, its launcher gone: no node_exit), rank 0
    ended the job with 69; node 1's ranks read the abort and mark themselves done 3 s later. Node 0's launcher
    leaves STALE_S after it starts looking, naming node 2 (it used to wait LATE_JOIN_S, 300 s)."""
    clock = Clock()
    store = Store(clock, {key("abort"): f"{EXIT_PEER_LOST} rank 4 stopped responding", key("hb/0"): "done",
                          key("hb/1"): "done", key("hb/4"): "37", key("hb/5"): "36"},
                  beating={2, 3}, done_at={2: 3.0, 3: 3.0})
    (reason, lost, absent), took = run(store, clock)
    assert reason == "rank 4 stopped responding" and lost == [2] and absent == []
    assert node_store.STALE_S <= took <= node_store.STALE_S + 2, took
    assert store.kv[key("node_exit/0")] == str(EXIT_PEER_LOST).encode()


def test_live_ranks_are_waited_for_and_no_node_is_lost():
    """Every other rank alive: the wait lasts until they are done (20 s here, past STALE_S: a beating rank is not
    stale), and nobody is named lost."""
    clock = Clock()
    store = Store(clock, {key("abort"): "1 rank 0 failed: RuntimeError: x", key("hb/0"): "done", key("hb/1"): "done",
                          **{key(f"hb/{r}"): "1" for r in (2, 3, 4, 5)}}, beating={2, 3, 4, 5}, done_at={2: 5.0, 3: 20.0, 4: 1.0, 5: 2.0})
    (reason, lost, absent), took = run(store, clock, code=1)
    assert reason == "rank 0 failed: RuntimeError: x" and lost == absent == []
    assert 20 <= took <= 22, took


def test_a_rank_that_never_arrived():
    """A crash (1) during start-up: a node still on its way may yet come to read the reason: waited for,
    LATE_JOIN_S (the start bound, START_WAIT_S) at most. After a peer was lost (69, e.g. rank 0 gave up on that node):
    it has left, and is named absent, not lost: none of its ranks ever arrived, which a node slow to start (an image
    pull, a cold file-system client) does too; slurm.sbatch excludes it only on evidence. It used to be named lost,
    and excluded from the job at once."""
    assert node_store.LATE_JOIN_S == node_store.START_WAIT_S
    for code, late in ((1, True), (EXIT_PEER_LOST, False)):
        clock = Clock()
        store = Store(clock, {key("abort"): f"{code} why", key("hb/0"): "done", key("hb/1"): "done",
                              key("hb/2"): "done", key("hb/3"): "done", key("hb/4"): "0"})  # rank 5: no key yet
        (_, lost, absent), took = run(store, clock, code=code)
        if late:
            assert took >= node_store.LATE_JOIN_S and lost == absent == [], (code, took, lost, absent)
        else:
            assert took < 2 and lost == [] and absent == [2], (code, took, lost, absent)


def test_a_node_where_one_rank_arrived_is_lost_not_absent():
    """Node 2: rank 4 arrived and stopped beating, rank 5 never arrived: the node ran, then went: lost."""
    clock = Clock()
    store = Store(clock, {key("abort"): f"{EXIT_PEER_LOST} why", key("hb/0"): "done", key("hb/1"): "done",
                          key("hb/2"): "done", key("hb/3"): "done", key("hb/4"): "7", key("hb/5"): "0"})
    (_, lost, absent), _ = run(store, clock)
    assert lost == [2] and absent == []


def test_a_node_that_posted_its_exit_is_not_lost():
    """Node 1's launcher posted (its ranks died: a crash there, not a loss): its frozen heartbeats are not waited
    for and it is not named lost."""
    clock = Clock()
    store = Store(clock, {key("abort"): f"{EXIT_PEER_LOST} x", key("node_exit/1"): "1", key("hb/0"): "done",
                          key("hb/1"): "done", key("hb/2"): "9", key("hb/3"): "9", key("hb/4"): "done",
                          key("hb/5"): "done"})
    (_, lost, absent), took = run(store, clock)
    assert lost == absent == [] and took < 2, (lost, took)


def test_the_lost_file_names_lost_and_absent_nodes_apart(tmp_path, monkeypatch):
    """What slurm.sbatch reads (`--lost-file`): a lost node's index alone, an absent one's as `K absent`; exit 69."""
    monkeypatch.setattr(node_store, "post", lambda *a, **k: ("rank 2 never arrived", [1], [3]))
    monkeypatch.setattr(node_store.signal, "signal", lambda *a: None)  # main() ignores Slurm's signals: not pytest's
    f = tmp_path / "lost"
    code = node_store.main(["post", "a", "1", "69", "why", "--node", "0", "--nnodes", "4", "--ranks-per-node", "2",
                            "--wait", "--lost-file", str(f)])
    assert code == EXIT_PEER_LOST and f.read_text() == "1\n3 absent\n"


def test_a_launcher_whose_ranks_read_the_reason_does_not_wait_for_a_store_that_has_ended(monkeypatch, capsys):
    """A node's ranks stopped on node 0's abort (read from its store); node 0's launcher ended as soon as they had
    read it, so this launcher's post finds nothing listening. It used to wait 37 s in torch's connect retries, a C++
    stack in the node's log: now KNOWN_CONNECT_S and one line, the reason on record kept, exit 0. Without that
    knowledge (node 0's store may still be starting) it waits CONNECT_S as before."""
    import socket
    import time

    from tests.distributed import free_port

    monkeypatch.setattr(node_store.signal, "signal", lambda *a: None)
    port = free_port()
    with socket.socket() as s:  # nothing listens on `port`
        s.bind(("127.0.0.1", 0))
    args = ["post", "127.0.0.1", str(port), "1", "node 1: its ranks exited 1", "--node", "1", "--nnodes", "2",
            "--ranks-per-node", "1"]
    t0 = time.monotonic()
    code = node_store.main([*args, "--known=node 0: its ranks exited 1 (that node's log has the cause)"])
    took = time.monotonic() - t0
    err = capsys.readouterr().err
    assert code == 0 and took < node_store.KNOWN_CONNECT_S + 2, (code, took, err)
    assert "node_store: abort on record: node 0: its ranks exited 1 (that node's log has the cause)\n" in err, err
    monkeypatch.setattr(node_store, "CONNECT_S", 1.0)
    t0 = time.monotonic()
    assert node_store.main(args) == 1 and 1.0 <= time.monotonic() - t0 < 3
    assert "could not post the failure (nothing answers on 127.0.0.1:" in capsys.readouterr().err


def test_a_store_that_starts_late_is_still_reached():
    """Why a launcher that knows nothing of the store still waits CONNECT_S: node 0's store may start after another
    node's ranks died at their import (a cold file system on node 0). A listener that appears 1 s into the wait is
    reached; the wait ends when it answers, not at its bound."""
    import threading
    import time

    from base.comm import TCPStore
    from tests.distributed import free_port

    port, servers = free_port(), []
    late = threading.Timer(1.0, lambda: servers.append(TCPStore("127.0.0.1", port, is_master=True,
                                                                wait_for_workers=False)))
    late.start()
    t0 = time.monotonic()
    assert node_store.reachable("127.0.0.1", port, 10.0) and 0.9 <= time.monotonic() - t0 < 5
    late.join(10)  # (the store listens inside its constructor: reached before the constructor returns)
    assert servers
