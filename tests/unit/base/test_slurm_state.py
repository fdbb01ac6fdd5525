"""base/slurm_state.py: a job's base state while it ends, which `scontrol show job` hides under COMPLETING (slurmctld
sets CANCELLED|COMPLETING before slurmd signals; job_state_string prints the flag first). What slurmctld, scontrol
and sacct answer is given as each prints it; no Slurm runs here."""

from __future__ import annotations

import json

import pytest

from base.slurm_state import base_state

TEXT = "JobId=7 JobName=x\n   JobState={} Reason={} Dependency=(null)\n"


def asker(json_state=None, text_state=None, reason="None", sacct=None):
    def ask(cmd, tries=3):
        if cmd[:2] == ["scontrol", "--json"]:
            return None if json_state is None else json.dumps(
                {"jobs": [{"job_id": 7, "job_state": json_state, "state_reason": reason}]})
        if cmd[0] == "scontrol":
            return None if text_state is None else TEXT.format(text_state, reason)
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
    assert base_state("7", ask=ask, env={}) == want


def test_the_end_time_reached_is_a_timeout_when_nothing_else_says():
    ask = asker(None, "COMPLETING")
    assert base_state("7", ask=ask, env={"SLURM_JOB_END_TIME": "1000"}, now=1000.5) == ("TIMEOUT", "None")
    assert base_state("7", ask=ask, env={"SLURM_JOB_END_TIME": "1000"}, now=900) == ("COMPLETING", "None")
