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


def _parts(data, docs, heldout: bool):
    """The oracle: the held-out stream (held documents in order, each from its cut) or the training stream."""
    st, ln = np.asarray(data.starts), data.prepared.lens
    tokens = data.tokens[0:len(data.tokens)]
    if heldout:
        return np.concatenate([tokens[st[i] + data.cut[i]: st[i] + ln[i]] for i in docs])
    return np.concatenate([tokens[st[i]: st[i] + data.cut[i]] for i in docs])


def test_heldout_documents_are_spread_fixed_for_the_run_and_never_trained_on(tmp_path, capsys, monkeypatch):
    """The held-out documents are chosen once for the whole curriculum (enough for its largest evaluation), drawn
    from several documents all over the stream: every stage evaluates on the same whole documents, packed to its
    own length, its first samples span several documents, and no stage's training samples touch them."""
    import types

    from data.pipeline import open_run_data

    # document d: tokens 100 * d + j % 97, so a token names its document
    lens = [300, 120, 500, 90, 260, 400, 150, 700, 80, 220, 310, 60, 450, 130, 240, 170]
    docs = [[100 * d + j % 97 for j in range(n)] for d, n in enumerate(lens)]
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps({"input_ids": d}) + "\n" for d in docs))
    stages = [types.SimpleNamespace(index=i, name=f"s{i}", max_seq_length=n, eval={"heldout_samples": 2}, data=None,
                                    tasks={}) for i, n in enumerate((64, 128, 256))]
    data = open_run_data(str(p), None, 2048, stages, reset_position_ids=False)
    assert "warning" not in capsys.readouterr().out
    held = data.held.tolist()
    assert len(held) > 1 and set(data.cut[held].tolist()) == {0}  # whole documents, several of them
    assert max(held) - min(held) > len(lens) // 2  # from all over the stream, not one end
    assert sum(lens[i] for i in held) >= 2 * 256  # the largest evaluation fits
    assert all(data.cut[i] == lens[i] for i in range(len(lens)) if i not in held)
    held_stream, train_stream = _parts(data, held, True), _parts(data, range(len(lens)), False)
    assert len(held_stream) + len(train_stream) == sum(lens)  # every token in exactly one of the two
    assert not {t // 100 for t in held_stream} & {t // 100 for t in train_stream}  # no document in both
    doc_at = np.concatenate([[0], np.cumsum([lens[i] for i in held])])  # where each held document starts
    for st in stages:
        n = st.max_seq_length
        samples = data.heldout(n, 2)
        assert len(samples) == 2
        firsts = []
        for s in samples:  # the same documents at every length, in the same order, packed to it from a document start
            j = int(s["input_ids"][0]) // 100
            assert s["input_ids"][0] == 100 * j and j in held
            at = doc_at[held.index(j)]
            assert s["input_ids"].tolist() == held_stream[at: at + n].tolist()
            firsts.append(held.index(j))
        assert firsts[0] == 0 and doc_at[firsts[1]] >= n  # the second starts after the first: no token twice
        ds, _ = data.stage_view(st, 1, 0, 1, 0)
        assert len(ds) == len(train_stream) // n
        for i in (0, len(ds) - 1):
            assert ds[i]["input_ids"].tolist() == train_stream[i * n: (i + 1) * n].tolist()
    # a later stage's held-out samples are also evaluated at the first stage's length (retention): they fit too
    stages[0].eval, stages[2].eval = {"heldout_samples": 1}, {"heldout_samples": 5}
    data = open_run_data(str(p), None, 2048, stages, reset_position_ids=False)
    assert len(data.heldout(256, 5)) == len(data.heldout(64, 5)) == 5
    # a resume keeps its first start's split (recorded in its checkpoints): a stage appended, or more held-out samples
    # asked, chose other documents (some the run had trained on; the training samples shifted under the data
    # position); the note says so
    first = data.heldout_split
    stages.append(types.SimpleNamespace(index=3, name="s3", max_seq_length=256, eval={"heldout_samples": 9}, data=None,
                                        tasks={}))
    capsys.readouterr()
    moved = open_run_data(str(p), None, 2048, stages, reset_position_ids=False)
    kept = open_run_data(str(p), None, 2048, stages, reset_position_ids=False, heldout=first)
    assert not (np.array_equal(moved.held, data.held) and np.array_equal(moved.cut, data.cut))  # another split
    assert np.array_equal(kept.held, data.held) and np.array_equal(kept.cut, data.cut) and kept.heldout_split == first
    assert "the held-out documents stay those of this run's first start" in capsys.readouterr().out
    # the same documents prepared again in another order (another shard count, a file added): the resume's held-out
    # documents are chosen by index, so some trained before: said, with how many (the first start's kept on record)
    again = tmp_path / "again.jsonl"
    again.write_text("".join(json.dumps({"input_ids": d}) + "\n" for d in docs[::-1]))
    reordered = open_run_data(str(again), None, 2048, stages, reset_position_ids=False, heldout=first)
    moved = {int(reordered.tokens[int(reordered.starts[d]):][0]) // 100 for d in reordered.held} - set(data.held.tolist())
    out = capsys.readouterr().out
    assert moved and f"note: {len(moved)} of the {len(reordered.held)} held-out documents were not held out" in out
    assert reordered.heldout_split["docs"] == first["docs"]
    assert "were not held out" not in (open_run_data(str(p), None, 2048, stages, reset_position_ids=False,
                                                     heldout=first), capsys.readouterr().out)[1]

    # the same input prepared again in the job under today's rules (another cache key: an upgrade's tokenization, as
    # on 2026-11-30): said as that, naming the folder it trained on (the note blamed another order, and "a new run")
    import data.prepare as in_job
    from data import packing

    monkeypatch.setattr(in_job, "CACHE", str(tmp_path / "cache"))  # the folders prepared again: this test's own
    monkeypatch.setattr(packing, "RULES", packing.RULES + ":next1")  # recorded in the plan, and in the cache key
    again = open_run_data(str(p), None, 2048, stages, reset_position_ids=False, heldout=first)
    out = capsys.readouterr().out
    assert "was prepared again in this job" in out and f"to keep them pass --dataset_path {first['prepared']}" in out
    assert "were not held out" not in out and again.heldout_split["prepared"] == first["prepared"]
    assert "a chat row's system_prompt or end-of-turn" in out  # today's rules name chat rows too (an upgrade audit)
    assert "its input" not in out  # what differs, from the two folders' plans: the rules only
    # the same file re-staged at another path (a copy on another mount) after the bump: said too (it was said only
    # where today's --dataset_path was the recorded string; the copy's re-tokenized data went without a word)
    staged = tmp_path / "staged" / p.name
    staged.parent.mkdir()
    staged.write_bytes(p.read_bytes())
    open_run_data(str(staged), None, 2048, stages, reset_position_ids=False, heldout=first)
    out = capsys.readouterr().out
    assert f"--dataset_path {staged} was prepared again in this job" in out, out
    assert f"to keep them pass --dataset_path {first['prepared']}" in out and "its input" not in out, out
    # prepared again under new rules AND its documents moved (a chat set re-tokenized: other lengths, another split):
    # both said (the held-out note was never reached after the first)
    p.write_text("".join(json.dumps({"input_ids": d}) + "\n" for d in docs[::-1]))
    capsys.readouterr()
    open_run_data(str(p), None, 2048, stages, reset_position_ids=False, heldout=first)
    out = capsys.readouterr().out
    assert "was prepared again in this job" in out and "were not held out at this run's first start" in out, out
    assert "its input (its files' names or content) and the tokenization rules" in out, out


def test_heldout_split_of_a_small_dataset_warns_and_shrinks(tmp_path, capsys):
    """Too small for the held-out share: a smaller held-out set and one warning line, as long as one training
    sample of the longest stage remains; refused (one line) only when not even that remains. A stream of one
    huge document is cut inside it."""
    import types

    from data.pipeline import heldout_split, open_run_data, sample_starts

    lens = np.array([300, 120, 500, 90])
    cut, held, warning = heldout_split(lens, [(64, 2), (512, 2)], min_train=256)  # 1010 tokens, 1024 asked
    assert warning.startswith("warning: the dataset has 1010 tokens, too few for 1024 held-out tokens")
    assert "holding out 754 tokens instead" in warning and "\n" not in warning
    assert int(lens.sum() - cut.sum()) == 754 and int(cut.sum()) == 256  # training keeps one longest sample
    cut, held, warning = heldout_split(lens, [(64, 2), (512, 2)], min_train=1000)  # 10 tokens left: no sample
    assert "no held-out evaluation" in warning and len(held) == 0 and (cut == lens).all()
    cut, held, warning = heldout_split(np.array([1000]), [(100, 2)], min_train=100)  # one huge document
    assert cut.tolist() == [800] and held.tolist() == [0] and not warning
    lens = np.array([100000] + [100] * 100)  # the first document in the held-out order is longer than any
    cut, held, warning = heldout_split(lens, [(1000, 2)], min_train=1000)  # evaluation reads: it trains
    assert cut[0] == lens[0] and len(sample_starts(lens[held] - cut[held], 1000, 2, inside=False)) == 2
    assert 2000 <= int((lens - cut).sum()) <= 4000 and not warning
    assert sample_starts(np.array([300, 2500, 1200]), 1000, 2) == [0, 2800]  # the next document's start ...
    assert sample_starts(np.array([300, 2500, 1200]), 1000, 3) == [0, 1000, 2800]  # ... unless all would not fit
    assert sample_starts(np.array([300, 2500, 40]), 1000, 3) == [0, 1000]
    assert sample_starts(np.array([300, 2500, 40]), 1000, 3, inside=False) == [0]
    lens = np.array([300, 120, 500, 90])
    with pytest.raises(ValueError, match=r"has 1010 tokens, fewer than one training sample of the longest stage "
                                         r"\(2048 tokens\): add data or shorten max_seq_length"):
        heldout_split(lens, [(2048, 1)], min_train=2048)
    # the run: trains and evaluates on what there is, with the one warning line
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps({"input_ids": [5 + d] * n}) + "\n" for d, n in enumerate(lens)))
    stage = types.SimpleNamespace(index=0, name="s0", max_seq_length=256, eval={"heldout_samples": 4}, data=None,
                                  tasks={})
    data = open_run_data(str(p), None, 100, [stage], reset_position_ids=False)
    assert capsys.readouterr().out.count("warning: the dataset has 1010 tokens") == 1
    assert len(data.stage_view(stage, 1, 0, 1, 0)[0]) == 1 and len(data.heldout(256, 4)) == 2


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


