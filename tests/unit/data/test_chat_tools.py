"""A row's top-level `tools` (OpenAI / TRL: `{"messages": [...], "tools": [...]}`; data/chat_tools.py): passed to the
chat template as `tools=` in every render of the row, in the ids and never supervised, on the prefix path (linear and
exact), the generation-marker path and `--loss_on all`; a template that ignores them, the ChatML default and a
text prompt / completion refuse the row in one line; malformed values are refused in one line naming them. Fixture
tokenizers of the sweep's families (data/chat_sweep.py), no network: ~3 s."""

from __future__ import annotations

import json

import numpy as np
import pytest

from data.chat import ChatEncoder, RowError
from data.chat_sweep import CASES, TOOLS, families
from data.chat_sweep import build_tokenizer as sweep_tokenizer
from data.tokenizer import Tokenizer
from tests.unit.data.chat_fixtures import build_tokenizer as fixture_tokenizer

CONV = CASES["tool list"]  # a question, a tool call, its result, a reply
DEFS = TOOLS["tool list"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tools_tokenizers"))


def encoder(root: str, key: str, loss_on: str = "auto") -> ChatEncoder:
    return ChatEncoder(Tokenizer(sweep_tokenizer(root, key, families()[key])), loss_on)


def trained_text(enc: ChatEncoder, ids: list[int], mask: np.ndarray) -> str:
    return enc.tok.hf.decode([i for i, m in zip(ids, mask) if m])


@pytest.mark.parametrize("key", ["qwen25", "qwen3", "llama31", "mistral_v03", "gpt_oss"])
def test_tools_are_in_the_ids_as_the_template_renders_them_and_never_supervised(root, key):
    enc = encoder(root, key)
    hf = enc.tok.hf
    want = enc.tok.encode(hf.apply_chat_template(CONV, tools=DEFS, tokenize=False, chat_template=enc.template))
    outs = []
    for linear in (True, False):  # the views on one tokenization, and every prefix tokenized whole
        enc.linear = linear
        ids, mask, stats = enc.encode({"messages": CONV, "tools": DEFS})
        assert ids == want and stats["untrained_turns"] == 0
        assert "Count the words of a text" in hf.decode(ids)  # the definition's description: in the ids
        trained = trained_text(enc, ids, mask)
        assert "Count the words of a text" not in trained and "The text" not in trained, trained
        assert "count_words" in trained and "2 words" in trained  # the call and the reply after it
        outs.append((ids, mask.tolist()))
    assert outs[0] == outs[1]


def test_a_json_string_and_a_sharegpt_row_give_the_same_as_the_list(root):
    """LLaMA-Factory writes `tools` as a JSON string beside ShareGPT `conversations`."""
    enc = encoder(root, "qwen25")
    ids, mask, _ = enc.encode({"messages": CONV, "tools": DEFS})
    ids2, mask2, _ = enc.encode({"messages": CONV, "tools": json.dumps(DEFS)})
    assert ids2 == ids and mask2.tolist() == mask.tolist()
    bare = [d["function"] for d in DEFS]  # LLaMA-Factory's definitions: {"name", "description", "parameters"}
    row = {"conversations": [{"from": "human", "value": "How many words in apple river?"},
                             {"from": "gpt", "value": "Let me count."}], "tools": json.dumps(bare)}
    ids, mask, _ = enc.encode(row)
    assert '"name": "count_words"' in enc.tok.hf.decode(ids) and "count_words" not in trained_text(enc, ids, mask)


def test_the_marker_path_and_loss_on_all_get_the_tools_too(root):
    """A template with generation markers (TRL's ChatML, here with a tool list in a system turn) and `--loss_on all`
    render the row with its tools as the prefix path does."""
    tok = Tokenizer(sweep_tokenizer(root, "chatml_generation", families()["chatml_generation"]))
    tok.hf.chat_template = ("{%- if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{%- endif %}"
                            + tok.hf.chat_template)
    plain = CASES["multi-turn"]
    ids, mask, _ = ChatEncoder(tok).encode({"messages": plain, "tools": DEFS})
    assert ChatEncoder(tok).kind == "markers"
    assert tok.hf.decode(ids).startswith("<|im_start|>system\nTools: [{") and "count_words" not in trained_text(
        ChatEncoder(tok), ids, mask)
    every, ones, _ = ChatEncoder(tok, "all").encode({"messages": plain, "tools": DEFS})
    assert every == ids and ones.all()


@pytest.mark.parametrize("key", ["qwen2", "llama3", "phi4_mini", "deepseek_r1"])
def test_a_template_that_ignores_tools_refuses_the_row_in_one_line(root, key):
    enc = encoder(root, key)
    conv = CASES["multi-turn"]  # no tool call: only the definitions would be lost
    enc.encode({"messages": conv})  # trains without them
    with pytest.raises(RowError, match=r"^tools \['count_words'\]: .* does not render a row's `tools`") as e:
        enc.encode({"messages": conv, "tools": DEFS})
    assert "\n" not in str(e.value)
    enc.encode({"messages": conv, "tools": []})  # an empty list: nothing to drop
    enc.encode({"messages": conv, "tools": None})


def test_the_chatml_default_and_a_text_pair_refuse_tools(tmp_path):
    enc = ChatEncoder(Tokenizer(fixture_tokenizer(str(tmp_path), "none")))
    with pytest.raises(RowError, match=r"^tools \['count_words'\]: the ChatML default"):
        enc.encode({"messages": CASES["multi-turn"], "tools": DEFS})
    with pytest.raises(RowError, match=r"^tools \['count_words'\] with a prompt / completion of strings"):
        enc.encode({"prompt": "Count apple river.", "completion": "2", "tools": DEFS})


@pytest.mark.parametrize("value,match", [
    (5, r"^tools: 5 is a int, not a list"),
    ({"type": "function", "function": {"name": "f"}}, r"^tools: \{'type': 'function'.* is a dict, not a list"),
    ("count_words(text)", r"^tools: 'count_words\(text\)' is not JSON"),
    ('{"name": "f"}', r"is a dict, not a list"),
    ([{"type": "function", "function": {"description": "no name"}}], r"^tools\[0\]: .* is not a function definition"),
    (["count_words"], r"^tools\[0\]: 'count_words' is not a function definition"),
])
def test_malformed_tools_are_refused_in_one_line_naming_the_value(root, value, match):
    enc = encoder(root, "qwen25")
    with pytest.raises(RowError, match=match) as e:
        enc.encode({"messages": CONV, "tools": value})
    assert "\n" not in str(e.value) and "function definitions" in str(e.value)



def test_mistral_v03_trains_only_the_replies_after_its_tool_list(root):
    """Mistral v0.3 writes the tool list before the LAST user turn only: a reply before that turn was rendered with no
    tool list in its own prefix, so its header is not where the conversation has it; it gets no loss and is counted
    (the model never learns a reply the conversation does not show it as given)."""
    enc = encoder(root, "mistral_v03", "assistant")
    conv = CASES["multi-turn"]
    ids, mask, stats = enc.encode({"messages": conv, "tools": DEFS})
    assert stats["untrained_turns"] == 1 and "message 1" in stats["why"][0]
    assert " apple river</s>[AVAILABLE_TOOLS] [{" in enc.tok.hf.decode(ids)  # after the first exchange
    assert trained_text(enc, ids, mask).strip() == "2 words</s>"


# ---- tool-call arguments: OpenAI's JSON text or an object, rendered once whichever the row brings
def _call_row(arguments) -> dict:
    call = {"id": "call00001", "type": "function", "function": {"name": "count_words", "arguments": arguments}}
    return {"messages": [{"role": "user", "content": "How many words in apple river?"},
                         {"role": "assistant", "content": "", "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "call00001", "content": "2"},
                         {"role": "assistant", "content": "2 words"}]}


@pytest.mark.parametrize("key,native", [("llama31", "object"), ("llama32", "object"), ("qwen25", "object"),
                                        ("mistral_v03", "object"), ("gpt_oss", "object"), ("qwen3", "both"),
                                        ("deepseek_r1", "text")])
def test_tool_call_arguments_are_written_once_whichever_form_the_row_brings(root, key, native):
    """Llama 3.1 / 3.2, Qwen2.5, Mistral v0.3 and gpt-oss apply `tojson` to the arguments: OpenAI's JSON text was
    written encoded twice ("{\\"text\\": ...}") and trained so, without a word. DeepSeek concatenates them: an object
    was a refused row. Both forms now give the same ids, the arguments written once as the template writes them."""
    enc = encoder(root, key)
    got = {}
    for form, arguments in (("object", {"text": "apple river"}), ("text", '{"text": "apple river"}')):
        ids, mask, stats = enc.encode(_call_row(arguments))
        trained = trained_text(enc, ids, mask)
        assert '{"text": "apple river"}' in trained and '\\"' not in enc.tok.hf.decode(ids), (form, trained)
        assert stats["rewritten_arguments"] == int(native not in (form, "both")), form
        got[form] = (ids, mask.tolist())
    assert got["object"] == got["text"]


_OWN = ("{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
        "{%- for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }} {CALL}</tool_call>{%- endfor %}"
        "<|im_end|>\n{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")


@pytest.mark.parametrize("call,given,want", [
    # printed as given: an object would be a Python dict in the ids ({'text': ...}); JSON text is kept
    ("{{ c.function.arguments }}", {"text": "apple river"}, '<tool_call>count_words {"text": "apple river"}</tool_call>'),
    # iterated as an object (Seed-OSS): JSON text fails to render; it is read as its object
    ("{% for k, v in c.function.arguments.items() %}<{{ k }}>{{ v }}</{{ k }}>{% endfor %}", '{"text": "apple river"}',
     "<tool_call>count_words <text>apple river</text></tool_call>"),
    # free text is no JSON object: left as given, whatever the template makes of it
    ("{{ c.function.arguments | tojson }}", "apple river", '<tool_call>count_words "apple river"</tool_call>'),
    # written only when an object (MiniMax-M2's template as Unsloth and llama.cpp ship it: `arguments is mapping`):
    # JSON text rendered no argument, and the call trained without them; it is read as its object
    ("{% if c.function.arguments is mapping %}{% for k, v in c.function.arguments.items() %}<p name=\"{{ k }}\">{{ v }}"
     "</p>{% endfor %}{% endif %}", '{"text": "apple river"}', '<tool_call>count_words <p name="text">apple river</p>'
     "</tool_call>"),
])
def test_a_template_that_prints_or_iterates_arguments_gets_the_form_it_renders_clean(root, call, given, want):
    tok = Tokenizer(sweep_tokenizer(root, "qwen25", families()["qwen25"]))
    tok.hf.chat_template = _OWN.replace("{CALL}", call)
    enc = ChatEncoder(tok)
    ids, mask, stats = enc.encode(_call_row(given))
    assert want in enc.tok.hf.decode(ids) and want.split("<tool_call>")[1] in trained_text(enc, ids, mask)
    assert stats["rewritten_arguments"] == int(given != "apple river")


def test_a_template_that_renders_no_arguments_refuses_the_row(root):
    """A template that writes a call's name and never its arguments, in either form: the call was trained as a bare
    name. Refused in one line."""
    tok = Tokenizer(sweep_tokenizer(root, "qwen25", families()["qwen25"]))
    tok.hf.chat_template = _OWN.replace("{CALL}", "")
    enc = ChatEncoder(tok)
    for given in ({"text": "apple river"}, '{"text": "apple river"}'):
        with pytest.raises(RowError, match=r"^message 1 \(assistant\): .* does not render its tool calls' arguments"):
            enc.encode(_call_row(given))
    enc.encode(_call_row({}))  # a call without arguments has none to render


def test_a_template_that_skips_a_call_with_no_content_refuses_the_row(root):
    """GLM-4's template renders a message only when its content is not empty: a tool call (content "") vanishes, calls
    and all, so its turn is never located, and the reply after its result was trained on a call the model never made
    (the call's turn counted, the row kept). Such a row is refused in one line, as a template that drops the calls is."""
    tok = Tokenizer(sweep_tokenizer(root, "qwen25", families()["qwen25"]))
    # GLM-4's shape: one control token opens each role's turn (here the fixture's three), nothing closes one
    tok.hf.chat_template = ("{%- set mark = {'user': '<|im_start|>', 'assistant': '<|im_end|>', 'tool': '<|endoftext|>'}"
                            " %}{%- for m in messages %}{%- if m.content %}{{ mark[m.role] }}\n{{ m.content }}{%- endif %}"
                            "{%- endfor %}{%- if add_generation_prompt %}<|im_end|>{%- endif %}")
    enc = ChatEncoder(tok)
    enc.encode({"messages": CASES["multi-turn"]})
    with pytest.raises(RowError, match=r"^message 1 \(assistant\): .* does not render its tool call\(s\) "
                                       r"\['count_words'\], so an empty reply would be trained"):
        enc.encode({"messages": CASES["tool call"]})


def test_calls_a_template_drops_in_part_are_named(root):
    """gpt-oss writes a reply's first tool call alone: two parallel calls were refused as "does not render its tool
    call(s) [both]", naming a call it renders. Now the refusal names the one dropped."""
    call = CASES["tool call"][1]["tool_calls"][0]
    second = {**call, "id": "call00002", "function": {**call["function"], "name": "count_chars"}}
    conv = [CASES["tool call"][0], {**CASES["tool call"][1], "tool_calls": [call, second]}, *CASES["tool call"][2:]]
    with pytest.raises(RowError, match=r"renders only some of its tool calls, not \['count_chars'\]") as e:
        encoder(root, "gpt_oss").encode({"messages": conv})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("key, trains", [("phi3", False), ("olmo3", False), ("zephyr", False), ("qwen25", True),
                                         ("llama31", True)])
def test_a_tool_result_the_template_drops_refuses_the_row(root, key, trains):
    """A tool result after a reply without a call (the call given as text): Phi-3 / Phi-4, OLMo, Zephyr and Vicuna
    templates have no tool role and dropped it, and the reply after it trained on a result the model never saw,
    without a word. Refused in one line now; a template that renders the role trains it."""
    row = {"messages": [{"role": "user", "content": "How many words in apple river?"},
                        {"role": "assistant", "content": "Counting them."},
                        {"role": "tool", "content": "count is 2"}, {"role": "assistant", "content": "2 words"}]}
    enc = encoder(root, key)
    if trains:
        ids, mask, stats = enc.encode(row)
        assert stats["untrained_turns"] == 0 and "count is 2" in enc.tok.hf.decode(ids)
        return
    with pytest.raises(RowError, match=r"message 2 \(tool\): .* does not render tool results") as e:
        enc.encode(row)
    assert "\n" not in str(e.value)


def test_an_empty_call_list_is_no_call():
    """OpenAI exports write `tool_calls: []` on plain replies; Llama 4's template tests `'tool_calls' in message` and
    skipped the reply, and the row was refused for another reason. An empty list is dropped as null is."""
    from data.chat_rows import normalize

    _, conv, _ = normalize({"messages": [{"role": "user", "content": "q"},
                                         {"role": "assistant", "content": "a", "tool_calls": []}]})
    assert "tool_calls" not in conv[1]
