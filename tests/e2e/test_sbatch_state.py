"""How scripts/slurm_requeue.sh reads a job's base state (its job_state, which slurm.sbatch's TERM trap decides on)
when no Python can run base/slurm_state.py: a venv built in a container (a dangling link on the host), a host python3
too old for the module (3.6: `from __future__ import annotations` is a SyntaxError), a venv python that fails. It used
to read `scontrol show job` as printed, COMPLETING while a job ends, which the trap takes as a cancel: a time limit or
a preemption was never requeued. The stand-in scontrol (tests/stubs) shows the job TIMEOUT|COMPLETING here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from base.slurm_state import FLAGS, _from_json
from tests.e2e.launchers import ROOT, SBATCH_SCRIPT, STUBS, clean_env, requeues, wait_for
from tests.e2e.test_sbatch import sbatch
from tests.e2e.test_sbatch_ends import ended_as, ready, slurm

REQUEUE_SH = os.path.join(ROOT, "scripts", "slurm_requeue.sh")


def sourced(tmp_path, call: str, venv: str = "runs", python3: str = "runs", ref: str = "4242",
            **env: str) -> subprocess.CompletedProcess:
    """`call` in a bash that sourced slurm_requeue.sh as slurm.sbatch does, for a repository whose .venv python is
    `venv` (runs, dangling, fails) and a PATH whose python3 is `python3` (runs, 3.6); the job TIMEOUT|COMPLETING."""
    repo, bin_dir = tmp_path / "repo", tmp_path / "bin"
    (repo / ".venv" / "bin").mkdir(parents=True, exist_ok=True)
    bin_dir.mkdir(exist_ok=True)
    if not (repo / "base").exists():
        (repo / "base").symlink_to(os.path.join(ROOT, "base"))
    py = repo / ".venv" / "bin" / "python"
    if venv == "dangling":
        py.symlink_to("/usr/bin/python3.99")  # the container's interpreter, absent on the host
    elif venv == "fails":  # executable, cannot start (a venv moved or built for another libc)
        py.write_text("#!/bin/sh\necho 'python: error while loading shared libraries: libpython3.11.so.1.0' >&2\n"
                      "exit 127\n")
    else:
        py.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (bin_dir / "python3").write_text(
        f'#!/bin/sh\nexec {sys.executable} "$@"\n' if python3 == "runs" else
        "#!/bin/sh\necho '  File \"base/slurm_state.py\", line 20' >&2\n"
        "echo 'SyntaxError: future feature annotations is not defined' >&2\nexit 1\n")
    for f in (py, bin_dir / "python3"):
        if not f.is_symlink():
            f.chmod(0o755)
    (tmp_path / "scontrol.log.state").write_text(
        "state=TIMEOUT\nreason=TimeLimit\ncompleting=1\njob_processes=state-test\n")
    script = f'ref={ref} repo={repo} out_dir=""; log() {{ echo "log: $*"; }}; . {REQUEUE_SH}; {call}'
    e = clean_env(PATH=f"{bin_dir}:{STUBS}:/usr/bin:/bin", PYTHONPATH=str(repo), SBATCH_STUB_JOB="state-test",
                  SCONTROL_LOG=str(tmp_path / "scontrol.log"), **env)
    return subprocess.run(["bash", "-c", script], env=e, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("venv, python3, json_ok, want", [
    ("dangling", "3.6", True, "TIMEOUT TimeLimit"),   # read by the shell from scontrol --json
    ("fails", "runs", True, "TIMEOUT TimeLimit"),     # python3 after a venv python that fails, not only one not -x
    ("fails", "3.6", True, "TIMEOUT TimeLimit"),
    ("dangling", "3.6", False, "COMPLETING TimeLimit"),  # a Slurm before --json, no Python: as printed (a cancel)
])
def test_the_base_state_is_read_when_the_venvs_python_cannot_run(tmp_path, venv, python3, json_ok, want):
    p = sourced(tmp_path, 'echo "state: $(job_state)"; echo "how: $state_how"', venv, python3,
                SCONTROL_JSON="1" if json_ok else "0")
    assert f"state: {want}\n" in p.stdout, p.stdout + p.stderr
    logged = [ln for ln in p.stdout.splitlines() if ln.startswith("log: ")]
    if python3 == "runs":  # found at start-up: nothing to say, and the COMPLETING line would name it
        assert logged == [] and "how: python3 -m base.slurm_state" in p.stdout, p.stdout
    else:  # one line at start-up, naming each Python and why it did not run
        assert len(logged) == 1 and "no Python runs base/slurm_state.py" in logged[0], p.stdout
        assert "python3: SyntaxError: future feature annotations is not defined" in logged[0], logged
        assert ("No such file or directory" if venv == "dangling" else "libpython3.11.so") in logged[0], logged


def test_the_shells_flags_are_base_slurm_states():
    p = subprocess.run(["bash", "-c", f'ref=1 repo={ROOT}; log() {{ :; }}; . {REQUEUE_SH}; echo $STATE_FLAGS'],
                       capture_output=True, text=True, timeout=30, env=clean_env(PYTHONPATH=ROOT))
    assert set(p.stdout.split()) == FLAGS, p.stdout + p.stderr


def job(job_id, states, reason="TimeLimit", array=None, **more) -> dict:
    rec = {"account": "a", "command": 'echo "{[\\"job_state\\": [\\"RUNNING\\"]]}"', "job_id": job_id}
    if array:
        rec.update(array_job_id={"set": True, "infinite": False, "number": array[0]},
                   array_task_id={"set": True, "infinite": False, "number": array[1]})
    rec.update(job_resources={"nodes": {"allocation": [{"name": "n1", "sockets": []}, {"name": "n2"}]}},
               job_state=states, **more)
    if reason is not None:
        rec["state_reason"] = reason
    return rec


ARRAY = [job(100, ["PENDING"], "JobArrayTaskLimit", (100, 7)), job(103, ["CANCELLED", "COMPLETING"], "None", (100, 3))]


@pytest.mark.parametrize("jobs, ref", [
    ([job(4242, ["TIMEOUT", "COMPLETING"])], "4242"),
    ([job(4242, ["COMPLETING", "PREEMPTED"])], "4242"),   # the flag first
    ([job(4242, ["COMPLETING", "REQUEUED"])], "4242"),    # flags only: no base state
    ([job(4242, "COMPLETING")], "4242"),                  # 23.02's data_parser writes the printed string
    ([job(4242, "RUNNING", None)], "4242"),               # no reason: None
    ([job(4242, ["CANCELLED"], "")], "4242"),
    (ARRAY, "100_3"), (ARRAY, "100_7"), (ARRAY, "100_5"), (ARRAY, "103"), (ARRAY, "999"),
    ([], "4242"),
])
@pytest.mark.parametrize("indent", [None, 2])
def test_the_shells_json_reading_agrees_with_base_slurm_state(tmp_path, jobs, ref, indent):
    """json_state (no Python) against base/slurm_state.py on the same text: each record split by nesting depth (an
    array task's among the array's records, the head's first), ids as numbers or v0.0.40's {"number": N}, pretty or
    compact."""
    text = json.dumps({"meta": {"plugin": {"type": "x"}}, "jobs": jobs, "errors": []}, indent=indent)
    (tmp_path / "job.json").write_text(text)
    p = subprocess.run(["bash", "-c", f'ref={ref} repo={ROOT}; log() {{ :; }}; . {REQUEUE_SH}; json_state < {tmp_path}/job.json'],
                       capture_output=True, text=True, timeout=30, env=clean_env(PYTHONPATH=ROOT))
    got = _from_json(text, ref)
    assert p.stdout == (" ".join(got) + "\n" if got else ""), (p.stdout, p.stderr, got)


def test_an_unreadable_state_names_the_python_it_tried(tmp_path):
    """A Slurm before --json and no sacct: the time limit's TERM leaves only COMPLETING, taken as a cancel; the log line
    names the Python that read it (it said "no scontrol --json, no sacct" whatever ran)."""
    text = ended_as(tmp_path, "TIMEOUT", SCONTROL_JSON="0", SCONTROL_KILL_WAIT="4")
    assert f"its base state unreadable ({ROOT}/.venv/bin/python -m base.slurm_state: no scontrol --json, no sacct)" \
        in text, text


def old_slurm_job(tmp_path, end: int, fake_exit: str = "wait", **env: str) -> subprocess.Popen:
    """slurm.sbatch under a Slurm before 23.02: `scontrol show job` prints this job's StartTime / EndTime (`end`), the
    stand-in sbatch sets no SLURM_JOB_END_TIME; the launcher writes the end and the times marker it was given."""
    shown = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(end))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # the stand-in's output, plus the times Slurm 22.05 prints under `show job`: a one-hour limit that ends at `end`
    # (RunTime: seconds since its start, base/slurm_state.py's TIMEOUT once it reaches TimeLimit)
    run = (f'r=$(($(date +%s) - {end - 3600})); '
           'printf -v run "%02d:%02d:%02d" $((r / 3600)) $((r % 3600 / 60)) $((r % 60))')
    (bin_dir / "scontrol").write_text(
        f'#!/usr/bin/env bash\n{STUBS}/scontrol "$@"; rc=$?\n[ "$1 $2 $rc" = "show job 0" ] && {{ {run}; '
        f'echo "   RunTime=$run TimeLimit=01:00:00 TimeMin=N/A"; '
        f'echo "   StartTime=2026-01-01T00:00:00 EndTime={shown} Deadline=N/A"; }}\nexit $rc\n')
    (bin_dir / "launch").write_text(f'#!/bin/sh\necho "end=$SLURM_JOB_END_TIME" > {tmp_path}/end\n'
                                    f'echo "$ULYSSES_TIMES_JOB" > {tmp_path}/marker\n'
                                    f'exec {STUBS}/fake_launch "$@"\n')
    for f in ("scontrol", "launch"):
        (bin_dir / f).chmod(0o755)
    e = clean_env(PATH=f"{bin_dir}:{STUBS}:{os.environ['PATH']}", SLURM_SUBMIT_DIR=str(tmp_path), PYTHONPATH=ROOT,
                  SCONTROL_LOG=str(tmp_path / "scontrol.log"), FAKE_LOG=str(tmp_path / "fake.log"), FAKE_EXIT=fake_exit,
                  FAKE_EXIT_AFTER="75", LAUNCH_CMD=str(bin_dir / "launch"), SCONTROL_JSON="0", SCONTROL_KILL_WAIT="4",
                  **env)
    return subprocess.Popen(["sbatch", SBATCH_SCRIPT, "--output_dir", str(tmp_path / "out")], cwd=tmp_path, env=e,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_a_time_limit_before_slurm_23_02_is_requeued(tmp_path):
    """Slurm < 23.02 sets no SLURM_JOB_END_TIME (the stand-in sbatch sets none either), and without scontrol --json or
    sacct a time limit's TERM read COMPLETING: taken as a cancel, never requeued, and the ranks had no end to stop
    before. slurm.sbatch now reads the planned EndTime from `scontrol show job` at its start (here a wrapper adds the
    lines the stand-in lacks) and exports it: launch.sh gets it; base/slurm_state.py reads TIMEOUT from RunTime >=
    TimeLimit (the exported end goes stale when the job is suspended)."""
    end = int(time.time()) + 3
    job = old_slurm_job(tmp_path, end)
    try:
        wait_for(lambda: ready(tmp_path), 90, "the stand-in launcher")
        time.sleep(max(0.0, end - time.time()))  # the limit comes: slurmctld sets TIMEOUT, then signals
        slurm(tmp_path, "scontrol", "_end", "4242", "TIMEOUT")
        text = job.communicate(timeout=30)[0]
    finally:
        job.kill()
    assert (tmp_path / "end").read_text() == f"end={end}\n", text
    assert "JobState=TIMEOUT: requeueing now" in text and requeues(tmp_path) == ["requeue 4242"], text


@pytest.mark.parametrize("given, marker, want", [
    ("1000", "4241:1000", "scontrol"),  # inherited from job 4241, which submitted this one (Slurm < 23.02)
    ("2000", "4241:1000", "given"),     # Slurm's own (>= 23.02): set for this job, not the one the marker names
    ("2000", "4242:2000", "given"),     # read for this job already
    ("2000", None, "given"),            # no marker: Slurm's own
])
def test_an_end_time_inherited_from_the_submitting_job_is_read_again(tmp_path, given, marker, want):
    """A job submitted from inside a running slurm.sbatch job inherits its environment (sbatch propagates it): under
    Slurm < 23.02 its SLURM_JOB_END_TIME, exported by that job's slurm.sbatch, was taken as this job's end (the ranks
    stopped at the other job's limit, or ran past their own). slurm.sbatch exports ULYSSES_TIMES_JOB (job:end) and
    reads the times again from scontrol when the end is the one another job's marker names."""
    end = int(time.time()) + 3600
    env = {"SLURM_JOB_END_TIME": given, "SLURM_JOB_START_TIME": "900"}
    if marker:
        env["ULYSSES_TIMES_JOB"] = marker
    job = old_slurm_job(tmp_path, end, fake_exit="0", **env)
    text = job.communicate(timeout=60)[0]
    got = end if want == "scontrol" else int(given)
    assert (tmp_path / "end").read_text() == f"end={got}\n", text
    assert (tmp_path / "marker").read_text() == f"4242:{got}\n", text


def test_a_bounded_scontrol_call_keeps_the_callers_ignored_term(tmp_path):
    """The requeue and the EXIT trap's update run scontrol with SIGTERM ignored (a requeue's own TERM reaches every
    process of the job under SignalChildrenProcesses=yes: a requeue that worked counted as failed). Under a bound,
    coreutils `timeout` sets its own TERM handler, so its child no longer inherited the ignore (and timeout passes a
    TERM it gets on to it). The command ignores TERM and INT within its bound as without one."""
    p = sourced(tmp_path, "for s in 5 ''; do (trap '' TERM INT; exec_within \"$s\" grep SigIgn /proc/self/status); done")
    masks = [int(line.split()[1], 16) for line in p.stdout.splitlines() if line.startswith("SigIgn:")]
    term, intr = 1 << (15 - 1), 1 << (2 - 1)  # bit N-1 of the mask: signal N (SIGTERM 15, SIGINT 2)
    assert len(masks) == 2 and all(m & term and m & intr for m in masks), p.stdout + p.stderr


# job_state stand-in (after the sourcing: it wins): one answer per call from `answers` ("_" a space), each call's bound
# (its $1) logged; the trap's other collaborators inert
FAKE_STATE = ('requeued=0 cancelled=0 exiting=0 stopped=0 finished="" kill_at="" term_at="" nnodes=1 state={tmp}/st '
              'intent={tmp}/intent progress={tmp}/progress; '
              'job_state() {{ echo "bound=${{1:-none}}" >> {tmp}/bounds; local n a=({answers}); '
              'n=$(grep -c . {tmp}/bounds); echo "${{a[$((n - 1))]:-}}" | tr _ " "; }}; '
              'forward() {{ :; }}; out_here() {{ :; }}; out_unseen() {{ :; }}; state_py=x; ')


def trapped(tmp_path, answers: str, call: str, **env: str) -> tuple[str, list[str], list[str]]:
    """`call` after the TERM trap's functions with job_state answering `answers` in turn: (output, requeue calls, each
    job_state call's bound)."""
    p = sourced(tmp_path, FAKE_STATE.format(tmp=tmp_path, answers=answers) + call, **env)
    bounds = tmp_path / "bounds"
    return p.stdout + p.stderr, requeues(tmp_path), bounds.read_text().split() if bounds.exists() else []


def test_the_term_traps_state_read_takes_half_of_killwait(tmp_path):
    """The read that decides a TERM may take KILL_WAIT_S / 2 in all, leaving the rest of KillWait for the requeue
    before Slurm's SIGKILL (it was given the whole of it: mutation audit mutC, M22)."""
    text, _, bounds = trapped(tmp_path, "RUNNING_None", "on_term", KILL_WAIT_S="8")
    assert bounds[:1] == ["bound=4"], text


@pytest.mark.parametrize("answers, said", [
    ("CANCELLED_None", "JobState=unknown"),  # the trap read the cancel; the read before the requeue got no answer
    ("'' CANCELLED_None", "JobState=CANCELLED"),  # the trap's read got no answer; the one before the requeue: cancelled
])
def test_a_cancel_read_by_either_read_is_never_requeued(tmp_path, answers, said):
    """A scancel's TERM read as CANCELLED by the trap is kept when the read before the requeue gets no answer (a busy
    controller); one the trap could not read is seen by that later read. Never requeued: slurmctld accepts the
    requeue of a CANCELLED, still COMPLETING job, which undoes the cancel (mutC: M20, M21)."""
    text, requeued, _ = trapped(tmp_path, answers, 'on_term; requeue_without "" 75; echo after', KILL_WAIT_S="30")
    assert requeued == [] and f"the job was cancelled ({said}): not requeueing" in text and "after" not in text, text


def test_a_start_whose_controller_does_not_answer_runs_or_is_requeued(tmp_path):
    """Submitted from a run folder, the job finds its repository from `scontrol show job`'s Command= alone; three
    failed tries (a controller busy after a preemption wave) ended it with "cannot find the repository", exit 2, before
    its EXIT trap: not requeued, lost. The show is retried for up to ULYSSES_SHOW_WAIT_S; with still no answer the job
    is requeued, at most ULYSSES_MAX_STALLED_REQUEUES starts in a row, then refused in one line."""
    runs = {}
    for name, shows, blind in (("busy", "3", None), ("down", "99", None), ("down_again", "99", "3")):
        run = tmp_path / name
        run.mkdir()
        if blind:
            (run / ".cache" / "slurm").mkdir(parents=True)
            (run / ".cache" / "slurm" / "4242.blind").write_text(blind + "\n")
        job = sbatch(run, "0", ["--output_dir", str(run / "out")], SCONTROL_FAIL_SHOWS=shows, ULYSSES_SHOW_WAIT_S="1"
                     if shows == "99" else "120", FAKE_COMPLETE=str(run / "out" / "COMPLETE"))
        runs[name] = (job.communicate(timeout=60)[0], job.returncode, requeues(run))
    text, rc, requeued = runs["busy"]
    assert rc == 0 and "done" in text and requeued == [], text
    text, rc, requeued = runs["down"]
    assert rc == 0 and requeued == ["requeue 4242"] and text.count("\n") == 1, text
    assert "no answer from scontrol show job 4242 in 1 s (a busy controller), repository unknown: requeued (1 in" in text
    text, rc, requeued = runs["down_again"]
    assert rc == 2 and requeued == [] and text.count("\n") == 1, text
    assert "cannot find the repository (not the work dir" in text and "start 4 in a row" in text, text


@pytest.mark.parametrize("bound, want", [("", "stop"), ("1800", "requeue"), ("20m", "refused")])
def test_a_warning_sent_as_term_is_read_within_ulysses_term_warn_s(tmp_path, bound, want):
    """`sbatch --signal=TERM@1200` (no B:): the steps' TERM 20 min before the end, none to the batch shell, no
    PreemptTime, the job RUNNING, the ranks saved: read as a user's scancel --signal=TERM (more than 900 s left), the
    job COMPLETED unfinished. Slurm does not show --signal, so the bound is a setting now (ULYSSES_TERM_WARN_S, checked
    at the start: job_facts), and the stop's line names the fix, --signal=B:USR1@N."""
    end = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() + 1200))
    call = (f'printf "state=RUNNING\\nreason=None\\nend_time={end}\\n" > "$SCONTROL_LOG.state"; job_facts; '
            'termed=1 term_at="" complete=0 stopped=0 rc=75 EXIT_PREEMPTED=75 crash_first=() crash_own=() requeued=0 '
            'cancelled=0; steps_termed; requeue_without "" 75')
    p = sourced(tmp_path, call, **({"ULYSSES_TERM_WARN_S": bound} if bound else {}))
    text = p.stdout + p.stderr
    assert requeues(tmp_path) == (["requeue 4242"] if want == "requeue" else []), text
    assert (p.returncode, "a user's scancel --signal=TERM" in text) == {"stop": (0, True), "requeue": (0, False),
                                                                       "refused": (2, False)}[want], text
    if want == "stop":
        assert "--signal=B:USR1@N, or raise ULYSSES_TERM_WARN_S above N" in text, text
    if want == "refused":
        assert text.count("\n") == 1 and "ULYSSES_TERM_WARN_S=20m is no number of seconds" in text, text
