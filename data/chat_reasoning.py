"""A reply's reasoning, and the templates that drop it (data/chat.py).

Reasoning reaches a template two ways: a reply's `reasoning_content` / `thinking` / `reasoning` field (vLLM's and
Qwen3's name, gpt-oss's, OpenRouter's; data/chat_message.py gives the template the text under all three), or the content's `<think>...</think>` block (OpenThoughts, s1K,
Mixture-of-Thoughts rows), or its text before a `</think>` with no `<think>` where the template reads it so (R1-style
`reasoning</think>answer`: `think_parts`). Given twice (a field and a content block) it is refused (`both`).
Templates treat them three ways, read in their stored copies:
- they render it (Qwen3, gpt-oss; any template that prints the content verbatim renders a think block as text);
  a template with a place of its own for the field that prints a content think block as answer text (gpt-oss: the
  field in its analysis channel, the block inside the final one) refuses the content form in one line (`as_text`);
- they render it only for the replies after the last user turn, as at inference (Qwen3, gpt-oss: the history's
  reasoning dropped): those replies train without it, counted (`dropped_reasoning`) and warned in the summary;
- they never render it (every template with no reasoning branch drops the field; DeepSeek-R1's cuts the content at
  `</think>` in every reply): the row would train its answers with the reasoning gone, a model that stops thinking,
  without a word. Refused in one line with the fix (the reasoning in the content for a template that prints it, a
  template that renders it), as a template that drops a row's tools is (data/chat_tools.py).
Which way is read once per template and form, from a probe conversation whose last reply carries reasoning (the
way every template renders it, if it renders it at all); where a plain reply's does not render, a second probe gives
the reply a tool call and a tool list (Gemma 4 renders its thought channel only there: a reply with calls trains
with it, one without is refused with no content fix). The count reads each trained span's own tokens, never the
conversation's text. Cost: two probe renders per encoder (two more where a plain reply drops it, one more for the
first bare `</think>`); a row without reasoning pays nothing.
"""

from __future__ import annotations

import re

from data.chat_rows import REASONING, RowError, unicode_form

FIELDS = REASONING  # a row gives one name; data/chat_message.py sets each
_ASK = {"role": "user", "content": "Probe question?"}
_WHY = "Probe reasoning, step by step."
_PROBE_CALL = {"id": "call00001", "type": "function", "function": {"name": "probe", "arguments": {"q": "x"}}}
_PROBE_TOOLS = [{"type": "function", "function": {"name": "probe", "description": "Probe", "parameters": {
    "type": "object", "properties": {"q": {"type": "string", "description": "q"}}, "required": ["q"]}}}]


def reasoning(msg: dict, enc=None) -> tuple[str, str] | None:
    """(form, text) of a reply's reasoning: `field` (reasoning_content / thinking / reasoning) or `content` (its leading
    think block, `think_parts`); None where it has none. `enc`: the encoder, whose template may open the block itself
    (R1-style `reasoning</think>answer`); None: a block only where the content opens it."""
    if given := field_of(msg):
        return "field", given[1]
    text = think_parts(enc, msg.get("content") or "")[0]
    return ("content", text) if text else None


def field_of(msg: dict) -> tuple[str, str] | None:
    """(name, text) of a reply's non-empty reasoning field (reasoning_content / thinking / reasoning), None without."""
    return next(((f, msg[f].strip()) for f in FIELDS if isinstance(msg.get(f), str) and msg[f].strip()), None)


def split_think(content: str, bare: bool = False) -> tuple[str | None, str]:
    """(the leading think block's text or None, the rest: the reply's answer) of a content. A block is `<think>` at the
    start (past blanks) up to the first `</think>`; with `bare` (the template opens the block itself) and no `<think>`
    in the content, the text up to the first `</think>` (R1-style `reasoning</think>answer`). Any other `</think>` is
    the answer's text (quoted in coding or distillation data: `s.split('</think>')`): templates that cut at the first
    or last one (Qwen3, DeepSeek-R1 and -V3.1, GLM-4.6 / 4.7, MiniMax-M2) lost or rewrote it without a word (the span
    check compared only the part past the last one, their own cut); data/chat_locate.shows wants this answer whole."""
    s = content.lstrip()
    if s.startswith("<think>") and "</think>" in s:
        block, _, rest = s[len("<think>"):].partition("</think>")
        return block.strip(), rest.strip()
    if bare and "<think>" not in content and "</think>" in content:
        block, _, rest = content.partition("</think>")
        return block.strip(), rest.strip()
    return None, content.strip()


