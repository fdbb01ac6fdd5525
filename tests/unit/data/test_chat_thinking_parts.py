"""Content lists as the template renders them (data/chat_render `Rendering._parts`): a reply's `{"type": "thinking"}`
part (mistral-common's ThinkChunk, what Magistral / Ministral exports write) trains exactly the tokens of Hugging Face's
rendering of the list where the template renders it (Ministral 3 Reasoning: `[THINK]...[/THINK]`), checked against
HF's assistant mask of the family's marked copy, and is refused in one line where it does not (Magistral Small 2509's
Unsloth copy, every non-Mistral template); text parts are written with no separator where the template renders the
list itself (it wrote them joined by a newline, a text the template never renders), by a newline elsewhere (vLLM's
reading of a string template). Each test failed on the code before (a 'thinking' part was refused everywhere, in a
line naming no template; text parts were always joined by a newline). One process, ~2 s: the sweep's tokenizers (data/chat_sweep.py)."""

from __future__ import annotations

import numpy as np
import pytest

from data.chat import ChatEncoder, RowError
from data.chat_message import message
from data.chat_sweep import build_tokenizer, families, marked, rendering
from data.tokenizer import Tokenizer

_WHY = "Two words: apple, river."
_ASK = {"role": "user", "content": "Say exactly: apple river"}


def _reply(text: str, why: str = _WHY) -> dict:
    return {"role": "assistant", "content": [{"type": "thinking", "thinking": why}, {"type": "text", "text": text}]}


_CONV = [_ASK, _reply("apple river"), {"role": "user", "content": "Count them."}, _reply("2 words")]


@pytest.fixture(scope="module")
def enc(tmp_path_factory):
    root, fams = str(tmp_path_factory.mktemp("parts")), families()
    return lambda key: ChatEncoder(Tokenizer(build_tokenizer(root, key, fams[key])), "assistant")


def _oracle(e: ChatEncoder, key: str, conv: list[dict]) -> tuple[list[int], np.ndarray]:
    out = rendering(e, marked(families()[key]), conv)  # HF's ids and assistant mask of the list, marked copy
    return list(out["input_ids"]), np.asarray(out["assistant_masks"], np.uint8)


def test_thinking_parts_train_what_the_template_renders(enc):
    e = enc("ministral3_reasoning")
    ids, mask, stats = e.encode({"messages": _CONV})
    want_ids, want_mask = _oracle(e, "ministral3_reasoning", _CONV)
    assert ids == want_ids and (mask == want_mask).all() and stats["untrained_turns"] == 0
    trained = e.tok.decode([t for t, m in zip(ids, mask) if m])
    assert trained == f"[THINK]{_WHY}[/THINK]apple river</s>[THINK]{_WHY}[/THINK]2 words</s>"


def test_a_system_prompts_thinking_part_and_several_parts(enc):
    """The template renders a system prompt's thinking part too, and parts in any order: HF's rendering, exactly."""
    e = enc("ministral3_reasoning")
    conv = [{"role": "system", "content": [{"type": "text", "text": "Think first."},
                                          {"type": "thinking", "thinking": "Like this."}]}, _ASK,
            {"role": "assistant", "content": [{"type": "text", "text": "apple "}, {"type": "thinking", "thinking": "x"},
                                              {"type": "text", "text": "river"}]}]
    ids, mask, _ = e.encode({"messages": conv})
    want_ids, want_mask = _oracle(e, "ministral3_reasoning", conv)
    assert ids == want_ids and (mask == want_mask).all()
    assert "[SYSTEM_PROMPT]Think first.[THINK]Like this.[/THINK][/SYSTEM_PROMPT]" in e.tok.decode(ids)


@pytest.mark.parametrize("key", ["magistral_small_2509", "qwen3", "llama3", "mistral_small32"])
def test_a_template_that_does_not_render_them_refuses_in_one_line(enc, key):
    with pytest.raises(RowError, match=r"content part 0 is a 'thinking' part .* does not render: give the reply as one "
                                       r"text with its reasoning .*\[THINK\]") as got:
        enc(key).encode({"messages": _CONV})
    assert "\n" not in str(got.value)


def test_text_parts_are_written_as_a_template_that_renders_lists_writes_them(enc):
    """Mistral Small 3.2 concatenates a list's text parts: trained `Alpha one.\\nBeta two.` before, a text its
    rendering of the row never holds; Llama 3 reads a string (a list renders as Python's repr): joined by a newline."""
    conv = [{"role": "user", "content": [{"type": "text", "text": "Alpha one."}, {"type": "text", "text": "Beta two."}]},
            {"role": "assistant", "content": [{"type": "text", "text": "apple "}, {"type": "text", "text": "river"}]}]
    e = enc("mistral_small32")
    ids, mask, _ = e.encode({"messages": conv})
    want_ids, want_mask = _oracle(e, "mistral_small32", conv)
    assert ids == want_ids and (mask == want_mask).all()
    assert "[INST]Alpha one.Beta two.[/INST]apple river</s>" in e.tok.decode(ids)
    e = enc("llama3")
    assert "Alpha one.\nBeta two." in e.tok.decode(e.encode({"messages": conv})[0])


def test_a_thinking_part_outside_a_reply_or_system_prompt_is_refused():
    with pytest.raises(RowError, match=r"message 0 \(user\): content part 0 is a 'thinking' part, which only a reply"):
        message({"role": "user", "content": [{"type": "thinking", "thinking": "x"}, {"type": "text", "text": "q"}]}, 0)


def test_a_message_read_again_is_the_same(enc):
    """encode_long reads its messages, then encodes them (reads them again): the parts survive (data/chat_splice.py)."""
    once = message(_CONV[1], 1)
    assert message(once, 1) == once and once["content"] == "apple river"
    e = enc("ministral3_reasoning")
    (ids, mask), (want_ids, want_mask, _) = e.encode_long(_CONV, 0), e.encode({"messages": _CONV})
    assert ids == want_ids and (mask == want_mask).all()
