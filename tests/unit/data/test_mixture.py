"""Per-stage mixtures and packing: configured shares reached, exact resume at micro-batch granularity, DP
ranks disjoint, long documents split at sample boundaries without loss, cross-document label masking."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest

from data.mixture import MixtureSampler, parse_mixture
from data.packing import DocPack


def test_sampler_reaches_configured_shares():
    s = MixtureSampler([50, 7, 300], [0.6, 0.1, 0.3], ["long", "rare", "short"], dp=2, dp_rank=0, micro_batch=2,
                       seed=1)
    for n in range(1, 251):
        s.next_batch()
        shares = s.source_shares()
        for name, w in (("long", 0.6), ("rare", 0.1), ("short", 0.3)):
            assert abs(shares[name] - w) <= 1.0 / (4 * n) + 1e-12  # within one sample at every micro-step
    assert s.drawn == 1000 and s.counts.tolist() == [600, 100, 300]


def _run(s, n):
    return [s.next_batch() for _ in range(n)]


@pytest.mark.parametrize("dp_rank", [0, 1])
def test_state_dict_round_trip_resumes_exactly(dp_rank):
    """2-source mixture, dp=2, micro-batch 3: stop after 7 micro-batches, restore into a fresh sampler, and
    the next 40 (crossing several component epochs) are the uninterrupted run's."""
    def make():
        return MixtureSampler([11, 5], [0.7, 0.3], ["a", "b"], dp=2, dp_rank=dp_rank, micro_batch=3, seed=4)

    ref = _run(make(), 47)
    first = make()
    got = _run(first, 7)
    state = json.loads(json.dumps(first.state_dict()))  # survives the checkpoint's serialisation
    resumed = make()
    resumed.load_state_dict(state)
    got += _run(resumed, 40)
    assert got == ref
    assert resumed.source_shares() == pytest.approx({"a": 0.7, "b": 0.3}, abs=1 / 282)
    with pytest.raises(ValueError, match="mixture components"):
        MixtureSampler([11], [1.0], ["x"], 2, 0, 3, 4).load_state_dict(state)


def test_dp_ranks_read_disjoint_samples_within_an_epoch():
    r0 = MixtureSampler([40, 40], [0.5, 0.5], ["a", "b"], 2, 0, 2, seed=0)
    r1 = MixtureSampler([40, 40], [0.5, 0.5], ["a", "b"], 2, 1, 2, seed=0)
    a = [i for b in _run(r0, 20) for i in b]
    b = [i for b in _run(r1, 20) for i in b]
    assert not set(a) & set(b) and len(set(a) | set(b)) == 80


def test_long_documents_split_at_sample_boundaries_without_loss():
    lens = [5, 23, 3, 17, 40, 2]  # longer and shorter than the sample
    tokens = np.arange(sum(lens) + 10, dtype=np.uint32)  # every token distinct
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    for order in ([0, 1, 2, 3, 4, 5], [4, 1, 5, 3]):  # the whole stream, and a non-contiguous choice
        ds = DocPack(tokens, starts[order], np.asarray(lens)[order], 8, reset_position_ids=True)
        virtual = np.concatenate([tokens[starts[k]: starts[k] + lens[k]] for k in order])
        got = np.concatenate([ds[i]["input_ids"] for i in range(len(ds))])
        assert len(ds) == len(virtual) // 8
        assert got.tolist() == virtual[: len(ds) * 8].tolist()  # each token once, in order, none repeated
        for i in range(len(ds)):  # positions restart exactly where a document starts
            s = ds[i]
            first = {int(np.flatnonzero(virtual == t)[0]) for t in s["input_ids"]}
            doc_starts = set(np.cumsum([0] + [lens[k] for k in order]).tolist())
            restart = [j for j in range(1, 8) if s["position_ids"][j] == 0]
            assert restart == [j for j in range(1, 8) if i * 8 + j in doc_starts], (order, i)
            assert len(first) == 8


