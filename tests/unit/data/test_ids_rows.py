"""Pre-tokenized rows with columns beside their ids (data/ids_rows.py): a packed row (axolotl's sample packing,
TRL's pack_dataset: `position_ids` that restart, `seq_lengths`) is split into its documents, each read as a separate
row of the same tokens (a review: they were refused, a hub dataset published packed has no rows before packing); an
`attention_mask`'s padding is stripped (its pads were stored and trained, an EOS after them); a table's columns that
change nothing are read as plain ids in the reader, and batched by their length (str() of a 1M-token row, 0.14 s)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from data.prepare_data import main, prepare, row_cost
from tests.unit.data.test_prepare_data import _bos_tokenizer
from tests.unit.data.test_trl_rows import QUIET, _docs, _write

IDS = [5, 6, 7, 8, 9, 10, 11, 12]
def _all_keys(rows: list[dict]) -> list[dict]:
    """Every row with every column (datasets' from_list takes its columns from the first row)."""
    keys = dict.fromkeys(k for r in rows for k in r)
    return [{k: r.get(k) for k in keys} for r in rows]


AXOLOTL = {"input_ids": IDS, "labels": IDS, "position_ids": [0, 1, 2, 0, 1, 2, 3, 4]}  # its sample packing's row


@pytest.mark.parametrize("form", ["jsonl", "parquet", "hf_disk"])
def test_a_packed_row_is_split_into_its_documents(tmp_path, form):
    """Restarting positions or several seq_lengths: each document its own (a separator after each plain one, a
    masked one as given, its slice of the mask), counted as rows their columns shaped."""
    rows = [AXOLOTL, {"input_ids": IDS[:6], "assistant_masks": [0, 1, 1, 0, 0, 1], "seq_lengths": [3, 3]},
            {"input_ids": [20, 21], "position_ids": [0, 1], "seq_lengths": [2]}]  # one document: plain ids
    manifest = prepare([_write(tmp_path, form, _all_keys(rows))], str(tmp_path / "o"), vocab_size=100, eos_id=2, **QUIET)
    assert _docs(tmp_path / "o") == [([5, 6, 7, 2], [1] * 4), ([8, 9, 10, 11, 12, 2], [1] * 6),
                                     ([5, 6, 7], [0, 1, 1]), ([8, 9, 10], [0, 0, 1]), ([20, 21, 2], [1] * 3)]
    assert (manifest["chat_docs"], manifest["ids_beside_rows"], manifest["bad_rows"]) == (2, 2, 0)


def test_a_packed_row_with_a_bad_piece_is_skipped_whole_and_counted_once(tmp_path):
    """--skip_bad_rows: a packed row whose later piece holds an id >= the vocabulary was reported skipped while its
    earlier pieces were stored and trained (and two bad pieces counted the row twice): none of its pieces is kept."""
    rows = [{"input_ids": [1, 2, 3, 99, 5, 6], "seq_lengths": [3, 3]},  # the second piece is bad
            {"input_ids": [7, 98, 9, 97], "seq_lengths": [2, 2]},  # both pieces bad: one row
            {"input_ids": [10, 11, 12]}]
    m = prepare([_write(tmp_path, "jsonl", rows)], str(tmp_path / "o"), vocab_size=50, eos_id=0, skip_bad_rows=True,
                **QUIET)
    assert _docs(tmp_path / "o") == [([10, 11, 12, 0], None)]
    assert (m["bad_rows"], m["n_docs"]) == (2, 1)


def test_a_piece_is_read_as_a_separate_row_of_its_tokens(tmp_path):
    """With a tokenizer that writes a BOS: a piece gets the BOS and the separator exactly where a row of the same
    tokens does (none where it has its own), so a packed corpus and its unpacked rows prepare to the same tokens."""
    from data.tokenizer import Tokenizer

    llama3 = _bos_tokenizer(tmp_path / "tok")  # a tokenizer writing a BOS before a text, as Llama 3's
    tok = Tokenizer(llama3)
    a, b, c = [tok.bos_id, 5, 6], [7, 8, tok.eos_id], [9, 10]
    (tmp_path / "p").mkdir(), (tmp_path / "s").mkdir()
    packed = _write(tmp_path / "p", "jsonl", [{"input_ids": a + b + c, "seq_lengths": [3, 3, 2]}])
    separate = _write(tmp_path / "s", "jsonl", [{"input_ids": x} for x in (a, b, c)])
    one = prepare([packed], str(tmp_path / "o1"), llama3, **QUIET)
    two = prepare([separate], str(tmp_path / "o2"), llama3, **QUIET)
    assert _docs(tmp_path / "o1") == _docs(tmp_path / "o2") and len(_docs(tmp_path / "o1")) == 3
    assert one["ids_given_bos"] == two["ids_given_bos"] == 2


def test_a_packed_row_that_is_none_is_refused_in_one_line(tmp_path, capsys):
    """Only lengths that do not add up, positions that are no runs from 0, the two disagreeing, or a piece whose
    mask trains nothing are refused; the message names the column, not "conversations"."""
    for k, (row, match) in enumerate((
            ({"seq_lengths": [3, 4]}, "seq_lengths [3, 4] add up to 7, beside 8 ids: not the lengths"),
            ({"seq_lengths": [8, 0]}, "seq_lengths [8, 0] hold a length below 1"),
            ({"position_ids": [0, 1, 3, 4, 5, 6, 7, 8]}, "are no runs 0, 1, 2, ... restarting at 0 where a packed "
                                                         "row's document starts (token 2)"),
            ({"position_ids": [1, 2, 3, 4, 5, 6, 7, 8]}, "(token 0)"),
            ({"position_ids": [0, 1, 2], "labels": IDS}, "position_ids [0, 1, 2] beside 8 ids are no runs"),
            ({"seq_lengths": [4, 4], "position_ids": AXOLOTL["position_ids"]}, "disagree on where"),
            ({"seq_lengths": [4, 4], "completion_mask": [0, 1, 1, 1, 1, 0, 0, 0]},
             "completion_mask mark no token to train (past the first) in document 2 of the row's 2 (tokens 4-7)"))):
        (tmp_path / f"r{k}").mkdir()
        src = _write(tmp_path / f"r{k}", "jsonl", [{"input_ids": IDS, **row}])
        capsys.readouterr()
        assert main(["--input", src, "--output", str(tmp_path / f"o{k}"), "--vocab_size", "100", "--workers", "0"]) == 2
        err = capsys.readouterr().err.strip()
        assert match in err and "\n" not in err and "conversations" not in err, err


@pytest.mark.parametrize("form", ["jsonl", "parquet", "hf_disk"])
def test_an_attention_masks_padding_is_stripped(tmp_path, form, capsys):
    """`attention_mask` was ignored: a padded row stored its pads, trained them, and an EOS after them. Zeros at the
    end or the start are stripped with the same slice of the row's labels (-100 over the pads) and masks; all ones
    change nothing; zeros between ones are refused in one line."""
    rows = [{"input_ids": [5, 6, 7, 0, 0, 0], "attention_mask": [1, 1, 1, 0, 0, 0]},
            {"input_ids": [0, 0, 5, 6, 7], "attention_mask": [0, 0, 1, 1, 1], "labels": [-100, -100, 5, 6, 7]},
            {"input_ids": [0, 5, 6, 7, 8], "attention_mask": [0, 1, 1, 1, 1], "assistant_masks": [0, 0, 0, 1, 1]},
            {"input_ids": [5, 6], "attention_mask": [1, 1]},
            {"input_ids": [5, 6, 7, 8, 0, 0], "attention_mask": [1] * 4 + [0, 0], "position_ids": [0, 1, 0, 1, 0, 0]}]
    prepare([_write(tmp_path, form, _all_keys(rows))], str(tmp_path / "o"), vocab_size=100, eos_id=2, **QUIET)
    assert _docs(tmp_path / "o") == [([5, 6, 7, 2], [1] * 4), ([5, 6, 7, 2], [1] * 4), ([5, 6, 7, 8], [0, 0, 1, 1]),
                                     ([5, 6, 2], [1] * 3), ([5, 6, 2], [1] * 3), ([7, 8, 2], [1] * 3)]
    (tmp_path / "bad").mkdir()
    src = _write(tmp_path / "bad", form, [{"input_ids": [5, 6, 7, 8], "attention_mask": [1, 0, 1, 1]}])
    capsys.readouterr()
    assert main(["--input", src, "--output", str(tmp_path / "ob"), "--vocab_size", "100", "--workers", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert "attention_mask has 0s between its 1s (token 1 of 4)" in err and "\n" not in err, err


def test_padding_its_labels_show_is_stripped_without_an_attention_mask(tmp_path):
    """Rows padded to max_length with the mask dropped (labels -100 over the trailing pad id 0): every pad was stored as
    an untrained token (80% pads: ~5x the compute, silently). A run of 2+ -100 over one id at the end (and over id 0
    at the start) is cut; the row stays read with its labels, as given. A lone untrained last token is kept."""
    real = [5 + j % 90 for j in range(100)]
    rows = [{"input_ids": real + [0] * 412, "labels": real + [-100] * 412} for _ in range(50)]
    rows += [{"input_ids": [0, 0, 5, 6, 7], "labels": [-100, -100, -100, 6, 7]},
             {"input_ids": [5, 6, 7, 3], "labels": [-100, 6, 7, -100]}]
    manifest = prepare([_write(tmp_path, "jsonl", rows)], str(tmp_path / "o"), vocab_size=100, eos_id=2, **QUIET)
    assert manifest["n_tokens"] == 5000 + 3 + 4, manifest["n_tokens"]
    assert _docs(tmp_path / "o")[-2:] == [([5, 6, 7], [0, 1, 1]), ([5, 6, 7, 3], [0, 1, 1, 0])]


def test_the_in_process_stream_splits_and_strips_too(tmp_path):
    """data/packing.build_token_stream (data/jsonl.read_documents) refused a packed row and kept the pads: its
    documents now as prepare_data's (a loss mask, which it cannot carry, is still refused)."""
    from data.packing import build_token_stream

    src = tmp_path / "r.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in (
        AXOLOTL, {"input_ids": [5, 6, 0, 0], "attention_mask": [1, 1, 0, 0]})))
    tokens, starts = build_token_stream(str(src), None, 100, str(tmp_path / "cache"))
    assert np.load(tokens).tolist() == IDS + [5, 6] and np.load(starts).tolist() == [0, 3, 8]
    src.write_text(json.dumps({"input_ids": IDS, "seq_lengths": [4, 4], "completion_mask": [0, 1] * 4}) + "\n")
    with pytest.raises(ValueError, match="completion_mask beside input_ids: a loss mask"):
        build_token_stream(str(src), None, 100, str(tmp_path / "cache2"))


