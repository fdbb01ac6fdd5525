"""A SLURM job's base state (RUNNING, CANCELLED, TIMEOUT, PREEMPTED, PENDING, ...) while it ends, for
scripts/slurm.sbatch's decision to requeue or not (`python -m base.slurm_state JOB` prints "STATE REASON").

`scontrol show job` prints no base state while a job ends: slurmctld sets a cancelled job CANCELLED|COMPLETING (a
timed-out one TIMEOUT|COMPLETING, one it requeued itself PENDING|COMPLETING) before slurmd signals its processes
(src/slurmctld/job_mgr.c job_signal, _job_timed_out), and `job_state_string` prints the COMPLETING flag over the
base (src/common/slurm_protocol_defs.c; src/scontrol/info_job.c). So the batch shell, which asks from inside its own
SIGTERM, read JobState=COMPLETING for every end, never CANCELLED, and a scancel was requeued. The base state comes
from, in order:
1. `scontrol --json show job J` (Slurm >= 23.11, data_parser v0.0.40: `job_state` lists the base state and its
   flags; 23.02's v0.0.39 writes the printed string, COMPLETING);
2. `scontrol show job J`'s JobState when it is not COMPLETING (a running job, a pending one);
3. `sacct -X -n -P -j J -o State` (accounting: "CANCELLED by 1000", written when slurmctld ends the job);
4. TIMEOUT when `scontrol show job`'s RunTime has reached its TimeLimit (slurmctld's _job_timed_out sets the end to
   that moment; RunTime leaves out the suspended time, src/scontrol/info_job.c). SLURM_JOB_END_TIME was read here
   before: the launch-time end, which a suspend does not move (slurmctld moves EndTime later by the suspended time at
   the resume), so a user's scancel after a suspend, past the launch-time end, was read TIMEOUT and requeued. What it
   still cannot tell apart: a scancel in the last ~30 s past the limit, before slurmctld's periodic check times the
   job out (it would have timed out then; requeued either way);
else COMPLETING: unknown, which the batch shell takes as a cancel (never requeued: undoing a user's scancel is the
worse mistake; a preemption is then not requeued, and the next submission resumes). Each call is retried (a busy
controller answers with an error); torch-free, standard library only, ~50 ms. `python -m base.slurm_state JOB S`: all
of it within S seconds (the batch shell's SIGTERM leaves it KillWait: the tries, each up to MessageTimeout on a busy
controller, took ~50 s), no try started past them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

# job_state flags as the JSON lists them beside the base state (src/common/slurm_protocol_defs.c job_state_string)
FLAGS = {"COMPLETING", "STAGE_OUT", "CONFIGURING", "EXPEDITING", "RESIZING", "REQUEUED", "REQUEUE_FED",
         "REQUEUE_HOLD", "SPECIAL_EXIT", "STOPPED", "REVOKED", "RESV_DEL_HOLD", "SIGNALING", "UPDATE_DB",
         "POWER_UP_NODE", "LAUNCH_FAILED", "RECONFIG_FAIL"}


def _ask(cmd: list[str], tries: int = 3, deadline: float | None = None) -> str | None:
    """`cmd`'s output, tried `tries` times; None when it fails, or when time.monotonic() reaches `deadline`."""
    for i in range(tries):
        left = 20.0 if deadline is None else min(20.0, deadline - time.monotonic())
        if left <= 0:
            return None
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=left)
        except (OSError, subprocess.TimeoutExpired):
            return None  # no such command (no accounting client), or a controller that does not answer
        if out.returncode == 0:
            return out.stdout
        if any(w in out.stderr for w in ("unrecognized option", "invalid option", "plugin", "Plugin")):
            return None  # a Slurm before --json, or one without its data_parser: asking again will not help
        if i < tries - 1:
            time.sleep(1 if deadline is None else max(0.0, min(1.0, deadline - time.monotonic())))
    return None


