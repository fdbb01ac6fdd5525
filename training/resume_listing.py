"""Which checkpoints a start chooses among: rank 0's listing of checkpoints/ joined with the one LATEST names, each
looked up by name through a stale view of a shared file system (docs/checkpoints.md). training/restore.py's
`Restorer.find_resume` walks this list newest first; it is rank 0's alone, broadcast (comm.run_on_main), never a
rank's own listing. Its own file: what a stale view hides and how long to look again is a question apart from
verifying and loading the checkpoint once chosen.
"""

from __future__ import annotations

import os
import time

from base.log import print0
from training import rotation
from training.checkpoint_files import MANIFEST, POINTER, TAG, not_visible


def listing(root: str, settle_s: float) -> list[str]:
    """Rank 0: this run's checkpoints under `root` (OUTPUT_DIR/checkpoints), oldest first: its listing of checkpoints/
    and the one LATEST names, looked up by name (a node's cached listing can be up to FS_SETTLE_S older than the
    folder: the newest checkpoint, just committed by the job before on another node, missing from it would resume an
    older one without a word). When LATEST names a checkpoint whose manifest this node cannot see yet, it is looked for
    again by name for up to `settle_s` (FS_SETTLE_S, whatever the world size), then left out with a warning naming it;
    LATEST itself the same way when this start has reason to expect one (`latest_name`). Costs one small read and, on
    a stale view, up to 60 s for LATEST and 60 s for its manifest, once per start."""
    listed = rotation.tags(root)
    latest = latest_name(root, listed, settle_s)
    if latest is None:
        return listed
    if not TAG.match(latest) or latest in listed and os.path.isfile(os.path.join(root, latest, MANIFEST)):
        return listed
    t0 = time.monotonic()
    if not_visible(os.path.join(root, latest), {MANIFEST: 1}, settle_s):
        print0(f"warning: {os.path.join(root, POINTER)} names {latest}, but this node cannot see "
               f"{os.path.join(root, latest, MANIFEST)} after looking for it for {settle_s:.0f} s (a "
               "stale view of the file system, or it was removed): resuming from an older checkpoint")
        return listed
    if time.monotonic() - t0 >= 1.0:
        print0(f"{POINTER} names {latest}: its manifest became visible here after {time.monotonic() - t0:.0f} s")
    return sorted(set(listed) | {latest}, key=lambda t: int(TAG.match(t).group(1)))


def latest_name(root: str, listed: list[str], settle_s: float) -> str | None:
    """Rank 0: the name LATEST holds, None if there is none. A LATEST this node cannot see is looked for again by
    name for up to `settle_s` only when this start has reason to expect one (`expects_latest`): a requeue onto a
    node whose cached negative lookup hides the LATEST the job before wrote on another node would otherwise start
    over, or resume an older checkpoint, without a word. A fresh run has none to wait for and starts at once."""
    pointer = os.path.join(root, POINTER)
    why = None if os.path.isfile(pointer) else expects_latest(root, listed)
    if why:
        t0 = time.monotonic()
        if not_visible(root, {POINTER: 1}, settle_s):
            print0(f"warning: {why}, but this node cannot see {pointer} after looking for it for "
                   f"{settle_s:.0f} s (a stale view of the file system, or it was removed): resuming from "
                   "this node's listing of checkpoints/")
        elif time.monotonic() - t0 >= 1.0:
            print0(f"{pointer} became visible here after {time.monotonic() - t0:.0f} s ({why})")
    try:
        with open(pointer) as fh:
            return fh.read().strip()
    except (OSError, UnicodeDecodeError):  # unreadable or not text (was a traceback): the listing decides
        return None


def expects_latest(root: str, listed: list[str]) -> str | None:
    """Rank 0: why this start should find a LATEST (a commit came before it), or None. A requeue of the job
    (SLURM_RESTART_COUNT > 0: the run before may have committed, on another node) or a committed checkpoint in
    the listing are reasons; a first start in an empty folder (a 1-rank run on a local disk included) has none
    and never waits. Not a reason: rotation's `.trash`, which outlives a `--resume none` branch (LATEST removed,
    every checkpoint moved to abandoned/). One stat per listed checkpoint (a few)."""
    restarts = os.environ.get("SLURM_RESTART_COUNT", "0")
    if restarts.isdigit() and int(restarts) > 0:
        return f"this is restart {restarts} of the job (SLURM_RESTART_COUNT)"
    committed = [t for t in listed if os.path.isfile(os.path.join(root, t, MANIFEST))]
    return f"{committed[-1]} is committed" if committed else None
