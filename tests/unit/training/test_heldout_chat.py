"""The held-out conversation loss (issue 42's leftover): scripts/evaluate.py `--heldout` (chat rows rendered on the fly,
or a prepared folder's masks) scores the mean cross-entropy over the assistant's tokens, against an oracle computed
here without data/chat.py (the ChatML default written out by hand, each conversation alone); the same set read from
the folder scripts/prepare_data.py writes gives the same tokens and masks; a bad row is one line; summary.md, the stage
evaluation of a curriculum with an SFT stage (every stage, the "before" included) and scripts/eval_summary.py report
it. A per-token stand-in model (logits a fixed function of the current token: packing cannot change a token's loss),
no launch: ~3 s. The real model under SP 2 against the plain Hugging Face model:
tests/e2e/test_evaluate.py::test_evaluate_asks_through_the_chat_template (slow)."""

from __future__ import annotations

import importlib.util
import json
import os
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from base.parallel import ParallelDims
from data.tokenizer import Tokenizer
from model_utils.tiled_loss import _stats
from training.evaluation import evaluate_stage

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SP = os.path.join(ROOT, "recipes/base/tiny_passkey256/tokenizer.model")  # no template: the ChatML default
DIMS1 = ParallelDims(world=1, sp=1, rank=0, local_rank=0)
ROWS = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Repeat: apple river"},
                      {"role": "assistant", "content": "apple river"}, {"role": "user", "content": "Count them."},
                      {"role": "assistant", "content": "2 words"}]},
        {"conversations": [{"from": "human", "value": "Reverse: candle forest"}, {"from": "gpt", "value": "forest candle"}]},
        {"prompt": [{"role": "user", "content": "Say yes."}], "completion": [{"role": "assistant", "content": "yes"}]},
        {"prompt": "The sky is", "completion": " blue."}]


