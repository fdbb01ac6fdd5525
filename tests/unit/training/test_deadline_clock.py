"""training/preemption.py: the time limit is decided on one clock, rank 0's (a node whose clock runs ahead used to
stop every run at start, never named), and rank 0 reads the job's end time from slurmctld again (a time-limit update
or a suspend moves it; SLURM_JOB_END_TIME is read once)."""

from __future__ import annotations

import os
import time

import torch

from training import preemption
from training.preemption import Deadline, PreemptionFlag


def votes_of(rank: int, monkeypatch) -> list[float]:
    seen: list[list[float]] = []
    monkeypatch.setattr(preemption.comm, "rank", lambda group=None: rank)
    monkeypatch.setattr(preemption.comm, "all_reduce",
                        lambda values, op="sum", group=None: seen.append(list(values)) or torch.tensor(values))
    flag = PreemptionFlag(deadline=Deadline(time_limit_s=10.0))  # 10 s left: near on any rank's own clock
    flag.agreed()
    return seen[0]


def test_only_rank_0_votes_for_the_time_limit(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_END_TIME", raising=False)
    assert votes_of(0, monkeypatch)[0] == 1.0
    assert votes_of(3, monkeypatch)[0] == 0.0  # its own clock says near: not its decision


def test_rank_0_reads_the_jobs_end_time_again(tmp_path, monkeypatch):
    later = time.localtime(time.time() + 7200)
    fake = tmp_path / "scontrol"
    fake.write_text(f"#!/bin/sh\necho 'JobId=9 JobState=RUNNING'\necho '   StartTime=2026-01-01T00:00:00 "
                    f"EndTime={time.strftime('%Y-%m-%dT%H:%M:%S', later)} Deadline=N/A'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "9")
    monkeypatch.setenv("SLURM_JOB_END_TIME", str(int(time.time()) + 60))  # the limit at start: 1 min left
    d = Deadline()
    assert d.near()
    d.refresh_from_slurm(every_s=3600)
    deadline = time.time() + 10
    while d.end < time.time() + 3600 and time.time() < deadline:
        time.sleep(0.05)
    assert abs(d.end - time.mktime(later)) < 1 and not d.near()  # `scontrol update TimeLimit=` gave it 2 h
