"""training/preemption.py: the time limit is decided on one clock, rank 0's (a node whose clock runs ahead used to
stop every run at start, never named), and rank 0 reads the job's end time from slurmctld again (a time-limit update
or a suspend moves it; SLURM_JOB_END_TIME is read once). Slurm < 23.02 sets no SLURM_JOB_END_TIME: rank 0 reads the end
from `scontrol show job`, for the stop and for a universal conversion's bound, and says so when there is none."""

from __future__ import annotations

import os
import pathlib
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
    later = int(time.time()) + 7200
    fake_scontrol(tmp_path, monkeypatch, later)
    monkeypatch.setenv("SLURM_JOB_END_TIME", str(int(time.time()) + 60))  # the limit at start: 1 min left
    d = Deadline()
    assert d.near()
    d.refresh_from_slurm(every_s=3600)
    deadline = time.time() + 10
    while d.end < time.time() + 3600 and time.time() < deadline:
        time.sleep(0.05)
    assert abs(d.end - later) < 1 and not d.near()  # `scontrol update TimeLimit=` gave it 2 h


def fake_scontrol(tmp_path, monkeypatch, end: float | None, end_file=None) -> str:
    """A `scontrol show job` as Slurm 22.05 prints it (EndTime=Unknown where `end` is None; with `end_file`, the
    EndTime that file holds now, no answer while it is empty), each call logged; the job under Slurm < 23.02:
    SLURM_JOB_ID set, no SLURM_JOB_END_TIME. Returns the call log's path."""
    shown = "Unknown" if end is None else time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(end))
    if end_file is not None:
        shown = f"$(cat {end_file})"
    calls = tmp_path / "calls"
    fake = tmp_path / "scontrol"
    fake.write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\n" + (f"[ -s {end_file} ] || exit 1\n" if end_file else "")
                    + f"echo 'JobId=9 JobState=RUNNING'\necho \"   StartTime=2026-01-01T00:00:00 EndTime={shown} Deadline=N/A\"\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "9")
    monkeypatch.delenv("SLURM_JOB_END_TIME", raising=False)
    return str(calls)


def test_before_slurm_23_02_rank_0_reads_the_end_from_scontrol(tmp_path, monkeypatch):
    """Slurm < 23.02 sets no SLURM_JOB_END_TIME: the deadline was None, so a 387 s step ran into the limit 60 s away
    (TIMEOUT, never requeued) and nothing said so. Rank 0 now reads EndTime from scontrol at its first check and keeps
    it current; another rank never asks (its vote is not the time limit's)."""
    end = time.time() + 60
    calls = fake_scontrol(tmp_path, monkeypatch, end)
    monkeypatch.setattr(preemption.comm, "all_reduce", lambda v, op="sum", group=None: torch.tensor(v))
    monkeypatch.setattr(preemption.comm, "rank", lambda group=None: 3)
    other = PreemptionFlag(deadline=Deadline())
    assert not other.agreed() and not os.path.exists(calls) and other.deadline.end is None
    monkeypatch.setattr(preemption.comm, "rank", lambda group=None: 0)
    flag = PreemptionFlag(deadline=Deadline())
    flag.deadline.record_step(387.0)
    assert flag.agreed() and flag.received == "time limit"
    assert abs(flag.deadline.end - int(end)) < 1 and flag.deadline._refreshing


def test_an_unknown_time_limit_is_said_in_one_line(tmp_path, monkeypatch, capsys):
    """A SLURM job whose end neither SLURM_JOB_END_TIME nor scontrol gives (EndTime=Unknown, no --time_limit_s): one
    line says no stop will come before the limit, once; with --time_limit_s that limit stands, nothing said."""
    fake_scontrol(tmp_path, monkeypatch, None)
    monkeypatch.setattr(preemption, "_UNKNOWN_SAID", set())
    for _ in range(2):
        assert Deadline().known() is None
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "SLURM job 9: the time limit is unknown" in out and "--time_limit_s" in out, out
    d = Deadline(time_limit_s=600.0, now=1000.0)
    assert d.known() == 1600.0 and capsys.readouterr().out == ""


def test_a_universal_conversion_is_bounded_before_slurm_23_02(tmp_path, monkeypatch, capsys):
    """The conversion's bound (training/universal.py) read Deadline.end, None without SLURM_JOB_END_TIME: a conversion
    was started 60 s before the job's end, killed there, redone on every requeue. It now takes scontrol's EndTime."""
    from tests.unit.training.test_checkpoint import LoadEngine, _exit_code, fake_converter, save_from_world
    from training.checkpoint import Checkpointer

    calls = fake_converter(monkeypatch)
    ck = Checkpointer(str(tmp_path / "run"), keep=3)
    path = save_from_world(ck, 4, world=2)
    fake_scontrol(tmp_path, monkeypatch, time.time() + 60)
    ck.deadline = Deadline()
    assert _exit_code(monkeypatch, lambda: ck.load(LoadEngine(), path)) == 75 and calls == []
    assert "requeue" in capsys.readouterr().err


def test_an_extension_since_the_threads_reading_is_read_before_the_stop(tmp_path, monkeypatch):
    """`scontrol update TimeLimit=+2:00:00` ~7 minutes before the old end of a 1M stage (a 300 s step, a 95 s save; 400 s left):
    slurmctld moves EndTime at once, rank 0's thread had read it seconds before (it reads every END_REFRESH_S), and
    the stale end voted "time limit": every rank saved, exited 75, requeued off its allocation. Rank 0 now reads the
    end again before it votes: no stop. An end scontrol confirms (or lowers), or one it cannot say, still stops."""
    end_file = tmp_path / "end"
    calls = pathlib.Path(fake_scontrol(tmp_path, monkeypatch, None, end_file=end_file))
    monkeypatch.setattr(preemption.comm, "rank", lambda group=None: 0)
    monkeypatch.setattr(preemption.comm, "all_reduce", lambda v, op="sum", group=None: torch.tensor(v))

    def shown(end: float) -> None:
        end_file.write_text(time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(end)))

    def flag(end: float) -> PreemptionFlag:
        monkeypatch.setenv("SLURM_JOB_END_TIME", str(int(end)))
        shown(end)
        f = PreemptionFlag(deadline=Deadline())
        f.deadline.record_step(300.0)
        f.deadline.record_save(95.0)
        return f

    old = time.time() + 400  # 425 s needed: near
    extended = flag(old)
    extended.deadline.refresh_from_slurm(every_s=3600)  # the thread's first reading: the old end
    deadline = time.time() + 10
    while not calls.exists() and time.time() < deadline:
        time.sleep(0.02)
    time.sleep(0.2)
    shown(old + 7200)  # scontrol update JobId=9 TimeLimit=+2:00:00
    assert not extended.agreed() and extended.received is None  # the next step's check: trains on
    assert abs(extended.deadline.end - int(old + 7200)) < 1 and not extended.deadline.near()
    confirmed = flag(old)
    assert confirmed.agreed() and confirmed.received == "time limit"
    lowered = flag(old)
    shown(old - 300)  # a limit lowered meanwhile: nearer still
    assert lowered.agreed() and abs(lowered.deadline.end - int(old - 300)) < 1
    unanswered = flag(old)
    end_file.write_text("")  # no answer: the end it had, a stop
    assert unanswered.agreed() and unanswered.received == "time limit"
