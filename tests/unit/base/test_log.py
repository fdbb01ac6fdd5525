"""base/log.py's print0 when the console is gone: a closed terminal or ssh session (its pty hung up: EIO) or a
`| tee` that died with it (EPIPE). Rank 0's next print0 raised: the job exited 1 with a traceback in the rank log
instead of going on to its save (a hang-up is a save request to scripts/launch.sh)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), *[os.pardir] * 3))

# a rank 0 with its rank log, printing to a console that is gone, then exiting 75 as after a save
CHILD = """
import logging, sys
from base import log
h = logging.FileHandler(sys.argv[1])
log._RANK_LOG.addHandler(h); log._RANK_LOG.setLevel(logging.INFO); log._RANK_LOG.propagate = False
log.print0("step 1")
log.print0("step 2")
print("a library's own print")
log.print0("saved", file=sys.stderr)
sys.exit(75)
"""


# the step lines of a run without a terminal (training/metrics.py: `2>&1 | tee log`), first to meet the dead pipe
STEP_FIRST = """
import sys
from base import log
log.say("step 1/10 loss 2.0 stage eta 1h02m")
log.say("step 2/10 loss 1.9 stage eta 1h01m")
sys.exit(75)
"""


def test_a_step_line_to_a_gone_console_is_not_the_ranks_end():
    """training/metrics.py printed its step lines with a bare print: under `... 2>&1 | tee log` with the tee gone
    (Ctrl-C or a hang-up), the next step line raised BrokenPipeError: exit 1, no save (a review of console_gone)."""
    read, out = os.pipe()
    os.close(read)
    try:
        p = subprocess.run([sys.executable, "-c", STEP_FIRST], cwd=ROOT, stdout=out, stderr=out, timeout=30,
                           env={**os.environ, "RANK": "0", "PYTHONPATH": ROOT})
    finally:
        os.close(out)
    assert p.returncode == 75


@pytest.mark.parametrize("console", ["pty", "pipe"])
def test_a_gone_console_stops_the_console_output_not_the_rank(tmp_path, console):
    if console == "pty":  # the terminal's master closed: the ssh session is gone, the pty hung up
        master, slave = os.openpty()
        os.close(master)
        out = slave
    else:  # the reader of a pipe gone (`launch.sh ... | tee run.log`, tee hung up with the session)
        read, out = os.pipe()
        os.close(read)
    log = tmp_path / "rank00000.log"
    try:
        p = subprocess.run([sys.executable, "-c", CHILD, str(log)], cwd=ROOT, stdout=out, stderr=out, timeout=30,
                           env={**os.environ, "RANK": "0", "PYTHONPATH": ROOT})
    finally:
        os.close(out)
    text = log.read_text()
    assert p.returncode == 75, text  # not 1 (the OSError of print0, of the plain print, or of the flush at exit)
    assert "console gone" in text and "Traceback" not in text, text
    assert [ln for ln in text.splitlines() if not ln.startswith("console gone")] == ["step 1", "step 2", "saved"], text


def test_a_write_error_that_is_not_a_gone_console_is_raised(monkeypatch):
    """(Not a full disk's: a console file on one is a gone console since a73, test_disk_full_writers.py.)"""
    from base import log

    class Full:
        def write(self, s):
            raise OSError(9, "Bad file descriptor")

        def flush(self):
            pass

    monkeypatch.setattr(log, "_IS_MAIN", True)
    with pytest.raises(OSError, match="Bad file descriptor"):
        log.print0("x", file=Full())


@pytest.mark.parametrize("foreign", ["logs", "logs/rank00003.log"])
def test_a_logs_folder_another_user_wrote_is_refused_in_one_line(tmp_path, monkeypatch, foreign):
    """A requeue in a root container left OUTPUT_DIR/logs (or a rank's log) root's: open_rank_log raised PermissionError,
    a traceback and exit 1 (a bug to slurm.sbatch). Now one line naming the folder and the fix, before any work (an
    input error: exit 2). os.access is faked: root writes through any mode."""
    from base.log import open_rank_log
    from training.job import _is_input_error

    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "rank00003.log").write_text("root's start\n")
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: str(p) != str(tmp_path / foreign) and real(p, mode))
    with pytest.raises(ValueError, match=rf"--output_dir {tmp_path}: this user \(uid \d+\) cannot write "
                                         rf"{tmp_path}/logs.* \(Permission denied; .*chown -R") as e:
        open_rank_log(str(tmp_path), 3)
    assert "\n" not in str(e.value) and _is_input_error(e.value)
