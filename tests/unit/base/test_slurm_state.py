"""base/slurm_state.py: a job's base state while it ends, which `scontrol show job` hides under COMPLETING (slurmctld
sets CANCELLED|COMPLETING before slurmd signals; job_state_string prints the flag first). What slurmctld, scontrol
and sacct answer is given as each prints it; no Slurm runs here."""

from __future__ import annotations

import json

import pytest

from base.slurm_state import base_state

TEXT = "JobId=7 JobName=x\n   JobState={} Reason={} Dependency=(null)\n"
# line 6 of `scontrol show job` (src/scontrol/info_job.c): RunTime leaves out the suspended time
TIMES = "   RunTime={} TimeLimit={} TimeMin=N/A\n   SubmitTime=2026-01-01T00:00:00 EligibleTime=2026-01-01T00:00:00\n"


def asker(json_state=None, text_state=None, reason="None", sacct=None, times=None):
    def ask(cmd, tries=3):
        if cmd[:2] == ["scontrol", "--json"]:
            return None if json_state is None else json.dumps(
                {"jobs": [{"job_id": 7, "job_state": json_state, "state_reason": reason}]})
        if cmd[0] == "scontrol":
            return None if text_state is None else TEXT.format(text_state, reason) + (TIMES.format(*times)
                                                                                       if times else "")
        return sacct
    return ask


@pytest.mark.parametrize("ask, want", [
    # Slurm >= 23.11 (data_parser v0.0.40): the JSON lists the base state and its flags
    (asker(["CANCELLED", "COMPLETING"], "COMPLETING"), ("CANCELLED", "None")),
    (asker(["TIMEOUT", "COMPLETING"], "COMPLETING", "TimeLimit"), ("TIMEOUT", "TimeLimit")),
    (asker(["PENDING", "COMPLETING", "REQUEUED"], "COMPLETING", "BeginTime"), ("PENDING", "BeginTime")),
    (asker(["RUNNING"], "RUNNING"), ("RUNNING", "None")),
    # 23.02's data_parser (v0.0.39) writes the printed string (job_state_string): the text and accounting decide
    (asker("COMPLETING", "COMPLETING", sacct="CANCELLED by 1000\n"), ("CANCELLED", "None")),
    # no --json (an older Slurm, or one without its data_parser plugin): the text when it shows a base state, else accounting
    (asker(None, "RUNNING"), ("RUNNING", "None")),
    (asker(None, "COMPLETING", sacct="PREEMPTED\n"), ("PREEMPTED", "None")),
    (asker(None, "COMPLETING", sacct="RUNNING\n"), ("COMPLETING", "None")),  # accounting behind: unknown
    (asker(None, "COMPLETING"), ("COMPLETING", "None")),  # no accounting: unknown (the batch shell: a cancel)
    (asker(None, None), ("", "")),  # slurmctld does not answer
])
def test_the_base_state_under_completing(ask, want):
    assert base_state("7", ask=ask) == want


@pytest.mark.parametrize("run, limit, want", [
    ("04:00:12", "04:00:00", "TIMEOUT"),      # slurmctld's periodic check timed it out a few seconds past the limit
    ("1-00:00:30", "1-00:00:00", "TIMEOUT"),  # days, as secs2time_str / mins2time_str print them
    ("01:10:00", "04:00:00", "COMPLETING"),   # ended before its limit: a cancel (unknown), never a time limit
    ("3-00:00:00", "UNLIMITED", "COMPLETING"),
    ("3-00:00:00", "Partition_Limit", "COMPLETING"),
])
def test_the_time_limit_reached_is_a_timeout_when_nothing_else_says(run, limit, want):
    """The last resort (no --json base state, no sacct): the time limit read from `scontrol show job` itself."""
    assert base_state("7", ask=asker(None, "COMPLETING", sacct="RUNNING\n", times=(run, limit))) == (want, "None")
    assert base_state("7", ask=asker(None, "COMPLETING", times=(run, limit))) == (want, "None")


def test_a_cancel_after_a_suspend_is_no_timeout(monkeypatch):
    """A job suspended 3 h 10 min and cancelled by its user 10 min past its launch-time end: SLURM_JOB_END_TIME (the
    batch step's environment, set at launch) has passed, but slurmctld moved EndTime later by the suspended time and
    RunTime leaves the suspend out (info_job.c: end - suspend_time + pre_sus_time). Read TIMEOUT from the variable,
    the cancel was requeued (slurm.sbatch requeue_now); scontrol's RunTime < TimeLimit says it is no time limit."""
    import time

    monkeypatch.setenv("SLURM_JOB_END_TIME", str(int(time.time()) - 600))
    ask = asker("COMPLETING", "COMPLETING", sacct="RUNNING\n", times=("01:00:00", "04:00:00"))
    assert base_state("7", ask=ask) == ("COMPLETING", "None")


def test_an_array_tasks_state_is_its_own_record():
    """`scontrol --json show job 1234_3` dumps array 1234 whole, its head first (PENDING while tasks wait, else the
    last task to start): jobs[0] read the head's state for the task's, so a scancel of task 3 while the head ran was
    requeued, and a time limit while it waited was taken as requeued by Slurm. The task's own record is read (the
    ids as data_parser v0.0.40 writes them, {"set", "number"}); a JSON without it falls back to the text."""
    def rec(job_id, task, state):
        return {"job_id": job_id, "array_job_id": {"set": True, "number": 1234},
                "array_task_id": {"set": True, "number": task}, "job_state": [state], "state_reason": "None"}

    dump = json.dumps({"jobs": [rec(1234, 9, "RUNNING"), rec(1236, 2, "RUNNING"), rec(1237, 3, "CANCELLED")]})

    def ask(cmd, tries=3):
        return dump if cmd[:2] == ["scontrol", "--json"] else TEXT.format("COMPLETING", "None") \
            if cmd[0] == "scontrol" else None

    assert base_state("1234_3", ask=ask) == ("CANCELLED", "None")
    assert base_state("1237", ask=ask) == ("CANCELLED", "None")  # by its own job id too
    assert base_state("1234_5", ask=ask) == ("COMPLETING", "None")  # not in the dump: the text's


def test_the_state_read_ends_within_its_bound(monkeypatch):
    """A busy controller (each call fails after its MessageTimeout, 0.4 s here): the JSON twice, the text three times,
    accounting twice, with the pauses between, took ~50 s at MessageTimeout=10, past the KillWait of the batch shell's
    SIGTERM (its requeue never came). `within` bounds all of it: no call runs past it, none starts after it."""
    import subprocess
    import time

    import base.slurm_state as mod

    calls = []

    def run(cmd, timeout, **kw):
        calls.append(timeout)
        if timeout < 0.4:
            time.sleep(timeout)
            raise subprocess.TimeoutExpired(cmd, timeout)
        time.sleep(0.4)
        return subprocess.CompletedProcess(cmd, 1, "", "slurm_load_jobs error: Socket timed out on send/recv operation")

    monkeypatch.setattr(mod.subprocess, "run", run)
    t0 = time.monotonic()
    assert base_state("7", within=1.0) == ("", "")
    assert time.monotonic() - t0 < 1.3 and all(t <= 1.0 for t in calls), calls
