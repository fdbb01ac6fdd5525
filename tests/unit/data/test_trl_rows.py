"""Rows as TRL's SFTTrainer leaves or reads them (TRL f2cd577: sft_trainer.py, data_utils.py), read as TRL means them:
pre-tokenized ids with `assistant_masks` / `completion_mask` train their masked tokens only (data/ids_rows.py), a
packed row (`seq_lengths`, restarting `position_ids`) is split into its documents (test_ids_rows.py), a string completion ending with the EOS gets no
second one and an empty one is refused as an empty reply is, and a `{% generation %}` template marking
`<|im_end|>\\n` draws no "never shown where to stop" count. Before, each of these trained without a word."""

from __future__ import annotations

import json

import numpy as np
import pytest

from data.chat import ChatEncoder, RowError
from data.prepare_data import main, prepare
from data.store import Prepared
from data.tokenizer import Tokenizer
from tests.unit.data.chat_fixtures import CHATML_MARKERS, build_tokenizer
from tests.unit.data.test_prepare_data import _SP

QUIET = {"workers": 0, "log": lambda _: None}
IDS = [5, 6, 7, 8, 9, 10]
MASK = [0, 0, 0, 1, 1, 1]


def _docs(folder) -> list[tuple[list[int], list[int]]]:
    p = Prepared(str(folder))
    return [(p.tokens.read(int(s), int(s + n)).tolist(),
             np.asarray(p.mask.read(int(s), int(s + n))).tolist() if p.mask is not None else None)
            for s, n in zip(p.starts, p.lens)]


