"""What a stage's start says of its data (data/pipeline.py, data/pipeline_notes.py): an SFT stage's truncation line
gives, for the stage or each mixture component, how many of the conversations longer than the stage were dropped and
the share of its supervised tokens the cuts lose (it gave one stage-wide share: most long rows gone read as 3.6%); a
text stage over conversations says how many it splits across samples and which supervised tokens train without their
conversation's start; a stage or mixture component left with no sample names the held-out setting where the held-out
documents hold conversations it would train. In-memory streams: < 1 s."""

from __future__ import annotations

import types

import numpy as np
import pytest


def _data(docs, held=(), source=None, sources=("web",)):
    """A RunData over conversations given as (length, targets at the end; a text document: every token); documents
    `held` held out whole; `source`: each document's index into `sources`."""
    from data.pipeline import RunData

    lens = np.asarray([n for n, _ in docs], np.int64)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
    mask = np.zeros(int(lens.sum()), np.uint8)
    for s, (n, k) in zip(starts, docs):
        mask[s + n - k: s + n] = 1
    prepared = types.SimpleNamespace(tokens=np.arange(int(lens.sum())) % 50 + 1, starts=starts, lens=lens, mask=mask,
                                     sources=list(sources), manifest={},
                                     source=np.zeros(len(lens), np.int32) if source is None else np.asarray(source, np.int32))
    cut = lens.copy()
    cut[list(held)] = 0
    return RunData(prepared, cut, np.asarray(held, np.int64), None, reset_position_ids=True)


def _stage(n, **kw):
    return types.SimpleNamespace(**{"index": 0, "name": "sft", "max_seq_length": n, "max_steps": 4, "sp": 1,
                                    "data": None, "replay": None, "tasks": None, "kind": "sft", **kw})


def test_the_truncation_line_gives_the_long_conversations_dropped_and_the_share_of_their_supervised_tokens(capsys):
    """Ten 50-token chats with 20 targets each (200) and one 300-token conversation whose last 250 tokens are targets,
    cut at 128: 172 of its targets lie past the cut, 172 / 450 of the stage's supervised tokens. Adding a 400-token one
    with its 10 targets past the cut (dropped: 1 of the 2 longer than 128, its 10 lost too: 182 / 460) and a 60-token
    one with no target (dropped, said apart: it fits)."""
    data = _data([(50, 20)] * 10 + [(300, 250)])
    data.stage_view(_stage(128), 1, 0, 1, seed=0)
    out = capsys.readouterr().out
    assert ("stage 0 (sft) at 128: 0 of its 1 conversation(s) longer than 128 dropped (no supervised token before the "
            "cut), 1 cut to the length; 172 supervised token(s) past the cuts not trained (38.2% of its 11 "
            "conversation(s)' supervised tokens)\n") in out, out
    _data([(50, 20)] * 10 + [(300, 250), (400, 10), (60, 0)]).stage_view(_stage(128), 1, 0, 1, seed=0)
    assert ("stage 0 (sft) at 128: 1 of its 2 conversation(s) longer than 128 dropped (no supervised token before the "
            "cut), 1 cut to the length, 1 shorter one(s) dropped (no supervised token at all); 182 supervised token(s) "
            "past the cuts not trained (39.6% of its 13 conversation(s)' supervised tokens)\n") in \
        capsys.readouterr().out


def test_the_truncation_line_names_each_mixture_component(capsys):
    """A `long` component (8 long-document QA rows of 300 tokens, answer = the last 10, and 2 of 120 that fit) at weight
    0.3 beside 20 short chats at 128: the 8 are dropped, 80 of the component's 100 supervised tokens. The stage-wide
    line said "8 dropped ... (16.0% of the stage's supervised tokens)", naming no component; 'chat' lost nothing."""
    data = _data([(300, 10)] * 8 + [(120, 10)] * 2 + [(60, 20)] * 20, source=[0] * 10 + [1] * 20,
                 sources=("longqa", "chat"))
    data.stage_view(_stage(128, data=[{"name": "long", "source": "longqa", "weight": 0.3},
                                      {"name": "chat", "source": "chat", "weight": 0.7}]), 1, 0, 1, seed=0)
    out = capsys.readouterr().out
    assert ("stage 0 (sft) at 128, component 'long': 8 of its 8 conversation(s) longer than 128 dropped (no supervised "
            "token before the cut), 0 cut to the length; 80 supervised token(s) past the cuts not trained (80.0% of its "
            "10 conversation(s)' supervised tokens)\n") in out, out
    assert "'chat'" not in out and "16.0%" not in out, out


