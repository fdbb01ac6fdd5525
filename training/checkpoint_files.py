"""The file side of a checkpoint: atomic writes, files fsynced and checksummed while they are written (CRC32,
size), the deal of a manifest's files to the ranks that verify them, which rank's file each is, and the look-up of
files a node may see late. training/checkpoint.py decides what a checkpoint holds and when it exists; this is how
its bytes reach the disk and are checked.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
import zlib
from collections.abc import Callable, Iterable

import torch

from base import progress
from base.atomic import atomic_write as atomic_bytes
from base.atomic import fsync_path

MANIFEST = "MANIFEST.json"
POINTER = "LATEST"  # under checkpoints/: the newest committed checkpoint's name
# DeepSpeed's own pointer, beside LATEST: the same name (`point`), for DeepSpeed's tools; nothing here reads it
DS_LATEST = "latest"
TAG = re.compile(r"^step_(\d{6,})$")  # a checkpoint's folder name


def manifest_sha256(ckpt: str) -> str | None:
    """A checkpoint's content identity: the SHA-256 of its manifest (every file's size and CRC32); None if none."""
    try:
        with open(os.path.join(ckpt, MANIFEST), "rb") as fh:
            return hashlib.sha256(fh.read()).hexdigest()
    except OSError:
        return None


fsync_file = fsync_path  # base/atomic.py holds the one copy (data/store.py writes through it too)


def atomic_write(path: str, text: str) -> dict:
    """Write `text` to `path` atomically (tmp, fsync, rename, fsync of the folder); returns its manifest entry."""
    data = text.encode()
    atomic_bytes(path, data)
    return {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}


def point(root: str, tag: str | None) -> None:
    """Rank 0: LATEST names `tag`, then DeepSpeed's `latest` does (None: both removed). Written after the manifest,
    LATEST first: `latest` never names an uncommitted checkpoint (DeepSpeed's save writes it on rank 0 before its
    final barrier, so it is not asked for there: save_latest=False). Without it, a user's `engine.load_checkpoint(
    OUTPUT/checkpoints)` warned "Unable to find latest file" and returned (None, None) (the script trained on from its
    initial weights), and zero_to_fp32 without a tag raised "Unable to find 'latest' file" (deepspeed 0.19.8
    runtime/engine.py load_checkpoint, utils/zero_to_fp32.py get_fp32_state_dict_from_zero_checkpoint: each reads
    `<dir>/latest`, stripped). Its bytes are DeepSpeed's (the tag, no newline). A case-insensitive file system (macOS)
    holds one file for both names, with the same tag: harmless. Cost: one more small atomic write per commit (ms)."""
    for name, text in ((POINTER, f"{tag}\n"), (DS_LATEST, tag)):
        path = os.path.join(root, name)
        if tag is not None:
            atomic_write(path, text)
        elif os.path.lexists(path):
            os.remove(path)


def describe(path: str, f: str) -> dict:
    """The manifest entry of file `f` of checkpoint `path`, read back once (fsynced first): for the files written
    outside the checkpoint engine."""
    full = os.path.join(path, f)
    fsync_file(full)
    return {"size": os.path.getsize(full), "crc32": crc32(full)}


# Bytes every checkpoint write has passed on, the background writer's too. A save is progress for the hang detector
# (base/progress.py) while bytes move: the training thread ticks as it writes and, waiting for the background write,
# as this grows. Without it a stage end's wait for the write plus its own save (Llama-3-8B on 32 ranks at 150 MB/s a
# node: 161 + 161 s) passed the 300-s bound of a `save` phase measured by async snapshots (~1 s): a false hang, exit 69.
WRITTEN = [0]


# A file's dirty bytes are flushed every SYNC_EVERY (fdatasync), the flush a tick: torch.save's writes land in the
# page cache (Linux throttles a writer only near dirty_ratio, hundreds of GB on a 1-2 TB node; NFS as well), so the
# file's one fsync at the end drained all of it without a tick. Qwen2.5-7B on one node of 8 (the shipped SFT recipe):
# 91 GB a node, ~84 GB still dirty after ~46 s of writes, ~564 s of fsyncs at 149 MB/s a node: past the 300-s bound a
# `save` phase gets from async snapshots (a false hang, exit 69, at every stage end). Now a rank's longest stretch
# without a tick is one SYNC_EVERY at its share of the node's rate (256 MiB at 149/8 MB/s: ~14 s). A write is split
# into pieces of SYNC_EVERY (torch.save hands a 3 GB optimizer partition over in one call). Cost: the writes wait for
# each flush instead of overlapping it, the disk the bottleneck either way.
SYNC_EVERY = 256 << 20


class CrcWriter:
    """A file object that counts the size and CRC32 of what passes through it (torch.save writes to it), flushing
    its dirty bytes every SYNC_EVERY (above)."""

    def __init__(self, fh):
        self.fh, self.crc, self.size, self.dirty = fh, 0, 0, 0
        self.main = threading.current_thread() is threading.main_thread()  # the background writer does not tick

    def write(self, b) -> int:
        view = memoryview(b)
        view = view if view.format == "B" and view.ndim == 1 else view.cast("B")
        for i in range(0, len(view), SYNC_EVERY):
            piece = view[i:i + SYNC_EVERY]
            self.crc = zlib.crc32(piece, self.crc)
            self.fh.write(piece)
            self.size += len(piece)
            WRITTEN[0] += len(piece)
            self.dirty += len(piece)
            if self.dirty >= SYNC_EVERY:
                self.sync()
            if self.main:
                progress.tick()
        return len(view)

    def sync(self) -> None:
        self.fh.flush()
        os.fdatasync(self.fh.fileno())
        self.dirty = 0

    def flush(self) -> None:
        self.fh.flush()

    def entry(self) -> dict:
        return {"size": self.size, "crc32": f"{self.crc:08x}"}


def save_torch(obj, path: str, zipfile: bool = True) -> dict:
    """torch.save to `path`, fsynced; returns its manifest entry, computed while writing."""
    with open(path, "wb") as fh:
        w = CrcWriter(fh)
        torch.save(obj, w, _use_new_zipfile_serialization=zipfile)
        fh.flush()
        os.fsync(fh.fileno())
    return w.entry()


def crc32(path: str) -> str:
    crc = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def list_files(d: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(dp, f), d) for dp, _, fs in os.walk(d) for f in fs if f != MANIFEST)


def deal_by_bytes(sizes: dict[str, int], world: int, own: bool = False) -> list[list[str]]:
    """Files to ranks for verification: largest first, each to the rank holding the fewest bytes so far (LPT).
    Deterministic in the manifest, so every rank computes the same deal. Llama-3-8B on 32 ranks: 32 optimizer
    partitions of ~3 GB and 32 of ~0.5 GB go one large and one small per rank, not all large ones to ranks 0-15.
    `own` (a checkpoint of this world size): each rank first gets the files it loads (`file_rank`), then the rest
    by bytes; the same balance when the partitions are equal. Dealt by name, a partition was verified on another
    node than the one loading it: the shared file system served its 96 GB (Llama-3-8B) twice a resume."""
    load, out, rest = [0] * world, [[] for _ in range(world)], sizes
    if own:
        rest = {}
        for f in sorted(sizes):
            r = file_rank(f)
            if r is not None and r < world:
                out[r].append(f)
                load[r] += sizes[f]
            else:
                rest[f] = sizes[f]
    for f in sorted(rest, key=lambda f: (-rest[f], f)):
        r = min(range(world), key=lambda i: (load[i], i))
        out[r].append(f)
        load[r] += sizes[f]
    return out


# The files of one rank, named by its world rank (training/engine.py): DeepSpeed's ZeRO-3 model and optimizer states
# ("bf16_" under bf16; its older "..._00optim_states.pt" too) and this project's state/rankNNNNN.pt
RANK_FILE = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_?(?:model|optim)_states\.pt|state/rank(\d+)\.pt")
EVERY = -1  # `awaited`: a file every rank reads


def state_file(rank: int) -> str:
    """This project's per-rank file of a checkpoint (its data position and RNG states), relative to the checkpoint."""
    return f"state/rank{rank:05d}.pt"


def file_rank(name: str) -> int | None:
    """The world rank whose file `name` (relative to its checkpoint) is; EVERY for NVMe optimizer offload's swap
    files (`offloaded_tensors/rankNN/...`: a rank copies its folder, named by its global rank or, with
    use_node_local_storage, its local rank; every rank looks them all up: NVMe offload is rare, its files few);
    None for the others (trainer.json, hf_config.json, a universal conversion's zero/*)."""
    if name.startswith("offloaded_tensors/"):
        return EVERY
    m = RANK_FILE.fullmatch(name)
    return None if m is None else int(m.group(1) or m.group(2))


def awaited(names: Iterable[str], rank: int, world: int, reader: Callable[[str], int | None]) -> list[str]:
    """The files of `names` that `rank` looks up before a load (`not_visible`): those it reads (`reader(name)`: the
    rank that reads it, EVERY, or None for none), and on rank 0 those no rank of `world` reads, so that each file is
    still looked up (one gone fails the load). Llama-3-8B on 512 ranks: 3 stats a rank (rank 0: +2) instead of every
    rank the checkpoint's 1,538 files, 1.57M stats into one directory of a shared file system per load (DeepSpeed's
    own load still checks every rank's optimizer file name on every rank: 262k, engine._get_all_zero_checkpoint_names)."""
    out = []
    for f in sorted(names):
        r = reader(f)
        if r == EVERY or r == rank or rank == 0 and (r is None or not 0 <= r < world):
            out.append(f)
    return out


def read_json(path: str) -> dict:
    """{"json": ...} or {"error": reason}: what rank 0 read, in a form every rank can be handed."""
    try:
        with open(path) as fh:
            return {"json": json.load(fh)}
    except (OSError, ValueError) as e:
        return {"error": f"{type(e).__name__}: {e}"}


def not_visible(root: str, sizes: dict[str, int], settle_s: float, every_s: float = 2.0) -> dict[str, int | None]:
    """The files (relative to `root`, name -> size expected) this process still cannot see whole after looking each
    one up again, by name, every `every_s` for up to `settle_s`: name -> the size seen (None: not found). A node may
    see another node's new file up to a minute late (NFS attribute and negative-lookup caching); a name lookup, never
    a cached directory listing, is what ends that. Costs one stat per file and look: a load looks up each rank's own
    files (`awaited`: 3 a rank), a universal conversion's ~1,200 files at Llama-3-8B on every rank (each reads them)."""
    give_up = time.monotonic() + settle_s
    todo = sorted(sizes)
    while True:
        seen = {}
        for f in todo:
            try:
                size = os.path.getsize(os.path.join(root, f)) if os.path.exists(os.path.join(root, f)) else None
            except OSError:  # removed between the two looks
                size = None
            if size is None or size < sizes[f]:
                seen[f] = size
        if not seen or time.monotonic() >= give_up:
            return seen
        time.sleep(every_s)
        todo = list(seen)
