"""The abort channel (base/watcher.py's Watcher and base/comm.py's channel functions), driven without training: a real
TCPStore and a fake clock for the protocol (a posted failure, a silent rank, a lost store, a rank that never arrives,
a hung log or stderr; tests/unit/base/fake_channel.py). A suspended job: test_suspend.py; the descriptor limit
raised, a world the store cannot hold and torchrun's agent: test_fd_limit.py."""

from __future__ import annotations

import subprocess

import pytest

from base import comm, watcher
from base.exits import EXIT_PEER_LOST
from tests.distributed import ROOT
from tests.unit.base.fake_channel import Exits, open_fake_channel, run_for

# --- the abort channel (base/watcher.py's Watcher), driven without processes: a real TCPStore, a fake clock ---


@pytest.fixture
def channel(monkeypatch):
    yield from open_fake_channel(monkeypatch)


def test_a_posted_failure_stops_every_other_rank_with_its_line(channel):
    make, clock, _ = channel
    (w0, ex0), (w1, ex1), (w2, ex2) = make(0), make(1), make(2)
    for w in (w0, w1, w2):
        w.poll()
    assert ex0 == ex1 == ex2 == []
    assert w2.post("rank 2 failed: RuntimeError: boom", 1) == "rank 2 failed: RuntimeError: boom"
    # a later failure (a rank whose collective broke because rank 2 left) does not replace the cause
    assert w1.post("rank 1 failed: gloo closed", 1) == "rank 2 failed: RuntimeError: boom"
    w0.poll()
    w1.poll()
    assert ex0 == ex1 == ["stopping: rank 2 failed: RuntimeError: boom", 1]
    assert w0.store.get(watcher.key("hb/1")) == watcher.DONE  # rank 1 marked itself done before exiting


def test_an_input_error_stops_the_others_with_its_exit_code(channel):
    make, _, _ = channel
    (w0, ex0), (w1, ex1) = make(0), make(1)
    w0.post("rank 0 stopped on an input error", 2)
    w1.poll()
    assert ex0 == [] and ex1 == ["stopping: rank 0 stopped on an input error", 2]


