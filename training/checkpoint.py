"""Atomic, verifiable checkpoints: saving and committing them, the only code that writes training state (reading it
back is training/restore.py).

Layout under OUTPUT_DIR/checkpoints/:

    step_000200/            DeepSpeed engine files (weights, optimizer, LR scheduler) written by every rank
        state/rank00003.pt  this rank's data position and RNG states
        trainer.json        counters, stage, config snapshot, W&B run id, layout, model-config hash
        hf_config.json      the model config of the stage (RoPE included), for export
        MANIFEST.json       written last: every file with size and CRC32
    LATEST                  name of the newest committed checkpoint, replaced atomically
    STAGE_1_s128k           name of the checkpoint that ended stage 1 ("s128k"); those are never rotated away

With `background=True` (`--async_save`) a save only snapshots its files into host memory and a thread writes them
(training/async_save.py); `poll()` at each step boundary commits it once an all-reduce says every rank's write is
durable, `finish()` waits for it (`finish(timeout_s)`: at most that long, for a stop inside the launcher's kill
window). At most one save is in flight.

What the commit costs on the step path (every other rank waits at its barrier meanwhile), Llama-3-8B on 32 ranks:
one all-gather of the ranks' manifest entries (~100 small dicts), rank 0's walk of the folder, MANIFEST.json (~20 KB)
and LATEST written atomically (a rename and two fsyncs each: milliseconds, ~0.1 s on a loaded NFS), and rotation's
*decision* with one rename per folder it drops. Deleting the dropped ~100 GB checkpoint (seconds to minutes) runs in
rank 0's background thread (training/rotation.py `Trash`), no longer inside `poll()`.

A checkpoint exists only once its manifest is written, after every rank has written and fsynced its
files (DeepSpeed's own `latest` file is not used: it is written on rank 0 before the final barrier).
Checksums are computed *while writing* (DeepSpeed's torch checkpoint engine is wrapped so every file it
writes passes through a CRC32 counter), so a save - the preemption save included - never reads its bytes
back; the few files written another way (DeepSpeed's copy of zero_to_fp32.py) are read once by rank 0.

Finding, verifying and loading a checkpoint (a stale view of a shared file system, another world size's universal
conversion, `--resume` branches) is training/restore.py: `Checkpointer` is its `Restorer` plus the save path here.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import time
from dataclasses import dataclass

import numpy as np
import torch

from base import comm
from base.parallel import FS_SETTLE_S
from training import rotation
from training.async_save import Snapshot, Staging
from training.branches import BRANCHES  # noqa: F401  (part of this module's interface)
from training.checkpoint_files import (  # noqa: F401  (MANIFEST, POINTER, deal_by_bytes: this module's interface)
    MANIFEST,
    POINTER,
    atomic_write,
    crc32,
    deal_by_bytes,
    fsync_file,
    list_files,
    save_torch,
)
from training.preemption import Deadline
from training.restore import Restorer, TrainState  # noqa: F401  (TrainState: part of this module's interface)


def tag_for(step: int) -> str:
    return f"step_{step:06d}"


def _world() -> tuple[int, int]:
    return comm.rank(), comm.world()


def _gather_dict(local: dict) -> dict:
    return {k: v for p in comm.all_gather_object(local) for k, v in p.items()}


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


@contextlib.contextmanager
def _recording(engine, root: str, written: dict, snapshot: Snapshot | None = None):
    """While DeepSpeed saves into `root`, every file its torch checkpoint engine writes gets its manifest entry
    computed on the way to disk (and is fsynced); with a `snapshot` (an asynchronous save) each file's state is copied
    into host memory instead, and serialized and written later by the snapshot's thread. Other checkpoint engines are left alone:
    their files are written by them and described by reading them back."""
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    ce = getattr(engine, "checkpoint_engine", None)
    if type(ce) is not TorchCheckpointEngine:
        yield
        return

    def save(state_dict, path: str) -> None:  # TorchCheckpointEngine.save's signature (called by keyword too)
        if snapshot is not None:
            snapshot.add_torch(path, state_dict, ce.zipfile_serialization)
        else:
            written[os.path.relpath(path, root)] = save_torch(state_dict, path, ce.zipfile_serialization)

    ce.save = save
    try:
        yield
    finally:
        del ce.save


def _tree_bytes(folder: str) -> int:
    """Bytes of the files under `folder` (0 when there is none). The trash thread deletes them meanwhile: a file gone
    between the listing and its stat counts 0 (it was a FileNotFoundError on rank 0, a clean clone's test caught it)."""
    total = 0
    for d, _, fs in os.walk(folder):
        for f in fs:
            try:
                total += os.lstat(os.path.join(d, f)).st_size
            except OSError:
                pass
    return total


def async_capable(engine) -> bool:
    """Whether DeepSpeed writes through the torch checkpoint engine (the one `_recording` can snapshot)."""
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    return type(getattr(engine, "checkpoint_engine", None)) is TorchCheckpointEngine


@dataclass
class Pending:
    """The save whose files are being written in the background (at most one)."""

    tag: str
    step: int
    path: str
    stage_end: str | None
    trainer: dict
    snapshot: Snapshot
    started: float  # time.perf_counter() when the save began
    blocked_s: float  # how long the step loop waited for the snapshot




# Bytes per parameter of a first checkpoint, before any was written to measure: ZeRO-3's fp32 master, Adam's m and v
# (12) and the model-dtype partition (2). Later saves take the newest committed one's size from its manifest.
CKPT_BYTES_PER_PARAM = 14
DISK_MARGIN = 1.05


def _own_params(engine) -> int:
    """Parameters this rank's files hold: its ZeRO-3 partitions (ds_tensor), else all of them over the world."""
    n = 0
    module = getattr(engine, "module", None)  # (the tests' stand-in engines have none: nothing to estimate)
    for p in module.parameters() if module is not None else ():
        part = getattr(p, "ds_tensor", None)
        n += part.numel() if part is not None else p.numel() // max(1, comm.world())
    return n


class Checkpointer(Restorer):
    def __init__(self, output_dir: str, keep: int, settle_s: float | None = None, deadline: Deadline | None = None):
        self.root = os.path.join(output_dir, "checkpoints")
        self.output_dir = output_dir  # conversions go under OUTPUT_DIR/universal/, never beside their source
        self.keep = keep
        # how long a file this node cannot see yet is looked for again, whatever the world size: a 1-rank job
        # requeued onto another node sees what the job before wrote there as late as a rank of a larger one does
        self.settle_s = FS_SETTLE_S if settle_s is None else settle_s
        self.deadline = deadline or Deadline()  # the job's end (SLURM_JOB_END_TIME): bounds a universal conversion
        self.pending: Pending | None = None  # the save being written in the background, not committed yet
        self._staging: Staging | None = None  # host memory the background saves copy into (one rank's checkpoint)
        self.trash = rotation.Trash(self.root)  # rank 0's deletions, off the step path

    def release_staging(self) -> int:
        """Give the background saves' host copy back (at a stage's end, with no save in flight: training/stage.py);
        the next background save allocates it afresh. Bytes released (0 when none was held or a save is pending)."""
        if self._staging is None or self.pending is not None:
            return 0
        return self._staging.release()

    # ---------------------------------------------------------------- save
    def save(self, engine, step: int, trainer: dict, rank_state: dict, hf_config, stage_end: str | None = None,
             background: bool = False) -> str | None:
        """Write checkpoint `step` on all ranks, commit it, rotate old ones; returns its path. Collective.

        `stage_end` ("STAGE_<index>_<name>") marks the final checkpoint of a stage: kept for good. `background`:
        only the snapshot happens now (every file's state copied into host memory) and a thread writes it; returns
        None, and `poll()` / `finish()` commit it once every rank's write is durable. One save in flight at most:
        the caller finishes the pending one first (`pending`)."""
        assert self.pending is None, "finish() the background save before starting another"
        rank, world = _world()
        t0 = time.perf_counter()
        tag = tag_for(step)
        path = os.path.join(self.root, tag)
        self._room(engine, tag)
        if rank == 0 and os.path.exists(path):  # a partial leftover of a killed run at this same step
            self.trash.discard(path)  # out of the way at once; deleted in the background
        comm.barrier()
        os.makedirs(os.path.join(path, "state"), exist_ok=True)  # every rank: no rank relies on another's mkdir
        written: dict[str, dict] = {}
        if background and async_capable(engine):
            self._staging = self._staging or Staging()  # reused by every background save of the run
            snap = Snapshot(path, self._staging)
        else:
            snap = None
        with _recording(engine, path, written, snap):
            engine.save_checkpoint(self.root, tag=tag, save_latest=False)
        own = os.path.join(path, "state", f"rank{rank:05d}.pt")
        if snap is not None:
            snap.add_torch(own, rank_state)
        else:
            written[os.path.relpath(own, path)] = save_torch(rank_state, own)
        if rank == 0:
            meta = {"trainer.json": json.dumps(trainer, indent=1, default=str),
                    "hf_config.json": hf_config.to_json_string()}
            for name, text in meta.items():
                if snap is not None:
                    snap.add_bytes(os.path.join(path, name), text.encode())
                else:
                    written[name] = atomic_write(os.path.join(path, name), text)
        if snap is None:
            self._commit(path, tag, step, written, stage_end, trainer)
            return path
        snap.start()
        self.pending = Pending(tag, step, path, stage_end, trainer, snap, t0, time.perf_counter() - t0)
        return None

    def _room(self, engine, tag: str) -> None:
        """Refuse, on every rank and in one line, a save the output folder's file system cannot hold, before any byte
        is written (a short write surfaced as torch.save's 'unexpected pos' after a ~21 GB file; Llama-3-8B's
        checkpoint is ~100 GB, and every stage's final one is kept). Need: the newest committed checkpoint's size
        (its manifest, rank 0), else each rank's parameters x CKPT_BYTES_PER_PARAM summed; room: the least free space
        any rank sees there (the folder is shared: train.py refuses one that is not), plus the trash rank 0 is deleting
        (a job killed during its deletion left a checkpoint there, which only a commit emptied: the first save of the
        next job was refused for the room it held). One all-reduce of three numbers (two before the first checkpoint).
        Collective."""
        os.makedirs(self.root, exist_ok=True)
        last, trash = ((self._newest_size() or 0), _tree_bytes(self.trash.folder)) if comm.rank() == 0 else (0, 0)
        if trash:
            self.trash.empty()  # deleted while this save writes
        top = comm.all_reduce([float(last), -float(shutil.disk_usage(self.root).free), float(trash)], op="max")
        free = -top[1].item() + top[2].item()
        need_all = top[0].item() or comm.all_reduce([float(_own_params(engine) * CKPT_BYTES_PER_PARAM)])[0].item()
        if need_all * DISK_MARGIN > free:
            raise ValueError(f"checkpoint {tag} needs ~{need_all / 1e9:.1f} GB in {self.root}, {free / 1e9:.1f} GB free "
                             "there: free space (every stage's final checkpoint is kept), lower --save_total_limit, "
                             "or give --output_dir a larger file system")

    def _newest_size(self) -> int | None:
        """Bytes of the newest committed checkpoint (its manifest's files), None when there is none."""
        try:
            with open(os.path.join(self.root, POINTER)) as fh:
                tag = fh.read().strip()
            with open(os.path.join(self.root, tag, MANIFEST)) as fh:
                return sum(int(f.get("size", 0)) for f in json.load(fh)["files"].values()) or None
        except (OSError, ValueError, KeyError):
            return None

    def poll(self) -> tuple[str, float] | None:
        """At a step boundary: commit the background save if every rank's write is durable (one all-reduce of two
        numbers, the same answer everywhere; never a rank's own clock); returns (path, seconds from the save's start
        to its commit) then, else None. A failed write on any rank fails every rank in one line. Collective."""
        if self.pending is None:
            return None
        p = self.pending
        votes = comm.all_reduce([0.0 if p.snapshot.done() else 1.0, 1.0 if p.snapshot.failed() else 0.0], op="max")
        if votes[1].item():
            self._failed()
        if votes[0].item():
            return None
        return self.finish()

    def finish(self, timeout_s: float | None = None) -> tuple[str, float] | None:
        """Wait for this rank's background write, then commit as `poll` does. Collective; None if none is pending.
        `timeout_s`: wait at most that long (each rank; then one all-reduce decides): if some rank's write is not
        durable by then, nothing is committed, the save stays pending and None is returned."""
        if self.pending is None:
            return None
        p = self.pending
        p.snapshot.wait(None if timeout_s is None else max(0.0, timeout_s))
        votes = comm.all_reduce([0.0 if p.snapshot.done() else 1.0, 1.0 if p.snapshot.failed() else 0.0], op="max")
        if votes[1].item():
            self._failed()
        if votes[0].item():
            return None
        self._commit(p.path, p.tag, p.step, p.snapshot.result(), p.stage_end, p.trainer)
        self.pending = None
        return p.path, time.perf_counter() - p.started

    def _failed(self) -> None:
        p, self.pending = self.pending, None
        p.snapshot.wait()
        p.snapshot.result()  # raises this rank's own error
        raise RuntimeError(f"checkpoint {p.path}: another rank's background write failed (see its log); "
                           "not committed")

    def mark_stage_end(self, checkpoint: str, stage_end: str) -> None:
        """`checkpoint` (a committed one of this run) ends its stage: the marker a save at the stage's end writes, for
        a stage whose steps were lowered to where it already was (training/curriculum.keep_stage_steps). Rank 0."""
        tag = os.path.basename(checkpoint.rstrip("/"))
        if comm.rank() == 0 and os.path.dirname(os.path.abspath(checkpoint.rstrip("/"))) == os.path.abspath(self.root) \
                and not os.path.exists(os.path.join(self.root, stage_end)):
            atomic_write(os.path.join(self.root, stage_end), tag + "\n")

    def _commit(self, path: str, tag: str, step: int, written: dict, stage_end: str | None, trainer: dict) -> None:
        """Every rank's files are on disk, fsynced, with their checksums: rank 0 writes the manifest (the commit),
        then the pointers, then rotates. Collective."""
        world = comm.world()
        described = _gather_dict(written)
        if comm.rank() == 0:
            for f in list_files(path):  # written outside the checkpoint engine (DeepSpeed's helper scripts)
                if f not in described:
                    described[f] = self._describe(path, f)
            manifest = {"tag": tag, "step": step, "world": world, "files": described, "stage_end": stage_end,
                        "model_hash": trainer.get("model_hash"), "sp": trainer.get("sp")}
            atomic_write(os.path.join(path, MANIFEST), json.dumps(manifest, indent=1))
            atomic_write(os.path.join(self.root, POINTER), tag + "\n")
            if stage_end:
                atomic_write(os.path.join(self.root, stage_end), tag + "\n")
            rotation.rotate(self.root, self.keep, keep_tag=tag, trash=self.trash)  # renames only; deletes in the background
            if os.path.isdir(self.trash.folder):
                self.trash.empty()  # (what a killed job left there too)
        comm.barrier()

    def close(self, timeout_s: float | None = None) -> None:
        """At a run's end: wait for rank 0's background deletions (a stop does not: the next job's commit ends them)."""
        self.trash.wait(timeout_s)

    @staticmethod
    def _describe(path: str, f: str) -> dict:
        full = os.path.join(path, f)
        fsync_file(full)
        return {"size": os.path.getsize(full), "crc32": crc32(full)}
