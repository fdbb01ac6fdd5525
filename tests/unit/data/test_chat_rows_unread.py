"""Real SFT datasets' row shapes that were prepared wrong without a word (audit 65): ChatQA's `document` / `answers`
beside the messages (never read), a chat dataset of another format hinted to `--text_field <its longest string>`, a
Parquet table mixing chat formats (only the first read), a top-level `system_prompt` (dropped) and tatsu-lab/alpaca's
pre-rendered `text` (refused with no way out named). data/chat_rows.py, data/row_errors.py, data/readers.py."""

from __future__ import annotations

import json

import pytest

from data.chat_rows import RowError, normalize
from data.discover import Unit
from data.readers import Fields, iter_rows, parse_item

_ASK = [{"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris."},
        {"role": "user", "content": "And of Italy?"}]
_PAIR = [{"role": "user", "content": "Count them."}, {"role": "assistant", "content": "12345"}]
_SHARE = [{"from": "human", "value": "Count them."}, {"from": "gpt", "value": "12345"}]


def _refused(row: dict) -> str:
    with pytest.raises(RowError) as e:
        normalize(row)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_a_context_or_reply_beside_the_chat_field_that_is_not_read_is_refused_by_name():
    """nvidia/ChatQA-Training-Data's synthetic_convqa: `document` and `answers` beside a history ending with the user's
    question were never read: rc 0, only the history's reply trained. Refused naming the keys and the fix; a one-turn
    row's "no assistant turn" names them too."""
    err = _refused({"document": "Rome is the capital of Italy.", "messages": _ASK, "answers": ["Rome."]})
    assert "'document', 'answers' beside the messages are not read here" in err, err
    assert err.endswith("put the document in the user turn and the answer as the last assistant turn (docs/sft.md)")
    err = _refused({"document": "Paris.", "messages": _ASK[:1], "answers": ["Paris."]})
    assert err.startswith("no assistant turn: nothing to train on (") and "'answers'" in err, err
    assert "'ctxs'" in _refused({"messages": _ASK[:2], "ctxs": [{"title": "Italy", "text": "Rome is its capital."}]})
    for key in ("context", "ctxs"):
        assert f"'{key}'" in _refused({"conversations": _SHARE, key: ["another text"]})
    for key in ("answer", "response", "output", "completion"):  # a reply key: where no reply answers the last question
        assert f"'{key}'" in _refused({"messages": _ASK, key: ["another text"]})


@pytest.mark.parametrize("row", [
    {"prompt": "Count them.", "prompt_id": "abc", "messages": _PAIR},  # HuggingFaceH4/ultrachat_200k
    {"id": "t-1", "source": "ai2-adapt-dev/x", "messages": _PAIR},  # allenai/tulu-3-sft-mixture
    {"conversations": _SHARE, "source": "x", "category": "orca", "weight": None, "custom_instruction": None},
    {"conversations": _SHARE, "prompt": "Count them.", "response": "12345"},  # bjoernp/ultrachat_de, Magpie: a copy
    {"messages": [{"role": "user", "content": "Doc: Paris is in France. Where?"}, _PAIR[1]], "document": "Paris is in "
     "France.", "answers": [], "answer": None, "output": "", "context": 3},  # held, empty, null, not text: nothing lost
    {"instruction": "Count them.", "input": "", "output": "12345"},  # the format's own field
    {"prompt": "Count", "completion": "12345"},
    {"messages": _PAIR, "prompt": _PAIR[:1], "completion": _PAIR[1:]},  # both forms exported: the same reply
    # a dataset's own label beside a conversation that ends in its reply (a review found these refused the same day):
    {"problem": "2+3?", "solution": "5", "answer": "5", "uuid": "u", "messages": _PAIR},  # open-r1/OpenR1-Math-220k
    {"messages": [_PAIR[0], {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "count", "arguments": {"n": 5}}}]}], "answers": '[{"name": "count", "arguments": {"n": 5}}]'},  # xLAM
    {"messages": _PAIR, "instruction": "Count them.", "output": "an earlier reply"},  # converted, the original kept
    {"instruction": "Count them.", "output": "12345", "response": "54321"},  # alpaca with a second generation
])
def test_rows_real_formats_carry_beside_their_chat_field_still_pass(row):
    assert normalize(row)[0] in ("chat", "text_pair")


