"""The one copy of durable, atomic file writes: fsync a file or a folder, and write a whole file so that a reader
sees the old content, the new one, or none (tmp + fsync + os.replace + fsync of the folder). The data preparation
(data/store.py) and the checkpointer (training/checkpoint_files.py) both write through these."""

from __future__ import annotations

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


def atomic_write(path: str, write: bytes | Callable, suffix: str = "") -> None:
    """Replace `path` atomically with `write` (bytes, or a function writing into the open binary file), fsynced,
    its folder fsynced after the rename. `suffix` ends the tmp name (np.save appends ".npy" to names without it).
    The tmp (tmp_name: this write's own) is removed if the write fails or is interrupted."""
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
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
    fsync_path(os.path.dirname(path) or ".")
