"""Chat data: a conversation row -> token ids plus a per-token loss mask, through the tokenizer's own template.

Row formats (one JSON object / table row; `row_format` tells them apart by their keys):
- OpenAI `messages`: [{"role": "system" | "user" | "assistant" | "tool", "content": str}, ...], multi-turn;
  an assistant message may carry `tool_calls` (passed on to the template) with an empty content;
- ShareGPT `conversations`: [{"from": "human" | "gpt" | "system" | "tool" | ..., "value": str}, ...];
- `prompt` / `completion`: two strings (plain text, encoded one after the other, EOS appended), or two
  message lists (TRL's conversational form: the prompt's messages, then the completion's).

What gets loss (`loss_on`, the mask: 1 = the token is a target, predicted from the token before it):
- `assistant` (default for chat rows): each assistant reply's tokens and its end-of-turn token, nothing of the
  role headers, system, user or tool turns (TRL's `assistant_only_loss`);
- `completion` (default for prompt/completion): the completion only (with messages: its assistant turns);
- `all`: every token.

How an assistant reply is found, by tokens, never by searching the text for the reply (a reply repeated in a
user turn, or a reply that is a substring of the header, would be found in the wrong place):
1. a template with `{% generation %}` markers: Hugging Face's own `return_assistant_tokens_mask`;
2. any other template (Llama 3, Qwen/ChatML, Mistral, Gemma, SmolLM as shipped): incremental prefix renders.
   For assistant turn k, `head = render(messages[:k], add_generation_prompt=True)` ends with the assistant's
   header, `turn = render(messages[:k+1])` ends with the reply and its end-of-turn; both tokenized, the reply
   is `turn[len(head):]` where the whole conversation's tokens continue them (checked token by token: the first
   token where head and the conversation differ starts the reply, in case the tokenizer merged across the
   header's end). Template text after the end-of-turn token inside the turn (ChatML's "\n") gets no loss: the
   model stops at the end-of-turn token and never generates it. A template that renders a turn differently once
   later turns follow (Qwen3 drops earlier reasoning, Mistral v0.3 moves the system prompt into the last user
   turn) keeps the header test; the reply then ends at its first end-of-turn token in the whole conversation
   (`_rewritten_end`). A turn whose header still cannot be located gets no loss and is counted
   (`untrained_turns`); a row with none located is a bad row (Mistral v0.3 with a system prompt: its template
   drops the system prompt from a conversation that ends with a reply, so no prefix render matches).
3. a tokenizer without a template (the demo's sentencepiece model, a base model's HF tokenizer): the documented
   default, ChatML built token by token: `<|im_start|>{role}\n` + content + end-of-turn + `\n`, the end-of-turn
   being the vocabulary's `<|im_end|>` token when it has one, else its EOS token (a base model then learns to
   stop where it already stops). `--chat_template chatml` forces it; `--chat_template none` refuses such rows.

Cost: the prefix renders tokenize each assistant turn's prefix twice: O(turns x length) tokens per conversation
(measured here: an 80k-token conversation with 25 replies takes 2.7 s of one core, one render 0.1 s; a 128k one
with 50 replies ~10 s); preparation is offline and parallel (`prepare_data --workers N`), so the training job
pays nothing. The mask is stored as one
uint8 per token beside the tokens (data/store.py), read with them.
"""

from __future__ import annotations

import json
import os
import random

import numpy as np

ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "model": "assistant",
                  "tool": "tool", "observation": "tool", "function_response": "tool", "ipython": "tool"}
LOSS_ON = ("auto", "assistant", "completion", "all")
CHAT_KEYS = ("messages", "conversations", "prompt")


class RowError(ValueError):
    """A row that cannot be used (bad shape, no assistant turn, a template that refuses it): a bad row."""


def row_format(obj: dict) -> str | None:
    """`messages` | `conversations` | `pair` for a chat row, None for anything else (text, input_ids)."""
    if "messages" in obj:
        return "messages"
    if "conversations" in obj:
        return "conversations"
    if "prompt" in obj and "completion" in obj:
        return "pair"
    return None


