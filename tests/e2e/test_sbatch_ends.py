"""How scripts/slurm.sbatch decides a job's end from Slurm's own word (issue 48), under stand-ins that behave as Slurm
does (tests/stubs/: `scancel` and the time limit set the job's state, SIGCONT + SIGTERM to each step's first process
(the batch shell, each node's task: proctrack/cgroup's default), SIGKILL to every process KillWait later; `scontrol
requeue` ends the batch step the same way; `update` only on a pending job and only known node names): a cancel is
never requeued, a preemption or the time limit is (inside KillWait), a requeue's exclusion survives the requeue's own
kill and never leaves the job held, an exclusion that would leave too few nodes is not applied, and requeues are
bounded by progress (newer checkpoints), not by count."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.e2e.launchers import STUBS, clean_env, requeues, wait_for
from tests.e2e.test_sbatch import TWO_NODES, sbatch, updates


def ready(tmp_path) -> bool:
    log = tmp_path / "fake.log"
    return log.exists() and "ready" in log.read_text()


def slurm(tmp_path, *args: str) -> None:
    """A Slurm command from outside the job (the user's terminal, slurmctld itself)."""
    subprocess.run(list(args), check=True, timeout=30,
                   env=clean_env(PATH=f"{STUBS}:{os.environ['PATH']}", SCONTROL_LOG=str(tmp_path / "scontrol.log")))


def during_slow_call(tmp_path, job, what: str, *act: str, timeout: int = 30) -> str:
    """The job's output after `act` (a stand-in command: scancel, scontrol _end ...) is run while the stand-in scontrol
    holds its slow call (SCONTROL_SLOW) open."""
    try:
        wait_for((tmp_path / "scontrol.log.slow").exists, 60, what)
        slurm(tmp_path, *act)
        return job.communicate(timeout=timeout)[0]
    finally:
        job.kill()


def state(tmp_path) -> dict:
    return dict(line.split("=", 1) for line in (tmp_path / "scontrol.log.state").read_text().splitlines())


def ended_as(tmp_path, end: str, early: bool = False, **env: str) -> str:
    """slurm.sbatch under the stand-ins until its launcher runs (early: until the node's task has set its traps, the
    launcher starting 2 s later, as a container's start), then slurmctld's end of the job as `end` (TIMEOUT,
    PREEMPTED, REQUEUED...): the batch shell's output."""
    if early:
        late = tmp_path / "late_launch"
        late.write_text(f'#!/usr/bin/env bash\nsleep 2\nexec {os.path.join(STUBS, "fake_launch")} "$@"\n')
        late.chmod(0o755)
        env["LAUNCH_CMD"] = str(late)
    job = sbatch(tmp_path, "wait", ["--output_dir", str(tmp_path / "out")], FAKE_EXIT_AFTER="75", **env)
    try:
        if early:
            wait_for((tmp_path / ".cache/slurm/4242.0/start.0").exists, 90, "the node's task")
        else:
            wait_for(lambda: ready(tmp_path), 90, "the stand-in launcher")
        slurm(tmp_path, "scontrol", "_end", "4242", end)
        return job.communicate(timeout=30)[0]
    finally:
        job.kill()


def cancelled_while_running(tmp_path, out, **env: str) -> str:
    """The batch shell's output of a job `scancel`led once its stand-in launcher runs."""
    job = sbatch(tmp_path, "wait", ["--output_dir", str(out)], **env)
    try:
        wait_for(lambda: ready(tmp_path), 90, "the stand-in launcher")
        slurm(tmp_path, "scancel", "4242")
        return job.communicate(timeout=30)[0]
    finally:
        job.kill()


def test_scancel_ends_the_job_and_is_never_requeued(tmp_path):
    """scancel: slurmctld sets CANCELLED, then SIGTERM (the node's task passes it on to launch.sh); the ranks save
    (75) within KillWait. The batch shell reads CANCELLED and does not requeue (it used to take the TERM for the
    time-limit warning and `scontrol requeue`, which slurmctld accepts for a CANCELLED, COMPLETING job: the cancel
    undone)."""
    text = cancelled_while_running(tmp_path, tmp_path / "out", FAKE_EXIT_AFTER="75", SCONTROL_KILL_WAIT="10",
                                   FAKE_SAVE_S="1")  # a save that lasts: Slurm's TERM comes during it
    assert "got SIGTERM" in (tmp_path / "fake.log").read_text(), text  # Slurm's own TERM reached the launcher
    assert requeues(tmp_path) == [] and state(tmp_path)["state"] == "CANCELLED", text
    assert "JobState=CANCELLED (scancel)" in text and "the job was cancelled (JobState=CANCELLED): not requeueing" \
        in text, text


@pytest.mark.parametrize("owner", ["4242", "999"])
def test_cancelling_a_second_job_on_a_live_runs_folder_leaves_that_run_alone(tmp_path, owner):
    """A second job started on a folder another job's run holds (refused by its ranks at the run lock), cancelled
    while it starts: its batch shell touched OUTPUT_DIR/PREEMPT, and the live run saved and stopped. PREEMPT is now
    touched only where the folder's RUN_LOCK is this job's (or there is none)."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "RUN_LOCK").write_text(json.dumps({"host": "n1", "pid": 1, "job": owner, "restart": "0"}))
    text = cancelled_while_running(tmp_path, out, FAKE_EXIT_AFTER="1", SCONTROL_KILL_WAIT="5")
    assert (out / "PREEMPT").exists() == (owner == "4242"), text
    assert (f"is the run of job {owner}" in text) == (owner != "4242"), text


@pytest.mark.parametrize("owner", [None, "999"])
def test_the_previous_jobs_stop_request_is_cleared_before_this_jobs_traps(tmp_path, owner):
    """The previous job's PREEMPT (honoured by its save) is removed by the batch shell before its traps, so the ranks
    keep any they find (a USR2 to the batch shell before they existed wrote it, and train.py deleted it as old): not
    in another job's folder (its RUN_LOCK names it)."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "PREEMPT").write_text("")
    if owner:
        (out / "RUN_LOCK").write_text(json.dumps({"host": "n1", "pid": 1, "job": owner, "restart": "0"}))
    job = sbatch(tmp_path, "0", ["--output_dir", str(out)], FAKE_COMPLETE=str(out / "COMPLETE"))
    text = job.communicate(timeout=60)[0]
    assert job.returncode == 0, text
    assert (out / "PREEMPT").exists() == bool(owner), text


@pytest.mark.parametrize("end, save_s, how", [
    ("TIMEOUT", 0, "default"), ("TIMEOUT", 6, "default"), ("PREEMPTED", 6, "default"),
    ("TIMEOUT", 6, "children"),  # cgroup.conf SignalChildrenProcesses=yes: every process gets the TERM
    ("TIMEOUT", 0, "early"),     # the TERM before launch.sh has set its traps (its container still starting)
])
def test_the_time_limit_and_a_preemption_requeue_inside_killwait(tmp_path, end, save_s, how):
    """The time limit (TIMEOUT) or a preemption in cancel mode (PREEMPTED): SIGTERM to each step's first process (the
    batch shell, each node's task: proctrack/cgroup's default, which passes it on to launch.sh; "children": every
    process), SIGKILL KillWait (4 s here) later. The batch shell reads the state and requeues at once, so a save that
    outlasts KillWait (6 s) still leaves the job requeued (it used to requeue only after the ranks' exit: SIGKILLed
    first, the job ended TIMEOUT and the chain stopped). "early": the node's task holds the signal until launch.sh's
    traps are set, then the ranks save (KillWait 10 s)."""
    text = ended_as(tmp_path, end, early=how == "early", FAKE_SAVE_S=str(save_s),
                    SCONTROL_KILL_WAIT="10" if how == "early" else "4",
                    STUB_SIGNAL_CHILDREN="1" if how == "children" else "0")
    # the launcher asked to save: by the node's task passing the TERM on, or the batch shell's USR1 through srun
    assert "got SIG" in (tmp_path / "fake.log").read_text(), text
    assert requeues(tmp_path) == ["requeue 4242"], text
    assert f"JobState={end}: requeueing now, inside KillWait" in text, text
    assert state(tmp_path)["state"] == "PENDING"


@pytest.mark.parametrize("code, fmt", [("1", None), ("75", "relative")])
def test_a_preemptions_grace_time_is_requeued_whatever_the_ranks_exit_with(tmp_path, code, fmt):
    """A preemption with GraceTime: slurmctld sets PreemptTime and sends SIGTERM to the steps only, never to the batch
    shell, and requeues the job itself at the grace's end, unless it has ended. The deepspeed launcher SIGKILLs its
    ranks 30 s after its TERM (exit 1 here): the batch shell took that for a crash, 'failed with 1: not requeueing',
    and the job ended FAILED before Slurm's requeue. It now reads PreemptTime and requeues. A user's
    SLURM_TIME_FORMAT (`relative`: "Ystday 23:59") printed no digit after PreemptTime=, and a save's 75 was read as a
    user's scancel --signal=TERM: stopped, never requeued (slurm.sbatch exports SLURM_TIME_FORMAT=standard)."""
    job = sbatch(tmp_path, "wait", ["--output_dir", str(tmp_path / "out")], FAKE_EXIT_AFTER=code, STATE_SETTLE_S="2",
                 **({"SLURM_TIME_FORMAT": fmt} if fmt else {}))
    try:
        wait_for(lambda: ready(tmp_path), 90, "the stand-in launcher")
        slurm(tmp_path, "scontrol", "_grace", "4242")
        text = job.communicate(timeout=30)[0]
    finally:
        job.kill()
    assert "got SIGTERM" in (tmp_path / "fake.log").read_text(), text  # the step's TERM, not the batch shell's
    assert f"a preemption (GraceTime), exit {code}: scontrol requeue 4242" in text, text
    assert requeues(tmp_path) == ["requeue 4242"] and job.returncode == 0, text


def test_the_time_limit_on_a_busy_controller_is_requeued_inside_killwait(tmp_path):
    """Each `scontrol show job` answers 5 s late (a slurmctld busy after a preemption wave), KillWait 8 s, a save
    that outlasts it: the TERM trap read TIMEOUT (5 s), then the requeue read the state again before its call (5 s
    more): SIGKILL first, while the log's last line said "requeueing now". A finished state cannot become CANCELLED
    (job_mgr.c job_signal: ESLURM_ALREADY_DONE): no second read, the requeue lands, and says so."""
    text = ended_as(tmp_path, "TIMEOUT", FAKE_SAVE_S="10", SCONTROL_KILL_WAIT="8", SCONTROL_SLOW="show job:5")
    assert requeues(tmp_path) == ["requeue 4242"] and state(tmp_path)["state"] == "PENDING", text
    assert "JobState=TIMEOUT: requeueing now" in text and "requeued: scontrol requeue 4242 accepted" in text, text


def test_a_disabled_requeue_at_the_time_limit_is_said_once_at_start_and_once_at_the_end(tmp_path):
    """Requeue=0 (sbatch --no-requeue, SBATCH_NO_REQUEUE=1 where it was submitted, a site's policy): said only at the
    end, twice under a time limit (the TERM's requeue and the exit's), each with "requeue failed". Now once at the
    start (the start's `scontrol show job`) and once at the end; the requeue calls are refused at once."""
    text = ended_as(tmp_path, "TIMEOUT", SCONTROL_KILL_WAIT="10", SCONTROL_NO_REQUEUE="1")
    assert text.count("requeue is disabled for this job") == 2 and "requeue failed" not in text, text
    assert requeues(tmp_path) == [] and "presently disabled" not in text, text


def test_slurms_own_requeue_during_ours_is_a_requeue(tmp_path):
    """PreemptMode=REQUEUE with GraceTime: slurmctld requeues the job while the batch shell's own `scontrol requeue`
    (after the ranks' save, exit 75) is on its way (a busy controller: 3 s); scontrol answers "Job is pending
    execution" (ESLURM_JOB_PENDING). It read "requeue failed": exit 75 and the job's book (progress, crashes) wiped
    while Slurm ran it again. Now it is taken as requeued: the book kept, exit 0."""
    out, book = tmp_path / "out", tmp_path / ".cache" / "slurm"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "LATEST").write_text("step_000100")
    book.mkdir(parents=True)
    (book / "4242.progress").write_text("0 100\n")
    (book / "4242.crashes").write_text("0 1 gpu7 100 120\n")
    job = sbatch(tmp_path, "75", ["--output_dir", str(out)], SCONTROL_SLOW="requeue:3", SCONTROL_KILL_WAIT="20")
    text = during_slow_call(tmp_path, job, "our requeue call", "scontrol", "_end", "4242", "REQUEUED", timeout=60)
    assert job.returncode == 0 and "requeue failed" not in text and "the job is pending already" in text, text
    assert sorted(p.name for p in book.iterdir()) == ["4242.crashes", "4242.progress"], text
    assert updates(tmp_path) == [], text