def test_rank0_declares_a_silent_rank_failed_after_stall_s(channel):
    make, clock, _ = channel
    (w0, ex0), (w1, ex1), _ = make(0), make(1), make(2)
    w0.poll()
    for _ in range(int(watcher.STALL_S // 10)):  # rank 1 heartbeats, rank 2 is silent (SIGKILL, hang, node lost)
        clock.t += 10
        w1.poll()
        w0.poll()
        if ex0:
            break
    assert ex0 == [f"stopping: rank 2 stopped responding: no heartbeat for {watcher.STALL_S:.0f} s (killed, hung, or "
                   "its node was lost)", EXIT_PEER_LOST]
    w1.poll()
    assert ex1[-1] == EXIT_PEER_LOST and ex1[0].startswith("stopping: rank 2 stopped responding")


def test_a_rank_that_left_cleanly_is_never_declared_silent(channel):
    make, clock, _ = channel
    (w0, ex0), (w1, _), (w2, _) = make(0), make(1), make(2)
    w0.poll()
    w1._mark_done()  # what comm.leave() does on a clean exit (0, or 75 after the save)
    w1.stop()
    for _ in range(10):
        clock.t += watcher.STALL_S / 2
        w2.poll()
        w0.poll()
    assert ex0 == []


def test_the_others_watch_rank0s_heartbeat(channel):
    make, clock, _ = channel
    _, (w1, ex1) = make(0), make(1)
    w1.poll()
    run_for(clock, watcher.STALL_S, w1)  # rank 0 alive (the store answers) but its heartbeat stalled: a hang
    assert ex1 and ex1[0].startswith("stopping: rank 0 stopped responding") and ex1[-1] == EXIT_PEER_LOST


def test_a_lost_store_stops_a_rank_after_the_grace_only(channel):
    make, clock, _ = channel
    w1, ex1 = make(1)

    class Gone:
        def __getattr__(self, name):
            def fail(*a, **k):
                raise comm.dist.DistNetworkError("connection refused")
            return fail

    real = w1.store
    w1.store = Gone()
    w1.poll()
    run_for(clock, watcher.LOST_STORE_S - 1, w1, step=1)
    assert ex1 == []
    w1.store = real  # it came back: the grace starts again
    w1.poll()
    w1.store = Gone()
    clock.t += 1
    w1.poll()
    run_for(clock, watcher.LOST_STORE_S - 1, w1, step=1)
    assert ex1 == []
    clock.t += 1
    w1.poll()
    assert ex1[-1] == EXIT_PEER_LOST and "store (hosted by rank 0) has been unreachable for 20 s" in ex1[0], ex1


def test_a_stopped_watcher_never_exits_the_process(channel):
    make, clock, _ = channel
    (w0, _), (w1, ex1) = make(0), make(1)
    w1.stop()  # this rank is on its own way out (a clean exit, or its own failure being reported)
    w0.post("rank 0 failed: x", 1)
    w1.poll()
    clock.t += 10 * watcher.STALL_S
    w1.poll()
    assert ex1 == []


def test_rank0_waits_for_ranks_still_leaving_before_its_store_goes(channel):
    make, clock, _ = channel
    (w0, _), (w1, _), (w2, _) = make(0), make(1), make(2)
    w1._mark_done()
    ticks = []

    def sleep(s):  # rank 2 still heartbeats for 3 ticks, then leaves
        ticks.append(s)
        clock.t += 1
        w2.store.add(watcher.key("hb/2"), 1)
        if len(ticks) == 3:
            w2._mark_done()

    w0.sleep = sleep
    w0.peers_done(watcher.LEAVE_WAIT_S)
    assert len(ticks) == 3


def test_rank0_does_not_wait_for_a_silent_rank_beyond_stall_s(channel):
    make, clock, _ = channel
    (w0, _), (w1, _), _ = make(0), make(1), make(2)
    ticks = []
    w0.sleep = lambda s: (ticks.append(s), setattr(clock, "t", clock.t + 1))
    w1._mark_done()
    w0.peers_done(watcher.LEAVE_WAIT_S)  # rank 2 never heartbeats again
    assert watcher.STALL_S - 1 <= len(ticks) <= watcher.STALL_S + 1


def test_a_store_that_never_answers_is_lost_too(channel, monkeypatch):
    """Rank 0's process stopped (or its node gone without a TCP reset): the store's requests block with no error;
    each poll still returns after STORE_OP_TIMEOUT_S and the rank stops after LOST_STORE_S."""
    import threading

    monkeypatch.setattr(watcher, "STORE_OP_TIMEOUT_S", 0.2)
    make, clock, _ = channel
    w1, ex1 = make(1)
    never = threading.Event()

    class Silent:
        def __getattr__(self, name):
            return lambda *a, **k: never.wait()

    w1.store = Silent()
    for _ in range(3):
        w1.poll()
        clock.t += watcher.LOST_STORE_S / 2
    never.set()
    assert ex1[-1] == EXIT_PEER_LOST and "unreachable" in ex1[0], ex1


def test_a_rank_that_never_arrives_ends_the_job_after_the_start_wait_naming_it(channel, monkeypatch):
    """The channel opens at a rank's first line, before the rendezvous: a rank still starting (another node's
    srun task, a slow import) has never beaten and is not declared silent; one that has not arrived START_WAIT_S
    (5 min, not the rendezvous' 30) after rank 0 did (stuck on a hung mount before train.py's first line) ends
    every rank with EXIT_PEER_LOST, named, with its node's host where a node-mate arrived."""
    assert watcher.START_WAIT_S <= 300
    monkeypatch.setenv("LOCAL_SIZE", "2")  # ranks 0-1 on node 0, 2-3 on node 1: rank 3 is missing, rank 2 arrived
    make, clock, _ = channel
    (w0, ex0), (w1, ex1), (w2, ex2) = make(0, 4), make(1, 4), make(2, 4)
    run_for(clock, watcher.START_WAIT_S - 2 * watcher.POLL_S, w0, w1, w2)
    assert ex0 == ex1 == ex2 == []  # beyond STALL_S: not joined is not silent
    run_for(clock, 2 * watcher.POLL_S, w0)
    import socket

    line = (f"stopping: rank 3 never arrived (node 1: host {socket.gethostname()}): not at the job's store "
            f"{watcher.START_WAIT_S:.0f} s after rank 0 was")
    assert ex0[0].startswith(line) and ex0[-1] == EXIT_PEER_LOST, ex0
    w1.poll()
    w2.poll()
    assert ex1 == ex2 == ex0


def test_the_others_end_when_rank0_never_arrives(channel):
    """With node 0's launcher hosting the store (launch.sh on several nodes), rank 0 itself can be the one stuck."""
    make, clock, _ = channel
    (w1, ex1), (w2, ex2) = make(1), make(2)
    run_for(clock, watcher.START_WAIT_S, w1, w2)
    assert ex1[0].startswith("stopping: rank 0 never arrived") and ex1[-1] == EXIT_PEER_LOST, ex1
    w2.poll()
    assert ex2 == ex1


def test_a_hung_log_write_does_not_keep_a_rank_from_exiting(channel, monkeypatch, capfd):
    """The rank log lives on the shared file system, which may be what broke: the watcher says its line on stderr
    and exits whether or not the log write ever returns."""
    import logging
    import threading

    class Stuck(logging.Handler):
        def emit(self, record):
            threading.Event().wait()  # a write to a file system that stopped answering

    stuck = Stuck()
    monkeypatch.setattr(watcher.LOG, "level", logging.INFO)
    watcher.LOG.addHandler(stuck)
    monkeypatch.setattr(watcher, "LOG_WRITE_S", 0.5)
    try:
        import datetime

        make, _, server = channel
        w0, _ = make(0)
        ex1 = Exits()  # made here, not by the fixture, whose teardown would wait for a watcher stuck in the write
        store = comm.dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=30))
        w1 = watcher.Watcher(store, 1, 3, hard_exit=ex1.exit).start()  # comm's own say and log
        w0.post("rank 0 failed: OSError: stale file handle", 1)
        t = threading.Thread(target=w1.poll, daemon=True)
        t.start()
        t.join(10)
        assert ex1 == [1], ex1
        assert "stopping: rank 0 failed: OSError: stale file handle" in capfd.readouterr().err
    finally:
        watcher.LOG.removeHandler(stuck)