def _message(m, i: int) -> dict:
    if not isinstance(m, dict):
        raise RowError(f"message {i}: expected an object with role and content, got {type(m).__name__}")
    role = m.get("role")
    if role not in ROLES:
        raise RowError(f"message {i}: role {role!r}; expected one of {list(ROLES)}")
    content = m.get("content")
    if content is None and role == "assistant" and m.get("tool_calls"):
        content = ""
    if not isinstance(content, str):
        raise RowError(f"message {i} ({role}): content must be a string, got {type(content).__name__}")
    out = {"role": role, "content": content}
    for k in ("tool_calls", "name", "tool_call_id", "reasoning_content"):
        if m.get(k) is not None:
            out[k] = m[k]
    return out


def _sharegpt(turns) -> list[dict]:
    if not isinstance(turns, list):
        raise RowError(f"conversations: expected a list of {{from, value}}, got {type(turns).__name__}")
    out = []
    for i, t in enumerate(turns):
        if not isinstance(t, dict) or "from" not in t:
            raise RowError(f"conversations[{i}]: expected {{\"from\": ..., \"value\": ...}}, got {t!r:.60}")
        role = SHAREGPT_ROLES.get(str(t["from"]).lower())
        if role is None:
            raise RowError(f"conversations[{i}]: from {t['from']!r}; expected one of {sorted(SHAREGPT_ROLES)}")
        out.append(_message({"role": role, "content": t.get("value")}, i))
    return out


def normalize(obj: dict) -> tuple[str, list[dict] | tuple[str, str], int]:
    """(kind, conversation, first supervised message) of a chat row: kind `chat` with its messages (`first` = the
    index of the first message a `completion` loss covers: 0, or the prompt's length for conversational pairs)
    or `text_pair` with (prompt, completion). RowError on a malformed row."""
    fmt = row_format(obj)
    if fmt == "pair":
        p, c = obj["prompt"], obj["completion"]
        if isinstance(p, str) and isinstance(c, str):
            return "text_pair", (p, c), 0
        if isinstance(p, list) and isinstance(c, list):
            msgs = [_message(m, i) for i, m in enumerate(p + c)]
            return "chat", _checked(msgs), len(p)
        raise RowError("prompt/completion: expected two strings or two lists of messages, got "
                       f"{type(p).__name__} and {type(c).__name__}")
    if fmt == "messages":
        if not isinstance(obj["messages"], list):
            raise RowError(f"messages: expected a list, got {type(obj['messages']).__name__}")
        return "chat", _checked([_message(m, i) for i, m in enumerate(obj["messages"])]), 0
    if fmt == "conversations":
        return "chat", _checked(_sharegpt(obj["conversations"])), 0
    raise RowError(f"not a chat row: expected one of {list(CHAT_KEYS)} (prompt with completion), got keys {sorted(obj)}")


def _checked(msgs: list[dict]) -> list[dict]:
    if not any(m["role"] == "assistant" for m in msgs):
        raise RowError("no assistant turn: nothing to train on")
    return msgs


# ------------------------------------------------------------------ encoders