def think_parts(enc, content: str) -> tuple[str | None, str]:
    """`split_think` for `enc` (None: no encoder): a content with `</think>` and no `<think>` is reasoning</think>answer
    where the template reads it so: it opens the block itself, in its generation prompt (DeepSeek-R1, GLM-4.7,
    MiniMax-M2, Nemotron Nano v2) or before every content (Kimi-K2-Thinking's `<think></think>`: refused,
    `refuse_dropped`), or it renders such a last reply's text before `</think>` inside its own think block (`reads_bare`:
    Qwen3, QwQ, GLM-4.6, which take `content.split('</think>')[0]` as the reasoning, as TRL trains it). Read once per
    encoder, only for such a content."""
    bare = enc is not None and enc.kind != "chatml" and "</think>" in content and "<think>" not in content
    if bare and "bare" not in enc.reasoning_renders:
        enc.reasoning_renders["bare"] = _opens(enc) or reads_bare(enc) or bool(
            _renders(enc, "content") and enc.reasoning_renders.get("nests"))
    return split_think(content, bare and enc.reasoning_renders["bare"])


def reads_bare(enc) -> bool:
    """Whether `enc`'s template renders a last reply `reasoning</think>answer` (no `<think>`: R1's, its distills', QwQ's
    and Qwen3-Thinking's raw output, their prompt opening the block) with the reasoning inside a think block of its
    own before the answer (Qwen3's `<think>\nreasoning\n</think>\n\nanswer`, GLM-4.6's `\n<think>reasoning</think>\nanswer`).
    A template that prints the content verbatim writes no `<think>` before it. Read once per encoder (a render)."""
    cache = enc.reasoning_renders
    if "reads bare" not in cache:
        cache["reads bare"] = False
        reply = {"role": "assistant", "content": f"{_WHY}</think>Probe answer."}
        seen = re.compile(r"<think>\s*" + re.escape(_WHY) + r"\s*</think>\s*Probe answer\.")
        for msgs, tools in (([_ASK, reply], None), ([{"role": "system", "content": "Probe system."}, _ASK, reply],
                                                     None), ([_ASK, reply], [])):
            try:
                text = enc._text(msgs, tools=tools)
            except RowError:
                continue
            cache["reads bare"] = bool(seen.search(text[text.index(_ASK["content"]):]))
            break
    return cache["reads bare"]


def marked(enc, msg: dict) -> tuple[str, str] | None:
    """("lead", text) where a reply's content opens with a `<think>...</think>` block (empty included: `text` ""),
    ("bare", text) where it is reasoning</think>answer as `enc`'s template reads it (`think_parts`) and the reply has
    no reasoning field, or one whose text the text before `</think>` holds (given twice: `both`); None otherwise (with
    a field, Qwen3 / GLM-4.6 print the content as written: a quoted `</think>` is the answer's). What a template with
    a place or a block of its own would render beside it (`refuse_dropped`)."""
    content = msg.get("content")
    if not isinstance(content, str) or "</think>" not in content:
        return None
    block = think_parts(enc, content)[0]
    field = (field_of(msg) or (None, None))[1]
    if block is None or not content.lstrip().startswith("<think>") and field and unicode_form(
            field) not in unicode_form(block) and not (block.strip() and unicode_form(block.strip()) in unicode_form(field)):
        return None  # (a bare block that is part of the field: given twice too)
    return ("lead" if content.lstrip().startswith("<think>") else "bare"), block


def quoted_close(enc, msg: dict) -> bool:
    """Whether a reply's answer (past its leading think block) holds `</think>` as text (`split_think`)."""
    content = msg.get("content") or ""
    return "</think>" in content and "</think>" in think_parts(enc, content)[1]


def cut_why(enc, conv: list[dict], k: int, text: str) -> str | None:
    """Why turn k was not found, where its answer quotes `</think>` and the conversation's text (`text`) does not hold
    that answer: the template cut it there. None otherwise (the turn failed for another reason)."""
    if not quoted_close(enc, conv[k]) or unicode_form(think_parts(enc, conv[k]["content"])[1]) in unicode_form(text):
        return None
    return (f"message {k}: its text holds `</think>` that is not a leading think block; {enc.name} cuts the reply "
            "there, so it would be trained with text lost or rewritten as reasoning: write the tag otherwise in the "
            "answer (`&lt;/think&gt;`), put reasoning only in a leading <think>...</think>, or use a template that "
            "prints the content verbatim")


