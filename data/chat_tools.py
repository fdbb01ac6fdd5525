"""Tool definitions and tool turns a chat row brings, as the template takes them (data/chat.py): the row's `tools`,
tool-call ids where the template needs them, call arguments in the form it writes; whether it renders them:
data/chat_tools_checks.py.

A row's top-level `tools` (OpenAI / TRL: `{"messages": [...], "tools": [{"type": "function", "function": {"name":
..., "parameters": {...}}}]}`; LLaMA-Factory's ShareGPT writes the list as a JSON string, of bare `{"name": ...}`
definitions) is passed to the chat template as `tools=`, as transformers' apply_chat_template and TRL do, in every
render of the conversation (its prefixes included). An empty list ("[]": LLaMA-Factory's "no tools") is no tools
(None: Llama 3.x / 4 test `tools is not none` and wrote an empty tool offer; Mistral v0.3 an empty
[AVAILABLE_TOOLS]), except for a template that renders the row only with a tool list (Hermes' and Command-R's
`tool_use` iterate `tools`): it gets [] as given. A definition reaches the template as OpenAI's
`{"type": "function", "function": {...}}`, the form inference servers, transformers' get_json_schema and
LLaMA-Factory give it: a bare one (`name`, `description`, `parameters`, `strict`: LLaMA-Factory's, glaive's) is
wrapped, the Responses API's flat `{"type": "function", "name": ...}` nested, Anthropic's / MCP's `input_schema` /
`inputSchema` (the same JSON Schema) named `parameters`; a bare one with other keys is refused in one line. Cohere's
`parameter_definitions` form (Command-R's template reads it) and other `type`s stay as given. A template that fails on
OpenAI's form, or writes no function's name with it, gets the plain function objects (`_fitted`: Apertus-2509 reads
`tool.name`). The definitions are then in the ids, in a system or user turn (never supervised: only assistant
replies are). A template that renders the same with and without them (Llama 3.0, Qwen2, Phi-3, ... take no tool
list) would train each reply as if no tool had been offered, a call to a function the model never saw defined: such
a row is refused in one line (data/chat_tools_checks.py), as the same is for a message's `tools` / `functions`
(Phi-4-mini's, OLMo 3's) and for an `environment` turn (OLMo 3's tool results) the template drops.
"""

from __future__ import annotations

import json

from data.chat_rows import RowError
from data.chat_tools_checks import (  # noqa: F401  (call_name: re-exported for data/chat.py, chat_locate.py)
    call_name,
    refuse_unrendered,
    tool_names,
)

_FORM = ('a list of function definitions [{"type": "function", "function": {"name": ..., "description": ..., '
         '"parameters": {...}}}] (or that list as a JSON string)')


def row_tools(obj: dict, enc=None, conv: list[dict] | None = None) -> list | None:
    """The row's top-level `tools` as the template gets them (a list, each definition in OpenAI's form: `_wrapped`; a
    JSON string of one parsed), None where absent, null or empty. An empty list stays [] where `enc`'s template
    renders `conv` (the row's messages) only with a tool list. RowError, one line naming the value and the form
    expected, for anything else."""
    value = obj.get("tools") if isinstance(obj, dict) else None
    if value is None or isinstance(value, str) and not value.strip():  # a JSON-text column's blank: no tools
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise RowError(f"tools: {obj['tools']!r:.80} is not JSON: give {_FORM}") from None
    if hasattr(value, "tolist") and not isinstance(value, list):  # a Parquet / Arrow list column read as an array
        value = value.tolist()
    if not isinstance(value, list):
        raise RowError(f"tools: {obj['tools']!r:.80} is a {type(value).__name__}, not a list: give {_FORM}")
    for i, t in enumerate(value):
        fn = t.get("function", t) if isinstance(t, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str) and fn["name"]):
            raise RowError(f"tools[{i}]: {t!r:.80} is not a function definition with a name: give {_FORM}")
    if value:
        return _fitted(enc, conv, [_wrapped(t, i) for i, t in enumerate(value)])
    # an empty list (LLaMA-Factory's "[]", 109 of the 300 rows of its glaive_toolcall demo) is no tools: passed as [],
    # Llama 3.1 wrote "Environment: ipython" and an empty function list into every such row, Mistral v0.3 an empty
    # [AVAILABLE_TOOLS] (4 of 5 replies then untrained). Hermes' and Command-R's `tool_use` iterate `tools` and fail
    # on None: they get the [] given, as before (the row was refused, and skip_bad_rows is off by default)
    return [] if enc is not None and _needs_list(enc, conv) else None


