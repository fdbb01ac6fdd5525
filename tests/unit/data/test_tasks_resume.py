"""TaskMixSampler's data position across a resume (data/tasks.py): a synthetic sample is a pure function of (seed,
task, serial), so a serial trained before the checkpoint and drawn again after it is an exact repeat. The serials are
global (all DP ranks together): a resume on fewer or more ranks, or another micro-batch, draws none again, and one on
the same layout continues with exactly the uninterrupted run's samples."""

from __future__ import annotations

import json

import pytest

from data.sampler import ResumableSampler
from data.tasks import TaskMixSampler


class Synthetic:
    """TaskMixDataset's index() alone: (task, serial) stands for the sample it names."""

    names = ["passkey", "niah_multikey"]

    def index(self, task: int, serial: int):
        return (self.names[task], serial)


FRACTIONS = {"passkey": 0.3, "niah_multikey": 0.2}


def ranks(dp: int, mb: int) -> list[TaskMixSampler]:
    return [TaskMixSampler(ResumableSampler(1000, dp, r, mb, 0), Synthetic(), FRACTIONS, dp, r, mb) for r in range(dp)]


def draw(samplers: list[TaskMixSampler], steps: int) -> list[list]:
    """Each rank's micro-batches, `steps` micro-steps of all ranks together."""
    out = [[] for _ in samplers]
    for _ in range(steps):
        for r, s in enumerate(samplers):
            out[r].append(s.next_batch())
    return out


def synthetic(batches: list[list]) -> list[tuple]:
    return [x for rank in batches for b in rank for x in b if isinstance(x, tuple)]


def saved(samplers: list[TaskMixSampler]) -> dict:
    """What a checkpoint holds (each rank's state through JSON); every rank's is the same."""
    states = [json.loads(json.dumps(s.state_dict())) for s in samplers]
    assert all({k: v for k, v in st.items() if k != "base"} == {k: v for k, v in states[0].items() if k != "base"}
               for st in states)  # the synthetic position agrees on every rank (a resume elsewhere reads rank 0's)
    return states[0]


@pytest.mark.parametrize("before, after", [((4, 1), (2, 1)), ((2, 2), (1, 1)), ((1, 2), (4, 1)), ((2, 1), (4, 2))])
def test_a_resume_on_another_layout_never_repeats_a_synthetic_sample(before, after):
    old = ranks(*before)
    seen = synthetic(draw(old, 20))
    assert len(seen) == len(set(seen)) > 0
    new = ranks(*after)
    state = saved(old)
    for s in new:
        s.load_state_dict(state)
    again = synthetic(draw(new, 20))
    assert len(again) == len(set(again)) > 0
    assert not set(seen) & set(again)  # before the serials: 20 of 40 repeated for 4 ranks -> 2


def test_a_resume_on_the_same_layout_continues_exactly():
    whole = draw(ranks(2, 2), 30)
    first = ranks(2, 2)
    head = draw(first, 13)
    state = saved(first)
    rest = ranks(2, 2)
    for r, s in enumerate(rest):
        s.load_state_dict(json.loads(json.dumps(first[r].state_dict())))  # each rank its own file, as checkpoints do
    tail = draw(rest, 17)
    assert [h + t for h, t in zip(head, tail)] == whole
    assert state["serials"] == [int(c) * 4 for c in state["counts"][1:]]  # what counts x dp x mb gave before


def test_a_state_saved_before_the_serials_continues_after_its_samples():
    old = ranks(4, 1)
    seen = synthetic(draw(old, 20))
    state = saved(old)
    del state["serials"]  # written before this change: its counts, under its wrapped sampler's dp and micro-batch
    same, fewer = ranks(4, 1), ranks(2, 1)
    for s in same + fewer:
        s.load_state_dict(state)
    assert draw(same, 10) == draw(old, 10)  # the same layout: exactly as the run would have gone on
    assert not set(seen) & set(synthetic(draw(fewer, 20)))
