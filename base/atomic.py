"""The one copy of durable, atomic file writes: fsync a file or a folder, and write a whole file so that a reader
sees the old content, the new one, or none (tmp + fsync + os.replace + fsync of the folder). The data preparation
(data/store.py) and the checkpointer (training/checkpoint_files.py) both write through these."""

from __future__ import annotations

import errno
import os
import secrets
import socket
from collections.abc import Callable


def nearest_folder(path: str) -> str:
    """`path` itself if it is a folder, else its nearest parent that is (the file system something made there lands
    on, before it is made)."""
    while not os.path.isdir(path) and path != os.path.dirname(path):
        path = os.path.dirname(path)
    return path


def fsync_path(path: str) -> None:
    """fsync a file or a folder (a folder's fsync makes a rename or a new entry in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tmp_name(path: str, suffix: str = "") -> str:
    """A name beside `path` that no other writer picks: host, pid and 32 random bits (a pid alone is not: two jobs'
    rank 0s in containers with their own pid namespace, on one shared volume, both run as pid 7, say)."""
    return f"{path}.tmp.{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(4)}{suffix}"


def full_disk(e: BaseException, path: str) -> BaseException:
    """`e` made a full disk's OSError where it is one that says no errno (numpy's `tofile` short write: `OSError('54784
    requested and 27120 written')`, errno None, measured on a full tmpfs) and the file system of `path` has no block
    left for us (statvfs f_bavail 0): errno ENOSPC, so the one-line exit 2 (training/job.py, data/prepare_checks.py)
    sees it. A quota (EDQUOT) is not seen this way (statvfs does not count it): the writer must pass the OS's errno
    (data/store.py's `NpyOut`). One statvfs, only on a failure. Returns `e`."""
    if isinstance(e, OSError) and e.errno is None:
        try:
            empty = os.statvfs(nearest_folder(path)).f_bavail == 0
        except OSError:
            empty = False
        if empty:
            e.errno, e.strerror = errno.ENOSPC, os.strerror(errno.ENOSPC)
    return e


def named(e: OSError, path: str) -> OSError:
    """`e`, a failed write's OSError, as the one line needs it: a full disk's where it says no errno (`full_disk`) and
    naming `path` where it names nothing (a write() into an open file never does: a full disk there was an unnamed
    error, a crash of the node, not the user's one line; training/job.users_disk). Returns `e`."""
    full_disk(e, path)
    e.filename = e.filename or path
    return e


def atomic_write(path: str, write: bytes | Callable, suffix: str = "") -> None:
    """Replace `path` atomically with `write` (bytes, or a function writing into the open binary file), fsynced,
    its folder fsynced after the rename. `suffix` ends the tmp name (np.save appends ".npy" to names without it).
    The tmp (tmp_name: this write's own) is removed if the write fails or is interrupted. A failed write's OSError
    names `path` where it names nothing (a write() into an open file never does: a full disk there was an unnamed
    error, a crash of the node, not the user's one line; training/job.users_disk), as metrics.log names its file."""
    tmp = tmp_name(path, suffix)
    try:
        with open(tmp, "wb") as fh:
            if callable(write):
                write(fh)
            else:
                fh.write(write)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if isinstance(e, OSError):
            named(e, path)  # before the tmp (beside `path`) goes: its blocks are what filled the disk
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
    fsync_path(os.path.dirname(path) or ".")