def _needs_list(enc, conv) -> bool:
    """Whether `enc`'s template renders `conv` only with a tool list (it refuses it with none, renders it with []).
    Cost: one render of a row whose tool list is empty (a third of Glaive's rows), two more where the template
    refuses it without a list."""
    if enc.kind == "chatml" or not isinstance(conv, list):
        return False
    try:
        enc._text(conv)
        return False
    except RowError:
        return enc._needs_tools(conv, False)


# OpenAI's function object (Chat Completions' `function`, the Responses API's flat tool less its `type`)
_OPENAI_KEYS = ("name", "description", "parameters", "strict")
# Anthropic's (and Claude traces') `input_schema`, MCP's `inputSchema`: the JSON Schema of the arguments, the object
# OpenAI's `parameters` holds. Mapped, not refused: the rename is exact (what an OpenAI-compatible server, LiteLLM or
# an MCP client's OpenAI adapter sends the model for these tools), where the template given the key it does not read
# rendered the function with no parameters (gpt-oss `() => any`, Gemma 4) or printed the key (Mistral v0.3)
_SCHEMA_KEYS = ("input_schema", "inputSchema")


def _wrapped(t: dict, i: int = 0) -> dict:
    """A definition as OpenAI's `{"type": "function", "function": {...}}`, what a server gives the template for the
    same tools (before, the tool list trained differed from the one served, and Mistral v0.3 / gpt-oss / Gemma 4,
    reading `tool.function`, failed): a bare one (`name` and neither `type` nor `function`: LLaMA-Factory's,
    glaive's, Anthropic's, MCP's) wrapped, the Responses API's flat `{"type": "function", "name": ...}` (Anthropic's
    `"type": "custom"` with its `input_schema`) nested. OpenAI's nested form, Cohere's `parameter_definitions` form
    (Command-R's template reads it as given) and other types (a provider's hosted tools; OpenAI's free-text
    `"custom"` tools, which take no JSON arguments) stay as given."""
    kind = t.get("type", "function")  # a bare definition: a function
    if "function" in t or "parameter_definitions" in t or not (kind == "function" or kind == "custom"
                                                                 and "input_schema" in t):
        return t
    return {"type": "function", "function": _function({k: v for k, v in t.items() if k != "type"}, i)}


def _function(fn: dict, i: int) -> dict:
    """`fn` as OpenAI's function object: as given where its keys are OpenAI's, `input_schema` / `inputSchema` named
    `parameters` where that is the only other key (in its place: `tojson` keeps the order); RowError naming the keys
    for anything else (a template reads only the keys it knows: the others were dropped or printed verbatim)."""
    other = [k for k in fn if k not in _OPENAI_KEYS]
    if not other:
        return fn
    if len(other) == 1 and other[0] in _SCHEMA_KEYS and "parameters" not in fn:
        return {("parameters" if k == other[0] else k): v for k, v in fn.items()}
    raise RowError(f"tools[{i}]: a definition with keys {list(fn)}, of which {other} are not OpenAI's (name, "
                   "description, parameters, strict; an input_schema / inputSchema alone is read as parameters): "
                   f"give {_FORM}, which reaches the template as given")


_PROBE = [{"role": "user", "content": "Probe question?"}]


