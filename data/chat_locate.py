"""Where an assistant reply is in a conversation's tokens, for data/chat.py's prefix path (any template without
`{% generation %}` markers): `locate(enc, conv, wanted, tools)` -> (ids, {turn: (start, end)}, {turn: why not}).

The start: `header_end`, where the conversation stops following the generation prompt rendered after the messages
before the turn (module doc of data/chat.py, point 2). Where it leaves the prompt inside a word the two share the
first bytes of (Nemotron Nano v2's prompt `Assistant\n<think>\n`, a reply of calls alone `Assistant\n<TOOLCALL>[`,
`<think>` and `<TOOLCALL>` plain text: both start with the token `<`), the start is that word's start (`word_start`):
the end of the last control token or blank before it. A reply of calls alone has no text `starts` could check, and
was trained without its first token.

The end: `reply_end`, the first end-of-turn token after the reply's text (data/chat_ends.probe_ends), carried on over
the control tokens right after it up to one generation stops on (`through_stop`): Command R7B ends a reply
`<|END_RESPONSE|><|END_OF_TURN_TOKEN|>` and stops only on the second, its EOS, which was never trained (the model
never learned to stop). The stops are the model's generation_config.json `eos_token_id` beside the tokenizer; without
one, the tokenizer's EOS (what `generate()` falls back on through the model's config; R7B's tokenizer alone: its
`<|END_OF_TURN_TOKEN|>`). An end-of-turn that is a stop, or followed by text or by control tokens reaching none
(gpt-oss's history `<|end|><|start|>assistant`), ends the reply as before. A reply whose end-of-turn the template
writes only when a message follows ends at the one the conversation goes on with past blanks (Apriel-1.6's
`reply\n<|end|>\n`: it was trained as `reply`, no stop, uncounted); none there, it is a turn not trained, counted.
Cost: a few token comparisons per turn. A row with no turn located is refused naming the cause where a cheap one holds
(`unfound_why`: the replies' `name`, a template argument), else the usual ones.
"""

from __future__ import annotations

import json
import re

import numpy as np

from data.chat_reasoning import reasoning, think_parts
from data.chat_rows import RowError
from data.chat_rows import unicode_form as _nf
from data.chat_template import reads
from data.chat_tools import call_name
from data.chat_views import Renders, View

_ASK = [{"role": "user", "content": "Probe question one?"}]  # data/chat.py's probe, its first message
SWITCHES = ("enable_thinking", "thinking", "reasoning")  # the names templates read their thinking switch by