def _write(tmp_path, form: str, rows: list[dict]) -> str:
    if form == "jsonl":
        (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(tmp_path / "d.jsonl")
    import datasets

    ds = datasets.Dataset.from_list(rows)
    if form == "parquet":
        ds.to_parquet(str(tmp_path / "d.parquet"))
        return str(tmp_path / "d.parquet")
    ds.save_to_disk(str(tmp_path / "d"))
    return str(tmp_path / "d")


@pytest.mark.parametrize("form", ["jsonl", "parquet", "hf_disk"])
def test_trl_loss_masks_beside_ids_are_the_loss_mask(tmp_path, form, capsys):
    """`{"input_ids", "assistant_masks"}` / `completion_mask` (TRL's processed columns) trained every token: now the
    mask is the row's loss mask, as a chat document's (mask-*.bin, chat_docs, supervised_tokens; the ids as given, no
    BOS or EOS added); both: a target where both say so (TRL's build_labels). A mask that is none is one line."""
    rows = [{"input_ids": IDS, "assistant_masks": MASK, "completion_mask": None},
            {"input_ids": IDS, "assistant_masks": None, "completion_mask": MASK},
            {"input_ids": IDS, "assistant_masks": [0, 1, 1, 1, 1, 0], "completion_mask": MASK},
            {"input_ids": [11, 12], "assistant_masks": None, "completion_mask": None}]  # a text document beside them
    src = _write(tmp_path, form, rows)
    manifest = prepare([src], str(tmp_path / "out"), _SP, eos_id=2, **QUIET)
    docs = _docs(tmp_path / "out")
    assert docs[:3] == [(IDS, MASK), (IDS, MASK), (IDS, [0, 0, 0, 1, 1, 0])]
    assert docs[3][1] == [1] * len(docs[3][0])  # the plain ids: every token, as before
    assert manifest["chat_docs"] == 3 and manifest["supervised_tokens"] == 8
    capsys.readouterr()
    for bad, match in (([1, 1], "assistant_masks (2 values) beside 6 ids is no 0/1 loss mask"),
                       ([0, 2, 1, 1, 1, 1], "assistant_masks (6 values) beside 6 ids is no 0/1 loss mask"),
                       ([1, 0, 0, 0, 0, 0], "assistant_masks mark no token to train")):
        sub = tmp_path / f"bad{len(list((tmp_path).glob('bad*')))}"
        sub.mkdir()
        src = _write(sub, form, [{"input_ids": IDS, "assistant_masks": bad}])
        capsys.readouterr()  # datasets' progress bars
        assert main(["--input", src, "--output", str(sub / "o"), "--tokenizer_name_or_path", _SP, "--workers", "0"]) == 2
        err = capsys.readouterr().err.strip()
        assert match in err and "\n" not in err, err


def test_a_masked_row_through_the_encoder_and_loss_on_all():
    """What the workers hand data/chat.py: the row's mask; `--loss_on all` trains every token, as for a chat row."""
    from data.ids_rows import MASKED
    from data.readers import Fields, parse_item

    value, _, err = parse_item(json.dumps({"input_ids": IDS, "assistant_masks": MASK}).encode(), Fields())
    assert err is None and MASKED in value
    tok = Tokenizer(_SP)
    ids, mask, _ = ChatEncoder(tok).encode(value)
    assert ids == IDS and mask.tolist() == MASK
    assert ChatEncoder(tok, loss_on="all").encode(value)[1].tolist() == [1] * 6


def test_a_masked_ids_row_needs_no_tokenizer(tmp_path, capsys):
    """Ids with `assistant_masks` and no tokenizer (--vocab_size) were refused as "a text or chat document needs a
    tokenizer ... or give input_ids", though the row gave them: its ids and mask are given, nothing is rendered. Read
    as with a tokenizer (the mask, no EOS added; `--loss_on all`: every token); a chat row still needs one."""
    src = _write(tmp_path, "jsonl", [{"input_ids": IDS, "assistant_masks": MASK}, {"input_ids": [11, 12]}])
    manifest = prepare([src], str(tmp_path / "out"), vocab_size=100, eos_id=2, **QUIET)
    assert _docs(tmp_path / "out") == [(IDS, MASK), ([11, 12, 2], [1, 1, 1])]
    assert (manifest["chat_docs"], manifest["supervised_tokens"], manifest["bad_rows"]) == (1, 3, 0)
    prepare([src], str(tmp_path / "all"), vocab_size=100, eos_id=2, loss_on="all", **QUIET)
    assert _docs(tmp_path / "all")[0] == (IDS, [1] * 6)
    (tmp_path / "c").mkdir()
    chats = _write(tmp_path / "c", "jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    assert main(["--input", chats, "--output", str(tmp_path / "o"), "--vocab_size", "100", "--workers", "0"]) == 2
    assert "a text or chat document needs a tokenizer" in capsys.readouterr().err


@pytest.mark.parametrize("form", ["jsonl", "parquet"])
def test_a_packed_row_of_one_document_is_read(tmp_path, form):
    """TRL's pack_dataset writes two conversations in one row with `seq_lengths: [57, 59]`: read as one document they
    attended to each other (split now: test_ids_rows.py). A row that is one document (`[n]`, positions 0..n-1) is
    read as plain ids."""
    src = _write(tmp_path, form, [{"input_ids": IDS, "seq_lengths": [6], "position_ids": list(range(6))}])
    prepare([src], str(tmp_path / "one"), vocab_size=100, eos_id=2, **QUIET)
    assert _docs(tmp_path / "one") == [(IDS + [2], None)]


def test_the_in_process_stream_refuses_what_it_cannot_carry(tmp_path):
    """data/packing.build_token_stream (data/jsonl.read_documents) reads ids alone: a loss mask, differing labels or
    packing columns that are none are refused in one line (before: every token trained, documents joined)."""
    from data.packing import build_token_stream

    for k, (row, match) in enumerate((({"completion_mask": MASK}, "completion_mask beside input_ids: a loss mask"),
                                      ({"labels": [-100] * 3 + IDS[3:]}, "'labels' that differ"),
                                      ({"seq_lengths": [2, 5]}, r"seq_lengths \[2, 5\] add up to 7"))):
        src = tmp_path / f"r{k}.jsonl"
        src.write_text(json.dumps({"input_ids": IDS, **row}) + "\n")
        with pytest.raises(ValueError, match=match) as e:
            build_token_stream(str(src), None, 100, str(tmp_path / "cache"))
        assert str(e.value).startswith(f"{src}:1: ") and "\n" not in str(e.value)
    src = tmp_path / "same.jsonl"
    src.write_text(json.dumps({"input_ids": IDS, "labels": IDS, "seq_lengths": [6]}) + "\n")
    assert np.load(build_token_stream(str(src), None, 100, str(tmp_path / "cache"))[0]).tolist() == IDS


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return Tokenizer(build_tokenizer(str(tmp_path_factory.mktemp("trl_rows")), "qwen25"))


def test_a_completion_ending_with_the_eos_gets_no_second_one_and_an_empty_one_is_refused(qwen):
    """TRL appends the EOS to a string completion only where it does not end with it (sft_trainer.py:1439-1443): here
    `" four<|im_end|>"` trained `<|im_end|><|im_end|>`. An empty completion trained a bare EOS, where a chat row's
    empty reply is refused ("would teach the model to stop at once"): the same now, but under `--loss_on all`."""
    enc = ChatEncoder(qwen)
    plain = enc.encode({"prompt": "Q: two plus two?\nA:", "completion": " four"})
    own = enc.encode({"prompt": "Q: two plus two?\nA:", "completion": " four<|im_end|>"})
    assert own[0] == plain[0] and own[1].tolist() == plain[1].tolist() and own[0].count(qwen.eos_id) == 1
    for c in ("", " ", "<|im_end|>"):
        with pytest.raises(RowError, match="completion: an empty reply") as e:
            enc.encode({"prompt": "Q: say nothing\nA:", "completion": c})
        assert "\n" not in str(e.value)
    ids, mask, _ = ChatEncoder(qwen, loss_on="all").encode({"prompt": "Q: say nothing\nA:", "completion": ""})
    assert ids[-1] == qwen.eos_id and mask.all()


def test_markers_around_the_end_of_turn_and_its_newline_are_no_missing_stop(qwen):
    """TRL's training templates (qwen2_5_training.jinja, ...) put `<|im_end|>\\n` inside `{% generation %}`: the last
    trained token is the newline, and every row was counted as never shown where to stop (the warning said to append
    an end-of-turn: following it doubled it). The markers decide what is trained; the newline after the stop is
    stepped over."""
    tok = Tokenizer(qwen.path)
    tok.hf.chat_template = CHATML_MARKERS.replace("'<|im_end|>' }}{% endgeneration %}{{ '\n' }}",
                                                  "'<|im_end|>\n' }}{% endgeneration %}")
    assert tok.hf.chat_template != CHATML_MARKERS
    enc = ChatEncoder(tok)
    assert enc.kind == "markers"
    ids, mask, stats = enc.encode({"messages": [{"role": "user", "content": "Count them."},
                                                {"role": "assistant", "content": "2 words"}]})
    assert tok.hf.decode([t for t, m in zip(ids, mask) if m]) == "2 words<|im_end|>\n"
    assert stats["no_stop_rows"] == 0


def test_a_completion_holding_a_stops_text_is_refused_as_a_messages_reply_is(qwen, tmp_path):
    """A string completion quoting `<|endoftext|>` / `<|im_end|>` (code about tokenizers) was tokenized with them as
    control tokens and trained: the model learnt to stop mid-reply, while the same reply as `messages` is refused
    naming the token. Now refused alike, in one line naming the field; a completion ending with the EOS (TRL's form)
    is read; --skip_bad_rows skips and counts it, as a messages row; --loss_on all trains every token, as it does
    a messages row's."""
    code = "Use tokenizer.encode('<|endoftext|>') to get the id. Then print <|im_end|> too."
    enc = ChatEncoder(qwen)
    for c in (code, code + "<|im_end|>"):
        with pytest.raises(RowError, match=r"^completion: its text holds the end-of-turn token's text \[") as e:
            enc.encode({"prompt": "How do I get GPT-2's end token?", "completion": c})
        assert "<|endoftext|>" in str(e.value) and "<|im_end|>" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(RowError, match="its text holds the end-of-turn token's text"):
        enc.encode({"messages": [{"role": "user", "content": "How?"}, {"role": "assistant", "content": code}]})
    assert enc.encode({"prompt": "Q:", "completion": " four<|im_end|>"})[0].count(qwen.eos_id) == 1
    assert ChatEncoder(qwen, loss_on="all").encode({"prompt": "Q:", "completion": code})[1].all()
    rows = [{"prompt": "How?", "completion": code}, {"prompt": "Q:", "completion": " four"}]
    m = prepare([_write(tmp_path, "jsonl", rows)], str(tmp_path / "o"), qwen.path, skip_bad_rows=True, **QUIET)
    assert (m["bad_rows"], m["chat_docs"]) == (1, 1) and "completion: its text holds" in m["bad_examples"][0]


def test_a_reply_ending_with_stops_ends_at_the_first(qwen):
    """A review: a completion was refused where a stop's text remained after one trailing EOS string was stripped,
    though nothing follows it: `' Paris<|im_end|><|im_end|>'`, `' Paris<|im_end|>\\n'`, Qwen's `' Paris<|endoftext|>'`
    (end-of-text after the text); a messages reply ending so was left untrained (a one-turn row refused). Stops' texts
    and blanks after the text end it: its text up to the first stop, then one EOS (a reply: its template's end-of-turn),
    as `' Paris'` is read; text after a stop is still refused; --loss_on all trains every token as given."""
    enc, row = ChatEncoder(qwen), {"prompt": "Q: the capital of France?\nA:"}
    plain = enc.encode({**row, "completion": " Paris"})
    for c in (" Paris<|im_end|><|im_end|>", " Paris<|im_end|>\n", " Paris<|endoftext|>", " Paris<|endoftext|><|im_end|>",
              " Paris<|im_end|> \n<|endoftext|>\n"):
        ids, mask, _ = enc.encode({**row, "completion": c})
        assert (ids, mask.tolist()) == (plain[0], plain[1].tolist()), c
    assert qwen.hf.decode(enc.encode({**row, "completion": " Paris\n<|im_end|>"})[0][-2:]) == "\n<|im_end|>"
    with pytest.raises(RowError, match=r"^completion: its text holds the end-of-turn token's text \['<\|im_end\|>'\]"):
        enc.encode({**row, "completion": " Paris<|im_end|> or Lyon<|im_end|>"})
    assert ChatEncoder(qwen, loss_on="all").encode({**row, "completion": " Paris<|im_end|><|im_end|>"})[0].count(
        qwen.eos_id) == 2
    q = [{"role": "user", "content": "The capital of France?"}]
    chat = lambda *replies: enc.encode({"messages": [m for r in replies for m in (*q, {"role": "assistant", "content": r})]})  # noqa: E731
    ids, mask, stats = chat("Paris", "Paris")
    for r in ("Paris<|im_end|>", "Paris<|endoftext|>\n", "Paris<|im_end|><|im_end|>"):
        got = chat(r, r)
        assert (got[0], got[1].tolist(), got[2]["untrained_turns"]) == (ids, mask.tolist(), 0), r
    assert chat("Paris<|im_end|> or Lyon", "Paris")[2]["untrained_turns"] == 1
