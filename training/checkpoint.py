"""Atomic, verifiable checkpoints: saving and committing them, the only code that writes training state (reading it
back is training/restore.py).

Layout under OUTPUT_DIR/checkpoints/:

    step_000200/            DeepSpeed engine files (weights, optimizer, LR scheduler) written by every rank
        state/rank00003.pt  this rank's data position and RNG states
        trainer.json        counters, stage, config snapshot, W&B run id, layout, model-config hash
        hf_config.json      the model config of the stage (RoPE included), for export
        MANIFEST.json       written last: every file with size and CRC32
    LATEST                  name of the newest committed checkpoint, replaced atomically
    latest                  the same name, for DeepSpeed's tools (engine.load_checkpoint, zero_to_fp32 without a tag)
    STAGE_1_s128k           name of the checkpoint that ended stage 1 ("s128k"); those are never rotated away

With `background=True` (`--async_save`) a save only snapshots its files into host memory and a thread writes them
(training/async_save.py); `poll()` at each step boundary commits it once an all-reduce says every rank's write is
durable, `finish()` waits for it (`finish(timeout_s)`: at most that long, for a stop inside the launcher's kill
window). At most one save is in flight.

What the commit costs on the step path (every other rank waits at its barrier meanwhile), Llama-3-8B on 32 ranks:
one all-gather of the ranks' manifest entries (~100 small dicts), rank 0's walk of the folder, MANIFEST.json (~20 KB),
LATEST and `latest` written atomically (a rename and two fsyncs each: milliseconds, ~0.1 s on a loaded NFS), and
rotation's *decision* with one rename per folder it drops. Deleting the dropped ~100 GB checkpoint (seconds to
minutes) runs in rank 0's background thread (training/rotation.py `Trash`), no longer inside `poll()`.

A checkpoint exists only once its manifest is written, after every rank has written and fsynced its
files (DeepSpeed's own `latest` is written by the commit, after LATEST: checkpoint_files.point).
Checksums are computed *while writing* (DeepSpeed's torch checkpoint engine is wrapped so every file it
writes passes through a CRC32 counter), so a save - the preemption save included - never reads its bytes
back; the few files written another way (DeepSpeed's copy of zero_to_fp32.py) are read once by rank 0.

Finding and verifying a checkpoint (a stale view of a shared file system, `--resume` branches) is training/restore.py,
loading it (another world size's universal conversion) training/checkpoint_load.py: `Checkpointer` is their `Restorer`
plus the save path here, and whether the folder can hold the next checkpoint (before each save and at start) is
training/checkpoint_room.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import time
from dataclasses import dataclass

import numpy as np
import torch

from base import comm
from base.parallel import FS_SETTLE_S
from training import job, rotation
from training.async_save import Snapshot, Staging
from training.branches import BRANCHES  # noqa: F401  (part of this module's interface)
from training.checkpoint_files import (  # noqa: F401  (MANIFEST, POINTER, deal_by_bytes: this module's interface)
    MANIFEST,
    POINTER,
    TAG,
    atomic_write,
    deal_by_bytes,
    describe,
    list_files,
    point,
    save_torch,
    state_file,
)
from training.checkpoint_room import CheckpointRoom
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


class Checkpointer(CheckpointRoom, Restorer):
    def __init__(self, output_dir: str, keep: int, settle_s: float | None = None, deadline: Deadline | None = None):
        self.root = os.path.join(output_dir, "checkpoints")
        self.output_dir = output_dir  # conversions go under OUTPUT_DIR/universal/, never beside their source
        self.keep = keep
        # how long a file this node cannot see yet is looked for again, whatever the world size: a 1-rank job
        # requeued onto another node sees what the job before wrote there as late as a rank of a larger one does
        self.settle_s = FS_SETTLE_S if settle_s is None else settle_s
        self.deadline = deadline or Deadline()  # the job's end (SLURM_JOB_END_TIME): bounds a universal conversion
        self.pending: Pending | None = None  # the save being written in the background, not committed yet
        # the last committed background save's write: its start until every rank's bytes were written and synced (the
        # writer threads' own time, MAX over ranks), without the wait for the step boundary that commits it (>= one
        # step: ~296 s at 1M, which made `auto` save every step: training/preemption.py due_after_s)
        self.written_s: float | None = None
        self._staging: Staging | None = None  # host memory the background saves copy into (one rank's checkpoint)
        self.trash = rotation.Trash(self.root)  # rank 0's deletions, off the step path
        self.recent: list[str] = []  # this job's last commits, oldest first (`pin` picks from them)

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
        path = os.path.join(self.root, tag_for(step))
        try:
            return self._save(engine, step, trainer, rank_state, hf_config, stage_end, background)
        except BaseException as e:
            job.naming(e, path)  # a full disk's write names no file itself: the refusal names this folder
            raise

    def _save(self, engine, step: int, trainer: dict, rank_state: dict, hf_config, stage_end: str | None,
              background: bool) -> str | None:
        rank, world = _world()
        t0 = time.perf_counter()
        tag = tag_for(step)
        path = os.path.join(self.root, tag)
        self._room(engine, tag)  # (rank 0 moved any leftover at this step, or a failed save's, to the trash first)
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
        own = os.path.join(path, state_file(rank))
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

    def pin(self, before_step: int | None, newest: str | None) -> str | None:
        """Keep the newest checkpoint of this run at or before `before_step` against rotation: checkpoints/PINNED
        names it (rank 0 writes it; one at a time: a later pin moves it). From this job's commits, else `newest` (the
        resumed one). Returns its path, None where there is none. Every rank picks the same."""
        if before_step is None:  # let it go (rank 0): rotation keeps what it would anyway
            if comm.rank() == 0 and os.path.exists(os.path.join(self.root, rotation.PINNED)):
                os.remove(os.path.join(self.root, rotation.PINNED))
            return None
        here = {os.path.basename(p.rstrip("/")): p for p in [*self.recent, newest]
                if p and os.path.dirname(os.path.abspath(p.rstrip("/"))) == os.path.abspath(self.root)}
        tag = max((t for t in here if TAG.match(t) and int(t[5:]) <= before_step), key=lambda t: int(t[5:]), default=None)
        if tag is not None and comm.rank() == 0:
            atomic_write(os.path.join(self.root, rotation.PINNED), tag + "\n")
        return here.get(tag)

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
        try:
            return self._finish(timeout_s)
        except BaseException as e:
            job.naming(e, self.root)  # a full disk's write names no file itself: the refusal names the folder
            raise

    def _finish(self, timeout_s: float | None) -> tuple[str, float] | None:
        p = self.pending
        p.snapshot.wait(None if timeout_s is None else max(0.0, timeout_s))
        done = p.snapshot.done()  # (its write time travels in the same all-reduce: the slowest rank's is the save's)
        votes = comm.all_reduce([0.0 if done else 1.0, 1.0 if p.snapshot.failed() else 0.0,
                                 p.blocked_s + p.snapshot.write_s if done else 0.0], op="max")
        if votes[1].item():
            self._failed()
        if votes[0].item():
            return None
        self._commit(p.path, p.tag, p.step, p.snapshot.result(), p.stage_end, p.trainer)
        self.pending, self.written_s = None, votes[2].item()
        return p.path, time.perf_counter() - p.started

    def _failed(self) -> None:
        """Some rank's background write failed (every rank is here, after the same vote): each raises its own error;
        where one is a full disk or quota, every rank raises that rank's one line instead (exit 2 everywhere, no node
        blamed: training/job.py), never the others' 'another rank failed' (exit 1, first on record: a crash requeue
        without a healthy node). One all-gather of a short line per rank. Collective."""
        p, self.pending = self.pending, None
        p.snapshot.wait()
        mine, err = None, None
        try:
            p.snapshot.result()  # raises this rank's own error
        except Exception as e:  # noqa: BLE001 -- raised below, after the others heard of it
            job.naming(e, p.path)
            full = job.users_disk(e)
            mine, err = (job.disk_full_line(full) if full is not None else None), e
        lines = comm.all_gather_object(mine)
        first = next((f"rank {r}: {line}" for r, line in enumerate(lines) if line), None)
        if first is not None:
            raise ValueError(f"checkpoint {p.tag} not committed: {first}")
        if err is not None:
            raise err
        raise RuntimeError(f"checkpoint {p.path}: another rank's background write failed (see its log); "
                           "not committed")

    def mark_stage_end(self, checkpoint: str, stage_end: str) -> None:
        """`checkpoint` (a committed one of this run) ends its stage: the marker a save at the stage's end writes, for
        a stage whose steps were lowered to where it already was (training/curriculum_resume.keep_stage_steps). Rank 0."""
        tag = os.path.basename(checkpoint.rstrip("/"))
        if comm.rank() == 0 and os.path.dirname(os.path.abspath(checkpoint.rstrip("/"))) == os.path.abspath(self.root) \
                and not os.path.exists(os.path.join(self.root, stage_end)):
            atomic_write(os.path.join(self.root, stage_end), tag + "\n")

    def _commit(self, path: str, tag: str, step: int, written: dict, stage_end: str | None, trainer: dict) -> None:
        """Every rank's files are on disk, fsynced, with their checksums: rank 0 writes the manifest (the commit),
        then the pointers (LATEST, `latest`, a stage's end), then rotates. Collective."""
        world = comm.world()
        described = _gather_dict(written)
        if comm.rank() == 0:
            for f in list_files(path):  # written outside the checkpoint engine (DeepSpeed's helper scripts)
                if f not in described:
                    described[f] = describe(path, f)
            manifest = {"tag": tag, "step": step, "world": world, "files": described, "stage_end": stage_end,
                        "model_hash": trainer.get("model_hash"), "sp": trainer.get("sp")}
            atomic_write(os.path.join(path, MANIFEST), json.dumps(manifest, indent=1))
            point(self.root, tag)  # LATEST, then DeepSpeed's `latest`
            if stage_end:
                atomic_write(os.path.join(self.root, stage_end), tag + "\n")
            rotation.rotate(self.root, self.keep, keep_tag=tag, trash=self.trash)  # renames only; deletes in the background
            if os.path.isdir(self.trash.folder):
                self.trash.empty()  # (what a killed job left there too)
        self.recent = [*self.recent[-7:], path]
        comm.barrier()

    def close(self, timeout_s: float | None = None) -> None:
        """At a run's end: wait for rank 0's background deletions (a stop does not: the next job's commit ends them)."""
        self.trash.wait(timeout_s)
