"""Chat rows as exporters write them (data/chat_rows.py, issue 47 item 8): content as a list of text parts, the
`developer` role, ShareGPT `function_call` / `observation` turns, and the one-line refusals. Pure functions."""

from __future__ import annotations

import pytest

from data.chat_rows import RowError, normalize


def test_content_as_text_parts():
    parts = [{"type": "text", "text": "Count"}, {"type": "text", "text": "these"}]
    row = {"messages": [{"role": "user", "content": parts},
                        {"role": "assistant", "content": [{"type": "text", "text": "2 words"}]}]}
    _, conv, _ = normalize(row)
    assert [m["content"] for m in conv] == ["Count\nthese", "2 words"]


def test_a_non_text_part_is_refused_in_one_line():
    row = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
                        {"role": "assistant", "content": "no"}]}
    with pytest.raises(RowError, match=r"content part 0 is 'image_url', not text") as e:
        normalize(row)
    assert "\n" not in str(e.value)


def test_developer_is_the_system_prompt():
    _, conv, _ = normalize({"messages": [{"role": "developer", "content": "Be brief."},
                                         {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]})
    assert conv[0] == {"role": "system", "content": "Be brief."}


def test_environment_is_passed_on_as_given():
    """OLMo 3's tool results (open-instruct's `olmo` template renders an `environment` turn, and no `tool` one)."""
    _, conv, _ = normalize({"messages": [{"role": "user", "content": "Count apple river"},
                                         {"role": "assistant", "content": "Counting."},
                                         {"role": "environment", "content": "2"},
                                         {"role": "assistant", "content": "2 words"}]})
    assert conv[2] == {"role": "environment", "content": "2"}


def test_sharegpt_function_call_and_observation():
    row = {"conversations": [{"from": "human", "value": "Count apple river"},
                             {"from": "function_call", "value": '{"name": "count", "arguments": {"words": 2}}'},
                             {"from": "observation", "value": "2"},
                             {"from": "gpt", "value": "2 words"}]}
    _, conv, _ = normalize(row)
    assert [m["role"] for m in conv] == ["user", "assistant", "tool", "assistant"]
    assert conv[1]["content"] == "" and conv[1]["tool_calls"] == [  # no ids: given where the template needs them
        {"type": "function", "function": {"name": "count", "arguments": {"words": 2}}}]  # (data/chat_tools.call_ids)
    assert "tool_call_id" not in conv[2]  # Apriel-1.6 writes an id only when the reply is not last: untrained
    with pytest.raises(RowError, match="function_call.*not JSON"):
        normalize({"conversations": [{"from": "human", "value": "x"}, {"from": "function_call", "value": "count("}]})


@pytest.mark.parametrize("row", [{"text": "hello", "messages": [{"role": "user", "content": "hi"}]},
                                 {"input_ids": [1, 2], "conversations": []}])
def test_a_row_with_both_text_and_a_chat_field_is_refused(row):
    """Which was meant? Read as text, every token of it would be trained: refused in one line instead."""
    import json

    from data.readers import Fields, parse_item

    value, _, err = parse_item(json.dumps(row).encode(), Fields())
    assert value is None and "both" in err and "\n" not in err


def test_a_table_with_both_a_text_and_a_chat_column_reads_each_row_as_the_one_it_fills(tmp_path):
    """pandas' to_parquet of mixed text and chat rows (each row fills one column, the other null): the table was
    refused whole. Each row is the one it fills; a row filling both is a bad row in one line (which is meant?)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from data.discover import Unit
    from data.readers import Fields, iter_rows, parse_item

    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    pq.write_table(pa.table({"text": ["a document", None, "both"], "messages": [None, msgs, msgs]}), tmp_path / "m.parquet")
    got = [parse_item(item, Fields()) for _, item in iter_rows(Unit("m", "parquet", str(tmp_path / "m.parquet")), Fields())]
    assert got[0] == ("a document", None, None) and got[1][0]["messages"] == msgs and got[1][2] is None
    assert got[2][0] is None and got[2][2].startswith("both 'text'") and "\n" not in got[2][2]


def test_a_system_messages_tools_are_passed_on():
    """Phi-4-mini's template renders the tool list from the system message's `tools` (a JSON string): kept as given,
    `developer` included; before, the key was dropped and the list never rendered."""
    tools = '[{"name": "count_words", "parameters": {"text": {"type": "str"}}}]'
    for role in ("system", "developer"):
        _, conv, _ = normalize({"messages": [{"role": role, "content": "Be brief.", "tools": tools},
                                             {"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]})
        assert conv[0] == {"role": "system", "content": "Be brief.", "tools": tools}


def test_olmo3s_function_keys_are_passed_on():
    """OLMo 3's template (open-instruct's `olmo`) renders a system or user message's `functions` and an assistant
    reply's `function_calls` (strings): kept as given, a reply with calls and no content allowed; before, both keys
    were dropped and never rendered."""
    funcs, calls = '[{"name": "count_words"}]', '[{"name": "count_words", "arguments": {"text": "apple river"}}]'
    _, conv, _ = normalize({"messages": [{"role": "developer", "content": "Be brief.", "functions": funcs},
                                         {"role": "user", "content": "Count.", "functions": funcs},
                                         {"role": "assistant", "content": None, "function_calls": calls},
                                         {"role": "user", "content": "2"}, {"role": "assistant", "content": "2 words"}]})
    assert conv[:3] == [{"role": "system", "content": "Be brief.", "functions": funcs},
                        {"role": "user", "content": "Count.", "functions": funcs},
                        {"role": "assistant", "content": "", "function_calls": calls}]


def test_a_tables_tools_column_travels_with_its_chat_rows(tmp_path):
    """A Parquet row's `tools` reach data/chat.py beside its messages (they were dropped: the row trained as if no
    tool had been offered), a struct column without the nulls Arrow's one-type-per-column union adds (each tool got
    the other's parameters as null), a JSON-string column as written."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from data.discover import Unit
    from data.readers import Fields, iter_rows

    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    tools = [{"type": "function", "function": {"name": "a", "parameters": {"type": "object",
                                                                          "properties": {"city": {"type": "string"}}}}},
             {"type": "function", "function": {"name": "b", "parameters": {"type": "object",
                                                                          "properties": {"q": {"type": "string"}}}}}]
    pq.write_table(pa.table({"messages": [msgs, msgs], "tools": [tools, None]}), tmp_path / "s.parquet")
    pq.write_table(pa.table({"messages": [msgs], "tools": [json.dumps(tools)]}), tmp_path / "j.parquet")
    rows = [v for _, (v, _) in iter_rows(Unit("s", "parquet", str(tmp_path / "s.parquet")), Fields())]
    assert rows[0]["tools"] == tools and rows[0]["messages"] == msgs
    assert rows[1]["tools"] is None
    (_, (row, _)), = iter_rows(Unit("j", "parquet", str(tmp_path / "j.parquet")), Fields())
    assert json.loads(row["tools"]) == tools