def test_a_stop_asked_then_the_time_limit_waits_for_the_save_and_is_not_requeued(tmp_path):
    """`scancel --batch --signal=USR2`, then the time limit's SIGTERM while the ranks save: the batch shell keeps
    waiting for them (it used to exit 0 inside its TERM trap, before the save's end, whatever the save did), ends
    the job after their 75, never requeued."""
    job = sbatch(tmp_path, "wait", ["--output_dir", str(tmp_path / "out")], FAKE_EXIT_AFTER="75", FAKE_SAVE_S="3",
                 SCONTROL_KILL_WAIT="10")
    try:
        wait_for(lambda: ready(tmp_path), 90, "the stand-in launcher")
        slurm(tmp_path, "scancel", "--batch", "--signal=USR2", "4242")
        wait_for(lambda: "got SIG" in (tmp_path / "fake.log").read_text(), 30, "the save request")
        slurm(tmp_path, "scontrol", "_end", "4242", "TIMEOUT")
        text = job.communicate(timeout=30)[0]
    finally:
        job.kill()
    assert "a stop was asked (SIGUSR2): not requeueing" in text, text
    assert "training exited with 75" in text and "saved and stopped, as asked (SIGUSR2)" in text, text
    assert requeues(tmp_path) == [], text


def test_a_job_slurm_requeued_itself_is_left_to_slurm(tmp_path):
    """PreemptMode=REQUEUE: slurmctld requeues the job (PENDING) and ends it; the batch shell says so and calls no
    requeue of its own (one would be refused: the job is pending)."""
    text = ended_as(tmp_path, "REQUEUED")
    assert requeues(tmp_path) == [] and "Slurm requeued the job itself" in text and "requeue failed" not in text, text


