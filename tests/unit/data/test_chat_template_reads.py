"""`reads` (the names a chat template reads) answers whatever transformers calls its private compile function:
`_compile_jinja_template` up to 5.0, `_cached_compile_jinja_template` since, or neither (our own environment with the
same `{% generation %}` tag). Where it answered None, an unread `chat_template_kwargs` key passed a substring test
and trained as if unset (transformers 4.57.6 / 5.0.0). Pure, < 1 s."""

from __future__ import annotations

import pytest
from transformers.utils import chat_template_utils

from data.chat_template import RowError, reads, row_kwargs

# Qwen3's shape: reads enable_thinking, never `thinking` (a substring of it); a generation block and a loop control
QWEN3_LIKE = ("{%- for m in messages %}{%- if m.role == 'assistant' %}{% generation %}{{ m.content }}"
              "{% endgeneration %}{%- else %}{{ m.content }}{%- endif %}{%- if loop.index > 99 %}{% break %}"
              "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n"
              "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}"
              "{%- endif %}")

NAMES = ("_cached_compile_jinja_template", "_compile_jinja_template")


@pytest.mark.parametrize("gone", [(), NAMES[:1], NAMES], ids=["transformers-5.23", "transformers-5.0", "renamed"])
def test_reads_answers_whatever_transformers_calls_its_compiler(monkeypatch, gone):
    for name in gone:
        monkeypatch.delattr(chat_template_utils, name, raising=False)
    reads.cache_clear()
    try:
        assert reads(QWEN3_LIKE) == {"messages", "add_generation_prompt", "enable_thinking"}
        assert row_kwargs({"chat_template_kwargs": {"enable_thinking": False}}, QWEN3_LIKE, "qwen3") == {
            "enable_thinking": False}
        with pytest.raises(RowError, match="thinking='low' and qwen3 never reads it"):
            row_kwargs({"chat_template_kwargs": {"thinking": "low"}}, QWEN3_LIKE, "qwen3")
    finally:
        reads.cache_clear()  # the next test reads with transformers' own function again


def test_a_template_that_does_not_parse_reads_nothing():
    assert reads("{% for m in messages %}") is None
