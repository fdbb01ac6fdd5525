"""A stop always fits its window (issue 41 items 2 and 3): training/stage.py's real step loop, run on a simulated
clock with a checkpointer stand-in whose saves take the times a large run's take (Llama-3-8B on 32 ranks, projected:
a step 60 s, a background write 95 s after a 1 s snapshot, a synchronous save 95 s) and a launcher that SIGKILLs
every rank KILL_WINDOW_S after its SIGTERM (deepspeed launch.py, torchrun). Checked: a SIGTERM commits the write in
flight when it ends inside the window and never starts a save that cannot finish there, exits before the kill; a
SIGUSR1 keeps its full save; the time-limit stop finishes before the job's end wherever that end falls; lost work
on a stop is at most the save interval plus one step. Single process, no engine: < 1 s."""

from __future__ import annotations

import dataclasses
import signal
import types

import numpy as np
import pytest
import torch

from base.parallel import ParallelDims
from training import preemption, stage_records
from training import stage as stage_mod
from training.checkpoint import TrainState, tag_for
from training.preemption import KILL_WINDOW_S, Deadline, PreemptionFlag

STEP_S, SNAPSHOT_S, WRITE_S, SYNC_S, COMMIT_S = 60.0, 1.0, 95.0, 95.0, 0.1  # a write of the same bytes: 95 s either way


class Clock:
    """time.time / monotonic / perf_counter of the modules under test, one simulated clock."""

    def __init__(self):
        self.t = 1_000.0

    def time(self):
        return self.t

    monotonic = perf_counter = time

    def sleep(self, s):
        self.t += s


@dataclasses.dataclass
class Pending:
    step: int
    started: float
    done_at: float
    blocked_s: float = SNAPSHOT_S
    snapshot: object = dataclasses.field(default_factory=lambda: types.SimpleNamespace(nbytes=0, copy_s=SNAPSHOT_S))


class SimCheckpointer:
    """Checkpointer's interface (save/poll/finish/pending) on the simulated clock: a background save's snapshot takes
    SNAPSHOT_S and its write is durable WRITE_S later; a synchronous save takes SYNC_S; a commit COMMIT_S."""

    def __init__(self, clock, write_s=WRITE_S, sync_s=SYNC_S):
        self.clock, self.write_s, self.sync_s = clock, write_s, sync_s
        self.pending: Pending | None = None
        self.started: list[tuple[int, float, str]] = []  # (step, when, kind)
        self.commits: list[tuple[int, float, float]] = []  # (step, state taken at, committed at)
        self.written_s: float | None = None  # Checkpointer.written_s: the last background write, start to durable

    def restore_stage(self, *a):
        return False

    def release_staging(self):
        """Checkpointer.release_staging: a stage's end gives the staging back, never under a write in flight."""
        assert self.pending is None, "the staging released under a write in flight"
        return 0

    def save(self, engine, step, trainer, rank_state, hf_config, stage_end=None, background=False):
        assert self.pending is None
        t0 = self.clock.t
        self.started.append((step, t0, "background" if background else "sync"))
        if background:
            self.clock.t += SNAPSHOT_S
            self.pending = Pending(step, t0, self.clock.t + self.write_s)
            return None
        self.clock.t += self.sync_s
        self.commits.append((step, t0, self.clock.t))
        return f"/ck/{tag_for(step)}"

    def poll(self):
        if self.pending is not None and self.clock.t >= self.pending.done_at:
            return self.finish()
        return None

    def finish(self, timeout_s=None):
        p = self.pending
        if p is None:
            return None
        wait = max(0.0, p.done_at - self.clock.t)
        if timeout_s is not None and wait > timeout_s:
            self.clock.t += max(0.0, timeout_s)
            return None
        self.clock.t += wait + COMMIT_S
        self.pending, self.written_s = None, p.done_at - p.started
        self.commits.append((p.step, p.started, self.clock.t))
        return f"/ck/{tag_for(p.step)}", self.clock.t - p.started


