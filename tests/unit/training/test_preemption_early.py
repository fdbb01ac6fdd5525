"""A save request (SIGUSR1/SIGUSR2) during a rank's start-up is kept, in every launch mode. ssh (launch.sh -H: pdsh)
and slurmstepd (`srun python train.py`, `scancel --signal=USR1` without --batch) start each rank with SIGUSR1's
default action, terminate, and train.py installed its handler only after the process group, the resume lookup and the
data (minutes at scale): a request then killed every rank (exit 246, no save, no 75). Now run_job records it from its
first line and PreemptionFlag.install() takes it as received: the same flag, the same agreed stop at the first check.
One process; a sentinel handler stands in for the default action (which would end pytest)."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from training import job, preemption
from training.preemption import PreemptionFlag

USR = (signal.SIGUSR1, signal.SIGUSR2)


@pytest.fixture
def handlers():
    """The sentinel in place of the default action; this process' own handlers back afterwards."""
    before = {s: signal.getsignal(s) for s in USR}
    died: list[int] = []
    for s in USR:
        signal.signal(s, lambda signum, frame: died.append(signum))
    getattr(job, "early_signals", list)()  # nothing left over from another test
    yield died
    for s, h in before.items():
        signal.signal(s, h)
    getattr(job, "early_signals", list)()


@pytest.mark.parametrize("sig", USR, ids=["USR1", "USR2"])
def test_a_save_request_during_start_up_is_a_stop_at_the_first_check(monkeypatch, handlers, sig):
    monkeypatch.setenv("RANK", "0")  # a world of one: run_job leaves the environment alone
    monkeypatch.delenv("LAUNCH_EXIT_DIR", raising=False)
    monkeypatch.setattr(preemption.comm, "rank", lambda group=None: 0)
    monkeypatch.setattr(preemption.comm, "all_reduce", lambda values, op="sum", group=None: torch.tensor(values))
    seen = {}

    def main() -> int:
        os.kill(os.getpid(), sig)  # while the rank starts: before the flag exists
        flag = PreemptionFlag().install()  # train.py's stop_flag, minutes later
        try:
            seen.update(received=flag.received, stopping=flag.agreed(), window=flag.window_left_s)
        finally:
            flag.uninstall()
        return job.EXIT_PREEMPTED if flag.stopping else job.EXIT_OK

    assert job.run_job(main) == job.EXIT_PREEMPTED
    assert handlers == []  # the default action's stand-in never ran: the rank would have died of it
    assert seen == {"received": sig, "stopping": True, "window": None}  # a full save: no kill window


def test_a_recorded_request_is_taken_once(handlers):
    job.record_early_signals()
    os.kill(os.getpid(), signal.SIGUSR1)
    first = PreemptionFlag().install()
    first.uninstall()
    second = PreemptionFlag().install()  # a flag of a later stage or test: nothing left to take
    second.uninstall()
    assert (first.received, second.received, handlers) == (signal.SIGUSR1, None, [])


def test_a_segfaults_traceback_is_recorded_where_launch_sh_reads_how_a_rank_ended(tmp_path):
    """A rank dead of SIGSEGV left no trace launch.sh could read once srun's TERM had killed the deepspeed runner
    (143: launch.py's 256 - 11 never came): its fault record now says how it ended (scripts/launch_crash.sh: `died`)."""
    import subprocess
    import sys

    code = "from training.job import record_faults; record_faults(); import ctypes; ctypes.string_at(0)"
    env = {**os.environ, "LAUNCH_EXIT_DIR": str(tmp_path), "RANK": "5"}
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == -11, p.stderr
    assert (tmp_path / "fault5").read_text().startswith("Fatal Python error: Segmentation fault")


def test_a_job_without_saves_keeps_the_signals_default(monkeypatch):
    """scripts/evaluate.py goes through run_job too but installs no PreemptionFlag: its USR1/USR2 were recorded and
    never taken (a `scancel --signal=USR2` ignored for the whole evaluation). Now they keep their default there."""
    seen = {}
    monkeypatch.setattr(job, "record_early_signals", lambda: seen.setdefault("recorded", True))
    monkeypatch.setattr(job, "record_faults", lambda: None)
    job.run_job(lambda: 0, saves=False)
    assert "recorded" not in seen
    job.run_job(lambda: 0)
    assert seen.get("recorded")


def test_a_failure_after_the_ranks_sigterm_is_no_crash_of_its_node(tmp_path, monkeypatch, capsys):
    """A GraceTime preemption during a long step: launch.py SIGKILLs a rank still in its step 30 s after the TERM, its
    peers' collective breaks and they raise: each wrote `first` / `own`, which the batch shell takes over PreemptTime
    (the job failed, or was requeued without a healthy node). A failure after this rank's SIGTERM writes none; one
    before it still does."""
    crash = tmp_path / "crash.0"
    monkeypatch.setenv("LAUNCH_CRASH_FILE", str(crash))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(preemption, "WINDOWED_AT", [])
    assert job._fail(RuntimeError("Connection closed by peer")) == 1
    assert crash.read_text().strip() == "first"
    crash.unlink()
    monkeypatch.setattr(preemption, "WINDOWED_AT", [123.0])
    assert job._fail(RuntimeError("Connection closed by peer")) == 1
    assert not crash.exists()
    capsys.readouterr()
