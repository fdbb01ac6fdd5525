"""scripts/launch.sh's crash verdict (LAUNCH_CRASH_FILE, read by slurm.sbatch) for a rank that died of a signal
without an exit of its own, under a stand-in deepspeed launcher that records the ranks' exits as train.py does
(LAUNCH_EXIT_DIR/rankR) and exits as deepspeed's launch.py does (256 - N for a rank dead of signal N). The batch
shell's side: test_sbatch.py::test_a_node_whose_rank_died_silently_is_the_crashs_origin_not_the_node_that_raised."""

from __future__ import annotations

import signal
import subprocess
import time

import pytest

from tests.e2e.launchers import LAUNCH, clean_env, launch, wait_for

STAND_IN = """#!/usr/bin/env bash
for r in ${VERDICT_RECORDS:-}; do echo "${r#*:}" > "$LAUNCH_EXIT_DIR/rank${r%%:*}"; done
[ -n "${VERDICT_GO:-}" ] && { : > "$VERDICT_GO.ready"; while [ ! -f "$VERDICT_GO" ]; do sleep 0.05; done; }
exit "$VERDICT_EXIT"
"""


def stand_in(tmp_path) -> str:
    path = tmp_path / "deepspeed"
    path.write_text(STAND_IN)
    path.chmod(0o755)
    return str(path)


@pytest.mark.parametrize("code, records, verdict", [
    ("247", "", "died"),         # SIGKILL (256 - 9): the host's OOM killer, no record of that rank
    ("245", "0:1", "died"),      # SIGSEGV (256 - 11) of rank 1; rank 0 raised after it ("connection reset")
    ("137", "", "died"),         # the launcher itself SIGKILLed (128 + 9)
    ("250", "", None),           # SIGABRT: NCCL's watchdog tears a healthy rank down when its peer vanished
    ("247", "0:1 1:1", "first"),  # every rank recorded its own exit: a rank raised (one node: `first`)
    ("1", "0:1", "first"),       # a plain crash, as before
])
def test_a_rank_dead_of_a_signal_without_an_exit_of_its_own_is_died(tmp_path, code, records, verdict):
    """A rank SIGKILLed by the host's OOM killer or a segfault records nothing; on several nodes a healthy node's rank
    raised first (its peer gone) and was taken for the crash's origin. The dead rank's node now says `died`, which the
    batch shell puts ahead of any `first`. Before, nothing was written there (no rank raised)."""
    crash = tmp_path / "crash.0"
    p = launch(["--num_gpus", "2", "--", "--x"], tmp_path, DEEPSPEED=stand_in(tmp_path), LAUNCH_CRASH_FILE=str(crash),
               VERDICT_EXIT=code, VERDICT_RECORDS=records)
    assert p.returncode == int(code), p.stderr
    assert (crash.read_text().strip() if crash.exists() else None) == verdict, p.stderr


def test_a_launcher_stopped_by_a_signal_is_not_died(tmp_path):
    """Slurm's SIGTERM to the step (srun ending it after another node's failure) reaches launch.sh too: a rank then
    killed on its way out is no death of this node's own."""
    crash, go = tmp_path / "crash.0", tmp_path / "go"
    p = subprocess.Popen([LAUNCH, "--num_gpus", "2", "--", "--x"], cwd=tmp_path, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True,
                         env=clean_env(DEEPSPEED=stand_in(tmp_path), LAUNCH_CRASH_FILE=str(crash), VERDICT_EXIT="247",
                                       VERDICT_GO=str(go)))
    try:
        wait_for(lambda: (tmp_path / "go.ready").exists(), 30, "the stand-in launcher")
        p.send_signal(signal.SIGTERM)
        time.sleep(0.5)  # its trap has run
        go.write_text("")
        text = p.communicate(timeout=30)[0]
    finally:
        p.kill()
    assert p.returncode == 247 and "got SIGTERM" in text, text
    assert not crash.exists(), text