LOST_NODE_1 = dict(TWO_NODES, FAKE_EXIT_0="69", FAKE_LOST="1", FAKE_EXIT_1="wait", FAKE_EXIT_AFTER="69",
                   FAKE_AFTER_READY="1")


def test_the_exclusion_survives_the_requeues_own_kill(tmp_path):
    """A lost node, a busy controller (each scontrol call that changes the job takes 1 s): the requeue makes slurmd
    SIGTERM every process of the batch step 0.3 s later, while the exclusion's update is in flight. It must still
    land, and the job must never be left held (it used to: requeuehold, then an `update` killed by that TERM, the job
    requeued with the bad node; a `release` killed the same way leaves it held forever)."""
    job = sbatch(tmp_path, "0", ["--output_dir", str(tmp_path / "out")], SCONTROL_RPC_S="1", SCONTROL_SIGNAL_S="0.3",
                 SCONTROL_KILL_WAIT="10", **LOST_NODE_1)
    text = job.communicate(timeout=60)[0]
    assert requeues(tmp_path) == ["requeue 4242", "update JobId=4242 ExcNodeList=localhost"], text
    assert state(tmp_path)["reason"] != "JobHeldUser" and state(tmp_path)["exc"] == "localhost", text


def test_a_scancel_while_the_requeue_is_decided_is_not_undone(tmp_path):
    """A lost node's requeue under a busy controller (`show partition`, the exclusion's pool count, answers after 3 s)
    and the user's scancel while that call runs: the TERM trap read CANCELLED between two scontrol calls, then
    requeue_without went on to `scontrol requeue` (slurmctld accepts it for a CANCELLED, still COMPLETING job) and
    the exclusion: the cancel undone, the job PENDING. The cancel is now looked at again just before the requeue."""
    job = sbatch(tmp_path, "0", ["--output_dir", str(tmp_path / "out")], SCONTROL_SLOW="show partition:3",
                 SCONTROL_KILL_WAIT="10", **LOST_NODE_1)
    text = during_slow_call(tmp_path, job, "the exclusion's partition call", "scancel", "4242")
    assert requeues(tmp_path) == [] and state(tmp_path)["state"] == "CANCELLED", text
    assert "JobState=CANCELLED (scancel)" in text and "the job was cancelled (JobState=CANCELLED): not requeueing" \
        in text and job.returncode == 69, text


