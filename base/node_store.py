"""The job's store, hosted by node 0's launcher: a failure before any rank can speak still ends every node.

Without it, rank 0's Python process hosts the rendezvous TCPStore (base/comm.py `open_channel`, train.py's first
line). A node-0 rank that dies before that line (an import error: a broken venv or a missing mount on node 0,
an OOM kill while importing torch from a cold shared file system) leaves every other node connecting to a store
that never comes, for START_WAIT_S (30 min, as the rendezvous would); a node whose ranks die before they
connect leaves rank 0 at the rendezvous for `dist_timeout_s`. Their own launcher knows at once (it reaps them),
but it had no one to tell.

With `scripts/launch.sh --no_ssh` on several nodes (how slurm.sbatch starts them), node 0's launch.sh starts
`serve` before its ranks and every rank connects to it as a client (TORCHELASTIC_USE_AGENT_STORE=True, torch's
env:// rendezvous' own rule for an agent-hosted store, as under torchrun). When a node's launcher exits with a
failure code (not 0, 2 or 75 handled by the ranks themselves: any code other than 0 and 75), its launch.sh
`post`s "node N: its ranks exited C" as the job's abort, with the same first-reason-wins rule as a rank's own
post (a rank that failed with its reason posted earlier keeps it). Every rank's watcher reads it within POLL_S;
a rank still connecting reads it at its first poll. Node 0's launcher keeps the store LATE_JOIN_S at most after a
failure (until every rank of the other nodes has left), so a node that starts late still finds the reason.

What stays uncovered: node 0's launch.sh itself never starting (its node lost before the job step), which the
rendezvous' timeout and Slurm's node health handle; `deepspeed --hostfile` over pdsh (one launcher for all nodes:
its own exit ends the others). Cost: one Python process on node 0 (torch imported, ~300 MB RSS, idle), no
extra request on the training's path.

    python -m base.node_store serve ADDR PORT          # node 0's launch.sh, in the background
    python -m base.node_store post ADDR PORT CODE REASON --node K --nnodes N --ranks-per-node R [--wait]
"""

from __future__ import annotations

import argparse
import datetime
import signal
import sys
import time

from base.comm import TCPStore
from base.watcher import DONE, POLL_S, STORE_OP_TIMEOUT_S, key, one_line

LATE_JOIN_S = 300.0  # after a failure, node 0's launcher keeps the store this long for ranks still on their way
CONNECT_S = 20.0  # a launcher's connection to post (node 0 may be gone: then nobody is waiting on its store)


def serve(addr: str, port: int) -> None:
    """Host the job's TCPStore on `port` until launch.sh kills it (its node's ranks done) or dies."""
    store = TCPStore(addr, port, is_master=True, wait_for_workers=False, multi_tenant=True,
                          timeout=datetime.timedelta(seconds=STORE_OP_TIMEOUT_S))
    store.compare_set(key("abort"), "", "")  # the watchers' multi_get never blocks on a missing key
    # Slurm signals every process of the step (preemption, time limit): the ranks then save and need the store until
    # they have committed; launch.sh ends this process with SIGKILL when its ranks are gone, and it dies with launch.sh
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: never outlive launch.sh on the port
    except (OSError, AttributeError):
        pass
    while True:
        time.sleep(3600)


def post(addr: str, port: int, code: int, reason: str, node: int, nnodes: int, per_node: int, wait: bool = False,
         late_join_s: float = LATE_JOIN_S) -> str:
    """Post `reason` as the job's abort (the first reason posted wins) and record that node `node`'s ranks are gone;
    returns the reason on record. With `wait` (node 0's launcher, whose process holds the store), then keep it until
    every rank of the nodes that did not fail has left or `late_join_s` has passed, so they read it before it goes."""
    store = TCPStore(addr, port, is_master=False, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=CONNECT_S))
    store.set_timeout(datetime.timedelta(seconds=STORE_OP_TIMEOUT_S))
    store.set(key(f"node_exit/{node}"), str(code))
    got = store.compare_set(key("abort"), "", f"{code} {one_line(reason)}")
    on_record = (got.decode() if isinstance(got, bytes) else str(got)).partition(" ")[2] or reason
    end = time.monotonic() + late_join_s
    while wait and time.monotonic() < end:
        live = [k for k in range(nnodes) if not store.check([key(f"node_exit/{k}")])]
        ranks = [key(f"hb/{r}") for k in live for r in range(k * per_node, (k + 1) * per_node)]
        if all(store.check([r]) for r in ranks) and all(b == DONE for b in store.multi_get(ranks)):
            break  # (no live node left: nobody to wait for)
        time.sleep(POLL_S / 2)
    return on_record


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m base.node_store", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("addr")
    s.add_argument("port", type=int)
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
    a = p.parse_args(argv)
    if a.cmd == "serve":
        serve(a.addr, a.port)
        return 0
    try:
        got = post(a.addr, a.port, a.code, a.reason, a.node, a.nnodes, a.ranks_per_node, a.wait, a.late_join_s)
        print(f"node_store: abort on record: {got}", file=sys.stderr)
    except Exception as e:  # noqa: BLE001 -- node 0's store is gone: nobody waits on it any more
        print(f"node_store: could not post the failure ({one_line(e)}): the job's store is gone", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
