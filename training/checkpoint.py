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

Finding, verifying and loading a checkpoint (a stale view of a shared file system, another world size's universal
conversion, `--resume` branches) is training/restore.py: `Checkpointer` is its `Restorer` plus the save path here.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import socket
import time
from dataclasses import dataclass

import numpy as np
import torch

from base import comm
from base.atomic import nearest_folder
from base.log import print0
from base.parallel import FS_SETTLE_S
from training import job, rotation, universal
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
from training.preemption import Deadline
from training.restore import Restorer, TrainState  # noqa: F401  (TrainState: part of this module's interface)
from training.step import nonfinite_state


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


# Bytes per parameter of a first checkpoint, before any was written to measure: ZeRO-3's fp32 master and Adam's m and
# v (12; its model-states files hold no weights under ZeRO-3), as bench/checkpoint.py measures (bench/results:
# bytes_per_param 12.0). 14 counted a bf16 copy that is not saved, and refused a fresh 8B run at start-up with room
# for its first checkpoint. Later saves take the newest committed one's size from its manifest.
CKPT_BYTES_PER_PARAM = 12
DISK_MARGIN = universal.DISK_MARGIN


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

    def _room(self, engine, tag: str) -> None:
        """Refuse, on every rank and in one line, a save the output folder's file system cannot hold, before any byte
        is written (a short write surfaced as torch.save's 'unexpected pos' after a ~21 GB file; Llama-3-8B's
        checkpoint is ~100 GB, and every stage's final one is kept). Need: the newest committed checkpoint's size
        (its manifest, rank 0), else each rank's parameters x CKPT_BYTES_PER_PARAM summed; room: `_space`. A quota
        (EDQUOT) is not seen by statvfs: a write it refuses ends the job in one line too (training/job.py). First, in
        the same all-reduce: a rank whose optimizer state holds a non-finite value (training/step.nonfinite_state)
        refuses the save. Collective."""
        mine = nonfinite_state(engine)
        last, room, bad = self._space(lambda: self._leftovers(tag), vote=float(comm.rank() + 1) if mine else 0.0)
        if bad:
            self._nonfinite(tag, mine)
        need = last or comm.all_reduce([float(_own_params(engine) * CKPT_BYTES_PER_PARAM)])[0].item()
        if need * DISK_MARGIN > room:
            raise ValueError(self._refusal(f"checkpoint {tag}", need, room))

    def _space(self, tidy, create: bool = True, vote: float = 0.0) -> tuple[float, float, float]:
        """(bytes of the newest committed checkpoint or 0, room for the next one, the largest `vote`), the same on every
        rank. Rank 0 first
        runs `tidy` (moves what goes into the trash), then counts the trash, whose deletion starts only once counted (a
        file deleted between the count and the free space would count twice); room: the least free space any rank sees
        there (the folder is shared: train.py refuses one that is not) plus the trash rank 0 is deleting (a job killed
        during its deletion left a checkpoint there, which only a commit emptied: the first save of the next job was
        refused for the room it held). One all-reduce of four numbers. Collective."""
        if create:
            os.makedirs(self.root, exist_ok=True)
        last = trash = 0  # (not created at start-up: a refusal after it must leave the output folder as it was)
        here = nearest_folder(self.root)  # the folder's file system, from its nearest existing parent
        if comm.rank() == 0 and os.path.isdir(self.root):
            self.trash.paused = True
            try:
                tidy()
                # counted, not walked (a walk per save of a killed conversion's ~10^5 fragments: minutes on NFS)
                last, trash = (self._newest_size() or 0), self.trash.bytes()
            finally:
                self.trash.paused = False
            if os.path.isdir(self.trash.folder):
                self.trash.empty()  # deleted while this save writes (a partial conversion counted 0 too)
        top = comm.all_reduce([float(last), -float(shutil.disk_usage(here).free), float(trash), vote], op="max")
        return top[0].item(), -top[1].item() + top[2].item(), top[3].item()

    def _nonfinite(self, tag: str, mine: int) -> None:
        """Some rank's optimizer state holds a non-finite value (every rank is here, after the same vote): nothing of
        `tag` is written, LATEST stays; one line naming the ranks and their hosts (one all-gather, on this path only)."""
        got = [(r, h) for r, h, n in comm.all_gather_object((comm.rank(), socket.gethostname(), mine)) if n]
        where = ", ".join(f"rank {r} on {h}" for r, h in got[:4]) + (f" and {len(got) - 4} more" * (len(got) > 4))
        newest = self._pointer()
        raise ValueError(f"checkpoint {tag} not written: the fp32 master weights or Adam moments of {where} hold "
                         "non-finite values (silent data corruption, a faulty GPU or host memory, or the non-finite "
                         "steps said above); the newest checkpoint, " + (os.path.join(self.root, newest) if newest
                         else "none") + ", stays the resume point: --resume auto (a host's fault: without it, sbatch "
                         "--exclude; non-finite steps: --resume PATH with a lower --learning_rate)")

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

    def _leftovers(self, tag: str | None) -> None:
        """Rank 0: move into the trash every step_N without a manifest (a failed or killed save's partial folder, at
        any step: it held its bytes until a save at that very step) but the one LATEST names (its manifest may not be
        visible on this node yet: training/restore.py _listed), and whatever is at `tag` (replaced by this save)."""
        latest = self._pointer()
        for t in rotation.tags(self.root):
            if t == tag or t != latest and not os.path.exists(os.path.join(self.root, t, MANIFEST)):
                self.trash.discard(os.path.join(self.root, t))

    def _pointer(self) -> str | None:
        try:
            with open(os.path.join(self.root, POINTER)) as fh:
                return fh.read().strip()
        except OSError:
            return None

    def _refusal(self, what: str, need: float, room: float) -> str:
        """The one line for `what` the folder cannot hold. A lower --save_total_limit helps only at a start (rotated
        there, before the first save: `check_room`); at the minimum (2) the checkpoints to delete by hand are named
        instead, oldest first, with their sizes (a stage's final one is kept for good: only a user removes it).
        Collective (rank 0 lists them)."""
        line = f"{what} needs ~{need / 1e9:.1f} GB in {self.root}, {room / 1e9:.1f} GB free there: "
        if self.keep > 2:
            return line + (f"free space, lower --save_total_limit (now {self.keep}; a start rotates to it before its "
                           "first save), or give --output_dir a larger file system")
        old = comm.run_on_main(self._spare)
        return line + (f"free space (the oldest checkpoints: {old}; each stage's final one is kept for good, the newest "
                       "is the one to resume from) or give --output_dir a larger file system" if old else
                       "free space or give --output_dir a larger file system")

    def _spare(self) -> str:
        """Rank 0: the committed checkpoints but the newest, oldest first (3 at most), with their sizes."""
        out = []
        for t in [t for t in rotation.tags(self.root) if os.path.exists(os.path.join(self.root, t, MANIFEST))][:-1][:3]:
            m, gb = rotation._manifest(self.root, t), self._size(t) / 1e9
            out.append(f"{os.path.join(self.root, t)} {gb:.1f} GB" + (f" ({m['stage_end']})" if m.get("stage_end") else ""))
        return ", ".join(out)

    def check_room(self, resumed: str | None, params: int, stages: int) -> None:
        """At start, after the resume decision and before any engine is built: refuse in one line a first save the
        folder cannot hold (it came after a whole save interval of training before: ~9 min at auto, lost), and print
        what the curriculum will hold. Rank 0 first moves a failed save's partial folders to the trash and rotates to
        today's --save_total_limit (a lower one applied only after a commit, which needed the room first), never the
        resumed checkpoint nor a stage's final one. Need: the newest committed checkpoint's size, else `params` x
        CKPT_BYTES_PER_PARAM. Every rank takes rank 0's decision (`_space`'s all-reduce). Collective.
        A folder another user wrote (a requeue in a root container, then a run as this user): rank 0 removes DeepSpeed's
        recovery scripts it cannot write (engine._copy_recovery_script copies them over the old ones at every save:
        PermissionError at the first save of every restart, a save interval lost each time), or refuses in one line
        where it cannot remove them, or cannot write the folder or its trash (rank 0's decision on every rank)."""

        def foreign() -> None:
            for where in (self.root, self.trash.folder):
                if os.path.isdir(where) and not os.access(where, os.W_OK | os.X_OK):
                    raise ValueError(f"{where}: this user (uid {os.getuid()}) cannot write there (written by another "
                                     "user: a run as root in a container?): give it this user (chown -R) or use "
                                     "another --output_dir")
            for name in ("zero_to_fp32.py", "zero_to_torch.py"):  # deepspeed/runtime/engine.py _copy_recovery_script
                path = os.path.join(self.root, name)
                if os.path.isfile(path) and not os.access(path, os.W_OK):
                    try:
                        os.remove(path)  # the folder is this user's: DeepSpeed copies it afresh at the next save
                    except OSError as e:
                        raise ValueError(f"{path}: another user's file this user (uid {os.getuid()}) cannot replace "
                                         f"({e.strerror}), which DeepSpeed rewrites at every save: remove it or use "
                                         "another --output_dir") from None
                    print0(f"note: removed {path} (another user's, not writable here): DeepSpeed writes it at each save")

        comm.run_on_main(foreign)
        root = os.path.abspath(self.root)
        tag = os.path.basename(resumed.rstrip("/")) if resumed else None
        tag = tag if tag and os.path.dirname(os.path.abspath(resumed.rstrip("/"))) == root else None

        def tidy() -> None:
            self._leftovers(None)
            if tag is not None and rotation.TAG.match(tag):
                rotation.rotate(self.root, self.keep, keep_tag=tag, trash=self.trash)  # renames only

        last, room, _ = self._space(tidy, create=False)
        need = last or float(params * CKPT_BYTES_PER_PARAM)
        if need * DISK_MARGIN > room:
            raise ValueError(self._refusal("the first checkpoint of this start", need, room))
        held = comm.run_on_main(lambda: sum(self._size(t) for t in rotation.tags(self.root)) if os.path.isdir(
            self.root) else 0)
        count = self.keep + 1 + max(stages - 1, 0)  # rolling (+1 being written) and the earlier stages' final ones
        total = need * count
        line = (f"checkpoint room: this curriculum keeps up to {self.keep + 1} rolling (--save_total_limit {self.keep}, "
                f"+1 being written) + {max(stages - 1, 0)} stage-end checkpoints of ~{need / 1e9:.1f} GB: "
                f"~{total / 1e9:.1f} GB; {room / 1e9:.1f} GB free in {self.root} (its trash included) + "
                f"{held / 1e9:.1f} GB its checkpoints hold now")
        print0(("warning: " + line + ": it may fill before the run ends (a quota is not seen here)")
               if total > room + held else line)

    def _size(self, tag: str) -> int:
        """Bytes of committed checkpoint `tag` (its manifest's files; 0 without one)."""
        return sum(int(f.get("size", 0)) for f in rotation._manifest(self.root, tag).get("files", {}).values())

    def _newest_size(self) -> int | None:
        """Bytes of the newest committed checkpoint (its manifest's files), None when there is none."""
        tag = self._pointer()
        return (self._size(tag) or None) if tag else None

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
        a stage whose steps were lowered to where it already was (training/curriculum.keep_stage_steps). Rank 0."""
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
