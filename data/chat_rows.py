"""Chat rows as users bring them -> one list of messages (what data/chat.py renders through a template).

Row formats (one JSON object / table row; `row_format` tells them apart by their keys):
- OpenAI `messages`: [{"role": "system" | "developer" | "user" | "assistant" | "tool", "content": ...}, ...];
  `content` a string or a list of text parts (`[{"type": "text", "text": ...}]`, what most exporters write, or
  LLaMA-Factory v1's `{"type": "text", "value": ...}`: the parts joined by a newline, as vLLM does for a
  string-content template; a non-text part is refused, v1's `reasoning` / `tool_call` parts naming the fields to use); `developer`
  (OpenAI's newer name for the system prompt) is read as `system`, `model` (Gemma's and the Gemini API's role name)
  as `assistant`, ShareGPT's `human` / `gpt` in a `role` as `user` / `assistant`; an assistant message may carry `tool_calls`
  (passed on to the template) with an empty content; a tool result given as data (an object, a list, a number: xLAM /
  APIGen rows) is its JSON text, as an OpenAI client sends it; `environment` (OLMo 3's tool results: its template renders
  them as a turn of that role, and a `tool` message not at all) is passed on as given; a system message's `tools` (Phi-4-mini's template renders
  the tool list from it, as a JSON string) is passed on as given, and so are OLMo 3's function-calling keys (its
  template, open-instruct's `olmo`: a system or user message's `functions`, an assistant reply's `function_calls`,
  both strings; a reply with `function_calls` may have an empty content); a message's training flag (OpenAI's
  fine-tuning `weight`: 0 or 1 on an assistant message; Axolotl's `training`, `train`: true / false; LLaMA-Factory
  v1's `loss_weight`: 0.0 / 1.0; null is no flag)
  is read, never passed on: a reply flagged 0 / false stays in the context and gets no loss (data/chat.py counts it,
  `flagged_turns`); a true flag on a message that is not an assistant reply (Axolotl would train a user turn), a
  weight other than 0 or 1 (no per-token or fractional weights here), flags that disagree, or Axolotl's
  `train_detail` (character ranges) are refused in one line;
- ShareGPT `conversations`: [{"from": "human" | "gpt" | "system" | "function_call" | "observation" | ..., "value":
  str}, ...] (a turn's text in `content` read too, and a turn written as an OpenAI message, `role` / `content`, as
  one: Agent-FLAN's rows, LLaMA-Factory's role_tag / content_tag; before, refused); `function_call` (LLaMA-Factory's tool call: a JSON object, or a list of them, with `name` and
  `arguments`) becomes an assistant message with `tool_calls`, `observation` a tool message;
- `prompt` / `completion`: two strings, or two message lists (TRL's conversational form);
- Alpaca `instruction` / `output` (with `input`, and LLaMA-Factory's `history` of [query, response] pairs): the
  conversation LLaMA-Factory builds from it: the history's turns, then a user turn (the instruction, and the input
  after a newline) and the output as the reply, rendered by the tokenizer's template like any conversation (not
  Stanford Alpaca's fixed "Below is an instruction..." prompt, which Axolotl's `type: alpaca` writes: give such rows
  as text, or as a prompt / completion of strings).
`messages` / `conversations` stored as JSON text (a CSV or table export) are read as the list they hold.
Beside any of them, a top-level `tools` (a list of OpenAI function definitions, or that list as a JSON string) is
read by data/chat_tools.py and passed to the template as `tools=`.
A top-level `system` (LLaMA-Factory's ShareGPT column: the system prompt beside the turns) or `system_prompt`
(OpenHermes', ultrachat_de's) is the conversation's first message (before, it was dropped without a word); one beside a
system message of another text, or both of two texts, is refused.
A context or reply beside the chat field that is not read (`document`, `documents`, `context`, `ctxs`, `answers`, `answer`,
`response`, `output`, `completion` where not the format's own: ChatQA's rows, apply_chat_template's RAG `documents`) is
refused in one line, unless the conversation holds its text (a copy of the last reply, ultrachat_de's `response`); before,
dropped without a word. So is a preference row's `chosen` / `rejected` beside it (LLaMA-Factory's ranking rows trained
the history's reply, `chosen` dropped) unless the conversation is the chosen one, and a boolean `label` (KTO rows).
A filled `images` / `image` / `videos` / `audios` column (LLaMA-Factory's mllm rows, LLaVA-Instruct) is refused in one
line: this trainer is text-only (before, dropped: the replies trained without what they describe, `<image>` as text).
A row with both a text field and a chat field is ambiguous (which one was meant?) and refused in one line
(data/readers.py); so is every malformed row, with the message and what was expected.
One message (its role, content, reasoning, keys and training flag) is read by data/chat_message.py.
"""

