"""A Ctrl-C (SIGINT) is a stop with a kill window only where a launcher kills the ranks after it (the deepspeed launcher:
LOCAL_SIZE, torchrun: LOCAL_WORLD_SIZE, scripts/launch.sh: LAUNCH_EXIT_DIR). Under `python train.py` or `salloc` +
`srun python train.py` nothing kills after it: the stop keeps its full save. training/stage.py's real loop on the
simulated clock of test_stop_window.py (Llama-3-8B on 32 ranks: a 95 s save, which a 30 s window never fits). Before
the flag is installed (the start-up) a Ctrl-C is the user's stop: one line, exit 130 (training/job.py)."""

from __future__ import annotations

import os
import signal

import pytest

from tests.unit.training.test_stop_window import simulate
from training.checkpoint import tag_for
from training.preemption import PreemptionFlag

LAUNCHED = ("LOCAL_SIZE", "LOCAL_WORLD_SIZE", "LAUNCH_EXIT_DIR")  # what each launcher sets in its ranks' environment


def no_launcher(monkeypatch) -> None:
    for k in LAUNCHED:
        monkeypatch.delenv(k, raising=False)


def test_ctrl_c_without_a_launcher_keeps_the_full_save(monkeypatch):
    """It was taken for a launcher's SIGINT (SIGKILL 30 s later): the stop's own 95 s save skipped, exit 75 with up to
    a save interval lost, though no kill ever came."""
    no_launcher(monkeypatch)
    clock, ckpt, flag, state, _ = simulate(monkeypatch, save_every_s=600, signal_at=(7, 50.0), sig=signal.SIGINT)
    assert flag.stopping and flag.window_left_s is None
    assert [(s, kind) for s, _, kind in ckpt.started] == [(6, "background"), (7, "sync")]
    assert [c[0] for c in ckpt.commits] == [6, 7] and state.checkpoint.endswith(tag_for(7))


@pytest.mark.parametrize("launcher", LAUNCHED)
def test_ctrl_c_under_a_launcher_stops_in_its_kill_window(monkeypatch, launcher):
    """The launcher got the terminal's SIGINT too and SIGKILLs the ranks 30 s later: no save started that cannot
    finish there, as for a SIGTERM."""
    no_launcher(monkeypatch)
    monkeypatch.setenv(launcher, "/tmp/x" if launcher == "LAUNCH_EXIT_DIR" else "8")
    clock, ckpt, flag, state, term = simulate(monkeypatch, save_every_s=600, signal_at=(7, 50.0), sig=signal.SIGINT)
    assert flag.window_left_s is not None and clock.t <= term + 30.0
    assert [kind for _, _, kind in ckpt.started] == ["background"]


def test_sigterm_has_its_window_without_a_launcher_too(monkeypatch):
    """srun's termination sequence (a second Ctrl-C within a second) and Slurm's own end send SIGTERM, then SIGKILL:
    the window starts at the SIGTERM, not at the Ctrl-C before it."""
    no_launcher(monkeypatch)
    flag = PreemptionFlag()
    flag._handler(signal.SIGINT, None)
    assert flag.term_at is None and flag.received == signal.SIGINT
    flag._handler(signal.SIGTERM, None)
    assert flag.term_at is not None


def test_ctrl_c_during_the_start_up_is_a_users_stop(tmp_path, monkeypatch, capsys):
    """A Ctrl-C before PreemptionFlag.install() (the model and data loading: minutes at 8B / 1M) was a
    KeyboardInterrupt traceback, "rank 0 failed", exit 1 and a crash record (under srun/launch.sh: a node requeued
    without it). Now one line, exit 130, recorded as 130 where launch.sh reads it, no crash record."""
    from training.job import run_job

    (tmp_path / "exits").mkdir()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LAUNCH_EXIT_DIR", str(tmp_path / "exits"))
    monkeypatch.setenv("LAUNCH_CRASH_FILE", str(tmp_path / "crash.0"))

    def main() -> int:
        os.kill(os.getpid(), signal.SIGINT)  # the terminal's Ctrl-C while rank 0 loads
        return 0

    # Python's KeyboardInterrupt handler, as a terminal starts it (a test run in the background ignores SIGINT)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert run_job(main) == 130
    finally:
        signal.signal(signal.SIGINT, previous)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Ctrl-C" in err and "Traceback" not in err and "failed" not in err, err
    assert (tmp_path / "exits" / "rank0").read_text() == "130\n" and not (tmp_path / "crash.0").exists()


@pytest.mark.parametrize("launcher", LAUNCHED)
def test_a_hang_up_is_a_stop_with_its_full_save(monkeypatch, launcher):
    """The terminal of a plain `deepspeed` run closed: its whole process group gets SIGHUP, whose default action
    killed the ranks unsaved. Now a stop with its full save: deepspeed's launch.py dies of it and kills nothing (no
    window to fit)."""
    no_launcher(monkeypatch)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv(launcher, "/tmp/x" if launcher == "LAUNCH_EXIT_DIR" else "8")
    clock, ckpt, flag, state, _ = simulate(monkeypatch, save_every_s=600, signal_at=(7, 50.0), sig=signal.SIGHUP)
    assert flag.stopping and flag.received == signal.SIGHUP and flag.window_left_s is None
    assert [(s, kind) for s, _, kind in ckpt.started] == [(6, "background"), (7, "sync")]


def test_a_hang_up_under_torchrun_stops_in_its_window(monkeypatch):
    """torchrun's agent catches the HUP, sends it to its workers (os.killpg: they run in sessions of their own, no
    SIGTERM follows) and SIGKILLs them shutdown_timeout (30 s) later: the full save was killed mid-write (a review)."""
    no_launcher(monkeypatch)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    clock, ckpt, flag, state, term = simulate(monkeypatch, save_every_s=600, signal_at=(7, 50.0), sig=signal.SIGHUP)
    assert flag.window_left_s is not None and clock.t <= term + 30.0
    assert [kind for _, _, kind in ckpt.started] == ["background"]


def test_a_hang_up_nohup_ignores_stays_ignored(monkeypatch):
    """`nohup deepspeed train.py ... &`: the run must outlive the terminal. Installing a handler for every signal
    would have replaced nohup's SIG_IGN, and the logout stopped the run."""
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        flag = PreemptionFlag().install()
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN and flag.received is None
        flag.uninstall()
    finally:
        signal.signal(signal.SIGHUP, previous)


@pytest.mark.parametrize("received, line", [(signal.SIGUSR1, "SIGUSR1: a save request"), (signal.SIGHUP, "SIGHUP: the "
                                            "terminal closed"), ("time limit", "time limit"), (None, "on another rank")])
def test_the_last_line_names_what_stopped_the_run(received, line):
    """It printed "preempted (10)": a signal's number, after a Ctrl-C or a `kill` the user could not read."""
    from training.preemption import said

    assert said(received).startswith(line)
