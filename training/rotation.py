"""Which checkpoints a run keeps (training/checkpoint.py calls `rotate` on rank 0 after each commit): the newest
`keep` committed ones, every stage's final one, and bounded side folders (universal/ conversions, abandoned/ branches).
At Llama-3-8B a checkpoint is ~100 GB: nothing here may grow with the number of saves."""

from __future__ import annotations

import json
import os
import shutil

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


def rotate(root: str, keep: int, keep_tag: str) -> None:
    """Keep the newest `keep` committed checkpoints; drop older ones and uncommitted leftovers."""
    all_tags = tags(root)
    committed = [t for t in all_tags if os.path.exists(os.path.join(root, t, MANIFEST))]
    newest = committed[-keep:]
    stage_ends = {t for t in committed if _manifest(root, t).get("stage_end")}
    for t in all_tags:
        if t in newest or t == keep_tag or t in stage_ends:
            continue
        if t in committed or int(TAG.match(t).group(1)) < int(TAG.match(keep_tag).group(1)):
            shutil.rmtree(os.path.join(root, t), ignore_errors=True)
    _bound_side_folders(root, keep)


def _bound_side_folders(root: str, keep: int) -> None:
    """universal/ (conversions for another world size) keeps only finished conversions of the checkpoints still
    here, the same content and not only the same name (a branch's new step_N makes the old conversion stale);
    abandoned/ (branches left by `--resume PATH`) keeps its newest `keep` checkpoints and the pointers to them.
    At 8B a checkpoint is ~100 GB: without this bound every world-size change and every branch stayed."""
    # OUTPUT_DIR/universal/ (training/universal.py): this run's conversions; one in progress is never touched
    universal.bound(os.path.join(os.path.dirname(root), "universal"),
                    {universal.source_id(os.path.join(root, t)) for t in tags(root)})
    uni = os.path.join(root, "universal")  # where conversions were written before issue 41 (beside their source)
    if os.path.isdir(uni):
        for t in os.listdir(uni):
            if TAG.match(t) and not universal.is_conversion_of(os.path.join(uni, t), os.path.join(root, t)):
                shutil.rmtree(os.path.join(uni, t), ignore_errors=True)
    aside = os.path.join(root, "abandoned")
    if os.path.isdir(aside):
        old = sorted((t for t in os.listdir(aside) if TAG.match(t)), key=lambda t: int(t[5:]))[:-keep]
        for t in old:
            shutil.rmtree(os.path.join(aside, t), ignore_errors=True)
        for name in os.listdir(aside):
            pointer = os.path.join(aside, name)
            if name.startswith("STAGE_") and os.path.isfile(pointer):
                with open(pointer) as fh:
                    if fh.read().strip() in old:
                        os.remove(pointer)
