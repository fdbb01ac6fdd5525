"""Page-locked host memory at its exact size: the offloaded layer checkpoints (model_utils/memory.py) and the async
save's host copy of GPU-resident states (training/async_save.Staging).

Why not `pin_memory=True`: torch's caching host allocator (ATen/core/CachingHostAllocator.h, torch 2.13) rounds every
pinned block up to a power of two and keeps freed blocks cached for the run (planner/memory_model.PINNED_NO_LIMIT).
Llama-3-8B at 5M tokens on 8 GPUs offloads 32 checkpoints of 4.77 GiB per rank: pinned, each is held as 8 GiB,
2,048 GiB per node, which a 2 TiB node does not have; at their size they are 1,221 GiB. (Setting only
pinned_max_round_threshold_mb is unsafe in torch 2.13: get_free_block can hand out a smaller cached block.)

How: anonymous pageable memory of exactly the bytes asked (an mmap: page-aligned and shared with no other allocation,
so two registrations never overlap a page), page-locked in place with cudaHostRegister through torch.cuda.cudart(),
as torch's own async checkpoint stager does (torch/distributed/checkpoint/_state_dict_stager.py). The host holds the
request rounded up to a 4 KiB page at most. A registered tensor is pinned memory to CUDA and to torch:
`is_pinned()` is True (CUDAHooks::isPinnedPtr asks cudaPointerGetAttributes, which reports registered memory as
cudaMemoryTypeHost), and a `copy_(non_blocking=True)` from or to the GPU is one cudaMemcpyAsync on the current stream
(ATen/native/cuda/Copy.cu issues it whatever the host memory is; the driver copies page-locked memory by DMA without
blocking the host), so the offload's device -> host copy overlaps compute as with a pinned block.

`HostArena`: slots keyed by (bytes, dtype), reused across steps: a slot is free again once nothing but the arena
holds its storage (the step's backward dropped the checkpoint), and the checkpoints of a stage have the same shapes
every step (every micro-batch is packed to the stage's length), so the first step allocates them and later steps
allocate nothing; shapes that varied from step to step would keep a set of slots per shape. `release()` (or the arena's end with
its model, at stage end: training/engine.release_engine + gc.collect) waits for the device and unregisters them.

What it costs at the target scale: registration faults in and page-locks every page once (the kernel zeroes each
fresh page): ~0.1-0.5 s per GiB per rank, the same first-touch cost cudaHostAlloc paid for the caching allocator's
blocks, once per stage, at its first step (measured on this CPU box: first touch of a fresh mmap 0.46 s/GiB idle,
up to 3.6 under load; not yet measured with cudaHostRegister on a GPU node). Llama-3-8B at 5M on 8 GPUs: 32 x 4.77
GiB = 153 GiB per rank, ~15-75 s once per stage (the rounded path pinned 256 GiB per rank). Per step: a scan of the
slots of one key and one storage use-count per take (~1 us), 32 per step: nothing against a multi-minute step.

Fallback: where registration fails on a GPU (a platform without it, a locked-memory limit), one warning line on
that rank and the old path, `pin_memory` through torch's caching host allocator (rounded: the host then holds up to
2x what the plan counts). `STATS` says which path ran and how many bytes each holds (bench/gpu_probe.py records it).
Without CUDA (a CPU run, the tests) the memory stays pageable: the same bookkeeping, nothing to register.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
import weakref

import torch

PAGE = mmap.PAGESIZE
# bytes page-locked by cudaHostRegister now; bytes pinned by the fallback (as requested; the allocator holds them
# rounded up to a power of two); fallback events; registrations done (each a one-time cost per slot)
STATS = {"registered_bytes": 0, "fallback_pinned_bytes": 0, "fallbacks": 0, "registrations": 0}
_LOCKED: dict[int, int] = {}  # data_ptr -> bytes, what this process registered and has not unregistered
_FALLBACK: dict[int, int] = {}  # data_ptr -> bytes, what the fallback pinned
_FAILED: list[str] = []  # the first registration failure's message: later buffers take the fallback at once


class CudaRegistrar:
    """cudaHostRegister / cudaHostUnregister (torch.cuda.cudart()); each returns the cudaError code, 0 on success."""

    FLAGS = 0  # cudaHostRegisterDefault: one device per rank, its context is the one that copies

    def register(self, ptr: int, nbytes: int) -> int:
        err = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, self.FLAGS))
        if err:
            _clear_last_cuda_error()
        return err

    def unregister(self, ptr: int) -> int:
        err = int(torch.cuda.cudart().cudaHostUnregister(ptr))
        if err:
            _clear_last_cuda_error()
        return err


def _clear_last_cuda_error() -> None:
    """A failed runtime call stays the thread's "last error" (torch's binding returns it, C10_CUDA_ERROR_HANDLED, and
    does not clear it), and torch's next kernel launch check (cudaGetLastError) would raise it there. Clear it through
    the libcudart this process loaded (/proc/self/maps), best effort."""
    try:
        with open("/proc/self/maps") as fh:
            paths = {line.split()[-1] for line in fh if "libcudart" in line}
        for path in paths:
            ctypes.CDLL(path).cudaGetLastError()
    except (OSError, AttributeError):
        pass


# "auto": resolved at the first buffer (importing this module touches no device); None: no CUDA, nothing to
# register. The tests put a stand-in here (tests/unit/model_utils/test_host_arena.py).
REGISTRAR: CudaRegistrar | None | str = "auto"


def registrar() -> CudaRegistrar | None:
    global REGISTRAR
    if REGISTRAR == "auto":
        REGISTRAR = CudaRegistrar() if torch.cuda.is_available() else None
    return REGISTRAR


def _pinned(nbytes: int) -> torch.Tensor:
    """The fallback: a block of torch's caching host allocator (rounded up to a power of two, cached for the run)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def page_locked(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes] of host memory, page-locked at its size where CUDA is (see the module docstring)."""
    if nbytes <= 0:
        return torch.empty(0, dtype=torch.uint8)
    reg = registrar()
    if reg is not None and _FAILED:
        return _fallback(nbytes)
    buf = torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)  # the tensor keeps the mapping alive
    if reg is None:
        return buf
    ptr = buf.data_ptr()
    err = reg.register(ptr, nbytes)
    if err:
        _FAILED.append(f"cudaHostRegister of {nbytes / 2**30:.2f} GiB failed (cudaError {err})")
        print(f"host arena: {_FAILED[0]}; pinning through torch's caching host allocator instead, which rounds each "
              f"block up to a power of two (host memory up to 2x what the plan counts)", file=sys.stderr, flush=True)
        return _fallback(nbytes)
    _LOCKED[ptr] = nbytes
    STATS["registered_bytes"] += nbytes
    STATS["registrations"] += 1
    return buf


