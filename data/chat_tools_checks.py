"""Whether a chat template renders what a tool row's replies depend on (data/chat_tools.py reads the row's tools;
data/chat.py calls `refuse_unrendered` on every row with tool turns, a system message or tool definitions).

Dropped, the replies would be trained on a result the model never sees, or as if no tool had been offered: a row's
`tools` a template renders the same with and without (Llama 3.0, Qwen2, Phi-3, ... take no tool list), a message's
`tools` / `functions` (Phi-4-mini's, OLMo 3's), an `environment` turn (OLMo 3's tool results), a tool result, a
call, a reply's text beside its call, a system message: each such row is refused in one line naming the message
and the fix (the tokenizer's own `tool_use` template where it ships one: `tool_use_fix`). Each check is a render
with the thing marked or removed, compared with the row's own render.
"""

from __future__ import annotations

from data.chat_rows import RowError


def tool_names(tools: list) -> list[str]:
    """The functions' names of a tool list (row_tools' checked form)."""
    return [t.get("function", t)["name"] for t in tools]


def defs(m: dict) -> list[str]:
    """The keys of a message that hold tool definitions (data/chat_message.py ROLE_KEYS), where given."""
    return [k for k in ("tools", "functions") if m.get(k) is not None]


def call_name(call: dict) -> str:
    """A tool call's function name (OpenAI `{"function": {"name": ...}}` or a bare `{"name": ...}`)."""
    fn = call.get("function", call) if isinstance(call, dict) else {}
    return str(fn.get("name", "")) if isinstance(fn, dict) else ""


def refuse_unrendered(enc, conv: list[dict], tools: list | None, turns: list[int] | None = None,
                      whole: bool = False) -> None:
    """A RowError, one line, where `enc`'s template drops what the replies depend on: the row's `tools`, an
    `environment` message (OLMo 3's tool results; Qwen2.5's template, for one, renders `tool` and skips other
    roles) or a message's `tools` / `functions` (only Phi-4-mini's and OLMo 3's templates read them there).
    Dropped, the replies would be trained on a result the model never sees, or as if no tool had been offered.
    The ChatML default (no template) renders none of them, nor any tool call: one in a prompt the row does not train
    (a prompt / completion's) was dropped while the completion trained on its result. `whole`: every token trains
    (`--loss_on all`), so a system message the conversation's render drops refuses the row even where the template
    writes it when a user turn is last (Mistral v0.3; the other paths' locate step refuses it, no turn found). Cost:
    one render of the text per thing checked (`whole` adds none: it reads the system check's two renders)."""
    calls = [k for k, m in enumerate(conv) if m["role"] == "assistant" and m.get("tool_calls")]
    if enc.kind == "chatml":
        if tools:
            raise RowError(f"tools {tool_names(tools)}: the ChatML default (the tokenizer has no template) renders no "
                           "tool definitions: give a tokenizer whose template takes tools, or drop them")
        if any(defs(m) for m in conv):
            raise RowError(f"message {next(k for k, m in enumerate(conv) if defs(m))}: tool definitions, and the "
                           "ChatML default (the tokenizer has no template) renders none: give a tokenizer whose "
                           "template renders them, or drop them")
        if calls:  # (was checked in the trained turns only: a prompt's call vanished, its result trained on)
            raise RowError(f"message {calls[0]} (assistant): tool calls, and the ChatML default (the tokenizer has "
                           "no template) renders none: give a tokenizer whose template renders tool_calls")
        return
    systems = [k for k, m in enumerate(conv) if m["role"] == "system" and isinstance(m.get("content"), str)
               and m["content"].strip()]
    lost = _unmarked(enc, conv, systems, tools) or []  # one render of a row with a system message; a second where
    if lost:  # one is lost: Mistral v0.3 writes it in the last user turn only when that turn is last (said later,
        users = [k for k, m in enumerate(conv) if m["role"] == "user"]  # but here under `whole`: no turn to locate)
        dropped = lost
        lost = [k for k in _unmarked(enc, conv[:users[-1] + 1], lost, tools) or [] if k < users[-1]] if users else lost
        if whole and not lost:
            raise RowError(f"message {dropped[0]} (system): {enc.name} does not render it in this conversation (it "
                           "writes a system prompt only where a user turn is last, as Mistral v0.3 does), so --loss_on "
                           "all would train every token without the instructions the replies answer: put it in the "
                           "first user turn, or drop it")
    for k in lost[:1]:
        raise RowError(f"message {k} (system): {enc.name} does not render a system message (Phi-4-reasoning writes "
                       "its own system prompt in its place), so the replies would be trained without the "
                       "instructions they answer: drop the system message, or use a template that renders it")
    if not tools and not calls and not any(m["role"] in ("environment", "tool") or defs(m) for m in conv):
        return
    try:
        text = enc._text(conv, tools=tools)
    except RowError as e:  # Command-R's `default` refuses a tool turn ("roles must alternate"): its set has the fix
        if (tools or calls or any(m["role"] == "tool" for m in conv)) and (fix := tool_use_fix(enc)):
            raise RowError(f"{e}: use {fix}") from None
        raise
    if tools:
        try:  # the same text without them: the template ignores `tools`
            same = enc._text(conv) == text
        except RowError:  # it needs them (Command-R's tool_use iterates `tools`): it reads them
            same = False
        if same:
            raise RowError(f"tools {tool_names(tools)}: {enc.name} does not render a row's `tools` (tool definitions),"
                           " so the replies would be trained as if no tool had been offered: use "
                           f"{tool_use_fix(enc) or 'a template that takes tools= (Llama 3.1, Qwen2.5 / 3, Mistral v0.3, ...)'}"
                           ", or drop them")
    if calls:
        try:  # no call is rendered (GLM-4 skips a message whose content is empty, calls and all): each reply after
            same = enc._text([{x: v for x, v in m.items() if x != "tool_calls"} for m in conv], tools=tools) == text
        except RowError:  # one renders only with its calls (roles must alternate, a tool turn needs a call): read
            same = False
        if same:  # one would be trained on the result of a call the model never made
            k = calls[0]
            raise RowError(f"message {k} (assistant): {enc.name} does not render its tool call(s) "
                           f"{[call_name(c) for c in conv[k]['tool_calls']]}, so an empty reply would be trained: use "
                           f"{tool_use_fix(enc) or 'a template that renders tool_calls'}, or drop the calls")
        # a trained reply's text beside its calls (`turns`: the replies trained, None: all), which Llama 3.1 / 3.2
        # and Mistral v0.3 drop, writing the call alone
        said = [k for k in (calls if turns is None else [k for k in calls if k in turns])
                if conv[k]["content"].split("</think>")[-1].strip()]
        for k in _dropped_texts(enc, conv, said, text, tools)[:1]:
            raise RowError(f"message {k} (assistant): {enc.name} does not render a reply's text beside its tool "
                           "calls (it writes the call alone, or drops the text once a final answer follows, as "
                           "gpt-oss does), so the text would be lost: give it as a reply of its own before the "
                           "call, or drop it")
    results = [k for k, m in enumerate(conv) if m["role"] in ("environment", "tool") and m["content"].strip()]
    for k in _dropped_results(enc, conv, results, text, tools)[:1]:
        if conv[k]["role"] == "environment":
            raise RowError(f"message {k} (environment): {enc.name} does not render the environment role (OLMo "
                           "3's tool results): give tool results as the role this template renders (tool)")
        raise RowError(f"message {k} (tool): {enc.name} does not render tool results (Phi-4's has no tool role), so "
                       "the replies after it would be trained on a result the model never sees: use a template that "
                       "renders them, or give the result as a user turn")
    for k, m in enumerate(conv):  # tool definitions on a message (Phi-4-mini's `tools`, OLMo 3's `functions`)
        for key in defs(m):  # dropped, the replies would be trained as if no tool had been offered
            if enc._text(conv[:k] + [{x: v for x, v in m.items() if x != key}] + conv[k + 1:], tools=tools) == text:
                raise RowError(f"message {k} ({m['role']}): {enc.name} does not render a message's `{key}` "
                               "(tool definitions): give them as this template takes them, or drop them")


