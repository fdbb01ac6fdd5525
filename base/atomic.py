"""The one copy of durable, atomic file writes: fsync a file or a folder, and write a whole file so that a reader
sees the old content, the new one, or none (tmp + fsync + os.replace + fsync of the folder). The data preparation
(data/store.py) and the checkpointer (training/checkpoint_files.py) both write through these."""

from __future__ import annotations

import os
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


def atomic_write(path: str, write: bytes | Callable, suffix: str = "") -> None:
    """Replace `path` atomically with `write` (bytes, or a function writing into the open binary file), fsynced,
    its folder fsynced after the rename. `suffix` ends the tmp name (np.save appends ".npy" to names without it)."""
    tmp = f"{path}.tmp{os.getpid()}{suffix}"
    with open(tmp, "wb") as fh:
        if callable(write):
            write(fh)
        else:
            fh.write(write)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_path(os.path.dirname(path) or ".")
