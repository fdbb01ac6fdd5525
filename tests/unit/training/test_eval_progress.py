"""A stage's evaluation builds every trial at a length before its first forward (training/evaluation.py `task_scores`):
at 1M tokens a common_words trial took ~17 s to build, and with no progress tick 25 of them passed the evaluation's
hang bound (300 s: 2 x the longest forward stretch, at least MIN_S) on rank 0's monitor (base/progress.py Tracker):
a healthy evaluation was aborted as "hung together" and requeued. Each built trial ticks now. Fake clock, the real
Tracker and `progress.tick`, a stand-in model (test_heldout_chat.TokenEngine), small trials: ~1 s."""

from __future__ import annotations

import training.evaluation as ev
from base import progress
from data.tokenizer import Tokenizer
from tests.unit.training.test_heldout_chat import DIMS1, SP, TokenEngine


def test_building_many_slow_trials_is_not_judged_a_hang(monkeypatch):
    tok = Tokenizer(SP)
    tracker, clock, lines = progress.Tracker(world=2), [0.0], []
    # this rank's progress as a run's marks leave it (the publisher itself needs a job's store: not started here)
    monkeypatch.setattr(progress, "_MINE", {"count": 0, "step": 7, "value": "0 7 forward"})

    def poll(seconds: float) -> None:  # both ranks in step (an evaluation every rank runs), rank 0 polls
        clock[0] += seconds
        value = progress._MINE["value"]
        lines.append(tracker.observe(clock[0], [value, value]))

    for _ in range(30):  # a stage's forwards, a layer's tick every 10 s: the eval bound is the 300-s floor
        progress.tick()
        poll(10)
    progress.mark(None, "eval")  # training/stage.py marks the evaluation
    poll(10)
    built = []

    def slow_trial(task, tokenizer, length, depth, rng, chat=None):
        built.append(task)
        poll(30)  # a common_words trial took 17-39 s to build at 1M before (one encode per word and occurrence)
        return real(task, tokenizer, length, depth, rng, chat)

    real = ev.trial
    monkeypatch.setattr(ev, "trial", slow_trial)
    acc, _ = ev.task_scores(TokenEngine(tok.vocab_size), DIMS1, 1, tok.pad_id, tok, {"common_words": 12}, [0.5], 256)
    poll(10)
    assert len(built) == 12 and set(acc) == {"common_words"}
    assert 12 * 30 > tracker.bound("eval") == 300  # without a tick per trial the building alone passed the bound
    assert not any(lines), [x for x in lines if x]