def tool_use_fix(enc) -> str | None:
    """The fix a refused tool row names where `enc` renders another of its tokenizer's named templates than the set's
    `tool_use` (Hermes-2-Pro / 3, Command-R / R7B ship `default` + `tool_use`; transformers and vLLM render a request
    with tools by `tool_use`): before, such a row was told to use another model's template (Llama 3.1, ...) though
    the tokenizer ships one. None otherwise."""
    own = getattr(enc.hf, "chat_template", None)
    if isinstance(own, dict) and own.get("tool_use") and enc.template != own["tool_use"]:
        return "--chat_template tool_use (the tokenizer's own template for rows with tools)"
    return None


def _unmarked(enc, conv: list[dict], ks: list[int], tools: list | None, keep=lambda m: "") -> list[int] | None:
    """The messages of `ks` whose content the template does not render: one render with each one's content replaced
    by `keep(message)` and a mark of its own, the marks it lacks (was one render per message: quadratic, half the
    minute of a 1,000-step agent trajectory); None where the template refuses the marks."""
    if not ks:
        return []
    marks = {k: f"Qz{k}MarkOfMessage" for k in ks}
    try:
        out = enc._text([{**m, "content": keep(m) + marks[k]} if k in marks else m for k, m in enumerate(conv)],
                        tools=tools)
    except RowError:
        return None
    return [k for k in ks if marks[k] not in out]


def _dropped_texts(enc, conv: list[dict], ks: list[int], text: str, tools: list | None) -> list[int]:
    """The turns of `ks` whose text (past a think block) the template does not render (`_unmarked`; per turn where
    the template refuses the marks)."""
    got = _unmarked(enc, conv, ks, tools, keep=_think)
    return got if got is not None else [k for k in ks if _same_without(enc, conv, k, text, tools)]


def _dropped_results(enc, conv: list[dict], ks: list[int], text: str, tools: list | None) -> list[int]:
    """The tool / environment messages of `ks` the template does not render (`_unmarked`; where the template refuses
    the marks, per message: the conversation renders the same without it)."""
    got = _unmarked(enc, conv, ks, tools)
    if got is not None:
        return got
    dropped = []
    for k in ks:
        try:
            if enc._text(conv[:k] + conv[k + 1:], tools=tools) == text:
                dropped.append(k)
        except RowError:  # the template needs it there (roles must alternate): it reads it
            pass
    return dropped


def _think(m: dict) -> str:
    return m["content"].split("</think>")[0] + "</think>" if "</think>" in m["content"] else ""


def _same_without(enc, conv: list[dict], k: int, text: str, tools: list | None) -> bool:
    """Whether the conversation renders the same with message k's text emptied (its think block kept)."""
    m = conv[k]
    try:
        return enc._text(conv[:k] + [{**m, "content": _think(m)}] + conv[k + 1:], tools=tools) == text
    except RowError:  # it renders only with the text: it reads it
        return False
