"""Reasoning SFT data as distillations ship it (data/chat_reasoning.py), on the sweep's tokenizers: R1-style
`reasoning</think>answer` contents (R1, its distills, QwQ, Qwen3-Thinking: their prompt opens the block), a reply with
its reasoning given twice, empty think blocks, OpenThoughts' `<|begin_of_thought|>` form. ~3 s, no network."""

from __future__ import annotations

import pytest

from data.chat import RowError
from data.chat_reasoning import reads_bare
from data.chat_sweep import TOOLS
from tests.unit.data.test_chat_quoted import encoder, spans

ASK = {"role": "user", "content": "What is 2+2?"}
R1 = ["R.</think>Four.", "R.</think>\n\nFour.", "R.\n</think>\nFour.", "R.\n</think>\n\nFour."]
AS_RENDERED = {"qwen3": "<think>\nR.\n</think>\n\nFour.<|im_end|>", "glm46": "\n<think>R.</think>\nFour.<|user|>"}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("reasoning_data_tokenizers"))


def test_the_probe_reads_which_templates_take_a_bare_close_as_reasoning(root):
    """Qwen3 and GLM-4.6 render `reasoning</think>answer` as their own think block (content.split('</think>')[0]);
    templates printing the content verbatim (Qwen2.5, gpt-oss's final channel) do not. Read once per encoder."""
    got = {k: reads_bare(encoder(root, k)) for k in ("qwen3", "glm46", "qwen25", "gpt_oss", "llama31")}
    assert got == {"qwen3": True, "glm46": True, "qwen25": False, "gpt_oss": False, "llama31": False}


@pytest.mark.parametrize("key", ["qwen3", "glm46"])
@pytest.mark.parametrize("reply", R1)
def test_an_r1_completion_trains_as_the_template_renders_it(root, key, reply):
    """Every spacing of `R.</think>Four.` was refused on Qwen3 but its own (`holds </think> that is not a leading think
    block`), every one on GLM-4.6; it trains as the template renders it (as TRL trains it). An earlier reply trains
    without its reasoning, counted (it was untrained, with the quoted reason)."""
    enc = encoder(root, key)
    got, stats = spans(enc, [ASK, {"role": "assistant", "content": reply}])
    assert got == [AS_RENDERED[key]] and not stats["untrained_turns"], got
    got, stats = spans(enc, [ASK, {"role": "assistant", "content": reply}, {"role": "user", "content": "And 3+3?"},
                             {"role": "assistant", "content": "Six."}])
    assert (stats["untrained_turns"], stats["dropped_reasoning"]) == (0, 1) and "Four." in got[0], (got, stats)
    assert "R." not in got[0], got


def test_a_quote_the_template_reads_as_reasoning_trains_as_reasoning(root):
    """Qwen3 reads a lone `</think>` with no `<think>` as reasoning</think>answer: a quote there cannot be told from an
    R1 completion, and trains as the template renders it (docs/sft.md). A second `</think>` the template would cut
    at stays refused (test_chat_quoted.py)."""
    got, _ = spans(encoder(root, "qwen3"), [ASK, {"role": "assistant", "content": "Use s.split('</think>')[-1]."}])
    assert got == ["<think>\nUse s.split('\n</think>\n\n')[-1].<|im_end|>"], got


def test_a_quoted_tag_after_a_long_think_block_is_never_trained_cut(root):
    """An earlier reply whose leading block the history drops was rewritten before locating (the content past its last
    `</think>`): a quoted tag in its answer trained `the answer's tail` alone, uncounted. Now it is counted, its reason
    named."""
    reply = "<think>\nA long line of reasoning.\n</think>\n\nThe tag `</think>` closes it."
    got, stats = spans(encoder(root, "qwen3"), [ASK, {"role": "assistant", "content": reply},
                                                {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "Six."}])
    assert stats["untrained_turns"] == 1 and "holds `</think>`" in stats["why"][0] and len(got) == 1, (got, stats)


@pytest.mark.parametrize("key", ["qwen3", "glm46", "gpt_oss"])
@pytest.mark.parametrize("content", ["<think>\nR.\n</think>\n\nFour.", "<think>\n\n</think>\n\nFour.", "R.</think>Four.",
                                     "R.\n</think>\n\nFour."])
def test_reasoning_given_twice_is_refused_naming_which_to_drop(root, key, content):
    """A reasoning field and a content think block: Qwen3 / GLM-4.6 trained two think blocks, gpt-oss the analysis
    channel and the block in its final one. (gpt-oss reads a bare `</think>` beside a field as answer text: trained.)"""
    row = {"messages": [ASK, {"role": "assistant", "content": content, "reasoning_content": "R."}]}
    if key == "gpt_oss" and content.startswith("R."):
        assert content in spans(encoder(root, key), row["messages"])[0][0]
        return
    with pytest.raises(RowError, match=r"^message 1 \(assistant\): it gives reasoning twice, its reasoning_content "
                                       r"field and .* drop the content's") as e:
        encoder(root, key).encode(row)
    assert "\n" not in str(e.value)


QUOTES = {"qwen3": "<think>\nThe tag closes the block.\n</think>\n\nUse s.split('</think>')[-1].<|im_end|>",
          "glm46": "\n<think>The tag closes the block.</think>\nUse s.split('</think>')[-1].<|user|>"}


