"""A suspended job goes on (base/watcher.py's SUSPENDED_S rule): `scontrol suspend` and gang scheduling SIGSTOP every
process of the job and SIGCONT them later, node by node, in any order. On the abort channel with a fake clock
(tests/unit/base/fake_channel.py), and (slow) three real ranks' process groups stopped and continued."""

from __future__ import annotations

import os
import subprocess

import pytest

from base import watcher
from base.exits import EXIT_PEER_LOST
from tests.distributed import ROOT
from tests.unit.base.fake_channel import open_fake_channel, run_for


@pytest.fixture
def channel(monkeypatch):
    yield from open_fake_channel(monkeypatch)


@pytest.mark.parametrize("order", ["rank0_resumes_first", "rank0_resumes_last", "stopped_mid_request"])
def test_a_suspended_job_goes_on_whatever_the_order_of_sigcont(channel, order):
    """`scontrol suspend` / gang scheduling SIGSTOPs every process of the job (ranks, heartbeat processes, the
    store's host) and SIGCONTs them later, node by node: on resume every clock shows minutes without a heartbeat.
    Rank 0 resumed first sees its peers' beats move only seconds later; resumed last, the others find its store
    silent at first; a watcher stopped inside a request finds it timed out. None of it is a failure. A rank that
    stays silent after the resume is still declared lost, STALL_S after it."""
    make, clock, _ = channel
    (w0, ex0), (w1, ex1), (w2, ex2) = make(0), make(1), make(2)
    # the watcher that resumes first saw its peers' last beats before the stop (it polled after them)
    run_for(clock, 20, *((w1, w2, w0) if order == "rank0_resumes_first" else (w0, w1, w2)))
    clock.t += 600  # everything stopped 10 minutes
    if order == "rank0_resumes_first":
        run_for(clock, 8, w0)  # rank 1 and 2 (and their heartbeat processes) are still stopped
    elif order == "rank0_resumes_last":
        real = w1.store, w2.store

        class Stopped:  # rank 0's process (the store) still stopped: every request times out
            def __getattr__(self, name):
                def fail(*a, **k):
                    raise TimeoutError("no answer from the store in 10 s")
                return fail

        w1.store = w2.store = Stopped()
        run_for(clock, 14, w1, w2)
        w1.store, w2.store = real
        run_for(clock, 4, w1, w2)  # rank 0's process answers again; its heartbeat process resumes a little later
    else:
        real = w1.store

        class StopsNow:  # SIGSTOP arrives while rank 1's request is in flight; on SIGCONT it has timed out
            def __getattr__(self, name):
                def stop(*a, **k):
                    clock.t += 600
                    w1.store = real
                    raise TimeoutError("no answer from the store in 10 s")
                return stop

        w1.store = StopsNow()
        w1.poll()
        run_for(clock, 4, w1)  # rank 0 resumes a little later
    run_for(clock, 2 * watcher.STALL_S, w0, w1, w2)
    assert ex0 == ex1 == ex2 == []
    clock.t += 600  # suspended again; this time rank 2 never comes back
    w0.poll()  # (a watcher resumed polls at once: its wait is long over)
    w1.poll()
    run_for(clock, watcher.STALL_S - 2 * watcher.POLL_S, w0, w1)
    assert ex0 == ex1 == []
    run_for(clock, 2 * watcher.POLL_S, w0, w1)
    assert ex0[0].startswith("stopping: rank 2 stopped responding") and ex0[-1] == EXIT_PEER_LOST, ex0


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            return [int(c) for c in fh.read().split()]
    except OSError:
        return []


@pytest.mark.slow  # fast sibling: test_a_suspended_job_goes_on_whatever_the_order_of_sigcont (the same orders, fake clock)
def test_sigstop_and_sigcont_of_whole_process_groups_in_any_order():
    """Three real ranks (tests/workers/channel_rank.py: the real channel, STALL_S 5 s), each in its own process group
    with its heartbeat process. Stopped together for 2 x STALL_S and resumed rank 0 first (its peers 3 s later: 15
    of its polls), then rank 0 last (its peers 2 s earlier; rank 1's heartbeat process 1 s after rank 1): nobody
    exits (before: rank 0, or the others, declared a peer dead at once). Then rank 2 alone stays stopped: ranks 0
    and 1 exit 69 after STALL_S."""
    import signal
    import sys
    import time

    from bench.control_plane import _numeric_names
    from tests.distributed import free_port

    env = dict(os.environ, WORLD_SIZE="3", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               TORCH_CPP_LOG_LEVEL="FATAL")
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    preload = _numeric_names()  # this machine's resolver stalls connects 5 s (bench/control_plane.py)
    if preload:
        env["LD_PRELOAD"] = preload
    worker = os.path.join(ROOT, "tests/workers/channel_rank.py")
    ranks = [subprocess.Popen([sys.executable, worker, "120"], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, text=True, start_new_session=True) for r in range(3)]
    try:
        for p in ranks:
            assert p.stdout.readline().strip() == "joined"
        time.sleep(1)

        def signal_group(r, sig):
            os.killpg(ranks[r].pid, sig)

        stall = 5.0
        for r in (0, 1, 2):  # suspended, rank 0 resumed first
            signal_group(r, signal.SIGSTOP)
        time.sleep(2 * stall)
        signal_group(0, signal.SIGCONT)
        time.sleep(3.0)
        signal_group(1, signal.SIGCONT)
        signal_group(2, signal.SIGCONT)
        time.sleep(2 * stall)
        assert [p.poll() for p in ranks] == [None, None, None]
        for r in (2, 1, 0):  # suspended, rank 0 resumed last; rank 1's heartbeat process after rank 1
            signal_group(r, signal.SIGSTOP)
        time.sleep(2 * stall)
        os.kill(ranks[1].pid, signal.SIGCONT)
        signal_group(2, signal.SIGCONT)
        time.sleep(1.0)
        for child in _children(ranks[1].pid):
            os.kill(child, signal.SIGCONT)
        signal_group(1, signal.SIGCONT)
        time.sleep(1.0)
        signal_group(0, signal.SIGCONT)
        time.sleep(2 * stall)
        assert [p.poll() for p in ranks] == [None, None, None]
        signal_group(2, signal.SIGSTOP)  # rank 2 alone: truly silent
        t0 = time.monotonic()
        codes = [ranks[0].wait(timeout=30), ranks[1].wait(timeout=30)]
        assert codes == [EXIT_PEER_LOST, EXIT_PEER_LOST] and stall <= time.monotonic() - t0 <= stall + 10
    finally:
        for p in ranks:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except OSError:
                pass
            p.wait()