def test_a_tables_columns_that_change_nothing_are_plain_ids_and_cost_their_length(tmp_path):
    """A Parquet row with positions 0..n-1 and `seq_lengths: [n]` went to the workers as a column dict, costed by
    len(str(row)) (0.14 s per 1M tokens in the reading process, batches ~15x smaller): now read as plain ids in the
    reader; a row that is checked in the workers costs its ids x (1 + columns)."""
    from data.discover import discover
    from data.ids_rows import BESIDE
    from data.readers import Fields, iter_rows

    src = _write(tmp_path, "parquet", [{"input_ids": IDS, "position_ids": list(range(8)), "seq_lengths": [8],
                                        "labels": IDS, "attention_mask": [1] * 8}])
    [(_, (value, _))] = list(iter_rows(discover(src)[0], Fields()))
    assert value == IDS
    n = 100_000  # (len(str(row)): ~1.6M, the old cost, computed in the reading process)
    assert row_cost(({BESIDE: (list(range(n)), {"position_ids": [0] * n})}, None)) == (2 * n, 2 * n)


def _trl(ids: list[int], prompt: int) -> list[int]:
    """TRL 1.16.0's labels (sft_trainer._prepare_dataset, build_labels): -100 where not trained, else the id."""
    return [-100] * prompt + ids[prompt:]


