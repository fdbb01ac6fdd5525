"""What an SFT stage's data says about long context at start-up (data/sft_notes.py, printed by
data/pipeline.open_run_data): a plain SFT stage shorter than the model's positions that mixes no long data (no tasks,
replay or long component) is said once (short SFT alone loses retrieval past its length: it was silent); under
`loss_weighting: conversation` with several components each one's expected share of the loss is said (a long-text
component's piece counts as one conversation: a books component at 5% of the samples carried ~0.06% of the loss at
128k, unsaid). Small prepared folders, no launch: ~3 s."""

from __future__ import annotations

import json
import os
import re
import types

import numpy as np

from data.chat import build_demo_chats
from data.packing import ConvPack
from data.sft_notes import eval_reach_note, loss_share_note, model_positions, retention_note
from data.tokenizer import Tokenizer

SP = ".cache/demo/stdlib_sp.model"


def _stage(i, n, data, **kw):
    return types.SimpleNamespace(**{"index": i, "name": f"s{i}", "max_seq_length": n, "eval": {}, "data": data,
                                    "tasks": {}, "replay": None, "kind": "sft", "loss_weighting": "token", **kw})


def test_open_run_data_says_a_plain_sft_stage_and_the_loss_shares(tmp_path, capsys):
    from data.pipeline import open_run_data
    from data.prepare_data import prepare

    chats = build_demo_chats(str(tmp_path / "chat.jsonl"), 200, seed=3)
    (tmp_path / "books.jsonl").write_text("".join(json.dumps({"text": f"page {i} " + "the river runs on " * 300})
                                                  + "\n" for i in range(6)))
    out = str(tmp_path / "prep")
    prepare([f"chat={chats}", f"books={tmp_path / 'books.jsonl'}"], out, SP, workers=0, log=lambda _: None)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 8192}))
    both = [{"name": "chat", "source": "chat", "weight": 0.95}, {"name": "books", "source": "books", "weight": 0.05}]
    stages = [_stage(0, 2048, [{"name": "chat", "source": "chat", "weight": 1.0}]),  # chats alone: said
              _stage(1, 2048, both, loss_weighting="conversation"),  # a long component: its share said
              _stage(2, 2048, [{"name": "chat", "source": "chat", "weight": 1.0}], tasks={"passkey": 0.05})]
    open_run_data(out, SP, Tokenizer(SP).vocab_size, stages, reset_position_ids=True, model_path=str(model))
    said = capsys.readouterr().out
    got = [line for line in said.splitlines() if "loss_weighting" in line or "long data" in line]
    assert len(got) == 2, got
    # retrieval evaluated at 2048 only (`earlier` of the first stage) on a model of 8192 positions: said at start-up
    reach = [line for line in said.splitlines() if "is never scored" in line]
    assert reach and reach[0].startswith("note: stage 0 (s0): retrieval is evaluated up to 2048"), reach
    assert got[0].startswith("note: stage 0 (s0): SFT at 2048 tokens mixes no long data (no tasks / replay / component ")
    assert "on a model of 8192 positions: short SFT alone loses retrieval past 2048 (docs/sft.md#retention-after-sft" \
        in got[0]
    share = re.search(r"books (0\.\d+) \(0\.050 of the samples x (\d+\.\d) a sample\)", got[1])
    assert got[1].startswith("note: stage 1 (s1) at 2048, loss_weighting conversation: ") and share, got[1]
    assert float(share[1]) < 0.01 and 0 < float(share[2]) < 2 and "`loss_weighting: token`" in got[1]  # 5% of the samples
    # the same model at 2048 positions has nothing past the stage to lose
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 2048}))
    open_run_data(out, SP, Tokenizer(SP).vocab_size, stages[:1], reset_position_ids=True, model_path=str(model))
    assert "long data" not in capsys.readouterr().out


def test_the_loss_share_is_the_sample_share_times_the_units_a_sample():
    """A chat pack of 100 conversations a sample against a text pack of one piece a sample, 0.9 / 0.1 of the samples,
    2% tasks: shares 0.9*0.98*100 : 0.1*0.98*1 : 0.02*1 of the conversations, as /tmp's weights.py measured them."""
    chat = ConvPack(None, None, np.arange(0, 10_000, 10), np.full(1000, 10), 1000, 0)  # 100 a sample
    text = ConvPack(None, None, [0], [10_000], 1000, 0)  # one 10k document: 10 pieces of 1000, one a sample
    mix = types.SimpleNamespace(parts=[chat, text], names=["chat", "books"])
    stage = _stage(0, 1000, {"chat": 0.9, "books": 0.1}, loss_weighting="conversation", tasks={"passkey": 0.02})
    note = loss_share_note(stage, mix)
    total = 0.9 * 0.98 * 100 + 0.1 * 0.98 + 0.02
    assert f"chat {0.9 * 0.98 * 100 / total:.4f} (0.882 of the samples x 100.0 a sample)" in note
    assert f"books {0.1 * 0.98 / total:.4f} (0.098 of the samples x 1.0 a sample)" in note
    assert f"passkey {0.02 / total:.4f}" in note
    assert loss_share_note(_stage(0, 1000, {"chat": 0.9, "books": 0.1}), mix) == ""  # token weighting: nothing
    assert loss_share_note(stage, types.SimpleNamespace(parts=[chat], names=["chat"])) == ""  # one component


