"""One save's files written in the background: the training thread only copies the state (the snapshot) into host
memory it keeps from one save to the next; one thread serializes (torch.save), checksums, writes and fsyncs while the
next steps run. training/checkpoint.py commits the checkpoint (manifest last) once every rank's `Snapshot` is
durable, decided by a collective (docs/checkpoints.md, "Asynchronous saves").

Why a thread and our own staging rather than DeepSpeed's decoupled engine, its FastPersist writer or PyTorch's async
DCP: see docs/checkpoints.md. What the snapshot costs: one copy of the rank's checkpoint bytes in host memory
(`Staging`, kept until the stage's end: Llama-3-8B on 32 ranks under ZeRO-3, 12 bytes per parameter / world: ~3 GB per
rank, ~24 GB per 8-rank node; page-locked at its exact size on a GPU node (base/host_arena.py; torch's pinned blocks
were rounded up to a power of two: 3 x 3.73 -> 3 x 4 GiB per sub-group on 8 ranks), where the copy is GPU -> host by
DMA at ~10+ GB/s). The copy is all the step loop waits for: host -> host for what ZeRO offload keeps on the CPU, one
memcpy per storage (GB/s; ~1 s for 3 GB at this box's ~3 GB/s). torch.save's zip writer (a CRC32 per record and Python
write calls, ~250 MB/s here: 4.7 s of the 4.9 s the step loop used to wait) and the write (the storage's rate: 100 GB
at ~0.6 GB/s per node is ~40 s) run in the thread. The files hold what the synchronous save's hold (torch.save of the
same state dicts: storages shared as they were, whole storages saved), so a resume cannot tell the two apart.
"""

from __future__ import annotations

import copy
import os
import threading
import time

import torch

from base import host_arena, progress
from base.atomic import fsync_path
from training.checkpoint_files import WRITTEN, CrcWriter, save_torch

_HOST = ("cpu",)  # device types whose states are host memory already: a pageable copy (a test empties it)
CHUNK = 1 << 26  # 64 MiB per write and CRC32 update: both release the GIL, so the step loop runs meanwhile
_ATOMS = (int, float, complex, str, bytes, bool, type(None), torch.dtype, torch.device)


class Staging:
    """Host storages a snapshot copies the state's tensors into, kept from one save to the next: a save of the same
    shapes (every save of a stage) reuses each one, so after the first save a snapshot is one memory copy per byte
    (no allocation, no page faults; a fresh buffer per save measured ~2x slower here). Its size is the rank's
    checkpoint, held from a stage's first background save to the stage's end (`release`). One snapshot uses it at a
    time (at most one save is in flight: the next snapshot starts after the previous write is durable)."""

    def __init__(self):
        self.buffers: list[torch.UntypedStorage] = []
        self.used = 0
        self.nbytes = 0

    def reset(self) -> None:
        self.used, self.nbytes = 0, 0  # the previous snapshot is on disk: overwrite its buffers

    def release(self) -> int:
        """Give every buffer back (unregistered where page-locked); the next snapshot allocates afresh. At a stage's
        end (training/stage.py), with no save in flight: the stage's last save is synchronous and the next stage's
        first background save is a stage away, while the next engine is built and loads its checkpoint (that load
        holds a transient copy of the fp32 master, 4 bytes per parameter / world). Returns the bytes released."""
        held = sum(b.nbytes() for b in self.buffers)
        for b in self.buffers:
            host_arena.unlock(b)
        self.buffers.clear()
        self.reset()
        return held

    def copy(self, src: torch.UntypedStorage) -> torch.UntypedStorage:
        """A host copy of `src` in the next buffer (reused when its size matches, else replaced)."""
        n, i = src.nbytes(), self.used
        self.used += 1
        if i >= len(self.buffers) or self.buffers[i].nbytes() != n:
            if src.device.type not in _HOST:  # GPU -> page-locked host, exact size: a DMA, not a pageable bounce
                buf = host_arena.page_locked(n).untyped_storage()
            else:
                buf = torch.UntypedStorage(n)
            if i < len(self.buffers):
                host_arena.unlock(self.buffers[i])  # a size that changed: the old buffer goes back pageable
            self.buffers[i:i + 1] = [buf]
        buf = self.buffers[i]
        buf.copy_(src, non_blocking=src.device.type != "cpu")
        self.nbytes += n
        return buf