def _script(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "scripts", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class TokenEngine:
    """A stand-in model whose logits at a position are a fixed random function of that position's token, scored with
    the real `_stats` (the tiled loss's evaluation statistics)."""

    device = torch.device("cpu")

    def __init__(self, vocab: int):
        self.table = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 3

    def __call__(self, input_ids, position_ids, use_cache, tiled_loss_labels, eval_stats, eval_buckets=None):
        return _stats(lambda h: h, self.table[input_ids], tiled_loss_labels, 2, eval_buckets)

    eval = train = lambda self: None


def by_hand(tok: Tokenizer, row: dict) -> tuple[list[int], list[int]]:
    """(ids, target) of one row in the ChatML default written out without data/chat.py: `<|im_start|>{role}\n` +
    content + EOS + `\n`, the reply and its EOS the targets; a text pair: the completion and its EOS."""
    if isinstance(row.get("prompt"), str):
        p, whole = tok.encode(row["prompt"]), tok.encode(row["prompt"] + row["completion"]) + [tok.eos_id]
        return whole, [0] * len(p) + [1] * (len(whole) - len(p))  # TRL's: one text, the prompt's ids not trained
    msgs = row.get("messages") or (row.get("prompt", []) + row.get("completion", [])) or [
        {"role": {"human": "user", "gpt": "assistant"}[t["from"]], "content": t["value"]} for t in row["conversations"]]
    ids, target = [], []
    for m in msgs:
        head, body, tail = tok.encode(f"<|im_start|>{m['role']}\n"), tok.encode(m["content"]) + [tok.eos_id], tok.encode("\n")
        ids += head + body + tail
        target += [0] * len(head) + [int(m["role"] == "assistant")] * len(body) + [0] * len(tail)
    return ids, target


def oracle(tok: Tokenizer, logits_of, rows: list[dict]) -> tuple[float, int]:
    """(mean CE over the assistant's tokens of `rows`, their count), each conversation alone; `logits_of(ids)` ->
    [len, vocab] (a table lookup here; the plain Hugging Face model in tests/e2e/test_evaluate.py)."""
    total, count = 0.0, 0
    for row in rows:
        ids, target = by_hand(tok, row)
        ids_t = torch.tensor(ids)
        ce = F.cross_entropy(logits_of(ids_t)[:-1].double(), ids_t[1:], reduction="none")
        keep = torch.tensor(target[1:], dtype=torch.bool)
        total += ce[keep].sum().item()
        count += int(keep.sum())
    return total / count, count


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    d = tmp_path_factory.mktemp("heldout_chat")
    (d / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return d


def test_heldout_chat_loss_is_the_mean_over_the_assistants_tokens(chats):
    ev = _script("evaluate")
    tok = Tokenizer(SP)
    engine = TokenEngine(tok.vocab_size)
    want, n = oracle(tok, engine.table.__getitem__, ROWS)
    held = ev.heldout_set(str(chats / "chats.jsonl"), tok, "auto")
    for length, mb in ((96, 1), (256, 2)):  # the longest alone in its sample (96 tokens), or all packed in one
        got = ev.heldout_loss(engine, DIMS1, mb, tok.pad_id, held, length)
        assert got["heldout_chat_loss"] == pytest.approx(want, rel=1e-6) and got["heldout_chat_tokens"] == n
        assert (got["heldout_chat_conversations"], got["heldout_chat_length"]) == (len(ROWS), length)
    first2 = ev.heldout_loss(engine, DIMS1, 1, tok.pad_id, ev.heldout_set(str(chats / "chats.jsonl"), tok, "auto", 2), 256)
    assert first2["heldout_chat_loss"] == pytest.approx(oracle(tok, engine.table.__getitem__, ROWS[:2])[0], rel=1e-6)


def test_a_prepared_folder_gives_the_same_masks(chats):
    """The folder scripts/prepare_data.py writes (tokens + mask-*.bin) is read as written: the same tokens and masks as
    rendering the rows here; one prepared with another tokenizer, or a bad row, is refused in one line."""
    from data.prepare_data import prepare

    ev = _script("evaluate")
    tok = Tokenizer(SP)
    out = str(chats / "prepared")
    prepare([str(chats / "chats.jsonl")], out, SP, workers=0, log=lambda _: None)
    a, b = ev.heldout_set(str(chats / "chats.jsonl"), tok, "auto"), ev.heldout_set(out, tok, "auto")
    assert all(np.array_equal(a[k], b[k]) for k in ("ids", "mask", "lens"))
    (chats / "bad.jsonl").write_text(json.dumps(ROWS[0]) + "\n" + json.dumps({"messages": [{"role": "user",
                                                                                            "content": "hi"}]}) + "\n")
    with pytest.raises(ValueError, match=r"^--heldout .*bad.jsonl:2: no assistant turn") as e:
        ev.heldout_set(str(chats / "bad.jsonl"), tok, "auto")
    assert "\n" not in str(e.value)
    from tests.unit.data.chat_fixtures import build_tokenizer

    other = Tokenizer(build_tokenizer(str(chats / "toks"), "qwen25"))
    with pytest.raises(ValueError, match=r"prepared with tokenizer .* not the model's .*qwen25"):
        ev.heldout_set(out, other, "auto")


def test_summary_reports_it(chats):
    from training.eval_report import summary

    r = {"model": "m", "kind": "hf", "rope": None, "trials": {}, "chat": "chatml", "tasks": {}, "task_mean": {},
         "heldout_chat_loss": 1.25, "heldout_chat_tokens": 40, "heldout_chat_conversations": 4, "heldout_chat_length": 256}
    text = "\n".join(summary([r, {**r, "heldout_chat_loss": 1.0}], {}))
    assert "**held-out conversation loss**" in text and "| model | 1.2500 | 40 | 4 | 256 |" in text
    assert "| compare - model | -0.2500 |" in text


def _stage(i, n, kind):
    return types.SimpleNamespace(index=i, name=f"s{i}", max_seq_length=n, kind=kind,
                                 eval={"heldout_samples": 2, "position_buckets": 0, "tasks": []})


def test_every_stage_of_a_curriculum_with_sft_reports_it_and_eval_summary_shows_it(tmp_path, capsys):
    """A text stage before the SFT stage measures the held-out conversations at the SFT stage's length (the before);
    the SFT stage reuses its own held-out number; eval_summary prints before -> after and the table's column."""
    tok = Tokenizer(SP)
    engine, calls = TokenEngine(tok.vocab_size), []
    conv = {"input_ids": np.arange(8) + 5, "shift_labels": np.r_[-100, -100, np.arange(8, 13), -100],
            "position_ids": np.arange(8)}
    text = {**conv, "shift_labels": np.r_[np.arange(6, 13), -100]}

    def heldout_at(seq_len, n, **kw):
        calls.append((seq_len, kw))
        return [conv if kw.get("sft") else text] * n

    metrics = types.SimpleNamespace(log_eval=lambda *a: None, log_table=lambda *a, **k: None)
    stages = [_stage(0, 8, "text"), _stage(1, 16, "text"), _stage(2, 8, "sft")]
    ce = F.cross_entropy(engine.table[torch.arange(7, 12)], torch.arange(8, 13)).item()
    rows = []
    for st in stages:
        calls.clear()
        held = heldout_at(st.max_seq_length, 2, **({"sft": True} if st.kind == "sft" else {}))
        calls.clear()
        r = evaluate_stage(engine, st, DIMS1, held, None, metrics, st.index, 1, 0, stages, heldout_at)
        assert r["heldout_chat_loss"] == pytest.approx(ce) and r["heldout_chat_len"] == 8, st.name
        assert ((8, {"sft": True}) in calls) == (st.kind == "text"), (st.name, calls)
        rows.append({**r, "step": st.index})
    out = tmp_path / "run"
    os.makedirs(out / "eval")
    for r in rows:
        (out / "eval" / f"stage{r['stage']}.json").write_text(json.dumps(r))
    assert _script("eval_summary").main([str(out)]) == 0
    got = capsys.readouterr().out
    assert _script("eval_summary").main(["--help"]) == 0 and "usage:" in capsys.readouterr().out  # not a run path
    assert f"held-out conversation loss (assistant tokens) at 8: {ce:.4f} -> {ce:.4f}" in got
    assert "chat_loss@8" in got and f"| 2 | s2 | 2 | 8 | {rows[2]['heldout_loss']:.4f} |" in got


@pytest.fixture(scope="module")
def mixed(chats):
    """Text documents and the chats prepared together (what docs/sft.md recommends): text first, chats after."""
    from data.prepare_data import prepare

    (chats / "text.jsonl").write_text("".join(json.dumps({"text": f"plain text number {i} " * 6}) + "\n"
                                              for i in range(12)))
    out = str(chats / "mixed")
    prepare([str(chats / "text.jsonl"), str(chats / "chats.jsonl")], out, SP, workers=0, log=lambda _: None)
    return out


def test_a_mixed_folders_conversation_loss_counts_conversations_only(chats, mixed):
    """Issue 47 item 7: with text and chats in one folder, the held-out conversation loss is the chats' alone, in
    scripts/evaluate.py --heldout FOLDER and in the run's evaluation (RunData.heldout with sft). On the old code the
    text documents' every token was a supervised held-out token (--heldout: 12 text documents first, so
    `--heldout_conversations 4` read text only)."""
    from data.pipeline import RunData
    from data.store import Prepared

    ev, tok = _script("evaluate"), Tokenizer(SP)
    alone = ev.heldout_set(str(chats / "chats.jsonl"), tok, "auto")
    for limit in (0, len(ROWS)):
        got = ev.heldout_set(mixed, tok, "auto", limit)
        assert all(np.array_equal(alone[k], got[k]) for k in ("ids", "mask", "lens")), limit
    p = Prepared(mixed)
    data = RunData(p, p.lens.copy() * 0, np.arange(len(p.lens)), tok, True)  # every document held out
    samples = data.heldout(256, 8, sft=True)
    want = sum(int(m[1:].sum()) for m in np.split(alone["mask"], np.cumsum(alone["lens"])[:-1]))
    assert sum(int((s["shift_labels"] != -100).sum()) for s in samples) == want


def test_no_held_out_conversation_is_none_never_zero(chats):
    """An empty held-out set reports no loss: the run's evaluation leaves heldout_chat_loss out (it wrote 0.0),
    --heldout whose every conversation is dropped has no heldout_chat_loss and summary.md says none."""
    tok = Tokenizer(SP)
    engine = TokenEngine(tok.vocab_size)
    text = {"input_ids": np.arange(8) + 5, "shift_labels": np.r_[np.arange(6, 13), -100], "position_ids": np.arange(8)}
    metrics = types.SimpleNamespace(log_eval=lambda *a: None, log_table=lambda *a, **k: None)
    stages = [_stage(0, 8, "text"), _stage(1, 8, "sft")]
    r = evaluate_stage(engine, stages[0], DIMS1, [text] * 2, None, metrics, 0, 1, 0, stages,
                       lambda seq_len, n, sft=False: [] if sft else [text] * n)
    assert "heldout_loss" in r and "heldout_chat_loss" not in r and "heldout_chat_len" not in r
    r = evaluate_stage(engine, stages[1], DIMS1, [], None, metrics, 0, 1, 0, stages, None)
    assert "heldout_chat_loss" not in r and "heldout_loss" not in r
    ev = _script("evaluate")
    held = ev.heldout_set(str(chats / "chats.jsonl"), tok, "auto", 1)
    held["mask"][:] = 0  # nothing supervised (every target cut away)
    got = ev.heldout_loss(engine, DIMS1, 1, tok.pad_id, held, 256)
    assert "heldout_chat_loss" not in got and got["heldout_chat_tokens"] == 0
    row = {"model": "m", "kind": "hf", "rope": None, "trials": {}, "chat": "chatml", "tasks": {}, "task_mean": {}, **got}
    from training.eval_report import summary
    from training.eval_tables import eval_tables

    assert "| model | none | 0 | 0 | 256 |" in "\n".join(summary([row], None))

    rows = [{"stage": 0, "stage_name": "s0", "step": 1, "seq_len": 8, "heldout_loss": 2.0, "heldout_chat_loss": 1.5,
             "heldout_chat_len": 8}, {"stage": 1, "stage_name": "s1", "step": 2, "seq_len": 8, "heldout_loss": 1.0}]
    assert "| 1 | s1 | 2 | 8 | 1.0000 | none | none |" in "\n".join(eval_tables(rows))  # was nan
    # a depth or a length only another stage was evaluated at: `-` (was `nan`, which reads as a diverged run)
    rows = [{**rows[0], "passkey_accuracy": {"0.5": 1.0}, "task_mean": {"niah": {"256": 0.5}}},
            {**rows[1], "passkey_accuracy": {"0.25": 0.0}, "task_mean": {"niah": {"512": 1.0}}}]
    text = "\n".join(eval_tables(rows))
    assert "nan" not in text and "| 0 | 8 | 0.50 | - |" in text and "| 1 | s1 | 2 | 8 | 1.0000 | none | none | 0.00 | - |" in text


def test_the_loss_by_position_is_by_a_tokens_context():
    """Held-out samples pack many documents at long lengths, their positions restarted: bucketed by offset in the
    sample, every slice held tokens of little context (the last too), not the curve docs/curriculum.md describes. By
    a token's position in its document: two documents of 4 in a sample of 8 fill the first half's bucket only."""
    from training.evaluation import sample_stats

    sample = {"input_ids": np.arange(8) + 5, "shift_labels": np.r_[np.arange(6, 13), -100],
              "position_ids": np.r_[np.arange(4), np.arange(4)]}
    stats = sample_stats(TokenEngine(32), [sample], ParallelDims(world=1, sp=1, rank=0, local_rank=0), 1, 0, buckets=2)
    counts = stats[0, 3 + 2:].tolist()  # [sums of bucket 0, 1, counts of bucket 0, 1]
    assert counts == [7.0, 0.0] and stats[0, 1].item() == 7
