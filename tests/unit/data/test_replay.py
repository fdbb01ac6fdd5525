"""Short-context replay (data/replay.py): the recipe forms and their one-line refusals; a stage's view with
replay: samples of the stage's length made of shorter ones with restarted positions, the token shares reached
and reported, DP ranks disjoint, exact resume from the JSON state."""

from __future__ import annotations

import json

import numpy as np
import pytest

from data.replay import ReplaySampler, parse_replay
from data.sampler import ResumableSampler


@pytest.mark.parametrize("spec, want", [
    (None, {}), ({256: 0.3}, {256: 0.3}), ({"256": 0.25, 512: 0.05}, {256: 0.25, 512: 0.05}),
    ({"share": 0.4, "lengths": [256, 512]}, {256: 0.2, 512: 0.2})])
def test_parse_replay_forms(spec, want):
    assert parse_replay(spec, 2048) == pytest.approx(want)


@pytest.mark.parametrize("spec, match", [
    ([256], "expected"), ({256: 1.5}, r"in \(0, 1\)"), ({256: 0.6, 512: 0.5}, "sum to"),
    ({2048: 0.1}, "shorter than"), ({300: 0.1}, "divide"), ({"short": 0.1}, "not a length"),
    ({"share": 0.3}, "both keys"), ({"share": "x", "lengths": [256]}, "a number")])
def test_parse_replay_refusals_are_one_line(spec, match):
    with pytest.raises(ValueError, match=match) as e:
        parse_replay(spec, 2048, "stage 1 (s2k) replay")
    assert "\n" not in str(e.value) and str(e.value).startswith("stage 1 (s2k) replay")


def test_sampler_shares_dp_disjoint_and_exact_resume():
    """dp=2, micro-batch 2, stage 64 tokens, replay at 16 (30%) and 32 (10%): shares within one micro-step
    at every point, the two ranks never read the same short sample, and a JSON round trip resumes exactly."""
    def make(rank):
        short = {16: ResumableSampler(400, 2, rank, 2 * 4, seed=1), 32: ResumableSampler(300, 2, rank, 2 * 2, seed=2)}
        return ReplaySampler(ResumableSampler(100, 2, rank, 2, seed=0), short, {16: 0.3, 32: 0.1}, 64, 2)

    r0, r1 = make(0), make(1)
    for n in range(1, 41):
        b0, b1 = r0.next_batch(), r1.next_batch()
        assert len(b0) == 2
        if isinstance(b0[0], tuple):
            assert b0[0][0] == b1[0][0] and not {i for _, t in b0 for i in t} & {i for _, t in b1 for i in t}
            assert all(len(t) == 64 // m for m, t in b0)
        shares = r0.source_shares()
        assert abs(shares["replay16"] - 0.3) <= 1 / n + 1e-12 and abs(shares["replay32"] - 0.1) <= 1 / n + 1e-12
    assert shares == pytest.approx({"stream": 0.6, "replay16": 0.3, "replay32": 0.1})
    state = json.loads(json.dumps(r0.state_dict()))
    ref = [r0.next_batch() for _ in range(25)]
    again = make(0)
    again.load_state_dict(state)
    assert [again.next_batch() for _ in range(25)] == ref
    with pytest.raises(ValueError, match="replay lengths"):
        ReplaySampler(ResumableSampler(100, 2, 0, 2, 0), {}, {}, 64, 2).load_state_dict(state)


def test_stage_view_packs_short_task_samples_with_restarted_positions():
    """A 512-token stage with 50% passkey and replay {256: 0.5} on the demo corpus: a replay sample is two
    256-token samples of the stage's mixture side by side (positions 0..255 twice: the attention masks them
    apart), the shares are in the sampler's report, and a bad replay stops the run at open_run_data."""
    from data.pipeline import open_run_data
    from training.config import config_from_dict
    from training.curriculum import resolve_stages

    def stages(replay, n=512):
        cfg = config_from_dict({"max_seq_length": n, "max_steps": 4, "stages": [
            {"name": "a", "max_seq_length": n, "tasks": {"passkey": 0.5}, "replay": replay}]})
        return resolve_stages(cfg, dp_of_sp=lambda sp: 1)

    st = stages({256: 0.5})
    data = open_run_data(None, None, 2048, st, False)
    ds, sampler = data.stage_view(st[0], 1, 0, 2, seed=0)
    kinds = []
    for _ in range(8):
        idx = sampler.next_batch()
        for i in idx:
            s = ds[i]
            assert len(s["input_ids"]) == len(s["shift_labels"]) == 512
            if isinstance(i, tuple):
                assert np.array_equal(s["position_ids"], np.tile(np.arange(256), 2))
                assert s["shift_labels"][255] == -100  # no label across the two packed samples
        kinds.append("replay" if isinstance(idx[0], tuple) else "own")
    assert kinds.count("replay") == 4
    shares = sampler.source_shares()
    assert shares["replay256"] == 0.5 and shares["stream"] + shares["task:passkey"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match=r"stage 0 \(a\) replay: length 100 must .* divide"):
        stages({100: 0.2})
    with pytest.raises(ValueError, match="too short for a passkey trial"):
        open_run_data(None, None, 2048, stages({16: 0.2}), False)


def test_a_stage_whose_replay_tasks_or_mixture_was_removed_is_refused_in_one_line():
    """A stage's `replay:`, `tasks:` or `data:` removed since the checkpoint: the innermost sampler indexed keys the
    wrapper's state lacks (KeyError 'epoch'). Now one line naming what the checkpoint's position was saved by; one
    added says so too."""
    from data.mixture import MixtureSampler

    plain = ResumableSampler(100, 2, 0, 2, seed=0)
    replay = ReplaySampler(ResumableSampler(100, 2, 0, 2, seed=0), {16: ResumableSampler(400, 2, 0, 8, seed=1)},
                           {16: 0.3}, 64, 2).state_dict()
    mixture = MixtureSampler([11, 5], [0.7, 0.3], ["a", "b"], 2, 0, 2, 4).state_dict()
    tasks = {"tasks": ["passkey"], "drawn": 3, "counts": [2, 1], "base": plain.state_dict()}
    mixed_replay = {**replay, "base": mixture}  # replay kept, the mixture under it removed
    for state, sampler, said in [
            (replay, plain, r"replay lengths \[16\]; this stage has no replay lengths"),
            (mixture, plain, r"mixture components \['a', 'b'\]; this stage has no mixture components"),
            (tasks, plain, r"synthetic tasks \['passkey'\]; this stage has no synthetic tasks"),
            (tasks, MixtureSampler([11], [1.0], ["x"], 2, 0, 2, 4), "this stage has no synthetic tasks"),
            (mixed_replay, ReplaySampler(ResumableSampler(100, 2, 0, 2, seed=0),
                                         {16: ResumableSampler(400, 2, 0, 8, seed=1)}, {16: 0.3}, 64, 2),
             "this stage has no mixture components"),
            (plain.state_dict(), MixtureSampler([11], [1.0], ["x"], 2, 0, 2, 4),  # added: said as before
             r"a stage with no mixture components; this stage has mixture components \['x'\]")]:
        with pytest.raises(ValueError, match=said) as e:
            sampler.load_state_dict(json.loads(json.dumps(state)))
        assert "\n" not in str(e.value) and str(e.value).endswith("resume with the same recipe (or --resume none)")