def lcp(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two token lists (vectorised: a 128k-token render is compared in ~0.1 ms)."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if len(diff) else n


def reply(enc, msg: dict) -> str:
    """The text a reply's span must show: its content past a leading think block (R1 / Qwen3 templates cut the
    reasoning), whole: a `</think>` quoted in it, which those templates cut at too, is text the span must show
    (data/chat_reasoning.split_think; the check compared only the part past the last one, the templates' own cut)."""
    return think_parts(enc, msg["content"])[1]


def shows(enc, ids: list[int], a: int, e: int, msg: dict) -> bool:
    """Whether ids[a:e] shows the reply: its text (past a leading think block, which R1 / Qwen3 templates drop from
    the content) and each tool call's name. One token before `a` too: a reply merged into the header's last token."""
    text = _nf(enc.tok.hf.decode(np.asarray(ids[max(a - 1, 0):e]), clean_up_tokenization_spaces=False))  # fast
    want = _nf(reply(enc, msg))
    if want and want not in text:
        return False
    return all(call_name(c) in text for c in msg.get("tool_calls") or [])


def header_end(enc, conv: list[dict], k: int, head: View, r: Renders) -> int | None:
    """Where turn k's reply starts in the conversation's tokens: the end of its header, None where the header is
    not there."""
    full = r.full
    a = head.lcp(r.arr)
    if a == len(head) < len(full):
        if k and conv[k - 1]["role"] == "assistant" and not starts(enc, full, a, conv[k]):
            return after_reply(enc, conv, k, full, a, r.tools)
        return a
    dec = enc.tok.hf.decode
    if a == len(head) - 1 < len(full) and dec(full[a:a + 1]).startswith(dec(head.slice(a, len(head)))):
        return a  # the header's last token merged with the reply's start into one token
    try:
        shared = r.prefix(k).lcp(r.arr) if k else 0
    except RowError:
        shared = 0
    d = min(a, shared)
    if k and thinks(enc):  # the history writes a reply as the generation prompt without thinking gives it:
        # GLM-4.7's `<|assistant|></think>` where its prompt is `<|assistant|><think>`
        b = header_after(enc, conv, k, d, full, r.tools, enable_thinking=False)
        if b is not None and d < b < len(full) and starts(enc, full, b, conv[k]):
            return b
    # a generation prompt longer than the header inside the conversation (DeepSeek-R1's `<｜Assistant｜><think>\n`):
    # the header is what the conversation follows of it past the earlier messages
    if a <= shared and k:  # the messages before close differently when last: find the generation prompt
        a = header_after(enc, conv, k, d, full, r.tools)
        shared = -1 if a is not None else shared
    elif a < len(full) and full[a] in head.slice(a, len(head)) and int(full[a]) in enc._added():
        return None  # the history writes an added token the prompt has past `a` (DeepSeek-V3.2: `</think>`, the
        # prompt `<think></think>`): a reply of calls alone (no text for _starts) was trained from that token
    elif a < len(head):  # the conversation leaves the prompt partway: never inside a word of it
        a = word_start(enc, head.slice(0, len(head)), a, shared)
    return a if a is not None and shared < a < len(full) and starts(enc, full, a, conv[k]) else None


def after_reply(enc, conv: list[dict], k: int, full: list[int], a: int, tools: list | None) -> int | None:
    """Where reply k starts right after another reply (two assistant messages in a row) whose generation prompt wrote
    no header: Qwen1.5's, Apriel-1.6's and Phi-3-vision's write none after an assistant message, so the conversation
    went on from it with the header `<|im_start|>assistant\n`, trained as the reply's text (uncounted). The header is
    the longest piece of the generation prompt after a user turn (`gen_header`: Qwen1.5's starts with the user's
    `<|im_end|>\n`; Apriel-1.6's goes on with `Here are my reasoning steps:\n`, the history not) that starts with a
    control token, lies past `a` behind nothing but blanks and control tokens (Apriel-1.6's `\n<|end|>\n` the
    conversation writes after the first reply) and is followed by the reply's text, or by its reasoning where the
    template prints that first (Qwen1.5's content `<think>...</think>` verbatim, Apriel-1.6's reasoning_content before
    `[BEGIN FINAL RESPONSE]`). `a` where the prompt wrote the header (the reply starts otherwise: a think block); None
    where it is not there. Read only for such a turn: one render and a few token comparisons."""
    h = gen_header(enc)
    try:
        if not h.strip() or enc._text(conv[:k], True, tools).endswith(h):
            return a
    except RowError:
        return None
    gen, dec = enc.tok.encode(h), enc.tok.hf.decode
    at = [p for p in range(a, min(a + 8, len(full))) if not dec(full[a:p], skip_special_tokens=True).strip()]
    firsts = [None]  # the reply's text, or its reasoning printed before it: its text, or its think block verbatim
    if got := reasoning(conv[k], enc):
        firsts += [got[1]] + ([conv[k]["content"].lstrip()] if got[0] == "content" else [])
    for i in [i for i, t in enumerate(gen) if t in enc.special]:  # a piece of it from a control token on
        for m in range(len(gen), i, -1):
            n = m - i
            for p in at:
                if full[p:p + n] == gen[i:m] and p + n < len(full) and any(
                        starts(enc, full, p + n, conv[k], text) for text in firsts):
                    return p + n
    return None


def gen_header(enc) -> str:
    """The generation prompt's text after a probe user turn (`<|im_start|>assistant\n`), read once per encoder."""
    if enc._gen_header is None:
        try:
            before, head = enc._text(_ASK), enc._text(_ASK, True)
        except RowError:
            before, head = "", ""
        enc._gen_header = head[len(before):] if head.startswith(before) else ""
    return enc._gen_header


def word_start(enc, head: list[int], a: int, low: int) -> int:
    """`a`, or the start of the word of the generation prompt `head` that `a` cuts (`<` | `think>` where the
    conversation writes `<TOOLCALL>`; module doc): the last position in (low, a) after a control token or a blank, or
    before one. `a` where there is none."""
    def edge(p: int) -> bool:
        left, right = head[p - 1], head[p]
        return (left in enc.special or right in enc.special or enc.tok.hf.decode([left])[-1:].isspace()
                or enc.tok.hf.decode([right])[:1].isspace())
    for p in range(a, low, -1):
        if edge(p):
            return p
    return a


def thinks(enc) -> bool:
    """Whether the template's generation prompt changes with enable_thinking=False (GLM-4.7, Qwen3), read once."""
    if enc._thinking is None:
        try:
            enc._thinking = enc._text(_ASK, True) != enc._text(_ASK, True, enable_thinking=False)
        except RowError:
            enc._thinking = False
    return enc._thinking


def opens_thinking(enc, conv: list[dict], k: int, tools: list | None = None) -> str | None:
    """Why turn k is not found where the generation prompt opens a thinking block (a tag holding `think`) that the
    history does not write before this reply: Cohere2MoE's prompt `<|START_THINKING|>` (`<|START_THINKING|><|END_THINKING|>`
    with reasoning false), the history nothing for a reply without reasoning; DeepSeek-V3.2's `<think></think>`, the
    history `</think>`. None where that is not so. Read only for a turn not found: three renders up to it."""
    try:
        tag = _unwritten(*(enc._text(conv[:n], g, tools) for n, g in ((k, False), (k, True), (k + 1, False))))
    except RowError:
        return None
    if tag is None:
        return None
    hint, off = switch(enc), [n for n in SWITCHES if enc._row_kw.get(n) is False]
    hint = f", or set chat_template_kwargs {hint}, with which its prompt is what the history writes" if hint else ""
    off = f" and drop chat_template_kwargs {off[0]}: false (with it the prompt closes the block empty)" if off else ""
    return (f"message {k}: the template's generation prompt opens a thinking block ({tag}) that the history does not "
            f"write before this reply: give the reply's reasoning (reasoning_content){off}{hint}")


def _unwritten(before: str, head: str, turn: str) -> str | None:
    """The thinking tag the generation prompt (`head` past `before`) writes and the turn (`turn` past `before`) does not."""
    tag = re.search(r"<[^<>]*think[^<>]*>", head[len(before):] if head.startswith(before) else head, re.IGNORECASE)
    if tag is None or tag.group(0) in (turn[len(before):] if turn.startswith(before) else turn):
        return None
    return tag.group(0)


def switch(enc) -> str:
    """`{"name": value}`: the template's thinking switch (SWITCHES, where it reads one) set so that its prompt opens no
    thinking block a reply without reasoning does not write (DeepSeek-V3.2's `thinking: true`: `<think>` in both); ""
    where none does (Cohere2MoE's `reasoning` either way writes `<|START_THINKING|>`, its history nothing) or the row
    sets it already. Read once per encoder, on a probe."""
    if (hit := getattr(enc, "_switch", None)) is None:
        hit, conv = "", [*_ASK, {"role": "assistant", "content": "Probe answer."}]
        for name in [n for n in SWITCHES if n in (reads(enc.template or "") or ())]:
            for v in (True, False):
                try:
                    texts = [enc._text(conv[:n], g, **{name: v}) for n, g in ((1, False), (1, True), (2, False))]
                except RowError:
                    continue
                if texts[1] != texts[0] and _unwritten(*texts) is None:
                    hit = json.dumps({name: v})
                    break
            if hit:
                break
        enc._switch = hit
    return "" if hit and json.loads(hit).items() <= enc._row_kw.items() else hit


def starts(enc, full: list[int], a: int, msg: dict, text: str | None = None) -> bool:
    """Whether the reply's text (or `text`: its reasoning, where printed first) starts at `a`: nothing but blanks
    between."""
    text = reply(enc, msg) if text is None else text
    want = _nf(text)[:16]  # cut after the normal form: a cut between a letter and its mark never matches
    if not want:
        return True
    pre = _nf(enc.tok.hf.decode(full[max(a - 1, 0):a]))
    # the window in tokens of the text as given too: a decomposed (NFD) reply takes more than its normal form
    n = max(len(enc.tok.encode(want)), len(enc.tok.encode(text[:64])))
    shown = _nf(enc.tok.hf.decode(full[max(a - 1, 0):a + n + 4]))
    i = shown.find(want)
    return i >= 0 and (i < len(pre) or not shown[len(pre):i].strip())


def header_after(enc, conv: list[dict], k: int, d: int, full: list[int], tools: list | None = None,
                  **kw) -> int | None:
    """Where turn k's reply starts when the messages before it render differently with a reply after them (Hermes'
    `tool_use` closes a last tool result `</tool_response><|im_end|>`, one followed by a reply
    `</tool_response>\n<|im_end|>`): the end of the generation prompt's tokens (the text `add_generation_prompt`
    adds, starting with a control token), found in the conversation past the divergence `d` with nothing but
    blanks and control tokens between (a template writing other text there, a system prompt moved, stays a turn
    not located). None where that does not hold."""
    try:
        before, head = enc._text(conv[:k], tools=tools, **kw), enc._text(conv[:k], True, tools, **kw)
    except RowError:
        return None
    if not head.startswith(before) or len(head) == len(before):
        return None
    gen = enc.tok.encode(head[len(before):])
    if not gen or gen[0] not in enc.special:
        return None
    for p in range(d, min(d + 16, len(full) - len(gen))):
        if full[p:p + len(gen)] == gen:
            between = enc.tok.hf.decode(full[d:p], skip_special_tokens=True)
            return p + len(gen) if not between.strip() else None
    return None


def prompt_cut(enc, conv: list[dict], turns: list[int], runs: list[tuple[int, int]],
               r: Renders) -> tuple[dict[int, tuple[int, int]], dict[int, str]]:
    """({turn: its `{% generation %}` run}, {turn: why it is not trained}) for data/chat.py's marker path, each run
    starting no earlier than where the conversation stops following the generation prompt rendered after the
    messages before its turn (TRL's completion rule, the common prefix; the prefix path's header_end, point 2 of
    data/chat.py's docstring): what that prompt writes is context at inference, never generated. TRL's training
    templates mark some of it: deepseek_r1_distill_training / deepseekv3_training `<｜Assistant｜>` (the prompt
    `<｜Assistant｜><think>\n`, the history `<｜Assistant｜>` alone), qwen2_5_training the header's `\n`, qwen3_training
    with enable_thinking false `<think>\n\n</think>\n\n`, qwen3_5_think / qwen3_6 / qwen3_8 / nemotron_3_nano_training
    the prompt's `<think>\n` (trl/chat_templates/*.jinja, TRL 1.16.0): all trained before, where the shipped templates
    train the reply and its end alone. A turn whose prefix does not render is not trained, as on the prefix path,
    except an assistant turn first (transformers renders no empty conversation): its marked run trains, cut by a later
    turn's prompt (`_first_cut`), as it trained before and in Hugging Face's assistant mask. Cost: the prompt is rendered exactly for the
    first turn after each role (two prefix renders), and read for a later turn after the same role from that one (the
    generation prompt is the row's arguments' and the last message's: DeepSeek's after a tool result is
    `<｜tool▁outputs▁end｜>`) where the tokens before its run are that prompt's: a few renders a row, linear in the
    conversation (the exact render of every turn gave the same masks on every sweep family and TRL template)."""
    arr, spans, why, seen = r.arr, {}, {}, {}  # previous role -> (the prompt's tokens, how many lie before the run, off)
    for k, (s, e) in zip(turns, runs):
        key = conv[k - 1]["role"] if k else None
        gen, before, off = seen.get(key, (None, 0, None))
        p = s - before  # where the prompt starts: its tokens before the run (the unmarked header) must be there
        if gen is None or p < 0 or r.full[p:p + min(before, len(gen))] != gen[:before]:
            try:
                head, base = r.prefix(k, gen=True), r.prefix(k)
            except RowError as err:
                if k:
                    why[k] = f"message {k}: {err}"
                continue  # an assistant turn first: cut after the loop, by a later turn's prompt
            if not base.lcp(arr) == len(base) <= min(head.lcp(arr), s):  # the messages before render otherwise
                spans[k] = (min(max(s, head.lcp(arr)), e), e)
                continue
            gen, before, off = seen[key] = (head.slice(len(base), len(head)), s - len(base), _off(enc, conv, k, r.tools))
            p = len(base)
        a = p + lcp(gen, r.full[p:p + len(gen)])
        if a < p + len(gen):  # the conversation leaves the prompt partway (header_end's cases)
            a = p + len(off) if off and r.full[p:p + len(off)] == off else p + word_start(enc, gen, a - p, 0)
        spans[k] = (min(max(s, a), e), e)
    if turns and turns[0] == 0 and 0 not in spans and 0 not in why:
        spans[0] = _first_cut(enc, r.full, runs[0], seen.get("user") or next(iter(seen.values()), None))
    return spans, why


def _first_cut(enc, full: list[int], run: tuple[int, int], prompt: tuple | None) -> tuple[int, int]:
    """An assistant turn first (no messages before it to render): its marked run, cut past the marked part of the
    generation prompt learned from a later turn (`prompt`: its tokens, how many lie before the run, off) where the run
    starts with it; the whole run without one (the turn trained before, and in Hugging Face's assistant mask)."""
    s, e = run
    if prompt is None:
        return s, e
    gen, before, off = prompt
    p = s - before  # where the prompt would start: its unmarked tokens before the run are not checked (nothing before)
    a = s + lcp(gen[before:], full[s:s + len(gen) - before])
    if a < p + len(gen):  # the conversation leaves the prompt partway (header_end's cases)
        a = p + len(off) if off and full[s:p + len(off)] == off[before:] else p + word_start(enc, gen, a - p, before)
    return min(max(s, a), e), e


def _off(enc, conv: list[dict], k: int, tools: list | None) -> list[int] | None:
    """The generation prompt's tokens after conv[:k] with enable_thinking false, where the template's prompt changes
    with it (`thinks`: the history writes a reply without reasoning as that prompt gives it, Nemotron 3 Nano's
    `<think></think>` where its prompt is `<think>\n`); None otherwise."""
    if not k or not thinks(enc):
        return None
    try:
        before, head = enc._text(conv[:k], tools=tools, enable_thinking=False), enc._text(conv[:k], True, tools,
                                                                                         enable_thinking=False)
    except RowError:
        return None
    return enc.tok.encode(head[len(before):]) if head.startswith(before) and len(head) > len(before) else None


def locate(enc, conv: list[dict], wanted: list[int], tools: list | None = None) -> tuple[list[int], dict, dict]:
    r = Renders(enc, conv, enc.linear, tools)  # rendered and tokenized once; each prefix a view on it
    full, arr = r.full, r.arr
    spans, why, unfound = {}, {}, []
    for k in wanted:
        msg = conv[k]
        try:
            head = r.prefix(k, gen=True)
            turn = r.prefix(k + 1)
        except RowError as e:  # e.g. an assistant turn first: there is nothing before it to render
            why[k] = f"message {k}: " + ("an assistant turn first (no messages before it to find its header by)"
                                         if k == 0 else str(e))
            continue
        a = header_end(enc, conv, k, head, r)
        if a is None and k and conv[k - 1]["role"] == "assistant":
            why[k] = (f"message {k}: an assistant message right after another, and the conversation does not go on "
                      "from the first with the template's assistant header: merge the two replies into one message")
            continue
        if a is None:
            why[k] = opens_thinking(enc, conv, k, tools) or (
                f"message {k}: the conversation does not go on from the messages before it with the template's "
                "assistant header: the template renders earlier messages differently once a reply follows (Mistral "
                "v0.3 drops a system prompt unless a user turn is last: put it in the first user turn) or writes text "
                "after the last message (Command-R's tool_use: use its `default`)")
            unfound.append(k)
            continue
        prefix = turn.lcp(arr) == len(turn)
        tail = turn.slice(a, len(turn))
        enc._tool_calls_shown(conv, [k], {k: tail})
        if w := enc._eot_text(conv, k):
            why[k] = w
            continue
        end = reply_end(enc, full, arr, a, len(turn) + (0 if prefix else 1), msg)
        if end is None and prefix and len(turn) < len(full) and tail and in_text(enc, tail, msg):
            # the turn alone ends in its text, the conversation goes on with an end-of-turn token, maybe behind
            # blanks (Apriel-1.6's `\n<|end|>\n`): written only when a message follows (Qwen1.5), it is this
            # reply's end. None there: the reply would train with no stop (the model never learns to end a turn)
            end = reply_end(enc, full, arr, a, past_blanks(enc, full, len(turn)) + 1, msg)
            if end is None:
                eot = enc.tok.hf.convert_ids_to_tokens(enc.eot.tolist())
                why[k] = (f"message {k}: the template writes no end-of-turn token {eot} after it (it goes on "
                          f"{enc.tok.hf.decode(full[len(turn):len(turn) + 4])!r:.40}), so it would train with no "
                          "stop: use a template that ends every reply")
                continue
        if end is None and prefix:  # a turn ended by another control token (gpt-oss's <|call|>); else, a last
            # reply the template ends with nothing (GLM's: a control token of its reasoning is no end)
            end = next((e for e in (trim(enc, tail, a, len(turn)), len(turn)) if shows(enc, full, a, e, msg)),
                       None)
        if end is None:
            eot = enc.tok.hf.convert_ids_to_tokens(enc.eot.tolist())
            why[k] = f"message {k}: no end-of-turn token {eot} after its text" + (
                "; its trailing blanks merge with the template's text after it into one token: strip them"
                if not prefix and msg["content"][-1:].isspace() else "")  # Apriel-1.6's `\r\n` + `\n<|end|>`
            continue
        spans[k] = (a, end)
    if unfound and not spans:  # the row is refused: its line names the cause where a cheap one holds
        why[unfound[0]] = unfound_why(enc, conv, unfound[0], tools, r.text) or why[unfound[0]]
    return full, spans, why


def unfound_why(enc, conv: list[dict], k: int, tools: list | None, text: str) -> str | None:
    """Why turn k's header is not where the generation prompt puts it, where a cheap explanation holds: the row's
    conversation (its rendering `text`) does not go on from that prompt, and does once the cause is taken out. In
    order: the assistant messages' `name`, which Kimi K2 writes in the header (`<|im_assistant|>{{ name or role }}
    <|im_middle|>`, moonshotai/Kimi-K2-Instruct's chat_template.jinja) where its prompt writes `assistant`; an argument
    of the row's chat_template_kwargs (Hunyuan-A13B's enable_thinking false writes `<think>\n\n</think>\n` after every
    render, vllm-project/vllm examples/tool_chat_template_hunyuan_a13b.jinja). None where neither holds (the line says
    the usual causes). Read only for a row refused with no turn located: one render, and two per cause tried (a row
    with named replies or template arguments)."""
    try:
        if text.startswith(enc._text(conv[:k], True, tools)):
            return None  # it goes on from the prompt as text: the cause is elsewhere (the tokens)
    except RowError:
        return None
    named = [m["name"] for m in conv[:k + 1] if m["role"] == "assistant" and m.get("name")]
    if named:
        plain = [{n: v for n, v in m.items() if n != "name"} if m["role"] == "assistant" else m for m in conv]
        if _goes_on(enc, plain, k, tools):
            return (f"message {k}: the template writes an assistant message's `name` ({named[0]!r}) in its header, "
                    "which its generation prompt does not: drop `name` from the assistant messages")
    for name, value in enc._row_kw.items():
        if _goes_on(enc.bound({n: v for n, v in enc._row_kw.items() if n != name}), conv, k, tools):
            return (f"message {k}: with chat_template_kwargs {name}: {json.dumps(value)} the template's generation "
                    f"prompt is not what it writes before a reply (without it, it is): drop {name} from the row's "
                    "chat_template_kwargs")
    return None


def _goes_on(enc, conv: list[dict], k: int, tools: list | None) -> bool:
    """Whether `conv` rendered goes on from the generation prompt after conv[:k] (as text: two renders)."""
    try:
        return enc._text(conv, tools=tools).startswith(enc._text(conv[:k], True, tools))
    except RowError:
        return False


def in_text(enc, tail: list[int], msg: dict) -> bool:
    """Whether a turn rendered alone (`tail`, from the reply's start) ends in the reply's text: its last token is no
    control token, or the text ends with a control token's string (`It is <|im_start|>`, tokenized as that token: it
    took trim()'s path, which ends a reply after its last control token, and trained it with no stop, uncounted)."""
    if tail[-1] not in enc.special:
        return True
    want = _nf(reply(enc, msg))[-32:]  # the end of both, decoded: a long reply costs no more
    end = tail[-(len(enc.tok.encode(want)) + 4):]
    return bool(want) and _nf(enc.tok.hf.decode(end, clean_up_tokenization_spaces=False)).rstrip().endswith(want)


def reply_end(enc, full: list[int], arr: np.ndarray, a: int, bound: int, msg: dict) -> int | None:
    """One past the first end-of-turn token at or after `a` (before `bound`) whose span shows the reply (gpt-oss
    writes a last reply's reasoning as its own message, ended by <|end|>, before the answer)."""
    for i in (np.flatnonzero(np.isin(arr[a:bound], enc.eot)) + a)[:16].tolist():
        if shows(enc, full, a, i + 1, msg):
            return through_stop(enc, full, i + 1)
    return None


def past_blanks(enc, ids: list[int], e: int, most: int = 4) -> int:
    """The first position at or after `e` whose token is not blanks alone (at most `most` further): where an
    end-of-turn written after a newline (Apriel-1.6's `reply\n<|end|>`) is, as data/chat_ends.probe_ends reads it."""
    j = e
    while j < min(e + most, len(ids)) and ids[j] not in enc.special and enc.tok.hf.decode(ids[j:j + 1]).isspace():
        j += 1
    return j


def through_stop(enc, ids: list[int], e: int) -> int:
    """`e`, or one past the stop that ends the run of control tokens right after an end-of-turn `ids[e - 1]` that
    is no stop (R7B's `<|END_RESPONSE|><|END_OF_TURN_TOKEN|>`; module doc). At most 4 tokens further."""
    _ = enc.eot  # the probe, read once: enc._carry
    stops = enc._carry
    if not stops or ids[e - 1] in stops:
        return e
    for j in range(e, min(e + 4, len(ids))):
        if ids[j] in stops:
            return j + 1
        if ids[j] not in enc.special:
            return e
    return e


def trim(enc, tail: list[int], a: int, b: int) -> int:
    """End of the reply: after the last special token of turn[a:b] (`tail`, from a) (its end-of-turn); b when
    there is none."""
    for i in range(b - 1, a - 1, -1):
        if tail[i - a] in enc.special:
            return i + 1
    return b

