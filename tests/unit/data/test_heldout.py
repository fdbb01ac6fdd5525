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
