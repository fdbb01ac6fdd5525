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
    stop does not wait for it; `wait` does (the end of a run).

    `bytes()` (the room check's, at every save) counts what the trash still holds without walking all of it each time
    (a killed universal conversion's ~10^5 fragment files at 512 ranks: minutes a walk on NFS, every GPU waiting): a
    discarded checkpoint's size comes from its manifest, a conversion's from its DONE record, anything else is walked
    once; only the entry being deleted is walked again (what is left of it). A partial conversion (`<key>.tmp.*`: no
    record, up to params x 3 x world fragments) counts 0, never walked: the room is understated until it is gone."""

    def __init__(self, root: str):
        self.root = root
        self.folder = os.path.join(root, TRASH)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._again = False
        self.paused = False  # while set, `empty` only records the request: the room check counts the trash first
        self._sizes: dict[str, int] = {}  # trash entry -> its bytes, measured once
        self._busy: str | None = None  # the entry the thread is deleting

    def discard(self, path: str) -> None:
        """Move `path` out of every listing now; its deletion follows in the background."""
        if not os.path.exists(path):
            return
        os.makedirs(self.folder, exist_ok=True)
        name = f"{os.path.basename(path.rstrip('/'))}.{time.time_ns()}"
        size = _recorded_bytes(path)  # read before the rename: the thread may take it at once
        os.replace(path, os.path.join(self.folder, name))
        if size is not None:
            with self._lock:
                self._sizes[name] = size
        self.empty()

    def bytes(self) -> int:
        """What the trash still holds (see the class docstring)."""
        names = os.listdir(self.folder) if os.path.isdir(self.folder) else []
        with self._lock:
            self._sizes = {n: b for n, b in self._sizes.items() if n in names}  # deleted meanwhile
            known, busy = dict(self._sizes), self._busy
        total = 0
        for n in names:
            if n not in known or n == busy:
                known[n] = 0 if universal.PARTIAL.match(n) else universal.tree_bytes(os.path.join(self.folder, n))
                if n != busy:
                    with self._lock:
                        self._sizes.setdefault(n, known[n])
            total += known[n]
        return total

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
                with self._lock:
                    self._busy = name
                shutil.rmtree(os.path.join(self.folder, name), ignore_errors=True)
                with self._lock:
                    self._busy = None
                    self._sizes.pop(name, None)

    def wait(self, timeout_s: float | None = None) -> None:
        t = self._thread
        if t is not None:
            t.join(timeout_s)


def _recorded_bytes(path: str) -> int | None:
    """The bytes a folder's own record says it holds: a checkpoint's manifest, a finished conversion's DONE; None
    without one."""
    for name, key in ((MANIFEST, "files"), (universal.DONE, "files")):
        try:
            with open(os.path.join(path, name)) as fh:
                files = json.load(fh).get(key)
            return sum(int(e["size"] if isinstance(e, dict) else e) for e in files.values())
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            continue
    return None


def _rmtree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


# checkpoints/PINNED names the checkpoint kept from before a loss spike (training/stage.py, Checkpointer.pin): one at a
# time, a later spike moves it; kept against rotation as a stage's end is until then (delete the file to let it go)
PINNED = "PINNED"


def pinned(root: str) -> str | None:
    """The tag checkpoints/PINNED names, or None."""
    try:
        with open(os.path.join(root, PINNED)) as fh:
            return fh.read().strip() or None
    except OSError:
        return None


def rotate(root: str, keep: int, keep_tag: str, trash: Trash | None = None) -> None:
    """Keep the newest `keep` committed checkpoints, every stage's end and the one PINNED names; drop older ones and
    uncommitted leftovers (into `trash`, deleted in its background thread; without one, deleted here)."""
    remove = trash.discard if trash is not None else _rmtree
    all_tags = tags(root)
    committed = [t for t in all_tags if os.path.exists(os.path.join(root, t, MANIFEST))]
    newest = committed[-keep:]
    stage_ends = {t for t in committed if _manifest(root, t).get("stage_end")}
    pin = pinned(root)
    for t in all_tags:
        if t in newest or t == keep_tag or t in stage_ends or t == pin:
            continue
        if t in committed or int(TAG.match(t).group(1)) < int(TAG.match(keep_tag).group(1)):
            remove(os.path.join(root, t))
    _bound_side_folders(root, keep, remove, [*newest, keep_tag])


def _bound_side_folders(root: str, keep: int, remove=_rmtree, converted: list[str] | None = None) -> None:
    """universal/ (conversions for another world size) keeps only finished conversions of the checkpoints named in
    `converted` (rotate's: the newest `keep` and the one just saved or resumed; default: every one here), the same
    content and not only the same name (a branch's new step_N makes the old conversion stale): a stage end's
    conversion, kept for good with its checkpoint, was ~100 GB at 8B each stage, never read again (a stage's
    evaluation refuses another world size; a resume from it converts again). abandoned/ (branches left by
    `--resume PATH`) keeps its newest `keep` checkpoints and the pointers to them. At 8B a checkpoint is ~100 GB:
    without this bound every world-size change and every branch stayed."""
    # OUTPUT_DIR/universal/ (training/universal.py): this run's conversions; one in progress is never touched
    universal.bound(os.path.join(os.path.dirname(root), "universal"),
                    {universal.source_id(os.path.join(root, t)) for t in (tags(root) if converted is None else converted)},
                    remove)
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
