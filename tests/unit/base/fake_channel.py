"""The abort channel without processes, for the tests of tests/unit/base/: a real TCPStore server (as rank 0 hosts
it), watchers on their own client connections, a fake clock and recorded exits. Each test file that uses it declares

    @pytest.fixture
    def channel(monkeypatch):
        yield from open_fake_channel(monkeypatch)
"""

from __future__ import annotations

from base import comm, watcher


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


class Exits(list):
    """What a watcher said and the code it would have exited with (instead of os._exit)."""

    def say(self, line):
        self.append(line)

    def exit(self, code):
        self.append(code)


def open_fake_channel(monkeypatch):
    """A TCPStore server (as rank 0 hosts it) and `make(rank)`: a started watcher of a 3-rank world on its own
    client connection, with a fake clock and recorded exits. Its thread never polls (the test calls poll(), every
    POLL_S of the fake clock as the thread would: `run_for`)."""
    import datetime

    from tests.distributed import free_port

    monkeypatch.setattr(watcher.Watcher, "_run", lambda self: None)
    monkeypatch.setattr(watcher, "ABORT_WAIT_S", 0.5)  # a stopped rank 0 waits for the others' marks: briefly here
    port = free_port()
    server = comm.dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                                timeout=datetime.timedelta(seconds=30))  # a connect here sometimes takes 5 s
    clock, made = Clock(), []

    def make(rank, world=3, **kw):
        store = comm.dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=30))
        store.set_timeout(datetime.timedelta(seconds=2))
        ex = Exits()
        kw.setdefault("say", ex.say)
        w = watcher.Watcher(store, rank, world, clock=clock, hard_exit=ex.exit, **kw).start()
        made.append(w)
        return w, ex

    yield make, clock, server
    for w in made:
        w.stop()


def run_for(clock, seconds, *watchers, step=None):
    """`seconds` of the fake clock with every watcher polling every `step` (POLL_S), as their threads do."""
    step = step or watcher.POLL_S
    for _ in range(int(round(seconds / step))):
        clock.t += step
        for w in watchers:
            w.poll()
