"""How often `save_interval_minutes: auto` saves at scale (audit 68): training/stage.py's real loop on
test_stop_window's simulated clock, with a background write of 96 s after a 1 s snapshot (Llama-3-8B, ~96 GB per save at
~1 GB/s). The next save is due the interval less the measured write (to durable, not to the commit at the next step
boundary) and a step, at least 1.5 steps after the last; a `save_steps` save's wait for a write in flight does not
stretch `auto`. Lost work (the age of the newest committed state, at any moment) stays within the documented bound
(docs/checkpoints.md, *Lost work*). Single process, no engine: < 2 s."""

from __future__ import annotations

import time

import pytest

from tests.unit.training.test_stop_window import SNAPSHOT_S, simulate
from training.preemption import AUTO_SAVE_EVERY_S, PreemptionFlag

WRITE_S = 96.0


def saves_and_worst_age(ckpt) -> tuple[list[int], float]:
    """The steps saved, and the oldest the newest committed state got before each commit (the run starts at 1000)."""
    taken = [1_000.0] + [t for _, t, _ in ckpt.commits]
    return [s for s, _, _ in ckpt.started], max(c - taken[i] for i, (_, _, c) in enumerate(ckpt.commits))


def test_a_step_longer_than_what_is_left_of_the_interval_saves_every_second_step(monkeypatch):
    """1M on 64 GPUs: a step of ~296 s. The write was measured from the save's start to its commit, which waits for
    the next step boundary (>= one step), so the next save was due at once: a save (~96 GB) after every step, 5.7 TB
    in the stage's 60 steps. Now every second step; lost work <= 3 steps (2 between saves + the write's step)."""
    step = 295.86
    clock, ckpt, flag, state, _ = simulate(monkeypatch, steps=20, save_every_s="auto", step_s=step,
                                           ckpt_kw={"write_s": WRITE_S})
    saves, worst = saves_and_worst_age(ckpt)
    assert saves == list(range(2, 21, 2)), saves  # before: [2, 3, 4, ..., 20]
    assert worst <= 3 * step + 2 * SNAPSHOT_S + 1, worst  # (+ two snapshots and the commit)


def test_the_interval_counts_the_write_until_durable_not_the_wait_for_the_commit(monkeypatch):
    """128k (a step of 26.9 s): the save at step 12 is durable 97 s after its start and commits at the first step
    boundary after that, ~109 s; the next save comes 540 - 97 - one step after it. Lost work <= 9 min + one step."""
    seen = []
    real = PreemptionFlag.committed
    monkeypatch.setattr(PreemptionFlag, "committed", lambda self, w: (seen.append(w), real(self, w)))
    step = 26.9
    clock, ckpt, flag, state, _ = simulate(monkeypatch, steps=40, save_every_s="auto", step_s=step,
                                           ckpt_kw={"write_s": WRITE_S})
    saves, worst = saves_and_worst_age(ckpt)
    assert seen[0] == pytest.approx(SNAPSHOT_S + WRITE_S)  # before: ~108.7 (to the commit)
    assert ckpt.commits[0][2] - ckpt.commits[0][1] > SNAPSHOT_S + WRITE_S + 10  # (the commit's own time: later)
    assert saves == [12, 28, 40] and worst <= AUTO_SAVE_EVERY_S + step, (saves, worst)


def test_a_save_steps_save_waiting_for_a_time_saves_write_keeps_auto_at_9_minutes(monkeypatch):
    """The recipes' `save_steps: 50` under `auto` at 128k: the time save at step 98 is still writing when step 100's
    save_steps save comes; that save waits for it. The wait counted in its blocked time, so `auto` became 100 x it
    (~72 min here; 115 min in the audit's run) and no time save came for the rest of the stage: lost work 634 s > 9 min
    + one step. A longer interval would not shorten that wait: it no longer counts."""
    step = 26.9
    clock, ckpt, flag, state, _ = simulate(monkeypatch, steps=120, save_every_s="auto", step_s=step, save_steps=50,
                                           ckpt_kw={"write_s": WRITE_S})
    saves, worst = saves_and_worst_age(ckpt)
    assert saves == [12, 28, 44, 50, 66, 82, 98, 100, 116, 120], saves  # 100 waited for 98's write
    assert flag.save_every_s == AUTO_SAVE_EVERY_S  # before: ~4330 s, and no save at 116
    assert worst <= AUTO_SAVE_EVERY_S + step, worst


def test_due_after_floors():
    """The rule itself: interval - write - step, at least half the interval and 1.5 steps (2 steps between saves)."""
    flag = PreemptionFlag(None, save_every_s="auto")
    flag.write_s, flag.deadline.step_s = 97.0, 26.9
    assert flag.due_after_s() == pytest.approx(540 - 97 - 26.9)
    flag.write_s = 400.0
    assert flag.due_after_s() == 270  # a slow file system: half the interval
    flag.write_s, flag.deadline.step_s = 97.0, 295.86
    assert flag.due_after_s() == pytest.approx(1.5 * 295.86)


def test_a_straggler_step_does_not_hold_the_cadence_for_the_stage():
    """The floor took the stage's longest step: one straggler (or the first step's warm-up) of 600 s at 1M held saves
    4 steps apart for the rest of the stage (a review). The last measured step's now; the time limit keeps the
    longest (Deadline.step_s)."""
    flag = PreemptionFlag(None, save_every_s="auto")
    flag.write_s = 97.0
    for seconds in (600.0, 296.0, 295.0):
        flag.deadline.record_step(seconds)
    assert flag.deadline.step_s == 600.0 and flag.due_after_s() == pytest.approx(1.5 * 295.0)


def test_the_checkpointer_measures_a_background_write_to_durable(tmp_path):
    """Checkpointer.written_s: the save's start until every rank's write is durable (the writer's own time), not
    the later step boundary that commits it."""
    from tests.unit.training.test_checkpoint import FakeConfig
    from tests.unit.training.test_checkpoint_async import TorchEngine
    from training.checkpoint import Checkpointer

    ck, eng = Checkpointer(str(tmp_path), keep=2), TorchEngine()
    ck.save(eng, 1, {"step": 1}, {}, FakeConfig(), background=True)
    p = ck.pending
    ck.pending.snapshot.wait()
    time.sleep(0.3)  # the rest of the step: the commit comes at its boundary
    path, seconds = ck.poll()
    assert p.blocked_s <= ck.written_s <= seconds - 0.25
