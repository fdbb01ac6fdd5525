"""scripts/launch.sh's crash verdict (LAUNCH_CRASH_FILE, read by slurm.sbatch) for a rank that died of a signal
without an exit of its own, under a stand-in deepspeed launcher that records the ranks' exits as train.py does
(LAUNCH_EXIT_DIR/rankR) and exits as deepspeed's launch.py does (256 - N for a rank dead of signal N). The batch
shell's side: test_sbatch_crash.py::test_a_node_whose_rank_died_silently_is_the_crashs_origin_not_the_node_that_raised."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from tests.e2e.launchers import LAUNCH, clean_env, launch, wait_for

STAND_IN = """#!/usr/bin/env bash
for r in ${VERDICT_RECORDS:-}; do echo "${r#*:}" > "$LAUNCH_EXIT_DIR/rank${r%%:*}"; done
for r in ${VERDICT_NOTES:-}; do echo "abort node 0: its ranks exited 247" > "$LAUNCH_EXIT_DIR/store$r"; done
[ -n "${VERDICT_SAY:-}" ] && echo "$VERDICT_SAY" >&2  # torchrun's summary of a failed worker
[ -n "${VERDICT_GO:-}" ] && { : > "$VERDICT_GO.ready"; while [ ! -f "$VERDICT_GO" ]; do sleep 0.05; done; }
exit "$VERDICT_EXIT"
"""


def stand_in(tmp_path) -> str:
    path = tmp_path / "deepspeed"
    path.write_text(STAND_IN)
    path.chmod(0o755)
    return str(path)


@pytest.mark.parametrize("code, records, notes, verdict", [
    ("247", "", "", "died"),         # SIGKILL (256 - 9): the host's OOM killer, no record of that rank
    ("245", "0:1", "", "died"),      # SIGSEGV (256 - 11) of rank 1; rank 0 raised after it ("connection reset")
    ("137", "", "", "died"),         # the launcher itself SIGKILLed (128 + 9)
    ("250", "", "", None),           # SIGABRT: NCCL's watchdog tears a healthy rank down when its peer vanished
    ("247", "0:1 1:1", "", "first"),  # every rank recorded its own exit: a rank raised (one node: `first`)
    ("1", "0:1", "", "first"),       # a plain crash, as before
    # every rank here stopped by the job's abort (base/watcher.py's note), whose code was a launcher's 247 (an OOM on
    # another node, posted by its launch.sh): that node's consequence, not a death here (it was `died`)
    ("247", "", "0 1", None),
    # a user's Ctrl-C at start-up (training/job.py: every rank it reached exits 130, no crash record): no crash of this
    # node's, whether every rank recorded it or one had not yet (it was `first`: a crash requeue without this node)
    ("130", "0:130 1:130", "", None),
    ("130", "0:130", "", None),
])
def test_a_rank_dead_of_a_signal_without_an_exit_of_its_own_is_died(tmp_path, code, records, notes, verdict):
    """A rank SIGKILLed by the host's OOM killer or a segfault records nothing; on several nodes a healthy node's rank
    raised first (its peer gone) and was taken for the crash's origin. The dead rank's node now says `died`, which the
    batch shell puts ahead of any `first`. Before, nothing was written there (no rank raised)."""
    crash = tmp_path / "crash.0"
    p = launch(["--num_gpus", "2", "--", "--x"], tmp_path, DEEPSPEED=stand_in(tmp_path), LAUNCH_CRASH_FILE=str(crash),
               VERDICT_EXIT=code, VERDICT_RECORDS=records, VERDICT_NOTES=notes)
    assert p.returncode == int(code), p.stderr
    assert (crash.read_text().strip() if crash.exists() else None) == verdict, p.stderr


LAUNCHERS = {"ds": [], "torchrun": ["--torchrun"], "node1": ["--no_ssh", "--nnodes", "2", "--node_rank", "1",
                                                             "--master_addr", "127.0.0.1"]}


@pytest.mark.parametrize("how, code, records, rc, verdict", [
    # rank 1 done (0), rank 0 SIGKILLed in its final export or W&B close (the OOM killer): 0 was passed on, a run
    # without COMPLETE (slurm.sbatch: failed, not requeued) and this node's 'died' (a requeue without it) lost
    ("ds", "247", "1:0", 247, "died"),
    ("ds", "143", "1:0", 143, None),  # every process TERMed, launch.py's SIGKILL of rank 0 30 s later
    ("torchrun", "1", "1:0", 1, "died"),  # torchrun's 1, its summary naming rank 0's -9
    ("ds", "143", "1:75", 143, None),  # a save's 75 is no more every rank's than a 0
    ("ds", "143", "0:0 1:0", 0, None),  # the launcher killed after every rank exited 0: done, as before
    ("node1", "143", "2:0 3:0", 0, None),  # --no_ssh node 1 of 2: its ranks are 2 and 3, every one recorded
])
def test_a_code_is_every_ranks_only_when_every_rank_here_recorded_it(tmp_path, how, code, records, rc, verdict):
    """launch.sh passes on the ranks' own code over a signalled launcher's only when every rank here recorded one;
    a rank that recorded nothing is named and the launcher's code (and the crash verdict) stands."""
    crash, runner = tmp_path / "crash.0", stand_in(tmp_path)
    p = launch([*LAUNCHERS[how], "--num_gpus", "2", "--", "--x"], tmp_path, DEEPSPEED=runner, TORCHRUN=runner,
               LAUNCH_CRASH_FILE=str(crash), VERDICT_EXIT=code, VERDICT_RECORDS=records,
               VERDICT_SAY="  exitcode  : -9 (pid: 1)" if how == "torchrun" else None)
    assert p.returncode == rc, p.stderr
    assert (crash.read_text().strip() if crash.exists() else None) == verdict, p.stderr
    assert ("rank 0 here recorded no exit" in p.stderr) == (rc != 0), p.stderr