def test_mask_cross_document_labels():
    tokens = np.arange(100, 120, dtype=np.uint16)
    plain = DocPack(tokens, [0, 3, 10], [3, 7, 10], 8, reset_position_ids=False)
    masked = DocPack(tokens, [0, 3, 10], [3, 7, 10], 8, reset_position_ids=False, mask_cross_document_labels=True)
    assert plain[0]["shift_labels"].tolist() == [101, 102, 103, 104, 105, 106, 107, -100]
    assert masked[0]["shift_labels"].tolist() == [101, 102, -100, 104, 105, 106, 107, -100]
    assert masked[1]["shift_labels"].tolist() == [109, -100, 111, 112, 113, 114, 115, -100]  # doc 3 starts at 10
    assert (masked[0]["input_ids"] == plain[0]["input_ids"]).all()


@pytest.mark.parametrize("spec, match", [
    ([], "expected"), ([{"source": "a"}], "at least `weight`"), ([{"weight": 0}], "weight must be > 0"),
    ([{"weight": 1, "min_tokens": 3}], r"unknown key\(s\) \['min_tokens'\]"),
    ([{"weight": 1}, {"weight": 2}], "names .* repeat"),
])
def test_bad_mixture_specs(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_mixture(spec)


def _stage(i, n, data):
    return types.SimpleNamespace(index=i, name=f"s{i}", max_seq_length=n, eval={"heldout_samples": 1}, data=data)


def test_stage_view_mixes_sources_with_length_filter(tmp_path):
    """Two sources prepared into one folder; the stage takes 60% from long `books` documents and 40% from
    `web`: samples of each component hold only its documents' tokens, and the shares are the configured ones."""
    from data.pipeline import open_run_data
    from data.prepare_data import prepare

    books = [[1] * n for n in (200, 30, 150, 20, 300)]  # token 1: books, token 2: web
    web = [[2] * n for n in (10, 25, 12, 40, 18, 30, 22, 15, 9, 35)]
    for name, docs in (("books", books), ("web", web)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"input_ids": d}) + "\n" for d in docs))
    out = str(tmp_path / "prep")
    prepare([str(tmp_path / "books.jsonl"), str(tmp_path / "web.jsonl")], out, vocab_size=10, workers=0,
            log=lambda _: None)
    mix = [{"name": "long", "source": "books", "weight": 0.6, "min_doc_tokens": 100},
           {"name": "short", "source": "w*", "weight": 0.4}]
    stages = [_stage(0, 16, mix)]
    data = open_run_data(out, None, 10, stages, reset_position_ids=False)
    ds, sampler = data.stage_view(stages[0], 1, 0, 5, seed=0)
    # held out: the first documents in the held-out order (data/pipeline.py spread_order) no longer than twice the
    # evaluation (16 tokens): web's 10- and 9-token ones; books' train whole
    assert data.held.tolist() == [13, 5]
    assert ds.sizes == [650 // 16, (216 - 10 - 9) // 16]
    for _ in range(10):
        for i in sampler.next_batch():
            ids = set(ds[i]["input_ids"].tolist())
            assert ids == ({1} if i < ds.sizes[0] else {2})
    assert sampler.source_shares() == {"long": 0.6, "short": 0.4}
    with pytest.raises(ValueError, match=r"component 'x' .* less than one sample"):
        open_run_data(out, None, 10, [_stage(0, 16, [{"name": "x", "source": "nothing", "weight": 1}])], False)
    # what a stage's steps draw, said at its start (data/coverage.py): 10 steps x 5 samples x 16 tokens = 800 tokens,
    # 40% of them (320) from 'short', whose 12 samples hold 192: drawn 1.7 times over; a stage of books alone leaves
    # web (its 197 training tokens of 897) unread; the whole stream drawn by a stage after another one repeats tokens
    from data.coverage import draw_notes as all_notes
    from data.coverage import stage_tokens

    def draw_notes(*a, **k):  # a component's last partial sample (in no sample) is said too: test_stage_data_checks.py
        return [n for n in all_notes(*a, **k) if "in no sample" not in n]

    for st in stages + (more := [_stage(1, 16, {"books": 1}), _stage(2, 16, None), _stage(3, 16, None)]):
        st.max_steps, st.sp, st.cp = 10, 1, 1
    notes = draw_notes(data, stages, stages[0], world=1, micro_batch=5, grad_accum=1)
    assert notes == ["note: stage 0 (s0) draws 800 tokens: its mixture component(s) 'short' 1.7x (12 samples) repeat "
                     "their samples that many times over: add documents to them or lower their weight"]
    only_books = draw_notes(data, stages + more, more[0], world=1, micro_batch=1, grad_accum=1)
    assert only_books == ["note: stage 1 (s1): source(s) ['web'] (22% of the training tokens) are in no component of "
                          "its data: this stage does not train on them"]
    assert draw_notes(data, stages + more, more[1], world=1, micro_batch=1, grad_accum=1) == []  # the first on it
    # SP 4 as Ulysses 2 x context parallel 2 on 8 ranks: 2 data-parallel groups
    assert stage_tokens(types.SimpleNamespace(max_steps=10, max_seq_length=16, sp=4, cp=2), 8, 1, 1) == 10 * 16 * 2
    repeat = draw_notes(data, stages + more, more[2], world=2, micro_batch=1, grad_accum=2)  # 640 of 897 tokens each
    assert repeat == ["note: stage 3 (s3) draws its samples from the whole stream again, independently of stage(s) "
                      "[2]: about 71% of its tokens were trained by them, and after it about 8% of the stream's 897 "
                      "tokens by no stage: more data than the curriculum's tokens keeps repeats rare"]


def test_a_resume_under_another_seed_keeps_the_runs_order():
    """A resume with another --seed (a launch script passing --seed $RANDOM at every requeue) drew the rest of the
    epoch from another permutation at the same offset: samples of the epoch trained twice, others never. The saved
    seed is kept, for the plain sampler and the mixture alike."""
    from data.sampler import ResumableSampler

    def plain(seed):
        return ResumableSampler(20, 1, 0, 1, seed=seed)

    def mixed(seed):
        return MixtureSampler([11, 5], [0.7, 0.3], ["a", "b"], dp=1, dp_rank=0, micro_batch=1, seed=seed)

    for make, n in ((plain, 20), (mixed, 16)):
        ref = _run(make(0), n)
        first = make(0)
        got = _run(first, n // 2)
        resumed = make(1)
        resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
        assert got + _run(resumed, n - n // 2) == ref, make.__name__


def test_an_sft_component_that_fills_its_samples_badly_is_said(capsys):
    """Each SFT mixture component is packed alone: one of long conversations only (64k-128k into 128k samples) fills
    ~0.75 of its samples, so its weight, a share of samples, trains fewer conversation tokens than it says (the
    packing audit: 0.077 for a weight of 0.1). Said at the stage's start with the share it trains."""
    from data.mixture import MixtureDataset
    from data.packing import ConvPack
    from data.pipeline import RunData

    rng = np.random.default_rng(0)
    L = 128 << 10
    chats = rng.integers(500, 4000, 4000)
    long = rng.integers(64 << 10, L + 1, 200)
    parts = [ConvPack(None, None, np.concatenate([[0], np.cumsum(x)[:-1]]), x, L, pad_id=0) for x in (chats, long)]
    mix = MixtureDataset(parts, ["chat", "long"])
    stage = types.SimpleNamespace(index=0, name="sft", max_seq_length=L, kind="sft", tasks=None,
                                  data=[{"name": "chat", "weight": 0.9}, {"name": "long", "weight": 0.1}])
    fake = types.SimpleNamespace(mixture=lambda st: mix, tokenizer=None)
    RunData._view(fake, stage, 1, 0, 1, 0)
    out = capsys.readouterr().out
    assert "each mixture component is packed alone" in out and "long fills 0.7" in out, out
    share = float(out.split("long fills")[1].split(" of the conversation tokens")[0].split(": ")[-1])
    assert 0.06 < share < 0.09, out
