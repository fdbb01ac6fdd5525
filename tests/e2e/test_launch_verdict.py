"""scripts/launch.sh's crash verdict (LAUNCH_CRASH_FILE, read by slurm.sbatch) for a rank that died of a signal
without an exit of its own, under a stand-in deepspeed launcher that records the ranks' exits as train.py does
(LAUNCH_EXIT_DIR/rankR) and exits as deepspeed's launch.py does (256 - N for a rank dead of signal N). The batch
shell's side: test_sbatch.py::test_a_node_whose_rank_died_silently_is_the_crashs_origin_not_the_node_that_raised."""

from __future__ import annotations

import os
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


# deepspeed's runner -> launch.py -> two ranks, as launch.sh's rank_pids finds them. Rank 1 dies of SIGKILL (the OOM
# killer) once launch.sh has had time to see both ranks, or only after the go file (Slurm's KillWait SIGKILL); the
# launcher waits for the go file (launch.py giving the other rank 30 s), then exits 256 - 9 as launch.py does. In the
# race, rank 0 (TERMed: saving) outlives it, and launch.sh waits for it until Slurm's SIGKILL.
RACE = """#!/usr/bin/env bash
mkfifo "$VERDICT_GO.fifo"
bash -c '
  exec 9<> "$VERDICT_GO.fifo"  # waits below are read timeouts: no child but the ranks (what rank_pids lists)
  sleep 300 & r0=$!
  sleep 300 & r1=$!
  echo $r0 > "$VERDICT_GO.r0"
  read -t 3 -u 9
  if [ "$RACE_ORDER" = dead_first ]; then kill -9 $r1; wait $r1; fi
  : > "$VERDICT_GO.ready"
  while [ ! -f "$VERDICT_GO" ]; do read -t 0.05 -u 9; done
  [ "$RACE_ORDER" = dead_first ] && exit 247
  kill -9 $r1 $r0 2>/dev/null; wait
  exit 247' &
wait $!
"""


@pytest.mark.parametrize("order, verdict", [
    ("dead_first", "died"),   # the OOM kill, then srun's TERM after the healthy node exited first: the real race
    ("term_first", None),     # Slurm's TERM ending the step, then its SIGKILL: no death of this node's own
])
def test_a_rank_gone_before_the_steps_sigterm_is_died_one_killed_after_it_is_not(tmp_path, order, verdict):
    """A rank OOM-killed on node B: a healthy node A's rank, its peer gone, raises and A's launcher exits first; srun
    then TERMs every task, B's launch.sh included, while B's launcher still waits for its other ranks. B's verdict was
    dropped for being signalled (the crash was then A's, a healthy node excluded, or none requeued), and was written
    only after B's other ranks had left (they save on TERM), past Slurm's SIGKILL: a rank here gone before the signal
    reached this script is B's own death, written as the launcher returns. A rank killed after the signal is not."""
    crash, go = tmp_path / "crash.0", tmp_path / "go"
    race = tmp_path / "deepspeed"
    race.write_text(RACE)
    race.chmod(0o755)
    p = subprocess.Popen([LAUNCH, "--num_gpus", "2", "--", "--x"], cwd=tmp_path, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True,
                         env=clean_env(DEEPSPEED=str(race), LAUNCH_CRASH_FILE=str(crash), VERDICT_GO=str(go),
                                       RACE_ORDER=order))
    try:
        wait_for(lambda: (tmp_path / "go.ready").exists(), 60, "the stand-in launcher")
        time.sleep(2.5)  # launch.sh's one-second poll has looked at the ranks since
        p.send_signal(signal.SIGTERM)
        time.sleep(0.5)  # its trap has run
        go.write_text("")
        if verdict:  # launch.sh now waits for rank 0; Slurm's SIGKILL ends it KillWait after the TERM
            wait_for(crash.exists, 15, "the crash verdict while the ranks here are still leaving")
            p.kill()
            os.kill(int((tmp_path / "go.r0").read_text()), signal.SIGKILL)  # it holds launch.sh's output open
        text = p.communicate(timeout=60)[0]
    finally:
        p.kill()
        if verdict and (tmp_path / "go.r0").exists():
            subprocess.run(["kill", "-9", (tmp_path / "go.r0").read_text().strip()], stderr=subprocess.DEVNULL)
    assert "got SIGTERM" in text and (verdict or p.returncode == 247), text
    assert (crash.read_text().strip() if crash.exists() else None) == verdict, text


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
