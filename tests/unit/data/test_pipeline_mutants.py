"""The pretraining data pipeline's blind spots, found by mutation (stop 71: 65 one-line mutants of data/sampler.py,
mixture.py, heldout.py, replay.py, sharding.py, pipeline.py; 21 that change what trains or what is evaluated survived
the suite). Each test here fails on its mutant (named in the test's name: S sampler, M mixture, H heldout, R replay, SH
sharding, PL / X13 pipeline), applied in a scratch clone: a resume under another dp or onto a shrunk epoch, the last
batch's padding, micro-batches > 1, a new order per epoch and per stage, the length bounds' edges, upsampling's copies,
held-out samples that start inside a document (they read into the next training document), the spread pool offering a
document twice. One process, no model: ~2 s."""
import types

import numpy as np
import pytest

from data.heldout import heldout_split, sample_starts
from data.mixture import Component, MixtureSampler, select_documents
from data.replay import ReplaySampler, parse_replay
from data.sampler import ResumableSampler
from data.sharding import segment_ids


def test_S2_last_batch_padded_on_every_rank():
    ss = [ResumableSampler(21, 2, r, 1, seed=0) for r in (0, 1)]
    got = [[s.next_batch() for _ in range(s.batches_per_epoch)] for s in ss]
    assert [len(b) for g in got for b in g] == [1] * 22
    assert {i for g in got for b in g for i in b} == set(range(21))


def test_S4_X11_each_epoch_its_own_order():
    s = ResumableSampler(10, 1, 0, 1, seed=0)
    e0 = [s.next_batch()[0] for _ in range(10)]
    e1 = [s.next_batch()[0] for _ in range(10)]
    assert sorted(e1) == list(range(10)) and e0 != e1
    assert s.state_dict()["epoch"] == 1


def test_S6_micro_batches_do_not_overlap():
    s = ResumableSampler(8, 1, 0, 2, seed=0)
    got = [i for _ in range(4) for i in s.next_batch()]
    assert sorted(got) == list(range(8))


def test_S8_resume_under_another_dp_counts_every_rank():
    state = {"epoch": 0, "taken": 5, "dp": 2, "micro_batch": 1, "num_samples": 20, "seed": 3}
    s = ResumableSampler(20, 4, 0, 1, seed=3)
    s.load_state_dict(state)
    assert s.taken == 2  # 10 samples consumed / 4 per step


def test_S9_resume_past_a_shrunk_epoch_rolls_over():
    state = {"epoch": 0, "taken": 9, "dp": 1, "micro_batch": 1, "num_samples": 10, "seed": 0}
    s = ResumableSampler(5, 1, 0, 1, seed=0)
    s.load_state_dict(state)
    b = s.next_batch()
    assert len(b) == 1 and s.epoch == 1


def test_M3_component_epochs_reshuffle():
    s = MixtureSampler([5], [1.0], ["a"], 1, 0, 1, seed=0)
    e0 = [s.next_batch()[0] for _ in range(5)]
    e1 = [s.next_batch()[0] for _ in range(5)]
    assert sorted(e1) == list(range(5)) and e0 != e1


def test_M9_M10_length_bounds_inclusive_and_complementary():
    lens = np.array([9, 10, 11])
    src = np.zeros(3, np.int32)
    long = Component("long", ("*",), 0.6, min_doc_tokens=10)
    short = Component("short", ("*",), 0.4, max_doc_tokens=9)
    shortinc = Component("s10", ("*",), 0.4, max_doc_tokens=10)
    assert select_documents(long, ["web"], src, lens).tolist() == [1, 2]
    assert select_documents(shortinc, ["web"], src, lens).tolist() == [0, 1]
    both = sorted(select_documents(long, ["web"], src, lens).tolist() + select_documents(short, ["web"], src, lens).tolist())
    assert both == [0, 1, 2]  # the docstring's 65536 / 65535 pair: every document in exactly one