def stage(obj, staging: Staging, memo: dict | None = None):
    """`obj` (a state dict: dicts, lists, tuples, tensors, numbers, strings, small objects) with every tensor's storage
    copied into `staging` and every container copied, so that the next step's in-place updates (the optimizer's
    partitions, the param groups' lr) do not reach it. Views of one storage stay views of one copy, as torch.save
    keeps them; a storage is copied whole, as torch.save writes it."""
    memo = {} if memo is None else memo
    if isinstance(obj, _ATOMS):
        return obj
    if id(obj) in memo:
        return memo[id(obj)]
    if isinstance(obj, torch.Tensor):
        out = _stage_tensor(obj, staging, memo)
    elif isinstance(obj, dict):
        out = copy.copy(obj)  # keeps the type (OrderedDict, defaultdict's factory) and its attributes
        for k, v in obj.items():
            out[k] = stage(v, staging, memo)
    elif isinstance(obj, list):
        out = [stage(v, staging, memo) for v in obj]
    elif isinstance(obj, tuple):
        items = [stage(v, staging, memo) for v in obj]
        out = type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    else:  # anything else a checkpoint holds (argparse.Namespace, a dataclass, numpy state): small, copied whole
        out = copy.deepcopy(obj)
    memo[id(obj)] = out
    return out


def _stage_tensor(t: torch.Tensor, staging: Staging, memo: dict) -> torch.Tensor:
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout != torch.strided or t.is_meta:
        return t.detach().clone()  # rare kinds (sparse, subclasses): a plain copy
    src = t.untyped_storage()
    key = ("storage", src.device, src.data_ptr())
    if key not in memo:
        memo[key] = staging.copy(src)
    out = torch.empty(0, dtype=t.dtype).set_(memo[key], t.storage_offset(), t.size(), t.stride())
    if isinstance(t, torch.nn.Parameter):
        return torch.nn.Parameter(out, requires_grad=t.requires_grad)
    return out.requires_grad_(t.requires_grad) if t.is_leaf and t.requires_grad else out


class Staged:
    """A staged object and how torch.save writes it (the checkpoint engine's zipfile setting)."""

    def __init__(self, obj, zipfile: bool):
        self.obj, self.zipfile = obj, zipfile


class Snapshot:
    """The files of one rank's save, held in memory, then written by `start()`'s thread. `result()` is every
    file's manifest entry (relative name -> size, CRC32) once durable; it raises the writer's error."""

    def __init__(self, root: str, staging: Staging | None = None):
        self.root = root
        self.staging = staging or Staging()
        self.staging.reset()
        self._files: list[tuple[str, Staged | bytes]] = []
        self._entries: dict[str, dict] = {}
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.nbytes = 0  # host memory held until the write is durable
        self.write_s = 0.0  # the thread's: serialization, checksums, writes, fsyncs
        self.copy_s = 0.0  # of the blocked time, what the copies into host memory took (the rest is DeepSpeed's)

    def add_torch(self, path: str, obj, zipfile: bool = True) -> None:
        """Copy `obj` into host memory now (later changes to its tensors, the next step, do not reach the file); the
        thread torch.saves the copy."""
        t0, before = time.perf_counter(), self.staging.nbytes
        staged = stage(obj, self.staging)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.current_stream().synchronize()  # the non-blocking GPU -> pinned copies have landed
        self._add(path, Staged(staged, zipfile), self.staging.nbytes - before)
        self.copy_s += time.perf_counter() - t0

    def add_bytes(self, path: str, data: bytes) -> None:
        self._add(path, data, len(data))

    def _add(self, path: str, data, nbytes: int) -> None:
        assert self._thread is None, "a snapshot's files are all added before its write starts"
        self._files.append((path, data))
        self.nbytes += nbytes

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

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait for the write (at most `timeout_s`, None: to its end); True if it is done. A tick of this rank's
        progress each time the write has moved (checkpoint_files.WRITTEN): a long wait is no hang, a stuck write is."""
        if self._thread is not None:
            end = None if timeout_s is None else time.monotonic() + timeout_s
            seen = WRITTEN[0]
            while self._thread.is_alive():
                left = 5.0 if end is None else min(5.0, end - time.monotonic())
                if left <= 0:
                    break
                self._thread.join(left)
                if WRITTEN[0] != seen:
                    seen = WRITTEN[0]
                    progress.tick()
        return self.done()

    def result(self) -> dict[str, dict]:
        self.wait()
        if self._error is not None:
            raise RuntimeError(f"background checkpoint write under {self.root} failed: "
                               f"{type(self._error).__name__}: {self._error}") from self._error
        return self._entries


def write_durable(path: str, data) -> dict:
    """Write `data` (a `Staged` object, torch.saved here, or bytes) to `path`, fsynced; returns its manifest entry
    (size, CRC32 on the way)."""
    if isinstance(data, Staged):
        return save_torch(data.obj, path, data.zipfile)
    view = memoryview(data)
    try:
        with open(path, "wb") as fh:
            w = CrcWriter(fh)  # its dirty bytes flushed every SYNC_EVERY: the wait's ticks follow WRITTEN
            for i in range(0, len(view), CHUNK):
                w.write(view[i:i + CHUNK])
            fh.flush()
            os.fsync(fh.fileno())
        return w.entry()
    finally:
        view.release()
