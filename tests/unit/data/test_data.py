"""Data pipeline: packing and labels, padding to a multiple of SP, SP slicing, resumable DP sampling."""

import json

import numpy as np
import pytest

from data.packing import PackedDataset, build_token_stream
from data.sampler import ResumableSampler
from data.sharding import collate, shard


def _stream(tmp_path, docs):
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps({"input_ids": d}) + "\n" for d in docs))
    return build_token_stream(str(p), None, 100, str(tmp_path / "cache"))


def test_packing_labels_are_next_tokens(tmp_path):
    tokens, starts = _stream(tmp_path, [list(range(1, 11)), list(range(20, 30))])
    ds = PackedDataset(tokens, starts, 8, reset_position_ids=False)
    assert len(ds) == 20 // 8
    s = ds[1]
    assert s["input_ids"].tolist() == [9, 10, 20, 21, 22, 23, 24, 25]
    assert s["shift_labels"].tolist() == [10, 20, 21, 22, 23, 24, 25, -100]
    assert s["position_ids"].tolist() == list(range(8))


def test_reset_position_ids_at_document_starts(tmp_path):
    tokens, starts = _stream(tmp_path, [list(range(1, 11)), list(range(20, 30))])
    s = PackedDataset(tokens, starts, 8, reset_position_ids=True)[1]
    assert s["position_ids"].tolist() == [0, 1, 0, 1, 2, 3, 4, 5]


def test_collate_pads_to_multiple_of_sp_and_shards():
    sample = {"input_ids": np.arange(7), "shift_labels": np.arange(1, 8), "position_ids": np.arange(7)}
    b = collate([sample], sp=4, pad_id=0)
    assert b["input_ids"].shape == (1, 8)
    assert b["shift_labels"][0, -1] == -100 and b["position_ids"][0].tolist() == list(range(8))
    parts = [shard(b, 4, r) for r in range(4)]
    assert [p["input_ids"].shape[1] for p in parts] == [2, 2, 2, 2]
    assert sum(int((p["shift_labels"] != -100).sum()) for p in parts) == 7


def test_sampler_disjoint_over_dp_and_resumable():
    a, b = ResumableSampler(20, 2, 0, 1, seed=3), ResumableSampler(20, 2, 1, 1, seed=3)
    ia = [a.next_batch()[0] for _ in range(10)]
    ib = [b.next_batch()[0] for _ in range(10)]
    assert not set(ia) & set(ib) and len(set(ia) | set(ib)) == 20
    c = ResumableSampler(20, 2, 0, 1, seed=3)
    for _ in range(4):
        c.next_batch()
    state = c.state_dict()
    d = ResumableSampler(20, 2, 0, 1, seed=3)
    d.load_state_dict(state)
    assert [d.next_batch() for _ in range(12)] == [c.next_batch() for _ in range(12)]  # crosses an epoch


@pytest.mark.parametrize("content, match", [
    ("", "no documents"),
    ('{"input_ids": [1, 2]}\n{"text": 5}\n', r"d.jsonl:2: expected"),
    ('{"input_ids": [1, 2]}\nnot json\n', r"d.jsonl:2: not valid JSON"),
    ('{"input_ids": [1, 200]}\n', "token id 200 >= the model's vocab_size 100"),
    ('{"text": "hello"}\n', "needs --tokenizer_name_or_path"),
])
def test_bad_dataset_errors(tmp_path, content, match):
    p = tmp_path / "d.jsonl"
    p.write_text(content)
    with pytest.raises(ValueError, match=match):
        build_token_stream(str(p), None, 100, str(tmp_path / "cache"))


def test_demo_tokenizer_roundtrip():
    from data.corpus import build_demo_corpus
    from data.tokenizer import Tokenizer

    _, model = build_demo_corpus()
    tok = Tokenizer(model)
    text = "def f(x):\n    return x + 1\n"
    assert tok.decode(tok.encode(text)) == text
    assert tok.vocab_size <= 2048


