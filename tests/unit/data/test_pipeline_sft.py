"""What an SFT stage's start says of its data (data/pipeline.py): the truncation line gives the share of the stage's
supervised tokens its cuts lose (it gave counts only), and a stage or mixture component left with no sample names
the held-out setting where the held-out documents hold conversations it would train. In-memory streams: < 1 s."""

from __future__ import annotations

import types

import numpy as np
import pytest


def _data(docs, held=()):
    """A RunData over conversations given as (length, targets at the end); documents `held` held out whole."""
    from data.pipeline import RunData

    lens = np.asarray([n for n, _ in docs], np.int64)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
    mask = np.zeros(int(lens.sum()), np.uint8)
    for s, (n, k) in zip(starts, docs):
        mask[s + n - k: s + n] = 1
    prepared = types.SimpleNamespace(tokens=np.arange(int(lens.sum())) % 50 + 1, starts=starts, lens=lens, mask=mask,
                                     sources=["web"], source=np.zeros(len(lens), np.int32), manifest={})
    cut = lens.copy()
    cut[list(held)] = 0
    return RunData(prepared, cut, np.asarray(held, np.int64), None, reset_position_ids=True)


def _stage(n, **kw):
    return types.SimpleNamespace(**{"index": 0, "name": "sft", "max_seq_length": n, "max_steps": 4, "sp": 1,
                                    "data": None, "replay": None, "tasks": None, "kind": "sft", **kw})


def test_the_truncation_line_gives_the_share_of_the_stages_supervised_tokens(capsys):
    """Ten 50-token chats with 20 targets each (200) and one 300-token conversation whose last 250 tokens are targets,
    cut at 128: 172 of its targets lie past the cut, 172 / 450 of the stage's supervised tokens; a 400-token one with
    its 10 targets past the cut is dropped (its 10 lost too: 182 / 460)."""
    data = _data([(50, 20)] * 10 + [(300, 250)])
    data.stage_view(_stage(128), 1, 0, 1, seed=0)
    out = capsys.readouterr().out
    assert "1 conversation(s) cut to the length, 0 dropped (no supervised token in their first 128 tokens" in out, out
    assert "172 supervised token(s) past the cuts not trained (38.2% of the stage's supervised tokens)" in out, out
    _data([(50, 20)] * 10 + [(300, 250), (400, 10)]).stage_view(_stage(128), 1, 0, 1, seed=0)
    assert "182 supervised token(s) past the cuts not trained (39.6% of the stage's supervised tokens)" in \
        capsys.readouterr().out


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
