"""prepare_data's checks of where it runs, each a one-line refusal: `--shard` against the SLURM step that started it
(`shard_of`), and a full disk or quota (`refusal`: what main prints for an error, exit 2)."""

from __future__ import annotations

import errno
import os
from collections.abc import Mapping

from base.atomic import full_disk

FULL = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded"}  # as training/job.py says them
SRUN = ("srun bash -c 'python scripts/prepare_data.py ... --shard $SLURM_PROCID/$SLURM_NTASKS' (single quotes: "
        "each task expands its own; written bare in an sbatch script, the batch shell expands them once, 0/N for "
        "every task), then --merge")


def shard_of(value: str, argv: list[str], env: Mapping[str, str] = os.environ) -> tuple[int, int]:
    """(i, N) of `--shard i/N`. Under a SLURM step of several tasks (SLURM_STEP_NUM_TASKS > 1: srun sets it for the
    step's every task, Slurm's src/common/env.c; not in the batch script itself), refused where --shard is not given
    (every task prepared shard 0 of 1: the same files N times, guarded only by a lock, which NFS without flock does
    not hold) or where its i is not the task's SLURM_PROCID while N is the step's task count (`--shard
    $SLURM_PROCID/$SLURM_NTASKS` expanded by the batch shell: 0/N for every task). Refused rather than taken from
    the step: a shard of N is a preparation of its own (its plan), so the same command run later outside srun (to
    resume, on a login node) would be another one, refused there; and `srun -n 8` of one command may be a launch
    wrapper's habit, not a request for 8 shards. An explicit i equal to the task's SLURM_PROCID is never refused, nor
    an i/N of another layout (N not the step's tasks: an array job's offset, two steps of half the shards each)."""
    try:
        i, n = (int(x) for x in value.split("/"))
        assert 0 <= i < n
    except (ValueError, AssertionError):
        raise ValueError(f"--shard {value!r}: use i/N with 0 <= i < N") from None
    tasks, rank = env.get("SLURM_STEP_NUM_TASKS", ""), env.get("SLURM_PROCID", "")
    if not (tasks.isdigit() and rank.isdigit() and int(tasks) > 1):
        return i, n
    given = any(x == "--shard" or x.startswith("--shard=") for x in argv)  # the parser takes no abbreviation
    if not given:
        raise ValueError(f"no --shard in a SLURM step of {tasks} tasks (SLURM_STEP_NUM_TASKS): each task would "
                         f"prepare all the files; give each its own shard: {SRUN}; to prepare all of it in one task, "
                         "give --shard 0/1")
    if i != int(rank) and n == int(tasks):
        raise ValueError(f"--shard {value} in task {rank} of a SLURM step of {tasks} tasks (SLURM_PROCID): the "
                         f"tasks' --shard were expanded once, not per task? Give each task its own: {SRUN}")
    return i, n


def refusal(e: Exception, output: str) -> str:
    """The one line main prints for `e`: a ValueError's own; a full disk or quota (ENOSPC, EDQUOT) naming --output
    and what to run (training/job.py's wording; an OSError without errno counts where the disk has no block left:
    base/atomic.full_disk). Any other error is raised again (a crash, with its traceback)."""
    if isinstance(e, ValueError):
        return str(e)
    if isinstance(e, OSError):  # an errno-less short write (numpy's tofile) on a file system left with no block
        full_disk(e, str(e.filename or output))
    if not isinstance(e, OSError) or e.errno not in FULL:
        raise e
    where = str(e.filename or f"a file under --output {output}")  # a write() into an open file names none
    folder = os.path.dirname(str(e.filename)) if e.filename else output
    what = f"{FULL[e.errno]} ({errno.errorcode[e.errno]}) writing {where}"
    again = "then run the same command again (it resumes after the last committed chunk)"
    if e.errno == errno.EDQUOT:  # user/group/project quotas: statvfs (df) never sees them
        return (f"{what}: a quota is full; see it with `lfs quota -hu $USER {folder}` (Lustre) or `quota -s`, free "
                f"space within it or give --output a file system with room, {again}")
    return f"{what}: free space there (`df -h {folder}`) or give --output a larger file system, {again}"