def test_an_exclusion_that_leaves_too_few_nodes_is_not_applied(tmp_path):
    """A 2-node job in a 2-node partition: excluding the lost node would leave it pending forever (slurmctld accepts
    any ExcNodeList on a pending job). Requeued as it is, one line saying why (it used to exclude it)."""
    job = sbatch(tmp_path, "0", ["--output_dir", str(tmp_path / "out")], SCONTROL_PARTITION_NODES="127.0.0.1,localhost",
                 **LOST_NODE_1)
    text = job.communicate(timeout=60)[0]
    assert requeues(tmp_path) == ["requeue 4242"], text
    assert "not excluding localhost: ExcNodeList=localhost would leave 1 node(s) of partition batch for a job of 2" \
        in text, text


@pytest.mark.parametrize("own", [True, False])
def test_the_nodes_left_are_counted_in_the_jobs_own_reservation(tmp_path, own):
    """In a reservation the nodes left are its own; a job submitted from inside a job in a reservation inherits its
    SLURM_JOB_RESERVATION (sbatch copies the environment): the parent's were counted (here too few: not excluded,
    the lost node kept). Its record names no reservation: its partition's are counted, and the variable unset."""
    if not own:
        (tmp_path / "scontrol.log.state").write_text("own_env=0\n")  # the job's record: no Reservation=
    job = sbatch(tmp_path, "0", ["--output_dir", str(tmp_path / "out")], SLURM_JOB_RESERVATION="resv",
                 SCONTROL_RESERVATION_NODES="127.0.0.1,localhost", SCONTROL_PARTITION_NODES="127.0.0.1,localhost,c,d",
                 **LOST_NODE_1)
    text = job.communicate(timeout=60)[0]
    if own:
        assert requeues(tmp_path) == ["requeue 4242"] and "would leave 1 node(s) of reservation resv" in text, text
    else:
        assert requeues(tmp_path) == ["requeue 4242", "update JobId=4242 ExcNodeList=localhost"], text
        assert "SLURM_JOB_RESERVATION=resv is not this job's (inherited): unset" in text, text