@pytest.mark.parametrize("form", ["jsonl", "parquet", "hf_disk"])
def test_trl_processed_labels_are_the_loss_mask(tmp_path, form):
    """TRL's processed rows carry `labels` (-100 off-target; its masks dropped), its packed ones `seq_lengths` too:
    both were refused ("labels that differ"). Now a label equal to its id is a target, -100 not: supervised_tokens is
    TRL's count of labels != -100, each packed document its own, the ids as given."""
    a, b, c = [5, 6, 7, 8, 9, 10], [11, 12, 13, 14], [15, 16, 17]
    rows = [{"input_ids": a, "labels": _trl(a, 3)},
            {"input_ids": b + c, "labels": _trl(b, 2) + _trl(c, 1), "seq_lengths": [4, 3]},  # TRL's pack_dataset
            {"input_ids": a, "labels": _trl(a, 2), "completion_mask": [0, 0, 0, 1, 1, 1]}]  # both: where both say so
    labels = [lab for r in rows[:2] for lab in r["labels"]]
    manifest = prepare([_write(tmp_path, form, _all_keys(rows))], str(tmp_path / "o"), vocab_size=100, eos_id=2, **QUIET)
    assert _docs(tmp_path / "o") == [(a, [0, 0, 0, 1, 1, 1]), (b, [0, 0, 1, 1]), (c, [0, 1, 1]), (a, [0, 0, 0, 1, 1, 1])]
    assert manifest["supervised_tokens"] == sum(x != -100 for x in labels) + 3 and manifest["chat_docs"] == 4