from __future__ import annotations

import json
import unicodedata

from data.chat_message import FLAGS, REASONING, RowError, message

SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "model": "assistant",
                  "tool": "tool", "observation": "tool", "function_response": "tool", "ipython": "tool",
                  "function_call": "assistant", "developer": "system"}
CHAT_KEYS = ("messages", "conversations", "prompt", "instruction")
MEDIA = ("images", "image", "videos", "audios")  # a multimodal row's media columns (LLaMA-Factory's mllm_demo,
# LLaVA-Instruct's `image`): refused where filled (text-only trainer)
SYSTEM_KEYS = ("system", "system_prompt")  # a row's top-level system prompt: LLaMA-Factory's name; OpenHermes',
# ultrachat_de's, Nemotron's
CONTEXT = ("document", "documents", "context", "ctxs")  # a row's context beside its chat field (ChatQA's document,
# ChatRAG's ctxs, apply_chat_template's RAG `documents`: not passed to the template here)
UNREAD = CONTEXT + ("answers", "answer", "response", "output", "completion")  # and its reply (ChatQA's answers):
# refused beside a chat field unless the conversation holds their text (a reply key: or ends in a reply; _checked)
OWN = {"pair": ("completion",), "alpaca": ("output",)}  # an UNREAD key that is the row format's own field
PREFERENCE = ("chosen", "rejected")  # a preference row's: refused beside a chat field unless it is the chosen one
_FORMATS = {"pair": "prompt / completion", "alpaca": "instruction / output"}


def row_format(obj: dict) -> str | None:
    """`messages` | `conversations` | `pair` | `alpaca` for a chat row, None for anything else (text, input_ids)."""
    def has(k: str) -> bool:  # a null is no field: pandas / datasets exports of mixed rows write one for each absent key
        return obj.get(k) is not None

    if has("messages"):
        return "messages"
    if has("conversations"):
        return "conversations"
    if has("prompt") and has("completion"):
        return "pair"
    if has("instruction") and has("output"):
        return "alpaca"
    return None


def _function_call(value, i: int) -> dict:
    """ShareGPT's `function_call` turn -> an assistant message with `tool_calls` (OpenAI form)."""
    try:
        calls = json.loads(value) if isinstance(value, str) else value
    except ValueError:
        raise RowError(f"conversations[{i}] (function_call): value is not JSON; expected {{\"name\": ..., "
                       "\"arguments\": {...}} or a list of them") from None
    calls = calls if isinstance(calls, list) else [calls]
    if not calls or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
        raise RowError(f"conversations[{i}] (function_call): expected {{\"name\": ..., \"arguments\": {{...}}}} or a "
                       f"list of them, got {value!r:.80}")
    return {"role": "assistant", "content": "", "tool_calls": [  # no ids (data/chat_tools.call_ids gives them)
        {"type": "function", "function": {"name": c["name"], "arguments": c.get("arguments", {})}} for c in calls]}