def progress_run(tmp_path, code: str, latest: int, before: str, **env: str) -> tuple[int, str]:
    out = tmp_path / "out"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "LATEST").write_text(f"step_{latest:06d}")
    (tmp_path / ".cache" / "slurm").mkdir(parents=True)
    (tmp_path / ".cache" / "slurm" / "4242.progress").write_text(before + "\n")
    job = sbatch(tmp_path, code, ["--output_dir", str(out)], **env)
    return job.wait(timeout=60), job.stdout.read()


def test_healthy_requeues_are_not_counted(tmp_path):
    """The 61st run of a job on short allocations, each bringing a newer checkpoint: requeued (it used to give up
    after MAX_REQUEUES=50 restarts, ~8 days of 4-hour allocations, while still progressing)."""
    code, text = progress_run(tmp_path, "75", 120, "0 100", SLURM_RESTART_COUNT="60")
    assert code == 0 and requeues(tmp_path) == ["requeue 4242"], text
    assert (tmp_path / ".cache" / "slurm" / "4242.progress").read_text() == "0 120\n"


@pytest.mark.parametrize("code", ["69", "75"])
def test_requeues_without_progress_end_the_job(tmp_path, code):
    """A rank that dies silently (69, no node named: a deterministic segfault, a host OOM kill), or a run preempted
    each time before it saves: the 4th requeue in a row without a newer checkpoint is not made (the 69 used to be
    requeued up to 50 times)."""
    rc, text = progress_run(tmp_path, code, 100, "3 100", **TWO_NODES)
    assert rc == int(code) and requeues(tmp_path) == [], text
    # nor by Slurm: a site's RequeueExit listing 69 or 75 requeued it, the book wiped, the bound never tripping
    assert updates(tmp_path) == ["update JobId=4242 Requeue=0"], text
    assert "4 requeues in a row without a newer checkpoint (newest: step 100) > ULYSSES_MAX_STALLED_REQUEUES=3: not " \
           "requeueing" in text, text