def test_a_tables_tool_call_arguments_come_back_without_the_other_rows_keys(tmp_path):
    """Arrow merges every row's call arguments into one struct: each call came back with the other calls' arguments
    as null (`{"city": "Paris", "query": None, "limit": None}`), which the template wrote into the trained reply."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from data.discover import Unit
    from data.readers import Fields, iter_rows

    def row(name, args):
        return [{"role": "user", "content": "?"},
                {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
                    "name": name, "arguments": args}}]}]

    pq.write_table(pa.Table.from_pylist([{"messages": row("get_weather", {"city": "Paris"})},
                                         {"messages": row("search", {"query": "cats", "limit": 3})}]),
                   tmp_path / "calls.parquet")
    got = [v["messages"][1]["tool_calls"][0]["function"]["arguments"]
           for _, (v, _) in iter_rows(Unit("c", "parquet", str(tmp_path / "calls.parquet")), Fields())]
    assert got == [{"city": "Paris"}, {"query": "cats", "limit": 3}]


def test_a_tool_result_given_as_data_is_its_json_text():
    """xLAM / APIGen rows give a tool's result as an object or a list: it is the JSON text an OpenAI client sends for
    it (before: a refused row); a user's or assistant's non-text content is still refused in one line."""
    from data.chat_rows import RowError, message

    assert message({"role": "tool", "content": {"count": 2, "unit": "mot"}}, 2)["content"] == '{"count": 2, "unit": "mot"}'
    assert message({"role": "tool", "content": [{"n": 1}, {"n": 2}]}, 2)["content"] == '[{"n": 1}, {"n": 2}]'
    assert message({"role": "tool", "content": 2}, 2)["content"] == "2"
    assert message({"role": "tool", "content": [{"type": "text", "text": "2"}]}, 2)["content"] == "2"  # text parts
    with pytest.raises(RowError, match=r"^message 0 \(user\): content must be a string"):
        message({"role": "user", "content": {"count": 2}}, 0)


def test_messages_stored_as_json_text_are_the_list_they_hold():
    """A CSV or table export stores `messages` / `conversations` as JSON text: read as the list (before: a refused
    row, 'expected a list, got str'); a text that is not a JSON list is refused in one line."""
    import json

    from data.chat_rows import RowError, normalize

    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert normalize({"messages": json.dumps(msgs)}) == normalize({"messages": msgs})
    turns = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]
    assert normalize({"conversations": json.dumps(turns)}) == normalize({"conversations": turns})
    with pytest.raises(RowError, match=r"^messages: a text that is not a JSON list of messages"):
        normalize({"messages": "[{'role': 'user'}]"})


def _flagged(flags: dict, role: str = "assistant") -> dict:
    ask = {"role": "user", "content": "hi"}
    msgs = [ask, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"},
            {"role": "assistant", "content": "bye"}]
    k = 1 if role == "assistant" else 0
    msgs[k] = {**msgs[k], **flags}
    return {"messages": msgs}


@pytest.mark.parametrize("flags,want", [
    ({"weight": 0}, False), ({"weight": 1}, True), ({"weight": 0.0}, False),  # OpenAI's fine-tuning weight
    ({"training": False}, False), ({"train": True}, True),  # Axolotl's message_field_training
    ({"weight": "0"}, False), ({"training": "false"}, False),  # a CSV export's text
    ({"weight": None}, None),  # OpenHermes-2.5 writes `weight: null` on every turn: no flag
])
def test_a_replys_training_flag_is_read_and_not_passed_to_the_template(flags, want):
    _, conv, _ = normalize(_flagged(flags))
    assert conv[1].get("train") == want and not set(conv[1]) & {"weight", "training"}


def test_sharegpt_turns_carry_their_weight():
    row = {"conversations": [{"from": "human", "value": "hi", "weight": None},
                             {"from": "gpt", "value": "hello", "weight": 0.0}]}
    assert normalize(row)[1][1]["train"] is False


@pytest.mark.parametrize("flags,role,match", [
    ({"weight": 0.5}, "assistant", r"weight 0\.5: a turn's training flag is 0 / false"),
    ({"weight": 0, "training": True}, "assistant", "training flags that disagree"),
    ({"train_detail": [{"begin_offset": 0, "end_offset": 3, "train": True}]}, "assistant", "train_detail"),
    ({"training": True}, "user", r"asks to train a user turn"),
])
def test_a_flag_that_cannot_be_honoured_is_refused_in_one_line(flags, role, match):
    with pytest.raises(RowError, match=match) as e:
        normalize(_flagged(flags, role))
    assert "\n" not in str(e.value)


def test_a_false_flag_on_a_user_turn_is_what_it_says():
    _, conv, _ = normalize(_flagged({"weight": 0}, "user"))
    assert "train" not in conv[0]


_SHARE = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]


def test_a_top_level_system_is_the_first_message():
    """LLaMA-Factory's ShareGPT rows carry the system prompt beside the turns; before, it was dropped, unsaid."""
    _, conv, _ = normalize({"conversations": _SHARE, "system": "Be brief.", "tools": None})
    assert conv[0] == {"role": "system", "content": "Be brief."} and len(conv) == 3
    same = [{"from": "system", "value": "Be brief."}, *_SHARE]  # given twice, the same: one
    assert normalize({"conversations": same, "system": "Be brief."})[1] == conv
    assert normalize({"conversations": _SHARE, "system": ""})[1][0]["role"] == "user"
    kind, conv, first = normalize({"prompt": [{"role": "user", "content": "hi"}],
                                   "completion": [{"role": "assistant", "content": "hello"}], "system": "Be brief."})
    assert conv[0]["role"] == "system" and first == 2  # the completion still starts at the reply


