"""scripts/slurm.sbatch as users submit it (stub sbatch, srun, scontrol from tests/stubs; a stand-in launch.sh): a
wrapper Slurm would signal instead, a copy away from the repository, submitted from a run folder (a relative path,
a busy controller, sbatch -D), a requeue whose TERM lands before scontrol returns, a disabled requeue, a requeue that
cannot see its job's checkpoints (a node-local --output_dir), a job submitted from inside a requeued one."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.e2e.launchers import ROOT, SBATCH_SCRIPT, STUBS, clean_env, requeues
from tests.e2e.test_sbatch import sbatch


def test_a_wrapper_that_slurm_would_signal_instead_is_refused_in_one_line(tmp_path):
    """`sbatch --wrap "bash scripts/slurm.sbatch ..."` or a script that runs it without exec: Slurm signals the process
    it started (SLURM_TASK_PID), the wrapper, which dies of the warning or the TERM and takes this shell with it (no
    save, no requeue; slurmstepd SIGKILLs what is left), and the #SBATCH lines (--requeue, the warning) are not these.
    It used to run; it is refused in one line. `exec` from a wrapper keeps the pid and runs."""
    for how, code in (("bash", 2), ("exec bash", 0)):
        wrapper = tmp_path / "wrap.sh"
        wrapper.write_text(f'#!/bin/sh\n{how} {SBATCH_SCRIPT} "$@"\n')
        e = clean_env(PATH=f"{STUBS}:{os.environ['PATH']}", SLURM_SUBMIT_DIR=str(tmp_path), PYTHONPATH=ROOT,
                      SCONTROL_LOG=str(tmp_path / "scontrol.log"), FAKE_LOG=str(tmp_path / "fake.log"), FAKE_EXIT="0",
                      FAKE_COMPLETE=str(tmp_path / "out" / "COMPLETE"), LAUNCH_CMD=os.path.join(STUBS, "fake_launch"))
        p = subprocess.run(["sbatch", str(wrapper), "--output_dir", str(tmp_path / "out")], cwd=tmp_path, env=e,
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == code, p.stdout + p.stderr
        assert ("not by Slurm (sbatch --wrap, or a script without exec)" in p.stdout) == (code == 2), p.stdout


def test_a_batch_script_away_from_its_repository_is_refused_in_one_line(tmp_path):
    """Slurm runs a copy of the submitted file from its spool (the stub sbatch too), so the repository is the submit
    dir or the submitted file's (the job's Command=): a copy of slurm.sbatch kept elsewhere, submitted from a run
    folder, finds neither and is refused in one line before any srun. (Submitting the repository's own file from a run
    folder runs: test_launch_real.py::test_sbatch_ranks_spread_over_the_nodes_cpus.)"""
    mine = tmp_path / "mine" / "slurm.sbatch"
    mine.parent.mkdir()
    mine.write_text(open(SBATCH_SCRIPT).read())
    e = clean_env(PATH=f"{STUBS}:{os.environ['PATH']}", SLURM_SUBMIT_DIR=str(tmp_path), SCONTROL_LOG=str(tmp_path / "s.log"),
                  FAKE_LOG=str(tmp_path / "fake.log"), FAKE_EXIT="0", LAUNCH_CMD=os.path.join(STUBS, "fake_launch"))
    p = subprocess.run(["sbatch", str(mine), "--output_dir", str(tmp_path / "out")], cwd=tmp_path, env=e,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stdout.count("\n") == 1, p.stdout + p.stderr
    assert "cannot find the repository" in p.stdout and not (tmp_path / "fake.log").exists(), p.stdout


@pytest.mark.parametrize("how", ["relative path", "busy controller", "chdir"])
def test_a_batch_script_submitted_from_a_run_folder_runs_there(tmp_path, how):
    """`cd runs/exp1 && sbatch ../../scripts/slurm.sbatch`: sbatch keeps a path starting with . as typed in the job's
    Command= (sbatch/opt.c search_path), relative to the submit dir: it was refused ("cannot find the repository"),
    after the queue wait. So was any start whose one `scontrol show job` met a busy controller (retried now). And
    `sbatch -D DIR` (slurmstepd starts the script there) was undone by a cd to the submit dir: a relative --output_dir
    went to the wrong folder (here: its COMPLETE unseen, the job failed)."""
    run = tmp_path / "runs" / "exp1"
    run.mkdir(parents=True)
    work = tmp_path / "work" if how == "chdir" else run
    work.mkdir(exist_ok=True)
    script = os.path.relpath(SBATCH_SCRIPT, run) if how == "relative path" else SBATCH_SCRIPT
    e = clean_env(PATH=f"{STUBS}:{os.environ['PATH']}", SLURM_SUBMIT_DIR=str(run), SCONTROL_LOG=str(tmp_path / "s.log"),
                  FAKE_LOG=str(tmp_path / "fake.log"), FAKE_EXIT="0", FAKE_COMPLETE=str(work / "out" / "COMPLETE"),
                  LAUNCH_CMD=os.path.join(STUBS, "fake_launch"), SCONTROL_FAIL_SHOWS="2" if how == "busy controller" else "0")
    opts = [f"--chdir={work}"] if how == "chdir" else []
    p = subprocess.run(["sbatch", *opts, script, "--output_dir", "out"], cwd=run, env=e, capture_output=True,
                       text=True, timeout=90)
    assert p.returncode == 0 and "done" in p.stdout, p.stdout + p.stderr
    assert "args: --no_ssh" in (tmp_path / "fake.log").read_text()


def test_a_requeue_that_ends_the_batch_shell_before_scontrol_returns_still_counts(tmp_path):
    """A requeue makes Slurm TERM every process of the job, which can land before `scontrol requeue` has returned.
    A shell between the command substitution and scontrol (this stop's own first form) died of it: the requeue that
    worked counted as failed ("requeue failed"), its retries met "pending execution", and the job's records were
    deleted. scontrol itself ignores the TERM and its answer is read."""
    job = sbatch(tmp_path, "75", ["--output_dir", str(tmp_path / "out")], SCONTROL_TERM_FIRST="1")
    text = job.communicate(timeout=60)[0]
    assert job.returncode == 0 and "requeue failed" not in text, text
    assert requeues(tmp_path) == ["requeue 4242"], text


@pytest.mark.parametrize("how", ["start", "answer"])
def test_a_job_whose_requeue_is_disabled_says_to_resubmit(tmp_path, how):
    """sbatch --no-requeue, SBATCH_NO_REQUEUE=1 where it was submitted (it beats #SBATCH --requeue) or a site's
    job_submit policy: `scontrol requeue` answers "presently disabled" and the job ended after three tries with
    "requeue failed", the user never told what to do; then said only at the end. The start's `scontrol show job`
    (Requeue=0) says it at once, in one line, and once at the end (one requeue call, refused at once: the user may
    have turned it back on); "answer": disabled during the run (`scontrol update JobId=J Requeue=0`), the requeue's
    answer says it, once, no retries. scontrol's own "presently disabled" line is not repeated in the log."""
    env = {"SCONTROL_NO_REQUEUE": "1"}
    if how == "answer":
        late = tmp_path / "launch"
        late.write_text(f'#!/usr/bin/env bash\necho requeue=0 >> {tmp_path}/scontrol.log.state\n'
                        f'exec {STUBS}/fake_launch "$@"\n')
        late.chmod(0o755)
        env = {"LAUNCH_CMD": str(late)}
    job = sbatch(tmp_path, "75", ["--output_dir", str(tmp_path / "out")], **env)
    text = job.communicate(timeout=60)[0]
    assert job.returncode == 75 and "presently disabled" not in text and requeues(tmp_path) == [], text
    assert text.count("requeue is disabled for this job") == (2 if how == "start" else 1), text
    assert "a preemption or the time limit will end it; resubmit the same command" in text or how == "answer", text
    assert "resubmit the same command" in text and "requeue failed" not in text, text


@pytest.mark.parametrize("latest", [None, "step_000500"])
def test_a_requeue_that_cannot_see_the_jobs_checkpoints_is_refused(tmp_path, latest):
    """--output_dir on a node's own disk (/tmp, local NVMe): a one-node job requeued onto another node found no
    checkpoint and started fresh, at every requeue (four of them, then "a failure that repeats"). A restart that
    cannot see the checkpoint its last requeue recorded is refused in one line; one that sees it runs."""
    (tmp_path / ".cache" / "slurm").mkdir(parents=True)
    (tmp_path / ".cache" / "slurm" / "4242.progress").write_text("0 500\n")
    out = tmp_path / "out"
    if latest:
        (out / "checkpoints").mkdir(parents=True)
        (out / "checkpoints" / "LATEST").write_text(latest + "\n")
    job = sbatch(tmp_path, "75", ["--output_dir", str(out)], SLURM_RESTART_COUNT="1", STATE_SETTLE_S="2")
    text = job.communicate(timeout=60)[0]
    if latest:
        assert job.returncode == 0 and requeues(tmp_path) == ["requeue 4242"], text
    else:
        assert job.returncode == 2 and "holds none of this job's checkpoints (step 500" in text, text
        assert not (tmp_path / "fake.log").exists()
    # this restart's node records (.cache/slurm/<job>.<restart>/) go with it, whatever its end (an exit 2, a requeue
    # without a node: they stayed for good, 2-3 files a node)
    assert sorted(p.name for p in (tmp_path / ".cache" / "slurm").iterdir() if p.is_dir()) == [], text


def test_a_heterogeneous_job_is_refused_and_the_step_waits_for_every_node(tmp_path):
    """`#SBATCH hetjob`: srun without --het-group starts on component 0 alone, the others idle the whole run: refused
    in one line. The step runs with --wait=0: a site's WaitTime ended it that long after the first launcher's exit,
    while node 0 still exported the model (no COMPLETE; the same at every resubmission)."""
    het = sbatch(tmp_path, "0", ["--output_dir", str(tmp_path / "out")], SLURM_HET_SIZE="2",
                 SLURM_JOB_ID_HET_GROUP_0="4242")
    out = het.communicate(timeout=60)[0]
    assert het.returncode == 2 and "a heterogeneous job (2 components)" in out, out
    # a plain job submitted from inside het job 4100 inherits its SLURM_HET_SIZE: it was refused as one, and runs
    job = sbatch(tmp_path, "0", ["--output_dir", str(tmp_path / "out")], SRUN_LOG=str(tmp_path / "srun.log"),
                 FAKE_COMPLETE=str(tmp_path / "out" / "COMPLETE"), SLURM_HET_SIZE="2", SLURM_JOB_ID_HET_GROUP_0="4100")
    out = job.communicate(timeout=60)[0]
    assert job.returncode == 0, out
    assert "--wait=0" in (tmp_path / "srun.log").read_text().split()


def test_a_job_submitted_from_inside_a_requeued_one_is_at_its_own_restart(tmp_path):
    """sbatch copies the submitting environment, and Slurm before 36b31fae4d sets SLURM_RESTART_COUNT only when > 0:
    a job submitted from inside a requeued job started with SLURM_RESTART_COUNT=1 at its real restart 0 (a needless
    wait for a LATEST, a run lock that refused its real restart as a live second writer). The start's `scontrol show
    job` Restarts= decides, for this shell and the ranks."""
    seen = tmp_path / "restart_seen"
    wrapper = tmp_path / "launch"
    wrapper.write_text(f'#!/usr/bin/env bash\necho "$SLURM_RESTART_COUNT" > {seen}\nexec {STUBS}/fake_launch "$@"\n')
    wrapper.chmod(0o755)
    job = sbatch(tmp_path, "0", ["--output_dir", str(tmp_path / "out")], SLURM_RESTART_COUNT="1", SCONTROL_RESTARTS="0",
                 LAUNCH_CMD=str(wrapper), FAKE_COMPLETE=str(tmp_path / "out" / "COMPLETE"))
    text = job.communicate(timeout=60)[0]
    assert job.returncode == 0 and "slurm.sbatch[4242]: restart 0, output dir" in text, text
    assert "SLURM_RESTART_COUNT=1 is another job's" in text and seen.read_text() == "0\n", text


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_the_batch_script_says_what_it_takes_outside_a_job(tmp_path, flag):
    """`bash scripts/slurm.sbatch --help` stopped on `SLURM_JOB_ID: not inside a SLURM job` (exit 1). It prints the
    file's head (how to submit it, what its arguments are) and exits 0, in a job or not, before any Slurm call."""
    p = subprocess.run(["bash", SBATCH_SCRIPT, flag], cwd=tmp_path, env=clean_env(PATH=f"{tmp_path}:/usr/bin:/bin"),
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 0 and "sbatch --nodes 4 scripts/slurm.sbatch" in p.stdout, p.stdout + p.stderr
    assert "#SBATCH --nodes" not in p.stdout and "KILL_WAIT_S" in p.stdout, p.stdout
