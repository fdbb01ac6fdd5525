"""What the start says or refuses about each stage's data (auditL4): a whole-stream stage too small for one step refused
before any model (it was refused only when the stage began, after the stages before it trained); a text pack's last
partial sample, in no sample, said; the held-out share said; mixture numbers written as text refused in one line; an
SFT replay length that drops every conversation of a component named as such."""

from __future__ import annotations

import types

import numpy as np
import pytest
import yaml

from data.mixture import parse_mixture


def _data(lens, sources=("web",), source=None, mask=None):
    """A RunData over an in-memory stream of documents `lens` (token d + 1 in document d), nothing held out."""
    from data.pipeline import RunData

    lens = np.asarray(lens, np.int64)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
    tokens = np.repeat(np.arange(1, len(lens) + 1), lens)
    prepared = types.SimpleNamespace(tokens=tokens, starts=starts, lens=lens, mask=mask, sources=list(sources),
                                     source=np.zeros(len(lens), np.int32) if source is None else np.asarray(source))
    return RunData(prepared, lens.copy(), np.zeros(0, np.int64), None, reset_position_ids=True)


def _stage(i, n, steps=10, **kw):
    return types.SimpleNamespace(**{"index": i, "name": f"s{i}", "max_seq_length": n, "max_steps": steps, "sp": 1,
                                    "data": None, "replay": None, "tasks": None, "kind": "text", **kw})


def test_a_whole_stream_stage_too_small_for_one_step_is_refused_at_the_start():
    """3,000 tokens: 46 samples at 64 and 2 at 1,024. On 4 data-parallel ranks at micro-batch 1 the second stage
    has no step: refused in one line naming it and the counts, before any model (its sampler refused it only when
    it began, after stage 0 trained, at every requeue); a resumed run past its end is not refused, nor a stage with
    a mixture (its sampler repeats a small component's samples)."""
    data = _data([1000, 1000, 1000])
    stages = [_stage(0, 64), _stage(1, 1024)]
    data.check_batches(stages[:1], world=4, micro_batch=1)
    with pytest.raises(ValueError) as e:
        data.check_batches(stages, world=4, micro_batch=1)
    msg = str(e.value)
    assert msg.startswith("stage 1 (s1): 2 packed samples of 1024 tokens, fewer than the dp 4 x "
                          "per_device_train_batch_size 1 = 4 one step reads: add data, shorten max_seq_length"), msg
    assert "\n" not in msg
    data.check_batches([_stage(0, 64), _stage(1, 1024, sp=2)], world=4, micro_batch=1)  # dp 2: fits
    data.check_batches(stages, world=4, micro_batch=1, done=20)  # both stages trained: a resume at the end
    data.check_batches([_stage(0, 64), _stage(1, 1024, data={"web": 1})], world=4, micro_batch=1)


def test_an_sft_replay_length_that_drops_every_conversation_is_refused_naming_it():
    """20 conversations of 6,000 tokens, the answer in the last 300 (LongAlign-like): an 8192 SFT stage fits them
    whole, its replay length 4096 drops them all (every target past the cut). The start names the replay length and
    why (it said "0 packed samples" for the stream, and "has 0 training tokens" for a mixture component)."""
    lens = np.full(20, 6000)
    mask = np.zeros(int(lens.sum()), np.uint8)
    for s in np.arange(20) * 6000:
        mask[s + 6000 - 300: s + 6000] = 1
    data = _data(lens, mask=mask)
    stage = _stage(0, 8192, kind="sft", replay={4096: 0.3})
    with pytest.raises(ValueError) as e:
        data.check_batches([stage], world=4, micro_batch=1)
    msg = str(e.value)
    assert msg.startswith("stage 0 (s0) replay length 4096: 0 packed samples of 4096 tokens, fewer than the dp 4 x "
                          "per_device_train_batch_size 1 x 8192/4096 = 8 one step reads (all 20 of its conversations "
                          "were dropped: their supervised tokens lie past the cut at 4096 tokens): use a longer replay "
                          "length"), msg
    mixed = types.SimpleNamespace(**{**vars(stage), "data": [{"name": "qa", "source": "web", "weight": 1}]})
    assert len(data.mixture(mixed)) == 20
    with pytest.raises(ValueError) as e:
        data.mixture(types.SimpleNamespace(**{**vars(mixed), "max_seq_length": 4096}), replay_of=8192)
    assert str(e.value).startswith("stage 0 (s0) replay length 4096: mixture component 'qa': all 20 of its "
                                   "conversations were dropped: their supervised tokens lie past the cut at 4096 "
                                   "tokens: use a longer replay length, or drop the replay"), str(e.value)


