"""Which checkpoints a run keeps (training/checkpoint.py calls `rotate` on rank 0 after each commit): the newest
`keep` committed ones, every stage's final one, and bounded side folders (universal/ conversions, abandoned/ branches).
At Llama-3-8B a checkpoint is ~100 GB: nothing here may grow with the number of saves.

Deleting is off the step path (issue 41 item 11): the commit runs at a step boundary while every other rank waits
at its barrier, and removing a ~100 GB checkpoint (32 optimizer partitions of ~3 GB and ~100 files; seconds to
minutes on a loaded Lustre/NFS) used to run there. Now rank 0 decides what goes, as before, and only *renames*
each folder into `checkpoints/.trash/` (one metadata operation per folder, ~ms: the checkpoint leaves every listing
at once, whole, so a deletion in progress can never make it look complete, and the newest complete one is never
among them); a background thread (`Trash`) deletes what is in the trash. A job killed mid-deletion leaves the rest
in the trash, which the next job's first commit empties."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time

from training import universal
from training.checkpoint_files import MANIFEST, TAG


def tags(root: str) -> list[str]:
    """The step_N folders under `root`, oldest first."""
    if not os.path.isdir(root):
        return []
    return sorted((t for t in os.listdir(root) if TAG.match(t)), key=lambda t: int(t[5:]))


def _manifest(root: str, tag: str) -> dict:
    try:
        with open(os.path.join(root, tag, MANIFEST)) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return {}


TRASH = ".trash"  # under checkpoints/: folders being deleted (no step_N name: never listed as a checkpoint)


class Trash:
    """Rank 0's deletions, in a background thread: `discard` moves a folder into `root/.trash/` at once (a rename, on
    the same file system); the thread deletes the trash's contents (leftovers of a killed job included). Daemon: a
    stop does not wait for it; `wait` does (the end of a run)."""

    def __init__(self, root: str):
        self.root = root
        self.folder = os.path.join(root, TRASH)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._again = False
        self.paused = False  # while set, `empty` only records the request: the room check counts the trash first

    def discard(self, path: str) -> None:
        """Move `path` out of every listing now; its deletion follows in the background."""
        if not os.path.exists(path):
            return
        os.makedirs(self.folder, exist_ok=True)
        name = f"{os.path.basename(path.rstrip('/'))}.{time.time_ns()}"
        os.replace(path, os.path.join(self.folder, name))
        self.empty()

    def empty(self) -> None:
        """Start (or re-arm) the thread that deletes the trash's contents."""
        with self._lock:
            self._again = True
            if self._thread is None and not self.paused:  # (the thread clears it under the lock as it ends: no
                # request is missed)
                self._thread = threading.Thread(target=self._run, name="checkpoint-trash", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._again:
                    self._thread = None
                    return
                self._again = False
            for name in sorted(os.listdir(self.folder)) if os.path.isdir(self.folder) else []:
                shutil.rmtree(os.path.join(self.folder, name), ignore_errors=True)

    def wait(self, timeout_s: float | None = None) -> None:
        t = self._thread
        if t is not None:
            t.join(timeout_s)


def _rmtree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def rotate(root: str, keep: int, keep_tag: str, trash: Trash | None = None) -> None:
    """Keep the newest `keep` committed checkpoints; drop older ones and uncommitted leftovers (into `trash`, deleted
    in its background thread; without one, deleted here)."""
    remove = trash.discard if trash is not None else _rmtree
    all_tags = tags(root)
    committed = [t for t in all_tags if os.path.exists(os.path.join(root, t, MANIFEST))]
    newest = committed[-keep:]
    stage_ends = {t for t in committed if _manifest(root, t).get("stage_end")}
    for t in all_tags:
        if t in newest or t == keep_tag or t in stage_ends:
            continue
        if t in committed or int(TAG.match(t).group(1)) < int(TAG.match(keep_tag).group(1)):
            remove(os.path.join(root, t))
    _bound_side_folders(root, keep, remove)


def _bound_side_folders(root: str, keep: int, remove=_rmtree) -> None:
    """universal/ (conversions for another world size) keeps only finished conversions of the checkpoints still
    here, the same content and not only the same name (a branch's new step_N makes the old conversion stale);
    abandoned/ (branches left by `--resume PATH`) keeps its newest `keep` checkpoints and the pointers to them.
    At 8B a checkpoint is ~100 GB: without this bound every world-size change and every branch stayed."""
    # OUTPUT_DIR/universal/ (training/universal.py): this run's conversions; one in progress is never touched
    universal.bound(os.path.join(os.path.dirname(root), "universal"),
                    {universal.source_id(os.path.join(root, t)) for t in tags(root)}, remove)
    uni = os.path.join(root, "universal")  # where conversions were written before issue 41 (beside their source)
    if os.path.isdir(uni):
        for t in os.listdir(uni):
            if TAG.match(t) and not universal.is_conversion_of(os.path.join(uni, t), os.path.join(root, t)):
                remove(os.path.join(uni, t))
    aside = os.path.join(root, "abandoned")
    if os.path.isdir(aside):
        old = sorted((t for t in os.listdir(aside) if TAG.match(t)), key=lambda t: int(t[5:]))[:-keep]
        for t in old:
            remove(os.path.join(aside, t))
        for name in os.listdir(aside):
            pointer = os.path.join(aside, name)
            if name.startswith("STAGE_") and os.path.isfile(pointer):
                with open(pointer) as fh:
                    if fh.read().strip() in old:
                        os.remove(pointer)
