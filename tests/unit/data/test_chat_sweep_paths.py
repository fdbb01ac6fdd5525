"""The sweep's checks of packing and the held-out split (data/chat_sweep_paths.py `check_pack`, `check_stream`) see
what they are for: a label across a document bound, a conversation cut in two. The sweep itself runs in
tests/unit/data/test_chat_sweep.py (over the messages sweep's tokenizers and renderings). Small arrays, no tokenizer:
well under a second."""

from __future__ import annotations

import numpy as np

from data.chat_sweep_paths import check_pack, check_stream
from data.packing import ConvPack


def _docs(n: int = 9) -> list[tuple[list[int], np.ndarray]]:
    """n conversations (a header of 4 untrained tokens, a reply of 3 + k trained ones) and a text document."""
    rng = np.random.default_rng(0)
    docs = [(rng.integers(5, 99, 7 + k).tolist(), np.r_[np.zeros(4), np.ones(3 + k)].astype(np.uint8)) for k in range(n)]
    return docs + [(list(range(10, 22)), np.ones(12, np.uint8))]


def test_the_pack_check_sees_a_label_across_a_document_bound():
    docs = _docs()
    tokens = np.concatenate([np.asarray(i) for i, _ in docs])
    mask = np.concatenate([m for _, m in docs])
    lens = np.asarray([len(i) for i, _ in docs])
    starts = np.r_[0, np.cumsum(lens)[:-1]]
    pack = ConvPack(tokens, mask, starts, lens, 48, pad_id=0)
    whole = set(zip(starts.tolist(), lens.tolist()))
    assert check_pack(pack, tokens, mask, whole) == "trains"

    class Leaky:  # the pack with a document's last token labelled with the next one's first
        def __getattr__(self, name):
            return getattr(pack, name)

        def __len__(self):
            return len(pack)

        def __getitem__(self, i):
            s = pack[i]
            at = int(np.flatnonzero(s["position_ids"] == 0)[1])
            s["shift_labels"][at - 1] = s["input_ids"][at]
            return s
    assert check_pack(Leaky(), tokens, mask, whole).startswith("WRONG: sample 0: the document at 0 predicts")
    assert check_pack(pack, tokens, mask, whole - {(0, 7)}).startswith("WRONG: 10 documents placed, 9 given")


def test_the_stream_check_sees_a_conversation_cut(monkeypatch):
    import data.pipeline

    assert check_stream(_docs(), 0) == ("trains", "trains")
    monkeypatch.setattr(data.pipeline, "_chat", lambda prepared: None)  # the split told of no conversation
    assert check_stream(_docs(), 0)[1].startswith("WRONG: conversation ")