def test_a_text_stage_says_the_conversations_it_splits_across_samples(capsys):
    """8 long-document QA rows (300 tokens, answer = the last 10) then 20 chats of 60 (reply = the last 10) under a text
    stage at 128: 3600 tokens, 28 samples (the last 16 tokens in none). Every long row spans 3 samples: its 80 targets
    lie two samples past its start, but 896 and 1792 (its rows 2 and 5) open a sample, predicted by nothing: 78 train,
    all without their row's start. The chats at 2400 + 60j cross the sample ends 2432, 2560, 2688, 2816, 2944, 3072,
    3200, 3328, 3456 (j = 0, 2, 4, 6, 9, 11, 13, 15, 17): 9 split, their targets after the end but j = 6's (2810..2819
    around 2816: 6 before it, 3 after) 83; j = 19 crosses 3584, the end of the trained samples (its targets are in
    none). 28 conversations, 17 split, 161 of the 78 + 189 trained supervised tokens. A text document split alike is
    no conversation; conversations that all fit a sample say nothing, nor does an SFT stage."""
    data = _data([(300, 10)] * 8 + [(60, 10)] * 20)
    data.stage_view(_stage(128, kind="text", name="main"), 1, 0, 1, seed=0)
    assert capsys.readouterr().out == (
        "stage 0 (main) at 128 packs 28 conversation(s) as text: 17 split across samples, 161 of their 267 supervised "
        "tokens (60.3%) trained without their conversation's start; `kind: sft` packs each whole\n")
    # a text document of 250 (every token a target) split at 128, then two chats of 100 (reply = the last 10) at 250 and
    # 350: the first crosses 256 (its reply after it), the second reaches past 384, the end of the 3 samples (its reply
    # in none): 2 conversations, 1 split, 10 of 10; the text's 249 targets are not a conversation's
    _data([(250, 250), (100, 10), (100, 10)]).stage_view(_stage(128, kind="text", name="main"), 1, 0, 1, seed=0)
    assert capsys.readouterr().out == (
        "stage 0 (main) at 128 packs 2 conversation(s) as text: 1 split across samples, 10 of their 10 supervised "
        "tokens (100.0%) trained without their conversation's start; `kind: sft` packs each whole\n")
    _data([(64, 10)] * 4 + [(300, 300)]).stage_view(_stage(128, kind="text", name="main"), 1, 0, 1, seed=0)
    _data([(300, 10)] * 8 + [(60, 10)] * 20).stage_view(_stage(1024), 1, 0, 1, seed=0)  # kind sft: whole
    assert "as text" not in capsys.readouterr().out


def test_the_text_stage_note_reads_the_mask_on_rank_0_alone(monkeypatch, capsys):
    """The note reads the loss mask (~45 s at 100M conversations): rank 0 alone (base/comm.run_on_main, the others on
    the bounded host wait), not every rank off the shared file system. A stand-in run_on_main as a non-zero rank sees
    it: the line it is sent is printed, the mask never read here (before, every rank counted it itself)."""
    from base import comm
    from data import pipeline

    monkeypatch.setattr(pipeline, "text_chat_line", lambda *a: pytest.fail("a non-zero rank read the mask"))
    sent = []
    monkeypatch.setattr(comm, "run_on_main", lambda fn, long=False: sent.append(long) or "rank 0's line")
    _data([(300, 10)] * 8 + [(60, 10)] * 20).stage_view(_stage(128, kind="text", name="main"), 1, 0, 1, seed=0)
    assert sent == [True] and capsys.readouterr().out == "rank 0's line\n"


def test_a_stage_left_with_no_sample_names_the_held_out_setting():
    """Two short conversations held out whole, the third longer than the stage with its answer past the cut: the
    stage trains nothing. Refused in one line that names eval.heldout_samples (the held-out two would train)."""
    data = _data([(100, 10), (100, 10), (400, 10)], held=(0, 1))
    with pytest.raises(ValueError) as e:
        data.check_batches([_stage(256)], world=1, micro_batch=1)
    msg = str(e.value)
    assert msg.startswith("stage 0 (sft): 0 packed samples of 256 tokens") and "lengthen max_seq_length" in msg, msg
    assert msg.endswith("; with the held-out documents it packs 1: lower eval.heldout_samples "
                        "(--eval_heldout_samples; 0 holds none out)") and "\n" not in msg, msg
    with pytest.raises(ValueError) as e:
        data.mixture(_stage(256, data=[{"name": "qa", "source": "web", "weight": 1}]))
    assert str(e.value).startswith("stage 0 (sft): mixture component 'qa': all 1 of its conversations were dropped") \
        and "lower eval.heldout_samples" in str(e.value), str(e.value)
    # nothing held out: nothing to name
    with pytest.raises(ValueError) as e:
        _data([(400, 10)]).check_batches([_stage(256)], world=1, micro_batch=1)
    assert "heldout" not in str(e.value)


def test_the_cut_share_is_of_the_conversations_not_of_a_split_texts_pieces():
    """Two 30-token conversations at 16 (15 targets each: 3 before the cut, 12 past it) beside a 400-token text
    document split into 25 pieces: the cuts lose 24 of the conversations' 30 supervised tokens (80%). The share
    divided by every target the samples hold, the pieces' 375 too: it read 5.9%."""
    from data.packing import ConvPack
    from data.pipeline_notes import cut_lines

    lens = np.asarray([30, 30, 400], np.int64)
    starts = np.asarray([0, 30, 60], np.int64)
    mask = np.zeros(460, np.uint8)
    for s in (0, 30):
        mask[s + 13: s + 28] = 1  # positions 13..15 train, 16..27 lie past the cut
    mask[60:] = 1  # the text: every token a target
    p = ConvPack(np.arange(460) % 50 + 1, mask, starts, lens, 16, 0)
    assert (p.split, p.truncated, p.lost_targets, p.n_targets, p.piece_targets) == (1, 2, 24, 6 + 375, 375)
    p.docs = 3
    line = cut_lines("s", [p], None, {})[0]
    assert "24 supervised token(s) past the cuts not trained (80.0% of its 2 conversation(s)'" in line, line
