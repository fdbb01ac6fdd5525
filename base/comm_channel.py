"""The abort channel on one rank: opened at a launched rank's first line (`open_channel`), left on a failure (`abort`)
or a clean exit (`leave`). base/comm.py calls these: it holds the rank's watcher (`comm._WATCHER`) and hands in the
store connections it makes (the one module that imports torch.distributed); base/watcher.py is the channel's
protocol (the watcher thread, the heartbeat process, the timings) and says why the channel exists.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

from base import connect, run_identity, watcher
from base.exits import EXIT_PEER_LOST
from base.store_limits import fd_refusal, publish_agent_fd_limit, publish_fd_limit


def open_channel(connect_by: Callable, host_store: Callable, watch: Callable) -> None:
    """The abort channel from the launcher's RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (comm.open_channel, before
    anything that can fail on one node: imports, config, model folder, network interface, a path a node lacks).
    `connect_by(addr, port, deadline)`: a client connection to the store; `host_store(addr, port)`: the store itself,
    on its host; `watch(store, rank, world, heart)`: this rank's watcher started on it. Nothing for a world of one.
    A failure posted before this rank arrived ends it here.

    Start-up is bounded: a rank waits START_WAIT_S (5 min) for the store's first answer, then exits EXIT_PEER_LOST
    naming who hosts it (rank 0, or node 0's launcher); once connected, its watcher ends the job the same way when a
    peer never arrives (base/watcher.py). A MASTER_ADDR the store's host cannot resolve: one line there (exit 2).
    Descriptors: every rank raises its soft RLIMIT_NOFILE to the hard limit (at 512 ranks the host gloo group alone
    holds 511 sockets per rank); the store's host publishes the limit it runs under (under torchrun rank 0 does it for
    the agent: publish_agent_fd_limit), and every rank refuses the job (one line, exit 2 on every rank, before any
    work) when it cannot hold 3 connections per rank of this world, or the rank's own limit its peers: the same
    number and WORLD_SIZE on every rank, one decision. Cost at 512 ranks: one getrlimit and setrlimit per rank, one
    `check` + `get` per rank at start. Another run's store (two runs on one port): refused in one line (exit 2)
    before this rank writes into it, from the identity its host published (base/run_identity.py; one `get`)."""
    env = os.environ
    world_size, rank_ = int(env.get("WORLD_SIZE", "1")), int(env.get("RANK", "0"))
    addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    if world_size <= 1 or not addr or not port:
        return
    from base.slurm_env import master_refusal, unresolved

    hosting = rank_ == 0 and env.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    # srun's ranks sent to a node outside their step (a batch export); the store's host: a name it cannot resolve
    wrong_host = master_refusal(env) or (unresolved(addr, port) if hosting else None)
    if wrong_host:
        raise ValueError(wrong_host)
    soft, _ = watcher.raise_fd_limit()  # every rank; on rank 0 before its store server accepts anyone
    deadline = connect.deadline(watcher.START_WAIT_S)  # one bounded wait, from this rank's start, for all below
    mine = run_identity.identity()  # whose store this is: read before anything is written (base/run_identity.py)
    watcher.use_run(mine.digest)

    def ours(st) -> bool:
        return run_identity.refusal(run_identity.read(st, deadline) or "", mine, addr, port, rank_) is None

    # first: a fork, before any thread or server exists
    heart = watcher.start_heartbeat(lambda: connect_by(addr, int(port), deadline), rank_, verify=ours)
    try:
        if hosting:
            # the rendezvous store itself: torch's env:// init (multi_tenant too) reuses this server
            store = host_store(addr, int(port))
            run_identity.publish(store, mine)  # before any rank can read anything else
            publish_fd_limit(store, soft)
        else:
            store = connect_by(addr, int(port), deadline)
        # rank 0 under an agent's store (torchrun's, which publishes nothing) says whose it is; the others wait for
        # the host's word (rank 0's arrival under torchrun, START_WAIT_S at most), writing nothing meanwhile
        on_record = run_identity.publish(store, mine) if rank_ == 0 else run_identity.read(store, deadline)
    except BaseException as e:
        watcher.stop_heartbeat(heart)
        if hosting and isinstance(e, Exception) and "EADDRINUSE" in str(e) + repr(getattr(e, "__cause__", "")):
            raise ValueError(f"MASTER_PORT {port} on {addr} is taken (another run on this node, or a port in use): "
                             "give this run its own with --master_port (deepspeed, launch.sh, torchrun)") from None
        if hosting or not isinstance(e, Exception):
            raise
        agent = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        host = "node 0's launcher" if agent else "rank 0"
        watcher._bounded(watcher._say, f"error: rank {rank_}: the job's store at {addr}:{port} did not answer in "
                         f"{watcher.START_WAIT_S:.0f} s: {host}, which hosts it, never arrived: node 0 or its store did "
                         f"not start ({'launch.sh' if agent else 'train.py'} on {addr} broken, stuck or lost, or "
                         "MASTER_ADDR/MASTER_PORT wrong; counted from this rank's start, ULYSSES_START_WAIT_S sets it) "
                         f"({unresolved(addr, port) or watcher.one_line(e)})", watcher.SAY_S)
        raise SystemExit(EXIT_PEER_LOST) from None
    refusal = run_identity.refusal(on_record or "", mine, addr, port, rank_)
    if refusal and on_record is None:  # rank 0 never arrived (torchrun), or a store of a program that never says
        watcher.stop_heartbeat(heart)
        watcher._bounded(watcher._say, f"error: rank {rank_}: the job's store at {addr}:{port} never said which run it "
                         f"belongs to within {watcher.START_WAIT_S:.0f} s: rank 0 never arrived, or the port is another "
                         "program's (give this run its own --master_port; ULYSSES_START_WAIT_S sets this wait)",
                         watcher.SAY_S)
        raise SystemExit(EXIT_PEER_LOST)
    if refusal:
        watcher.stop_heartbeat(heart)
        raise ValueError(refusal)
    watch(store, rank_, world_size, heart).poll()
    if rank_ == 0 and not hosting:
        publish_agent_fd_limit(store, int(port))
    refusal = fd_refusal(store, world_size, rank_, soft, wait_s=watcher.START_WAIT_S)
    if refusal:
        raise ValueError(refusal)


def abort(w: watcher.Watcher, reason: str, code: int = 1) -> str:
    """This rank failed (comm.abort, with its watcher `w`): tell every rank (they exit within POLL_S), stop watching,
    wait (ABORT_WAIT_S at most) until the others have read it, and bound this process's own teardown to EXIT_GRACE_S
    (base/watcher.py's timings). Returns the first failure on record (the cause, when this rank failed because
    another one did)."""
    timer = threading.Timer(watcher.EXIT_GRACE_S, lambda: os._exit(code))  # first: nothing below may hang this rank
    timer.daemon = True
    timer.start()
    first = w.post(reason, code)
    if w.on_record is not None:
        watcher.tell_launcher(w.rank, f"abort {w.on_record}")
    w.stop()
    w.heart = watcher.stop_heartbeat(w.heart)
    w._mark_done()
    # every failing rank, not only rank 0 (whose process hosts the store): the launcher kills this rank's node-mates,
    # rank 0 among them, as soon as this one exits
    w.peers_done(watcher.ABORT_WAIT_S)
    return first


def leave(w: watcher.Watcher) -> None:
    """A clean exit (comm.leave, with its watcher `w`: 0, or 75 after a committed save): stop the watcher, mark this
    rank done; rank 0 then waits for the others' marks (LEAVE_WAIT_S at most), so its store outlives every rank still
    on its way out."""
    w.stop()
    w.heart = watcher.stop_heartbeat(w.heart)
    w._mark_done()
    if w.rank == 0:
        w.peers_done(watcher.LEAVE_WAIT_S)
