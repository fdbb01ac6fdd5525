"""Atomic, verifiable checkpoints: the only module that writes or reads training state.

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
Loading verifies the manifest in parallel, files dealt to ranks by bytes (the largest first, each to the rank
with the fewest bytes so far: the optimizer partitions, ~2/3 of the bytes, no longer land on half the ranks);
an incomplete or corrupt checkpoint is skipped with a warning naming it.

Every rank takes the same decision (docs/checkpoints.md): on a shared file system a node may list a directory as
it was up to a minute ago (NFS attribute caching), so a rank's own listing never picks what is loaded. Rank 0
alone lists `checkpoints/`, reads the manifest, `trainer.json` and the pointer files, and broadcasts them; all
ranks then verify the same checkpoint together and take the gathered verdict. A file a rank cannot see yet is
looked for again for up to `settle_s` (60 s) before the checkpoint counts as incomplete; the rank that *loads* a
file does the same (every rank looks up what it is about to load, then one gathered verdict), so a node that sees a
file late does not fail the resume. At Llama-3-8B on 32 ranks a checkpoint is ~100 GB (bf16 weights + fp32 master
weights and Adam moments): each rank writes and, at resume, re-reads ~3 GB.

A checkpoint written by another world size is converted to DeepSpeed's universal format (training/universal.py):
keyed by the checkpoint's content (its manifest's hash), never by its name, written under this run's
OUTPUT_DIR/universal/ (never beside a source it does not own), locked against another job converting the same
source, and started only if it can finish before the job's end (else exit 75 to be requeued).

`--resume PATH` (or `none`) starts a new branch from PATH (or from nothing) once (training/branches.py).
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
from base.log import print0, rank_log
from base.parallel import FS_SETTLE_S
from training import branches, rotation, universal
from training.async_save import Snapshot, Staging
from training.branches import BRANCHES  # noqa: F401  (part of this module's interface)
from training.checkpoint_files import (  # noqa: F401  (MANIFEST, POINTER: part of this module's interface)
    MANIFEST,
    POINTER,
    TAG,
    atomic_write,
    crc32,
    deal_by_bytes,
    fsync_file,
    list_files,
    manifest_sha256,
    not_visible,
    read_json,
    save_torch,
)
from training.job import Requeue
from training.preemption import Deadline


def tag_for(step: int) -> str:
    return f"step_{step:06d}"


def _world() -> tuple[int, int]:
    return comm.rank(), comm.world()


def _gather_dict(local: dict) -> dict:
    return {k: v for p in comm.all_gather_object(local) for k, v in p.items()}


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(s: dict) -> None:
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    torch.set_rng_state(s["torch"])
    if s.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


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


@dataclass
class TrainState:
    """Where the run stands: what every checkpoint records (trainer.json, with the run's metadata) and a resume
    restores. `checkpoint` is the newest committed checkpoint, the one a resume or the next stage loads."""

    step: int = 0
    tokens: int = 0
    stage: int = 0
    wandb_id: str | None = None
    checkpoint: str | None = None

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens": self.tokens, "stage": self.stage, "wandb_id": self.wandb_id}

    def load_state_dict(self, d: dict) -> None:
        self.step, self.tokens, self.stage = int(d["step"]), int(d["tokens"]), int(d["stage"])
        self.wandb_id = d.get("wandb_id")


def reset_adam_moments(optimizer) -> int:
    """Zero Adam's moments and step counts in place (a stage with `reset_optimizer`); the fp32 master weights
    are kept. Works on DeepSpeed's ZeRO wrappers (the torch optimizer is `.optimizer`). Returns the number of
    parameter states reset."""
    inner = getattr(optimizer, "optimizer", optimizer)
    for state in inner.state.values():
        for k, v in state.items():
            if torch.is_tensor(v):
                v.zero_()
            elif k == "step":
                state[k] = 0
    for group in inner.param_groups:
        if "step" in group:
            group["step"] = 0
    return len(inner.state)


class Checkpointer:
    def __init__(self, output_dir: str, keep: int, settle_s: float | None = None, deadline: Deadline | None = None):
        self.root = os.path.join(output_dir, "checkpoints")
        self.output_dir = output_dir  # conversions go under OUTPUT_DIR/universal/, never beside their source
        self.keep = keep
        # one process has one view: nothing to wait for; several may see a new file up to SETTLE_S late
        self.settle_s = settle_s if settle_s is not None else (FS_SETTLE_S if comm.world() > 1 else 0.0)
        self.deadline = deadline or Deadline()  # the job's end (SLURM_JOB_END_TIME): bounds a universal conversion
        self.pending: Pending | None = None  # the save being written in the background, not committed yet
        self._staging: Staging | None = None  # host memory the background saves copy into (one rank's checkpoint)
        self.trash = rotation.Trash(self.root)  # rank 0's deletions, off the step path

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

    # ---------------------------------------------------------------- find and load
    def tags(self) -> list[str]:
        return rotation.tags(self.root)

    def verify(self, path: str) -> str | None:
        """None if the checkpoint at `path` is complete and intact, else the reason; the same answer on every rank.
        Collective: rank 0 reads the manifest (and lists the folder for unlisted files), every rank checks its
        deal of the files (by bytes), the first reason found by any rank is the verdict."""
        rank, world = _world()
        manifest = comm.run_on_main(lambda: read_json(os.path.join(path, MANIFEST)))
        if "error" in manifest:
            return f"no readable manifest ({manifest['error']})"
        files = manifest["json"].get("files")
        if not isinstance(files, dict):
            return "no readable manifest (no file list)"
        reason = None
        if rank == 0:
            extra = set(list_files(path)) - set(files) if os.path.isdir(path) else set()
            reason = f"files not in the manifest: {sorted(extra)[:3]}" if extra else None
        mine = deal_by_bytes({f: int(e["size"]) for f, e in files.items()}, world)[rank]
        reason = reason or self._check_files(path, {f: files[f] for f in mine})
        return next((r for r in comm.all_gather_object(reason) if r), None)

    def _check_files(self, path: str, files: dict) -> str | None:
        """The first problem among `files` (name -> manifest entry), or None. A file missing or shorter than its
        entry may be a stale view of this node: looked for again every 2 s for up to `settle_s`."""
        late = not_visible(path, {f: int(e["size"]) for f, e in files.items()}, self.settle_s)
        if late:
            f = min(late)
            return f"missing {f}" if late[f] is None else f"{f} has {late[f]} bytes, manifest says {files[f]['size']}"
        for f in sorted(files):
            full, want = os.path.join(path, f), files[f]
            if os.path.getsize(full) != want["size"]:
                return f"{f} has {os.path.getsize(full)} bytes, manifest says {want['size']}"
            if crc32(full) != want["crc32"]:
                return f"{f} checksum differs from the manifest"
        return None

    def _await_files(self, root: str, sizes: dict[str, int], what: str) -> None:
        """Before loading: every rank looks up the files under `root` (name -> size) by name until it sees them whole,
        for up to `settle_s` (a node's stale view, as verification does), then one gathered verdict: a file some rank
        still cannot see fails the load on every rank in one line (exit 1). Collective."""
        t0 = time.monotonic()
        late = not_visible(root, sizes, self.settle_s)
        if time.monotonic() - t0 >= 1.0:
            rank_log(f"waited {time.monotonic() - t0:.0f} s for files of {what} this node did not see yet"
                     + (f"; still not seen: {sorted(late)[:3]}" if late else ""))
        reports = comm.all_gather_object({f: late[f] for f in sorted(late)[:3]})
        for r, got in enumerate(reports):
            if got:
                f = next(iter(got))
                seen = "not found" if got[f] is None else f"{got[f]} of {sizes[f]} bytes"
                raise RuntimeError(f"{what}: rank {r} cannot see {os.path.join(root, f)} ({seen}) after looking for "
                                   f"it for {self.settle_s:.0f} s: that node's view of the shared file system is stale "
                                   "or the file was removed")

    def find_resume(self, resume: str) -> str | None:
        """Path of the checkpoint to resume from, or None (fresh). Collective; rank 0 decides, every rank gets it.

        `auto`: this run's newest complete checkpoint. `PATH` and `none` start a branch (from PATH, or fresh) the
        first time this run folder is started with them, recorded in checkpoints/BRANCHES.json; started again with
        the same `--resume` (a SLURM requeue, a launch.sh re-run, a user re-running the command after a crash) the
        run continues like `auto`, from PATH again only while the branch has no complete checkpoint of its own. A
        branch is known by its source's content (the sha256 of its MANIFEST.json), not by its name: a new `step_N`
        written under an old name (after another branch) is a new branch point."""
        if resume != "auto":
            taken = comm.run_on_main(lambda: branches.taken(self.root, resume))
            if taken is None:
                path = None if resume == "none" else self._checked(resume)
                comm.run_on_main(lambda: branches.start(self.root, path, resume, self._listed()))
                return path
            print0(f"--resume {resume}: this branch was taken on {taken}: continuing from this run's newest complete "
                   f"checkpoint (docs/checkpoints.md)")
        for tag in reversed(comm.run_on_main(self._listed)):  # rank 0's view is the only one read
            path = os.path.join(self.root, tag)
            t0 = time.perf_counter()
            why = self.verify(path)
            if why is None:
                print0(f"verified {path} in {time.perf_counter() - t0:.1f}s")
                return path
            print0(f"warning: skipping checkpoint {path}: {why}")
        if resume not in ("auto", "none"):  # the branch saved nothing of its own yet: from its source again
            return self._checked(resume)
        return None

    def _listed(self) -> list[str]:
        """Rank 0: this run's checkpoints, oldest first: its listing of checkpoints/ and the one LATEST names, looked up
        by name (a node's cached listing can be up to FS_SETTLE_S older than the folder: the newest checkpoint, just
        committed by the job before on another node, missing from it would resume an older one without a word). When
        LATEST names a checkpoint whose manifest this node cannot see yet, it is looked for again by name for up to
        `settle_s` (FS_SETTLE_S on several ranks), then left out with a warning naming it. Costs one small read and,
        on a stale view, up to 60 s once per start."""
        listed = self.tags()
        try:
            with open(os.path.join(self.root, POINTER)) as fh:
                latest = fh.read().strip()
        except OSError:
            return listed
        if not TAG.match(latest) or latest in listed and os.path.isfile(os.path.join(self.root, latest, MANIFEST)):
            return listed
        t0 = time.monotonic()
        if not_visible(os.path.join(self.root, latest), {MANIFEST: 1}, self.settle_s):
            print0(f"warning: {os.path.join(self.root, POINTER)} names {latest}, but this node cannot see "
                   f"{os.path.join(self.root, latest, MANIFEST)} after looking for it for {self.settle_s:.0f} s (a "
                   "stale view of the file system, or it was removed): resuming from an older checkpoint")
            return listed
        if time.monotonic() - t0 >= 1.0:
            print0(f"{POINTER} names {latest}: its manifest became visible here after {time.monotonic() - t0:.0f} s")
        return sorted(set(listed) | {latest}, key=lambda t: int(TAG.match(t).group(1)))

    def _checked(self, path: str) -> str:
        why = self.verify(path)
        if why:
            raise ValueError(f"--resume {path}: not a complete checkpoint ({why}); use --resume auto or another "
                             "checkpoint")
        return path

    def resume(self, resume: str, model_hash: str, model_name: str) -> TrainState:
        """The run's state at start: fresh, or restored from the checkpoint `resume` picks (find_resume), refused
        in one line when that checkpoint was written for another architecture. Collective."""
        state = TrainState()
        path = self.find_resume(resume)
        if path is None:
            print0("starting fresh")
            return state
        trainer = self.read_trainer(path)
        if trainer.get("model_hash") != model_hash:
            raise ValueError(f"checkpoint {path} was written for a different model architecture than {model_name}: "
                             "use the same model, another --output_dir, or --resume none")
        self._universal(path)  # another world size: converted now, before any engine holds memory (or exit 75/2)
        state.load_state_dict(trainer)
        state.checkpoint = path
        print0(f"resuming from {path} (step {state.step}, stage {state.stage})")
        return state

    def restore_stage(self, engine, state: TrainState, stage: int, sampler, reset_optimizer: bool) -> bool:
        """Load what stage `stage` starts from into `engine` and `sampler`: in the middle of the stage, the whole
        engine state, the data position and (same world) every rank's RNG; at its start, the previous stage's
        final weights (and Adam moments unless `reset_optimizer`) with a fresh LR schedule; nothing on a fresh
        run. Returns whether the RNG streams were restored (else the caller seeds them for the stage)."""
        if state.checkpoint is None:
            return False
        if state.stage == stage:
            saved = self.load(engine, state.checkpoint)
            sampler.load_state_dict(saved["sampler"])
            if "rng" in saved:
                set_rng_state(saved["rng"])
                return True
            return False
        self.load(engine, state.checkpoint, load_optimizer=not reset_optimizer, load_scheduler=False)
        return False

    @staticmethod
    def read_trainer(path: str) -> dict:
        """The counters, stage and config a checkpoint was saved with: rank 0 reads them, every rank gets its copy."""
        got = comm.run_on_main(lambda: read_json(os.path.join(path, "trainer.json")))
        if "error" in got:
            raise RuntimeError(f"checkpoint {path}: trainer.json unreadable after verification ({got['error']})")
        return got["json"]

    def load(self, engine, path: str, load_optimizer: bool = True, load_scheduler: bool = True) -> dict:
        """Restore engine state into `engine`; returns this rank's saved state (data position, RNG).

        A new stage loads the previous stage's weights, optionally its Adam moments, never its LR schedule."""
        rank, world = _world()
        t0 = time.perf_counter()
        load_dir, tag = os.path.split(path.rstrip("/"))
        manifest = comm.run_on_main(lambda: read_json(os.path.join(path, MANIFEST)))["json"]
        saved_world = manifest["world"]
        self._await_files(path, {f: int(e["size"]) for f, e in manifest["files"].items()}, f"checkpoint {path}")
        if saved_world != world:
            load_dir, files = self._universal(path)
            self._await_files(os.path.join(load_dir, tag), files, f"the universal conversion of {path}")
            engine._config.load_universal_checkpoint = True
        # Always the whole ZeRO state: under ZeRO-3 the weights live in the optimizer's fp32 partitions
        # (`load_module_only` would restore them from the empty module placeholders); moments reset after.
        loaded, _ = engine.load_checkpoint(load_dir, tag=tag, load_optimizer_states=True,
                                           load_lr_scheduler_states=load_scheduler)
        if loaded is None:
            raise RuntimeError(f"DeepSpeed could not load {path}")
        if not load_optimizer:
            reset_adam_moments(engine.optimizer)
        if not load_scheduler and engine.lr_scheduler is not None:
            # the loaded optimizer state carries the old stage's LR; start the new schedule from its step 0
            for group, lr in zip(engine.optimizer.param_groups, engine.lr_scheduler.get_last_lr()):
                group["lr"] = lr
        engine._config.load_universal_checkpoint = False
        print0(f"loaded {path} in {time.perf_counter() - t0:.1f}s")
        if saved_world != world:  # rank r of another world: take rank 0's data position, fresh RNG
            return {k: v for k, v in torch.load(os.path.join(path, "state", "rank00000.pt"), weights_only=False).items()
                    if k != "rng"}
        return torch.load(os.path.join(path, "state", f"rank{rank:05d}.pt"), weights_only=False)

    def _universal(self, path: str) -> tuple[str, dict[str, int]] | None:
        """For a checkpoint written by another world size: its universal conversion (training/universal.py), made
        by rank 0 if none of exactly this content exists, and if it can finish before the job's end. Returns the
        folder to load from and the conversion's files (name -> size), the same on every rank; None for a checkpoint
        of this world size. Raises Requeue (exit 75) when the conversion cannot finish before the job's end,
        ValueError (exit 2) when it cannot fit a whole allocation. Collective: rank 0 decides and converts while
        the others wait on the host (comm.run_on_main)."""
        world = comm.world()

        def decide() -> dict | None:
            saved = read_json(os.path.join(path, MANIFEST))["json"]["world"]
            return None if saved == world else universal.prepare(path, saved, world, self.output_dir, self.deadline)

        got = comm.run_on_main(decide)
        if got is None:
            return None
        if "requeue" in got:
            raise Requeue(got["requeue"])
        if "refuse" in got:
            raise ValueError(got["refuse"])
        return got["dir"], got["files"]