def test_a_run_on_a_node_its_last_requeue_meant_to_exclude_requeues_again(tmp_path):
    """The last requeue recorded its exclusion (.cache/slurm/<job>.exclude) but its update never landed (cut by the
    requeue's SIGKILL under a busy controller): this run starts on that node. It requeues again without it before any
    work (it used to train there: the exclusion lost)."""
    (tmp_path / ".cache" / "slurm").mkdir(parents=True)
    (tmp_path / ".cache" / "slurm" / "4242.exclude").write_text("localhost\n")
    job = sbatch(tmp_path, "0", ["--output_dir", str(tmp_path / "out")], **TWO_NODES)
    text = job.communicate(timeout=60)[0]
    assert not (tmp_path / "fake.log").exists(), text  # no launcher started
    assert "this run landed on localhost, which the last requeue meant to exclude" in text, text
    assert requeues(tmp_path) == ["requeue 4242", "update JobId=4242 ExcNodeList=localhost"], text
    assert not (tmp_path / ".cache" / "slurm" / "4242.exclude").exists()  # landed this time


def test_a_requeue_a_busy_controller_refuses_is_tried_again(tmp_path):
    """The first two `scontrol requeue` calls time out (a busy slurmctld): the third lands (it used to give up after one:
    'requeue failed', the job ended with the preemption's 75 and the chain stopped)."""
    job = sbatch(tmp_path, "75", ["--output_dir", str(tmp_path / "out")], SCONTROL_FAIL_REQUEUES="2")
    text = job.communicate(timeout=60)[0]
    assert job.returncode == 0 and requeues(tmp_path) == ["requeue 4242"], text
    assert text.count("Socket timed out") == 2, text


def with_checkpoint(tmp_path) -> str:
    """An output folder holding a committed checkpoint (so a requeue records its progress in the book)."""
    out = tmp_path / "out"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "LATEST").write_text("step_000100")
    return str(out)


def test_a_requeue_no_try_of_which_is_answered_leaves_requeue_on_and_the_book(tmp_path):
    """Every `scontrol requeue` times out (a busy controller): "requeue failed", exit 75. The EXIT trap then set
    Requeue=0, which turned off the site's fallback (a RequeueExit listing 75 requeues the job), and wiped the book.
    A requeue this shell wanted leaves Requeue alone and keeps the book."""
    job = sbatch(tmp_path, "75", ["--output_dir", with_checkpoint(tmp_path)], SCONTROL_FAIL_REQUEUES="3")
    text = job.communicate(timeout=60)[0]
    assert job.returncode == 75 and "requeue failed" in text and text.count("Socket timed out") == 3, text
    assert updates(tmp_path) == [] and (tmp_path / ".cache" / "slurm" / "4242.progress").exists(), text


