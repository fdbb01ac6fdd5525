"""Preemption: a signal only sets a flag; at a boundary every rank agrees through one all-reduce.

SIGTERM (schedulers, the deepspeed launcher), SIGUSR1 (SLURM `--signal`), SIGUSR2 (a user's `scancel --signal=USR2`:
slurm.sbatch then stops instead of requeueing; a rank saves the same) and SIGINT (Ctrl-C). A rank
that got no signal still stops with the others, so all ranks save the same step and exit together with
EXIT_PREEMPTED, which launch scripts read as "requeue me".

A save request (SIGUSR1/SIGUSR2) that comes before the flag is installed (during the start-up: the process group, the
resume lookup, the data; minutes at scale) is recorded from the rank's first line (training/job.py) and taken at
install(), the same as one received after it: ssh and slurmstepd start the ranks with its default action, terminate.

A file works as a signal too (OUTPUT_DIR/PREEMPT): launchers do not forward SIGUSR1 to their children,
so scripts/slurm.sbatch traps SLURM's warning in the batch shell and touches this file on the shared
file system. Rank 0 alone looks for it (and alone removes it when a run starts): another node may still see
a removed file for up to a minute, and its vote would stop the requeued job at its first step.

The launcher's death is a stop request too. Under a plain `deepspeed --num_gpus N train.py` (no scripts/launch.sh) a
`kill <runner pid>` ended the runner alone (deepspeed/launcher/runner.py handles SIGTERM only for pdsh on several
nodes): launch.py was reparented and the ranks trained on, unsaved, with nothing left to stop them. Each rank notes
launch.py and its parent at its first line and votes to stop once either is gone (training/launcher.py launcher_gone: one
/proc read per check), with the full save: no launcher is left to SIGKILL after it.

The time limit is a stop reason too: a 1M-token step on 8 GPUs takes minutes, longer than SLURM's 120 s
warning, and a job killed at its limit ends TIMEOUT and is never requeued. With SLURM_JOB_END_TIME (epoch
seconds, set by SLURM >= 23.02; before 23.02 rank 0 reads EndTime from `scontrol show job` at its first check, and
scripts/slurm.sbatch exports what it read at the job's start) or `--time_limit_s`, rank 0 votes to stop when less than
one measured step plus one measured save (and a margin) remains (slurmctld's end read again first: an extension or a
resume moves it at once, Deadline.near_confirmed); until a save has been measured, `SAVE_GUESS_S` stands in for it.
A SLURM job whose end nothing gives says so in one line.

Every time measured here leaves out the seconds this process was stopped (`scontrol suspend`, gang scheduling:
base/stopped.py): Slurm moves EndTime later by the suspended time, and a step or save timed across a 2 h suspend,
kept as the longest, stopped the job 2 h early for the rest of its allocation (and a save's blocked time made `auto`'s
interval 100 x the suspend). The step's time is read on a clock that stands still while stopped (training/step.py);
the others are intervals that end at the call, less the stops within them.

The time ahead of a check counts all the work before the next one: after the step that ends a stage, the
save *and the stage's evaluation*; before a stage builds its engine, the build (ZeRO-3 init, restore) and its
first step. Each is measured the first time it runs; until then an evaluation counts as one step and a build
as nothing (the first build is at the job's start). At a stage change the step and the evaluation measured so far
are scaled to the next stage's length (`Deadline.next_stage`, training/stage.py `step_cost_ratio`: the planner's
predicted step times under `auto`, else the model's FLOPs per sequence at each length over each SP degree), and
the next stage's first measurement replaces the estimate; the build is not scaled (ZeRO-3 init and the restore
move the same bytes at any length).

Saves bounded by time (`save_interval_minutes`): rank 0's clock alone says when the interval has passed, and
its vote travels in the same all-reduce, so every rank saves the same step. `auto` (the default) is an interval of 9
minutes (a stop or a crash loses at most the interval plus one step, below), stretched where the last save blocked
the steps more than 1% of the interval (rank 0's measurement, rank 0's decision): 100 x the blocked seconds, the wait
for the previous write included when the save was due by time (a `save_steps` save's wait is not: a longer interval
would not shorten it). An asynchronous save blocks ~1 s (0.8 s projected for Llama-3-8B on 32 ranks): 9 minutes,
~0.2% (saves ~7 min apart, below). A synchronous one blocks for its whole write (95 s projected): 158 minutes, where 9
would cost 18% (docs/checkpoints.md). Until a save is measured, 9 minutes.

The interval I bounds the age of the newest *committed* checkpoint, not the gap between saves: the next save is due
`due_after_s` = I - W - S after the previous save's snapshot, W the last measured write (the save's start until every
rank's bytes are written and synced), S the last measured step (the commit waits for the step boundary after the
write), so saves come I - W - S apart (Llama-3-8B at 128k: ~7 min of `auto`'s 9) and a kill at any moment loses at most
I + one step (docs/checkpoints.md states the argument). At least I/2 and 1.5 steps apart: where a step is long (1M:
~296 s on 64 GPUs) a save every step would write ~96 GB every 5 minutes; a floor makes the bound D + W + 2S (1M:
every 2 steps, ~3 steps lost at most, ~15 min).

SIGTERM (and SIGINT under a launcher) is a stop with a kill window: where SLURM signals every process of the step
(proctrack/cgroup with cgroup.conf SignalChildrenProcesses=yes), the deepspeed launcher (`launch.py`:
`terminate_process_tree`, `wait_procs(timeout=30)`, then SIGKILL) and torchrun (`_close(timeout=30)`) get it too, so
the ranks are SIGKILLed `KILL_WINDOW_S` (30 s; env KILL_WINDOW_S; under torchrun its shutdown timeout: kill_window_s)
after it, whatever GraceTime says. (Under its default `no` a step's TERM reaches each node's task alone: slurm.sbatch
passes it to launch.sh, which asks the ranks for a save with SIGUSR1; Slurm's SIGKILL follows KillWait later.)
A SIGINT without a launcher (`python train.py`, `srun python train.py` under salloc: no LOCAL_SIZE, LOCAL_WORLD_SIZE
or LAUNCH_EXIT_DIR, what the deepspeed launcher, torchrun and scripts/launch.sh set) is
a Ctrl-C nothing kills after: a stop without a window, with its full save (it skipped a save longer than ~25 s and
lost up to a save interval); (under srun one Ctrl-C only prints the status; a second sends SIGINT and SIGKILL at
once, srun/signals.c: no window to fit there; scancel --signal=USR1 saves.)
Such a stop commits what can be committed in the window and exits (training/stage.py `_stop_in_window`): the
background write in flight if every rank's finishes in time, and the stop's own save only if the measured save
time (before one is measured: `guess_save_s`, from the rank's checkpoint bytes) fits what is left. At Llama-3-8B on
32 ranks a synchronous save is ~95 s (projected): it never fits, so a SIGTERM commits the write in flight or nothing
new, and exits 75 before the SIGKILL. SIGUSR1 (SLURM's `--signal` warning through slurm.sbatch/launch.sh, sized
by its @N) and the PREEMPT file keep the full save: no launcher times them.

Where the flag is checked (train.py, training/stage.py): after every step, after every save and evaluation, before
a stage builds its engine, after its build and restore (before its first step), and between the forward batches of
its evaluation (`StopChecked`); each check is one all-reduce of four numbers (MAX over ranks: stop, save due, how far past its
kill window the earliest SIGTERM is, the save time to count), so every rank decides the same from the collective,
never from its own clock alone.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time

from base import comm, stopped

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT, signal.SIGHUP)  # HUP: the terminal of a
# plain `deepspeed` / torchrun run closed (the ranks died of it unsaved): under deepspeed a stop with its full save
# (launch.py dies of it, killing nothing), under torchrun one in its window (its agent sends the workers its HUP and
# SIGKILLs them 30 s later: install); left ignored where `nohup` ignores it; launch.sh's ranks get its SIGUSR1
WINDOWED = (signal.SIGTERM, signal.SIGINT)  # the launchers get these too and SIGKILL the ranks KILL_WINDOW_S later
LAUNCHED = ("LOCAL_SIZE", "LOCAL_WORLD_SIZE", "LAUNCH_EXIT_DIR")  # deepspeed's launch.py, torchrun, scripts/launch.sh
KILL_WINDOW_S = 30.0  # deepspeed launch.py's wait_procs(timeout=30) and torchrun's default shutdown timeout
# (kill_window_s: env KILL_WINDOW_S, else under torchrun its own --shutdown-timeout / TORCH_ELASTIC_SHUTDOWN_TIMEOUT)
EXIT_MARGIN_S = 5.0  # from the window stop's last decision to the process's end (commit, engine release, exit)
# a save's time before one is measured, for the window stop only (the time-limit stop keeps SAVE_GUESS_S): the rank's
# checkpoint bytes at the slowest rate measured here (149 MB/s per node shared by its 8 ranks) plus DeepSpeed's own
# start and the commit. Llama-3-8B on 32 ranks: ~3.5 GB per rank (14 B a parameter: training/stage._rank_bytes) ->
# ~190 s (no SIGTERM save); the tiny test model: ~5 s
GUESS_RANK_BPS = 149e6 / 8
GUESS_FIXED_S = 5.0
NO_WINDOW = -1e18  # the window vote of a rank that got no SIGTERM
SAVE_GUESS_S = 300.0  # before the first measured save (Llama-3-8B, 32 ranks: ~100 GB at a few GB/s)
AUTO_SAVE_EVERY_S = 540.0  # save_interval_minutes auto: lost work <= 9 min + one step ...
MAX_SAVE_OVERHEAD = 0.01  # ... unless the saves would then block the steps > 1% of the time
# a save is due no sooner than this many measured steps after the last: 2 steps between saves at least. Llama-3-8B at
# 1M on 64 GPUs (step ~296 s, ~96 GB per save): without it I - W - S < one step made every step a save (5.7 TB in
# the stage's 60 steps, ~325 MB/s sustained on the shared file system); with it every 2 steps (~10 min, ~160 MB/s)
SAVE_GAP_STEPS = 1.5
MARGIN_S = 30.0
END_REFRESH_S = 300.0  # rank 0 reads the job's end time from slurmctld again this often (a time-limit update, a suspend)
END_CONFIRM_S = 5.0  # ... and once more, synchronously, bounded so, before it votes to stop on a slurmctld end
# (Deadline.near_confirmed): the other ranks wait in the all-reduce meanwhile (~50 ms a call; a busy controller's is cut)
_UNKNOWN_SAID: set[str] = set()  # the SLURM jobs whose unknown time limit was said (once per process)
WINDOWED_AT: list[float] = []  # this process's first SIGTERM/SIGINT under a launcher (its kill follows): a failure
# raised after it is the teardown of that stop (a peer SIGKILLed by its launch.py mid-step, its collective broken),
# not a crash of this node's own: training/job.py writes no crash verdict for it (a GraceTime preemption during a
# long step was failed, or requeued without a healthy node)


def slurm_end_time(job: str, timeout_s: float = 20.0) -> float | None:
    """The job's EndTime as slurmctld has it now (epoch seconds; `scontrol show job` prints the controller's local
    time, read here in this node's time zone); None where it cannot say within `timeout_s`."""
    try:
        p = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, timeout=timeout_s)
        m = re.search(r"EndTime=(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)", p.stdout)
        return time.mktime(time.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S")) if m else None
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return None


class Deadline:
    """When the job must be out: SLURM_JOB_END_TIME, else (a SLURM job on Slurm < 23.02, which sets no such variable)
    the EndTime of `scontrol show job`, read by rank 0 at its first check (`known`), else start + time_limit_s, else
    never. The times it keeps leave out this process's stopped seconds (`counter`: base/stopped.py's, its thread
    started here; tests give one on a fake clock)."""

    def __init__(self, time_limit_s: float = 0.0, now: float | None = None,
                 counter: stopped.StopCounter | None = None):
        self.stopped = (counter or stopped.COUNTER).start()
        now = time.time() if now is None else now
        end = os.environ.get("SLURM_JOB_END_TIME")
        self.end = float(end) if end else (now + time_limit_s if time_limit_s > 0 else None)
        self.step_s = 0.0  # longest step measured
        self.last_step_s = 0.0  # the last one (the save cadence's: record_step)
        self.save_s: float | None = None  # longest save measured
        self.build_s = 0.0  # longest engine build + restore measured
        self.eval_s: float | None = None  # longest stage evaluation measured
        self.rank_bytes: float | None = None  # this rank's checkpoint bytes (engine state), for guess_save_s
        self._refreshing = False
        self._from_slurm = bool(end)  # self.end is slurmctld's: refresh_from_slurm keeps it current
        # Slurm < 23.02 sets no SLURM_JOB_END_TIME (it came with SLURM_JOB_START_TIME in 23.02): scontrol's EndTime,
        # asked by rank 0 alone at its first reading (one `scontrol show job`, ~50 ms; 32 ranks asking would be 32)
        self._ask_slurm = bool(os.environ.get("SLURM_JOB_ID")) and not end
        # step_s / eval_s scaled from the previous stage's (next_stage): this stage's first measurement replaces it
        self._estimated = self._estimated_eval = False

    def known(self) -> float | None:
        """The job's end (epoch seconds; None: no limit known). In a SLURM job without SLURM_JOB_END_TIME (Slurm <
        23.02) it is read once, here, from `scontrol show job` (it wins over --time_limit_s, as SLURM_JOB_END_TIME
        does; synchronous, ~50 ms, at most scontrol's 20 s timeout, at the first check: before the first engine is
        built); where none can be read and no --time_limit_s was given, one line says the limit is unknown. Rank
        0's call (agreed(), a universal conversion's bound): its reading is the job's; the others' vote is not asked."""
        if self._ask_slurm:
            self._ask_slurm = False
            job = os.environ.get("SLURM_JOB_ID", "")
            end = slurm_end_time(job)
            if end is not None:
                self.end, self._from_slurm = end, True
            elif self.end is None and job not in _UNKNOWN_SAID:
                _UNKNOWN_SAID.add(job)
                from base.log import print0

                print0(f"warning: SLURM job {job}: the time limit is unknown (no SLURM_JOB_END_TIME: Slurm before "
                       f"23.02; no EndTime from `scontrol show job {job}`): no stop and save before it; give "
                       "--time_limit_s SECONDS (from train.py's start) to have one")
        return self.end

    def refresh_from_slurm(self, every_s: float = END_REFRESH_S) -> None:
        """Read the job's end time from slurmctld again every `every_s`, in a daemon thread (never on the step's
        path): SLURM_JOB_END_TIME (or the EndTime `known` read) is read once at start and goes stale after `scontrol
        update TimeLimit=` or a suspend. Rank 0 only (its reading is the job's: agreed() takes the time-limit vote from
        rank 0 alone). An end from --time_limit_s alone is kept as given."""
        job = os.environ.get("SLURM_JOB_ID")
        if self._refreshing or not job or self.known() is None or not self._from_slurm:
            return
        self._refreshing = True

        def run() -> None:
            while True:
                end = slurm_end_time(job)
                if end is not None:
                    self.end = end
                time.sleep(every_s)

        threading.Thread(target=run, name="slurm-end-time", daemon=True).start()

    def record_step(self, seconds: float) -> None:
        """A step's running time, read by training/step.py on base/stopped.py's clock, which stands still while this
        process is stopped (recorded after the step's logging: not an interval that ends at this call)."""
        self.step_s = seconds if self._estimated else max(self.step_s, seconds)
        self.last_step_s = seconds  # the save cadence's step (a straggler or the first step's warm-up is not every one)
        self._estimated = False

    # a save, a build and an evaluation: an interval that ends at the call, less this process's stops within it

    def record_save(self, seconds: float) -> None:
        self.save_s = max(self.save_s or 0.0, self.stopped.running(seconds))

    def record_build(self, seconds: float) -> None:
        self.build_s = max(self.build_s, self.stopped.running(seconds))

    def record_eval(self, seconds: float) -> None:
        seconds = self.stopped.running(seconds)
        self.eval_s = seconds if self._estimated_eval else max(self.eval_s or 0.0, seconds)
        self._estimated_eval = False

    def next_stage(self, cost: float) -> None:
        """A stage change: a step and an evaluation of the next stage cost `cost` times this one's (training/stage.py
        step_cost_ratio). The measured times are scaled by it until the next stage measures its own: its first step
        (evaluation) then replaces the estimate, longer or shorter. Without it the check before a longer stage's build
        counted the shorter stage's step: 512k -> 1M on Llama-3-8B at sp 8, a step x3.8 longer, so the job built,
        restored and stepped into its time limit (TIMEOUT, never requeued)."""
        self.step_s *= cost
        self.last_step_s *= cost
        self.eval_s = None if self.eval_s is None else self.eval_s * cost
        self._estimated = self._estimated_eval = True

    def record_rank_bytes(self, nbytes: float) -> None:
        self.rank_bytes = nbytes

    def guess_save_s(self) -> float:
        """A save's time for the window stop: the longest measured, else the rank's bytes at GUESS_RANK_BPS plus
        GUESS_FIXED_S, else SAVE_GUESS_S."""
        if self.save_s is not None:
            return self.save_s
        return SAVE_GUESS_S if self.rank_bytes is None else GUESS_FIXED_S + self.rank_bytes / GUESS_RANK_BPS

    def evaluation_s(self) -> float:
        """A stage evaluation's time: measured, else one step's (a few forward passes at the stage's length)."""
        return self.step_s if self.eval_s is None else self.eval_s

    def saving_s(self) -> float:
        """A save's time: the longest measured (a background one: snapshot to commit), else SAVE_GUESS_S."""
        return SAVE_GUESS_S if self.save_s is None else self.save_s

    def ahead_s(self, stage_ends: bool, write_in_flight: bool) -> float:
        """Work after a step, before the next check, beyond the step and the stop's own save: the stage's
        evaluation when the step ends the stage, and a background write in flight (the stop's save waits for it;
        before the first one commits, nothing is measured: SAVE_GUESS_S stands in, as for the stop's save)."""
        return (self.evaluation_s() if stage_ends else 0.0) + (self.saving_s() if write_in_flight else 0.0)

    def needed_s(self, ahead_s: float = 0.0) -> float:
        """One step, one save, the margin, and `ahead_s` of other work before the next check."""
        return self.step_s + self.saving_s() + MARGIN_S + ahead_s

    def near(self, now: float | None = None, ahead_s: float = 0.0) -> bool:
        if self.end is None:
            return False
        return (self.end - (time.time() if now is None else now)) < self.needed_s(ahead_s)

    def near_confirmed(self, ahead_s: float = 0.0) -> bool:
        """near(), with a slurmctld end read again first where it says so (rank 0's, agreed()): the refresh thread's
        reading is up to END_REFRESH_S old, and slurmctld moves EndTime at once at `scontrol update TimeLimit=+2:00:00`
        (src/slurmctld/job_mgr.c _update_job: end_time += the change) and at each resume of a suspended job
        (job_suspend: now + limit - pre_sus_time). A 1M stage extended 10 minutes before its old end voted "time limit"
        from the stale value: every rank saved, exited 75 and the job was requeued off its allocation. One `scontrol
        show job` (~50 ms; at most END_CONFIRM_S) each time near() turns true; no answer keeps the end it had (a stop:
        the safe side). An earlier end (a limit lowered) is near the same; an end from --time_limit_s is not asked."""
        if not self.near(ahead_s=ahead_s):
            return False
        job = os.environ.get("SLURM_JOB_ID")
        if self._from_slurm and job:
            end = slurm_end_time(job, END_CONFIRM_S)
            if end is not None:
                self.end = end
        return self.near(ahead_s=ahead_s)


SAID = {signal.SIGUSR1: "a save request: launch.sh's, or Slurm's --signal", signal.SIGUSR2: "a stop, not requeued",
        signal.SIGTERM: "a stop", signal.SIGINT: "Ctrl-C", signal.SIGHUP: "the terminal closed"}


def said(received) -> str:
    """What stopped the run, for its last line: a signal by name and meaning ("preempted (10)" said nothing)."""
    if isinstance(received, int) and received in SAID:
        return f"{signal.Signals(received).name}: {SAID[received]}"
    return str(received or "on another rank")


def auto_save_every_s(blocked_s: float | None) -> float:
    """`save_interval_minutes: auto` in seconds, from the last save's blocked time (None: none measured yet)."""
    return AUTO_SAVE_EVERY_S if blocked_s is None else max(AUTO_SAVE_EVERY_S, blocked_s / MAX_SAVE_OVERHEAD)


def kill_window_s(env, agent: list[str] | None = None) -> float:
    """Seconds from a SIGTERM to the launcher's SIGKILL: KILL_WINDOW_S where set; under torchrun (TORCHELASTIC_RUN_ID)
    its agent's shutdown timeout, which the workers were not told (`--shutdown-timeout`, PET_SHUTDOWN_TIMEOUT, else
    TORCH_ELASTIC_SHUTDOWN_TIMEOUT: torch/distributed/launcher/api.py LaunchConfig.__post_init__), read from its
    command line (`agent`, default this rank's parent's: training/launcher.py torchrun_options); else 30 s. A window
    longer than the default lets a SIGTERM stop commit the save it would have skipped; a shorter one is not overrun."""
    if env.get("KILL_WINDOW_S"):
        return float(env["KILL_WINDOW_S"])
    if env.get("TORCHELASTIC_RUN_ID"):
        from training.launcher import parent_cmdline, torchrun_options

        given = getattr(torchrun_options(parent_cmdline() if agent is None else agent), "shutdown_timeout", None)
        given = env.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT") if given is None else given
        if str(given or "").strip():
            return float(given)
    return KILL_WINDOW_S


class PreemptionFlag:
    def __init__(self, stop_file: str | None = None, deadline: Deadline | None = None,
                 save_every_s: float | str = 0.0):
        self.received: int | str | None = None  # what this rank saw
        self.stopping = False  # what all ranks agreed at the last check
        self.save_due = False  # ... and whether save_every_s has passed since the last save (rank 0's clock)
        self.stop_file = stop_file
        self.deadline = deadline or Deadline()
        self.auto_interval = save_every_s == "auto"
        self.save_every_s = auto_save_every_s(None) if self.auto_interval else float(save_every_s)
        self.write_s: float | None = None  # the last save's write (its start until every rank's bytes are durable, not
        # the wait for the commit's step boundary): the next save comes that much early; until one is measured, the
        # deadline's guess (guess_save_s)
        self._last_save = time.monotonic()  # when the last save's snapshot was taken
        self.window_s = kill_window_s(os.environ)
        self.term_at: float | None = None  # this rank's first SIGTERM/SIGINT (monotonic)
        # a launcher that kills its ranks after a SIGINT too (a terminal's Ctrl-C reaches it as well); none: no window
        self.windowed = WINDOWED if any(os.environ.get(k) for k in LAUNCHED) else (signal.SIGTERM,)
        if os.environ.get("TORCHELASTIC_RUN_ID"):  # torchrun's agent passes its HUP on to the workers (killpg) and
            self.windowed += (signal.SIGHUP,)  # SIGKILLs them shutdown_timeout (30 s) later; deepspeed's dies of it
        self.window_left_s: float | None = None  # agreed at the last check: seconds to the kill (None: no SIGTERM)
        self.save_need_s = 0.0  # ... and the save time to count (MAX over ranks of guess_save_s)
        self._previous = {}
        from training.launcher import launcher_gone

        self._launcher_gone = launcher_gone  # a plain deepspeed run whose runner died: a stop (training/launcher.py)

    def install(self) -> PreemptionFlag:
        """Handle the signals from now on, and take those a rank recorded since its first line (training/job.py
        record_early_signals: a save request during start-up) as received, in the order they came."""
        from training.job import early_signals

        for s in SIGNALS:  # a hang-up `nohup` ignores stays ignored (the run was meant to outlive the terminal)
            if s != signal.SIGHUP or signal.getsignal(s) != signal.SIG_IGN:
                self._previous[s] = signal.signal(s, self._handler)
        for signum in early_signals():  # after the handlers: one that comes between is this flag's own
            self._handler(signum, None)
        return self

    def _handler(self, signum, frame) -> None:  # no I/O, no collectives: just remember it
        if signum in self.windowed and self.term_at is None:
            self.term_at = time.monotonic()  # the launcher's kill comes window_s after this, a later SIGUSR1 or not
            WINDOWED_AT.append(self.term_at)
        self.received = signum


    def agreed(self, ahead_s: float = 0.0) -> bool:
        """True on every rank when any rank got a signal, rank 0 saw the stop file, or a rank is near the time
        limit with `ahead_s` of work before the next check; also sets `save_due` the same on every rank
        (a collective: call it on all ranks at the same points)."""
        if self.received is None and self.stop_file and comm.rank() == 0 and os.path.exists(self.stop_file):
            self.received = "stop file"
        if self.received is None:  # every rank's own vote (one /proc read); nothing SIGKILLs after it: a full save
            self.received = self._launcher_gone()
        # the time limit on one clock, rank 0's (a node whose clock runs ahead would stop every run, never named)
        if self.received is None and comm.rank() == 0:
            self.deadline.refresh_from_slurm()
            if self.deadline.near_confirmed(ahead_s=ahead_s):
                self.received = "time limit"
        now = time.monotonic()
        due = comm.rank() == 0 and self.save_every_s > 0 and now - self._last_save >= self.due_after_s()
        past = NO_WINDOW if self.term_at is None else now - self.term_at - self.window_s
        votes = comm.all_reduce([1.0 if self.received is not None else 0.0, float(due), past,
                                 self.deadline.guess_save_s()], op="max")
        self.stopping, self.save_due = bool(votes[0].item()), bool(votes[1].item())
        self.window_left_s = None if votes[2].item() <= NO_WINDOW / 2 else -votes[2].item()
        self.save_need_s = votes[3].item()
        return self.stopping

    def due_after_s(self) -> float:
        """Seconds after the last save's snapshot that the next save is due: the interval less the last measured
        write and the last measured step (the commit comes at the first step boundary after the write), so the
        newest committed checkpoint is never older than the interval plus one step. At least half the interval
        (where a write takes longer, saves would otherwise follow each other back to back) and SAVE_GAP_STEPS steps
        (a step longer than what is left: 1M). Before a write is measured, the guess of Deadline.guess_save_s
        (Llama-3-8B on 32 ranks: ~190 s, so the first save comes ~5 of `auto`'s 9 minutes after the start)."""
        write = self.deadline.guess_save_s() if self.write_s is None else self.write_s
        step = self.deadline.last_step_s or self.deadline.step_s  # the last step's (the longest one
        # would hold a straggler's 600 s at 1M for the whole stage: saves every 4 steps, ~25 min lost at most)
        return max(self.save_every_s - write - step, self.save_every_s / 2, SAVE_GAP_STEPS * step)

    def saved(self, blocked_s: float | None = None, at: float | None = None) -> None:
        """A save was made (committed, or snapshotted for a background write): the save interval starts again, from
        `at` (time.monotonic() when its state was taken: the save's start; default now). `blocked_s`: how long it
        held the steps, waiting for the previous write included, for the `auto` interval (rank 0's reading decides,
        as `due` does; None: keep the last measurement, for a save unlike the periodic ones, e.g. a stage's
        synchronous end). `blocked_s` ends at the call; the seconds this process was stopped within it are left out
        (base/stopped.py: a save blocked across a 1 h suspend made the interval 100 h)."""
        self._last_save = time.monotonic() if at is None else at
        self.save_due = False
        if self.auto_interval and blocked_s is not None:
            self.save_every_s = auto_save_every_s(self.deadline.stopped.running(blocked_s))

    def committed(self, write_s: float) -> None:
        """A save committed; its write took `write_s` from its start until every rank's bytes were durable
        (training/checkpoint.py `written_s`; a synchronous save: to its commit), less the stops within it (read as
        an interval that ends now): the next one comes that much earlier (`due_after_s`)."""
        self.write_s = self.deadline.stopped.running(write_s)

    def uninstall(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)


class EvalStopped(Exception):
    """A stop agreed between two forward batches of a stage's evaluation, raised on every rank at the same batch: the
    evaluation is left unrecorded (training/stage.py) and the resume evaluates the stage again from its end checkpoint,
    committed before the evaluation began."""


class StopChecked:
    """An engine as a stage's evaluation calls it: before each forward batch the stop is agreed (`flag.agreed()`), and
    EvalStopped is raised instead of the forward where it is. Every rank runs the same forward batches (training/
    evaluation.py sample_stats pads a round with filler samples; under ZeRO-3 each forward gathers every layer's
    parameters from all ranks, a collective already), so each check is at the same point on every rank. A SIGTERM
    during a 45 s evaluation was left to the launcher's SIGKILL 30 s later (rank 0 killed, the others failed "Connection
    closed by peer", exit 143). Cost per forward batch, as after a step: one all-reduce of four float64 (32 bytes:
    latency-bound, an estimate of ~0.1 ms at 512 ranks over NCCL's tree, not measured here; the copy back to the host
    waits for no work, the previous batch's `.cpu()` having synchronized), rank 0's stat of the stop file (~1 ms on
    NFS) and each rank's /proc read of its launcher, against seconds to minutes per batch at 128k-1M (a stage's
    evaluation is a few dozen batches). Everything else (eval(), train(), device) is the engine's."""

    def __init__(self, engine, flag: PreemptionFlag):
        self._engine, self._flag = engine, flag

    def __call__(self, *args, **kwargs):
        # the time limit's vote with nothing to save: the stage's end is committed, so only the margin must be left
        # (the step loop's budget, a step and a save ahead, abandoned a 1M stage's evaluation ~8 min early, and each
        # resume built the engine and evaluated again); a signal or the stop file stop it as before
        d = self._flag.deadline
        if self._flag.agreed(ahead_s=-(d.step_s + d.saving_s())):
            raise EvalStopped
        return self._engine(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._engine, name)
