"""Where a reply starts and ends (data/chat_locate.py), on the sweep's tokenizers (data/chat_sweep.py): Command R7B's
reply is trained through the stop after its end-of-turn, with or without a generation config beside the tokenizer;
Nemotron Nano v2's reply of tool calls alone from its first token; a row with no turn located refused naming its cause
(named replies, a template argument). ~3 s, no network."""

from __future__ import annotations

import os

import numpy as np
import pytest

from data.chat import ChatEncoder
from data.chat_sweep import CASES, build_tokenizer, families
from data.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("locate_tokenizers"))


def spans(key: str, root: str, conv: list[dict], config: bool = True) -> list[str]:
    """The trained spans' texts of `conv` through family `key`'s template as shipped (without its
    generation_config.json where `config` is False)."""
    fam = families()[key]
    sub = os.path.join(root, "with" if config else "without")
    os.makedirs(sub, exist_ok=True)
    path = build_tokenizer(sub, key, fam)
    if not config and os.path.exists(os.path.join(path, "generation_config.json")):
        os.remove(os.path.join(path, "generation_config.json"))
    tok = Tokenizer(path)
    ids, mask, _ = ChatEncoder(tok, "assistant", fam.get("template", "auto")).encode({"messages": conv})
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    return [tok.hf.decode(ids[a:b]) for a, b in zip(edges[::2], edges[1::2])]


@pytest.mark.parametrize("config", [True, False])
def test_command_r7b_replies_are_trained_through_their_stop(root, config):
    """R7B ends a reply `<|END_RESPONSE|><|END_OF_TURN_TOKEN|>` and generation stops only on the second (its EOS, its
    generation config's one stop): the span ended at the first, the model never learned to stop. Without a
    generation config the EOS is the stop: the template writes it after every reply."""
    got = spans("command_r7b", root, CASES["multi-turn"], config)
    assert got == ["apple river<|END_RESPONSE|><|END_OF_TURN_TOKEN|>", "2 words<|END_RESPONSE|><|END_OF_TURN_TOKEN|>"]
    call, answer = spans("command_r7b_tool_use", root, CASES["tool list"], config)
    assert call.endswith("<|END_ACTION|><|END_OF_TURN_TOKEN|>") and "count_words" in call
    assert answer == "<|START_RESPONSE|>2 words<|END_RESPONSE|><|END_OF_TURN_TOKEN|>"


def test_a_stop_only_the_conversations_end_writes_stays_untrained_and_history_ends_stay(root):
    """Phi-4-mini writes its EOS only after the last reply (`<|end|><|endoftext|>`): without a generation config it
    is no turn's stop, and stays untrained; gpt-oss's history `<|end|><|start|>` reaches no stop: unchanged."""
    assert spans("phi4_mini", root, CASES["multi-turn"], config=False)[-1] == "2 words<|end|>"
    got = spans("gpt_oss", root, CASES["multi-turn"])
    assert got[0].endswith("apple river") and got[1].endswith("2 words<|return|>")


def test_the_stop_an_r7b_export_gets_is_the_one_trained(root):
    from data.chat_stops import reply_stops

    os.makedirs(os.path.join(root, "with"), exist_ok=True)
    path = build_tokenizer(os.path.join(root, "with"), "command_r7b", families()["command_r7b"])
    assert reply_stops(path) == [Tokenizer(path).hf.convert_tokens_to_ids("<|END_OF_TURN_TOKEN|>")]


@pytest.mark.parametrize("case", ["tool call", "tool list", "arguments as JSON text"])
def test_nemotron_nano2_reply_of_calls_alone_is_trained_from_its_first_token(root, case):
    """The prompt ends `Assistant\\n<think>\\n`, the history writes `Assistant\\n<TOOLCALL>[`: with both words plain
    text they share the token `<`, and the reply was trained from `TOOLCALL>` (its `<` never learned)."""
    call, answer = spans("nemotron_nano2", root, CASES[case])
    assert call.startswith('<TOOLCALL>[{"name": "count_words"') and call.endswith("</TOOLCALL>\n<SPECIAL_12>")
    assert answer == "2 words\n<SPECIAL_12>"


def _encode(key: str, root: str, conv: list[dict], **kw) -> tuple[list[str], dict]:
    """The trained spans' texts and the stats of `conv` through family `key` (or a family dict), the row's
    chat_template_kwargs `kw`."""
    fam = families()[key] if isinstance(key, str) else key
    tok = Tokenizer(build_tokenizer(root, key if isinstance(key, str) else fam["key"], fam))
    ids, mask, stats = ChatEncoder(tok, "assistant").encode({"messages": conv, "chat_template_kwargs": kw})
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    return [tok.hf.decode(ids[a:b]) for a, b in zip(edges[::2], edges[1::2])], stats


