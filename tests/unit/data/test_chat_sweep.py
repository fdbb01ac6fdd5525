"""The chat-template sweep (data/chat_sweep.py): every family users fine-tune, through a template written here that
renders what the family's own renders, either trains exactly each reply and its end-of-turn token (checked against
Hugging Face's assistant mask of the same template with generation markers) or is refused in one line; the table
in docs/sft.md is what the sweep prints now. Issue 47 items 1-6 as cells of that table. ~5.5 s of CPU over the 70
families (4.3 s over 49), no network; the other paths to training over the same renderings (data/chat_sweep_paths.py)
~3.5 s more (2.5 s)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from data.chat_sweep import CASES, as_shipped, families, markdown, sweep


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """(root, kept, table): the messages sweep, and what the other paths reuse of it (its tokenizers, encoders and
    renderings: data/chat_sweep_paths.py)."""
    root, kept = str(tmp_path_factory.mktemp("chat_sweep")), {}
    return root, kept, sweep(root, keep=kept)


@pytest.fixture(scope="module")
def table(swept):
    return swept[2]


def test_every_family_trains_exactly_its_replies_or_is_refused_in_one_line(table):
    assert set(table) == set(families())
    ok = ("trains", "refused", "not checked")
    wrong = {(f, c): out for f, row in table.items() for c, out in row.items() if not out.startswith(ok)}
    # a WRONG cell only where families.json records the encoder bug it shows (`wrong`), and each record still shows
    # one: fixed in data/chat.py, the record goes (and the table regenerated)
    open_bugs = {f for f, fam in families().items() if fam.get("wrong")}
    assert {f for f, _ in wrong} == open_bugs, wrong
    assert all("\n" not in out for row in table.values() for out in row.values())


def test_every_path_trains_exactly_the_oracles_replies_or_refuses_in_one_line(swept):
    """The same conversations through every other path to training (data/chat_sweep_paths.py: prompt / completion,
    --loss_on completion / all, pre-tokenized rows, encode_long, packing, the held-out split) and the sentencepiece
    ChatML default, against the same oracle: WRONG only where WRONG records the bug (found, not fixed yet), and
    each record still shows one. ~3.5 s of CPU (the renderings are the messages sweep's)."""
    from data.chat_sweep_paths import PATHS, SAMPLED, WRONG, sweep_paths, wrong_cells

    root, kept, table = swept
    paths = sweep_paths(root, kept)
    assert set(paths) == set(families()) | {"sentencepiece"}
    wrong = wrong_cells(paths)
    assert {(f, p) for f, p, _ in wrong} == set(WRONG), wrong
    assert all("\n" not in out for cells in paths.values() for row in cells.values() for out in row.values())
    # every path trains (the check is no refusal of everything) in every family, named apart, not by a count: one the
    # messages path refuses whole (Command-R's `tool_use` renders only with a tool list) trains on no path; and `long`
    # takes no row carrying `tools` or chat_template_kwargs (encode_long takes neither: data/tasks.py's trials carry
    # none), so a family whose every row carries one (`kwargs` in families.json, Hermes' `"tools": "always"`) has no
    # `long` cell at all, by construction
    refused_whole = {f for f, row in table.items() if not any(o.startswith("trains") for o in row.values())}
    no_long = {f for f in table if all(kept[f, c]["args"][3] is not None or kept[f, c]["args"][5]
                                       for c in CASES if (f, c) in kept)}
    assert {f for f, cells in paths.items() if not cells["long"]} == no_long
    for path in PATHS:
        trains = {f for f, cells in paths.items() if any(o.startswith("trains") for o in cells[path].values())}
        assert set(paths) - trains <= refused_whole | (no_long if path == "long" else set()), (path, set(paths) - trains)
    for case in CASES:  # each sampled path meets every conversation in some family
        assert all(any(case in cells[p] for cells in paths.values()) or p == "long" for p in SAMPLED), case


def test_every_familys_template_given_as_a_file_trains_as_its_own(swept):
    """`--chat_template FILE` (data/chat_template.given_template; TRL's chat_template_path): each family's tokenizer
    folder given as the file renders through the template-text path, and every case's ids, mask and counts (or its
    refusal, the template's name aside) equal those of the tokenizer's own template. Before, a path was a template
    name the tokenizer lacks: refused."""
    from data.chat import ChatEncoder
    from data.chat_sweep import outcome
    from data.chat_template import given_template

    root, kept, _ = swept
    encs, checked = {}, 0
    for (key, case), k in kept.items():
        enc, conv, tools, kwargs = k["args"][0], k["args"][2], k["args"][3], k["args"][5]
        if isinstance(enc.hf.chat_template, dict):  # a named set: a folder gives no one text (the JSON form refuses)
            continue
        if key not in encs:
            text = given_template(os.path.join(root, key))
            assert text == enc.hf.chat_template, key
            encs[key] = ChatEncoder(enc.tok, "assistant", text, enc.clock.at)  # the instant a date renders
        row = {"messages": conv, **({"tools": tools} if tools is not None else {}),
               **({"chat_template_kwargs": kwargs} if kwargs else {})}
        (why, got), (why2, got2) = outcome(enc.encode, row), outcome(encs[key].encode, row)
        assert (why2 or "").replace(encs[key].name, enc.name) == (why or ""), (key, case, why, why2)
        if got is not None:
            assert got[0] == got2[0] and np.array_equal(np.asarray(got[1]), np.asarray(got2[1])), (key, case)
            assert got[2] == got2[2], (key, case)
        checked += 1
    assert len(encs) >= 60 and checked >= 60 * 10, (len(encs), checked)


@pytest.mark.parametrize("family,case,want", [
    # item 1: a template whose last message renders differently (Phi's EOS after it, OLMo 3's EOS instead of
    # <|im_end|>, gpt-oss's <|return|>): each reply ends at its own end-of-turn token, never the conversation's end
    ("phi3", "multi-turn", "trains"), ("phi4_mini", "system", "trains"), ("olmo3", "multi-turn", "trains"),
    ("gpt_oss", "multi-turn", "trains"), ("gpt_oss", "reasoning", "trains: 1 earlier reply's"), ("gpt_oss", "tool call", "trains"),
    # GLM-4.7 writes an earlier reply as its prompt without thinking gives it (`<|assistant|></think>`, the prompt
    # `<|assistant|><think>`): every row without reasoning was refused; a reply ends with the next message's token
    # (<|user|>, <|observation|> after a call), its stops
    ("glm47", "multi-turn", "trains"), ("glm47", "system", "trains"), ("glm47", "tool call", "trains"),
    ("glm47", "reasoning", "trains: 1 earlier reply's"), ("glm47", "tool call with text", "trains"),
    # item 2: a tool call the template does not render is a refused row, never an empty reply trained
    ("llama3", "tool call", "refused: message 1 (assistant): llama3's template does not render its tool call(s)"),
    ("smollm2", "tool call", "refused: message 1 (assistant): smollm2's template does not render its tool call(s)"),
    # Granite 3.1-3.3 render only an assistant's content (granite-common's 3.2 template, llama.cpp's 3.3 copy)
    ("granite3", "tool call", "refused: message 1 (assistant): granite3's template does not render its tool call(s)"),
    ("granite33", "tool call", "refused: message 1 (assistant): granite33's template does not render its tool call"),
    ("olmo3", "tool call", "refused: message 1 (assistant): olmo3's template does not render its tool call(s)"),
    ("llama31", "tool call", "trains"), ("qwen25", "tool call", "trains"), ("deepseek_r1", "tool call", "trains"),
    # DeepSeek-V3's own template renders calls only for a reply whose content is None; "" drops them
    ("deepseek_v3", "tool call", "refused: message 1 (assistant): deepseek_v3's template does not render its tool"),
    ("mistral_v03", "tool call", "trains"),  # [TOOL_CALLS] supervised with the call: what the model writes
    # Mistral's system prompt: in the first user turn ('v1', v0.2) it trains; in the last (v3, v0.3) it is refused
    ("mistral_v02", "system", "trains"), ("mistral_v03", "system", "refused: none of the 2 assistant turn(s)"),
    # item 3: named templates: `default` by default, another when named
    ("command_r", "multi-turn", "trains"),
    # (Command-R's own `tool_use` iterates `tools`: rows here carry none, so it raises and the row is refused)
    ("command_r_tool_use", "multi-turn", "refused: command_r_tool_use's `tool_use` template refuses this conversation"),
    # item 4: a generation prompt longer than the header inside the conversation (<｜Assistant｜><think>\n)
    ("deepseek_r1", "multi-turn", "trains"),
    # a reply's reasoning: a template that never renders it (R1's cuts the content at </think>; Llama's, Qwen2.5's have
    # no reasoning branch) refuses the row; one that renders only the replies' after the last user turn (Qwen3,
    # gpt-oss) trains them, the earlier ones counted. Before, every one trained with its reasoning gone, without a word
    ("deepseek_r1", "reasoning", "refused: message 1 (assistant): deepseek_r1's template never renders its reasoning"),
    ("deepseek_r1", "reasoning in the content", "refused: message 1 (assistant): deepseek_r1's template never renders "
                                                "the think block of its content"),
    ("llama31", "reasoning", "refused: message 1 (assistant): llama31's template never renders its reasoning field"),
    ("llama31", "reasoning in the content", "trains"), ("qwen25", "reasoning in the content", "trains"),
    ("qwen3", "reasoning in the content", "trains: 1 earlier reply's reasoning not rendered"),
    ("qwen3", "reasoning", "trains: 1 earlier reply's reasoning not rendered"),
    # gpt-oss writes a tool call's analysis until a final answer follows: the prefixes rendered it, the conversation
    # did not, and no turn was found (the row refused, its reason "no end-of-turn token"); now the history is read as
    # the conversation renders it: the call and the answer train, the analysis dropped is counted
    ("gpt_oss", "tool call with reasoning", "trains: 1 earlier reply's reasoning not rendered"),
    ("qwen3", "tool call with reasoning", "trains"),
    # a reply's text beside its calls, which Llama 3.1 / Mistral v0.3 drop (the call written alone): refused in one
    # line (it was a turn not located, counted, its reason "no end-of-turn token")
    ("llama31", "tool call with text", "refused: message 1 (assistant): llama31's template does not render a reply's "
                                       "text beside its tool calls"),
    ("qwen25", "tool call with text", "trains"),
    # item 5: an assistant turn first: the later turns train, the first is counted
    ("llama3", "assistant first", "trains 1 of 2: message 0: an assistant turn first"),
    # item 6: a reply holding its end-of-turn token's text is not trained (it would teach a stop inside it), counted
    ("qwen25", "end-of-turn text in a reply", "trains 1 of 2: message 3: its text holds the end-of-turn token's text"),
    ("chatml_generation", "end-of-turn text in a reply", "trains 1 of 2: message 3: its text holds the end-of-turn"),
    # OLMo 3's tool results come as the `environment` role, which its template renders (never supervised); a template
    # that drops the role refuses the row rather than train replies to a result the model never sees
    ("olmo3", "environment turn", "trains"), ("llama3", "environment turn", "trains"),
    ("qwen25", "environment turn", "refused: message 2 (environment): qwen25's template does not render the "
                                   "environment role"),
    # a system message's tool list: Phi-4-mini's template renders it (never supervised); one that drops it refuses
    # the row rather than train replies as if no tool had been offered
    ("phi4_mini", "tool definitions", "trains"),
    ("llama31", "tool definitions", "refused: message 0 (system): llama31's template does not render a message's "
                                    "`tools`"),
    # the row's top-level `tools` (OpenAI / TRL), passed as tools=: the families whose templates take them train the
    # call and the reply after it (the list in the ids, never supervised); a template that renders the same without
    # them refuses the row, never training a call to a function the model never saw defined
    ("llama31", "tool list", "trains"), ("llama32", "tool list", "trains"), ("qwen25", "tool list", "trains"),
    ("qwen3", "tool list", "trains"), ("mistral_v03", "tool list", "trains"), ("gpt_oss", "tool list", "trains"),
    ("qwen2", "tool list", "refused: tools ['count_words']: qwen2's template does not render a row's `tools`"),
    ("deepseek_r1", "tool list", "refused: tools ['count_words']: deepseek_r1's template does not render a row's"),
    ("granite33", "tool list", "refused: message 1 (assistant): granite33's template does not render its tool call"),
    # OpenAI's arguments (JSON text) through templates that `tojson` them: written once, as the object form is (the
    # oracle renders the object); before, encoded twice and trained so (WRONG: the ids are not the rendering)
    ("llama31", "arguments as JSON text", "trains"), ("qwen25", "arguments as JSON text", "trains"),
    ("mistral_v03", "arguments as JSON text", "trains"), ("gpt_oss", "arguments as JSON text", "trains"),
    ("qwen3", "arguments as JSON text", "trains"),
    # Hermes' tool_use closes a last tool result `</tool_response><|im_end|>`, one a reply follows with a newline
    # before the end-of-turn: the reply after a result is found by the generation prompt past that difference (before,
    # it was a turn not located, counted: the reply a tool-use row exists for, never trained)
    ("hermes_tool_use", "tool call", "trains"), ("hermes_tool_use", "tool list", "trains"),
    ("hermes_tool_use", "arguments as JSON text", "trains"),
    # a template that iterates `tools`, given none: refused in one line that names the fix
    ("command_r_tool_use", "multi-turn", "refused: command_r_tool_use's `tool_use` template refuses this conversation: "
                                         "'NoneType' object is not iterable (it renders only with a tool list: give "
                                         "the row's `tools`"),
    # 2025-26 templates byte for byte as shipped (`oracle`: their marked copies): <|im_sep|>, no tool role (Phi-4);
    # BOS then ChatML, calls written in the content (LFM2); the prompt <|assistant|>, the history's \n<think></think>
    # (GLM-4.6); no header after tool outputs (DeepSeek-V3.1); <|python_start|> calls (Llama 4); XML calls (Qwen3-Coder)
    ("phi4", "multi-turn", "trains"), ("phi4", "tool call", "refused: message 1 (assistant): phi4's template does not"),
    ("lfm2", "system", "trains"), ("lfm2", "tool list", "refused: message 1 (assistant): lfm2's template does not"),
    ("glm46", "tool call", "trains"), ("glm46", "reasoning", "trains: 1 earlier reply's"),
    ("deepseek_v31", "tool call", "trains"), ("deepseek_v31", "tool call with text", "trains"),
    ("deepseek_v31", "reasoning", "refused: message 1 (assistant): deepseek_v31's template never renders its reasoning"),
    ("llama4", "tool call", "trains"), ("llama4", "tool list", "trains"), ("llama4", "tool call with text", "trains"),
    ("qwen3_coder", "tool call", "trains"), ("qwen3_coder", "tool list", "trains"),
    # Gemma 4 renders a reply's thought channel only with tool calls after the last user turn: there it trains with
    # it; a plain reply's is refused with no content fix (data/chat_reasoning.py's second probe)
    ("gemma4", "tool call", "trains"), ("gemma4", "tool call with reasoning", "trains"),
    ("gemma4", "reasoning", "refused: message 1 (assistant): gemma4's template renders a reply's reasoning only on a "
                            "reply with tool calls"),
    # a reply's reasoning under OpenRouter's name `reasoning` reaches every template (data/chat_message.py)
    ("qwen3", "reasoning as `reasoning`", "trains: 1 earlier reply's"), ("gpt_oss", "reasoning as `reasoning`", "trains: 1"),
    ("glm46", "reasoning as `reasoning`", "trains: 1 earlier reply's"),
    ("llama31", "reasoning as `reasoning`", "refused: message 1 (assistant): llama31's template never renders its"),
    # Seed-OSS: the history's header `<seed:bos>assistant` with no newline, the prompt's with one; <seed:think> on
    # every reply; XML calls. Phi-4-reasoning ships its own markers and its own system prompt: a row's system
    # message is never rendered, so its replies would train without the instructions they answer (they trained)
    ("seed_oss", "multi-turn", "trains"), ("seed_oss", "reasoning", "trains"), ("seed_oss", "tool call", "trains"),
    ("seed_oss", "tool call with text", "trains"), ("seed_oss", "tool list", "trains"),
    ("phi4_reasoning", "multi-turn", "trains"), ("phi4_reasoning", "reasoning in the content", "trains"),
    ("phi4_reasoning", "system", "refused: message 0 (system): phi4_reasoning's template does not render a system "
                                 "message"),
    ("mistral_v03", "system", "refused: none of the 2 assistant turn(s)"),  # rendered in the last user turn: not lost
    # Mistral Small 3.2 (tekken v11): [SYSTEM_PROMPT], no generation prompt, [TOOL_CALLS]NAME[CALL_ID]ID[ARGS] calls
    # written alone; Granite 4.0: Hermes-style <tool_call> JSON after the reply's text, results in a user turn
    ("mistral_small32", "system", "trains"), ("mistral_small32", "tool call", "trains"),
    ("mistral_small32", "tool list", "trains"), ("mistral_small32", "arguments as JSON text", "trains"),
    ("mistral_small32", "tool call with text", "refused: message 1 (assistant): mistral_small32's template does not "
                                               "render a reply's text beside its tool calls"),
    ("granite4", "system", "trains"), ("granite4", "tool call", "trains"), ("granite4", "tool list", "trains"),
    ("granite4", "tool call with text", "trains"), ("granite4", "arguments as JSON text", "trains"),
    # MiniMax-M2: the prompt's <think>\n is not in the history (a reply after ]~b]ai\n); Nemotron Nano v2: the last
    # reply after the prompt's <think>\n, whole, a reply of calls alone from its <TOOLCALL>'s `<`; Apertus: the answer
    # after a tool result has no header; Command R7B: <|END_OF_TURN_TOKEN|> after <|END_RESPONSE|> trained (its stop)
    ("minimax_m2", "multi-turn", "trains"), ("minimax_m2", "tool call", "trains"),
    ("minimax_m2", "reasoning", "trains: 1 earlier reply's"), ("minimax_m2", "tool call with text", "trains"),
    ("nemotron_nano2", "multi-turn", "trains"), ("nemotron_nano2", "tool call with text", "trains"),
    ("nemotron_nano2", "reasoning in the content", "refused: message 1 (assistant): nemotron_nano2's template writes "
                                                   "its own <think>"),
    ("nemotron_nano2", "tool call", "trains"), ("nemotron_nano2", "tool list", "trains"),
    ("apertus", "multi-turn", "trains"), ("apertus", "tool call", "trains 1 of 2: message 3: the conversation does not"),
    # Apertus-2509 reads a definition's function object (tool.name): the row's OpenAI form was refused in every form
    # (the raw Jinja error); now given the plain form (data/chat_tools.py), the call trains as without tools
    ("apertus", "tool list", "trains 1 of 2: message 3: the conversation does not"),
    ("command_r7b", "multi-turn", "trains"), ("command_r7b", "system", "trains"),
    ("command_r7b_tool_use", "tool call", "trains"), ("command_r7b_tool_use", "tool list", "trains"),
    # Apriel-1.6 writes `reply\n<|end|>\n` only when a message follows (or with training_prompt true): the earlier reply
    # was trained without its `\n<|end|>` (WRONG: supervised in part), uncounted; the last one has no stop unless the row
    # sets training_prompt (counted, no_stop_rows: tests/unit/data/test_chat_locate.py)
    ("apriel16", "multi-turn", "trains"), ("apriel16", "system", "trains"), ("apriel16_training", "multi-turn", "trains"),
    ("apriel16", "end-of-turn text in a reply", "trains 1 of 2: message 3: its text holds"),
])
def test_issue_47_cases(table, family, case, want):
    assert table[family][case].startswith(want), table[family][case]


@pytest.mark.parametrize("family", ["chatml_generation", "phi4_reasoning"])
def test_an_opening_reply_trains_under_generation_markers(table, family):
    """Under {% generation %} markers a conversation's opening assistant turn trains its marked run (cut by the prompt
    a later turn gives), as in Hugging Face's assistant mask: it was left untrained once the generation prompt before
    each run was cut (no messages before it to render that prompt from)."""
    assert table[family]["assistant first"] == "trains", table[family]["assistant first"]


def test_the_docs_table_is_the_sweeps(table):
    """docs/sft.md holds `python -m data.chat_sweep --markdown` as it prints now."""
    with open("docs/sft.md") as fh:
        assert markdown(table) in fh.read(), "regenerate: python -m data.chat_sweep --markdown"
    assert len(CASES) == 15


# Facts read in the families' own templates as stored in public repositories (families.json `checked`), each one a
# place where the template written here from memory rendered something else before it was compared.
_CALL = {"type": "function", "function": {"name": "count_words", "arguments": '{"text": "apple river"}'}}
_TOOL = [{"role": "user", "content": "How many?"}, {"role": "assistant", "content": "", "tool_calls": [_CALL]},
         {"role": "tool", "content": "2"}, {"role": "assistant", "content": "2 words"}]
_DEF = {"type": "function", "function": {"name": "count_words", "description": "Count the words.", "parameters": {
    "type": "object", "properties": {"text": {"type": "string", "description": "The text"}}, "required": ["text"]}}}
_DICT_ARGS = {**_TOOL[1], "tool_calls": [{**_CALL, "function": {**_CALL["function"], "arguments": {"text": "apple river"}}}]}


def _render(key: str, conv: list[dict], **kw) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    fam = families()[key]
    out, _ = render_jinja_template(conversations=[conv], chat_template=as_shipped(fam),
                                   bos_token=fam.get("bos") or "", eos_token=fam["eos"], **kw)
    return out[0]


@pytest.mark.parametrize("family,conv,want,kw", [
    # llama.cpp's Llama-3.1-8B / 3.2-3B / 3.3-70B: a tool result goes through tojson (a string is iterable): quoted
    ("llama31", _TOOL, '<|start_header_id|>ipython<|end_header_id|>\n\n"2"<|eot_id|>', {}),
    ("llama32", _TOOL, '<|start_header_id|>ipython<|end_header_id|>\n\n"2"<|eot_id|>', {}),
    # huggingface.js's zephyr-7b-beta renders system, user and assistant messages only: a tool result vanishes
    ("zephyr", _TOOL, "<|assistant|>\n</s>\n<|assistant|>\n2 words</s>\n", {}),
    # llama.cpp's granite-3.3-2B: the default system prompt's sentences joined by spaces (3.2's by newlines)
    ("granite33", _TOOL[:1], "<|end_of_role|>Knowledge Cutoff Date: April 2024. Today's Date: ", {}),
    ("granite3", _TOOL[:1], "<|end_of_role|>Knowledge Cutoff Date: April 2024.\nToday's Date: ", {}),
    # huggingface.js's DeepSeek-R1: system prompts joined by a blank line; a later message's calls get no header
    ("deepseek_r1", [{"role": "system", "content": "A."}, {"role": "system", "content": "B."}] + _TOOL[:1],
     "<｜begin▁of▁sentence｜>A.\n\nB.<｜User｜>", {}),
    ("deepseek_r1", _TOOL + [{"role": "user", "content": "Again?"}, {**_TOOL[1], "content": None}],
     "<｜User｜>Again?\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>count_words", {}),
    # huggingface.js ollama-utils' deepseek-v3:671b (V3's own): calls only when the content is None, a lone first call
    # with no end of turn, a newline before a later tool output; an empty-string content drops the calls
    ("deepseek_v3", _TOOL, "<｜Assistant｜><｜end▁of▁sentence｜><｜tool▁outputs▁begin｜>", {}),
    ("deepseek_v3", [_TOOL[0], {**_TOOL[1], "content": None}, _TOOL[2], _TOOL[2]],
     "```<｜tool▁call▁end｜><｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>2<｜tool▁output▁end｜>\n<｜tool▁output▁begin｜>", {}),
    # huggingface.js's c4ai-command-r-v01 (JSON Schema) `tool_use`: tools as Python stubs; calls as an Action: list
    # with no end of turn; a tool result as a system turn in <results>
    ("command_r_tool_use", _TOOL[:1], '```python\ndef count_words(text: str) -> List[Dict]:\n    """Count the words.\n\n'
     '    Args:\n        text (str): The text\n    """\n    pass\n```<|END_OF_TURN_TOKEN|>', {"tools": [_DEF]}),
    ("command_r_tool_use", [_TOOL[0], _DICT_ARGS, _TOOL[2]], '<|CHATBOT_TOKEN|>\nAction:\n```json\n[\n    {\n        '
     '"tool_name": "count_words",\n        "parameters": {\n            "text": "apple river"\n        }\n    }\n]```\n'
     '<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|><results>\n2</results><|END_OF_TURN_TOKEN|>', {"tools": [_DEF]}),
    # gorilla's and huggingface.js ollama-utils' Phi-4-mini: a system message's tools between <|tool|> and <|/tool|>
    ("phi4_mini", [{"role": "system", "content": "Be terse.", "tools": '[{"name": "count_words"}]'}] + _TOOL[:1],
     '<|system|>Be terse.<|tool|>[{"name": "count_words"}]<|/tool|><|end|><|user|>How many?<|end|>', {}),
    # open-instruct's `olmo` template (OLMo 3): its own default system prompt; an OpenAI tool call is not rendered
    ("olmo3", _TOOL[:1], "<|im_start|>system\nYou are OLMo, a helpful function-calling AI assistant built by Ai2.", {}),
    ("olmo3", _TOOL[:2], "<|im_start|>assistant\n<|endoftext|>", {}),
    # llama.cpp's openai-gpt-oss-120b: the developer message ends with a blank line
    ("gpt_oss", [{"role": "system", "content": "You are terse."}, _TOOL[0]],
     "<|start|>developer<|message|># Instructions\n\nYou are terse.\n\n<|end|>", {}),
    # llama.cpp's mistralai 'v3' template: calls with their ids, no space, then the EOS; a result's content unquoted
    ("mistral_v03", [_TOOL[0], {**_TOOL[1], "tool_calls": [{**_CALL, "id": "call00001", "function": {
        **_CALL["function"], "arguments": {"text": "apple river"}}}]}, {**_TOOL[2], "tool_call_id": "call00001"}, _TOOL[3]],
     '[/INST][TOOL_CALLS] [{"name": "count_words", "arguments": {"text": "apple river"}, "id": "call00001"}]</s>'
     '[TOOL_RESULTS] {"content": 2, "call_id": "call00001"}[/TOOL_RESULTS] 2 words</s>', {}),
    # the row's tool list (tools=), as each family's own template writes it (families.json `checked`): Qwen2.5 after
    # its default system prompt, one JSON definition a line; Qwen3 with no default prompt; Llama 3.1 in the first
    # user turn, indented by 4; Mistral v0.3 before the last user turn; Granite 3.3 in an available_tools turn;
    # gpt-oss as a TypeScript namespace in the developer message
    ("qwen25", _TOOL[:1], "You are a helpful assistant.\n\n# Tools\n\nYou may call one or more functions to assist "
     'with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{"'
     'type": "function", "function": {"name": "count_words", ', {"tools": [_DEF]}),
    ("qwen3", _TOOL[:1], "<|im_start|>system\n# Tools\n\nYou may call", {"tools": [_DEF]}),
    ("llama31", _TOOL[:1], 'Environment: ipython\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n<|'
     'eot_id|><|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, please respond with a JSON '
     'for a function call with its proper arguments that best answers the given prompt.\n\nRespond in the format {"'
     'name": function name, "parameters": dictionary of argument name and its value}.Do not use variables.\n\n{\n    '
     '"type": "function",\n    "function": {\n        "name": "count_words",', {"tools": [_DEF]}),
    ("llama31", _TOOL[:1], '"required": [\n                "text"\n            ]\n        }\n    }\n}\n\nHow many?'
     '<|eot_id|>', {"tools": [_DEF]}),
    ("mistral_v03", [_TOOL[0], {"role": "assistant", "content": "2"}, {"role": "user", "content": "Sure?"}],
     '[INST] How many?[/INST] 2</s>[AVAILABLE_TOOLS] [{"type": "function", "function": {"name": "count_words", '
     '"description": "Count the words.", "parameters": {"type": "object", "properties": {"text": {"type": "string", '
     '"description": "The text"}}, "required": ["text"]}}}][/AVAILABLE_TOOLS][INST] Sure?[/INST]', {"tools": [_DEF]}),
    ("granite33", _TOOL[:1], "You are Granite, developed by IBM. You are a helpful assistant with access to the "
     "following tools. When a tool is required to answer the user's query, respond only with <|tool_call|> followed "
     'by a JSON list of tools used. If a tool does not exist in the provided list of tools, notify the user that you do'
     ' not have the ability to fulfill the request.<|end_of_text|>\n<|start_of_role|>available_tools<|end_of_role|>[\n'
     '    {\n        "type": "function",', {"tools": [_DEF]}),
    ("gpt_oss", _TOOL[:1], "Calls to these tools must go to the commentary channel: 'functions'.<|end|><|start|>"
     "developer<|message|># Tools\n\n## functions\n\nnamespace functions {\n\n// Count the words.\ntype count_words ="
     " (_: {\n// The text\ntext: string,\n}) => any;\n\n} // namespace functions<|end|><|start|>user", {"tools": [_DEF]}),
    # Raudbjorn/ggml-llama.cpp's Mistral-Small-3.2-24B-Instruct-2506: a call as [TOOL_CALLS]NAME[CALL_ID]ID[ARGS], the
    # EOS after it; a result [TOOL_RESULTS]ID[TOOL_CONTENT]; its own system prompt where none is given
    ("mistral_small32", [_TOOL[0], {**_DICT_ARGS, "tool_calls": [{**_DICT_ARGS["tool_calls"][0], "id": "call00001"}]},
                         {**_TOOL[2], "tool_call_id": "call00001"}],
     '[/INST][TOOL_CALLS]count_words[CALL_ID]call00001[ARGS]{"text": "apple river"}</s>[TOOL_RESULTS]call00001'
     '[TOOL_CONTENT]2[/TOOL_RESULTS]', {}),
    ("mistral_small32", _TOOL[:1], "<s>[SYSTEM_PROMPT]You are Mistral Small 3, a Large Language Model", {}),
    # its ibm-granite-granite-4.0: Hermes-style calls after the text, a result in a user turn, a default system prompt
    ("granite4", [_TOOL[0], _DICT_ARGS, _TOOL[2]], '<|start_of_role|>assistant<|end_of_role|><tool_call>\n{"name": '
     '"count_words", "arguments": {"text": "apple river"}}\n</tool_call><|end_of_text|>\n<|start_of_role|>user<|end_of'
     '_role|>\n<tool_response>\n2\n</tool_response><|end_of_text|>', {}),
    ("granite4", _TOOL[:1], "<|start_of_role|>system<|end_of_role|>You are a helpful assistant. Please ensure", {}),
])
def test_what_the_families_own_templates_render(family, conv, want, kw):
    assert want in _render(family, conv, **kw)


def test_llama32_takes_todays_date_and_deepseek_refuses_arguments_not_a_string():
    import datetime

    today = datetime.datetime.now().strftime("%d %b %Y")
    assert f"Today Date: {today}\n" in _render("llama32", _TOOL[:1])  # llama.cpp's Llama-3.2-3B: strftime_now
    assert "Today Date: 26 Jul 2024\n" in _render("llama31", _TOOL[:1])
    call = {**_CALL, "function": {**_CALL["function"], "arguments": {"text": "apple river"}}}
    with pytest.raises(Exception, match="JSON string"):  # R1's template concatenates them: a dict cannot render
        _render("deepseek_r1", [_TOOL[0], {**_TOOL[1], "tool_calls": [call]}])


def test_every_template_written_from_memory_names_what_it_was_checked_against():
    fams = families()
    for key in ("llama31", "llama32", "qwen3", "gemma3", "granite3", "granite33", "deepseek_v3", "deepseek_r1",
                "zephyr", "vicuna", "mistral_v03", "hermes_tool_use"):
        assert fams[key].get("checked"), key


def test_tool_definitions_are_never_supervised_and_never_dropped(tmp_path):
    """Phi-4-mini's tool list is in the ids and out of the mask; the ChatML default (no template) renders none, so a
    row with one is refused in one line, as a template that drops it is (the sweep's `tool definitions` cells)."""
    from data.chat import ChatEncoder, RowError
    from data.chat_sweep import build_tokenizer
    from data.tokenizer import Tokenizer
    from tests.unit.data.chat_fixtures import build_tokenizer as fixture_tokenizer

    conv = CASES["tool definitions"]
    tok = Tokenizer(build_tokenizer(str(tmp_path), "phi4_mini", families()["phi4_mini"]))
    ids, mask, _ = ChatEncoder(tok).encode({"messages": conv})
    text, trained = tok.hf.decode(ids), tok.hf.decode([i for i, m in zip(ids, mask) if m])
    assert "<|tool|>" + conv[0]["tools"] + "<|/tool|>" in text and "count_words" not in trained
    default = ChatEncoder(Tokenizer(fixture_tokenizer(str(tmp_path / "fx"), "none")))
    with pytest.raises(RowError, match=r"message 0 \(system\): the ChatML default does not render a message's `tools`"):
        default.encode({"messages": conv})


def test_the_templates_kept_as_shipped_are_the_shipped_text():
    """The 2026 additions are their templates byte for byte (families.json `oracle` beside each): Llama 4's is
    transformers' processor template; the rest as the stored llama.cpp fork holds them (their lengths, read there)."""
    from transformers.models.llama4 import processing_llama4

    fams = families()
    assert as_shipped(fams["llama4"]) == processing_llama4.chat_template
    sizes = {"lfm2": 1349, "glm46": 3374, "deepseek_v31": 3357, "qwen3_coder": 6148, "gemma4": 16448,
             "seed_oss": 7705, "phi4_reasoning": 1658, "mistral_small32": 6704, "granite4": 6418, "minimax_m2": 6482,
             "nemotron_nano2": 5496, "apertus": 14120, "command_r7b": 12784, "command_r7b_tool_use": 11420,
             "apriel16": 8091}
    assert {k: len(as_shipped(fams[k]).encode()) for k in sizes} == sizes
    assert "{{'<|im_start|>assistant<|im_sep|>' + message['content'] + '<|im_end|>'}}" in as_shipped(fams["phi4"])


# DeepSeek-V3.2's way (llama.cpp's models/templates/deepseek-ai-DeepSeek-V3.2.jinja, thinking off): the history writes
# `<｜Assistant｜></think>` before a reply, the generation prompt `<｜Assistant｜><think></think>`
_V32 = ("{% for m in messages %}{% if m.role == 'user' %}<｜User｜>{{ m.content }}{% else %}<｜Assistant｜></think>"
        "{{ m.content }}{% for c in m.tool_calls or [] %}<｜tool▁calls▁begin｜>{{ c.function.name }}"
        "{{ c.function.arguments | tojson }}<｜tool▁calls▁end｜>"
        "{% endfor %}<｜end▁of▁sentence｜>{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<｜Assistant｜><think></think>{% endif %}")


def test_a_reply_of_calls_alone_is_not_trained_from_a_token_the_prompt_holds(tmp_path):
    """A reply with text is not located there (its text does not follow the header); one of tool calls alone has no
    text to check, and was trained from the history's `</think>`, a token the model never writes after its prompt."""
    from transformers import AutoTokenizer

    from data.chat import ChatEncoder, RowError
    from data.chat_sweep import build_tokenizer
    from data.tokenizer import Tokenizer

    path = build_tokenizer(str(tmp_path), "deepseek_v31", families()["deepseek_v31"])
    hf = AutoTokenizer.from_pretrained(path)
    hf.chat_template = _V32
    hf.save_pretrained(path)
    enc = ChatEncoder(Tokenizer(path))
    for conv in (CASES["multi-turn"][:2], CASES["tool call"][:2]):
        with pytest.raises(RowError, match="could be located"):
            enc.encode({"messages": conv})



def test_named_templates_kept_as_shipped_reach_the_tokenizer_verbatim(tmp_path):
    """Command R7B's two named templates (`files`): the tokenizer carries each file byte for byte, not its marked copy
    with the markers taken out."""
    from transformers import AutoTokenizer

    from data.chat_sweep import HERE, build_tokenizer

    fam = families()["command_r7b"]
    got = AutoTokenizer.from_pretrained(build_tokenizer(str(tmp_path), "command_r7b", fam)).chat_template
    for name, path in fam["files"].items():
        with open(f"{HERE}/{path}") as fh:
            assert got[name] == fh.read()
