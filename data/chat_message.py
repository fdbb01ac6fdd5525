"""One message of a chat row, checked, as templates read it: its role (OpenAI's, and the names exporters write:
`developer`, `model`, ShareGPT's `human` / `gpt`, Llama 3.1's `ipython`), its content as one text (text parts joined
by a newline, as vLLM does for a string-content template; a list of several parts, or with a `thinking` part, is
also kept as given, `PARTS`, for the encoder to render as the template renders the list where it does: data/chat_render
`Rendering._parts`; a tool's result given as data becomes its JSON text), its
reasoning under every name a template reads, the keys templates read (tool calls, Phi-4-mini's and OLMo 3's function
lists) and its training flag (OpenAI's `weight`, Axolotl's `training` / `train`, LLaMA-Factory v1's `loss_weight`),
read and never passed on. data/chat_rows.py reads the row formats and calls `message` for each; its docstring lists
what is read and what is refused. `RowError`, the one-line refusal every data/chat_*.py module raises, is defined
here, below them all (data/chat_rows.py imports it back). Split out of data/chat_rows.py.

Cost: a few lookups and one join a message; linear in the row's size.
"""

from __future__ import annotations

import json

ROLES = ("system", "user", "assistant", "tool", "environment")  # environment: OLMo 3's tool results, a role of its
# own in its template (open-instruct's `olmo`); passed on as given, never supervised; a template that does not render
# it refuses the row (data/chat.py)
ALIASES = {"developer": "system", "model": "assistant", "human": "user", "gpt": "assistant", "ipython": "tool"}  # OpenAI's
# newer system role; Gemma's / Gemini's reply role; ShareGPT's names in `role`; Llama 3.1's tool results (as `tool`)
FLAGS = ("weight", "training", "train", "loss_weight")  # a message's training flag: OpenAI's fine-tuning `weight`,
# Axolotl's `message_field_training` (`training` by default; `train` in its docs' examples and Nemotron exports),
# LLaMA-Factory v1's `loss_weight` (0.0 on a user turn, 1.0 on a reply in its v1_sft_demo; before, ignored: a reply
# weighted 0.0 was trained)
PARTS = "_content_parts"  # a content list of several parts or with a thinking part, normalized ({"type": "text", "text"}
# / {"type": "thinking", "thinking"}), beside its text: the encoder renders it and drops the key before any render
KEYS = ("tool_calls", "name", "tool_call_id")  # a message's keys templates read (and a reply's REASONING)
REASONING = ("reasoning_content", "thinking", "reasoning")  # a reply's reasoning field: one text under every name
ROLE_KEYS = {"system": ("tools", "functions"), "user": ("functions",), "assistant": ("function_calls",)}  # Phi-4-mini's
# tool list rides on the system message; OLMo 3's function list on a system (or user) message, its calls on a reply


class RowError(ValueError):
    """A row that cannot be used (bad shape, no assistant turn, a template that refuses it): a bad row."""


def _text_part(part) -> bool:
    """A content part that is text: a string, {"type": "text", "text": str} (the type may be left out), or LLaMA-Factory
    v1's {"type": "text", "value": str} (its text under `value`, the type given)."""
    return isinstance(part, str) or isinstance(part, dict) and part.get("type", "text") == "text" and (
        isinstance(part.get("text"), str) or part.get("text") is None and part.get("type") == "text"
        and isinstance(part.get("value"), str))


def _part_text(part) -> str:
    return part if isinstance(part, str) else part["text"] if isinstance(part.get("text"), str) else part["value"]


_V1_PARTS = {"reasoning": "the reply's reasoning_content (a string)",  # LLaMA-Factory v1's other part types
             "tool_call": 'the reply\'s tool_calls [{"type": "function", "function": {"name": ..., "arguments": ...}}]'}


def _text(content, i: int, role: str) -> tuple[str, list[dict] | None]:
    """(a message's content as one string: a string as is, a list's text parts joined by a newline; the list's parts,
    normalized, where it has several or a thinking part, else None)."""
    if isinstance(content, str):
        return content, None
    if isinstance(content, list):
        out, parts = [], []
        for j, part in enumerate(content):
            if _text_part(part):
                if isinstance(part, dict) and isinstance(part.get("value"), str) and part.get("text") not in (
                        None, part["value"]):
                    raise RowError(f"message {i} ({role}): content part {j} holds a `text` and a `value` of another "
                                   "text: which is meant? Keep one")
                out.append(_part_text(part))
                parts.append({"type": "text", "text": out[-1]})
            elif isinstance(part, dict) and part.get("type") == "thinking" and isinstance(part.get("thinking"), str):
                if role not in ("assistant", "system"):  # mistral-common's ThinkChunk: a reply's or a system prompt's
                    raise RowError(f"message {i} ({role}): content part {j} is a 'thinking' part, which only a reply "
                                   "or a system prompt carries: drop it")
                parts.append({"type": "thinking", "thinking": part["thinking"]})
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                if kind in _V1_PARTS and isinstance(part.get("value"), str):
                    raise RowError(f"message {i} ({role}): content part {j} is a {kind!r} part (LLaMA-Factory v1's), "
                                   f"not read here: give its value as {_V1_PARTS[kind]}")
                if kind == "thinking":
                    raise RowError(f"message {i} ({role}): content part {j} is a 'thinking' part without its text as "
                                   f"a string (keys {sorted(part)}): give it under `thinking`")
                if kind == "text":
                    raise RowError(f"message {i} ({role}): content part {j} is a text part without its text as a "
                                   f"string (keys {sorted(part)}): give it under `text`")
                raise RowError(f"message {i} ({role}): content part {j} is {kind!r}, not text: only text is trained "
                               "here (drop the part, or give its text as a {\"type\": \"text\"} part)")
        thinks = any(p["type"] == "thinking" for p in parts)
        return "\n".join(out), parts if len(parts) > 1 or thinks else None
    raise RowError(f"message {i} ({role}): content must be a string or a list of text parts, got "
                   f"{type(content).__name__}")


