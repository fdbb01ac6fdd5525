"""One save's files written in the background: the training thread only serializes (the snapshot), one thread
writes, checksums and fsyncs while the next steps run. training/checkpoint.py commits the checkpoint (manifest
last) once every rank's `Snapshot` is durable, decided by a collective (docs/checkpoints.md, "Asynchronous saves").

Why a thread and in-memory serialization (torch.save into a buffer) rather than DeepSpeed's decoupled engine, its
FastPersist writer or PyTorch's async DCP: see docs/checkpoints.md. What the snapshot costs: one copy of the rank's
checkpoint bytes in host memory (`Arena`, kept for the run: Llama-3-8B on 32 ranks: ~3 GB per rank, ~24 GB per
8-rank node), the serialization (a memory copy, GB/s) is all the step loop waits for; writing (the storage's
rate: 100 GB at ~0.6 GB/s per node is ~40 s) overlaps the next steps. The files hold what the synchronous save's
hold (the same torch.save of the same state dicts), so a resume cannot tell the two apart.
"""

from __future__ import annotations

import os
import threading
import time
import zlib

import torch

from base.atomic import fsync_path

CHUNK = 1 << 26  # 64 MiB per write and CRC32 update: both release the GIL, so the step loop runs meanwhile


class Arena:
    """Host memory the snapshots of one rank are serialized into, kept from one save to the next: after the first
    save its pages are already mapped, so a snapshot is one memory copy per byte (no page faults, no regrowth; a
    fresh buffer per save measured ~2x slower here). Its size is the rank's checkpoint (12 bytes per parameter /
    world under ZeRO-3: ~3 GB per rank for Llama-3-8B on 32 ranks), held for the run once a save happened."""

    def __init__(self):
        self.buf = bytearray()
        self.used = 0

    def reset(self) -> None:
        self.used = 0  # the previous snapshot is on disk (one save in flight at most): overwrite it

    def write(self, b) -> int:
        n = len(memoryview(b).cast("B"))
        end = self.used + n
        if end > len(self.buf):  # the first save, or a bigger one: grow (amortized) once
            self.buf.extend(bytes(max(end - len(self.buf), len(self.buf) // 2)))
        self.buf[self.used:end] = memoryview(b).cast("B")
        self.used = end
        return n

    def flush(self) -> None:
        pass


class Snapshot:
    """The files of one rank's save, held in memory, then written by `start()`'s thread. `result()` is every
    file's manifest entry (relative name -> size, CRC32) once durable; it raises the writer's error."""

    def __init__(self, root: str, arena: Arena | None = None):
        self.root = root
        self.arena = arena or Arena()
        self.arena.reset()
        self._files: list[tuple[str, tuple[int, int] | bytes]] = []  # path, (start, end) in the arena or bytes
        self._entries: dict[str, dict] = {}
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.nbytes = 0  # host memory held until the write is durable
        self.write_s = 0.0
        self.serialize_s = 0.0  # of the blocked time, what torch.save into the arena took (the rest is DeepSpeed's)

    def add_torch(self, path: str, obj, zipfile: bool = True) -> None:
        """torch.save `obj` into memory now: later changes to its tensors (the next step) do not reach the file."""
        t0, start = time.perf_counter(), self.arena.used
        torch.save(obj, self.arena, _use_new_zipfile_serialization=zipfile)
        self._add(path, (start, self.arena.used))
        self.serialize_s += time.perf_counter() - t0

    def add_bytes(self, path: str, data: bytes) -> None:
        self._add(path, data)

    def _add(self, path: str, data) -> None:
        assert self._thread is None, "a snapshot's files are all added before its write starts"
        self._files.append((path, data))
        self.nbytes += data[1] - data[0] if isinstance(data, tuple) else len(data)

    def start(self) -> None:
        # daemon: a process that ends (an error elsewhere, a kill) does not wait for it; the checkpoint stays uncommitted
        self._thread = threading.Thread(target=self._run, name="checkpoint-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            folders = set()
            while self._files:
                path, data = self._files.pop(0)
                if isinstance(data, tuple):
                    data = memoryview(self.arena.buf)[data[0]:data[1]]
                self._entries[os.path.relpath(path, self.root)] = write_durable(path, data)
                folders.add(os.path.dirname(path))
                del data
            for d in sorted(folders):  # the new names themselves durable, not only the bytes
                fsync_path(d)
        except BaseException as e:  # handed to the training thread by result(); the save is then not committed
            self._error = e
        self.write_s = time.perf_counter() - t0

    def done(self) -> bool:
        return self._thread is not None and not self._thread.is_alive()

    def failed(self) -> bool:
        return self.done() and self._error is not None

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def result(self) -> dict[str, dict]:
        self.wait()
        if self._error is not None:
            raise RuntimeError(f"background checkpoint write under {self.root} failed: "
                               f"{type(self._error).__name__}: {self._error}") from self._error
        return self._entries


def write_durable(path: str, data) -> dict:
    """Write `data` (bytes or a memoryview) to `path`, fsynced; returns its manifest entry (size, CRC32 on the way)."""
    view = memoryview(data)
    crc = 0
    try:
        with open(path, "wb") as fh:
            for i in range(0, len(view), CHUNK):
                piece = view[i:i + CHUNK]
                crc = zlib.crc32(piece, crc)
                fh.write(piece)
            fh.flush()
            os.fsync(fh.fileno())
        return {"size": len(view), "crc32": f"{crc:08x}"}
    finally:
        view.release()