def test_an_end_of_turn_behind_a_newline_is_trained_with_its_reply(root):
    """Apriel-1.6 writes `reply\\n<|end|>\\n` only when a message follows (or with training_prompt): the turn rendered
    alone ends in its text, and the end-of-turn was looked for one token on, where the `\\n` is: the earlier reply
    trained as `apple river`, no stop, uncounted. The last reply has none unless the row sets training_prompt:
    counted (no_stop_rows), as Qwen1.5's."""
    got, stats = _encode("apriel16", root, CASES["multi-turn"])
    assert got == ["apple river\n<|end|>", "2 words"] and stats["no_stop_rows"] == 1 and not stats["untrained_turns"]
    got, stats = _encode("apriel16", root, CASES["multi-turn"], training_prompt=True)
    assert got == ["apple river\n<|end|>", "2 words\n<|end|>"] and stats["no_stop_rows"] == 0


def test_an_earlier_reply_the_template_ends_with_no_end_of_turn_is_counted_not_trained(root, tmp_path):
    """A template writing its end-of-turn after a reply a user turn follows, and none before a tool result: the reply
    before the result ends in its text, `\\n<|begin_tool|>` after it; it was trained so (no stop), uncounted."""
    path = tmp_path / "no_eot_before_tool.jinja"
    path.write_text("{% for m in messages %}{{ '<|begin_' + m.role + '|>\\n' + m.content }}"
                    "{% if m.role == 'assistant' and not loop.last and messages[loop.index0 + 1].role == 'user' %}"
                    "{{ '\\n<|end|>\\n' }}{% else %}{{ '\\n' }}{% endif %}{% endfor %}"
                    "{% if add_generation_prompt %}{{ '<|begin_assistant|>\\n' }}{% endif %}")
    fam = {"key": "no_eot_before_tool", "file": str(path), "oracle": str(path), "eos": "<|end|>",
           "special": ["<|begin_user|>", "<|begin_assistant|>", "<|begin_tool|>", "<|end|>"]}
    conv = [{"role": "user", "content": "How many words in apple river?"},
            {"role": "assistant", "content": "Counting them."}, {"role": "tool", "content": "2"},
            {"role": "assistant", "content": "2 words"}, {"role": "user", "content": "Thanks."},
            {"role": "assistant", "content": "apple river"}]
    got, stats = _encode(fam, root, conv)
    assert got == ["2 words\n<|end|>", "apple river\n"] and stats["untrained_turns"] == 1
    assert stats["why"] == ["message 1: the template writes no end-of-turn token ['<|end|>'] after it (it goes on "
                            "'<|begin_tool|>\\n2\\n'), so it would train with no stop: use a template that ends "
                            "every reply"]


def _thinking_family(tmp_path, name: str, text: str) -> dict:
    path = tmp_path / f"{name}.jinja"
    path.write_text(text)
    return {"key": name, "file": str(path), "oracle": str(path), "eos": "<|end|>", "added": ["<think>", "</think>"],
            "special": ["<|User|>", "<|Assistant|>", "<|end|>", "<|START_THINKING|>", "<|END_THINKING|>",
                        "<|START_TEXT|>", "<|END_TEXT|>"]}


# Cohere2MoE's way (llama.cpp's models/templates/Cohere2MoE.jinja): the prompt opens a thinking block, with `reasoning`
# false an empty one, and the history writes one only for a reply with reasoning, a reply's text in <|START_TEXT|>
_COHERE2MOE = ("{% for m in messages %}{% if m.role == 'user' %}<|User|>{{ m.content }}<|end|>{% else %}<|Assistant|>"
               "{% if m.reasoning_content %}<|START_THINKING|>{{ m.reasoning_content }}<|END_THINKING|>{% endif %}"
               "<|START_TEXT|>{{ m.content }}<|END_TEXT|><|end|>{% endif %}{% endfor %}{% if add_generation_prompt %}"
               "<|Assistant|>"
               "{% if reasoning is not defined or reasoning %}<|START_THINKING|>{% else %}<|START_THINKING|>"
               "<|END_THINKING|>{% endif %}{% endif %}")
# DeepSeek-V3.2's way: `thinking` off, the prompt `<think></think>`, the history `</think>`; on, `<think>` in both
_V32 = ("{% for m in messages %}{% if m.role == 'user' %}<|User|>{{ m.content }}{% else %}<|Assistant|>"
        "{% if thinking %}<think></think>{% else %}</think>{% endif %}{{ m.content }}<|end|>{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|Assistant|>{% if thinking %}<think>{% else %}<think></think>{% endif %}"
        "{% endif %}")