def _lcp(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two token lists (vectorised: a 128k-token render is compared in ~0.1 ms)."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if len(diff) else n


class ChatEncoder:
    """`encode(obj) -> (ids, mask, stats)` for one chat row, with one tokenizer (data/tokenizer.py's `Tokenizer`).

    `template`: `auto` (the tokenizer's own, else the ChatML default), `chatml` (the default, always) or `none`
    (the tokenizer's own, else refuse the row)."""

    def __init__(self, tokenizer, loss_on: str = "auto", template: str = "auto"):
        if loss_on not in LOSS_ON:
            raise ValueError(f"--loss_on {loss_on!r}: use one of {list(LOSS_ON)}")
        if template not in ("auto", "chatml", "none"):
            raise ValueError(f"--chat_template {template!r}: use auto, chatml or none")
        self.tok, self.loss_on = tokenizer, loss_on
        hf = getattr(tokenizer, "hf", None)
        own = getattr(hf, "chat_template", None) if hf is not None else None
        self.hf = hf if (own and template != "chatml") else None
        self.markers = bool(self.hf is not None and "{% generation %}" in own.replace("{%- generation", "{% generation"))
        if self.hf is None and template == "none":
            self.refusal = (f"tokenizer {tokenizer.path} has no chat template (--chat_template none): give one with a "
                            "template, or --chat_template chatml for the documented default")
        else:
            self.refusal = None
        self.special = set(getattr(hf, "all_special_ids", []) or []) | {tokenizer.eos_id}
        if hf is not None:
            self.special |= {i for i, t in getattr(hf, "added_tokens_decoder", {}).items() if getattr(t, "special", False)}
        im_end = hf.convert_tokens_to_ids("<|im_end|>") if hf is not None else None
        unk = getattr(hf, "unk_token_id", None) if hf is not None else None
        self.default_eot = im_end if isinstance(im_end, int) and im_end >= 0 and im_end != unk else tokenizer.eos_id
        self.kind = "markers" if self.markers else "prefix" if self.hf is not None else "chatml"

    # ---- rendering
    def _render(self, msgs: list[dict], gen: bool = False) -> list[int]:
        try:
            text = self.hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
        except Exception as e:  # jinja's raise_exception (roles must alternate, no system role, ...)
            raise RowError(f"the chat template refuses this conversation: {str(e).splitlines()[0][:160]}") from None
        return self.tok.encode(text)

    def encode(self, obj: dict) -> tuple[list[int], np.ndarray, dict]:
        kind, conv, first = normalize(obj)
        if kind == "text_pair":
            p, c = conv
            pi, ci = self.tok.encode(p), self.tok.encode(c) + [self.tok.eos_id]
            mask = np.zeros(len(pi) + len(ci), np.uint8)
            mask[0 if self.loss_on == "all" else len(pi):] = 1
            return pi + ci, mask, {"untrained_turns": 0}
        if self.refusal:
            raise RowError(self.refusal)
        loss_on = "assistant" if self.loss_on == "auto" and first == 0 else "completion" if self.loss_on == "auto" \
            else self.loss_on
        wanted = [k for k, m in enumerate(conv) if m["role"] == "assistant" and (loss_on != "completion" or k >= first)]
        if loss_on == "all":  # no span to find: the rendering alone
            ids = self._chatml(conv)[0] if self.kind == "chatml" else self._render(conv)
            return ids, np.ones(len(ids), np.uint8), {"untrained_turns": 0}
        if self.kind == "chatml":
            ids, spans = self._chatml(conv)
        elif self.kind == "markers":
            ids, spans = self._markers(conv)
            if spans is None:  # the markers do not give one run per assistant turn: find the turns by prefixes
                ids, spans = self._prefix(conv, wanted)
        else:
            ids, spans = self._prefix(conv, wanted)
        mask = np.zeros(len(ids), np.uint8)
        untrained = 0
        for k in wanted:
            span = spans.get(k)
            if span is None:
                untrained += 1
                continue
            mask[span[0]:span[1]] = 1
        if not mask[1:].any():
            raise RowError(f"none of the {untrained} assistant turn(s) could be located: the template renders the "
                           "turns differently once later ones follow (Mistral v0.3 drops a system prompt unless a "
                           "user turn is last); docs/sft.md")
        return ids, mask, {"untrained_turns": untrained}

    def encode_long(self, messages: list[dict], at: int) -> tuple[list[int], np.ndarray]:
        """(ids, mask) of `messages` (OpenAI form) whose message `at` is long (a haystack): what `encode` gives, with
        that message's content tokenized once instead of once per render. The template is rendered around a short
        placeholder; its text is cut at the special tokens on either side of the placeholder (HF tokenizers split
        special tokens out before anything else, so tokenization never crosses them), the outer parts are the
        placeholder render's tokens and mask, the text between (e.g. "user\n" + content) is tokenized once. Used
        where it is checked to hold: the placeholder render splits that way, the template inserts the content
        verbatim (a render of the content's head and tail, cheap), the placeholder's span has one mask value;
        otherwise `encode` (exact either way; tests/unit/data/test_chat_splice.py compares both on the golden
        families). A 128k-token trial: one tokenization of the haystack instead of three (`--chat`, `chat: true`)."""
        conv = [_message(m, i) for i, m in enumerate(messages)]
        content = conv[at]["content"]
        if self.kind == "chatml" or self.refusal:  # built token by token: the content is tokenized once already
            ids, mask, _ = self.encode({"messages": conv})
            return ids, mask
        parts = self._splice_parts(conv, at, content)
        if parts is None:
            ids, mask, _ = self.encode({"messages": conv})
            return ids, mask
        (pre_ids, pre_mask), (soft_pre, soft_post, value), (post_ids, post_mask) = parts
        mid = self.tok.encode(soft_pre + content + soft_post)
        return pre_ids + mid + post_ids, np.concatenate([pre_mask, np.full(len(mid), value, np.uint8), post_mask])

    PLACEHOLDER = "SPLICEDCONTENT"

    def _hard_cuts(self, text: str) -> tuple[int, int]:
        """(end of the last special token before the placeholder, start of the first one after it) in `text`."""
        at = text.index(self.PLACEHOLDER)
        end = at + len(self.PLACEHOLDER)
        names = {self.hf.convert_ids_to_tokens(i) for i in self.special} - {None}
        a = max((text.rfind(n, 0, at) + len(n) for n in names if text.rfind(n, 0, at) >= 0), default=0)
        b = min((text.find(n, end) for n in names if text.find(n, end) >= 0), default=len(text))
        return a, b

    def _splice_parts(self, conv: list[dict], at: int, content: str):
        """((pre ids, pre mask), (text before the content, text after it, the content's mask value), (post ids,
        post mask)) of the placeholder render, or None where splicing would not give `encode`'s tokens."""
        ph = self.PLACEHOLDER
        try:
            text = self.hf.apply_chat_template([{**m, "content": ph} if k == at else m for k, m in enumerate(conv)],
                                               tokenize=False)
        except Exception:
            return None  # encode says why, in its own words
        if text.count(ph) != 1 or content.count(ph):
            return None
        probe = content if len(content) <= 512 else content[:256] + content[-256:]
        shown = self.hf.apply_chat_template([{**m, "content": probe} if k == at else m for k, m in enumerate(conv)],
                                            tokenize=False)
        if shown != text.replace(ph, probe):  # the template changes the content (trims it, ...): render it whole
            return None
        a, b = self._hard_cuts(text)
        pre, soft_pre = text[:a], text[a:text.index(ph)]
        soft_post, post = text[text.index(ph) + len(ph):b], text[b:]
        ids, mask, _ = self.encode({"messages": [{**m, "content": ph} if k == at else m for k, m in enumerate(conv)]})
        pre_ids, mid, post_ids = self.tok.encode(pre), self.tok.encode(soft_pre + ph + soft_post), self.tok.encode(post)
        if ids != pre_ids + mid + post_ids:
            return None
        span = mask[len(pre_ids):len(pre_ids) + len(mid)]
        if len(span) and span.min() != span.max():
            return None
        value = int(span[0]) if len(span) else 0
        return (pre_ids, mask[:len(pre_ids)]), (soft_pre, soft_post, value), (post_ids, mask[len(ids) - len(post_ids):])

    def _chatml(self, conv: list[dict]) -> tuple[list[int], dict]:
        """The documented default, token by token: the spans are known as they are written."""
        ids, spans = [], {}
        for k, m in enumerate(conv):
            ids += self.tok.encode(f"<|im_start|>{m['role']}\n")
            a = len(ids)
            ids += self.tok.encode(m["content"]) + [self.default_eot]
            spans[k] = (a, len(ids))
            ids += self.tok.encode("\n")
        return ids, spans

    def _markers(self, conv: list[dict]) -> tuple[list[int], dict | None]:
        try:
            out = self.hf.apply_chat_template(conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        except Exception as e:
            raise RowError(f"the chat template refuses this conversation: {str(e).splitlines()[0][:160]}") from None
        ids, m = list(out["input_ids"]), np.asarray(out["assistant_masks"], dtype=np.uint8)
        # runs of 1 in generation order are the assistant turns, in order
        edges = np.flatnonzero(np.diff(np.concatenate([[0], m, [0]])))
        runs = list(zip(edges[::2].tolist(), edges[1::2].tolist()))
        turns = [k for k, msg in enumerate(conv) if msg["role"] == "assistant"]
        if len(runs) != len(turns) or ids != self._render(conv):  # merged or missing runs; another tokenization
            return ids, None
        return ids, dict(zip(turns, runs))

    def _trim(self, turn: list[int], a: int, b: int) -> int:
        """End of the reply: after the last special token of turn[a:b] (its end-of-turn); b when there is none."""
        for i in range(b - 1, a - 1, -1):
            if turn[i] in self.special:
                return i + 1
        return b

    def _prefix(self, conv: list[dict], wanted: list[int]) -> tuple[list[int], dict]:
        full = self._render(conv)
        spans = {}
        for k in wanted:
            head = self._render(conv[:k], gen=True)
            turn = self._render(conv[:k + 1])
            a = _lcp(head, full)
            if a < len(head) - 1 or a >= len(full):
                continue  # the template renders the earlier turns or the header differently here: not located
            b = _lcp(turn, full)
            if b == len(turn):  # the turn is a prefix of the whole conversation
                end = self._trim(turn, a, len(turn))
            else:
                end = self._rewritten_end(turn, full, a)
            if end is not None and end > a:
                spans[k] = (a, end)
        return full, spans

    def _rewritten_end(self, turn: list[int], full: list[int], a: int) -> int | None:
        """The reply's end in `full` when the template renders this turn differently once later turns follow:
        its first end-of-turn token (the last special token of the turn rendered alone) at or after `a`."""
        eot = next((t for t in reversed(turn[a:]) if t in self.special), None)
        if eot is None:
            return None
        for i in range(a, len(full)):
            if full[i] == eot:
                return i + 1
        return None


# ------------------------------------------------------------------ the demo's chat set


_WORDS = ("apple", "river", "candle", "forest", "mirror", "silver", "garden", "planet", "window", "tiger", "bottle",
          "castle", "dragon", "engine", "feather", "guitar", "harbor", "island", "jacket", "lemon", "marble", "needle",
          "orange", "pencil", "rocket", "saddle", "tunnel", "violin", "wallet", "yellow")


def demo_conversation(rng: random.Random) -> dict:
    """One synthetic conversation a tiny model learns in minutes: repeat, reverse or count a list of words, over
    1-3 turns, in one of the three row formats (so the demo exercises all three readers)."""
    msgs = [{"role": "system", "content": "You are a careful assistant."}] if rng.random() < 0.5 else []
    for _ in range(rng.randint(1, 3)):
        words = rng.sample(_WORDS, rng.randint(2, 5))
        op = rng.choice(("Repeat", "Reverse", "Count"))
        reply = (" ".join(words) if op == "Repeat" else " ".join(reversed(words)) if op == "Reverse"
                 else f"{len(words)} words")
        msgs += [{"role": "user", "content": f"{op} these words: {' '.join(words)}"},
                 {"role": "assistant", "content": reply}]
    form = rng.random()
    if form < 0.6:
        return {"messages": msgs}
    if form < 0.85:
        names = {"system": "system", "user": "human", "assistant": "gpt"}
        return {"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in msgs]}
    return {"prompt": msgs[:-1], "completion": msgs[-1:]}


def build_demo_chats(path: str, n: int = 4000, seed: int = 0) -> str:
    """Write `n` demo conversations as JSONL at `path` (atomic; kept when it exists)."""
    if os.path.exists(path):
        return path
    rng = random.Random(seed)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        for _ in range(n):
            fh.write(json.dumps(demo_conversation(rng)) + "\n")
    os.replace(tmp, path)
    return path


if __name__ == "__main__":  # python -m data.chat OUT.jsonl [N]: the demo's chat set
    import sys

    print(build_demo_chats(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 4000))
