"""An SFT stage's note on documents split into pieces (data/pipeline.py): under `--loss_on all` every conversation's
mask is all ones, as a text's, so ConvPack splits a long one as it splits text; the note called them "longer text
document(s)". It names them by the folder's manifest (loss_on, chat_docs / n_docs), at no cost."""

from __future__ import annotations

import json
import types

import pytest

from data.prepare_data import prepare
from data.tokenizer import Tokenizer
from tests.unit.data.chat_fixtures import build_tokenizer

LONG = [{"role": "user", "content": "Repeat these words: " + "apple river candle " * 12},
        {"role": "assistant", "content": "apple river candle " * 12}]


def _stage(n):
    return types.SimpleNamespace(index=0, name="s0", max_seq_length=n, eval={"heldout_samples": 0}, data=None,
                                 tasks={}, replay=None, kind="sft", loss_weighting="token")  # nothing held out


@pytest.mark.parametrize("loss_on,text,said", [
    ("all", False, "2 conversation(s) under --loss_on all (every token a target, as a text's) split into pieces"),
    ("all", True, "3 longer text document(s) or conversation(s) under --loss_on all (every token a target: alike) "
                  "split into pieces"),
    ("assistant", True, "1 longer text document(s) split into pieces")])
def test_the_split_note_names_conversations_under_loss_on_all(tmp_path, capsys, loss_on, text, said):
    from data.pipeline import open_run_data

    tok = build_tokenizer(str(tmp_path / "tok"), "qwen25")
    with open(tmp_path / "c.jsonl", "w") as fh:
        for row in [{"messages": LONG}] * 2 + [{"text": "The quick brown fox jumps. " * 20}] * text:
            fh.write(json.dumps(row) + "\n")
    prepare([str(tmp_path / "c.jsonl")], str(tmp_path / "prep"), tok, workers=0, loss_on=loss_on, log=lambda _: None)
    data = open_run_data(str(tmp_path / "prep"), tok, Tokenizer(tok).vocab_size, [_stage(48)], reset_position_ids=True)
    capsys.readouterr()
    data.stage_view(_stage(48), 1, 0, 1, seed=0)
    assert said in capsys.readouterr().out