@pytest.mark.parametrize("row,match", [
    ({"conversations": [{"from": "system", "value": "Be long."}, *_SHARE], "system": "Be brief."}, "which is meant"),
    ({"conversations": _SHARE, "system": ["Be brief."]}, "system: expected the system prompt as a string"),
    ({"prompt": "hi", "completion": "hello", "system": "Be brief."}, "system beside a text prompt"),
])
def test_a_top_level_system_that_cannot_be_placed_is_refused_in_one_line(row, match):
    with pytest.raises(RowError, match=match) as e:
        normalize(row)
    assert "\n" not in str(e.value)


def test_the_reply_roles_exports_write_are_read():
    """Gemma's and the Gemini API's `model`, ShareGPT's `human` / `gpt` written in `role`: before, refused."""
    _, conv, _ = normalize({"messages": [{"role": "human", "content": "hi"}, {"role": "model", "content": "hello"},
                                         {"role": "human", "content": "again"}, {"role": "gpt", "content": "bye"}]})
    assert [m["role"] for m in conv] == ["user", "assistant", "user", "assistant"]


def test_conversations_written_as_openai_messages_are_read_as_messages():
    """A `conversations` column of {role, content} turns (Agent-FLAN; LLaMA-Factory's role_tag / content_tag), and a
    ShareGPT turn whose text is in `content`: before, refused ("expected {from, value}")."""
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
             {"role": "assistant", "content": "hello", "weight": 0}, {"role": "user", "content": "again"},
             {"role": "assistant", "content": "bye"}]
    assert normalize({"conversations": turns}) == normalize({"messages": turns})
    mixed = [{"from": "human", "content": "hi"}, {"from": "gpt", "value": "hello"}]
    assert [m["content"] for m in normalize({"conversations": mixed})[1]] == ["hi", "hello"]
    with pytest.raises(RowError, match=r"conversations\[0\]: expected .*\{\"role\""):
        normalize({"conversations": [{"speaker": "user", "text": "hi"}]})


