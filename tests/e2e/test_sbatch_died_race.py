"""The OOM race through the whole chain as a cluster runs it: scripts/slurm.sbatch under the stand-ins of sbatch, srun
(--kill-on-bad-exit: SIGTERM to every process of the other tasks, SIGKILL SRUN_KILL_WAIT later) and scontrol, the real
scripts/launch.sh on each of 2 nodes (node 0 hosting the job's store, base/node_store.py), and a stand-in deepspeed
launcher as deepspeed's behaves (runner.py, launch.py, the ranks). Its parts, alone: test_launch_verdict.py (launch.sh's
`died`), test_sbatch.py (the batch shell's side). ~12 s (two torch imports for node 0's store, srun's KillWait of 3 s).
Node 1's launch.sh sees its runner dead of srun's TERM (143) at once, never launch.py's 247 (that comes ~30 s after the
TERM: launch.py waits again for the saving rank): only the task cgroup's OOM count (LAUNCH_CGROUP stands in for it,
one folder a node) tells it, and only because the rank was gone before that TERM. On launch.sh before that evidence
(and on e080d0d's, which read the launcher's code) node 0's `first` stood and the healthy node 0 was excluded.
Each node's task cgroup sits in its job's, which holds the job's memory limit (`sbatch --mem`: memory.max): a kill at
that limit (its `oom` count grows with the task's `oom_kill`) is `memlimit`, the job stopped naming it; a host-wide OOM
(the task's `oom_kill` alone) is the node's `died`."""

from __future__ import annotations

import os
import socket
import subprocess

import pytest

from tests.e2e.launchers import LAUNCH, SBATCH_SCRIPT, STUBS, clean_env, requeues

# The launch.sh under test (RACE_LAUNCH_SH: another copy, e.g. an older one beside a checkout's .venv)
LAUNCH_SH = os.environ.get("RACE_LAUNCH_SH", LAUNCH)

# deepspeed's runner.py under --no_ssh: it installs no SIGTERM handler (only for pdsh over several nodes), so srun's
# TERM to every process of the task ends it (143 to launch.sh); else it exits with launch.py's code when > 0.
RUNNER = """#!/usr/bin/env bash
node=0
while [ $# -gt 0 ]; do [ "$1" = --node_rank ] && node=$2; shift; done
"$RACE_DIR/launch" "$node" &
wait $!
rc=$?
[ "$rc" -gt 0 ] && exit "$rc"
exit 0
"""
# deepspeed's launch.py: the node's 2 ranks; once one fails, terminate_process_tree: TERM to the others, up to 30 s
# for them, SIGKILL, exit with the failed rank's code (256 - N for a signal N). Its own TERM (srun's) runs that again,
# nested. Waits are read timeouts on a fifo: no child but the ranks (what launch.sh's rank_pids lists).
LAUNCHPY = """#!/usr/bin/env bash
node=$1 code=1
exec 9<> "$RACE_DIR/fifo"
"$RACE_DIR/rank" "$node" 0 & a=$!
"$RACE_DIR/rank" "$node" 1 & b=$!
stop() {
  kill -TERM $a $b 2>/dev/null
  for ((i = 0; i < 300; i++)); do kill -0 $a 2>/dev/null || kill -0 $b 2>/dev/null || break; read -t 0.1 -u 9; done
  kill -9 $a $b 2>/dev/null
  exit $code
}
trap stop TERM
wait -n $a $b
rc=$?
if [ "$rc" -gt 128 ]; then code=$((384 - rc)); else code=$rc; fi
stop
"""
# The ranks. Node 1's local rank 0: the OOM killer's SIGKILL, 3 s in (launch.sh has seen it): the host's, or at its
# job's limit (RACE_MEMLIMIT: the job level's `oom` counts it too, as the kernel's hierarchical memory.events do). Node 0's local rank 0:
# its peer gone ("Connection reset by peer"), it raises 0.5 s later, as train.py does: its exit record, `first` (its
# failure the job's first on record, training/job.py). Node 1's local rank 1: saving, SIGTERM ignored, until Slurm's
# SIGKILL. Node 0's local rank 1: ended by its launcher's TERM.
RANK = """#!/usr/bin/env bash
node=$1 here=$2
exec 9<> "$RACE_DIR/fifo"
case $node/$here in
  1/0) read -t 3 -u 9; : > "$RACE_DIR/oom"
       [ -z "$RACE_MEMLIMIT" ] || printf 'max 9\\noom 1\\noom_kill 1\\n' > "$RACE_DIR/job1/memory.events"
       echo "oom_kill 1" > "$RACE_DIR/job1/task/memory.events"; kill -9 $$ ;;
  0/0) until [ -f "$RACE_DIR/oom" ]; do read -t 0.1 -u 9; done
       read -t 0.5 -u 9
       echo 1 > "$LAUNCH_EXIT_DIR/rank0"
       echo first > "$LAUNCH_CRASH_FILE"
       exit 1 ;;
  1/1) trap '' TERM; echo $$ > "$RACE_DIR/saver" ;;
esac
for ((i = 0; i < 60; i++)); do read -t 1 -u 9; done
"""


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


@pytest.mark.parametrize("children, memlimit", [("1", ""), ("", ""), ("", "1")],
                         ids=["signal_children", "slurm_default", "memlimit"])
