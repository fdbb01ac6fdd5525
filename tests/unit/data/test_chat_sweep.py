"""The chat-template sweep (data/chat_sweep.py): every family users fine-tune, through a template written here that
renders what the family's own renders, either trains exactly each reply and its end-of-turn token (checked against
Hugging Face's assistant mask of the same template with generation markers) or is refused in one line; the table
in docs/sft.md is what the sweep prints now. Issue 47 items 1-6 as cells of that table. ~4 s, no network."""

from __future__ import annotations

import pytest

from data.chat_sweep import CASES, families, markdown, sweep


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    return sweep(str(tmp_path_factory.mktemp("chat_sweep")))


def test_every_family_trains_exactly_its_replies_or_is_refused_in_one_line(table):
    assert set(table) == set(families())
    ok = ("trains", "refused", "not checked")
    wrong = {(f, c): out for f, row in table.items() for c, out in row.items() if not out.startswith(ok)}
    assert not wrong
    assert all("\n" not in out for row in table.values() for out in row.values())


@pytest.mark.parametrize("family,case,want", [
    # item 1: a template whose last message renders differently (Phi's EOS after it, OLMo 3's EOS instead of
    # <|im_end|>, gpt-oss's <|return|>): each reply ends at its own end-of-turn token, never the conversation's end
    ("phi3", "multi-turn", "trains"), ("phi4_mini", "system", "trains"), ("olmo3", "multi-turn", "trains"),
    ("gpt_oss", "multi-turn", "trains"), ("gpt_oss", "reasoning", "trains"), ("gpt_oss", "tool call", "trains"),
    # item 2: a tool call the template does not render is a refused row, never an empty reply trained
    ("llama3", "tool call", "refused: message 1 (assistant): llama3's template does not render its tool call(s)"),
    ("smollm2", "tool call", "refused: message 1 (assistant): smollm2's template does not render its tool call(s)"),
    ("llama31", "tool call", "trains"), ("qwen25", "tool call", "trains"), ("deepseek_v3", "tool call", "trains"),
    # item 3: named templates: `default` by default, another when named
    ("command_r", "multi-turn", "trains"),
    ("command_r_tool_use", "multi-turn", "refused: none of the 2 assistant turn(s) could be located in "
                                         "command_r_tool_use's `tool_use` template"),
    # item 4: a generation prompt longer than the header inside the conversation (<｜Assistant｜><think>\n)
    ("deepseek_r1", "multi-turn", "trains"), ("deepseek_r1", "reasoning", "trains"),
    ("deepseek_r1", "reasoning in the content", "trains"), ("qwen3", "reasoning in the content", "trains"),
    # item 5: an assistant turn first: the later turns train, the first is counted
    ("llama3", "assistant first", "trains 1 of 2: message 0: an assistant turn first"),
    # item 6: a reply holding its end-of-turn token's text is not trained (it would teach a stop inside it), counted
    ("qwen25", "end-of-turn text in a reply", "trains 1 of 2: message 3: its text holds the end-of-turn token's text"),
    ("chatml_generation", "end-of-turn text in a reply", "trains 1 of 2: message 3: its text holds the end-of-turn"),
])
def test_issue_47_cases(table, family, case, want):
    assert table[family][case].startswith(want), table[family][case]


def test_the_docs_table_is_the_sweeps(table):
    """docs/sft.md holds `python -m data.chat_sweep --markdown` as it prints now."""
    with open("docs/sft.md") as fh:
        assert markdown(table) in fh.read(), "regenerate: python -m data.chat_sweep --markdown"
    assert len(CASES) == 7