def test_heldout_documents_are_fixed_for_the_run_and_never_trained_on(tmp_path):
    """The held-out tail is chosen once for the whole curriculum (enough for its largest evaluation): every stage
    evaluates on the same whole documents, packed to its own length, and no stage's training samples touch them."""
    import types

    from data.pipeline import open_run_data, split_point

    docs = [list(range(4 + d, 4 + d + n)) for d, n in enumerate([300, 120, 500, 90, 260, 400, 150, 700, 80, 220])]
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps({"input_ids": d}) + "\n" for d in docs))
    stages = [types.SimpleNamespace(index=i, name=f"s{i}", max_seq_length=n, eval={"heldout_samples": 2}, data=None,
                                    tasks={}) for i, n in enumerate((64, 128, 256))]
    data = open_run_data(str(p), None, 2048, stages, reset_position_ids=False)
    tokens, starts = data.tokens[0:len(data.tokens)], np.asarray(data.starts)
    assert data.boundary in set(starts.tolist())  # whole documents
    assert len(tokens) - data.boundary >= 2 * 256  # the largest evaluation fits
    held = tokens[data.boundary:]
    for st in stages:
        n = st.max_seq_length
        for k, s in enumerate(data.heldout(n, 2)):  # the same tail documents at every length, packed to it
            assert s["input_ids"].tolist() == held[k * n: (k + 1) * n].tolist()
        ds, _ = data.stage_view(st, 1, 0, 1, 0)
        assert (len(ds) + 1) * st.max_seq_length > data.boundary >= len(ds) * st.max_seq_length
        last = ds[len(ds) - 1]["input_ids"]
        assert last.tolist() == tokens[(len(ds) - 1) * st.max_seq_length: len(ds) * st.max_seq_length].tolist()
    # a stream of a few huge documents is cut inside the last one rather than leave nothing to train on
    assert split_point(1000, np.array([0, 10]), need=200, min_train=100) == 800
    with pytest.raises(ValueError, match="held-out documents need 900"):
        split_point(1000, np.array([0]), need=900, min_train=200)


def _reset_positions_quadratic(seq_len, inside):
    """The previous implementation (O(documents x length)): the oracle."""
    pos = np.arange(seq_len, dtype=np.int64)
    for s in inside:
        pos[s:] = np.arange(seq_len - s)
    return pos


def test_reset_positions_equals_the_quadratic_loop_on_random_layouts():
    from data.packing import reset_positions

    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(1, 400))
        k = int(rng.integers(0, n))  # up to every offset a document start (1-token documents)
        inside = np.sort(rng.choice(np.arange(1, n), size=min(k, n - 1), replace=False)) if n > 1 else np.array([])
        got = reset_positions(n, inside.astype(np.int64))
        assert got.dtype == np.int64 and np.array_equal(got, _reset_positions_quadratic(n, inside)), (n, inside)
    # DocPack end to end: random document lengths, every sample's positions as the loop gave them
    lens = rng.integers(1, 50, 200)
    tokens = np.arange(int(lens.sum()), dtype=np.uint32)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    ds = PackedDataset(tokens, starts, 64, reset_position_ids=True)
    for i in range(len(ds)):
        _, inside = ds.window(i)
        assert np.array_equal(ds[i]["position_ids"], _reset_positions_quadratic(64, inside))


def test_reset_positions_work_does_not_grow_with_the_number_of_documents(monkeypatch):
    """Timing-free linearity: the numpy operations (each one pass over at most the sample) that a sample's
    position ids take are as many for 1 document as for 100,000 (the loop took one per document); and a
    1M-token sample of 100,000 documents (5e10 element writes for the loop) restarts at each of them."""
    import data.packing as packing

    calls = []

    class Counting:
        def __getattr__(self, name):
            f = getattr(np, name)
            if not callable(f) or isinstance(f, type):
                return f
            if isinstance(f, np.ufunc):
                return _CountingUfunc(f, calls)
            return lambda *a, **kw: calls.append(name) or f(*a, **kw)

    monkeypatch.setattr(packing, "np", Counting())
    n = 1 << 20
    per = []
    for docs in (2, 100, 100_000):
        inside = np.linspace(0, n, docs, endpoint=False).astype(np.int64)[1:]
        calls.clear()
        pos = packing.reset_positions(n, inside)
        per.append(len(calls))
        assert per[-1] == per[0] <= 5, (docs, per)  # before the big case: the loop would take minutes there
        first = np.concatenate([[0], inside])
        assert np.array_equal(pos[first], np.zeros(len(first)))  # every document starts at 0 ...
        ends = np.append(inside, n) - 1
        assert np.array_equal(pos[ends], ends - first)  # ... and ends at its length - 1
        assert (np.diff(pos)[np.setdiff1d(np.arange(n - 1), inside - 1)] == 1).all()  # +1 inside a document


class _CountingUfunc:
    def __init__(self, f, calls):
        self.f, self.calls = f, calls

    def __getattr__(self, name):
        method = getattr(self.f, name)
        return lambda *a, **kw: self.calls.append(f"{self.f.__name__}.{name}") or method(*a, **kw)

    def __call__(self, *a, **kw):
        self.calls.append(self.f.__name__)
        return self.f(*a, **kw)