def _renders(enc, form: str, calls: bool = False) -> bool | None:
    """Whether `enc`'s template renders a last reply's reasoning given as `form` (on a reply with a tool call, with a
    tool list, where `calls`: Gemma 4 renders its thought channel only there); None where the probe does not render
    (the template refuses it: nothing is known)."""
    cache = enc.reasoning_renders
    if calls:
        key = f"{form} calls"
        if key not in cache:
            cache[key] = None
            reply = {"role": "assistant", "content": "", "tool_calls": [_PROBE_CALL],
                     **(dict.fromkeys(REASONING, _WHY) if form == "field" else {"content": f"<think>\n{_WHY}\n</think>\n\n"})}
            try:
                cache[key] = _WHY in enc._text([_ASK, reply], tools=_PROBE_TOOLS)
            except RowError:
                pass
        return cache[key]
    if form not in cache:
        if enc.kind == "chatml":  # the token-built default: the content verbatim, no field
            cache[form] = form == "content"
        else:
            reply = ({"role": "assistant", "content": "Probe answer.", **dict.fromkeys(REASONING, _WHY)} if form == "field" else
                     {"role": "assistant", "content": f"<think>\n{_WHY}\n</think>\n\nProbe answer."})
            cache[form] = None
            for msgs, tools in (([_ASK, reply], None), ([{"role": "system", "content": "Probe system."}, _ASK, reply],
                                                         None), ([_ASK, reply], [])):  # Hermes' tool_use: a tool list
                try:
                    text = enc._text(msgs, tools=tools)
                except RowError:
                    continue
                cache[form] = _WHY in text
                cache[f"{form} tag"] = "<think>" in text[text.index(_ASK["content"]):]  # the tag written as text
                if form == "content":  # the template's own <think> before the content's (Nemotron-Nano-v2's last
                    # reply, Kimi-K2-Thinking's <think></think>): a block nested in a second opening
                    cache["nests"] = text[text.index(_ASK["content"]):].count("<think>") > 1
                break
    return cache[form]


def _opens(enc) -> bool:
    """Whether the template's generation prompt opens a think block (the reply then completes it)."""
    try:
        return enc._text([_ASK], gen=True).rstrip().endswith("<think>")
    except RowError:
        return False


def as_text(enc) -> bool:
    """Whether the template renders a reasoning field in a place of its own (gpt-oss's analysis channel: no <think> tag
    written) and prints a content think block as answer text (inside its final channel): OpenThoughts-shaped rows
    would teach it to write its reasoning to the user and never use the channel."""
    return bool(_renders(enc, "content") and _renders(enc, "field") and enc.reasoning_renders.get("content tag")
                and not enc.reasoning_renders.get("field tag"))


def calls_only(enc) -> bool:
    """Whether the template has a place of its own for reasoning on a reply with tool calls only (Gemma 4's thought
    channel) and prints the content verbatim: a reply's reasoning as answer text beside that place."""
    return enc.kind != "chatml" and _renders(enc, "field") is False and bool(
        _renders(enc, "content") and _renders(enc, "field", calls=True))


def bare_close(enc, msg: dict, k: int) -> None:
    """A RowError, one line, where a reply with no reasoning field has a content whose first `</think>` has no
    `<think>` before it and `enc`'s template has a place of its own for reasoning (`as_text`: gpt-oss, Seed-OSS,
    Apriel-1.6; `calls_only`: Gemma 4, for a reply with tool calls, where its thought channel is): a raw R1 completion
    (`reasoning</think>answer`, its block opened by R1's generation prompt) and a quoted tag (`s.split('</think>')`,
    after other answer text too) cannot be told apart, and either way it would train as answer text (R1's
    reasoning written to the user). Templates that print the content verbatim with no such place train it as text."""
    content = msg.get("content")
    if not isinstance(content, str) or "</think>" not in content or "<think>" in content.partition("</think>")[0]:
        return
    if field_of(msg) or not (
            as_text(enc) or msg.get("tool_calls") and calls_only(enc)):
        return  # (a reasoning field given: the content is the answer; Gemma 4's plain reply has no place: as text)
    where = "" if as_text(enc) else " on a reply with tool calls (the only replies it renders reasoning on; drop it elsewhere)"
    raise RowError(f"message {k} (assistant): its content holds `</think>` with no `<think>` before it, which "
                   f"{enc.name} would train as answer text: if the tag is quoted, write it otherwise (`&lt;/think&gt;`); "
                   "if the text before it is reasoning (an R1 completion), give it as the reply's thinking (or "
                   f"reasoning_content) field{where}")