def test_a_prompt_opening_a_thinking_block_the_history_does_not_write_is_named(root, tmp_path):
    """The refusal spoke of earlier messages rendered differently (Mistral v0.3's system prompt); it names the
    thinking block, and the switch with which the prompt is what the history writes, where one is."""
    from data.chat import RowError

    conv = CASES["multi-turn"][:2]
    fam = _thinking_family(tmp_path, "cohere2moe_like", _COHERE2MOE)
    with pytest.raises(RowError, match=r"message 1: the template's generation prompt opens a thinking block "
                                       r"\(<\|START_THINKING\|>\) that the history does not write before this reply: "
                                       r"give the reply's reasoning \(reasoning_content\); docs"):
        _encode(fam, root, conv)
    with pytest.raises(RowError, match=r"\(reasoning_content\) and drop chat_template_kwargs reasoning: false"):
        _encode(fam, root, conv, reasoning=False)
    assert _encode(fam, root, CASES["reasoning"][:2])[0] == [
        "Two words: apple, river.<|END_THINKING|><|START_TEXT|>apple river<|END_TEXT|><|end|>"]
    fam = _thinking_family(tmp_path, "v32_like", _V32)
    with pytest.raises(RowError, match=r"opens a thinking block \(<think>\) .* or set chat_template_kwargs "
                                       r"\{\"thinking\": true\}, with which its prompt is what the history writes"):
        _encode(fam, root, conv)
    assert _encode(fam, root, conv, thinking=True)[0] == ["</think>apple river<|end|>"]


def test_the_no_stop_warning_names_the_templates_training_switch(tmp_path):
    """Apriel-1.6 writes the last reply's end-of-turn only with `training_prompt`: prepare_data's warning about
    conversations ending with no stop named no way out; it names the switch where the template reads it."""
    from data.chat_template import training_switch

    (tmp_path / "chat_template.jinja").write_text("{% if not loop.last or training_prompt %}<|end|>{% endif %}")
    assert '"training_prompt": true' in training_switch(None, str(tmp_path))
    (tmp_path / "chat_template.jinja").write_text("{{ '<|im_end|>' }}")
    assert training_switch(None, str(tmp_path)) == "" and training_switch(None, None) == ""


def _named(conv: list[dict]) -> list[dict]:
    return [{**m, "name": "Kimi" if m["role"] == "assistant" else "bob"} for m in conv]


def test_a_row_refused_for_its_named_replies_names_the_name(root):
    """The refusal of a row with no turn located named Mistral v0.3's system prompt and Command-R's tool_use whatever
    the cause: Kimi K2 writes an assistant message's `name` in its header (`<|im_assistant|>{{ name or role }}`), its
    generation prompt `assistant`. It names `name` and the fix; Kimi K2 0711's template, which writes the role, trains
    the row."""
    from data.chat import RowError

    conv = CASES["multi-turn"]
    with pytest.raises(RowError, match=r"located in .*kimi_k2's template: message 1: the template writes an assistant "
                                       r"message's `name` \('Kimi'\) in its header, which its generation prompt does "
                                       r"not: drop `name` from the assistant messages; docs"):
        _encode("kimi_k2", root, _named(conv))
    assert _encode("kimi_k2", root, conv)[0] == ["apple river<|im_end|>", "2 words<|im_end|>"]
    assert _encode("kimi_k2_0711", root, _named(conv))[0] == ["apple river<|im_end|>", "2 words<|im_end|>"]


def test_a_row_refused_for_its_template_arguments_names_the_argument(root):
    """Hunyuan-A13B's enable_thinking false writes `<think>\\n\\n</think>\\n` after every render: no turn is located and
    the line named Mistral v0.3 / Command-R; it names the argument. A row refused for neither cause keeps the line."""
    from data.chat import RowError

    conv = CASES["multi-turn"]
    with pytest.raises(RowError, match=r"message 1: with chat_template_kwargs enable_thinking: false the template's "
                                       r"generation prompt is not what it writes before a reply \(without it, it is\): "
                                       r"drop enable_thinking from the row's chat_template_kwargs; docs"):
        _encode("hunyuan_a13b", root, conv, enable_thinking=False)
    with pytest.raises(RowError, match=r"message 2: .* \(Mistral v0.3 drops a system prompt unless a user turn is last"):
        _encode("mistral_v03", root, _named(CASES["system"]), enable_thinking=False)