def _fallback(nbytes: int) -> torch.Tensor:
    STATS["fallbacks"] += 1
    STATS["fallback_pinned_bytes"] += nbytes
    buf = _pinned(nbytes)
    _FALLBACK[buf.data_ptr()] = nbytes
    return buf


def unlock(buf: torch.Tensor | torch.UntypedStorage) -> None:
    """Undo page_locked's registration of `buf` (its memory becomes pageable; it is freed with its last reference).
    The caller makes sure no copy from or to it is in flight (release() synchronizes)."""
    ptr = buf.data_ptr()
    if ptr in _LOCKED:
        err = registrar().unregister(ptr)
        assert not err, f"cudaHostUnregister of a registered buffer failed (cudaError {err})"
        STATS["registered_bytes"] -= _LOCKED.pop(ptr)
    elif ptr in _FALLBACK:
        STATS["fallback_pinned_bytes"] -= _FALLBACK.pop(ptr)


def path() -> str:
    """Which path holds this process' page-locked host memory: registered, fallback-pinned or pageable (no CUDA)."""
    return "pageable" if registrar() is None else "pinned-fallback" if _FAILED else "registered"


class HostArena:
    """Exact-size host slots for tensors copied off the device each step (see the module docstring)."""

    def __init__(self, name: str):
        self.name = name
        self.slots: dict[tuple[int, torch.dtype], list[list]] = {}  # key -> [[uint8 slot, free use count, event]]
        self._by_ptr: dict[int, list] = {}  # a slot's data_ptr -> its entry
        self._end = weakref.finalize(self, _release, self.slots)  # with its owner (the model) at the latest
        self._end.atexit = False  # at exit the CUDA context may be gone first; the OS takes the memory back

    @property
    def nbytes(self) -> int:
        """Host bytes the arena holds: the sum of its slots' exact sizes."""
        return sum(n * len(slots) for (n, _), slots in self.slots.items())

    def take(self, shape: torch.Size | tuple, dtype: torch.dtype) -> torch.Tensor:
        """A contiguous host tensor of `shape` and `dtype` in a free slot of exactly its bytes (a new one only when
        every slot of that size is still held)."""
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * dtype.itemsize
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        slots = self.slots.setdefault((nbytes, dtype), [])
        for entry in slots:
            if _use_count(entry[0]) <= entry[1]:
                break
        else:
            buf = page_locked(nbytes)
            entry = [buf, _use_count(buf), None]
            slots.append(entry)
            self._by_ptr[buf.data_ptr()] = entry
        if entry[2] is not None:  # the device's last read of this slot (a backward's host -> device copy) comes first
            torch.cuda.current_stream().wait_event(entry[2])
            entry[2] = None
        return entry[0].view(dtype).view(shape)

    def read(self, host: torch.Tensor) -> None:
        """`host` (a slot's tensor) was just copied to the device on the current stream: the slot's next writer waits
        for that copy on the device (no host sync), whatever stream it runs on."""
        if not torch.cuda.is_available():
            return
        entry = self._by_ptr.get(host.untyped_storage().data_ptr())
        if entry is not None:
            entry[2] = torch.cuda.Event()
            entry[2].record()

    def release(self) -> None:
        """Unregister and drop every slot (the stage ended); tensors still viewing one keep plain pageable memory."""
        _release(self.slots)
        self._by_ptr.clear()


def _use_count(buf: torch.Tensor) -> int:
    """References to `buf`'s storage: the arena's own while the slot is free, more while a handed-out view lives (or a
    view of it, which a per-tensor weakref would miss). torch's own private counter (torch 2.13)."""
    return torch._C._storage_Use_Count(buf.untyped_storage()._cdata)


def _release(slots: dict) -> None:
    if not slots:
        return
    if registrar() is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()  # no copy from or to a slot is in flight when it stops being page-locked
    for entries in slots.values():
        for entry in entries:
            unlock(entry[0])
    slots.clear()