def test_labels_that_are_no_loss_mask_are_refused_in_one_line(tmp_path, capsys):
    """Labels shifted already (label i = id i+1, as a model's loss shifts them: shifted again, each token would learn
    the one after next) or holding other ids are refused, the reason named."""
    for k, (labels, match) in enumerate((
            (IDS[1:] + [-100], "the ids shifted one position left (label i = id i+1): shifted already"),
            ([-100] * 4 + [7, 10, 11, 12], "labels beside 'input_ids' hold 7 at token 4 (id 9)"),
            ([-100] * 8, "labels mark no token to train"),
            ([-100, 6], "labels (2 values) beside 8 'input_ids' are no labels of the ids"))):
        (tmp_path / f"r{k}").mkdir()
        src = _write(tmp_path / f"r{k}", "jsonl", [{"input_ids": IDS, "labels": labels}])
        capsys.readouterr()
        assert main(["--input", src, "--output", str(tmp_path / f"o{k}"), "--vocab_size", "100", "--workers", "0"]) == 2
        err = capsys.readouterr().err.strip()
        assert match in err and "\n" not in err, err


@pytest.mark.parametrize("form", ["jsonl", "parquet", "hf_disk"])
@pytest.mark.parametrize("chat", [{"prompt": [{"role": "user", "content": "Hi"}],  # TRL's unpacked processed rows
                                   "completion": [{"role": "assistant", "content": "Hello"}]},
                                  {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}])
def test_trl_processed_rows_beside_their_chat_fields_are_read_as_their_ids_and_labels(tmp_path, form, chat):
    """TRL keeps the prompt / completion or messages it tokenized beside input_ids and labels: "both ... which is
    meant?" refused every row. TRL trains such a dataset as its ids and labels (it skips preparing rows holding
    input_ids): read so, the chat fields not rendered again; without labels, still one line."""
    a = [5, 6, 7, 8, 9, 10]
    src = _write(tmp_path, form, [{**chat, "input_ids": a, "labels": _trl(a, 4)}] * 2)
    manifest = prepare([src], str(tmp_path / "o"), vocab_size=100, eos_id=2, **QUIET)
    assert _docs(tmp_path / "o") == [(a, [0, 0, 0, 0, 1, 1])] * 2 and manifest["supervised_tokens"] == 4
    (tmp_path / "n").mkdir()
    src = _write(tmp_path / "n", form, [{**chat, "input_ids": a}])
    with pytest.raises(ValueError, match="which is meant"):
        prepare([src], str(tmp_path / "o2"), vocab_size=100, eos_id=2, **QUIET)