def stub_stage(monkeypatch, module, **overrides) -> None:
    """training/stage.py's collaborators replaced by stand-ins (no engine, model, data or collective): an engine around
    `module`, a step of 1 s, no evaluation; `overrides` (name=function) replace any of them. The step's record and the
    engine's release (training/stage_records.py) read their own peak memory and gc: stood in for there."""
    fns = {"build_engine": lambda *a, **k: types.SimpleNamespace(get_lr=lambda: [1e-3], module=module),
           "stage_config": lambda cfg, s: cfg, "_record_ds_config": lambda *a: None,
           "apply_rope": lambda *a: None, "features_of": lambda c: None, "make_loss_fn": lambda f: None,
           "shard": lambda b, *a: b, "collate": lambda *a: None, "_after_first_step": lambda *a: None,
           "train_step": lambda *a, **k: {"loss": 1.0, "step_time": 1.0, "label_tokens": 1},
           "evaluate_stage": lambda *a: None, "release_engine": lambda e: None, "heldout_samples": lambda e: 0,
           "model_hash": lambda c: "h", "to_dict": lambda c: {}, "gc": types.SimpleNamespace(collect=lambda: 0)}
    for name, fn in {**fns, **overrides}.items():
        monkeypatch.setattr(stage_mod, name, fn)
    monkeypatch.setattr(stage_records, "peak_memory_gb", lambda: 0.0)
    monkeypatch.setattr(stage_records, "gc", fns["gc"])


def stub_data(heldout):
    """The run's data as the stage loop reads it: one sample per batch, `heldout` for the stage's evaluation."""
    sampler = types.SimpleNamespace(next_batch=lambda: [0], state_dict=lambda: {}, source_shares=lambda: {})
    return types.SimpleNamespace(stage_view=lambda *a: ([0], sampler), pad_id=0, tokenizer=None, heldout=heldout,
                                 heldout_split=None, tokenizer_vocab=None, cut=np.array([1 << 40]),  # tokens
                                 reply_stops=lambda: [], trained_template=lambda: None, reset_position_ids=True)


def simulate(monkeypatch, steps=40, time_limit_s=0.0, save_every_s=600.0, signal_at=None, sig=signal.SIGTERM,
             save_s=None, ckpt_kw=None, step_s=STEP_S, save_steps=0, stubs=None):
    """Run training/stage.train_stage (the real loop) for `steps` steps of `step_s`; `signal_at`: (step, seconds
    into it) at which every rank gets `sig`; `stubs(flag, clock, got)`: more of stage.py's collaborators replaced (its
    `got["signal"]`: the time a signal it sends came). Returns (clock, checkpointer, flag, state, the SIGTERM's time)."""
    clock = Clock()
    monkeypatch.setattr(stage_mod, "time", clock)
    monkeypatch.setattr(preemption, "time", clock)
    monkeypatch.delenv("SLURM_JOB_END_TIME", raising=False)
    monkeypatch.delenv("KILL_WINDOW_S", raising=False)
    ckpt = SimCheckpointer(clock, **(ckpt_kw or {}))
    flag = PreemptionFlag(None, Deadline(time_limit_s, now=clock.t), save_every_s=save_every_s)
    if save_s is not None:
        flag.deadline.record_save(save_s)  # a save measured before (an earlier stage, or this job's first save)
    got = {"signal": None}

    def step(engine, micro, world, loss_fn=None):
        if signal_at and state.step + 1 == signal_at[0]:
            clock.t += signal_at[1]
            got["signal"] = clock.t
            flag._handler(sig, None)
            clock.t += step_s - signal_at[1]
        else:
            clock.t += step_s
        return {"loss": 1.0, "step_time": step_s, "label_tokens": 1}

    module = torch.nn.Linear(1, 1, bias=False)
    module.weight.ds_numel = 8_030_000_000  # Llama-3-8B's parameters, as ZeRO-3 records them on a partitioned one
    stub_stage(monkeypatch, module, train_step=step, **(stubs(flag, clock, got) if stubs else {}))
    data = stub_data(heldout=lambda *a: None)
    cfg = types.SimpleNamespace(seed=0, per_device_train_batch_size=1, gradient_accumulation_steps=1, save_steps=save_steps,
                                async_save=True, loss_weighting=None, output_dir="/unused")
    run = stage_mod.Run(cfg, ParallelDims(world=32, sp=1, rank=0, local_rank=0), data, ckpt,
                        types.SimpleNamespace(log=lambda r: None, run_id=None, home=None, begin_stage=lambda end, start=None: None),
                        flag, types.SimpleNamespace(), "sdpa", False)
    st = types.SimpleNamespace(index=0, name="s", max_steps=steps, sp=1, cp=1, max_seq_length=64, rope=None,
                               deepspeed_overrides=None, reset_optimizer=False, eval=None, memory_choice=None,
                               steps_from="steps")
    state = TrainState()
    stage_mod.train_stage(run, st, [st], state)
    return clock, ckpt, flag, state, got["signal"]