def _qa(n_docs, length, answer, L):
    """A ConvPack of `n_docs` conversations of `length` tokens, each with `answer` targets at its end."""
    lens = np.full(n_docs, length)
    starts = np.arange(n_docs) * length
    mask = np.zeros(n_docs * length, np.uint8)
    for s in starts:
        mask[s + length - answer: s + length] = 1
    return ConvPack(None, mask, starts, lens, L, 0)


def test_a_component_far_below_its_share_is_said_under_token_weighting_pointing_the_right_way():
    """The audit's exp6 in small: 90% chats (100 tokens, 55 supervised) and 10% long QA (3,000-token documents,
    2-token answers) at 8192. By token (the default) long QA gets ~0.01% of the loss, and nothing was said; by
    conversation ~0.3%, and the note advised `loss_weighting: token`, which cuts it further. Now both say each share
    under both weightings; the token note names conversation weighting, the conversation note the weight."""
    L = 8192
    chat, qa = _qa(4000, 100, 55, L), _qa(100, 3000, 2, L)  # ~81 chats of 54 targets, 2 documents of 2, a sample
    mix = types.SimpleNamespace(parts=[chat, qa], names=["chat", "longqa"])
    data = [{"name": "chat", "source": "c", "weight": 0.9}, {"name": "longqa", "source": "q", "weight": 0.1}]
    token = loss_share_note(_stage(0, L, data, tasks=None), mix)
    per = chat.n_targets / len(chat)
    by_tok = 0.1 * 4 / (0.9 * per + 0.1 * 4)
    by_conv = 0.1 * 2 / (0.9 * 4000 / len(chat) + 0.1 * 2)
    assert qa.n_targets / len(qa) == 4 and by_tok * 4 < 0.1 and by_conv > 8 * by_tok
    assert token.startswith("note: stage 0 (s0) at 8192, loss_weighting token: every supervised token weighs alike, "
                            f"so the expected share of the loss is chat {1 - by_tok:.4f} (0.900 of the samples x "
                            f"{per:.0f} supervised tokens a sample), longqa {by_tok:.4f} (0.100 of the samples x 4 supervised "
                            f"tokens a sample); under `loss_weighting: conversation`: chat {1 - by_conv:.4f}, longqa "
                            f"{by_conv:.4f}: longqa trains {by_tok:.4f} of the loss at 0.100 of the samples: "
                            f"`loss_weighting: conversation` gives it {by_conv:.4f}"), token
    assert "or raise its weight in `data:`" in token and "\n" not in token
    conv = loss_share_note(_stage(0, L, data, tasks=None, loss_weighting="conversation"), mix)
    assert f"under `loss_weighting: token`: chat {1 - by_tok:.4f}, longqa {by_tok:.4f}: longqa trains {by_conv:.4f} " \
        "of the loss at 0.100 of the samples: raise its weight in `data:`" in conv, conv
    assert "`loss_weighting: token` gives" not in conv
    # shares near the samples' (two chat sets): nothing said under token weighting
    even = types.SimpleNamespace(parts=[_qa(4000, 100, 55, L), _qa(4000, 120, 50, L)], names=["a", "b"])
    assert loss_share_note(_stage(0, L, data, tasks=None), even) == ""


def test_what_counts_as_long_data_and_the_model_positions(tmp_path):
    prepared = types.SimpleNamespace(sources=["chat", "long"], source=np.array([0] * 50 + [1] * 5),
                                     lens=np.array([300] * 50 + [20_000] * 5))
    stage = _stage(0, 65536, {"chat": 0.9, "long": 0.1})
    assert retention_note(stage, prepared, 131072) == ""  # 20k documents: a quarter of 64k and more
    assert "mixes no long data" in retention_note(_stage(0, 65536, {"chat": 1.0}), prepared, 131072)
    assert retention_note(_stage(0, 65536, None), prepared, 131072) == ""  # the stream: mostly long tokens
    assert retention_note(_stage(0, 65536, {"chat": 1.0}), prepared, 65536) == ""  # nothing past it to lose
    assert retention_note(_stage(0, 65536, {"chat": 1.0}, kind="text"), prepared, 131072) == ""
    assert retention_note(_stage(0, 65536, {"chat": 1.0}, replay={8192: 0.2}), prepared, 131072) == ""
    assert retention_note(_stage(0, 65536, {"chat": 1.0}, tasks={"chat": True}), prepared, 131072) != ""  # no task
    assert retention_note(_stage(0, 65536, {"chat": 1.0}), prepared, None) == ""
    assert model_positions("tiny-llama") == 131072 and model_positions(str(tmp_path)) is None
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"max_position_embeddings": 262144},
                                                      "max_position_embeddings": 8192}))
    assert model_positions(str(tmp_path)) == 262144


