"""A GraceTime preemption during a long step through the whole chain: scripts/slurm.sbatch under the stand-ins of
sbatch, srun (--kill-on-bad-exit), scontrol and scancel, the real scripts/launch.sh on each of 2 nodes x 2 ranks (node
0 hosting the job's store, base/node_store.py), and stand-ins of deepspeed's runner.py, launch.py and the ranks as
train.py behaves. slurmctld TERMs every step process (cgroup.conf SignalChildrenProcesses=yes: STUB_SIGNAL_CHILDREN),
not the batch shell (`scontrol _grace`, PreemptTime set). The
ranks are in a 120-s step: the flag is looked at only at its end, so none leaves on its own. launch.py TERMs each
rank in turn, waits (30 s; LP_WAIT here), SIGKILLs it; the other ranks' collective breaks ("Connection closed by peer")
and they raise as training/job._fail does: the failure posted on the job's store (first wins), no crash record after
the rank's own SIGTERM (training/preemption.WINDOWED_AT), exit 1. Before 7f98f9c the job failed 143 (no requeue), or
was requeued without the healthy node 0 (GRACE_RAISE_NODES=0), of either alone: the ranks' crash records, or launch.sh's
crash_verdict (scripts/launch_crash.sh, without its `signalled$early` guard) from the failure on record. ~15 s (a torch import each for node
0's store and the 4 ranks' store clients).
GRACE_LAUNCH_SH: another launch.sh (a copy beside a checkout's .venv and scripts/launch_crash.sh, e.g. one before
7f98f9c). GRACE_RAISE_NODES="0": only node 0's ranks raise (node 1's are SIGKILLed in their step); ~20 s more (node
1's launch.sh gives node 0's store, gone, node_store.CONNECT_S to answer)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from tests.e2e.launchers import LAUNCH, SBATCH_SCRIPT, STUBS, clean_env, requeues, wait_for

LAUNCH_SH = os.environ.get("GRACE_LAUNCH_SH", LAUNCH)
RAISE_NODES = os.environ.get("GRACE_RAISE_NODES", "0 1")  # the nodes whose ranks raise when a peer is gone

# deepspeed's runner.py under --no_ssh: no SIGTERM handler (dies 143 of Slurm's TERM); else launch.py's code when > 0
# (a launch.py dead of a signal: its returncode < 0, 0)
RUNNER = r"""#!/usr/bin/env bash
node=0
while [ $# -gt 0 ]; do
  case "$1" in --node_rank) node=$2 ;; --master_addr) export MA=$2 ;; --master_port) export MP=$2 ;; esac; shift