def _word_tokenizer(path, words: list[str]) -> str:
    from tokenizers import Tokenizer as Raw
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Raw(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>", unk_token="<unk>").save_pretrained(str(path))
    return str(path)


def test_a_model_whose_tokenizer_is_not_the_datas_is_refused_in_one_line(tmp_path):
    """Data prepared with one tokenizer, a model folder shipping another of the same size (Mistral's and Llama 2's
    both have 32000 tokens), no --tokenizer_name_or_path: the ids would be read as other tokens, every step trained
    on garbage, without a word. Refused in one line naming both; the same vocabulary saved again passes, and so do
    added tokens (OpenHermes-2.5-Mistral's 32002 over Mistral's 32000); a model folder without a tokenizer, or data
    whose tokenizer is not here, is not compared."""
    from data.run_tokenizer import check_model_tokenizer
    from data.store import tokenizer_identity

    words = ["<unk>", "</s>", "apple", "river", "stone"]
    data_tok = _word_tokenizer(tmp_path / "data_tok", words)
    m = {"tokenizer": {"path": data_tok, "sha256": tokenizer_identity(data_tok), "vocab_size": 5}}
    other = _word_tokenizer(tmp_path / "model", ["<unk>", "</s>", "river", "apple", "stone"])
    with pytest.raises(ValueError, match=r"was prepared with tokenizer .*data_tok \(5 tokens\), and the model .*model "
                                         r"ships another one \(5 tokens, other ids\)") as e:
        check_model_tokenizer("prepared", m, other)
    assert "\n" not in str(e.value)
    same = _word_tokenizer(tmp_path / "resaved", words)
    cfg = tmp_path / "resaved" / "tokenizer_config.json"  # its own files (another template, say), the same vocabulary
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "chat_template": "{{ messages }}"}))
    assert tokenizer_identity(same) != m["tokenizer"]["sha256"]
    check_model_tokenizer("prepared", m, same)
    (tmp_path / "bare").mkdir()
    check_model_tokenizer("prepared", m, str(tmp_path / "bare"))
    added = _word_tokenizer(tmp_path / "added", [*words, "<|im_start|>"])  # the same ids and one added token
    check_model_tokenizer("prepared", m, added)
    moved = {"tokenizer": {**m["tokenizer"], "path": str(tmp_path / "gone")}}  # not here: nothing to compare
    check_model_tokenizer("prepared", moved, other)


