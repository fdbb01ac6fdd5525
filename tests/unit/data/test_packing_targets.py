"""ConvPack drops a conversation with no target in its first min(length, seq_len) tokens, not only one longer than the
length (data/packing.py): a conversation that fits with no target (a head cut from its answer) was packed silently,
counted neither dropped nor truncated, and trained nothing. `targets` counts each document's supervised tokens in one
read of the mask (ConvPack.n_targets: the stage's truncation line and the loss-share note read it). Arrays: < 1 s."""

from __future__ import annotations

import numpy as np

from data.packing import ConvPack


def _store(docs):
    toks = np.concatenate([np.asarray(i, np.int64) for i, _ in docs])
    mask = np.concatenate([np.asarray(m, np.uint8) for _, m in docs])
    lens = np.asarray([len(i) for i, _ in docs], np.int64)
    return toks, mask, np.concatenate([[0], np.cumsum(lens)[:-1]]), lens


def test_a_fitting_conversation_without_a_target_is_dropped_and_counted():
    head = ([1] * 5, [0] * 5)  # a prompt without its answer: fits, trains nothing
    first_only = ([2] * 3, [1, 0, 0])  # its one target is its first token, which nothing of it predicts
    short = ([3, 4, 5], [0, 1, 1])
    long_early = ([6] * 10, [0, 0, 1] + [1] * 7)  # cut at 6, keeps 4 targets
    toks, mask, starts, lens = _store([head, first_only, short, long_early])
    pack = ConvPack(toks, mask, starts, lens, 6, pad_id=0)
    assert (pack.dropped, pack.untargeted, pack.truncated) == (2, 2, 1)
    assert pack.n_targets == 2 + 4 and pack.lost_targets == 4
    kept = {int(pack[i]["input_ids"][0]) for i in range(len(pack))}
    assert kept == {3, 6}  # neither the head nor first_only is in any sample
    assert sum(int((pack[i]["shift_labels"] != -100).sum()) for i in range(len(pack))) == pack.n_targets


def test_targets_count_each_documents_supervised_tokens_in_blocks():
    from data.packing import targets

    rng = np.random.default_rng(0)
    mask = (rng.random(50_000) < 0.3).astype(np.uint8)
    starts = rng.integers(0, 49_000, 800)  # unsorted, overlapping, gaps
    lens = np.minimum(rng.integers(0, 900, 800), 50_000 - starts)
    want = [int(mask[s + 1: s + n].sum()) if n > 1 else 0 for s, n in zip(starts, lens)]
    for block in (1, 100, 1 << 22):
        assert targets(mask, starts, lens, block=block).tolist() == want
    assert targets(None, starts, lens).tolist() == np.maximum(lens - 1, 0).tolist()
    # a long text document split into pieces (every token a target): its 1-token last piece is kept, not "dropped"
    pack = ConvPack(None, np.ones(13, np.uint8), [0], [13], 6, pad_id=0)
    assert (pack.split, pack.dropped, pack.n_targets) == (1, 0, 5 + 5)