def test_labels_that_masked_the_eos_as_a_pad_end_with_one_trained_eos(tmp_path):
    """pad == eos (Qwen2.5 base, GPT-2 or Llama with pad set to eos; a tokenizer naming no pad: Tokenizer.pad_id):
    DataCollatorForLanguageModeling / padding="max_length" pipelines label every pad -100, the real EOS with them. The
    trailing run was cut whole (a padded row) or its lone EOS kept untrained, and a row with a loss mask gets no
    separator: row A ran into row B (a pack trained A's last token to predict B's first) and no EOS was trained,
    unsaid. Now each ends with one trained EOS, counted in a note; an EOS trained already, or a pad that is not the
    EOS, is read as before."""
    from data.tokenizer import Tokenizer

    path = _bos_tokenizer(tmp_path / "tok")
    tok = Tokenizer(path)
    eos, body = tok.eos_id, tok.encode("a quick brown fox")
    assert tok.pad_id == eos and 0 not in body
    n = len(body)
    rows = [{"input_ids": body + [eos] * 5, "labels": body + [-100] * 5},  # padded to max_length
            {"input_ids": body + [eos], "labels": body + [-100]},  # unpadded
            {"input_ids": body + [eos] * 3, "attention_mask": [1] * (n + 1) + [0, 0], "labels": body + [-100] * 3},
            {"input_ids": body + [eos] * 3, "labels": body + [eos, -100, -100]},  # its EOS trained already
            {"input_ids": body + [0] * 3, "labels": body + [-100] * 3}]  # another pad: cut, as before
    lines = []
    m = prepare([_write(tmp_path, "jsonl", rows)], str(tmp_path / "o"), path, workers=0, log=lines.append)
    assert _docs(tmp_path / "o") == [(body + [eos], [1] * (n + 1))] * 4 + [(body, [1] * n)]
    assert m["eos_labels_trained"] == 3, m
    assert [x for x in lines if "masked their final EOS" in x] == [
        f"note: 3 rows' labels masked their final EOS (pad == eos, id {eos}): trained"], lines
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(path)
    hf.pad_token = "<s>"  # a pad that is not the EOS: the EOS -100 is the row's own choice, read as given
    hf.save_pretrained(str(tmp_path / "padded"))
    m = prepare([_write(tmp_path, "jsonl", rows[:2])], str(tmp_path / "p"), str(tmp_path / "padded"), **QUIET)
    assert _docs(tmp_path / "p") == [(body, [1] * n), (body + [eos], [1] * n + [0])] and not m["eos_labels_trained"]


def test_an_eos_run_after_an_untrained_token_is_padding_only():
    """A review: with pad == eos the trailing -100 run of the EOS was cut and a trained EOS appended, even where the
    kept row ends on a token its labels left untrained (they stopped training before the end; the run was padding):
    a ChatML reply's trained `<|im_end|>` then its masked "\\n" got a second `<|im_end|>`, trained (C); a last user turn
    was taught to end with an EOS (F). Such rows are read as given; the collators' rows (B: the real EOS masked with
    the pads after a trained token; also unpadded, and after an attention_mask's cut) still end with one trained EOS."""
    from data.ids_rows import MASKED, beside_ids, documents, trained_end

    P, eos = -100, 5

    def read(ids, labels, **cols):
        value, err = beside_ids(ids, {"input_ids": ids, "labels": labels, **cols}, "input_ids")
        assert err is None, err
        value, trained = trained_end(value, eos)
        (doc,), _ = documents(value)  # one document, its padding cut
        return list(zip(doc[MASKED][0], doc[MASKED][1].tolist())), trained

    c, trained = read([276, 95, 349, 394, 5, 218, 5, 5], [P, P, 349, 394, 5, P, P, P])
    assert c[-3:] == [(394, 1), (5, 1), (218, 0)] and not trained, c
    f, trained = read([276, 95, 349, 394, 276, 95, 5, 5], [P, P, 349, 394, P, P, P, P])
    assert f[-3:] == [(394, 1), (276, 0), (95, 0)] and not trained, f
    for ids, labels, cols in (([276, 95, 349, 394, 5, 5, 5], [P, P, 349, 394, P, P, P], {}),  # B: padded
                              ([276, 95, 349, 394, 5], [P, P, 349, 394, P], {}),  # unpadded
                              ([276, 95, 349, 394, 5, 5, 5], [P, P, 349, 394, P, P, P],
                               {"attention_mask": [1, 1, 1, 1, 1, 0, 0]})):
        b, trained = read(ids, labels, **cols)
        assert b == [(276, 0), (95, 0), (349, 1), (394, 1), (5, 1)] and trained == 1, (b, cols)
