"""A template that changes a list in place (`.append`, `.pop`): transformers renders chat templates in jinja2's
ImmutableSandboxedEnvironment, which forbids it, so Hugging Face's own apply_chat_template cannot render such a row
either (Kimi K2 Instruct 0905's and Thinking's templates as llama.cpp stores them, on every row with a tool call). The
refusal says so and names the fix in one line (data/chat_render.sandboxed), on the prefix path and under
`{% generation %}` markers; before, it read "refuses this conversation: access to attribute 'append' of 'list' object
is unsafe." and named none (both tests failed on that code). One process, ~1 s."""

from __future__ import annotations

import pytest
from jinja2.exceptions import SecurityError

from data.chat import ChatEncoder, RowError
from data.chat_sweep import CASES, build_tokenizer, families
from data.tokenizer import Tokenizer

_FIX = (r"cannot be rendered: it changes a list in place \(access to attribute 'append' of 'list' object is unsafe\.\), "
        r"which transformers' sandboxed jinja forbids .* chat_template\.jinja with it rewritten, "
        r"`\{% set ns\.ids = ns\.ids \+ \[x\] %\}`")


@pytest.mark.parametrize("key", ["kimi_k2", "kimi_k2_thinking"])
def test_kimi_k2s_list_append_is_refused_with_its_fix(tmp_path, key):
    enc = ChatEncoder(Tokenizer(build_tokenizer(str(tmp_path), key, families()[key])), "assistant")
    with pytest.raises(SecurityError, match="'append' of 'list' object is unsafe"):  # Hugging Face's own render
        enc.hf.apply_chat_template(CASES["tool call"], tokenize=False)
    with pytest.raises(RowError, match=_FIX) as got:
        enc.encode({"messages": CASES["tool call"]})
    assert "\n" not in str(got.value)
    assert enc.encode({"messages": CASES["multi-turn"]})[1].any()  # a row without calls renders (no append)


def test_the_same_under_generation_markers(tmp_path):
    """A template with `{% generation %}` markers is rendered by Hugging Face's assistant mask first (ChatEncoder._markers)."""
    template = ("{%- set ns = namespace(ids=[]) -%}{%- for m in messages -%}{%- set _ = ns.ids.append(m.role) -%}"
                "<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}{% generation %}{{ m.content }}<|im_end|>"
                "{% endgeneration %}{% else %}{{ m.content }}<|im_end|>{% endif %}\n{%- endfor -%}")
    fam = {**families()["chatml_generation"], "markers": True}
    path = build_tokenizer(str(tmp_path), "appends", fam)
    enc = ChatEncoder(Tokenizer(path), "assistant")
    enc.template = template
    assert enc.markers
    with pytest.raises(RowError, match=_FIX):
        enc.encode({"messages": CASES["multi-turn"]})
