"""Branches of a run (training/checkpoint.py's `find_resume`): `--resume PATH` (or `none`) starts a new branch from
PATH (or from nothing) once: this run's checkpoints not on it are moved aside to checkpoints/abandoned/, a stale
COMPLETE too, LATEST and DeepSpeed's `latest` name the branch point (or go), and the branch is recorded in
checkpoints/BRANCHES.json (its source's content hash), so the same command run again (a SLURM requeue, a re-run after
a crash) continues the branch from its own newest checkpoint instead of taking it again. Rank 0 alone runs these (the
caller broadcasts what they decide)."""

from __future__ import annotations

import json
import os
import shutil
import time

from base.log import print0
from training.checkpoint_files import TAG, atomic_write, manifest_sha256, point, read_json

BRANCHES = "BRANCHES.json"  # the branches this run took (--resume PATH / none), each taken once


def _recorded(root: str) -> list[dict]:
    got = read_json(os.path.join(root, BRANCHES))
    return got.get("json", {}).get("branches", []) if "json" in got else []


def taken(root: str, resume: str) -> str | None:
    """Rank 0: when the run folder whose checkpoints are under `root` took the branch `resume` (PATH or none), or
    None if it never did. PATH is known by its content (its manifest's SHA-256) where both it and the record have one:
    the same branch after the run folder was moved, copied, re-mounted or rsynced elsewhere (its recorded real path
    is the old one; matched by path, the requeue took the branch again and moved the branch's own newer checkpoints
    to abandoned/, retraining them). A source that is gone (rotated away by the branch's own saves): one of this run's
    by its name in checkpoints/ (`tag`), another run's by its real path."""
    if resume == "none":
        return next((b.get("taken_at", "an earlier start") for b in reversed(_recorded(root))
                     if b.get("resume") == "none"), None)
    key, sid = os.path.realpath(resume.rstrip("/")), manifest_sha256(resume)
    own = os.path.dirname(key) == os.path.realpath(root)
    for b in reversed(_recorded(root)):
        if b.get("resume") == "none":
            continue
        if sid and b.get("manifest_sha256"):
            same = b["manifest_sha256"] == sid
        elif sid is None and own and b.get("tag"):
            same = b["tag"] == os.path.basename(key)
        else:
            same = b.get("source") == key and (sid is None or b.get("manifest_sha256") == sid)
        if same:
            return b.get("taken_at", "an earlier start")
    return None


def _evaluations_aside(root: str, aside: str) -> None:
    """A stage's evaluation (OUTPUT_DIR/eval/stage{N}.json) is the branch's only while its end checkpoint is on it (its
    STAGE_N pointer still in `root`): the others (and the summary of them) move to abandoned/eval/. Left, a stage the
    branch ended but had not evaluated when killed was taken as evaluated: the abandoned line's numbers reported as
    the branch's, its own model never evaluated."""
    kept = {n.split("_")[1] for n in os.listdir(root) if n.startswith("STAGE_")} if os.path.isdir(root) else set()
    evals = os.path.join(os.path.dirname(root), "eval")
    gone = [n for n in (os.listdir(evals) if os.path.isdir(evals) else [])
            if n.startswith("stage") and n.endswith(".json") and n[5:-5] not in kept]
    for name in gone + (["summary.md"] if gone and os.path.exists(os.path.join(evals, "summary.md")) else []):
        os.makedirs(os.path.join(aside, "eval"), exist_ok=True)
        os.replace(os.path.join(evals, name), os.path.join(aside, "eval", name))


def start(root: str, path: str | None, resume: str, tags: list[str]) -> None:
    """Rank 0: start a branch from `path` (None: fresh); `tags` are this run's checkpoints, oldest first. Those not
    on the branch (newer than `path` when it is one of this run's, all of them otherwise), the stage pointers to
    them and a COMPLETE left by the line they belong to move to checkpoints/abandoned/ (bounded by save_total_limit like the rest); then
    the branch is recorded in BRANCHES.json, last and atomically: a start killed before that takes it again."""
    own = path is not None and os.path.dirname(os.path.realpath(path.rstrip("/"))) == os.path.realpath(root)
    step = int(TAG.match(os.path.basename(path.rstrip("/"))).group(1)) if own else -1
    off = [t for t in tags if int(t[5:]) > step]
    aside = os.path.join(root, "abandoned")
    src = os.path.realpath(path.rstrip("/")) if path else None
    for t in off:
        if os.path.realpath(os.path.join(aside, t)) == src:
            raise ValueError(f"--resume {path}: this branch would move this run's {t} onto it (abandoned/{t}); "
                             "copy it out of checkpoints/ and resume from the copy")
    complete = os.path.join(os.path.dirname(root), "COMPLETE")
    if off or os.path.exists(complete):
        os.makedirs(aside, exist_ok=True)
    for name in os.listdir(root) if os.path.isdir(root) else []:
        pointer = os.path.join(root, name)
        if name.startswith("STAGE_") and os.path.isfile(pointer):
            with open(pointer) as fh:
                if fh.read().strip() in off:
                    os.replace(pointer, os.path.join(aside, name))
    for t in off:
        if os.path.exists(os.path.join(aside, t)):  # an older abandoned line's checkpoint of the same step
            shutil.rmtree(os.path.join(aside, t))
        os.replace(os.path.join(root, t), os.path.join(aside, t))
    if os.path.exists(complete):  # it described the line left behind; this branch writes its own at its end
        os.replace(complete, os.path.join(aside, "COMPLETE"))
    pinned = os.path.join(root, "PINNED")  # a spike's kept checkpoint (rotation.PINNED) moved aside: no longer kept,
    if os.path.isfile(pinned):  # else the branch's own checkpoint of that step would be kept in its place
        with open(pinned) as fh:
            if fh.read().strip() in off:
                os.replace(pinned, os.path.join(aside, "PINNED"))
    _evaluations_aside(root, aside)
    os.makedirs(root, exist_ok=True)
    # both pointers move together: a `latest` left naming a checkpoint now in abandoned/ sent DeepSpeed's tools
    # (a user's engine.load_checkpoint(checkpoints), zero_to_fp32 without a tag) to a folder no longer there
    point(root, os.path.basename(path.rstrip("/")) if own else None)
    record = {"resume": resume, "source": src, "manifest_sha256": manifest_sha256(path) if path else None,
              "tag": os.path.basename(src) if own else None,  # its name in checkpoints/, wherever the folder is now
              "step": step if own else None, "moved": off, "taken_at": time.strftime("%Y-%m-%d %H:%M:%S")}
    atomic_write(os.path.join(root, BRANCHES),
                 json.dumps({"branches": [*_recorded(root), record]}, indent=1) + "\n")
    print0(f"--resume {resume}: branch started" + (f"; {len(off)} checkpoint(s) not on it moved to {aside} "
                                                   f"({off[0]} .. {off[-1]})" if off else ""))