done
"$RACE_DIR/launch" "$node" &
wait $!
rc=$?
[ "$rc" -gt 0 ] && [ "$rc" -lt 128 ] && exit "$rc"
exit 0
"""
# deepspeed's launch.py: polls its ranks; at the first non-zero exit, or its own SIGTERM, sigkill_handler:
# terminate_process_tree(rank) for each rank in turn (TERM the rank's tree, wait_procs(timeout=30), SIGKILL), then
# exit with the last code or 1. Waits are read timeouts on a fifo (no child but the ranks). The ranks start with
# USR1/USR2 handled (train.py takes them at its first line; bash cannot trap a signal ignored at its start).
LAUNCHPY = r"""#!/usr/bin/env bash
node=$1 last=""
exec 9<> "$RACE_DIR/fifo"
pids=()
for here in 0 1; do env --default-signal=USR1,USR2 "$RACE_DIR/rank" "$node" "$here" & pids+=($!); done
alive() { local s; { read -r s < "/proc/$1/stat"; } 2>/dev/null || return 1; s=${s##*) }; [ "${s%% *}" != Z ]; }
tree() { local p=$1 c; echo "$p"; for c in $(cat /proc/$p/task/*/children 2>/dev/null); do tree "$c"; done; }
stop() {
  local p t
  for p in "${pids[@]}"; do
    alive "$p" || continue
    t=$(tree "$p")
    kill -TERM $t 2>/dev/null
    for ((i = 0; i < LP_WAIT * 10; i++)); do alive "$p" || break; read -t 0.1 -u 9; done
    kill -9 $t 2>/dev/null
  done
  exit "${last:-1}"
}
trap stop TERM
while :; do
  left=0
  for p in "${pids[@]}"; do
    if alive "$p"; then left=1; continue; fi
    [ -f "$RACE_DIR/reaped.$p" ] && continue
    wait "$p"; rc=$?; : > "$RACE_DIR/reaped.$p"
    if [ "$rc" != 0 ]; then
      if [ "$rc" -gt 128 ]; then last=$((384 - rc)); else last=$rc; fi
      stop
    fi
  done
  [ "$left" = 0 ] && exit 0
  read -t 0.5 -u 9
done
"""
# A rank as train.py: USR1/USR2/TERM/INT only set a flag, looked at after each step (STEP_S); TERM/INT also mark the
# stop's window (WINDOWED_AT). A rank whose peer is gone mid-step raises as training/job._fail: posts "rank R failed"
# first-wins on the job's store (its client, helper.py), writes LAUNCH_CRASH_FILE (first/own, _crash_record) only
# when no TERM/INT came before, waits (comm.abort), records 1, exits 1.
RANK = r"""#!/usr/bin/env bash
node=$1 here=$2 R=$(($1 * 2 + $2))
exec 9<> "$RACE_DIR/fifo"
got="" windowed=0
trap 'got=${got:-USR1}' USR1
trap 'got=${got:-USR2}' USR2
trap 'got=${got:-TERM}; windowed=1' TERM
trap 'got=${got:-INT}; windowed=1' INT
echo $$ > "$RACE_DIR/pid.$R"
"$PY" "$RACE_DIR/helper.py" "$R" &
alive() { local s; { read -r s < "/proc/$1/stat"; } 2>/dev/null || return 1; s=${s##*) }; [ "${s%% *}" != Z ]; }
peer_gone() {
  local f p
  for f in "$RACE_DIR"/pid.*; do
    p=$(cat "$f"); [ "$p" = $$ ] && continue
    [ -f "$RACE_DIR/left.${f##*.}" ] && continue
    alive "$p" || return 0
  done
  return 1
}
raise() {
  : > "$RACE_DIR/go.$R"
  for ((i = 0; i < 100; i++)); do [ -s "$RACE_DIR/res.$R" ] && break; read -t 0.1 -u 9; done
  rec=$(cut -d' ' -f2- "$RACE_DIR/res.$R" 2>/dev/null)
  echo "rank $R: raised (peer gone mid-step, windowed=$windowed); on record: $rec" >&2
  if [ "$windowed" = 1 ]; then :
  elif [[ $rec == "rank $R failed:"* ]]; then echo first > "$LAUNCH_CRASH_FILE"
  else ( set -o noclobber; echo own > "$LAUNCH_CRASH_FILE" ) 2>/dev/null; fi
  read -t 1 -u 9
  echo 1 > "$LAUNCH_EXIT_DIR/rank$R"
  exit 1
}
for ((i = 0; i < 300; i++)); do [ "$(ls "$RACE_DIR"/pid.* 2>/dev/null | wc -l)" -ge 4 ] && break; read -t 0.1 -u 9; done
: > "$RACE_DIR/ready.$R"
while :; do
  for ((t = 0; t < STEP_S * 10; t++)); do
    read -t 0.1 -u 9
    [[ " $RAISE_NODES " == *" $node "* ]] && peer_gone && raise
  done
  if [ -n "$got" ]; then
    read -t 1 -u 9
    : > "$RACE_DIR/left.$R"
    echo 75 > "$LAUNCH_EXIT_DIR/rank$R"
    exit 75
  fi
done
"""
# The rank's store client: a forked helper that ignores the signals (as the rank's heartbeat process does) and dies
# with the rank; it posts the rank's failure on node 0's store when the rank raises.
HELPER = r"""
import ctypes, datetime, os, signal, sys, time
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
    signal.signal(s, signal.SIG_IGN)
ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)
parent, R, d = os.getppid(), sys.argv[1], os.environ["RACE_DIR"]
from base.comm import TCPStore
from base.watcher import key
open(f"{d}/client.{R}", "w").close()
while os.getppid() == parent and not os.path.exists(f"{d}/go.{R}"):
    time.sleep(0.05)
if os.getppid() != parent:
    sys.exit(0)
st = TCPStore(os.environ["MA"], int(os.environ["MP"]), is_master=False, wait_for_workers=False,
              timeout=datetime.timedelta(seconds=10))
got = st.compare_set(key("abort"), "", f"1 rank {R} failed: RuntimeError: Connection closed by peer")
got = got.decode() if isinstance(got, bytes) else str(got)
with open(f"{d}/res.{R}.tmp", "w") as fh:
    fh.write(got)
os.replace(f"{d}/res.{R}.tmp", f"{d}/res.{R}")
"""


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def leftovers(race) -> list[int]:
    """The processes this test started that are still there: every one carries RACE_DIR (its environment)."""
    mark = f"RACE_DIR={race}".encode()
    found = []
    for p in os.listdir("/proc"):
        try:
            with open(f"/proc/{p}/environ", "rb") as fh:
                if mark in fh.read().split(b"\0"):
                    found.append(int(p))
        except (OSError, ValueError):
            pass
    return found


def test_a_gracetime_preemption_during_a_long_step_is_requeued_without_excluding_a_node(tmp_path):
    """slurmctld TERMs the steps (GraceTime) while every rank is in a 120-s step; launch.py SIGKILLs a rank still in
    it, its peers raise. That teardown is no crash: the job is requeued plainly (no node excluded), as a preemption."""
    race = tmp_path / "race"
    race.mkdir()
    os.mkfifo(race / "fifo")
    for name, text in (("deepspeed", RUNNER), ("launch", LAUNCHPY), ("rank", RANK), ("helper.py", HELPER)):
        (race / name).write_text(text)
        (race / name).chmod(0o755)
    out = tmp_path / "out"  # a checkpoint and a logged step: what a crash requeue would record
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "LATEST").write_text("step_000020")
    (out / "metrics.jsonl").write_text("".join(f'{{"step": {s}, "loss": 1.0}}\n' for s in range(1, 26)))
    env = clean_env(PATH=f"{STUBS}:{os.environ['PATH']}", SLURM_SUBMIT_DIR=str(tmp_path), TMPDIR=str(tmp_path),
                    SCONTROL_LOG=str(tmp_path / "scontrol.log"), LAUNCH_CMD=LAUNCH_SH, DEEPSPEED=str(race / "deepspeed"),
                    RACE_DIR=str(race), PY=sys.executable, GPUS_PER_NODE="2", DS_ACCELERATOR="cpu",
                    MASTER_PORT=free_port(), SLURM_JOB_NUM_NODES="2", SLURM_JOB_NODELIST="127.0.0.1,localhost",
                    SCONTROL_NODES="gpu[1-8]", SRUN_KILL_WAIT="25", STATE_SETTLE_S="8", ULYSSES_START_WAIT_S="2",
                    LP_WAIT="4",  # launch.py's wait_procs(timeout=30) for each rank, scaled
                    STEP_S="120", RAISE_NODES=RAISE_NODES,  # a step of a 1M-token sequence: minutes
                    STUB_SIGNAL_CHILDREN="1")  # the steps' TERM to every process (SignalChildrenProcesses=yes)
    job = subprocess.Popen(["sbatch", SBATCH_SCRIPT, "--output_dir", str(out)], cwd=tmp_path, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # every rank in its step, and its store client up (torch imported)
        wait_for(lambda: job.poll() is not None or len([*race.glob("ready.*"), *race.glob("client.*")]) >= 8, 60,
                 "the ranks and their store clients")
        assert job.poll() is None, job.communicate()[0]
        time.sleep(0.5)
        # a preemption with GraceTime: PreemptTime set, SIGTERM to every step process, not the batch shell
        subprocess.run(["scontrol", "_grace", "4242"], env=clean_env(PATH=env["PATH"], SCONTROL_LOG=env["SCONTROL_LOG"],
                                                                     STUB_SIGNAL_CHILDREN="1"), check=True, timeout=30)
        text = job.communicate(timeout=90)[0]
    finally:
        job.kill()
        job.wait()
        for _ in range(5):  # a rank, launch.py or a store left by a failure; scontrol's end-of-job watcher (again:
            left = leftovers(race)  # a child forked meanwhile)
            for p in left:
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if not left:
                break
            time.sleep(0.1)
    assert "raised (peer gone mid-step, windowed=1)" in text, text  # the teardown happened (a rank SIGKILLed in its step)
    assert job.returncode == 0, text
    assert requeues(tmp_path) == ["requeue 4242"], text  # no ExcNodeList: no node crashed
    assert "PreemptTime set: a preemption (GraceTime), exit 143: scontrol requeue 4242" in text, text