def test_the_last_partial_sample_of_a_text_pack_is_said_at_the_stage_start():
    """12 books of 160k tokens in a 1M stage's mixture (the audit's r2): one sample; 871,424 tokens (45%) in no
    sample, the same every epoch, said at the stage's start; the whole stream's tail too; below 1% nothing."""
    from data.coverage import draw_notes

    L = 1 << 20
    data = _data([160_000] * 12 + [5243] * 2000, sources=("books", "web"), source=[0] * 12 + [1] * 2000)  # web: 240 left
    stage = _stage(0, L, steps=1, data=[{"name": "long", "source": "books", "weight": 0.5},
                                        {"name": "short", "source": "web", "weight": 0.5}])
    notes = draw_notes(data, [stage], stage, world=1, micro_batch=1, grad_accum=1)
    tails = [n for n in notes if "in no sample" in n]
    assert tails == ["note: stage 0 (s0): 871424 tokens (45%) of its mixture component 'long' (1920000 tokens) are "
                     "in no sample (the last partial sample of 1048576: the end of its last documents, untrained in "
                     "every epoch): add documents, or train them at a shorter length"], notes
    whole = _stage(0, L, steps=1)
    stream = 12 * 160_000 + 2000 * 5243  # 12,406,000 tokens: 11 samples, 871,664 (7%) left
    assert [n for n in draw_notes(data, [whole], whole, 1, 1, 1) if "in no sample" in n] == [
        f"note: stage 0 (s0): {stream % L} tokens (7%) of its whole stream ({stream} tokens) are in no sample (the "
        f"last partial sample of {L}: the end of its last documents, untrained in every epoch): add documents, or "
        "train them at a shorter length"]
    assert not [n for n in draw_notes(data, [whole], _stage(0, 4096, steps=1), 1, 1, 1) if "in no sample" in n]
    sft = _stage(0, L, steps=1, kind="sft")  # conversations pad their last sample: nothing left out
    assert not [n for n in draw_notes(data, [sft], sft, 1, 1, 1) if "in no sample" in n]


def test_the_held_out_share_is_said_with_how_to_lower_it():
    """1,000 LIMA-sized conversations and a 128k stage's 2 held-out samples (the audit's r7): ~15% of the stream
    held out, said with `eval.heldout_samples` / --eval_heldout_samples; 10,000 conversations: said, no note."""
    from data.heldout import heldout_note, heldout_split

    rng = np.random.default_rng(0)
    for n, noted in ((1000, True), (10000, False)):
        lens = np.clip(rng.lognormal(np.log(1500), 0.6, n), 30, 16000).astype(np.int64)
        cut, held, _ = heldout_split(lens, [(131072, 2)], min_train=131072)
        lines = heldout_note(lens, cut, held)
        taken = int(lens.sum() - cut.sum())
        assert lines[0].startswith(f"held out {len(held)} documents, {taken} tokens ({taken / lens.sum():.1%} of the "
                                   "stream)")
        assert (len(lines) == 2) == noted and all("\n" not in x for x in lines)
        if noted:
            assert "eval.heldout_samples" in lines[1] and "--eval_heldout_samples" in lines[1]
    assert heldout_note(np.array([10, 20]), np.array([10, 20]), np.zeros(0, np.int64)) == []


def test_open_run_data_says_the_held_out_split(tmp_path, capsys):
    import json

    from data.pipeline import open_run_data

    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps({"input_ids": [5 + d % 7] * n}) + "\n" for d, n in enumerate([60] * 40)))
    stage = types.SimpleNamespace(index=0, name="s0", max_seq_length=128, eval={"heldout_samples": 2}, data=None,
                                  tasks={})
    data = open_run_data(str(p), None, 100, [stage], reset_position_ids=False)
    out = capsys.readouterr().out
    taken = int(data.prepared.lens.sum() - data.cut.sum())
    assert f"held out {len(data.held)} documents, {taken} tokens" in out and "--eval_heldout_samples" in out, out


@pytest.mark.parametrize("spec, key, value", [
    ("{books: , web: 0.4}", "weight", "None"), ("{books: 60%, web: 40%}", "weight", "'60%'"),
    ("[{source: books, weight: 0.6, min_doc_tokens: 64k}]", "min_doc_tokens", "'64k'"),
    ("[{source: arxiv, weight: 0.2, upsample: {min_doc_tokens: 32768, factor: 4x}}]", "upsample.factor", "'4x'"),
    ("[{source: books, weight: 0.6, max_doc_tokens: 64k}]", "max_doc_tokens", "'64k'"),
    ("[{source: books, weight: true}]", "weight", "True")])
def test_mixture_numbers_written_as_text_are_refused_in_one_line(spec, key, value):
    """A traceback (TypeError, int()'s ValueError) or, for max_doc_tokens (never converted), accepted and then numpy's
    UFuncTypeError when the documents were selected."""
    with pytest.raises(ValueError) as e:
        parse_mixture(yaml.safe_load(spec), "stage 0 (s) data")
    msg = str(e.value)
    assert msg.startswith("stage 0 (s) data[0] (") and f": {key} is {value}: give a number" in msg, msg
    assert "\n" not in msg
    from training.job import _is_input_error

    assert _is_input_error(e.value)  # our own `raise`: one line for the user, no traceback


def test_mixture_numbers_still_taken():
    c = parse_mixture(yaml.safe_load("[{source: books, weight: 3, max_doc_tokens: 65_535, min_doc_tokens: 1.6e4, "
                                     "upsample: {min_doc_tokens: '32768', factor: 2}}]"))[0]
    assert (c.weight, c.max_doc_tokens, c.min_doc_tokens, c.upsample_min_tokens, c.upsample_factor) == (
        3.0, 65535, 16000, 32768, 2)
    assert isinstance(c.max_doc_tokens, int) and isinstance(c.weight, float)
