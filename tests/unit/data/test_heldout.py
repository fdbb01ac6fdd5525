"""The held-out split never cuts a conversation (data/heldout.py `heldout_split`, applied by data/pipeline.py): where
holding a document whole would leave too little to train on, its tail was held out and its head trained; for a chat
document the head is the prompt without its answer (an SFT stage trained nothing of it, unsaid) and the tail was
scored as a conversation starting mid-document. A conversation is now held out whole or trains whole, said in one
line when that holds out fewer tokens than asked. One process, small arrays and a 2-row prepared folder: ~3 s."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest

from data.heldout import heldout_split
from tests.unit.data.chat_fixtures import build_tokenizer


def test_a_conversation_is_held_out_whole_or_trains_whole():
    """Four 100k-token conversations, two held-out samples of 128k (the audit's exp2): the split cut the third at
    31,072 (its head trained with no target); now two are held out whole, the others train whole, and the warning
    says why fewer tokens than asked are held out. Text documents are still cut."""
    lens = np.full(4, 100_000)
    asked = []

    def chat(d):
        asked.append(d)
        return True

    cut, held, warning = heldout_split(lens, [(131072, 2)], 131072, chat=chat)
    assert not ((cut > 0) & (cut < lens)).any(), cut.tolist()  # no conversation cut
    assert sorted(held.tolist()) == [0, 2] and cut.tolist() == [0, 100_000, 0, 100_000]
    assert warning.startswith("warning: holding out 200000 of the 262144 tokens the largest stage's eval asks") \
        and "a conversation is held out whole or not at all" in warning and "eval.heldout_samples" in warning \
        and "\n" not in warning, warning
    assert sorted(asked) == [1, 3]  # asked only of the documents it would cut
    # text (chat() false): its tail is held out as before
    cut, held, warning = heldout_split(lens, [(131072, 2)], 131072, chat=lambda d: False)
    assert cut.tolist() == [0, 31072, 0, 100_000] and not warning
    # a stream too small for the held-out share: what it holds, whole
    cut, held, warning = heldout_split(np.array([1510, 1510]), [(1024, 2)], 1024, chat=lambda d: True)
    assert cut.tolist() == [0, 1510] and "holding out 1510 tokens instead; a conversation is held out whole" in warning
    cut, held, warning = heldout_split(np.array([1600, 1600]), [(512, 4)], 1800, chat=lambda d: True)
    assert not len(held) and (cut == 1600).all() and "no held-out evaluation; a conversation" in warning, warning


def _row(words: int) -> dict:
    return {"messages": [{"role": "user", "content": "Read this: " + "apple river candle " * words},
                         {"role": "assistant", "content": "candle"}]}


def test_two_long_conversations_train_nothing_and_are_refused(tmp_path, capsys):
    """The audit's r1: 2 conversations longer than the stage, their answers at the end, 2 held-out samples: the
    second's head trained (0 supervised tokens: "optimizer step skipped" every step, exit 0). Now no conversation is
    cut, and the stage, left with a conversation whose answer lies past the length, is refused before any model."""
    from data.pipeline import open_run_data
    from data.prepare_data import prepare
    from data.tokenizer import Tokenizer

    tok = build_tokenizer(str(tmp_path / "tok"), "qwen25")
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(_row(120)) + "\n" for _ in range(2)))
    prepare([str(tmp_path / "c.jsonl")], str(tmp_path / "prep"), tok, workers=0, log=lambda _: None)
    stage = types.SimpleNamespace(index=0, name="sft", max_seq_length=512, max_steps=3, sp=1, eval={"heldout_samples": 2},
                                  data=None, tasks={}, replay=None, kind="sft", loss_weighting="token")
    data = open_run_data(str(tmp_path / "prep"), tok, Tokenizer(tok).vocab_size, [stage], reset_position_ids=True)
    lens = data.prepared.lens
    assert 512 < lens.min() and lens.max() < 768 and not ((data.cut > 0) & (data.cut < lens)).any(), (data.cut, lens)
    assert "a conversation is held out whole or not at all" in capsys.readouterr().out
    with pytest.raises(ValueError) as e:
        data.check_batches([stage], world=1, micro_batch=1)
    msg = str(e.value)
    assert msg.startswith("stage 0 (sft): 0 packed samples of 512 tokens") and "were dropped" in msg \
        and "lengthen max_seq_length" in msg and "\n" not in msg, msg


def _mixed_lengths() -> np.ndarray:
    lens = np.array([200] * 1000 + [2000] * 20)
    np.random.default_rng(0).shuffle(lens)
    return lens


def test_each_stage_length_gets_a_long_held_out_document():
    """The stage-data audit's exp3: 17% of the tokens in 2000-token documents, stages 256 and 1024: the split held 12
    documents of 200 (spread order alone), so the held-out loss at 1024 measured no context past 200. Now a document
    of at least L/2 is held out first for each stage where the stream has one, and where none does a note says so."""
    from data.heldout import heldout_note, sample_starts

    lens = _mixed_lengths()
    cut, held, warning = heldout_split(lens, [(256, 2), (1024, 2)], 1024)
    spans = lens[held] - cut[held]
    assert spans.max() > 512 and spans[0] == 2000 and not warning, spans.tolist()
    assert sample_starts(spans, 1024, 2, inside=False)[0] == 0  # the first sample at 1024 starts in it
    assert len(sample_starts(spans, 256, 2, inside=False)) == 2  # every stage's samples still start at documents
    split = {"wants": [[256, 2], [1024, 2]], "min_train": 1024, "reach": True}
    assert not any("no held-out document" in x for x in heldout_note(lens, cut, held, split))
    short = np.full(1000, 200)  # no document reaches 512: said, with the fix
    cut, held, _ = heldout_split(short, [(256, 2), (1024, 2)], 1024)
    note = heldout_note(short, cut, held, split)[-1]
    assert note.startswith("note: no held-out document reaches past 200 tokens, so the held-out loss at [1024] "
                           "measures no context past that") and "add long documents" in note, note
    # a chat set is short on purpose: no such advice (the review: the SFT demo was told to add long documents)
    assert not any("no held-out document" in x for x in heldout_note(short, cut, held, split, chats=True))


def test_a_resumed_run_keeps_its_recorded_split(tmp_path, capsys):
    """A run started before long held-out documents recorded {"wants", "min_train"} (no "reach") in its checkpoints;
    the resume makes its split again from them: with today's rule its held-out documents, and so every training
    sample under the saved data position, would move. It keeps the split it trained with, and says why its held-out
    loss reaches no further; a new run's split records "reach"."""
    from data.pipeline import open_run_data
    from data.prepare_data import main

    lens = _mixed_lengths()
    src = tmp_path / "d.jsonl"
    src.write_text("".join(json.dumps({"input_ids": [5 + d % 50] * int(n)}) + "\n" for d, n in enumerate(lens)))
    out = str(tmp_path / "prep")
    assert main(["--input", str(src), "--output", out, "--vocab_size", "100", "--workers", "0"]) == 0
    stages = [types.SimpleNamespace(index=i, name=f"s{i}", max_seq_length=n, eval={"heldout_samples": 2}, data=None,
                                    tasks={}) for i, n in enumerate((256, 1024))]
    new = open_run_data(out, None, 100, stages, reset_position_ids=True)
    assert new.heldout_split["reach"] is True and (lens[new.held] - new.cut[new.held]).max() == 2000
    old_cut, old_held, _ = heldout_split(lens, [(256, 2), (1024, 2)], 1024, reach=False)  # as the run first made it
    recorded = {"wants": [[256, 2], [256, 2], [1024, 2]], "min_train": 1024}
    capsys.readouterr()
    kept = open_run_data(out, None, 100, stages, reset_position_ids=True, heldout=recorded)
    said = capsys.readouterr().out
    assert np.array_equal(kept.held, old_held) and np.array_equal(kept.cut, old_cut)
    assert "reach" not in kept.heldout_split and "stay those of this run's first start" not in said
    assert "note: no held-out document reaches past 200 tokens" in said and "kept, so its training samples stay" in said