def _sharegpt(turns) -> list[dict]:
    if not isinstance(turns, list):
        raise RowError(f"conversations: expected a list of {{from, value}}, got {type(turns).__name__}")
    out = []
    for i, t in enumerate(turns):
        if isinstance(t, dict) and "from" not in t and "role" in t:  # an OpenAI message in `conversations` (Agent-FLAN;
            out.append(message(t, i))  # LLaMA-Factory's role_tag / content_tag): read as one
            continue
        if not isinstance(t, dict) or "from" not in t:
            raise RowError(f"conversations[{i}]: expected {{\"from\": ..., \"value\": ...}} or {{\"role\": ..., "
                           f"\"content\": ...}}, got {t!r:.60}")
        who = str(t["from"]).lower()
        role = SHAREGPT_ROLES.get(who)
        if role is None:
            raise RowError(f"conversations[{i}]: from {t['from']!r}; expected one of {sorted(SHAREGPT_ROLES)}")
        flags = {k: t[k] for k in FLAGS + ("train_detail",) if k in t}  # OpenHermes-2.5 has `weight` on every turn
        if who == "function_call":
            out.append(message({**_function_call(t.get("value"), i), **flags}, i))
        else:
            out.append(message({"role": role, "content": t.get("value", t.get("content")), **flags}, i))
    return out


def normalize(obj: dict) -> tuple[str, list[dict] | tuple[str, str], int]:
    """(kind, conversation, first supervised message) of a chat row: kind `chat` with its messages (`first` = the
    index of the first message a `completion` loss covers: 0, or the prompt's length for conversational pairs)
    or `text_pair` with (prompt, completion). RowError on a malformed row."""
    fmt = row_format(obj)
    system, system_key = _system(obj)
    for k in MEDIA:  # dropped, the replies describing them were trained text-only, the `<image>` placeholder as text
        if _filled(obj.get(k)):
            raise RowError(f"{k}: {_count(obj[k])} beside the conversation, and this trainer is text-only (the replies "
                           "would be trained without them, a placeholder such as <image> as text): drop the column "
                           "and the placeholders, or use a multimodal trainer")
    if obj.get("functions") is not None:  # OpenAI's legacy function calling, beside the messages
        raise RowError("functions (OpenAI's legacy tool list), which no template reads: give it as tools "
                       '[{"type": "function", "function": {"name": ..., "parameters": {...}}}]')
    if isinstance(obj.get("label"), bool):  # trl-lib/kto-mix-14k's shape, LLaMA-Factory's kto_en_demo (messages)
        raise RowError(f"{_FORMATS.get(fmt, fmt)} with a boolean label ({obj['label']}): an unpaired preference (KTO) "
                       "row, whose label-false replies would be trained as wanted ones: keep the label-true rows and "
                       "drop the column, or train them with a preference trainer")
    if fmt == "pair":
        p, c = obj["prompt"], obj["completion"]
        if isinstance(p, str) and isinstance(c, str):
            if system:
                raise RowError(f"{system_key} beside a text prompt / completion, which no template renders: put it in "
                               "the prompt, or give prompt and completion as message lists")
            _checked([{"role": "user", "content": p}, {"role": "assistant", "content": c}], obj, fmt)
            return "text_pair", (p, c), 0
        if isinstance(p, list) and isinstance(c, list):
            msgs = _with_system([message(m, i) for i, m in enumerate(p + c)], system)
            return "chat", _checked(msgs, obj, fmt), len(msgs) - len(c)
        raise RowError("prompt/completion: expected two strings or two lists of messages, got "
                       f"{type(p).__name__} and {type(c).__name__}")
    if fmt == "messages":
        msgs = _listed(obj["messages"], "messages")
        if not isinstance(msgs, list):
            raise RowError(f"messages: expected a list, got {type(obj['messages']).__name__}")
        return "chat", _checked(_with_system([message(m, i) for i, m in enumerate(msgs)], system), obj, fmt), 0
    if fmt == "conversations":
        conv = _sharegpt(_listed(obj["conversations"], "conversations"))
        return "chat", _checked(_with_system(conv, system), obj, fmt), 0
    if fmt == "alpaca":
        return "chat", _checked(_with_system(_alpaca(obj), system), obj, fmt), 0
    raise RowError(f"not a chat row: expected one of {list(CHAT_KEYS)} (prompt with completion, instruction with "
                   f"output), got keys {sorted(obj)}")