def test_a_tables_context_and_reply_columns_travel_with_its_chat_columns(tmp_path):
    """The same ChatQA rows as Parquet: the columns reach chat_rows (they were never selected: the same silent loss)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"messages": [_ASK], "document": ["Rome."], "answers": [["Rome."]]}), tmp_path / "q.parquet")
    (_, (row, _)), = iter_rows(Unit("q", "parquet", str(tmp_path / "q.parquet")), Fields())
    assert "'document', 'answers' beside the messages" in _refused(row)


_CHATS = {  # a row of no format read here: its longest string was hinted as --text_field, and trained
    "lmsys-chat-1m": ({"conversation_id": "33f01939a744455c869cb234afca47f1", "model": "vicuna-13b", "turn": 1,
                       "conversation": [{"content": "Hi", "role": "user"}, {"content": "Hello!", "role": "assistant"}]},
                      "its turns in 'conversation'"),
    "nemotron": ({"input": [{"role": "user", "content": "Count."}], "output": "<think>\nc\n</think>\n\n12345",
                  "system_prompt": "detailed thinking on", "category": "math"}, "its turns in 'input'"),
    "xlam": ({"id": 1, "query": "Weather in Paris?", "tools": json.dumps([{"name": "get_weather"}]),
              "answers": json.dumps([{"name": "get_weather", "arguments": {"city": "Paris"}}])}, "'query', 'answers'"),
    "glaive": ({"system": "SYSTEM: You are a helpful assistant with access to functions.", "chat": "USER: Hi\n"},
               "'chat', 'system'"),
    "openorca": ({"id": "niv.1", "system_prompt": "You are an AI assistant. " * 5, "question": "Count.",
                  "response": "12345"}, "'question', 'response', 'system_prompt'"),
    "trl prompt-only": ({"prompt": "The capital of France is"}, "'prompt'"),
    "sharegpt under another name": ({"dialog": json.dumps([{"from": "human", "value": "Hi"}])}, "'dialog'"),
}


@pytest.mark.parametrize("name", list(_CHATS))
def test_a_chat_dataset_of_another_format_is_named_and_gets_no_text_field_hint(name):
    row, named = _CHATS[name]
    _, _, err = parse_item(json.dumps(row).encode(), Fields())
    assert "--text_field" not in err and "a chat dataset in a format not read here (" in err and named in err, err
    assert err.endswith("convert its rows to `messages` (docs/sft.md)"), err


def test_a_corpus_rows_text_field_hint_and_a_chat_rows_skip_fix_are_kept(tmp_path, capsys):
    from data.prepare_data import main

    _, _, err = parse_item(json.dumps({"content": "def f(): pass\n" * 9, "lang": "py", "path": "a.py"}).encode(),
                           Fields())
    assert err.endswith("--text_field content"), err
    (tmp_path / "l.jsonl").write_text(json.dumps(_CHATS["lmsys-chat-1m"][0]) + "\n")
    capsys.readouterr()
    assert main(["--input", str(tmp_path / "l.jsonl"), "--output", str(tmp_path / "o"), "--vocab_size", "9",
                 "--workers", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("(docs/sft.md) (--skip_bad_rows skips and counts such rows)") and "\n" not in err, err


def test_a_table_mixing_chat_formats_reads_each_row_as_the_one_it_fills(tmp_path):
    """pandas' to_parquet of tulu `messages`, Alpaca, TRL prompt / completion and ShareGPT rows: only the first
    format's columns were read, every other row refused "not a chat row"."""
    import pandas as pd

    rows = [{"id": "t", "messages": _PAIR}, {"instruction": "Count them.", "input": "", "output": "12345"},
            {"prompt": [_PAIR[0]], "completion": [_PAIR[1]]}, {"idx": "w", "conversations": _SHARE}]
    pd.DataFrame(rows).to_parquet(tmp_path / "m.parquet")
    got = [parse_item(item, Fields()) for _, item in iter_rows(Unit("m", "parquet", str(tmp_path / "m.parquet")),
                                                                 Fields())]
    assert [e for _, _, e in got] == [None] * 4
    assert [[m["content"] for m in normalize(v)[1]] for v, _, _ in got] == [["Count them.", "12345"]] * 4


def test_a_top_level_system_prompt_is_the_system_turn():
    """OpenHermes-2.5's and bjoernp/ultrachat_de's `system_prompt` beside the turns was dropped without a word."""
    _, conv, _ = normalize({"conversations": _SHARE, "system_prompt": "You are a pirate.", "source": "x"})
    assert conv[0] == {"role": "system", "content": "You are a pirate."} and len(conv) == 3
    assert normalize({"conversations": _SHARE, "system_prompt": None})[1][0]["role"] == "user"
    assert normalize({"messages": _PAIR, "system": "Be.", "system_prompt": "Be. "})[1][0]["content"] == "Be."
    assert "which is meant" in _refused({"messages": _PAIR, "system": "Be brief.", "system_prompt": "Be long."})
    assert "which is meant" in _refused({"conversations": [{"from": "system", "value": "Be long."}, *_SHARE],
                                         "system_prompt": "Be brief."})
    assert _refused({"prompt": "hi", "completion": "yo", "system_prompt": "Be."}).startswith("system_prompt beside")


def test_tatsu_alpacas_text_beside_its_fields_names_the_way_out_and_it_works(tmp_path):
    """tatsu-lab/alpaca ships a pre-rendered `text` beside instruction / input / output: every row refused, no flag
    named. The message names `--text_field none` (a field no row has), which reads the chat fields, JSONL and Parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    row = {"instruction": "Count them.", "input": "", "output": "12345", "text": "Below is an instruction... 12345"}
    _, _, err = parse_item(json.dumps(row).encode(), Fields())
    assert err.endswith("to read every row's chat fields and not its text: --text_field none"), err
    value, _, err = parse_item(json.dumps(row).encode(), Fields(text="none"))
    assert err is None and normalize(value)[1][1]["content"] == "12345"
    pq.write_table(pa.table({k: [v] for k, v in row.items()}), tmp_path / "a.parquet")
    unit = Unit("a", "parquet", str(tmp_path / "a.parquet"))
    (_, item), = iter_rows(unit, Fields())
    assert parse_item(item, Fields())[2].endswith("--text_field none")
    (_, item), = iter_rows(unit, Fields(text="none"))
    assert normalize(parse_item(item, Fields(text="none"))[0])[1][1]["content"] == "12345"
