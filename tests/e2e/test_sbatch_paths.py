"""scripts/slurm.sbatch where a path means another folder on another host: the job's records under a work dir that
only the batch host has (a site's `cd $TMPDIR && exec slurm.sbatch`, `sbatch -D /local/scratch`), and an --output_dir
that is a container's path (apptainer -B, pyxis --container-mounts) the batch shell does not see. Stub sbatch, srun
and scontrol from tests/stubs; a node's own view of a path is a stand-in srun that gives node 1's task another folder
for it (what a node-local disk at the same path is), no mount namespace needed."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.e2e.launchers import ROOT, SBATCH_SCRIPT, STUBS, clean_env, requeues

TWO_NODES = {"SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "n0,n1", "SCONTROL_NODES": "n0,n1,n2,n3"}
# srun's stand-in, wrapped: each node's task runs under VIEW, which on node 1 names VIEW_TO for every path under
# VIEW_FROM (that node's own disk at the work dir's path); VIEW_LATE=S: that folder shows up there S s late instead
# (a symlink to the real one: a shared file system's cache showing a new folder late)
SRUN = """#!/usr/bin/env bash
opts=()
while [ $# -gt 0 ] && [[ "$1" == -* ]]; do opts+=("$1"); shift; done
exec "$STUB_SRUN" "${opts[@]}" "$VIEW" "$@"
"""
VIEW = """#!/usr/bin/env bash
[ "${SLURM_NODEID:-0}" = 0 ] && exec "$@"
if [ -n "${VIEW_LATE:-}" ]; then (sleep "$VIEW_LATE"; mkdir -p "${VIEW_TO%/*}"; ln -s "$VIEW_FROM" "$VIEW_TO") </dev/null >/dev/null 2>&1 & fi
args=()
for a in "$@"; do args+=("${a//"$VIEW_FROM"/"$VIEW_TO"}"); done
export LAUNCH_LOST_FILE=${LAUNCH_LOST_FILE//"$VIEW_FROM"/"$VIEW_TO"}
exec "${args[@]}"
"""
# A container runtime's stand-in (`apptainer exec -B $REAL:/data img.sif scripts/launch.sh`): inside, --output_dir is
# $REAL. Each allocation trains 100 steps (commits checkpoints/LATEST) and saves at the warning (75); allocation
# $FINISH completes the run (COMPLETE, 0).
CONTAINER = """#!/usr/bin/env bash
mkdir -p "$REAL/checkpoints"
echo "global_step$(( (SLURM_RESTART_COUNT + 1) * 100 ))" > "$REAL/checkpoints/LATEST"
[ "${FINISH:-x}" = "$SLURM_RESTART_COUNT" ] && { echo done > "$REAL/COMPLETE"; exit 0; }
exit 75
"""


def script(path, text: str) -> str:
    path.write_text(text)
    path.chmod(0o755)
    return str(path)


def sbatch(tmp_path, work, args: list[str], launch: str | None = None, **env: str) -> tuple[int, str]:
    e = clean_env(PATH=f"{tmp_path / 'bin'}:{STUBS}:{os.environ['PATH']}", SLURM_SUBMIT_DIR=str(work),
                  PYTHONPATH=ROOT, SCONTROL_LOG=str(tmp_path / "scontrol.log"), FAKE_LOG=str(tmp_path / "fake.log"),
                  LAUNCH_CMD=launch or os.path.join(STUBS, "fake_launch"), **env)
    job = subprocess.run(["sbatch", SBATCH_SCRIPT, *args], cwd=work, env=e, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=90)
    return job.returncode, job.stdout


def node_views(tmp_path, **env: str) -> tuple:
    """The work dir and the environment in which node 1 sees its own folder at the work dir's records path."""
    work = tmp_path / "work"
    work.mkdir()
    (tmp_path / "bin").mkdir()
    script(tmp_path / "bin" / "srun", SRUN)
    view = {"STUB_SRUN": os.path.join(STUBS, "srun"), "VIEW": script(tmp_path / "view", VIEW),
            "VIEW_FROM": str(work / ".cache"), "VIEW_TO": str(tmp_path / "node1_disk" / ".cache")}
    return work, {**TWO_NODES, **view, "STATE_SETTLE_S": "2", **env}


@pytest.mark.parametrize("node0", ["sleep:20:1", "sleep:1:1"])  # node 0 fails after node 1's wait ends, or during it
def test_records_a_node_cannot_see_end_the_job_as_bad_input(tmp_path, node0):
    """The work dir on the batch host's own disk: node 1's records went nowhere (`2>/dev/null`), the batch shell saw
    node 0's alone and read a bug that crashed both nodes as node 0's own crash: requeued without the healthy node,
    at every allocation (the job's book, wiped with the folder, never tripped a bound). Now node 1's task says in one
    line that it cannot see the records and exits before its launcher (also when the step ends while it waits for the
    folder, STATE_SETTLE_S); the job ends as bad input (2), no requeue."""
    work, env = node_views(tmp_path)
    rc, text = sbatch(tmp_path, work, ["--output_dir", str(tmp_path / "out")], FAKE_EXIT_0=node0,
                      FAKE_CRASH_0="first", FAKE_EXIT_1="1", FAKE_CRASH_1="own", **env)
    assert rc == 2 and requeues(tmp_path) == [], text
    assert (f"{tmp_path}/node1_disk/.cache/slurm (the job's records, under the work dir {tmp_path}/node1_disk) is "
            "not visible on n1: submit from a folder every node mounts") in text, text
    assert f"node(s) 1 (n1) could not see {work}/.cache/slurm (the job's records, under the work dir {work}" in text
    assert "bad input (exit 2): not requeueing" in text and "crashed" not in text, text
    assert "node 1:" not in (tmp_path / "fake.log").read_text()  # its launcher never ran


def test_records_a_node_sees_late_are_no_refusal(tmp_path):
    """A shared file system showing the new records folder late on node 1 (a cache): its task waits for it
    (STATE_SETTLE_S) and runs; both save (75), the job is requeued as usual."""
    work, env = node_views(tmp_path, VIEW_LATE="1")
    rc, text = sbatch(tmp_path, work, ["--output_dir", str(tmp_path / "out")], FAKE_EXIT="75", **env)
    assert rc == 0 and requeues(tmp_path) == ["requeue 4242"], text
    assert "not visible" not in text and "training exited with 75" in text, text


def container_run(tmp_path, out: str, restarts: range, **env: str) -> list[tuple[int, str]]:
    """Allocations 0.. of a job whose launcher writes the run into $REAL (a container's bind of it at `out`)."""
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    launch = script(tmp_path / "container", CONTAINER)
    return [sbatch(tmp_path, work, ["--output_dir", out], launch=launch, SLURM_JOB_ID="88",
                   SLURM_RESTART_COUNT=str(r), REAL=str(tmp_path / "real"), **env) for r in restarts]


def test_an_output_dir_inside_a_container_is_unknown_here_not_a_stalled_or_failed_run(tmp_path):
    """--output_dir /data/run, the ranks' path of a bind mount: the batch shell found no checkpoints/LATEST there, a
    healthy run was stopped after 4 allocations as "no progress", and the finished run was failed for a missing
    COMPLETE. Now: unknown after the step (as with no --output_dir), said in one line naming OUTPUT_DIR."""
    runs = container_run(tmp_path, str(tmp_path / "container_only" / "run"), range(6), FINISH="5")
    assert [rc for rc, _ in runs] == [0] * 6, runs[-1][1]
    assert requeues(tmp_path) == ["requeue 88"] * 5, runs[4][1]
    assert "done" in runs[5][1] and (tmp_path / "real" / "COMPLETE").exists(), runs[5][1]
    assert (f"this shell does not see --output_dir {tmp_path}/container_only/run (a path inside a container?): set "
            "OUTPUT_DIR to its path on this host") in runs[0][1], runs[0][1]
    assert not (tmp_path / "container_only").exists()  # nothing made here at that path


def test_output_dir_names_the_runs_folder_on_this_host(tmp_path):
    """OUTPUT_DIR, the host's path of that folder, wins over --output_dir (the ranks'), as docs/launch.md said it did
    (--output_dir won): progress and COMPLETE are read there."""
    env = {"FINISH": "1", "OUTPUT_DIR": str(tmp_path / "real")}
    (rc, text), = container_run(tmp_path, "/data/run", range(1), **env)
    assert rc == 0 and requeues(tmp_path) == ["requeue 88"], text
    assert f"output dir {tmp_path}/real" in text and "does not see" not in text, text
    assert (tmp_path / "work" / ".cache" / "slurm" / "88.progress").read_text() == "0 100\n"  # its checkpoint read
    (rc, text), = container_run(tmp_path, "/data/run", range(1, 2), **env)
    assert rc == 0 and f"run complete ({tmp_path}/real/COMPLETE)" not in text and "done" in text, text


def test_an_exported_output_dir_never_wins_over_a_folder_this_shell_sees(tmp_path):
    """A review: OUTPUT_DIR (a wrapper's export, the parent of its runs) was made to win over --output_dir, so a
    finished run on a shared folder was failed for want of COMPLETE there. --output_dir wins where this shell sees it,
    judged again after the step (a fresh run's folder appears only then)."""
    work, runs = tmp_path / "work", tmp_path / "runs"
    for d in (work, tmp_path / "bin", runs):
        d.mkdir()
    out = runs / "lr1e-5"
    rc, text = sbatch(tmp_path, work, ["--output_dir", str(out)], launch=script(tmp_path / "c", CONTAINER),
                      SLURM_JOB_ID="88", SLURM_RESTART_COUNT="0", REAL=str(out), FINISH="0", OUTPUT_DIR=str(runs))
    assert rc == 0 and (out / "COMPLETE").exists() and "done" in text and "no " + str(runs) not in text, text


def test_a_work_dir_that_cannot_hold_the_records_trains_with_them_off(tmp_path):
    """A review: where the batch shell cannot make the records folder (a full quota, a read-only work dir: here
    .cache is a file) it said records were off, then every node waited for the folder and the job ended as bad
    input, never trained. The nodes no longer wait: it trains, as before."""
    work = tmp_path / "work"
    for d in (work, tmp_path / "bin"):
        d.mkdir()
    (work / ".cache").write_text("")
    out = tmp_path / "out"
    rc, text = sbatch(tmp_path, work, ["--output_dir", str(out)], launch=script(tmp_path / "c", CONTAINER),
                      SLURM_JOB_ID="88", SLURM_RESTART_COUNT="0", REAL=str(out), FINISH="0", STATE_SETTLE_S="2")
    assert rc == 0 and (out / "COMPLETE").exists() and "cannot write" in text and "bad input" not in text, text


@pytest.mark.parametrize("where", ["work dir", "submitted file's"])
def test_an_older_clone_is_passed_over_or_refused_in_one_line(tmp_path, where):
    """A review: the repository was the first folder holding scripts/slurm_requeue.sh, so a work dir holding an older
    clone (searched first; here: no slurm_run.sh nor slurm_node.sh, which slurm.sbatch sources since its split) or a
    checkout moved back died "unbound variable", exit 1, never requeued. Now a folder lacking any of the three is passed
    over for the submitted file's repository; where none has them all, refused in one line naming what is missing."""
    work, old = tmp_path / "work", tmp_path / ("work" if where == "work dir" else "old")
    for d in (tmp_path / "bin", old / "scripts"):
        d.mkdir(parents=True, exist_ok=True)
    (old / "scripts" / "slurm_requeue.sh").write_text(open(os.path.join(ROOT, "scripts", "slurm_requeue.sh")).read())
    submitted = SBATCH_SCRIPT
    if where != "work dir":  # a copy of slurm.sbatch in the older clone, submitted from an empty work dir
        submitted = old / "scripts" / "slurm.sbatch"
        submitted.write_text(open(SBATCH_SCRIPT).read())
        work.mkdir()
    e = clean_env(PATH=f"{STUBS}:{os.environ['PATH']}", SLURM_SUBMIT_DIR=str(work), SCONTROL_LOG=str(tmp_path / "s.log"),
                  FAKE_LOG=str(tmp_path / "fake.log"), FAKE_EXIT="0", FAKE_COMPLETE=str(work / "out" / "COMPLETE"),
                  LAUNCH_CMD=os.path.join(STUBS, "fake_launch"))
    p = subprocess.run(["sbatch", str(submitted), "--output_dir", "out"], cwd=work, env=e, capture_output=True,
                       text=True, timeout=90)
    if where == "work dir":
        assert p.returncode == 0 and "done" in p.stdout and "unbound" not in p.stderr, p.stdout + p.stderr
        return
    assert p.returncode == 2 and p.stdout.count("\n") == 1 and not (tmp_path / "fake.log").exists(), p.stdout + p.stderr
    assert f"the repository {old} has no scripts/slurm_run.sh scripts/slurm_node.sh (an older clone" in p.stdout
