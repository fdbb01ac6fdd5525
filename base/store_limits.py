"""The descriptor checks of the job's store at start-up (base/comm_channel.py open_channel calls them;
re-exported by base/comm.py):
the store's host publishes the descriptors it may hold, every rank refuses a world it cannot hold. The limits
themselves: base/fd_limit.py."""

from __future__ import annotations

from base import watcher


def publish_fd_limit(store, soft: int, who: str = "") -> None:
    """The store's host records the descriptors it may hold (its raised soft limit), and who it is: rank 0 here, node
    0's launcher in base/node_store.py, torchrun's agent through rank 0 (publish_agent_fd_limit)."""
    store.set(watcher.key("store_fds"), f"{soft} {who}".strip())


def publish_agent_fd_limit(store, port: int) -> None:
    """Rank 0 under an agent's store: torchrun's agent hosts the job's store and publishes nothing, so rank 0, its
    child, finds it (the ancestor listening on MASTER_PORT, base.watcher.store_host_pid), raises its soft limit to the
    hard one (prlimit: torch never does, and past it the agent's store stops accepting ranks, a start-up hang near
    330 ranks at 1024) and publishes that limit for every rank to check against this world. Nothing when the store's
    host published already (node 0's launcher, several `launch.sh --no_ssh` nodes); -1 (every rank checks only its
    own limit) when no ancestor holds the port. Cost: once, on rank 0, before any work."""
    if store.check([watcher.key("store_fds")]):
        return
    pid = watcher.store_host_pid(port)
    have = watcher.raise_fd_limit_of(pid) if pid else None
    publish_fd_limit(store, -1 if have is None else have, f"torchrun's agent on {watcher._hostname()}, pid {pid}")


def fd_refusal(store, world_size: int, rank_: int, soft: int, wait_s: float = 0.0) -> str | None:
    """The one-line refusal when the store's host (its published limit) cannot hold this world's connections, or
    this rank's own limit its sockets; None when both can. Waits up to `wait_s` for the host's word, which always
    comes (rank 0 publishes it right after starting the store, node 0's launcher before any rank starts, rank 0 under
    torchrun once it has arrived; the watcher ends this rank meanwhile if rank 0 never does): every rank then decides
    from the same number. Cost at 512 ranks: one `check` per rank every 0.5 s until rank 0 has arrived, then a `get`."""
    import time

    name = watcher.key("store_fds")
    end = time.monotonic() + wait_s
    while not store.check([name]) and time.monotonic() < end:
        time.sleep(0.5)
    if store.check([name]):
        got = store.get(name)
        have, _, who = (got.decode() if isinstance(got, bytes) else str(got)).partition(" ")
        if int(have) >= 0:
            host = who or "rank 0, or node 0's launcher"
            server = watcher.fd_refusal(int(have), watcher.store_fds(world_size), f"the job's store (hosted by {host})")
            if server:
                return server
    return watcher.fd_refusal(soft, watcher.rank_fds(world_size), f"rank {rank_} ({watcher._hostname()})")