def test_a_jsonl_without_a_tokenizer_flag_is_tokenized_with_the_models_own(tmp_path, monkeypatch):
    """`--model_name_or_path MODEL --dataset_path d.jsonl`, no --tokenizer_name_or_path: the model folder's own
    tokenizer, as transformers and TRL default to it. Before, every text row was refused as needing a tokenizer."""
    from data import prepare as in_job
    from data.store import Prepared

    monkeypatch.setattr(in_job, "CACHE", str(tmp_path / "cache"))
    model = _word_tokenizer(tmp_path / "model", ["<unk>", "</s>", "apple", "river", "stone"])
    src = tmp_path / "d.jsonl"
    src.write_text(json.dumps({"text": "river apple stone"}) + "\n")
    folder, tok = in_job.prepare_in_job(str(src), None, 5, model)
    assert tok == model
    p = Prepared(folder)
    assert p.tokens.read(0, len(p.tokens)).tolist() == [3, 2, 4, 1]  # the words' ids, then EOS


def test_a_model_tokenizer_that_does_not_load_is_not_taken(tmp_path, monkeypatch):
    """A model folder whose tokenizer.model is not one this code reads (a tiktoken-format file, say): pre-tokenized
    rows train as before, bound by the model's vocab_size, not refused for a tokenizer nobody named."""
    from data import prepare as in_job
    from data.store import Prepared

    monkeypatch.setattr(in_job, "CACHE", str(tmp_path / "cache"))
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "tokenizer.model").write_text("Y2F0 0\n")  # tiktoken's base64 ranks
    assert in_job.model_tokenizer(str(tmp_path / "model")) is None
    src = tmp_path / "d.jsonl"
    src.write_text(json.dumps({"input_ids": [7, 8, 9]}) + "\n")
    folder, tok = in_job.prepare_in_job(str(src), None, 10, str(tmp_path / "model"))
    assert tok is None and Prepared(folder).tokens.read(0, 3).tolist() == [7, 8, 9]