def test_sigterm_commits_the_write_in_flight_and_starts_no_save_that_cannot_finish(monkeypatch):
    """Saves every 10 min (the first after 6 steps: 600 s less the guessed write and a step); SIGTERM 50 s into the
    step after a snapshot (its 60 s write ends 1 s after that step, inside the window): that write commits, the stop's own synchronous save (60 s) is not started, every rank is out before
    the kill. Before: the stop waited for the write, then started the 95 s save and was SIGKILLed in it."""
    clock, ckpt, flag, state, term = simulate(monkeypatch, save_every_s=600, signal_at=(7, 50.0),
                                              ckpt_kw={"write_s": 60.0, "sync_s": 60.0})  # a faster file system
    assert flag.stopping and flag.window_left_s is not None
    assert clock.t <= term + KILL_WINDOW_S, (clock.t - term, ckpt.started)
    assert [s for s, _, kind in ckpt.started] == [6] and ckpt.commits[-1][0] == 6  # the write in flight
    assert ckpt.commits[-1][2] <= term + KILL_WINDOW_S
    assert state.checkpoint.endswith(tag_for(6))


def test_sigterm_with_a_write_that_cannot_finish_exits_in_the_window(monkeypatch):
    """A background write of 200 s in flight (a loaded file system): not waited for past the window, nothing new
    committed, every rank out before the kill (the previous checkpoint stays the newest complete one)."""
    clock, ckpt, flag, state, term = simulate(monkeypatch, save_every_s=600, signal_at=(7, 50.0),
                                              ckpt_kw={"write_s": 200.0})
    assert clock.t <= term + KILL_WINDOW_S
    assert ckpt.pending is not None and ckpt.pending.step == 6 and ckpt.commits == []
    assert [kind for _, _, kind in ckpt.started] == ["background"]  # no save started in the window


def test_sigterm_saves_when_the_measured_save_fits(monkeypatch):
    """A small model (saves measured at 3 s): the SIGTERM stop still saves the step it reached, inside the window."""
    clock, ckpt, flag, state, term = simulate(monkeypatch, save_every_s=0, signal_at=(5, 50.0), save_s=3.0,
                                              ckpt_kw={"sync_s": 3.0})
    assert clock.t <= term + KILL_WINDOW_S
    assert [(s, kind) for s, _, kind in ckpt.started] == [(5, "sync")] and state.checkpoint.endswith(tag_for(5))


def test_sigusr1_keeps_the_full_save(monkeypatch):
    """SLURM's warning (SIGUSR1 through slurm.sbatch/launch.sh, sized by @N) is not timed by a launcher: the write in
    flight commits, then the stop's own synchronous save, whatever it takes."""
    clock, ckpt, flag, state, _ = simulate(monkeypatch, save_every_s=600, signal_at=(7, 50.0), sig=signal.SIGUSR1)
    assert flag.window_left_s is None
    assert [(s, kind) for s, _, kind in ckpt.started] == [(6, "background"), (7, "sync")]
    assert [c[0] for c in ckpt.commits] == [6, 7] and state.checkpoint.endswith(tag_for(7))


@pytest.mark.parametrize("measured", [False, True])
def test_the_time_limit_stop_always_finishes_before_the_job_ends(monkeypatch, measured):
    """Wherever the job's end falls (every 3 s over ten minutes), the run stops by itself and its last commit and its
    exit come before the end: 20 s steps (a write spans several), a background save every 5 minutes. Before: right
    after a background snapshot the check reserved nothing for the write it had just started, so the loop ran one
    more step and the stop (the rest of the write, then a full save) overran the end (TIMEOUT, never requeued)."""
    overruns = []
    for limit in range(800, 1_400, 3):
        clock, ckpt, flag, state, _ = simulate(monkeypatch, steps=100, time_limit_s=limit, save_every_s=300,
                                               save_s=SYNC_S if measured else None, step_s=20.0)
        end = flag.deadline.end
        if flag.stopping and (clock.t > end or ckpt.pending is not None):
            overruns.append((limit, round(clock.t - end, 1)))
    assert overruns == []


