"""A row's `chat_template_kwargs` (SmolTalk2's column, which TRL's SFTTrainer passes to apply_chat_template): every
render of the row gets them, so a no-think row trains as the template writes it without thinking and its tool list
is in the system prompt; the probes read under them never leak into another row's; an argument the template never
reads, one apply_chat_template sets itself, or a text pair carrying them is refused in one line; a Parquet struct
column arrives without Arrow's nulls. The template is ours, written to read its arguments as SmolLM3's does
(`enable_thinking` off: an empty think block opens every reply, the generation prompt included; `xml_tools` listed
in the system turn). Fixture tokenizer, no network: ~2 s."""

from __future__ import annotations

import json

import numpy as np
import pytest
from transformers import AutoTokenizer

from data.chat import ChatEncoder, RowError
from data.tokenizer import Tokenizer
from tests.unit.data.chat_fixtures import build_tokenizer

SMOL_LIKE = (
    "{%- if enable_thinking is not defined %}{% set enable_thinking = true %}{% endif -%}"
    "<|im_start|>system\nReasoning Mode: {{ '/think' if enable_thinking else '/no_think' }}\n"
    "{%- if xml_tools is defined %}\n<tools>\n{% for t in xml_tools %}{{ t | tojson }}\n{% endfor %}</tools>{% endif %}"
    "<|im_end|>\n"
    "{%- for m in messages %}{% if m.role == 'assistant' %}<|im_start|>assistant\n"
    "{% if not enable_thinking %}<think>\n\n</think>\n{% endif %}{{ m.content }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor -%}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% if not enable_thinking %}<think>\n\n</think>\n"
    "{% endif %}{% endif %}")