def _number(v):
    """A JSON id as an int: a plain number, or data_parser v0.0.40's {"set": true, "number": N}."""
    if isinstance(v, dict):
        v = v.get("number") if v.get("set", True) else None
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def _record(jobs: list, job: str):
    """The record of `job` among what `scontrol --json show job` gives: for an array task (A_T), scontrol loads
    array A whole and dumps every record, the array's head (PENDING while tasks wait, else the last task to start)
    first (src/scontrol/info_job.c scontrol_print_job; src/slurmctld/job_mgr.c pack_one_job): jobs[0] read the head's
    state for the task's (a scancel of the task requeued, a time limit taken as requeued by Slurm). None: not there."""
    if "_" in job:
        a, t = (_number(x) for x in job.split("_", 1))
        return next((j for j in jobs if _number(j.get("array_job_id")) == a
                     and _number(j.get("array_task_id")) == t), None)
    ids = [_number(j.get("job_id")) for j in jobs]
    return jobs[ids.index(_number(job))] if _number(job) in ids else (jobs[0] if jobs else None)


def _from_json(text: str | None, job: str = "") -> tuple[str, str] | None:
    try:
        job = _record(json.loads(text or "")["jobs"], job)
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return None
    if not isinstance(job, dict):
        return None
    states = job.get("job_state")
    states = states if isinstance(states, list) else [states]
    base = [s for s in states if isinstance(s, str) and s not in FLAGS]
    reason = job.get("state_reason") or "None"
    return (base[0], str(reason)) if base else None


def _seconds(text: str, key: str) -> int | None:
    """`key`=[D-]HH:MM:SS of `scontrol show job` in seconds (secs2time_str / mins2time_str, src/common/parse_time.c);
    None for UNLIMITED, Partition_Limit, INVALID or no such field."""
    m = re.search(rf"\b{key}=(?:(\d+)-)?(\d+):(\d\d):(\d\d)(?:\s|$)", text)
    if not m:
        return None
    d, h, mi, s = (int(x or 0) for x in m.groups())
    return ((d * 24 + h) * 60 + mi) * 60 + s


def timed_out(text: str) -> bool:
    """Whether `scontrol show job`'s text shows the time limit reached: RunTime >= TimeLimit (both leave out the
    suspended time; an unlimited or unprinted limit never is)."""
    run, limit = _seconds(text, "RunTime"), _seconds(text, "TimeLimit")
    return run is not None and limit is not None and run >= limit


def base_state(job: str, ask=None, within: float | None = None) -> tuple[str, str]:
    """(base state, reason) of job `job` (module docstring); ("", "") when slurmctld cannot be asked at all. `ask`
    (cmd, tries) -> output or None; the default runs the command, every try ending by `within` seconds from now."""
    deadline = None if within is None else time.monotonic() + within
    ask = ask or (lambda cmd, tries=3: _ask(cmd, tries, deadline))
    got = _from_json(ask(["scontrol", "--json", "show", "job", job], tries=2), job)
    if got:
        return got
    text = ask(["scontrol", "show", "job", job])
    state = re.search(r"JobState=([A-Z_]+)", text or "")
    reason = re.search(r"Reason=(\S+)", text or "")
    reason = reason.group(1) if reason else "None"
    if state and state.group(1) != "COMPLETING":
        return state.group(1), reason
    acct = (ask(["sacct", "-X", "-n", "-P", "-j", job, "-o", "State"], tries=2) or "").split()
    if acct and acct[0] not in FLAGS | {"RUNNING"}:  # accounting can lag behind the end: RUNNING says nothing
        return acct[0], reason
    if state and timed_out(text):
        return "TIMEOUT", reason
    return ("COMPLETING", reason) if state else ("", "")


if __name__ == "__main__":  # python -m base.slurm_state JOB [SECONDS]
    print(" ".join(base_state(sys.argv[1], within=float(sys.argv[2]) if len(sys.argv) > 2 else None)))


def job_local(path: str) -> str | None:
    """Inside a Slurm job, what makes `path` the job's own (gone at its end: job_container/tmpfs gives each job a
    private /tmp, sites a per-job $TMPDIR, /dev/shm is emptied), else None."""
    if not os.environ.get("SLURM_JOB_ID"):
        return None
    path = os.path.realpath(path)
    for root, what in ((os.environ.get("TMPDIR"), "$TMPDIR"), ("/tmp", "/tmp"), ("/dev/shm", "/dev/shm")):
        if root and (path + os.sep).startswith(os.path.realpath(root).rstrip(os.sep) + os.sep):
            return f"a folder under {what}, this Slurm job's own"
    return None