def test_M11_M12_upsample_copies():
    lens = np.array([5, 10, 20])
    c = Component("a", ("*",), 1.0, upsample_min_tokens=10, upsample_factor=3)
    assert select_documents(c, ["web"], np.zeros(3, np.int32), lens).tolist() == [0, 1, 2, 1, 2, 1, 2]


def test_H2_exact_fit_sample_starts():
    assert sample_starts(np.array([100]), 100, 1) == [0]
    assert sample_starts(np.array([100, 100]), 100, 2) == [0, 100]


def test_R1_replay_micro_batch_samples_disjoint():
    class Short:
        def next_batch(self):
            return [10, 11, 12, 13]
    class Base:
        def next_batch(self):
            return [0, 1]
    r = ReplaySampler(Base(), {256: Short()}, {256: 0.99}, 512, micro_batch=2)
    assert r.next_batch() == [(256, (10, 11)), (256, (12, 13))]


def test_R5_shares_summing_to_one_refused():
    with pytest.raises(ValueError, match="sum below 1"):
        parse_replay({256: 0.5, 512: 0.5}, 1024)


def test_SH2_one_token_documents_are_their_own_segments():
    assert segment_ids(np.array([0, 1, 0, 0, 1])).tolist() == [0, 0, 1, 2, 2]


def test_PL2_heldout_sample_inside_a_document_continues_into_the_next_held_one():
    from data.pipeline import RunData
    lens = np.array([150, 40, 60, 50])  # held: docs 0 and 2 (not adjacent in the stream)
    tokens = np.concatenate([np.full(n, 1000 * d) + np.arange(n) for d, n in enumerate(lens)]).astype(np.uint32)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    prepared = types.SimpleNamespace(tokens=tokens, starts=starts, lens=lens, mask=None)
    cut = lens.copy()
    cut[[0, 2]] = 0
    data = RunData(prepared, cut, np.array([0, 2]), None, True)
    s = data.heldout(100, 2)
    want = np.concatenate([tokens[100:150], tokens[190:240]])
    assert s[1]["input_ids"].tolist() == want.tolist()
    assert not set(s[1]["input_ids"].tolist()) & set(tokens[150:190].tolist())  # doc 1 trains


def test_PL3_two_stages_at_one_length_draw_different_orders(tmp_path):
    import json

    from data.pipeline import open_run_data
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps({"input_ids": [d + 1] * 64}) + "\n" for d in range(40)))
    st = [types.SimpleNamespace(index=i, name=f"s{i}", max_seq_length=64, eval={"heldout_samples": 0}, data=None,
                                tasks={}) for i in range(2)]
    data = open_run_data(str(p), None, 100, st, reset_position_ids=True)
    s0, s1 = data.stage_view(st[0], 1, 0, 1, 0)[1], data.stage_view(st[1], 1, 0, 1, 0)[1]
    assert [s0.next_batch()[0] for _ in range(10)] != [s1.next_batch()[0] for _ in range(10)]


def test_H10_spread_yields_each_document_once():
    lens = np.array([2000, 30] * 10)
    cut, held, _ = heldout_split(lens, [(50, 2)], min_train=50)
    assert len(set(held.tolist())) == len(held) and (cut >= 0).all()
    assert held.tolist() == [13, 5, 15, 7] and (lens - cut)[held].tolist() == [30] * 4


def test_X13_two_mixture_stages_at_one_length_draw_different_orders(tmp_path):
    import json

    from data.pipeline import open_run_data
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps({"input_ids": [d + 1] * 64}) + "\n" for d in range(40)))
    st = [types.SimpleNamespace(index=i, name=f"s{i}", max_seq_length=64, eval={"heldout_samples": 0},
                                data={"*": 1.0}, tasks={}) for i in range(2)]
    data = open_run_data(str(p), None, 100, st, reset_position_ids=True)
    s0, s1 = data.stage_view(st[0], 1, 0, 1, 0)[1], data.stage_view(st[1], 1, 0, 1, 0)[1]
    assert [s0.next_batch()[0] for _ in range(10)] != [s1.next_batch()[0] for _ in range(10)]