def test_a_node_whose_rank_the_oom_killer_took_is_excluded_through_the_whole_chain(tmp_path, children, memlimit):
    """Node 1's rank is SIGKILLed (the host's OOM killer); node 0's rank, its peer gone, raises and writes `first`,
    and node 0's launch.sh exits 1 first (after its post to the job's store); srun then TERMs every process of node
    1's task (launch.sh, the deepspeed runner, launch.py, the saving rank: a cluster whose cgroup.conf has
    SignalChildrenProcesses=yes; under its default `no` the TERM reaches node 1's task alone, which passes it to
    launch.sh only), SIGKILL SRUN_KILL_WAIT later. The crash began on node 1: the job is requeued without node 1's host,
    never without node 0's (healthy). Under the default node 1's launch.sh, TERMed with a rank already gone and the
    OOM count up, writes `died` at once (it waited for its launcher, whose 30 s outlast KillWait: node 0 was excluded).
    Killed at its job's memory limit instead (`memlimit`): no node's fault, the next allocation has the same limit, so
    nothing is requeued nor excluded and one line names the limit and `sbatch --mem` (it was `died`: node 1 excluded,
    then a healthy replacement, then "the same failure twice", memory never named)."""
    race = tmp_path / "race"
    race.mkdir()
    os.mkfifo(race / "fifo")
    for name, text in (("deepspeed", RUNNER), ("launch", LAUNCHPY), ("rank", RANK)):
        (race / name).write_text(text)
        (race / name).chmod(0o755)
    out = tmp_path / "out"  # a checkpoint and a logged step: what a crash requeue records
    for n in (0, 1):  # each node's job cgroup (`sbatch --mem=64G`: Slurm's memory.max) and its task's, as the kernel keeps
        (race / f"job{n}" / "task").mkdir(parents=True)  # them: OOM counts (the rank's stand-in counts its kill)
        (race / f"job{n}" / "memory.max").write_text(f"{64 << 30}\n")
        (race / f"job{n}" / "task" / "memory.max").write_text("max\n")
        for level in (race / f"job{n}", race / f"job{n}" / "task"):
            (level / "memory.events").write_text("low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\n")
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "LATEST").write_text("step_000020")
    (out / "metrics.jsonl").write_text("".join(f'{{"step": {s}, "loss": 1.0}}\n' for s in range(1, 26)))
    env = clean_env(PATH=f"{STUBS}:{os.environ['PATH']}", SLURM_SUBMIT_DIR=str(tmp_path), TMPDIR=str(tmp_path),
                    SCONTROL_LOG=str(tmp_path / "scontrol.log"), LAUNCH_CMD=LAUNCH_SH, DEEPSPEED=str(race / "deepspeed"),
                    RACE_DIR=str(race), LAUNCH_CGROUP=str(race / "job%n" / "task"), GPUS_PER_NODE="2",
                    DS_ACCELERATOR="cpu", MASTER_PORT=free_port(), RACE_MEMLIMIT=memlimit,
                    SLURM_JOB_NUM_NODES="2", SLURM_JOB_NODELIST="127.0.0.1,localhost", SCONTROL_NODES="gpu[1-8]",
                    SRUN_KILL_WAIT="3",  # node 1's launch.sh has this long after srun's TERM (Slurm's KillWait: 30 s)
                    STATE_SETTLE_S="8", ULYSSES_START_WAIT_S="2",  # node 0's post waits this long for node 1's ranks
                    STUB_SIGNAL_CHILDREN=children)  # "1": srun's TERM to every process (SignalChildrenProcesses=yes)
    job = subprocess.Popen(["sbatch", SBATCH_SCRIPT, "--output_dir", str(out)], cwd=tmp_path, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        text = job.communicate(timeout=90)[0]
    finally:
        job.kill()
        if (race / "saver").exists():  # Slurm's SIGKILL ended it, unless the step never got that far
            subprocess.run(["kill", "-9", (race / "saver").read_text().strip()], stderr=subprocess.DEVNULL)
    assert "srun: error: 127.0.0.1: task 0: Exited with exit code 1" in text, text  # node 0 ended first
    if memlimit:
        assert job.returncode != 0, text
        assert requeues(tmp_path) == [], text  # no requeue, no ExcNodeList
        assert "crash verdict is 'memlimit'" in text and f"cgroup {race / 'job1'} (limit 64.0 GiB)" in text, text
        line = [ln for ln in text.splitlines() if "slurm.sbatch" in ln and "memory limit" in ln]
        assert len(line) == 1 and f"node(s) 1 (cgroup {race / 'job1'}, limit 64.0 GiB, on localhost)" in line[0], text
        assert "not requeueing" in line[0] and "raise sbatch --mem" in line[0] and "scripts/plan.py" in line[0], text
        return
    assert job.returncode == 0, text
    assert requeues(tmp_path) == ["requeue 4242", "update JobId=4242 ExcNodeList=localhost"], text  # node 1's host
    assert "this node's crash verdict is 'died'" in text, text  # node 1's launch.sh
    assert "node(s) 1: a rank died of a signal without an exit of its own; the failures of node(s) 0 followed it" \
           in text, text