# deepspeed's runner -> launch.py -> two ranks, as launch.sh's rank_pids finds them. Rank 1 dies (the OOM killer's
# SIGKILL, its task cgroup's oom_kill counted, or a segfault that faulthandler records in LAUNCH_EXIT_DIR/fault1) once
# launch.sh has had time to see both ranks, or only after the go file (Slurm's KillWait SIGKILL). The launcher waits
# for the go file, then exits RACE_CODE: launch.py's 256 - 9, or 143 (the runner dead of srun's TERM: it has no handler
# under --no_ssh). Rank 0 (TERMed: saving) outlives it, and launch.sh waits for it until Slurm's SIGKILL.
RACE = """#!/usr/bin/env bash
mkfifo "$VERDICT_GO.fifo"
bash -c '
  exec 9<> "$VERDICT_GO.fifo"  # waits below are read timeouts: no child but the ranks (what rank_pids lists)
  sleep 300 & r0=$!
  sleep 300 & r1=$!
  echo $r0 > "$VERDICT_GO.r0"
  die() {
    case $RACE_EVIDENCE in
      oom) echo "oom_kill 1" > "$LAUNCH_CGROUP/memory.events"; kill -9 $r1 ;;
      early_oom) kill -9 $r1 ;;  # the count grew long before (below): a compiler'"'"'s OOM, not this death
      fault) echo "Fatal Python error: Segmentation fault" > "$LAUNCH_EXIT_DIR/fault1"; kill -11 $r1 ;;
      *) kill -9 $r1 ;;
    esac
    wait $r1
  }
  [ "$RACE_EVIDENCE" = early_oom ] && echo "oom_kill 1" > "$LAUNCH_CGROUP/memory.events"
  read -t ${RACE_WAIT:-1.5} -u 9
  [ "$RACE_ORDER" = dead_first ] && die
  : > "$VERDICT_GO.ready"
  while [ ! -f "$VERDICT_GO" ]; do read -t 0.05 -u 9; done
  [ "$RACE_ORDER" = dead_first ] || die
  exit $RACE_CODE' &
wait $!
"""


