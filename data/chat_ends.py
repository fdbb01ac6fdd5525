"""Where a template ends an assistant reply (data/chat.py's ChatEncoder): its end-of-turn tokens, read once from a
probe conversation, and the one only the history writes.

- `probe_ends`: the control token written right after a probe reply's text, the reply mid-conversation and last
  (Phi-3 `<|end|>`; gpt-oss `<|end|>` and `<|return|>`; OLMo 3 `<|im_end|>` and its EOS), and the control tokens the
  model's generation config stops on (GLM ends a reply with the next message's token: `<|user|>` after an answer,
  `<|observation|>` after a tool call); the EOS where neither shows one. And the stops a reply's span is carried on
  to (data/chat_locate.through_stop): the generation config's, or without one the EOS where the template writes it
  in the control tokens right after a reply mid-conversation (Command R7B's tokenizer alone).
- `history_ends`: the end-of-turn the template writes after a reply only in the history, where the last reply ends
  with another, and which the model's generation config does not stop on (gpt-oss: `<|end|>` after a final answer
  followed by more, `<|return|>` after the last; generation stops on `<|return|>`, `<|call|>`, `<|endoftext|>`): a
  generating model never writes it there, so it gets no loss. None where the two are the same, where the token is a
  stop (OLMo 3: `<|im_end|>` mid-conversation, its EOS last, both stops), or where no generation_config.json lies
  beside the tokenizer (then it is trained, as the template writes it).
- `last_stop`: the stop the history ends a reply with where it is the next message's opening token (GLM's `<|user|>`,
  `<|observation|>` after a call), appended after a last reply the template ends with nothing, and trained.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np

from data.chat_rows import RowError
from data.tokenizer import END_OF_TEXT, TURN_STARTS

REPLIES = ("Probe answer one.", "Probe answer two.")  # the probe's replies: mid-conversation, last
# what a template's control strings look like: <|im_end|>, <end_of_turn>, </s>, [/INST], and the known ones
_CONTROL = re.compile("|".join([r"<\|[^<>|\s]{1,40}\|>", r"</?[a-z][a-z_]{0,30}>", r"\[/?[A-Z][A-Z_]{1,30}\]",
                                *map(re.escape, sorted({*TURN_STARTS, *END_OF_TEXT, *sum(END_OF_TEXT.values(), ())},
                                                       key=len, reverse=True))]))


def probe_ends(enc, probe: list[dict]) -> tuple[np.ndarray, dict[str, int], set[int] | None, set[int]]:
    """(the end-of-turn ids, {probe reply: the id after it}, the generation config's stops or None, the stops a
    reply's span is carried on to: data/chat_locate.through_stop) of `enc`'s template, from `probe` (two exchanges)
    rendered alone and after a system message; read once per encoder."""
    names, found, ends, run = enc._names(), set(), {}, set()
    for msgs in (probe, [{"role": "system", "content": "Probe system."}] + probe):
        try:
            text = enc._text(msgs)
        except RowError:
            continue
        for reply in REPLIES:
            at = text.find(reply)
            if at < 0:
                continue
            j = at + len(reply)
            while j < len(text) and text[j].isspace():
                j += 1
            hit = max((n for n in names if text.startswith(n, j)), key=len, default=None)
            if hit is None:
                unsplit(enc, text, j, reply, names)
            if hit:
                found.add(names[hit])
                ends.setdefault(reply, names[hit])
            while hit and reply == REPLIES[0] and len(run) < 4:  # the control tokens after a reply mid-conversation
                run.add(names[hit])
                j += len(hit)
                hit = max((n for n in names if text.startswith(n, j)), key=len, default=None)
        if found:
            break
    got = stops(enc.tok.path)
    # without a generation config: the EOS, where the template writes it after every reply (R7B's tokenizer alone),
    # not only at the conversation's end (Phi-4-mini's `<|end|><|endoftext|>`: there it stays untrained)
    carry = got if got is not None else {enc.tok.eos_id} & run
    found |= carry & enc.special  # a reply the next message's token ends (GLM's <|observation|>)
    return np.array(sorted(found or {enc.tok.eos_id}), dtype=np.int64), ends, got, carry


def unsplit(enc, text: str, j: int, reply: str, names) -> None:
    """A ValueError (one line) where the template writes a control-token-shaped string after a probe reply (before
    the next message's text) that the tokenizer splits into pieces, and no control token of the vocabulary (`names`)
    there: a ChatML template pasted onto a base model's tokenizer with no <|im_end|> (Mistral-7B-v0.1's, Llama 3's).
    Else earlier replies went untrained, the last one trained a stop spelled in pieces no generation stops on, and the
    export added none. Text markup before a real end-of-turn (`<answer>...</answer></s>`, `<br>`) is a reply's text,
    not its stop: it passes. One regex search per probe."""
    nxt = text.find("Probe question two?", j) if reply == REPLIES[0] else -1
    end = nxt if nxt >= 0 else len(text)
    if any(n in text[j:end] for n in names):  # the template's own end-of-turn follows the markup
        return
    m = _CONTROL.search(text, j, end)
    if m is None:
        return
    n = len(enc.tok.hf.encode(m[0], add_special_tokens=False))
    if n > 1:
        raise ValueError(f"{enc.name} ends a reply with {m[0]!r}, which tokenizer {enc.tok.path} splits into {n} "
                         "pieces (no token of its vocabulary): add it to the tokenizer as a special token and resize the "
                         "model's embeddings (tokenizer.add_special_tokens; model.resize_token_embeddings(len(tokenizer)); "
                         "save both), or use the tokenizer's own template or --chat_template chatml (which ends replies "
                         "with the EOS)")


def history_ends(enc, ids: list[int], spans: dict[int, tuple[int, int]], mask: np.ndarray) -> dict[str, int]:
    """Takes the loss off each span's last token where it is the end-of-turn only the history writes and generation
    never does (module doc: a model trained on it learns a stop its inference stack does not stop on, and runs on
    into another turn); {"history_ends": how many, "history_ends_unknown": how many such tokens were trained because
    no generation_config.json beside the tokenizer says whether generation stops on them}."""
    _ = enc.eot  # the probe, read once: enc._ends, enc._stops
    mid, last = enc._ends.get(REPLIES[0]), enc._ends.get(REPLIES[1])
    if mid is None or last is None or mid == last:
        return {"history_ends": 0, "history_ends_unknown": 0}
    known = enc._stops is not None
    cut = known and mid not in enc._stops  # generation does not stop on it
    n = 0
    for a, e in spans.values():
        if e - a > 1 and ids[e - 1] == mid:
            n += 1
            if cut:
                mask[e - 1] = 0
    return {"history_ends": n if cut else 0, "history_ends_unknown": 0 if known else n}


def stops(tokenizer_path: str) -> set[int] | None:
    """The ids the model's generation config stops on (generation_config.json's eos_token_id beside the tokenizer),
    None where there is none."""
    path = os.path.join(tokenizer_path, "generation_config.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as fh:
            eos = json.load(fh).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return None
    eos = eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else []
    return {int(i) for i in eos if isinstance(i, int)} or None


def marked_header(enc, ids: list[int], run: tuple[int, int]) -> bool:
    """Whether a `{% generation %}` run (from `return_assistant_tokens_mask`) starts with the assistant's header, the
    generation prompt's text after a probe user turn, read once per encoder (SmolLM3 wraps `<|im_start|>assistant\n`
    + reply + `<|im_end|>\n` whole): trained, the header and the newline after the end-of-turn would be learned, every
    row counted as ending without an end-of-turn. data/chat.py then finds the turns by prefixes, as any template."""
    if enc._header is None:
        probe = [{"role": "user", "content": "Probe question one?"}]
        try:
            before, head = enc._text(probe), enc._text(probe, True)
        except RowError:
            before, head = "", ""
        enc._header = head[len(before):].strip() if head.startswith(before) else ""
    return bool(enc._header) and enc.tok.hf.decode(ids[run[0]:run[1]]).lstrip().startswith(enc._header)


_NEXT = {"role": "user", "content": "Probe question two?"}  # what follows a reply in the probe (data/chat.py's _PROBE)


def last_stop(enc, conv: list[dict], ids: list[int], mask: np.ndarray, end: int | None,
              tools: list | None = None) -> tuple[list[int], np.ndarray, int]:
    """(ids, mask, 1) with the stop the history ends a reply with appended after the last reply and trained, where
    the template writes none there and that stop is the next message's opening token (GLM-4.5 / 4.6 / 4.7: a reply
    ends with `<|user|>` before a user turn, `<|observation|>` before a tool result, both stops of its generation
    config, the last reply with nothing): the model is shown where to stop, as TRL's glm4moe_training.jinja does (it
    writes `<|user|>` after the last reply, marked). Read from the conversation with one message more (a user turn, or
    a tool result after a call), rendered once: its tokens from the last control token before the reply's end
    (reasoning the history drops once a user turn follows, GLM's, lies before it) followed by blanks and a control
    token that is a stop (generation_config.json's, or the EOS) and opens that message (`opens`). `(ids, mask, 0)`
    unchanged otherwise: text after the reply, an end-of-turn written only when a message follows (Qwen1.5's
    `<|im_end|>`), none at all: counted, `no_stop_rows`, and warned. Cost: one render and tokenization of the row,
    only for a row whose last reply ends with no stop."""
    if end is None or conv[-1]["role"] != "assistant" or not enc._no_stop(ids, conv, end) or \
            enc.tok.hf.decode(ids[end:]).strip():
        return ids, mask, 0
    _ = enc.eot  # the probe, read once: enc._stops
    calls = conv[-1].get("tool_calls") or []
    nxt = _NEXT if not calls else {"role": "tool", "content": "Probe result.",
                                   **({"tool_call_id": calls[-1]["id"]} if calls[-1].get("id") else {})}
    try:
        more = enc.tok.encode(enc._text(conv + [nxt], tools=tools))
    except RowError:
        return ids, mask, 0
    added = enc._added()
    q = next((i for i in range(end - 1, -1, -1) if ids[i] in added), None)  # the last control token before the end
    if q is None:
        return ids, mask, 0
    tail = ids[q:]
    for p in range(len(more) - len(tail), max(len(more) - len(tail) - 64, -1), -1):  # the next message lies after it
        if more[p:p + len(tail)] == tail:
            j = p + len(tail)
            while j < len(more) and more[j] not in enc.special and not enc.tok.hf.decode(more[j:j + 1]).strip():
                j += 1
            stops = (enc._stops or set()) | {enc.tok.eos_id}
            if j < len(more) and more[j] in stops and more[j] in enc.special and opens(enc, more[j + 1:], nxt):
                got = more[p + len(tail):j + 1]
                mask = np.concatenate([mask[:end], np.ones(len(ids) - end + len(got), np.uint8)])
                return ids + got, mask, 1
            break
    return ids, mask, 0


def opens(enc, rest: list[int], nxt: dict) -> bool:
    """Whether the control token before `rest` opens the next message `nxt` (no other control token between it and
    the message's text: GLM's `<|user|>\n`, `<|observation|>\n<tool_response>\n`), as against an end-of-turn the
    next message's own header follows (Qwen1.5's `<|im_end|>\n<|im_start|>user\n`, Apriel-1.6's `<|end|>`: counted
    and warned as before, `no_stop_rows`)."""
    text = enc.tok.hf.decode(rest[:64])
    at = text.find(nxt["content"])
    return at >= 0 and not any(name in text[:at] for name in enc._names())