def test_a_tables_system_column_travels_with_its_chat_columns(tmp_path):
    """LLaMA-Factory's ShareGPT as a Parquet table: `conversations` beside `system`. Before, the reader dropped the
    column, so the system prompt was lost for tables while JSONL rows kept it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from data.discover import Unit
    from data.readers import Fields, iter_rows

    turns = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]
    pq.write_table(pa.table({"conversations": [turns], "system": ["Be brief."]}), tmp_path / "s.parquet")
    (_, (row, _)), = iter_rows(Unit("s", "parquet", str(tmp_path / "s.parquet")), Fields())
    assert normalize(row)[1][0] == {"role": "system", "content": "Be brief."}


def test_alpaca_rows_are_the_conversation_llama_factory_builds():
    """Alpaca's instruction / input / output (LLaMA-Factory's `history` and `system` too): the history's turns, then
    the instruction and the input joined by a newline, the output as the reply. Before, every such row was refused."""
    _, conv, first = normalize({"instruction": "Count the words.", "input": "apple river", "output": "2",
                                "system": "Be brief.", "history": [["Hi", "Hello"]]})
    assert conv == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Count the words.\napple river"},
                    {"role": "assistant", "content": "2"}] and first == 0
    assert normalize({"instruction": "Say hi.", "input": "", "output": "hi"})[1][0]["content"] == "Say hi."


@pytest.mark.parametrize("row,match", [
    ({"instruction": "x", "output": ["a", "b"]}, "output: expected a string, got list"),  # a ranking row
    ({"instruction": "x", "output": "y", "history": [["only a query"]]}, r"history\[0\]: expected \[query, response\]"),
])
def test_a_malformed_alpaca_row_is_refused_in_one_line(row, match):
    with pytest.raises(RowError, match=match) as e:
        normalize(row)
    assert "\n" not in str(e.value)


def test_an_alpaca_table_carries_its_input_and_history(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from data.discover import Unit
    from data.readers import Fields, iter_rows

    pq.write_table(pa.table({"instruction": ["Count."], "input": ["a b"], "output": ["2"], "history": [[["Hi", "Yo"]]]}),
                   tmp_path / "a.parquet")
    (_, (row, _)), = iter_rows(Unit("a", "parquet", str(tmp_path / "a.parquet")), Fields())
    assert [m["content"] for m in normalize(row)[1]] == ["Hi", "Yo", "Count.\na b", "2"]


def test_an_alpaca_history_read_as_an_array_or_json_text_is_a_list():
    """A table's history column read as an array of arrays (two pairs or more): `history or []` asked an array for its
    truth value, a ValueError traceback, not a one-line refusal; a CSV export's JSON text reads as the list it holds."""
    import json

    import numpy as np

    pairs = np.array([np.array(["a", "b"], dtype=object), np.array(["c", "d"], dtype=object)], dtype=object)
    want = ["a", "b", "c", "d", "x", "y"]
    assert [m["content"] for m in normalize({"instruction": "x", "output": "y", "history": pairs})[1]] == want
    text = json.dumps([["a", "b"], ["c", "d"]])
    assert [m["content"] for m in normalize({"instruction": "x", "output": "y", "history": text})[1]] == want