def both(enc, msg: dict, k: int) -> None:
    """A RowError, one line, where a reply gives reasoning twice: a reasoning field and a content think block (leading,
    empty included, or reasoning</think>answer where the template reads it so and the text before `</think>` holds
    the field's: `marked`; any other `</think>` beside a field is the answer's). Templates render the field and print
    the content beside it: Qwen3 / GLM-4.6 trained two think blocks, gpt-oss the analysis channel and the block in its
    final one. The fix named keeps the form the template renders in a place of its own."""
    field = (field_of(msg) or (None, None))[0]
    mark = marked(enc, msg) if field else None
    if mark is None:
        return
    what = ("an empty <think></think>" if not mark[1] else "a <think>...</think> block") if mark[0] == "lead" else (
        "reasoning before its </think>")
    fix = ("drop the content's (the field is what the template renders as reasoning)" if _renders(enc, "field")
           else "drop the field (the template renders the content's)")
    quoted = "; a quoted `</think>` is written otherwise (`&lt;/think&gt;`)" if mark[0] == "bare" else ""
    raise RowError(f"message {k} (assistant): it gives reasoning twice, its {field} field and {what} in its content, "
                   f"and {enc.name} would train both: {fix}{quoted}")


def thoughts(enc, msg: dict, k: int) -> None:
    """A RowError, one line, where a reply is in OpenThoughts-114k's / Bespoke-Stratos' form (`<|begin_of_thought|>
    ...<|end_of_thought|>` then `<|begin_of_solution|>...`) and `enc`'s template has a place of its own for reasoning
    (Qwen3 wrote its empty think block, then the thoughts as answer text). A template without one trains the form as
    written, as those models were trained."""
    content = msg.get("content")
    if (isinstance(content, str) and "<|begin_of_thought|>" in content and "<|end_of_thought|>" in content
            and _renders(enc, "field")):
        raise RowError(f"message {k} (assistant): its content holds <|begin_of_thought|>...<|end_of_thought|> "
                       f"(OpenThoughts / Bespoke-Stratos), which {enc.name} would train as answer text beside its own "
                       "reasoning, left empty: give the thought as the reply's reasoning_content (or thinking) field "
                       "and the <|begin_of_solution|> text as its content")


def _closes(enc, conv: list[dict], k: int, tools: list | None) -> str | None:
    """The end of this row's generation prompt before reply k where it closes the think block (Nemotron Nano v2's
    `<think></think>` under a system prompt's /no_think); None where it does not (or does not render)."""
    try:
        head = enc._text(conv[:k], True, tools).rstrip()
    except RowError:
        return None
    return head[-24:] if head.endswith("</think>") else None