@pytest.mark.parametrize("order, code, evidence, verdict", [
    ("dead_first", 247, "", "died"),  # launch.py's own code came before Slurm's SIGKILL
    ("dead_first", 143, "oom", "died"),  # the real race: the runner dead of srun's TERM, the cgroup's OOM count
    ("dead_first", 143, "fault", "died"),  # a segfault's faulthandler record
    ("dead_first", 143, "", None),  # nothing tells how it ended
    ("term_first", 143, "oom", None),  # Slurm's TERM first: an OOM on the way out is no death of this node's own
    ("dead_first", 143, "early_oom", None),  # an OOM kill before the window (read_ooms), which the ranks survived
])
def test_a_rank_gone_before_the_steps_sigterm_is_died_one_killed_after_it_is_not(tmp_path, order, code, evidence,
                                                                                verdict):
    """A rank OOM-killed on node B: a healthy node A's rank, its peer gone, raises and A's launcher exits first; srun
    then TERMs every process of B's task, while B's launch.py still waits for its other ranks: B's runner dies of that
    TERM (143), the rank's signal never reported. B's verdict was dropped for being signalled (the crash was then A's,
    a healthy node excluded, or none requeued): a rank here gone before the signal, with the task cgroup's OOM count
    grown or a fault record (or the launcher's code), is B's own death, written as the launcher returns (before the
    ranks' saves, which Slurm's SIGKILL cuts). A rank killed after the signal is not."""
    crash, go, cg = tmp_path / "crash.0", tmp_path / "go", tmp_path / "cg"
    cg.mkdir()
    (cg / "memory.events").write_text("low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\n")
    race = tmp_path / "deepspeed"
    race.write_text(RACE)
    race.chmod(0o755)
    p = subprocess.Popen([LAUNCH, "--num_gpus", "2", "--", "--x"], cwd=tmp_path, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True,
                         env=clean_env(DEEPSPEED=str(race), LAUNCH_CRASH_FILE=str(crash), VERDICT_GO=str(go),
                                       RACE_ORDER=order, RACE_CODE=str(code), RACE_EVIDENCE=evidence,
                                       RACE_WAIT="3" if evidence == "early_oom" else "1.5",
                                       # the OOM 3 s before the death: out of a 1 s window (30 s by default, a
                                       # killed rank's teardown: scripts/launch_crash.sh read_ooms)
                                       LAUNCH_OOM_WINDOW_S="1" if evidence == "early_oom" else "30",
                                       LAUNCH_CGROUP=str(cg)))
    try:
        wait_for(lambda: (tmp_path / "go.ready").exists(), 60, "the stand-in launcher")
        time.sleep(1.5)  # launch.sh's one-second poll has looked at the ranks since
        p.send_signal(signal.SIGTERM)
        time.sleep(0.5)  # its trap has run
        go.write_text("")
        # launch.sh now waits for rank 0 (saving) until Slurm's SIGKILL, KillWait after the TERM
        if verdict:
            wait_for(crash.exists, 15, "the crash verdict while the ranks here are still leaving")
        else:
            time.sleep(2.5)  # the launcher has returned and launch.sh has judged (a verdict would be there)
        p.kill()
        os.kill(int((tmp_path / "go.r0").read_text()), signal.SIGKILL)  # it holds launch.sh's output open
        text = p.communicate(timeout=60)[0]
    finally:
        p.kill()
        if (tmp_path / "go.r0").exists():
            subprocess.run(["kill", "-9", (tmp_path / "go.r0").read_text().strip()], stderr=subprocess.DEVNULL)
    assert "got SIGTERM" in text, text
    assert (crash.read_text().strip() if crash.exists() else None) == verdict, text



@pytest.mark.parametrize("code, records", [("247", ""), ("1", "0:1")])
def test_a_launcher_stopped_by_a_signal_is_not_died(tmp_path, code, records):
    """Slurm's SIGTERM to the step (srun ending it after another node's failure, a GraceTime preemption) reaches
    launch.sh too: a rank then killed on its way out is no death of this node's own, and a rank that raised since (its
    peer SIGKILLed by launch.py mid-step: a broken collective) no crash of its own (it was `first`: a preemption
    failed, or requeued without a healthy node)."""
    crash, go = tmp_path / "crash.0", tmp_path / "go"
    p = subprocess.Popen([LAUNCH, "--num_gpus", "2", "--", "--x"], cwd=tmp_path, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True,
                         env=clean_env(DEEPSPEED=stand_in(tmp_path), LAUNCH_CRASH_FILE=str(crash), VERDICT_EXIT=code,
                                       VERDICT_RECORDS=records, VERDICT_GO=str(go)))
    try:
        wait_for(lambda: (tmp_path / "go.ready").exists(), 30, "the stand-in launcher")
        p.send_signal(signal.SIGTERM)
        time.sleep(0.5)  # its trap has run
        go.write_text("")
        text = p.communicate(timeout=30)[0]
    finally:
        p.kill()
    assert p.returncode == int(code) and "got SIGTERM" in text, text
    assert not crash.exists(), text