TOOL = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
MSGS = [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": "It is sunny."}]


@pytest.fixture(scope="module")
def enc(tmp_path_factory):
    root = tmp_path_factory.mktemp("kwargs")
    tok = AutoTokenizer.from_pretrained(build_tokenizer(str(root), "qwen25"))
    tok.chat_template = SMOL_LIKE
    tok.save_pretrained(str(root / "smol_like"))
    return ChatEncoder(Tokenizer(str(root / "smol_like")))


def _trained(enc, ids, mask) -> str:
    return enc.tok.hf.decode([i for i, m in zip(ids, mask) if m])


def test_a_rows_template_arguments_are_in_every_render_of_it(enc):
    hf = enc.tok.hf
    for kw in ({"enable_thinking": False, "xml_tools": [TOOL], "python_tools": None},  # a Parquet row's nulls
               json.dumps({"enable_thinking": False, "xml_tools": [TOOL]})):  # a JSON-text column
        ids, mask, _ = enc.encode({"messages": MSGS, "chat_template_kwargs": kw})
        want = hf.apply_chat_template(MSGS, tokenize=False, enable_thinking=False, xml_tools=[TOOL])
        assert ids == enc.tok.encode(want) and "/no_think" in want and "get_weather" in want
        assert _trained(enc, ids, mask) == "It is sunny.<|im_end|>"  # the empty block is the generation prompt's
    ids, mask, _ = enc.encode({"messages": MSGS})  # the next row, without: the template's defaults, nothing kept
    assert ids == enc.tok.encode(hf.apply_chat_template(MSGS, tokenize=False))
    assert "/think" in hf.decode(ids) and "<tools>" not in hf.decode(ids) and "<think>" not in hf.decode(ids)
    assert _trained(enc, ids, mask) == "It is sunny.<|im_end|>"
    # a flag, or an empty value, that the template never reads changes nothing: passed over, as a null is
    # (SmolTalk2's rows on another model's template: custom_instructions "", python_tools [])
    for kw in ({"thinking": False}, {"thinking": True, "custom_instructions": "", "python_tools": np.array([])}):
        assert enc.encode({"messages": MSGS, "chat_template_kwargs": kw})[0] == ids


@pytest.mark.parametrize("kw, match", [
    ({"reasoning_effort": "high"}, r"reasoning_effort='high' and .* never reads it"),
    ({"thinking": "on"}, r"thinking='on' and .* never reads it"),  # a substring of enable_thinking, which it reads
    ({"custom_instructions": "Be brief."}, r"custom_instructions='Be brief.' and .* never reads it"),
    ({"add_generation_prompt": True}, "apply_chat_template sets it"),
    ("[1]", "a list, not an object"),
    ("{oops", "is not JSON"),
    ({"enable_thinking": False, "reasoning": True}, r"enable_thinking=false and message 1 \(assistant\) carries "
                                                     "reasoning"),
])
def test_template_arguments_it_cannot_honour_refuse_the_row(enc, kw, match):
    """(Thinking off with a reply carrying reasoning: each such reply was left untrained, with another turn's reason.)"""
    msgs = MSGS
    if isinstance(kw, dict) and kw.pop("reasoning", False):
        msgs = [MSGS[0], {"role": "assistant", "content": "<think>\nSun.\n</think>\n\nIt is sunny."}]
    with pytest.raises(RowError, match=match):
        enc.encode({"messages": msgs, "chat_template_kwargs": kw})


def test_a_text_pair_or_the_chatml_default_refuse_them(enc):
    with pytest.raises(RowError, match="prompt / completion of strings"):
        enc.encode({"prompt": "a", "completion": "b", "chat_template_kwargs": {"xml_tools": [TOOL]}})
    plain = ChatEncoder(enc.tok, template="chatml")
    with pytest.raises(RowError, match="the ChatML default never reads it"):
        plain.encode({"messages": MSGS, "chat_template_kwargs": {"xml_tools": [TOOL]}})


def test_a_parquet_struct_column_arrives_without_arrows_nulls(tmp_path, enc):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from data.prepare_data import prepare
    from data.store import Prepared

    kws = [{"enable_thinking": False, "xml_tools": [json.dumps(TOOL)]}, {"enable_thinking": True}]
    pq.write_table(pa.table({"messages": [MSGS, MSGS], "chat_template_kwargs": kws}), tmp_path / "c.parquet")
    prepare([str(tmp_path / "c.parquet")], str(tmp_path / "out"), enc.tok.path, workers=0, log=lambda _: None)
    p = Prepared(str(tmp_path / "out"))
    for d, kw in enumerate(kws):  # the second row's xml_tools came back as null: not passed (it is not "defined")
        ids, mask, _ = enc.encode({"messages": MSGS, "chat_template_kwargs": kw})
        s, n = int(p.starts[d]), int(p.lens[d])
        assert p.tokens.read(s, s + n).tolist() == ids and np.array_equal(p.mask.read(s, s + n), mask)


def test_generation_markers_around_the_header_train_the_reply_alone(tmp_path, enc):
    """SmolLM3 ships `{% generation %}` around `<|im_start|>assistant\\n` + reply + `<|im_end|>\\n`: the marked runs
    trained the header and the newline after the end-of-turn, and every row was counted as ending without one."""
    marked = SMOL_LIKE.replace("{%- for m in messages %}{% if m.role == 'assistant' %}<|im_start|>assistant\n",
                               "{%- for m in messages %}{% if m.role == 'assistant' %}{% generation %}"
                               "<|im_start|>assistant\n").replace("{{ m.content }}<|im_end|>\n{% else %}",
                                                                  "{{ m.content }}<|im_end|>\n{% endgeneration %}{% else %}")
    assert marked.count("generation %}") == 2
    tok = AutoTokenizer.from_pretrained(enc.tok.path)
    tok.chat_template = marked
    tok.save_pretrained(str(tmp_path / "marked"))
    marked_enc = ChatEncoder(Tokenizer(str(tmp_path / "marked")))
    assert marked_enc.kind == "markers"
    for head in ([], [{"role": "assistant", "content": "Hello there."}]):  # an assistant turn first too: it was
        # trained with its header; on the prefix path it is a turn with nothing before it, untrained and counted
        ids, mask, stats = marked_enc.encode({"messages": head + MSGS + [{"role": "user", "content": "And Rome?"},
                                                                         {"role": "assistant", "content": "Rainy."}]})
        edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
        spans = [marked_enc.tok.hf.decode(ids[a:b]) for a, b in zip(edges[::2], edges[1::2])]
        assert spans == ["It is sunny.<|im_end|>", "Rainy.<|im_end|>"] and stats.get("no_stop_rows", 0) == 0
        assert stats["untrained_turns"] == len(head)


def test_a_tables_filled_media_column_is_refused_as_a_json_rows_is(tmp_path, enc):
    """A Parquet / datasets table's `images` column never reached the row (only CHAT_EXTRAS' columns are carried):
    LLaVA-style rows were trained text-only, their replies describing images the model never saw, where the same
    rows as JSONL are refused (data/chat_rows.MEDIA). An empty column is no media."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from data.prepare_data import prepare

    pq.write_table(pa.table({"messages": [MSGS, MSGS], "images": [[], []]}), tmp_path / "empty.parquet")
    prepare([str(tmp_path / "empty.parquet")], str(tmp_path / "ok"), enc.tok.path, workers=0, log=lambda _: None)
    pq.write_table(pa.table({"messages": [MSGS, MSGS], "images": [[], ["cat.jpg"]]}), tmp_path / "filled.parquet")
    with pytest.raises(Exception, match="images"):
        prepare([str(tmp_path / "filled.parquet")], str(tmp_path / "no"), enc.tok.path, workers=0,
                log=lambda _: None)