def test_lost_work_on_a_stop_is_at_most_the_interval_plus_one_step(monkeypatch):
    """Saves every 10 min whose write takes 100 s, SIGTERM at every moment of a save cycle: the newest checkpoint
    committed before the kill holds the state of at most 10 min + one step before the stop (the next save comes one
    measured write early). Before: up to the interval + a step + the write in flight that cannot finish."""
    worst = 0.0
    for at in range(0, 60, 5):
        for step in range(9, 22):
            clock, ckpt, flag, state, term = simulate(monkeypatch, steps=40, save_every_s=600, signal_at=(step, at),
                                                      ckpt_kw={"write_s": 100.0})
            kill = term + KILL_WINDOW_S
            kept = [1_000.0] + [taken for _, taken, when in ckpt.commits if when <= kill]  # (the run's start)
            worst = max(worst, min(clock.t, kill) - max(kept))  # the work done since the state a resume loads
    assert worst <= 600 + STEP_S, worst


def test_the_wait_for_the_previous_write_counts_as_blocked_time(monkeypatch):
    """`save_interval_minutes: auto` is 100 x the seconds the last periodic save held the steps, the wait for the
    write in flight included when the save was due by time: steps of 20 s, writes of 400 s (a loaded file system).
    The first save comes at step 17 (540 s less the guessed write, ~193 s, and a step: 327 s); the second is due
    327 s later, at step 34 (681 s in), and waits 60 s for step 17's write (durable 741 s in), then snapshots (1 s):
    it held the steps ~61 s, so the interval stretches to ~6100 s. Before (issue 35): the wait was not counted."""
    clock, ckpt, flag, state, _ = simulate(monkeypatch, steps=40, save_every_s="auto", step_s=20.0,
                                           ckpt_kw={"write_s": 400.0})
    assert [(s, kind) for s, _, kind in ckpt.started] == [(17, "background"), (34, "background"), (40, "sync")]
    assert flag.save_every_s == pytest.approx(100 * (60 + COMMIT_S + SNAPSHOT_S))


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGUSR2])
def test_a_users_signal_is_a_save_request_never_a_kill(sig):
    """SIGUSR2 reaches a rank directly when a user runs `scancel --signal=USR2` without --batch (slurm.sbatch reads
    the same signal to its shell as a stop after the save): a rank takes it as SIGUSR1, a full save with no kill
    window. Before, it was not caught and killed the rank (Python's default)."""
    import os

    from training.preemption import PreemptionFlag

    flag = PreemptionFlag().install()
    try:
        os.kill(os.getpid(), sig)
        assert flag.received == sig and flag.term_at is None
    finally:
        flag.uninstall()


def test_a_stop_asked_while_the_job_starts_is_kept(tmp_path):
    """OUTPUT_DIR/PREEMPT written during a job's start (`touch PREEMPT` or scancel --signal=USR2 while the resume or a
    universal conversion runs: minutes) was deleted as the previous job's request, unseen, and the job trained on to
    its time limit. Only a request older than this process' start is removed."""
    import os
    import time

    from training.startup import clear_honoured_stop

    stop = tmp_path / "PREEMPT"
    stop.write_text("")
    old = time.time() - 300
    os.utime(stop, (old, old))  # the previous job's: written before this process started
    assert clear_honoured_stop(str(stop), started=time.time() - 5) and not stop.exists()
    stop.write_text("")  # asked 60 s into this job's start
    assert not clear_honoured_stop(str(stop), started=time.time() - 60) and stop.exists()
    assert not clear_honoured_stop(str(tmp_path / "none"), started=time.time())
    # under slurm.sbatch, which removed the previous job's before its traps: any one found is this job's (a USR2 to
    # the batch shell before the ranks existed wrote it)
    os.utime(stop, (old, old))
    os.environ["ULYSSES_STOP_CLEARED"] = "1"
    try:
        assert not clear_honoured_stop(str(stop), started=time.time()) and stop.exists()
    finally:
        del os.environ["ULYSSES_STOP_CLEARED"]