def test_an_sft_stage_short_of_the_models_positions_names_the_eval_lengths_that_reach_them(tmp_path):
    """A standalone SFT at 128k of a model already extended to 1M (recipes/qwen25_7b_instruct_sft_128k.yaml after
    one's own extension) evaluated retrieval at 128k only (`earlier`: the run's one length), tasks or not, unsaid."""
    sft = _stage(0, 131072, {"chat": 0.9, "long": 0.1}, tasks={"passkey": 0.02})  # retention_note: silent (tasks)
    note = eval_reach_note(sft, 1048576)
    assert note.startswith("note: stage 0 (s0): retrieval is evaluated up to 131072 (eval.lengths earlier) on a model "
                           "of 1048576 positions") and "\n" not in note, note
    assert "`eval: {lengths: [131072, 1048576]}`" in note and "scripts/evaluate.py CHECKPOINT --lengths 1048576" in note
    assert eval_reach_note(sft, 1048576, [sft]) == note
    assert eval_reach_note(_stage(0, 131072, None, eval={"lengths": [131072, 1048576]}), 1048576) == ""  # reaches it
    assert eval_reach_note(_stage(0, 131072, None, eval={"tasks": []}), 1048576) == ""  # no retrieval evaluated
    assert eval_reach_note(_stage(0, 131072, None, kind="text"), 1048576) == ""
    assert eval_reach_note(sft, 131072) == "" and eval_reach_note(sft, None) == ""
    # the stage's own RoPE sets its positions: YaRN x4 over 32768 reaches 131072, nothing past the stage
    assert eval_reach_note(_stage(0, 131072, None, rope={"rope_type": "yarn", "factor": 4.0,
                                                         "original_max_position_embeddings": 32768}), 1048576) == ""
    # a run that extends to 1M first: `earlier` of its SFT stage reaches 1M; without the run's stages, not decided
    ext = _stage(0, 1048576, None, kind="text")
    later = _stage(1, 131072, None)
    assert eval_reach_note(later, 1048576, [ext, later]) == "" and eval_reach_note(later, 1048576) == ""
    assert "up to 262144" in eval_reach_note(later, 1048576, [_stage(0, 262144, None, kind="text"), later])
    # the model's positions: max_position_embeddings or its RoPE scaling's reach, the larger
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 32768, "rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}))
    assert model_positions(str(tmp_path)) == 131072


def test_a_text_stage_gets_no_loss_share_note():
    """A text stage under conversation weighting (DocPack parts: no conversations) printed every share as 0.0000
    (a review): no note there."""
    import types

    from data.sft_notes import loss_share_note

    stage = types.SimpleNamespace(loss_weighting="conversation", index=0, name="s", tasks=None,
                                  data={"web": 0.5, "books": 0.5}, max_seq_length=1024)
    mix = types.SimpleNamespace(parts=[types.SimpleNamespace(), types.SimpleNamespace()], names=["web", "books"])
    assert loss_share_note(stage, mix) == ""


def test_chat_tasks_render_at_the_preparations_instant(tmp_path):
    """`tasks: {chat: true}` renders an SFT stage's synthetic samples through the chat template on every rank: a
    template writing today's date read each rank's own clock, so across a midnight the ranks of one SP group rendered
    samples of different tokens. Every rank now renders at the prepared folder's `created` instant."""
    import datetime

    from data.pipeline import open_run_data
    from data.prepare_data import prepare
    from data.store import MANIFEST

    chats = build_demo_chats(str(tmp_path / "chat.jsonl"), 40, seed=3)
    out = str(tmp_path / "prep")
    prepare([f"chat={chats}"], out, SP, workers=0, log=lambda _: None)
    created = json.load(open(os.path.join(out, MANIFEST)))["created"]
    stage = _stage(0, 2048, [{"name": "chat", "source": "chat", "weight": 1.0}], tasks={"passkey": 0.05, "chat": True})
    data = open_run_data(out, SP, Tokenizer(SP).vocab_size, [stage], reset_position_ids=True)
    ds, _ = data.stage_view(stage, 1, 0, 1, seed=0)
    assert ds.chat.clock.at == datetime.datetime.fromisoformat(created)