def test_a_requeue_that_landed_unanswered_leaves_the_next_allocation_requeueable(tmp_path):
    """A busy controller applies the first `scontrol requeue` but its answer is lost; the retries time out. The
    requeue's own TERM came between two tries, the trap read PENDING, the next try reset that, "requeue failed", and
    the EXIT trap set Requeue=0 on the pending job: its next allocation's time limit was not requeued, the chain ended.
    Now the PENDING read is the requeue: exit 0, the book kept, and the next allocation's time limit is requeued."""
    wrap = tmp_path / "wrap"
    wrap.mkdir()
    (wrap / "scontrol").write_text(f"""#!/usr/bin/env bash
if [ "$1" = requeue ]; then  # the first lands, its answer lost; the others time out unapplied
  n=$(cat "$SCONTROL_LOG.wrapn" 2>/dev/null || echo 0); echo $((n + 1)) > "$SCONTROL_LOG.wrapn"
  [ "$n" = 0 ] && {STUBS}/scontrol "$@" > /dev/null 2>&1
  echo "scontrol: error: Socket timed out on send/recv operation" >&2; exit 1
fi
exec {STUBS}/scontrol "$@"
""")
    (wrap / "scontrol").chmod(0o755)
    job = sbatch(tmp_path, "75", ["--output_dir", with_checkpoint(tmp_path)],
                 PATH=f"{wrap}:{STUBS}:{os.environ['PATH']}")
    text = job.communicate(timeout=60)[0]
    assert job.returncode == 0 and "requeue failed" not in text and "the job is pending already" in text, text
    assert updates(tmp_path) == [] and state(tmp_path).get("requeue") != "0", text
    assert (tmp_path / ".cache" / "slurm" / "4242.progress").exists(), text
    text = ended_as(tmp_path, "TIMEOUT", SCONTROL_KILL_WAIT="10", SLURM_RESTART_COUNT="1")
    assert "requeue is disabled" not in text and requeues(tmp_path) == ["requeue 4242"] * 2, text


@pytest.mark.parametrize("then", [None, "TIMEOUT"])
def test_a_term_that_does_not_end_the_job_leaves_the_calls_unbounded(tmp_path, then):
    """`scancel --batch --signal=TERM` (or `sbatch --signal=B:TERM@N`, a person's kill) while the job RUNS: no SIGKILL
    follows. Its TERM started the KillWait clock all the same: once the save outlasted KillWait every scontrol call got
    1 s, and a busy controller's requeue (2 s) was cut three times: not requeued. Only a state that ends the job starts
    the clock now. TIMEOUT: the time limit's TERM after it was never read (only the first TERM was): the requeue waited
    for the ranks' save, SIGKILL first; now read, and requeued inside KillWait."""
    job = sbatch(tmp_path, "wait", ["--output_dir", str(tmp_path / "out")], FAKE_SAVE_S="6", KILL_WAIT_S="4",
                 SCONTROL_RPC_S="0" if then else "2", SCONTROL_KILL_WAIT="4")
    try:
        wait_for(lambda: ready(tmp_path), 90, "the stand-in launcher")
        slurm(tmp_path, "scancel", "--batch", "--signal=TERM", "4242")
        wait_for(lambda: "got SIG" in (tmp_path / "fake.log").read_text(), 30, "the save request")
        if then:
            slurm(tmp_path, "scontrol", "_end", "4242", then)
        text = job.communicate(timeout=60)[0]
    finally:
        job.kill()
    assert "SIGTERM with JobState=RUNNING" in text and requeues(tmp_path) == ["requeue 4242"], text
    assert ("JobState=TIMEOUT: requeueing now" in text) == bool(then), text
    assert then or (job.returncode == 0 and "requeue failed" not in text), text