def _filled(v) -> bool:
    """Whether a media column's value holds anything: null, a blank, an empty list / array or a struct of nulls (a
    table's row without media: Arrow's {"bytes": None, "path": None}) does not."""
    v = v.tolist() if hasattr(v, "tolist") and not isinstance(v, list | str) else v
    if v is None or isinstance(v, str | bytes) and not v.strip():
        return False
    if isinstance(v, dict | list | tuple):
        return any(_filled(x) for x in (v.values() if isinstance(v, dict) else v))
    return True


def _count(v) -> str:
    v = v.tolist() if hasattr(v, "tolist") and not isinstance(v, list | str) else v
    if isinstance(v, str) or isinstance(v, list | tuple) and all(isinstance(x, str) for x in v):
        return f"{v!r:.60}"  # paths or URLs: named
    return f"{len(v)} item(s)" if isinstance(v, list | tuple) else "one item"  # bytes, structs: counted


def _alpaca(obj: dict) -> list[dict]:
    """An Alpaca row as LLaMA-Factory's converter reads it: `history` [[query, response], ...] as earlier turns, then
    the instruction and the input joined by a newline as the user turn, the output as the reply."""
    parts = {k: obj.get(k) for k in ("instruction", "input", "output")}
    for k, v in parts.items():
        if v is not None and not isinstance(v, str):
            raise RowError(f"{k}: expected a string, got {type(v).__name__}")
    history = [] if obj.get("history") is None else _listed(obj["history"], "history")  # a table's list column too
    if not isinstance(history, list):
        raise RowError(f"history: expected a list of [query, response], got {type(history).__name__}")
    msgs = []
    for i, pair in enumerate(history):
        pair = pair.tolist() if hasattr(pair, "tolist") else pair
        if not (isinstance(pair, list | tuple) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
            raise RowError(f"history[{i}]: expected [query, response] (two strings), got {pair!r:.60}")
        msgs += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    query = "\n".join(x for x in (parts["instruction"], parts["input"]) if x)
    return msgs + [{"role": "user", "content": query}, {"role": "assistant", "content": parts["output"] or ""}]


def _system(obj: dict) -> tuple[str | None, str]:
    """A row's top-level system prompt and the key it came from: `system` (LLaMA-Factory's ShareGPT and Alpaca column)
    or `system_prompt` (OpenHermes', ultrachat_de's, Nemotron's name: before, dropped without a word); None where it
    has none (null or empty). Both given with two texts: refused (which is meant?)."""
    given = {}
    for k in SYSTEM_KEYS:
        v = obj.get(k)
        if v is None or isinstance(v, str) and not v.strip():
            continue
        if not isinstance(v, str):
            raise RowError(f"{k}: expected the system prompt as a string, got {type(v).__name__}")
        given[k] = v
    if len({v.strip() for v in given.values()}) > 1:
        raise RowError("a top-level system and system_prompt of two texts: which is meant? Keep one")
    return next(iter(given.values()), None), next(iter(given), "system")


def _with_system(msgs: list[dict], system: str | None) -> list[dict]:
    """The conversation with the row's top-level system prompt as its first message; the same text given twice is
    one; a system message with another text is ambiguous (which one was meant?) and refused."""
    if system is None:
        return msgs
    if msgs and msgs[0]["role"] == "system":
        if msgs[0]["content"].strip() == system.strip():
            return msgs
        raise RowError("a top-level system and a system message with another text: which is meant? Keep one")
    return [{"role": "system", "content": system}, *msgs]


def _listed(value, key: str):
    """A column of messages stored as JSON text (a CSV or table export) as the list it holds; anything else as given.
    Parquet / Arrow list columns read as arrays are lists already (readers.py)."""
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            return json.loads(value)
        except ValueError:
            raise RowError(f"{key}: a text that is not a JSON list of messages ({value[:60]!r}...)") from None
    value = value.tolist() if hasattr(value, "tolist") and not isinstance(value, list) else value
    if isinstance(value, dict) and value and all(isinstance(v, list) for v in value.values()) \
            and len({len(v) for v in value.values()}) == 1:  # datasets' Sequence({role, content}): a dict of lists
        value = [dict(zip(value, row)) for row in zip(*value.values())]
    return value


def _checked(msgs: list[dict], obj: dict, fmt: str) -> list[dict]:
    """The conversation, if it has a reply to train and the row holds no context or reply beside it that is not read
    (UNREAD: ChatQA's `document` and `answers` beside a history ending with the user's question trained only the
    history's reply, without a word); a key whose text the conversation holds (ultrachat_de's and Magpie's `response`,
    the last reply's copy) is no loss, nor a reply key beside a conversation that ends in a reply (OpenR1-Math's
    ground-truth `answer` beside its solution, xLAM's `answers` beside its calls: a dataset's own label). Cost: a string comparison per key and message, a row's own size."""
    roles = [m["role"] for m in msgs]
    answered = "assistant" in roles and ("user" not in roles or roles[::-1].index("assistant") < roles[::-1].index("user"))
    unread = [k for k in UNREAD if k not in OWN.get(fmt, ()) and not (answered and k not in CONTEXT)
              and not _carried(obj.get(k), k in CONTEXT, msgs)]
    beside = f"{', '.join(map(repr, unread))} beside the {fmt} {'is' if len(unread) == 1 else 'are'} not read here"
    fix = "put the document in the user turn and the answer as the last assistant turn (docs/sft.md)"
    pref = [k for k in PREFERENCE if obj.get(k) is not None]
    if pref and not _chosen(obj.get("chosen"), msgs):  # LLaMA-Factory's ranking rows: the history's reply trained
        raise RowError(f"{' and '.join(pref)} beside the {fmt}: a preference row, whose chosen reply the conversation does "
                       "not hold: for SFT give the chosen conversation as messages, or train it with a preference trainer")
    if not any(m["role"] == "assistant" for m in msgs):
        raise RowError("no assistant turn: nothing to train on" + (f" ({beside}: {fix})" if unread else ""))
    if unread:
        raise RowError(f"{beside} (a context or reply the conversation does not hold: it would be dropped, the row "
                       f"trained without it): {fix}")
    return msgs


def _carried(value, context: bool, msgs: list[dict]) -> bool:
    """Whether an UNREAD key's value is nothing (null, empty, not text) or text the conversation holds: a context
    inside a message, a reply as an assistant message (a message list's contents, a passage list's texts, each)."""
    value = value.tolist() if hasattr(value, "tolist") and not isinstance(value, list | str) else value
    texts = [value] if isinstance(value, str) else value if isinstance(value, list) else []
    texts = [t.get("content", t.get("text")) if isinstance(t, dict) else t for t in texts]
    if any(not isinstance(t, str) for t in texts):
        return False
    texts = [t.strip() for t in texts if t.strip()]
    if context:
        return all(any(t in m["content"] for m in msgs) for t in texts)
    return all(any(t == m["content"].strip() for m in msgs if m["role"] == "assistant") for t in texts)


def _chosen(value, msgs: list[dict]) -> bool:
    """Whether a preference row's `chosen` (a reply's text, a message / turn, or a list of them) is in the conversation:
    each of its replies an assistant message of it (ultrafeedback_binarized's `messages` is its `chosen`)."""
    value = value.tolist() if hasattr(value, "tolist") and not isinstance(value, list | str) else value
    turns = value if isinstance(value, list) else [value]
    texts = [t.get("content", t.get("value")) if isinstance(t, dict) else t for t in turns if not isinstance(t, dict)
             or SHAREGPT_ROLES.get(str(t.get("role", t.get("from", "assistant"))).lower()) == "assistant"]
    replies = {m["content"].strip() for m in msgs if m["role"] == "assistant"}
    return bool(texts) and all(isinstance(t, str) and t.strip() in replies for t in texts)


def empty_reply(msg: dict) -> bool:
    """A reply with no text, no tool call and no reasoning: trained, it teaches the model to stop at once (raw
    ShareGPT dumps hold such turns); data/chat.py leaves it untrained and counts it."""
    return not (msg["content"].strip() or msg.get("tool_calls") or msg.get("function_calls")
                or any(isinstance(msg.get(f), str) and msg[f].strip() for f in REASONING))


def turns_to_train(conv: list[dict], first: int, loss_on: str) -> tuple[list[int], int]:
    """The assistant turns to train and how many the row flags not to (a reply's `weight` 0 / `training` false, read
    by `message`: it stays in the context, gets no loss). The flags are taken out of the messages here, before any
    render (data/chat.py calls it first). A RowError where a flag cannot be honoured: a weight-0 reply under `--loss_on all`, a flagged
    reply in a prompt that `completion` never trains, every reply flagged."""
    flags = {k: m.pop("train") for k, m in enumerate(conv) if "train" in m}
    if loss_on == "all" and not all(flags.values()):
        k = next(k for k, v in flags.items() if not v)
        raise RowError(f"message {k} (assistant) is flagged not to train (weight 0 / training false), and "
                       "--loss_on all trains every token: use --loss_on assistant to honour the flag, or drop it")
    if loss_on == "completion" and any(v and k < first for k, v in flags.items()):
        k = next(k for k, v in flags.items() if v and k < first)
        raise RowError(f"message {k} (assistant) is flagged to train, and it is in the prompt, which --loss_on "
                       "completion never trains: move it to the completion, or drop the flag")
    turns = [k for k, m in enumerate(conv) if m["role"] == "assistant" and (loss_on != "completion" or k >= first)]
    wanted = [k for k in turns if flags.get(k, True)]
    if not wanted and turns:
        raise RowError(f"every assistant turn ({len(turns)}) is flagged not to train (weight 0 / training false): "
                       "nothing to train on")
    return wanted, len(turns) - len(wanted)


def without_nulls(value: object) -> object:
    """A struct column's value as JSON-like Python (an Arrow / numpy value through `tolist`), without the nulls Arrow
    adds: a table holds one struct type per column, the union of every row's keys, so each tool comes back with every
    other tool's parameters as null (`"query": None`), which the template would render into the tool's schema, and
    each tool call with every other call's arguments (`{"city": "Paris", "query": null, "limit": null}`), which a
    trained reply would teach; a row's `chat_template_kwargs` likewise. A null written on purpose in a tool definition
    cannot be told apart in such a column: a JSON-string column (json.dumps of the list) is read exactly
    (docs/sft.md)."""
    value = value.tolist() if hasattr(value, "tolist") and not isinstance(value, list | str) else value
    if isinstance(value, dict):
        return {k: without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [without_nulls(v) for v in value]
    return value


def unicode_form(text: str) -> str:
    """`text` in Unicode's NFKC form, for finding a message's text in a decoded rendering: a tokenizer that
    normalizes (Qwen2's NFC) decodes text written in another form (macOS's decomposed accents, the OHM SIGN) as its
    normal form, and the text, compared as given, was not found (the turn untrained, a one-turn row refused)."""
    return text if text.isascii() else unicodedata.normalize("NFKC", text)