def test_a_failing_rank0_waits_for_the_others_to_read_its_reason(channel, monkeypatch):
    """Rank 0 hosts the store: if it went at once, the others would find the store gone (LOST_STORE_S later, "store
    unreachable") instead of its reason. comm.abort on rank 0 returns once every other rank has read the reason
    (marked itself done), at most ABORT_WAIT_S."""
    import threading

    make, clock, _ = channel
    (w0, _), (w1, ex1), (w2, ex2) = make(0), make(1), make(2)
    monkeypatch.setattr(comm, "_WATCHER", w0)
    monkeypatch.setattr(watcher, "EXIT_GRACE_S", 1e6)  # abort's own exit timer must not end pytest
    monkeypatch.setattr(watcher, "ABORT_WAIT_S", 30.0)
    done = threading.Event()
    threading.Thread(target=lambda: (comm.abort("rank 0 failed: RuntimeError: boom"), done.set()), daemon=True).start()
    assert not done.wait(1.0)  # still there: nobody has read it
    w1.poll()
    assert not done.wait(0.5)
    w2.poll()
    assert done.wait(5)
    assert ex1 == ex2 == ["stopping: rank 0 failed: RuntimeError: boom", 1]


def test_a_failing_rank0_does_not_wait_beyond_abort_wait_s(channel, monkeypatch):
    make, clock, _ = channel
    (w0, _), _ = make(0), make(1)
    monkeypatch.setattr(comm, "_WATCHER", w0)
    monkeypatch.setattr(watcher, "EXIT_GRACE_S", 1e6)
    monkeypatch.setattr(watcher, "ABORT_WAIT_S", 5.0)
    w0.sleep = lambda s: setattr(clock, "t", clock.t + 1)  # rank 1 never reads it (its watcher starved, say)
    t0 = clock.t
    comm.abort("rank 0 failed: RuntimeError: boom")
    assert clock.t - t0 <= watcher.ABORT_WAIT_S + 1