def test_a_requeue_turned_back_on_during_the_run_is_used(tmp_path):
    """Requeue=0 at the start (`sbatch --no-requeue`), then `scontrol update JobId=J Requeue=1` by the user: the time
    limit was not requeued (no call made: the start's reading decided). One call is made (a disabled one is refused at
    once), and it lands."""
    (tmp_path / "scontrol.log.state").write_text("requeue=0\n")
    job = sbatch(tmp_path, "wait", ["--output_dir", str(tmp_path / "out")], SCONTROL_KILL_WAIT="10")
    try:
        wait_for(lambda: ready(tmp_path), 90, "the stand-in launcher")
        slurm(tmp_path, "scontrol", "update", "JobId=4242", "Requeue=1")
        slurm(tmp_path, "scontrol", "_end", "4242", "TIMEOUT")
        text = job.communicate(timeout=30)[0]
    finally:
        job.kill()
    assert text.count("requeue is disabled for this job") == 1, text  # said at the start
    assert requeues(tmp_path) == ["requeue 4242"] and state(tmp_path)["state"] == "PENDING", text


def test_a_scancel_during_the_exit_traps_update_is_no_stop_request(tmp_path):
    """A failure (exit 3) not requeued: the EXIT trap's `scontrol update JobId=J Requeue=0` (slow: 3 s) and a scancel
    meanwhile. The TERM trap ran after training had ended: PREEMPT touched in the run's folder, "the ranks save if
    they can", and the update's "Job has already finished" became a note that a RequeueExit would requeue a
    cancelled job. Now the TERM trap does nothing once the EXIT trap has begun, and that answer is no note."""
    out = tmp_path / "out"
    out.mkdir()
    job = sbatch(tmp_path, "3", ["--output_dir", str(out)], SCONTROL_SLOW="update JobId=4242 Requeue=0:3")
    text = during_slow_call(tmp_path, job, "the exit trap's update", "scancel", "4242")
    assert job.returncode == 3 and "failed with 3: not requeueing" in text, text
    assert not (out / "PREEMPT").exists() and "save if they can" not in text and "RequeueExit" not in text, text


def test_a_requeue_cut_at_its_bound_says_so(tmp_path):
    """The time limit on a controller slower than a third of KillWait: each requeue try is cut at its bound, and the
    job's log got an empty line for each (scontrol killed, nothing printed). It says "no answer within N s"."""
    text = ended_as(tmp_path, "TIMEOUT", KILL_WAIT_S="6", SCONTROL_RPC_S="3", SCONTROL_KILL_WAIT="40")
    assert "no answer within 2 s" in text and "requeue failed (JobState=TIMEOUT)" in text, text
    assert "" not in text.splitlines() and requeues(tmp_path) == [] and updates(tmp_path) == [], text


def test_the_records_settle_wait_ends_inside_killwait_after_an_ending_term(tmp_path):
    """A TERM whose state ends the job but is none the trap names (NODE_FAIL: save and requeue) starts the KillWait
    clock; node 1's exit record is not visible yet (a shared file system's cache: 40 s) and STATE_SETTLE_S (60) is
    longer than KillWait (12): the wait for it ends KillWait - 10 s after the TERM, so the requeue (node 1 lost) lands
    before Slurm's SIGKILL (the wait ran to KillWait + 10 s, the job killed unrequeued: mutation audit mutC, M24)."""
    env = dict(TWO_NODES, FAKE_EXIT_0="wait", FAKE_EXIT_1="late:75:40", STATE_SETTLE_S="60", KILL_WAIT_S="12",
               SCONTROL_KILL_WAIT="12")
    job = sbatch(tmp_path, "wait", ["--output_dir", str(tmp_path / "out")], **env)
    try:
        wait_for(lambda: (tmp_path / "fake.log").exists() and "node 0: ready" in (tmp_path / "fake.log").read_text(),
                 90, "node 0's stand-in launcher")
        slurm(tmp_path, "scontrol", "_end", "4242", "NODE_FAIL")
        text = job.communicate(timeout=60)[0]
    finally:
        job.kill()
    assert requeues(tmp_path)[:1] == ["requeue 4242"], text
