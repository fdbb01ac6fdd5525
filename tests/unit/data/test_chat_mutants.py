"""The SFT path's mutants the chat sweep and its neighbours let live (a mutation audit, 56 one-line mutants, 5 real
survivors): a prefilled prompt's reply under --loss_on completion, the manifest's supervised count under --loss_on all,
a pack's text document after a conversation (its first token predicted from the conversation's last), a text row
before a chat row in one chunk (its mask written zeros), an opening reply under TRL's training template (the
generation prompt's token trained). Each test failed on its mutant. data/chat_rows.py, data/prepare_data.py,
data/packing.py, data/store.py, data/chat_locate.py."""
from __future__ import annotations

import json

import numpy as np

from data.chat import ChatEncoder
from data.packing import ConvPack, chat_documents
from data.prepare_data import prepare
from data.store import Prepared
from data.tokenizer import Tokenizer
from tests.unit.data.chat_fixtures import build_tokenizer

U = {"role": "user", "content": "Repeat these words: apple river"}


def _runs(enc, ids, mask):
    e = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    return [enc.tok.hf.decode(ids[a:b]) for a, b in zip(e[::2], e[1::2])]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_k18_a_prompt_ending_with_a_reply_trains_only_the_completion(tmp_path):
    """M18: --loss_on completion (auto for a conversational pair) trains message k >= first, never the prompt's last
    message, even when that is an assistant reply (a prefilled prompt)."""
    enc = ChatEncoder(Tokenizer(build_tokenizer(str(tmp_path), "qwen25")))
    ids, mask, _ = enc.encode({"prompt": [U, {"role": "assistant", "content": "apple river"}],
                               "completion": [{"role": "assistant", "content": "2 words"}]})
    assert _runs(enc, ids, mask) == ["2 words<|im_end|>"]


def test_k19_supervised_tokens_never_count_a_documents_first_token(tmp_path):
    """M19: under --loss_on all every token of a conversation is 1 in its mask; the manifest counts what packing
    trains (positions 1.., TRL's count), not the first token too."""
    tok = build_tokenizer(str(tmp_path / "tok"), "qwen25")
    src = _jsonl(tmp_path / "c.jsonl", [{"messages": [U, {"role": "assistant", "content": "apple river"}]}] * 3)
    m = prepare([src], str(tmp_path / "o"), tok, workers=0, loss_on="all", log=lambda _: None)
    assert m["supervised_tokens"] == m["n_tokens"] - m["n_docs"]


def test_k20_no_document_in_a_pack_is_predicted_from_the_one_before():
    """M20: an SFT pack's text document (every token a target, an SFT stage's replay or a --loss_on all
    conversation) after a conversation: the conversation's last token has no label (the docstring's promise)."""
    toks = np.asarray([10, 11, 12, 13, 20, 21, 22], np.int64)
    mask = np.asarray([0, 0, 1, 1, 1, 1, 1], np.uint8)  # a conversation, then a text document (all ones)
    pack = ConvPack(toks, mask, np.asarray([0, 4]), np.asarray([4, 3]), 8, pad_id=0)
    s = pack[0]
    for at in np.flatnonzero(s["position_ids"][1:] == 0) + 1:  # every document start inside the sample
        assert s["shift_labels"][at - 1] == -100, s


def test_k47_a_text_row_before_a_chat_row_in_one_chunk_trains_every_token(tmp_path):
    """M47: a chunk whose first chat document comes in a later batch than its text writes ones for that text
    (data/store.py ChunkWriter.add)."""
    tok = build_tokenizer(str(tmp_path / "tok"), "qwen25")
    src = _jsonl(tmp_path / "mix.jsonl", [{"text": "The quick brown fox jumps over the lazy dog."},
                                          {"messages": [U, {"role": "assistant", "content": "apple river"}]}])
    prepare([src], str(tmp_path / "o"), tok, workers=0, batch_docs=1, log=lambda _: None)  # a text-only batch first
    p = Prepared(str(tmp_path / "o"))
    first = np.asarray(p.mask.read(int(p.starts[0]), int(p.starts[0] + p.lens[0])))
    assert first.all() and chat_documents(p.mask, p.starts, p.lens).tolist() == [1]


def test_k54_an_opening_reply_under_trl_markers_does_not_train_the_prompts_token(tmp_path):
    """M54: an assistant turn first under TRL's deepseek_r1_distill_training.jinja (marks `<｜Assistant｜>` + reply):
    its run is cut past the generation prompt's marked token, as every later turn's is (data/chat_locate._first_cut)."""
    from tests.unit.data.test_chat_trl_templates import MULTI, R1_DISTILL_TRAINING, A, _pair

    _, trl = _pair(str(tmp_path), "deepseek_r1", R1_DISTILL_TRAINING)
    ids, mask, _ = trl.encode({"messages": [A("Hello, what shall I count?")] + MULTI})
    runs = _runs(trl, ids, mask)
    assert runs and not any(r.startswith("<｜Assistant｜>") for r in runs), runs