def test_the_stderr_line_before_a_hard_exit_cannot_block_it(tmp_path):
    """The watcher says why on stderr before os._exit; stderr may be a pipe into slurm-%j.out nobody drains (a hung
    file system): a rank whose stderr pipe is full still exits, with the abort's code."""
    import sys

    script = tmp_path / "full_stderr.py"
    script.write_text(f"""
import fcntl, os, sys
sys.path.insert(0, {ROOT!r})
from base import watcher
flags = fcntl.fcntl(2, fcntl.F_GETFL)
fcntl.fcntl(2, fcntl.F_SETFL, flags | os.O_NONBLOCK)
try:
    while True:
        os.write(2, b"x" * 4096)  # fill the pipe: nobody reads it
except BlockingIOError:
    pass
fcntl.fcntl(2, fcntl.F_SETFL, flags)
class Store:  # rank 0 posted a failure
    def add(self, *a): return 1
    def set(self, *a): pass
    def multi_get(self, keys): return [b"1 rank 0 failed: OSError: stale file handle", b"7"]
watcher.SAY_S = 0.5
watcher.Watcher(Store(), 1, 2, hard_exit=os._exit, log=lambda line: None).poll()
os._exit(99)
""")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        assert proc.wait(timeout=30) == 1  # the abort's code, not stuck in the write
    finally:
        proc.kill()
        proc.stderr.close()


def test_a_rank_waits_for_a_store_that_never_answers_a_bounded_time(monkeypatch, capfd):
    """Rank 0 (or node 0's launcher, which hosts the store) stuck before it serves: the other ranks wait
    START_WAIT_S (5 min by default, not the rendezvous' 30), then exit EXIT_PEER_LOST with one line naming it."""
    from tests.distributed import free_port

    monkeypatch.setattr(watcher, "START_WAIT_S", 1.0)
    monkeypatch.setattr(comm, "_WATCHER", None)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))  # nobody serves it
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    with pytest.raises(SystemExit) as stop:
        comm.open_channel()
    assert stop.value.code == EXIT_PEER_LOST
    lines = [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "did not answer in 1 s: rank 0, which hosts it, never arrived" in lines[0], lines


def test_a_rank_leaving_tells_its_launcher_what_it_knows_of_the_store(channel, monkeypatch, tmp_path):
    """scripts/launch.sh reads `$LAUNCH_EXIT_DIR/store<R>` after its ranks exit: the reason on record when the store
    answered (read or posted here: its own post then waits briefly for a store node 0 may have ended meanwhile),
    `gone` when it was unreachable (nothing to post), nothing when this rank never heard from it."""
    monkeypatch.setenv("LAUNCH_EXIT_DIR", str(tmp_path))
    make, clock, _ = channel
    (w0, ex0), (w1, ex1), (w2, _) = make(0), make(1), make(2)
    w2.post("rank 2 failed: RuntimeError: boom", 1)
    w1.poll()
    assert ex1[-1] == 1 and (tmp_path / "store1").read_text() == "abort rank 2 failed: RuntimeError: boom\n"

    class Gone:
        def __getattr__(self, name):
            def fail(*a, **k):
                raise comm.dist.DistNetworkError("connection refused")
            return fail

    w0.store = Gone()
    w0.poll()
    run_for(clock, watcher.LOST_STORE_S, w0, step=1)
    assert ex0[-1] == EXIT_PEER_LOST and (tmp_path / "store0").read_text() == "gone\n"
    assert not (tmp_path / "store2").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["store0", "store1"]