def _shows(enc, tools: list) -> tuple[bool, str | None]:
    """(whether `enc`'s template renders a one-question probe with `tools` writing every function's name, the
    template's error where it refuses it)."""
    try:
        text = enc._text(_PROBE, True, tools=tools)
    except RowError as e:
        return False, str(e).removeprefix(f"{enc.name} refuses this conversation: ")
    return all(n in text for n in tool_names(tools)), None


def _fitted(enc, conv, tools: list) -> list:
    """`tools` (OpenAI's form, `_wrapped`) as `enc`'s template reads them: as given where it renders them, each
    function's name written; else the plain form (each `{"type": "function", "function": {...}}` as its function
    object: Apertus-8B-Instruct-2509's template reads `tool.name`, `tool.description`, `tool.parameters`) where that
    renders them, as fit_arguments tries the other form of the arguments. Decided on a one-question probe, not the
    row (its arguments may be in the form the template does not take yet): the same form for every row with the same
    template and definitions, the form the exported template is then to be served with. RowError, one line naming
    both forms, where the template refuses the probe with each but renders it without tools. Cost: one render of the
    probe per row with tools (~the definitions' length), one more where the plain form is tried, one without tools
    where neither renders."""
    if enc is None or enc.kind == "chatml" or not isinstance(conv, list):
        return tools
    plain = [t["function"] if t.get("type") == "function" and isinstance(t.get("function"), dict) else t
             for t in tools]
    if plain == tools:  # none in OpenAI's form (Cohere's parameter_definitions, other types): nothing to try
        return tools
    ok, why = _shows(enc, tools)
    if ok:
        return tools
    ok_plain, why_plain = _shows(enc, plain)
    if ok_plain:
        return plain
    if why is not None and why_plain is not None:
        try:  # the probe renders without tools: it is the definitions the template refuses
            enc._text(_PROBE, True)
        except RowError:
            return tools
        raise RowError(f"tools {tool_names(tools)}: {enc.name} refuses them in both forms tried, OpenAI's "
                       f'{{"type": "function", "function": {{...}}}} ({why}) and the plain {{"name": ..., '
                       f'"description": ..., "parameters": ...}} ({why_plain}): give definitions with the keys this '
                       "template reads, or drop them")
    return tools  # rendered without their names in both: the row's own checks say why (refuse_unrendered)


# ---- tool-call ids: Mistral v0.3 / Small 3.2 templates raise on a call or result without a 9-character id
def _needs_ids(enc) -> bool:
    """Whether `enc`'s template refuses a probe call and its result without ids and renders them with ids. Read once
    per encoder (two renders); False where it renders neither (nothing known: the row goes on as given)."""
    if "ids" not in enc.tool_probes:
        def probe(i: dict, j: dict) -> list[dict]:
            return [_PROBE[0], {"role": "assistant", "content": "", "tool_calls": [{"type": "function", **i, "function": {
                "name": "probe", "arguments": {"q": "x"}}}]}, {"role": "tool", "content": "1", **j}]
        enc.tool_probes["ids"] = _render_or_none(enc, probe({}, {}), None) is None and _render_or_none(
            enc, probe({"id": "c00000000"}, {"tool_call_id": "c00000000"}), None) is not None
    return enc.tool_probes["ids"]