def test_the_stages_evaluation_is_judged_and_what_follows_is_not(monkeypatch):
    """The stage's evaluation is judged a hang (`eval`: a rank stuck in its collectives is named at its forwards'
    floor, not at dist_timeout_s), the release, the stop's agreement and the run's teardown after it are not (`idle`:
    rank 0 waits there for the rotation's deletions with no tick; judged as `eval`, a finished run was declared hung)."""
    from base import progress

    marks = []
    monkeypatch.setattr(progress, "mark", lambda step, phase: marks.append(phase))
    simulate(monkeypatch, steps=3)  # (its evaluate_stage: a stand-in between the two marks)
    assert marks[:2] == ["build", "restore"] and marks[-3:] == ["save", "eval", "idle"], marks


def exit_code(flag) -> int:
    """train.py's exit after train_stage returns: 75 (run.exit_preempted) when the stop was agreed, else it goes on."""
    from training.job import EXIT_PREEMPTED

    return EXIT_PREEMPTED if flag.stopping else 0


def test_a_sigterm_during_the_build_stops_before_the_first_step(monkeypatch):
    """SIGTERM while the stage builds its engine and restores (minutes at 8B): every rank stops right after the
    restore, trains nothing and saves nothing (the checkpoint restored is the resume point), inside the window; exit 75.
    Before: the first check came after a full step (a 1M step ~296 s; here 60 s), past the launcher's SIGKILL."""

    def stubs(flag, clock, got):
        def build(*a, **k):
            clock.t += 20.0  # ZeRO-3 init
            got["signal"] = clock.t
            flag._handler(signal.SIGTERM, None)
            clock.t += 5.0  # the rest of it, then the restore
            return types.SimpleNamespace(get_lr=lambda: [1e-3], module=torch.nn.Linear(1, 1, bias=False))
        return {"build_engine": build}

    clock, ckpt, flag, state, term = simulate(monkeypatch, steps=5, stubs=stubs)
    assert state.step == 0 and ckpt.started == [] and ckpt.commits == []  # train_step never called, nothing saved
    assert exit_code(flag) == 75 and clock.t <= term + KILL_WINDOW_S


def test_a_stop_during_the_stage_evaluation_leaves_it_unrecorded(monkeypatch):
    """SIGTERM during the stage's evaluation (4 forward batches of 15 s: the audit's 45 s) after its end was committed:
    the stop is agreed before the next batch, the evaluation is not recorded (the resume evaluates the stage again),
    every rank exits 75 inside the window. Before: nothing checked during the evaluation; the launcher SIGKILLed rank 0
    30 s after the TERM, the others failed with "Connection closed by peer" (exit 143)."""
    forwards, recorded = [], []

    def stubs(flag, clock, got):
        class Engine:
            module = torch.nn.Linear(1, 1, bias=False)

            def get_lr(self):
                return [1e-3]

            def __call__(self, **batch):
                forwards.append(clock.t)
                if len(forwards) == 2:  # the TERM comes at the second batch's start
                    got["signal"] = clock.t
                    flag._handler(signal.SIGTERM, None)
                clock.t += 15.0

        def evaluate(engine, stage, dims, heldout, tok, metrics, step, *a):  # training/evaluation.evaluate_stage's shape
            for _ in range(4):
                engine(input_ids=None)  # model_utils/tiled_loss.eval_stats: a forward batch
            recorded.append(step)  # metrics.log_eval: after the last forward

        return {"build_engine": lambda *a, **k: Engine(), "evaluate_stage": evaluate}

    clock, ckpt, flag, state, term = simulate(monkeypatch, steps=3, stubs=stubs)
    assert [c[0] for c in ckpt.commits] == [3] and state.checkpoint.endswith(tag_for(3))  # the stage's end, before
    assert len(forwards) == 2 and recorded == []
    assert exit_code(flag) == 75 and clock.t <= term + KILL_WINDOW_S
