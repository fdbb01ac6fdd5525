"""A long message (a haystack) spliced into a chat template's rendering: `encode_long(enc, messages, at)` gives what
`ChatEncoder.encode` (data/chat.py) gives, with that message's content tokenized once instead of once per render.

The template is rendered around a short placeholder; its text is cut at the special tokens on either side of the
placeholder (HF tokenizers split special tokens out before anything else, so tokenization never crosses them), the
outer parts are the placeholder render's tokens and mask, the text between (e.g. "user\n" + content) is tokenized
once. Used where it is checked to hold: the placeholder render splits that way, the template inserts the content
verbatim (a render of the content's head and tail, cheap), the placeholder's span has one mask value; otherwise
`encode` (exact either way; tests/unit/data/test_chat_splice.py compares both on the golden families). `encode`
also tokenizes the haystack once now (data/chat_views.py): the two cost about the same (docs/sft.md's cost
paragraph; `--chat`, `chat: true`). `stats=True`: (ids, mask, stats), `encode`'s stats (`untrained_turns`,
`no_stop_rows`: a last reply the template ends with no end-of-turn token, Qwen1.5's, so the model is never shown
where to stop; `rewritten_arguments`), for the caller to count as the preparation does.
"""

from __future__ import annotations

import numpy as np

from data.chat_rows import RowError
from data.chat_rows import message as _message
from data.chat_tools import call_ids, fit_arguments

PLACEHOLDER = "SPLICEDCONTENT"


def encode_long(enc, messages: list[dict], at: int, stats: bool = False):
    """`enc.encode` of `messages` (OpenAI form) whose message `at` is long, the content tokenized once (module doc)."""
    conv = [_message(m, i) for i, m in enumerate(messages)]
    conv, rewritten = (conv, 0) if enc.refusal else fit_arguments(enc, call_ids(enc, conv), None)  # as the template writes them
    content = conv[at]["content"]
    cut = isinstance(content, str) and enc.loss_on != "all" and enc._before_stops(content) != content  # a reply
    # ending with stops' texts, which encode cuts where it trains it: encode's own path, rare (a long reply so)
    parts = None if enc.kind == "chatml" or enc.refusal or cut else splice_parts(enc, conv, at, content)
    if parts is None:  # the ChatML default is built token by token (the content tokenized once already); or
        ids, mask, st = enc.encode({"messages": conv})  # splicing would not give encode's tokens
        st = {**st, "rewritten_arguments": rewritten}
        return (ids, mask, st) if stats else (ids, mask)
    (pre_ids, pre_mask), (soft_pre, soft_post, value), (post_ids, post_mask), st = parts
    mid = enc.tok.encode_batch([soft_pre + content + soft_post])[0]  # the Rust tokenizer without offsets
    ids, mask = pre_ids + mid + post_ids, np.concatenate([pre_mask, np.full(len(mid), value, np.uint8), post_mask])
    # the placeholder render's stats hold for the spliced tokens: the spans are the same, and the token ending the
    # last one is the same (or, the long message being the last reply, a text token either way)
    st = {**st, "rewritten_arguments": rewritten}
    return (ids, mask, st) if stats else (ids, mask)


def hard_cuts(enc, text: str) -> tuple[int, int]:
    """(end of the last special token before the placeholder, start of the first one after it) in `text`."""
    at = text.index(PLACEHOLDER)
    end = at + len(PLACEHOLDER)
    names = {enc.hf.convert_ids_to_tokens(i) for i in enc.special} - {None}
    a = max((text.rfind(n, 0, at) + len(n) for n in names if text.rfind(n, 0, at) >= 0), default=0)
    b = min((text.find(n, end) for n in names if text.find(n, end) >= 0), default=len(text))
    return a, b


def splice_parts(enc, conv: list[dict], at: int, content: str):
    """((pre ids, pre mask), (text before the content, text after it, the content's mask value), (post ids,
    post mask), the placeholder render's stats) of the placeholder render, or None where splicing would not give
    `encode`'s tokens."""
    ph = PLACEHOLDER
    try:
        text = enc._text([{**m, "content": ph} if k == at else m for k, m in enumerate(conv)])
    except RowError:
        return None  # encode says why, in its own words
    if text.count(ph) != 1 or content.count(ph):
        return None
    probe = content if len(content) <= 512 else content[:256] + content[-256:]
    shown = enc._text([{**m, "content": probe} if k == at else m for k, m in enumerate(conv)])
    if shown != text.replace(ph, probe):  # the template changes the content (trims it, ...): render it whole
        return None
    a, b = hard_cuts(enc, text)
    pre, soft_pre = text[:a], text[a:text.index(ph)]
    soft_post, post = text[text.index(ph) + len(ph):b], text[b:]
    ids, mask, st = enc.encode({"messages": [{**m, "content": ph} if k == at else m for k, m in enumerate(conv)]})
    pre_ids, mid, post_ids = enc.tok.encode(pre), enc.tok.encode(soft_pre + ph + soft_post), enc.tok.encode(post)
    if ids != pre_ids + mid + post_ids:
        return None
    span = mask[len(pre_ids):len(pre_ids) + len(mid)]
    if len(span) and span.min() != span.max():
        return None
    value = int(span[0]) if len(span) else 0
    return ((pre_ids, mask[:len(pre_ids)]), (soft_pre, soft_post, value), (post_ids, mask[len(ids) - len(post_ids):]),
            st)