def call_ids(enc, conv: list[dict]) -> list[dict]:
    """conv with an id for each tool call lacking one, and each tool result lacking a tool_call_id the next id of the
    calls before it, in order, where `enc`'s template needs them (`_needs_ids`): by position, 9 letters / digits
    (`c00000000`, ...), none a call's own. As given elsewhere: Apriel-1.6 writes an id only when the reply is not
    last, so a reply given one renders otherwise as a prefix (untrained). Cost: nothing for a row without calls."""
    if enc.kind == "chatml" or not any(m.get("tool_calls") for m in conv) or not _needs_ids(enc):
        return conv
    used = {c.get("id") for m in conv for c in m.get("tool_calls") or [] if isinstance(c, dict)}
    fresh, out, queue = (i for n in range(10 ** 8) if (i := f"c{n:08d}") not in used), [], []
    for m in conv:
        if m["role"] == "assistant" and m.get("tool_calls"):
            m = {**m, "tool_calls": [{**c, "id": next(fresh)} if isinstance(c, dict) and not c.get("id") else c
                                     for c in m["tool_calls"]]}
            queue = [c.get("id") for c in m["tool_calls"] if isinstance(c, dict)]
        elif m["role"] == "tool" and queue:
            m = m if m.get("tool_call_id") else {**m, "tool_call_id": queue[0]}
            queue = [i for i in queue if i != m["tool_call_id"]]
        out.append(m)
    return out


# ---- tool-call arguments: JSON text (OpenAI's API, most exported datasets) or an object (HF's docs, TRL)
def _arguments(call) -> object:
    fn = call.get("function", call) if isinstance(call, dict) else None
    return fn.get("arguments") if isinstance(fn, dict) else None


def _with_call_arguments(call: dict, arguments) -> dict:
    """`call` with its arguments replaced (OpenAI's `function` form or a bare call), the rest as given."""
    if isinstance(call.get("function"), dict):
        return {**call, "function": {**call["function"], "arguments": arguments}}
    return {**call, "arguments": arguments}


def _as_object(value) -> dict | None:
    """A JSON-text argument's object, None for anything else (a free-text argument stays as given)."""
    if isinstance(value, str) and value.lstrip().startswith("{"):
        try:
            out = json.loads(value)
        except ValueError:
            return None
        return out if isinstance(out, dict) else None
    return None


def _with_arguments(conv: list[dict], form: str) -> tuple[list[dict], bool]:
    """(conv with every call's arguments as an object (`object`) or as JSON text (`text`), whether any changed). Only
    what converts without loss: JSON text of an object <-> a dict (json.dumps as transformers' `tojson` writes)."""
    out, changed = [], False
    for m in conv:
        calls = m.get("tool_calls")
        if not isinstance(calls, list) or not calls:
            out.append(m)
            continue
        new = []
        for c in calls:
            a = _arguments(c)
            b = _as_object(a) if form == "object" else json.dumps(a, ensure_ascii=False) if isinstance(a, dict) else None
            if b is None:
                new.append(c)
                continue
            changed = True
            new.append(_with_call_arguments(c, b))
        out.append({**m, "tool_calls": new})
    return out, changed


def _render_or_none(enc, conv: list[dict], tools: list | None) -> str | None:
    try:
        return enc._text(conv, tools=tools)
    except RowError:
        return None


def _garbled(text: str, conv: list[dict]) -> bool:
    """Whether `text` (a render of conv) shows a call's arguments encoded twice (JSON text through `tojson`: a quoted
    string of escaped JSON) or as a Python dict (an object concatenated or printed: {'k': 'v'})."""
    for m in conv:
        for c in m.get("tool_calls") or []:
            a = _arguments(c)
            if _as_object(a) is not None and (json.dumps(a, ensure_ascii=False) in text or json.dumps(a) in text):
                return True
            if isinstance(a, dict) and a and str(a) != json.dumps(a) and str(a) in text:
                return True
    return False