@pytest.mark.parametrize("key", ["qwen3", "glm46"])
def test_a_field_beside_an_answer_quoting_the_close_trains_as_rendered(root, key):
    """With a reasoning field given, Qwen3 / GLM-4.6 print the content as written: a `</think>` quoted in it is the
    answer's, not reasoning given twice (refused for a day; the text before it must hold the field's to be that)."""
    msgs = [ASK, {"role": "assistant", "content": "Use s.split('</think>')[-1].",
                  "reasoning_content": "The tag closes the block."}]
    got, stats = spans(encoder(root, key), msgs)
    assert got == [QUOTES[key]] and not stats["untrained_turns"], got
    with pytest.raises(RowError, match=r"never renders its reasoning field"):  # not trained without it (it opens the
        encoder(root, "nemotron_nano2").encode({"messages": msgs})  # block: the content was read as reasoning)


@pytest.mark.parametrize("content", ["R.</think>Four.", "Use s.split('</think>')[-1].", "Four. Then s.split('</think>')."])
@pytest.mark.parametrize("calls", [False, True])
def test_a_bare_close_is_refused_where_a_template_has_a_place_for_reasoning_on_calls_only(root, content, calls):
    """Gemma 4 renders its thought channel only on a reply with tool calls; there a bare `</think>` (an R1 completion
    or a quote, after other answer text too: ambiguous) trained as answer text: refused as on gpt-oss / Seed-OSS. A
    plain reply has no such place: it trains as written (it was refused for a day: a review)."""
    call = {"id": "call00001", "type": "function", "function": {"name": "count_words", "arguments": {"text": "a b"}}}
    reply = {"role": "assistant", "content": content, **({"tool_calls": [call]} if calls else {})}
    msgs = [ASK, reply] + ([{"role": "tool", "tool_call_id": "call00001", "content": "2"},
                            {"role": "assistant", "content": "Two."}] if calls else [])
    row = {"messages": msgs, **({"tools": TOOLS["tool list"]} if calls else {})}
    if not calls:
        got, stats = spans(encoder(root, "gemma4"), msgs)
        assert content in got[0] and not stats["untrained_turns"], got
        return
    with pytest.raises(RowError, match=r"^message 1 \(assistant\): its content holds `</think>` with no `<think>` "
                                       r"before it, .* field on a reply with tool calls") as e:
        encoder(root, "gemma4").encode(row)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("key,system,match", [
    ("gpt_oss", None, r"as answer text: drop the empty <think></think> \(a reply without reasoning\)$"),
    ("nemotron_nano2", None, r"drop the empty <think></think> \(.*/no_think in the system prompt makes"),
    ("nemotron_nano2", "/no_think", r"drop the empty <think></think>"),
])
def test_an_empty_think_block_is_refused_where_the_template_prints_or_nests_it(root, key, system, match):
    """`<think>\\n\\n</think>\\n\\nFour.` (a no-think reply) trained literal tags in gpt-oss's final channel, and nested
    (or, under /no_think, doubled) in Nemotron Nano v2's own block."""
    msgs = ([{"role": "system", "content": system}] if system else []) + [
        ASK, {"role": "assistant", "content": "<think>\n\n</think>\n\nFour."}]
    with pytest.raises(RowError, match=match) as e:
        encoder(root, key).encode({"messages": msgs})
    assert "\n" not in str(e.value)


def test_a_bare_close_under_no_think_is_refused(root):
    """Nemotron Nano v2 writes its last reply after its generation prompt: `<think>\\n` opens the block that
    `R.</think>Four.` closes (trained), but a system /no_think makes it `<think></think>`: the reasoning trained after
    a closed block, then a second `</think>`."""
    enc = encoder(root, "nemotron_nano2")
    msgs = [{"role": "system", "content": "/no_think"}, ASK, {"role": "assistant", "content": "R.\n</think>\n\nFour."}]
    with pytest.raises(RowError, match=r"generation prompt closes the think block .*drop the /no_think") as e:
        enc.encode({"messages": msgs})
    assert "\n" not in str(e.value)
    got, stats = spans(enc, msgs[1:])
    assert got == ["R.\n</think>\n\nFour.\n<SPECIAL_12>"] and not stats["untrained_turns"], got


OPEN_THOUGHTS = "<|begin_of_thought|>\n\nR.\n\n<|end_of_thought|>\n\n<|begin_of_solution|>\n\nFour.\n\n<|end_of_solution|>"


def test_open_thoughts_rows_are_refused_where_the_template_has_its_own_reasoning_place(root):
    """OpenThoughts-114k / Bespoke-Stratos on Qwen3 trained an empty think block, then the thoughts as answer text.
    Refused there, naming the field; a template with no place of its own trains the form as written."""
    with pytest.raises(RowError, match=r"<\|begin_of_thought\|>.*give the thought as the reply's reasoning_content"):
        encoder(root, "qwen3").encode({"messages": [ASK, {"role": "assistant", "content": OPEN_THOUGHTS}]})
    got, _ = spans(encoder(root, "llama31"), [ASK, {"role": "assistant", "content": OPEN_THOUGHTS}])
    assert OPEN_THOUGHTS in got[0], got


@pytest.mark.parametrize("key", ["qwen3", "glm46"])
def test_part_of_the_field_before_a_bare_close_is_reasoning_given_twice(root, key):
    """`reasoning_content` "Two words: apple, river." beside content "Two words:</think>apple river": the text before
    the close is part of the field (given twice, as when it holds the field); it trained both (a review)."""
    msgs = [ASK, {"role": "assistant", "content": "Two words:</think>apple river",
                  "reasoning_content": "Two words: apple, river."}]
    with pytest.raises(RowError, match="reasoning twice"):
        encoder(root, key).encode({"messages": msgs})