def test_a_null_field_is_no_field():
    """pandas' / datasets' to_json of mixed text and chat rows writes a null for each absent key: the text row was
    refused as 'both', and with --skip_bad_rows every text document dropped."""
    import json

    from data.readers import Fields, parse_item

    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert parse_item(json.dumps({"text": "a document", "messages": None}).encode(), Fields())[::2] == ("a document", None)
    value, _, err = parse_item(json.dumps({"text": None, "messages": msgs}).encode(), Fields())
    assert err is None and value["messages"] == msgs


def test_shapes_exports_write_are_read():
    """datasets' Sequence({role, content}) feature comes back as a dict of lists (every row was refused); a blank
    JSON-text tools cell of a tool-less row is no tools (it was refused as 'not JSON')."""
    from data.chat_tools import row_tools

    columns = {"role": ["user", "assistant"], "content": ["hi", "hello"]}
    assert normalize({"messages": columns})[1] == [{"role": "user", "content": "hi"},
                                                   {"role": "assistant", "content": "hello"}]
    assert row_tools({"tools": ""}) is None and row_tools({"tools": "  "}) is None


@pytest.mark.parametrize("row,match", [
    ({"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant", "content": "no"}],
      "label": False}, r"boolean label \(False\): an unpaired preference \(KTO\) row"),
    ({"messages": [{"role": "user", "content": "weather?"},
                   {"role": "assistant", "content": None, "function_call": {"name": "w", "arguments": "{}"}}]},
     r"message 1 \(assistant\): function_call \(OpenAI's legacy form\).*give it as tool_calls"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
      "functions": [{"name": "w", "parameters": {}}]}, r"functions \(OpenAI's legacy tool list\).*give it as tools"),
])
def test_rows_of_other_trainings_and_legacy_forms_are_refused_in_one_line(row, match):
    """A KTO row trained its label-false completions as wanted replies; a legacy function_call was dropped (the reply
    trained without its call), a top-level functions list ignored."""
    with pytest.raises(RowError, match=match) as e:
        normalize(row)
    assert "\n" not in str(e.value)


def test_a_kto_table_is_refused_as_its_jsonl_is(tmp_path):
    """trl-lib/kto-mix-14k ships as Parquet: its `label` column did not travel with the chat columns, so the
    label-false completions trained as wanted replies (the JSONL form was refused)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from data.discover import Unit
    from data.readers import Fields, iter_rows

    p, c = [{"role": "user", "content": "Is it safe?"}], [{"role": "assistant", "content": "Yes, always."}]
    pq.write_table(pa.table({"prompt": [p], "completion": [c], "label": [False]}), tmp_path / "k.parquet")
    (_, (row, _)), = iter_rows(Unit("k", "parquet", str(tmp_path / "k.parquet")), Fields())
    with pytest.raises(RowError, match="unpaired preference"):
        normalize(row)


@pytest.mark.parametrize("role", [["user"], {"name": "user"}])
def test_a_role_that_is_not_a_string_is_one_line(role):
    """A list or object as a message's role raised "unhashable type" (a traceback through prepare_data, even with
    --skip_bad_rows); now the row is a bad row named in one line."""
    with pytest.raises(RowError, match=r"message 0: role .*; expected one of"):
        normalize({"messages": [{"role": role, "content": "Hi"}, {"role": "assistant", "content": "Yo"}]})


def test_llama31s_ipython_role_is_a_tool_result():
    """Llama 3.1's documented role for a tool's output (its template renders `ipython` and `tool` alike) was refused in
    OpenAI-form messages, though ShareGPT's `from: ipython` was read as `tool`."""
    kind, conv, _ = normalize({"messages": [{"role": "user", "content": "2+2?"},
                                  {"role": "assistant", "content": "", "tool_calls": [
                                      {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}]},
                                  {"role": "ipython", "content": "4"}, {"role": "assistant", "content": "4."}]})
    assert kind == "chat" and [m["role"] for m in conv] == ["user", "assistant", "tool", "assistant"]
