"""The job's store, hosted by node 0's launcher: a failure before any rank can speak still ends every node.

Without it, rank 0's Python process hosts the rendezvous TCPStore (base/comm.py `open_channel`, train.py's first
line). A node-0 rank that dies before that line (an import error: a broken venv or a missing mount on node 0,
an OOM kill while importing torch from a cold shared file system) leaves every other node connecting to a store
that never comes, for START_WAIT_S (5 min; it was 30, as the rendezvous waits); a node whose ranks die before they
connect leaves rank 0 at the rendezvous for `dist_timeout_s`. Their own launcher knows at once (it reaps them),
but it had no one to tell.

With `scripts/launch.sh --no_ssh` on several nodes (how slurm.sbatch starts them), node 0's launch.sh starts
`serve` before its ranks and every rank connects to it as a client (TORCHELASTIC_USE_AGENT_STORE=True, torch's
env:// rendezvous' own rule for an agent-hosted store, as under torchrun). When a node's launcher exits with a
failure code (not 0, 2 or 75 handled by the ranks themselves: any code other than 0 and 75), its launch.sh
`post`s "node N: its ranks exited C" as the job's abort, with the same first-reason-wins rule as a rank's own
post (a rank that failed with its reason posted earlier keeps it). Every rank's watcher reads it within POLL_S;
a rank still connecting reads it at its first poll. Node 0's launcher keeps the store LATE_JOIN_S (the start bound,
START_WAIT_S: one setting, ULYSSES_START_WAIT_S) at most after a failure (until every rank of the other nodes has
left), so a node that starts late still finds the reason.

Node 0's store must start: its launch.sh waits (STORE_START_S at most) for `serve` to write its ready file before it
starts its own ranks, and ends at once (exit 1, one line naming the host and the port) when `serve` exits or does
not answer: a broken venv, torch or mount on node 0, or the port taken by another job's store (whose ranks would
otherwise join a stranger's store). Under SLURM, srun then ends the step on every node (slurm.sbatch).

A lost node (SIGKILLed, hung, cut off) posts nothing: its ranks' heartbeats stop and rank 0's watcher ends the job
with EXIT_PEER_LOST (69). Node 0's `post --wait` then counts a rank whose heartbeat has not moved for STALE_S as
gone (a live rank beats every POLL_S until it marks itself done), and, the abort being 69, a rank that never arrived
too: node 0's launcher ends within STALE_S of its ranks (it used to wait LATE_JOIN_S, 300 s, for ranks that never
mark themselves done). A node that posted no exit and whose ranks are all gone that way is lost, whatever the code on
record (a rank whose collective saw the node's sockets close raises: a crash, 1, caused by the loss): `post` exits
69 and `--lost-file` names it (its node index, one a line), where slurm.sbatch reads it to requeue without it.
A node none of whose ranks ever arrived (beat "0" to the end: rank 0 gave up on it START_WAIT_S after it started
waiting) is not lost but absent, `K absent` in that file: its ranks never reached train.py's first line within the
start bound, which a slow start (a container image pulled, a cold file-system client, a busy prolog) does as well
as a broken node. slurm.sbatch excludes such a node only on evidence (docs/launch.md, "A node slow to start").

What stays uncovered: node 0 lost (its launcher and the store with it: the others stop after LOST_STORE_S, and Slurm
itself requeues a job whose batch host failed); `deepspeed --hostfile` over pdsh (one launcher for all nodes: its
own exit ends the others). The store is the run's (base/run_identity.py): `serve` publishes the identity launch.sh
exported (ULYSSES_LAUNCH_ID) before any rank starts, and every key here is under it. Cost: one Python process on
node 0 (torch imported, ~300 MB RSS, idle), no extra request on the training's path; node 0's `post --wait` reads
every rank's heartbeat key every POLL_S/2 (512 small keys at 512 ranks, for STALE_S at most once the job has failed).

    python -m base.node_store serve ADDR PORT [--ready FILE]   # node 0's launch.sh, in the background
    python -m base.node_store post ADDR PORT CODE REASON --node K --nnodes N --ranks-per-node R [--wait]
        [--lost-file FILE]
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import socket
import sys
import time

from base import run_identity
from base.comm import TCPStore
from base.exits import EXIT_PEER_LOST
from base.watcher import DONE, POLL_S, START_WAIT_S, STORE_OP_TIMEOUT_S, key, one_line, use_run

LATE_JOIN_S = START_WAIT_S  # after a failure, node 0's launcher keeps the store this long for ranks still on their way
STALE_S = 5 * POLL_S  # a rank's heartbeat unchanged this long after a failure: the rank is gone (it beats every POLL_S)
CONNECT_S = 20.0  # a launcher's connection to post (node 0 may be gone: then nobody is waiting on its store)
KNOWN_CONNECT_S = 3.0  # the same when a rank here read the reason on record: the store was up, node 0 may have left
_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)


def serve(addr: str, port: int, ready: str | None = None) -> None:
    """Host the job's TCPStore on `port` until launch.sh kills it (its node's ranks done) or dies; write `ready` (a
    file launch.sh waits for) once the store answers."""
    from base.comm import publish_fd_limit
    from base.watcher import raise_fd_limit

    soft, _ = raise_fd_limit()  # 3 connections per rank: 1664 descriptors at 512 ranks, past a soft limit of 1024
    store = TCPStore(addr, port, is_master=True, wait_for_workers=False, multi_tenant=True,
                          timeout=datetime.timedelta(seconds=STORE_OP_TIMEOUT_S))
    run_identity.publish(store, run_identity.identity())  # whose store: every rank reads it before it writes
    store.compare_set(key("abort"), "", "")  # the watchers' multi_get never blocks on a missing key
    publish_fd_limit(store, soft)  # every rank refuses a world this process cannot hold (base/comm.py open_channel)
    # Slurm may signal every process of the step (preemption, time limit; proctrack/cgroup with SignalChildrenProcesses
    # =yes, else launch.sh's group gets it from slurm.sbatch): the ranks then save and need the store until they have
    # committed; launch.sh ends this process with SIGKILL when its ranks are gone, and it dies with launch.sh
    for sig in _SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: never outlive launch.sh on the port
    except (OSError, AttributeError):
        pass
    if ready:
        with open(ready, "w") as fh:
            fh.write(f"{addr}:{port}\n")
    while True:
        time.sleep(3600)


class StoreGone(Exception):
    pass


def reachable(addr: str, port: int, within_s: float, clock=time.monotonic, sleep=time.sleep) -> bool:
    """Whether anything listens on addr:port within `within_s` (a refused connection tried again every 0.25 s:
    node 0's store may not have started yet). A plain socket, so that a store that is gone costs `within_s` and one
    line, not torch's connect retries (20 s, then a 17 s back-off, each with a C++ stack in the node's log)."""
    end = clock() + within_s
    while True:
        try:
            socket.create_connection((addr, port), timeout=max(0.1, min(2.0, end - clock()))).close()
            return True
        except OSError:
            if clock() >= end:
                return False
            sleep(0.25)


def post(addr: str, port: int, code: int, reason: str, node: int, nnodes: int, per_node: int, wait: bool = False,
         late_join_s: float = LATE_JOIN_S, stale_s: float = STALE_S, store=None, clock=time.monotonic,
         sleep=time.sleep, connect_s: float = CONNECT_S) -> tuple[str, list[int], list[int]]:
    """Post `reason` as the job's abort (the first reason posted wins) and record that node `node`'s ranks are gone;
    returns the reason on record, the nodes found lost and the nodes found absent. With `wait` (node 0's launcher,
    whose process holds the
    store), then keep it until every rank of the nodes that did not fail has left or `late_join_s` has passed, so
    they read it before it goes. A rank has left when it marked itself done, or when its heartbeat has not moved for
    `stale_s` (killed, stopped, its node lost), or, the abort on record being EXIT_PEER_LOST, when it never arrived.
    A node that posted no exit of its own and none of whose ranks is done or still beating is lost; absent instead
    when none of its ranks ever arrived (it never started within the start bound: slow, or broken)."""
    if store is None:
        if not reachable(addr, port, connect_s):
            raise StoreGone(f"nothing answers on {addr}:{port} within {connect_s:.0f} s")
        store = TCPStore(addr, port, is_master=False, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=connect_s))
        store.set_timeout(datetime.timedelta(seconds=STORE_OP_TIMEOUT_S))
    store.set(key(f"node_exit/{node}"), str(code))
    got = store.compare_set(key("abort"), "", f"{code} {one_line(reason)}")
    got = got.decode() if isinstance(got, bytes) else str(got)
    code_on_record, _, on_record = got.partition(" ")
    peer_lost = code_on_record == str(EXIT_PEER_LOST)
    seen: dict[int, tuple[bytes, float]] = {}  # rank -> (its heartbeat value, when it last changed)
    end = clock() + late_join_s
    lost: list[int] = []
    absent: list[int] = []
    while wait and clock() < end:
        now = clock()
        live = [k for k in range(nnodes) if not store.check([key(f"node_exit/{k}")])]
        waiting, lost, absent = False, [], []
        for k in live:
            ranks = list(range(k * per_node, (k + 1) * per_node))
            names = [key(f"hb/{r}") for r in ranks]
            present = [store.check([n]) for n in names]
            beats = dict(zip([r for r, p in zip(ranks, present) if p],
                             store.multi_get([n for n, p in zip(names, present) if p]) if any(present) else []))
            gone = never = 0
            for r in ranks:
                beat = beats.get(r, b"0")
                if beat == DONE:
                    continue
                if beat == b"0":  # never arrived: gone if a peer was lost, else it may still come to read the reason
                    gone += peer_lost
                    never += 1
                    waiting |= not peer_lost
                    continue
                if seen.get(r, (None,))[0] != beat:
                    seen[r] = (beat, now)
                if now - seen[r][1] >= stale_s:
                    gone += 1
                else:
                    waiting = True
            if gone == per_node:
                (absent if never == per_node else lost).append(k)
        if not waiting:
            break  # (no live node left: nobody to wait for)
        sleep(POLL_S / 2)
    return on_record or reason, lost, absent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m base.node_store", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("addr")
    s.add_argument("port", type=int)
    s.add_argument("--ready", help="a file written once the store answers (launch.sh waits for it)")
    q = sub.add_parser("post")
    q.add_argument("addr")
    q.add_argument("port", type=int)
    q.add_argument("code", type=int)
    q.add_argument("reason")
    q.add_argument("--node", type=int, required=True, help="the node whose ranks exited")
    q.add_argument("--nnodes", type=int, required=True)
    q.add_argument("--ranks-per-node", type=int, required=True)
    q.add_argument("--wait", action="store_true", help="node 0: keep the store until the live nodes' ranks have read it")
    q.add_argument("--late-join-s", type=float, default=LATE_JOIN_S)
    q.add_argument("--known", metavar="REASON", help="the reason on record, as a rank here read it from the store "
                   "(LAUNCH_EXIT_DIR's store<R> notes): the store was up, so wait only KNOWN_CONNECT_S for it")
    q.add_argument("--lost-file", help="with --wait: write the lost nodes' indices here, one a line, and `K absent` "
                   "for a node none of whose ranks arrived (none: no file)")
    a = p.parse_args(argv)
    use_run(run_identity.identity().digest)  # ULYSSES_LAUNCH_ID, which launch.sh exports to its ranks and to this
    if a.cmd == "serve":
        serve(a.addr, a.port, a.ready)
        return 0
    # Slurm may signal every process of the step when it ends it (srun --kill-on-bad-exit, scancel): the wait is bounded,
    # and its verdict (the lost nodes) is what the batch shell needs to requeue without them
    for sig in _SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    try:
        got, lost, absent = post(a.addr, a.port, a.code, a.reason, a.node, a.nnodes, a.ranks_per_node, a.wait,
                                 a.late_join_s, connect_s=KNOWN_CONNECT_S if a.known else CONNECT_S)
        print(f"node_store: abort on record: {got}", file=sys.stderr)
        if lost:
            print(f"node_store: lost node(s) {' '.join(map(str, lost))}: no exit posted, every rank's heartbeat "
                  f"stopped", file=sys.stderr)
        if absent:
            print(f"node_store: absent node(s) {' '.join(map(str, absent))}: no exit posted, none of its ranks arrived "
                  f"within the start bound (ULYSSES_START_WAIT_S={START_WAIT_S:.0f} s)", file=sys.stderr)
        if lost or absent:
            if a.lost_file:
                tmp = f"{a.lost_file}.{os.getpid()}"
                with open(tmp, "w") as fh:
                    fh.write("".join([f"{k}\n" for k in lost] + [f"{k} absent\n" for k in absent]))
                os.replace(tmp, a.lost_file)
            return EXIT_PEER_LOST  # the job's end was a lost node, whatever the ranks that saw it go raised
    except StoreGone as e:
        if a.known:  # every rank of the job has read it: node 0 ended once they had
            print(f"node_store: abort on record: {a.known}", file=sys.stderr)
            print(f"node_store: the job's store has ended ({e}): its ranks had read the reason", file=sys.stderr)
            return 0
        print(f"node_store: could not post the failure ({e}): the job's store is gone", file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001 -- node 0's store is gone: nobody waits on it any more
        print(f"node_store: could not post the failure ({one_line(e)}): the job's store is gone", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
