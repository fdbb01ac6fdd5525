"""The descriptors the abort channel needs (base/watcher.py): what the job's store server and each rank must be able
to open at a world size, the soft RLIMIT_NOFILE raised to the hard limit (on every rank, and by rank 0 for torchrun's
agent, which hosts the store there), and the one-line refusal when the hard limit is too low. base/comm.py's
`open_channel` calls these (through base.watcher) before any other work; tests/unit/base/test_fd_limit.py.
"""

from __future__ import annotations

import os

# descriptors the store's server needs: 3 connections per rank (its heartbeat process, its watcher, the rendezvous'
# own client), one per node launcher posting a failure (64 at 64 nodes), and its own files and listening socket
# (15 measured with torch imported): at 512 ranks 3 x 512 + 128 = 1664, past the common soft limit of 1024
STORE_FDS_PER_RANK, STORE_FDS_MARGIN = 3, 128
RANK_FDS_MARGIN = 256  # a rank's own, beyond one socket per peer (the host gloo group's full mesh): files, NCCL, CUDA


def store_fds(world: int) -> int:
    """Descriptors the job's store server needs for a world of `world` ranks (3 x 512 + 128 = 1664 at 512)."""
    return STORE_FDS_PER_RANK * world + STORE_FDS_MARGIN


def rank_fds(world: int) -> int:
    """Descriptors one rank needs: a socket per peer in each gloo group's full mesh (measured: +1 per rank per group;
    the host group of base/comm.py, NCCL's own are few) plus files: 512 + 256 = 768 at 512 ranks."""
    return world + RANK_FDS_MARGIN


def raise_fd_limit() -> tuple[int, int]:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit (what `ulimit -n` can do unprivileged; nothing else in
    the stack does it, and past the soft limit a store server stops accepting ranks: a start-up hang near 330 ranks at
    1024). Returns (soft, hard) after; an unlimited hard limit counts as the kernel's nr_open."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return _raise_soft(soft, hard, lambda limits: resource.setrlimit(resource.RLIMIT_NOFILE, limits))


def _raise_soft(soft: int, hard: int, set_limits) -> tuple[int, int]:
    """(soft, want) after raising a soft RLIMIT_NOFILE to its hard limit through `set_limits((soft, hard))`; an
    unlimited hard limit counts as the kernel's nr_open; a refused raise leaves the soft limit as it was."""
    import resource

    want = hard
    if hard == resource.RLIM_INFINITY:
        try:
            with open("/proc/sys/fs/nr_open") as fh:
                want = int(fh.read())
        except (OSError, ValueError):
            want = max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            set_limits((want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    return soft, want


def store_host_pid(port: int, pid: int | None = None, depth: int = 4) -> int | None:
    """The process among this one's ancestors (its parent first, `depth` at most) that listens on TCP `port`: under
    torchrun, the agent that hosts the job's store. Global rank 0 is a child of the agent whose group rank is 0
    (torch.distributed.elastic assigns ranks by group rank), and that agent hosts the workers' store at
    MASTER_ADDR:MASTER_PORT under both its rendezvous: `static` (`--master_addr`: `StaticTCPRendezvous`, is_master =
    node rank 0) and `c10d` (`DynamicRendezvousHandler._shared_tcp_store_server`, created by rank 0); torch 2.13's
    sources. Checked, not assumed: the port's listening socket (/proc/net/tcp{,6}, state 0A) must be one of that
    process's descriptors (/proc/PID/fd, readable for a process of the same user). None when none of them holds it.
    Cost: two small /proc reads and one listing of the agent's descriptors, once, on rank 0."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as fh:
                rows = fh.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{f[9]}]")
    p = os.getppid() if pid is None else pid
    for _ in range(depth if inodes else 0):
        if p <= 1:
            return None
        try:
            fds = os.listdir(f"/proc/{p}/fd")
        except OSError:
            fds = []
        for fd in fds:
            try:
                if os.readlink(f"/proc/{p}/fd/{fd}") in inodes:
                    return p
            except OSError:
                continue
        try:
            with open(f"/proc/{p}/stat") as fh:
                p = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return None
    return None


def raise_fd_limit_of(pid: int) -> int | None:
    """raise_fd_limit() for another process of this user (prlimit(2) allows it): torchrun's agent, which hosts the job's
    store and never raises its own soft limit. Returns its soft limit after (None if it cannot be read)."""
    import resource

    try:
        soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    except (OSError, ValueError):
        return None
    soft, want = _raise_soft(soft, hard, lambda limits: resource.prlimit(pid, resource.RLIMIT_NOFILE, limits))
    return want if soft == resource.RLIM_INFINITY else soft


def fd_refusal(have: int, need: int, who: str) -> str | None:
    """The one-line refusal when `have` descriptors (the raised limit) cannot hold `need`; None when they can."""
    if have >= need:
        return None
    return (f"{who} may open only {have} file descriptors (its hard limit, `ulimit -Hn`) but needs {need} for this "
            f"world: raise the hard limit on the nodes (`ulimit -n {need}` in the job script where the hard limit "
            f"allows, LimitNOFILE={need} or more in slurmd's systemd unit, or PropagateResourceLimits=NOFILE in "
            "slurm.conf with a higher limit where you submit) and resubmit")