def refuse_dropped(enc, conv: list[dict], turns: list[int], tools: list | None = None) -> None:
    """A RowError, one line, where a reply to train carries reasoning in a form `enc`'s template never renders, or
    renders as answer text beside a place of its own for it (`as_text`), or might (`bare_close`), or twice (`both`).
    A content's think block counts empty too (`marked`): gpt-oss trained `<think>\n\n</think>` as answer text,
    Nemotron Nano v2 nested it. Cost: one render more for a last reply reasoning</think>answer on a template that
    opens the block (the row's own prompt: its /no_think closes it)."""
    for k in turns:
        bare_close(enc, conv[k], k)
        both(enc, conv[k], k)
        thoughts(enc, conv[k], k)
        got, mark = reasoning(conv[k], enc), marked(enc, conv[k])
        empty = "drop the empty <think></think> (a reply without reasoning)"
        if mark and mark[0] == "lead" and as_text(enc):
            raise RowError(f"message {k} (assistant): {enc.name} renders reasoning given as thinking / "
                           "reasoning_content in a place of its own, and the content's think block as answer text: " +
                           (empty if not mark[1] else "give the reasoning as the reply's thinking (or "
                            "reasoning_content) field"))
        if mark and _renders(enc, "content") and enc.reasoning_renders.get("nests"):
            opens = _opens(enc)  # the block opened by the generation prompt (Nemotron-Nano-v2's): reasoning</think>answer
            if opens and mark[0] == "bare":
                if k < len(conv) - 1 or (shut := _closes(enc, conv, k, tools)) is None:
                    continue  # (an earlier reply is written past its </think>)
                raise RowError(f"message {k} (assistant): this row's generation prompt closes the think block (it ends "
                               f"{shut!r}: /no_think in the system prompt, or a switch off), so {enc.name} would train "
                               "the reasoning before `</think>` after it: drop the /no_think, or the reasoning and its "
                               "`</think>`")
            fix = ("give the content as reasoning</think>answer (the template opens the block), " if opens else
                   "give it as reasoning_content where the template renders that field, ")
            if not mark[1]:
                fix = empty[:-1] + ("; /no_think in the system prompt makes the template write its own), " if
                                    "/no_think" in (enc.template or "") else "), ")
            raise RowError(f"message {k} (assistant): {enc.name} writes its own <think> before a reply, so the "
                           f"content's think block would be trained nested in a second one: {fix}use a template "
                           "that renders it, or drop the reasoning")
        if got and _renders(enc, got[0]) is False:
            on_calls = enc.kind != "chatml" and _renders(enc, got[0], calls=True)
            if on_calls and conv[k].get("tool_calls"):
                continue  # rendered on a reply with calls (Gemma 4's thought channel): trained with it, or counted
            if on_calls:  # its content form, if printed, would be answer text beside that channel
                raise RowError(f"message {k} (assistant): {enc.name} renders a reply's reasoning only on a reply with "
                               "tool calls, so this reply would be trained with its reasoning gone: drop the reasoning "
                               "of replies without calls, or use a template that renders it (Qwen3, gpt-oss, ...)")
            given = "its reasoning field (reasoning_content / thinking / reasoning)" if got[0] == "field" else (
                "the think block of its content (cut at </think>, as DeepSeek-R1's template does)")
            tags = ("[THINK]", "[/THINK]") if "[THINK]" in (enc.template or "") else ("<think>", "</think>")
            fix = (f"put the reasoning in the content as {tags[0]}...{tags[1]} where the template prints the content, "
                   if got[0] == "field" else "")  # Magistral's own tags (its template writes thinking parts so)
            if fix and _renders(enc, "content") and enc.reasoning_renders.get("nests") and _opens(enc):
                fix = "give the content as reasoning</think>answer (the template opens the block), "  # Nemotron-Nano-v2
            # trl/chat_templates/deepseek_r1_distill_training.jinja (TRL 1.16.0) prints the content whole; its <think>\n
            # is the generation prompt's, untrained (data/chat_locate.prompt_cut), the reasoning and answer trained
            trl = ("for a DeepSeek-R1-Distill model, TRL's deepseek_r1_distill_training.jinja as the tokenizer's "
                   "chat_template, which prints the content whole; " if got[0] == "content" else "")
            raise RowError(f"message {k} (assistant): {enc.name} never renders {given}, so the reply would be trained "
                           f"with its reasoning gone: {fix}use a template that renders it ({trl}Qwen3, gpt-oss, ...), or "
                           "drop the reasoning")


def as_rendered(enc, conv: list[dict], tools: list | None) -> list[dict]:
    """The conversation with the reasoning its full render drops taken out of those replies, where the render stays
    the same: what the prefix renders (data/chat.py `_prefix`) must show of the history. A template that renders a
    reply's reasoning only while no later message overrides it (gpt-oss writes a tool call's analysis until a final
    answer follows) otherwise renders each prefix with it and the whole conversation without it, and no later turn
    is found. Cost: a text search per reply with reasoning, one render more where some is taken out."""
    if enc.kind == "chatml" or not any(reasoning(m, enc) for m in conv):
        return conv
    text = enc._text(conv, tools=tools)
    out = list(conv)
    for k, m in enumerate(conv):
        got = reasoning(m, enc) if m["role"] == "assistant" else None
        if got and got[1] not in text and not (got[0] == "content" and quoted_close(enc, m)):  # (that one: the
            # span must show its answer whole, `</think>` and all: not found, said by cut_why)
            out[k] = ({x: v for x, v in m.items() if x not in FIELDS} if got[0] == "field" else
                      {**m, "content": think_parts(enc, m["content"])[1]})
    if out == conv:
        return conv
    try:
        return out if enc._text(out, tools=tools) == text else conv
    except RowError:
        return conv


def dropped(enc, ids: list[int], spans: dict[int, tuple[int, int]], conv: list[dict]) -> int:
    """How many trained replies carry reasoning their span does not show (the template drops the history's, as
    Qwen3's and gpt-oss's do before the last user turn)."""
    n = 0
    for k, (a, b) in spans.items() if enc.kind != "chatml" else ():  # the default prints the content, no field
        got = reasoning(conv[k], enc)
        if got and unicode_form(got[1]) not in unicode_form(enc.tok.hf.decode(ids[max(a - 1, 0):b],
                                                                             clean_up_tokenization_spaces=False)):
            n += 1
    return n
