"""Where an export may be written (model_utils/export.py builds the folder beside it and swaps it in): so that a typo
cannot delete a user's folder, an existing `out_dir` is replaced only where it is the run's own (`owned`: RUN/hf_model)
or a previous export (it holds MARKER, which records the checkpoint's path and content hash); a folder holding the
checkpoint, or any other existing folder, is refused in one line before any work (`check_out`). A symlinked `out_dir`
is written where it points, so its target must be missing, empty or a previous export of this run's checkpoints, owned
or not (a run's hf_model linked to a scratch folder of other work wiped it; a copied run folder's link to the
original's export replaced the original's model). `is_export_of`: whether a folder holds a finished export of a
checkpoint, by content. Cost: a few stats, one listing and reads of small files (MARKER, manifests), no walk.
"""

from __future__ import annotations

import hashlib
import json
import os

from base.atomic import nearest_folder

MARKER = "export.json"  # written into every export: which checkpoint it came from


def check_out(out_dir: str, checkpoint: str | None, owned: bool = False) -> None:
    """A one-line ValueError where writing `out_dir` would destroy something not an export: the folder holding the
    checkpoint (the run folder, its checkpoints), an existing file or folder that is neither the run's own export
    folder (`owned`) nor a previous export, or, where `out_dir` is a link, a target that is not missing, empty or a
    previous export (`owned` or not: the export replaces the folder the link points to, and a link to a scratch folder
    holding other work wiped it) or a previous export of another run's checkpoint (`_exported_here`: a run folder
    copied with its absolute link made the copy's export replace the original run's model); also where the folder it
    is built in beside the target is not writable (that failed after the consolidation: minutes and 32 GB of host
    memory for 8B). `checkpoint` None: train.py's start-up check of its RUN/hf_model, before the run trains."""
    out = os.path.realpath(out_dir)
    ck = checkpoint and os.path.realpath(checkpoint)
    if ck and (ck == out or ck.startswith(out.rstrip(os.sep) + os.sep)):
        raise ValueError(f"--out {out_dir}: it holds the checkpoint {checkpoint}, which the export would replace: "
                         "give a new folder")
    link = os.path.islink(out_dir.rstrip(os.sep) or out_dir)
    if link:
        if not _replaceable(out):
            what = "a file" if os.path.isfile(out) else "a folder holding other files (no export.json)"
            raise ValueError(f"{out_dir}: a link to {out}, {what}, which the export would replace: point the link "
                             "at a new or empty folder (or a previous export), or remove the link")
        ours = [os.path.dirname(os.path.abspath(checkpoint.rstrip(os.sep)))] if checkpoint else []
        if owned:  # RUN/hf_model: RUN/checkpoints
            ours.append(os.path.join(os.path.dirname(os.path.abspath(out_dir.rstrip(os.sep))), "checkpoints"))
        # a copy of a run folder (cp -a) whose link still points at the original's export: refused (its export would
        # replace the original's model). A link to another run's export on purpose (a served `current`) passes: a
        # review found the first rule refused it
        if os.path.isfile(os.path.join(out, MARKER)) and not _exported_here(out, ours) and _copied(out, ours):
            raise ValueError(f"{out_dir}: a link to {out}, the export of the run this folder was copied from "
                             f"({exported_from(out)[0]}), which this export would replace: remove the link (the export "
                             "is then written in its place) or point --out elsewhere")
    elif os.path.lexists(out_dir) and not owned and not os.path.isfile(os.path.join(out_dir, MARKER)):
        what = "a folder that is not a previous export" if os.path.isdir(out_dir) else "a file"
        raise ValueError(f"--out {out_dir}: {what} (no {MARKER}), which the export would replace: give a new "
                         "folder, or remove it yourself")
    # the export is built in OUT.export-tmp beside it, then swapped in (os.replace: atomic only within one file system)
    parent = nearest_folder(os.path.dirname(out))
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{out_dir}: the export is built beside {out}, in {parent}, which is not writable: "
                         f"{'point the link at' if link else 'give'} a folder inside a writable one")


def _exported_here(target: str, checkpoints: list[str]) -> bool:
    """Whether the previous export in `target` came from a checkpoint of this run (its checkpoints/ folders:
    `checkpoints`): the checkpoint its MARKER records is under one by real path, or, where that path is gone (the run
    folder moved or re-mounted since), the checkpoint of the same name here has the recorded content (its manifest's
    SHA-256, as training/checkpoint_files.manifest_sha256: model_utils does not import training). A copied run folder
    whose link still points at the original's export is not this run's: the original is still there."""
    path, sha = exported_from(target)
    if not path:
        return False
    for folder in checkpoints:
        here = os.path.realpath(folder)
        if os.path.realpath(path).startswith(here + os.sep):
            return True
        if sha and not os.path.exists(path) and _same_here(path, sha, [here]):
            return True
    return False


def _copied(target: str, checkpoints: list[str]) -> bool:
    """Whether the export in `target` is of a run this one is a copy of: its recorded checkpoint is still there and a
    checkpoint of the same name in one of `checkpoints` has its content (manifest SHA-256)."""
    path, sha = exported_from(target)
    return bool(path and sha and os.path.isdir(path)) and _same_here(path, sha, checkpoints)


def _same_here(path: str, sha: str, checkpoints: list[str]) -> bool:
    """Whether a checkpoint named as `path` in one of the `checkpoints` folders has the manifest SHA-256 `sha`."""
    for folder in checkpoints:
        try:
            with open(os.path.join(folder, os.path.basename(path.rstrip(os.sep)), "MANIFEST.json"), "rb") as fh:
                if hashlib.sha256(fh.read()).hexdigest() == sha:
                    return True
        except OSError:
            pass
    return False


def _replaceable(path: str) -> bool:
    """Whether `path` may be replaced by an export: missing, an empty folder or a previous export."""
    if not os.path.lexists(path):
        return True
    return os.path.isdir(path) and (not os.listdir(path) or os.path.isfile(os.path.join(path, MARKER)))


def exported_from(out_dir: str) -> tuple[str | None, str | None]:
    """(path, content hash) of the checkpoint a finished export in `out_dir` was written from (its MARKER); Nones
    where there is none."""
    try:
        with open(os.path.join(out_dir, MARKER)) as fh:
            got = json.load(fh)
        return got.get("checkpoint"), got.get("manifest_sha256")
    except (OSError, ValueError, AttributeError):
        return None, None


def is_export_of(out_dir: str, identity: str | None) -> bool:
    """Whether `out_dir` holds a finished export of the checkpoint whose content hash is `identity` (its manifest's
    SHA-256): by content, not path, so a finished run moved or re-mounted since its export keeps it (compared by path,
    it exported again: minutes and 32 GB of host memory at 8B)."""
    return bool(identity) and exported_from(out_dir)[1] == identity