def _lost(enc, conv: list[dict], tools: list | None) -> int | None:
    """Whether the template drops a call's arguments in the form the row gives them (MiniMax-M2's template as Unsloth
    and llama.cpp ship it writes them only when they are an object: JSON text vanishes, the call trained without
    them). One render with each argument's value replaced by a mark of its own, in the same form (keys kept: a
    template may read them); False where the template refuses the marked row (the plain render decides). A message
    some of whose calls show their arguments drops the others whole (gpt-oss writes the first call alone): that is
    the calls' refusal (data/chat.py), not this. Returns the first message that lost them, None where none did."""
    marks, out = {}, []
    for k, m in enumerate(conv):
        calls = m.get("tool_calls") if m["role"] == "assistant" else None
        if not isinstance(calls, list) or not calls:
            out.append(m)
            continue
        new = []
        for i, c in enumerate(calls):
            a = _arguments(c)
            obj = a if isinstance(a, dict) else _as_object(a)
            if not obj:
                new.append(c)
                continue
            marked = {key: f"Qz{k}x{i}x{j}ArgMark" for j, key in enumerate(obj)}
            marks.setdefault(k, []).append(list(marked.values()))
            b = marked if isinstance(a, dict) else json.dumps(marked)
            new.append(_with_call_arguments(c, b))
        out.append({**m, "tool_calls": new})
    if not marks:
        return None
    try:
        text = enc._text(out, tools=tools)
    except RowError:
        return None
    return next((k for k, calls in marks.items() if all(any(x not in text for x in call) for call in calls)), None)


def fit_arguments(enc, conv: list[dict], tools: list | None) -> tuple[list[dict], int]:
    """(conv with its tool calls' arguments in the form `enc`'s template writes, 1 where that rewrote them else 0).

    Templates disagree: Llama 3.1, Qwen2.5, Mistral v0.3 and gpt-oss apply `tojson` to the arguments unguarded, so
    OpenAI's JSON text renders encoded twice ("{\\"text\\": ...}", a string the model would learn to write instead of
    an object); DeepSeek's and functionary's concatenate them, so an object fails (or prints as a Python dict);
    Seed-OSS and Qwen3-Coder iterate an object; Qwen3 and Hermes take both; Gemma 4 prints text verbatim in braces
    of its own (`call:f{{"k": "v"}}`; the model writes `call:f{k:<|"|>v<|"|>}`). JSON text of an object is rendered
    as the object wherever that renders clean (templates are written for transformers' object form); else the row is
    rendered as given, and only where that render fails, garbles the arguments or drops them (`_lost`) is the other
    form tried, kept if it renders clean (else the row goes on as given, and a template that fails is a refused row;
    one that drops the arguments in every form is refused in one line: the calls would train without them).
    JSON text of an object <-> that object (its spelling as `tojson` writes it: `1e5` becomes `100000.0`, spaces
    canonical); free text stays as given. Cost: two more text renders of a
    row with calls (four where it is rewritten); rows without tool calls pay nothing."""
    if enc.kind == "chatml" or not any(m.get("tool_calls") for m in conv):
        return conv, 0
    as_object, changed = _with_arguments(conv, "object")
    if changed:  # JSON text of an object: the object's render where it is clean. Templates are written for an object
        try:  # (transformers' form); one may print text verbatim in a syntax of its own (Gemma 4's
            alt = enc._text(as_object, tools=tools)  # call:f{{"k": "v"}}, the model writing call:f{k:<|"|>v<|"|>})
            if not _garbled(alt, as_object) and _lost(enc, as_object, tools) is None:
                return as_object, int(alt != _render_or_none(enc, conv, tools))
        except RowError:
            pass
    lost = None
    try:
        if not _garbled(enc._text(conv, tools=tools), conv):
            lost = _lost(enc, conv, tools)
            if lost is None:
                return conv, 0
    except RowError:
        pass
    for form in ("object", "text"):
        alt, changed = _with_arguments(conv, form)
        if not changed:
            continue
        try:
            if not _garbled(enc._text(alt, tools=tools), alt) and _lost(enc, alt, tools) is None:
                return alt, 1
        except RowError:
            continue
    if lost is not None:
        refuse_unrendered(enc, conv, tools)  # a template that drops the calls whole says so first
        raise RowError(f"message {lost} (assistant): {enc.name} does not render its tool calls' arguments (as JSON text "
                       "or as an object), so the calls would be trained without them: use a template that renders "
                       "them, or drop the calls")
    return conv, 0