def _data(content) -> bool:
    """A JSON value that is not text: an object, a number, a boolean, a list that is not text parts."""
    if isinstance(content, dict | int | float | bool):
        return True
    return isinstance(content, list) and not all(_text_part(p) for p in content)


def message(m, i: int) -> dict:
    """One OpenAI-style message, checked: {role, content: str} and the optional keys templates read (KEYS, and
    ROLE_KEYS for its role), as given."""
    if not isinstance(m, dict):
        raise RowError(f"message {i}: expected an object with role and content, got {type(m).__name__}")
    role = ALIASES.get(m.get("role"), m.get("role")) if isinstance(m.get("role"), str) else m.get("role")
    if role not in ROLES:  # a list or object as the role: one line (it raised "unhashable type" with a traceback)
        raise RowError(f"message {i}: role {m.get('role')!r}; expected one of {list(ROLES) + list(ALIASES)}")
    if m.get("function_call") is not None:  # OpenAI's legacy form: dropped, the reply trained without its call
        raise RowError(f"message {i} ({role}): function_call (OpenAI's legacy form), which templates do not read: give "
                       'it as tool_calls [{"type": "function", "function": {"name": ..., "arguments": ...}}]')
    content = m[PARTS] if isinstance(m.get(PARTS), list) else m.get("content")  # (a message read here already)
    if content is None and role == "assistant" and (m.get("tool_calls") or m.get("function_calls")):
        content = ""
    if role in ("tool", "environment") and _data(content):  # a tool's result as data (xLAM, APIGen rows): the JSON
        content = json.dumps(content, ensure_ascii=False)  # text an OpenAI client sends for it
    text, parts = _text(content, i, role)
    out = {"role": role, "content": text, **({PARTS: parts} if parts else {})}
    if role == "assistant":
        out.update(_reasoning(m, i))
    for k in KEYS + ROLE_KEYS.get(role, ()):
        if m.get(k) is not None and not (k in ("tool_calls", "function_calls") and m[k] == []):
            out[k] = m[k]  # an empty call list (OpenAI exports write one) is no call: Llama 4's template skipped the reply
    train = _flag(m, i, role)
    if train is not None and role == "assistant":  # a false flag elsewhere says what is so already
        out["train"] = train  # data/chat.py takes it out before any render
    return out


def _reasoning(m: dict, i: int) -> dict:
    """A reply's reasoning field under every name a template reads: `reasoning_content` (vLLM, Qwen3, DeepSeek),
    `thinking` (gpt-oss, Magistral's exports) and `reasoning` (OpenRouter's and newer vLLM's name; Gemma 4's template
    reads it first). A row gives one of them; each template reads its own: before, a `reasoning` field was dropped
    without a word (Qwen3 trained an empty think block before each answer). Two names with two texts are refused."""
    given = {k: m[k] for k in REASONING if m.get(k) is not None}
    if any(not isinstance(v, str) for v in given.values()):
        k = next(k for k, v in given.items() if not isinstance(v, str))
        raise RowError(f"message {i} (assistant): {k} is {type(given[k]).__name__}, not text: give the reasoning as a "
                       "string")
    texts = [v for v in given.values() if v.strip()]
    if len({v.strip() for v in texts}) > 1:
        raise RowError(f"message {i} (assistant): {' and '.join(given)} hold different texts: give the reasoning once")
    return {k: texts[0] for k in REASONING} if texts else {}


def _flag(m: dict, i: int, role: str) -> bool | None:
    """The message's training flag (FLAGS) as a bool, None where it has none; a RowError for what is not read here."""
    if m.get("train_detail") is not None:
        raise RowError(f"message {i} ({role}): train_detail (Axolotl's character ranges to train) is not read here: "
                       "drop it, or flag whole turns with weight 0 / 1")
    got = {}
    for k in FLAGS:
        v = m.get(k)
        if v is None:
            continue
        if isinstance(v, str) and v.strip().lower() in ("true", "false", "0", "1"):  # a CSV / table export's text
            v = v.strip().lower() in ("true", "1")
        if isinstance(v, bool) or isinstance(v, int | float) and v in (0, 1):
            got[k] = bool(v)
        else:
            raise RowError(f"message {i} ({role}): {k} {v!r}: a turn's training flag is 0 / false (no loss) or 1 / "
                           "true; fractional or per-token weights are not read here")
    if len(set(got.values())) > 1:
        raise RowError(f"message {i} ({role}): training flags that disagree ({got}): give one")
    train = next(iter(got.values()), None)
    if train and role != "assistant":
        k = next(iter(got))
        raise RowError(f"message {i} ({role}): {k} {m[k]!r} asks to train a {role} turn, and only assistant replies "
                       "are trained here (--loss_on all trains every token): drop the flag")
    return train
