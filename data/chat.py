"""Chat data: a conversation row -> token ids plus a per-token loss mask, through the tokenizer's own template.

Rows (OpenAI `messages`, ShareGPT `conversations`, `prompt` / `completion`) are read by data/chat_rows.py; a row's
top-level `tools` (tool definitions) is passed to every render of it as `tools=`, and what a template drops (tools,
tool turns) refuses the row: data/chat_tools.py. A tool call's `arguments` (OpenAI's JSON text or an object) are given
to the template in the form it writes once (chat_tools.fit_arguments: `tojson` templates get the object).

What gets loss (`loss_on`, the mask: 1 = the token is a target, predicted from the token before it):
- `assistant` (default for chat rows): each assistant reply's tokens and its end-of-turn token, nothing of the
  role headers, system, user or tool turns (TRL's `assistant_only_loss`);
- `completion` (default for prompt/completion): the completion only (with messages: its assistant turns);
- `all`: every token.
Pre-tokenized ids with TRL's `assistant_masks` / `completion_mask`, or `labels` (-100 where not trained: TRL's processed
rows), come as `{MASKED: (ids, mask)}` (data/ids_rows.py): that mask (`all`: every token), the ids as given.

Which template: the tokenizer's own (`auto`); of named templates (Command-R, Hermes-2-Pro ship `default`,
`tool_use`, `rag`) a row's pick as transformers makes it (`tool_use` for a row with tools, else `default`:
data/chat_template.row_template), or the one named (`--chat_template tool_use`); `chatml` forces the documented
default below; `none` refuses chat rows when the tokenizer has no template; a FILE's jinja (`--chat_template
my.jinja`, read by prepare_data into the text the manifest records: data/chat_template.given_template) renders with
the tokenizer as its own would. A set of named templates without `default`, or a name it lacks: one line before any
work.

How an assistant reply is found, by tokens, never by searching the conversation's text for the reply (a reply
repeated in a user turn would be found in the wrong place):
1. a template with `{% generation %}` markers: Hugging Face's own `return_assistant_tokens_mask`, each run starting no
   earlier than where the conversation leaves the generation prompt, as point 2 finds it (data/chat_locate.prompt_cut:
   TRL's training templates mark DeepSeek's `<｜Assistant｜>`, Qwen2.5's header `\n`, Qwen3's `<think>\n`, which the
   prompt writes: the same ids get the same mask as without markers); where it ends, the markers decide (TRL's mark
   `<|im_end|>\n`, trained whole);
2. any other template: incremental prefix renders. For assistant turn k, `head = render(messages[:k],
   add_generation_prompt=True)` ends with the assistant's header; the reply starts where the whole conversation's
   tokens stop following it (the first differing token, in case the tokenizer merged across the header's end). A
   generation prompt longer than the header inside the conversation (DeepSeek-R1's `<｜Assistant｜><think>\n`)
   counts as far as the conversation follows it past the earlier messages. Earlier messages that close differently
   when last (Hermes' `tool_use`: `</tool_response><|im_end|>`, inside `</tool_response>\n<|im_end|>`): the header
   is the generation prompt's tokens, found past that difference where only blanks and control tokens lie between
   (data/chat_locate.header_after). Never inside a word of the prompt the reply shares a token with (Nemotron Nano
   v2's `<think>` and a call's `<TOOLCALL>` as plain text, both `<`...): the word's start. The reply ends at its template's
   end-of-turn token: the control token(s) the template writes right after a reply's text, read once from a
   probe conversation (mid-conversation and last: Phi-3 `<|end|>`, gpt-oss `<|end|>` and `<|return|>`), the first
   one after the reply's text, within the turn rendered alone. Never "the last control token of the turn rendered
   alone": Phi-3 / OLMo-3 end the conversation with an EOS, gpt-oss with `<|return|>`, which inside the conversation
   is the conversation's end. A turn that renders alone as a prefix of the conversation ending in its text ends at
   the end-of-turn token the conversation goes on with (Qwen1.5 writes `<|im_end|>` only when a message follows; its
   last reply has none to train: such a row is counted, `no_stop_rows`, and the preparation warns; GLM's end is the
   next message's `<|user|>`, a stop: appended after the last reply and trained, data/chat_ends.last_stop). A turn the
   template ends with another control token (gpt-oss's `<|call|>` after a tool call) ends at the turn's own last one,
   where the turn is a prefix of the conversation. Template text after the end-of-turn token (ChatML's "\n",
   Phi-3's trailing EOS) gets no loss: the model stops at the end-of-turn. An end-of-turn generation does not stop
   on, followed by control tokens up to one it does (Command R7B's `<|END_RESPONSE|><|END_OF_TURN_TOKEN|>`), is
   trained through that stop (data/chat_locate.through_stop; the stops: generation_config.json beside the tokenizer,
   else its EOS where the template writes it after every reply; neither known: the span ends at the first).
   Every span is checked: its text holds the reply's text (past a `</think>`, which R1 / Qwen3 templates drop)
   and each tool call's name; a template that does not render tool calls (Llama 3.0, SmolLM2) is a refused row,
   never an empty reply trained. A reply's reasoning (a `reasoning_content` / `thinking` / `reasoning` field, a think block) that
   the template never renders refuses the row; one it drops from the history (Qwen3, gpt-oss) is counted
   (`dropped_reasoning`): data/chat_reasoning.py. A reply holding the text of its end-of-turn token (`<|im_end|>` quoted in prose)
   gets no loss: it is tokenized as the control token (as TRL and inference servers do) and the model would learn to
   stop inside it. A turn not located (also: one the template refuses to render up to, like an assistant turn
   first) gets no loss and is counted (`untrained_turns`); a row with none located is a bad row, with the reason.
3. a tokenizer without a template (the demo's sentencepiece model, a base model's HF tokenizer): the documented
   default, ChatML built token by token: `<|im_start|>{role}\n` + content + end-of-turn + `\n`, the end-of-turn
   being the vocabulary's `<|im_end|>` token when it has one, else its EOS token (a base model then learns to
   stop where it already stops). It renders no tool calls: such a row is refused.

Cost: tokenizing is linear in the conversation. It is tokenized once (under markers: the tokens of Hugging Face's mask,
its one encode with offsets); each prefix render is a view on those tokens
(data/chat_views.py: a Hugging Face tokenizer splits control tokens out first, so a prefix's tokens up to the last
control token it shares with the conversation are the conversation's; only the short rest is tokenized). Before,
each prefix was tokenized whole: turns x length (a 1M-token conversation of 100 messages: 206 s, now 3 s). The
template is still rendered per prefix as text, quadratic: ~8 us x messages^2 (measured: 1,000 messages ~5 s, 5,000
~213 s a row; `{% generation %}` markers are linear, ~10 us a token: prepare_data warns of such rows,
data/chat_render.prefix_costly, docs/sft.md). A tokenizer without offsets takes the exact path (every prefix tokenized whole). Preparation is
offline and parallel (`prepare_data --workers N`), so the training job pays nothing. The mask is stored as one uint8 per token beside the tokens
(data/store.py). The sweep over every family's template: `python -m data.chat_sweep` (docs/sft.md).
"""

from __future__ import annotations

import copy
import datetime
import json

import numpy as np

from data.chat_demo import build_demo_chats, demo_conversation  # noqa: F401  (python -m data.chat_demo OUT.jsonl)
from data.chat_ends import history_ends, last_stop, marked_header, probe_ends
from data.chat_locate import lcp, locate, prompt_cut, shows
from data.chat_message import ROLES  # noqa: F401
from data.chat_reasoning import as_rendered, cut_why, dropped, quoted_close, refuse_dropped
from data.chat_render import FrozenClock, Rendering, sandboxed
from data.chat_rows import SHAREGPT_ROLES, RowError, empty_reply, normalize, row_format, turns_to_train  # noqa: F401
from data.chat_splice import encode_long
from data.chat_template import literal, resolve_template, row_kwargs, row_template, text_pair_kwargs
from data.chat_tools import call_ids, call_name, fit_arguments, refuse_unrendered, row_tools, tool_names
from data.chat_views import Renders
from data.ids_rows import MASKED

LOSS_ON = ("auto", "assistant", "completion", "all")
_PROBE = [{"role": "user", "content": "Probe question one?"}, {"role": "assistant", "content": "Probe answer one."},
          {"role": "user", "content": "Probe question two?"}, {"role": "assistant", "content": "Probe answer two."}]


class ChatEncoder(Rendering):
    """`encode(obj) -> (ids, mask, stats)` for one chat row, with one tokenizer (data/tokenizer.py's `Tokenizer`).

    `template`: `auto` (the tokenizer's own: of named ones `tool_use` for a row with tools, else `default`; else the
    ChatML default),
    `chatml` (the default, always), `none` (the tokenizer's own, else refuse the row) or the name of one of the
    tokenizer's named templates. `now`: the instant every render of this encoder sees (a template's `strftime_now`,
    FrozenClock): a datetime or its ISO text (prepare_data's, recorded in its shard plan); None: read here, once."""

    linear = True  # prefix renders as views on one tokenization (data/chat_views.py); False: each tokenized whole

    def __init__(self, tokenizer, loss_on: str = "auto", template: str = "auto",
                 now: datetime.datetime | str | None = None):
        if loss_on not in LOSS_ON:
            raise ValueError(f"--loss_on {loss_on!r}: use one of {list(LOSS_ON)}")
        self.tok, self.loss_on = tokenizer, loss_on
        self.clock = FrozenClock(now)  # every render (_text, _needs_tools, _markers) inside `with self.clock`
        hf = getattr(tokenizer, "hf", None)
        own = getattr(hf, "chat_template", None) if hf is not None else None
        if not isinstance(template, str) or not template:
            raise ValueError(f"--chat_template {template!r}: use auto, chatml, none, a named template's name or a "
                             "template FILE")
        if literal(template) and hf is None:
            raise ValueError(f"--chat_template FILE: tokenizer {tokenizer.path} is no Hugging Face tokenizer folder "
                             "(a jinja template renders through one): give the model's tokenizer folder")
        # the template's text and name; the ChatML default's where it has none; the template an export must carry
        self.template, self.name, self.default, self.serves = resolve_template(hf, own, template, tokenizer.path)
        self.hf = hf if self.template else None
        self.markers = bool(self.hf is not None and "{% generation %}" in self.template.replace("{%- generation",
                                                                                              "{% generation"))
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
        self._row_kw, self._bound = {}, {}  # the row's chat_template_kwargs (data/chat_template.py); encoders per set
        self.choice, self._named = template, {}  # auto's pick per row over a named set (data/chat_template.row_template)
        self._fresh()
        if self.hf is not None and not self._renders_text():
            self.refusal = (f"{self.name} renders no message text given as a string (it reads content parts, as a "
                            "multimodal processor's template does): give a tokenizer with a text chat template, or "
                            "--chat_template chatml")

    def _fresh(self) -> None:
        """What is read from the template once (end-of-turn tokens, thinking, reasoning forms): under its arguments."""
        self._eot, self._name_ids, self._added_ids, self._ends, self._stops, self._thinking = None, None, None, {}, None, None
        self.reasoning_renders, self.tool_probes = {}, {}  # the reasoning forms it renders; whether calls need ids (chat_tools)
        self._header = None  # the generation prompt's header text (data/chat_ends.marked_header)
        self._gen_header = None  # the same, unstripped (data/chat_locate.gen_header)
        self._carry = None  # the stops an end-of-turn that is none is carried on to (data/chat_locate.through_stop)

    def bound(self, kw: dict) -> ChatEncoder:
        """This encoder rendering every time with the template arguments `kw` (a row's chat_template_kwargs), its
        probes read under them; kept for the next row with the same ones (32 sets at most)."""
        key = json.dumps(kw, sort_keys=True, default=str)
        if key not in self._bound:
            if len(self._bound) >= 32:
                self._bound.pop(next(iter(self._bound)))
            enc = copy.copy(self)
            enc._row_kw, enc._bound = kw, {}
            enc._fresh()
            self._bound[key] = enc
        return self._bound[key]

    def named(self, name: str) -> ChatEncoder:
        """The encoder of the tokenizer's named template `name` (auto's pick for a row with tools: row_template),
        built once, its probes read on that template; the same instant (`now`) as this one."""
        if name not in self._named:
            self._named[name] = ChatEncoder(self.tok, self.loss_on, name, now=self.clock.at)
        return self._named[name]

    def _renders_text(self) -> bool:
        """Whether the template writes a probe reply's text (LLaVA's processor template writes only content parts'
        text: a string's would vanish, every row trained as headers alone); True where the probe does not render."""
        try:
            return "Probe answer two." in self._text(_PROBE)
        except RowError:
            return True

    # ---- rendering (_text, _needs_tools, _render, _added, _names): data/chat_render.py `Rendering`
    @property
    def eot(self) -> np.ndarray:
        """The ids that end an assistant reply in this template (data/chat_ends.py), read once."""
        if self._eot is None:
            self._eot, self._ends, self._stops, self._carry = probe_ends(self, _PROBE)
        return self._eot

    def _text_pair(self, p: str, c: str) -> tuple[list[int], list[int]]:
        """(prompt ids, completion ids) of a prompt / completion of strings, tokenized as one text (TRL's way): the
        completion alone would start a new text (sentencepiece writes its leading space, '▁The' after
        'Response:\n'; two spaces before ' 42'), a form inference never sees. Split where the prompt's own ids end;
        where a token spans the two (a BPE merge across the boundary), it is the completion's first."""
        whole = self.tok.encode(p + c)
        k = lcp(self.tok.encode(p), whole)
        return whole[:k], whole[k:]

    def encode(self, obj: dict) -> tuple[list[int], np.ndarray, dict]:
        if MASKED in obj:  # pre-tokenized ids with TRL's loss mask (data/ids_rows.py): its mask, as a chat row's
            ids, mask = obj[MASKED]
            return list(ids), np.ones(len(ids), np.uint8) if self.loss_on == "all" else mask, {"untrained_turns": 0}
        if (name := row_template(getattr(self.hf, "chat_template", None), self.choice, obj)) != self.choice:
            return self.named(name).encode(obj)  # a row with tools over Hermes' / Command-R's set: its `tool_use`
        kind, conv, first = normalize(obj)
        tools = row_tools(obj, self, conv)  # the row's top-level tool definitions, passed to every render of it
        if kind == "text_pair":
            text_pair_kwargs(obj)
        elif (kw := row_kwargs(obj, self.template, self.name, conv)) != self._row_kw:
            return self.bound(kw).encode(obj)  # the row's template arguments, in every render of it
        if kind == "text_pair" and tools:
            raise RowError(f"tools {tool_names(tools)} with a prompt / completion of strings, which no template "
                           "renders: give them as message lists (TRL's conversational form), or drop the tools")
        if kind == "text_pair":
            p, c = conv
            eos_s = self.tok.hf.eos_token if self.tok.hf is not None else None  # one EOS ending it: TRL's form (chat9)
            if self.loss_on != "all" and (cut := self._before_stops(c)) != c:  # its text, then one EOS
                c = cut + (eos_s or "")
            if self.loss_on != "all" and (why := self._stop_text(c[:-len(eos_s)] if eos_s and c.endswith(eos_s) else c)):
                raise RowError(f"completion: {why}, a stop the model would learn inside its reply (as a `messages` "
                               "reply's is refused): write those strings otherwise, or drop the row; docs/sft.md")
            pi, ci = self._text_pair(p, c)
            ci = ci if ci and ci[-1] == self.tok.eos_id else ci + [self.tok.eos_id]  # one EOS (TRL: its text's)
            if self.loss_on != "all" and not self.tok.decode(ci[:-1]).strip():  # as a chat row's empty reply
                raise RowError("completion: an empty reply (no text), which would teach the model to stop at once")
            bos = self.tok.bos_id  # the prompt as the tokenizer writes a text, BOS first (TRL tokenizes it so)
            pi = [bos] + pi if bos is not None and (not pi or pi[0] != bos) else pi
            mask = np.zeros(len(pi) + len(ci), np.uint8)
            mask[0 if self.loss_on == "all" else len(pi):] = 1
            return pi + ci, mask, {"untrained_turns": 0}
        if self.refusal:
            raise RowError(self.refusal)
        conv = self._parts(conv, tools)  # content lists as the template renders them (Mistral's thinking parts)
        loss_on = "assistant" if self.loss_on == "auto" and first == 0 else "completion" if self.loss_on == "auto" \
            else self.loss_on
        wanted, flagged = turns_to_train(conv, first, loss_on)
        if loss_on != "all":  # a reply ending with stops' texts ends there, with its template's end-of-turn
            conv = [*conv]
            for k in wanted:
                if isinstance(text := conv[k].get("content"), str) and (cut := self._before_stops(text)) != text:
                    conv[k] = {**conv[k], "content": cut}
        conv, rewritten = fit_arguments(self, call_ids(self, conv), tools)  # ids where it needs them; arguments as it writes
        # tool definitions, environment turns, the default's tool calls, a system message `all` would train without
        refuse_unrendered(self, conv, tools, wanted, whole=loss_on == "all")
        refuse_dropped(self, conv, wanted, tools)  # reasoning the template never renders
        if loss_on == "all":  # no span to find: the rendering alone
            ids = self._chatml(conv)[0] if self.kind == "chatml" else self._render(conv, tools=tools)
            end = len(ids) - (len(self.tok.encode("\n")) if self.kind == "chatml" else 0)  # the default's "\n" after
            ids, mask, stop = (ids, np.ones(len(ids), np.uint8), 0) if self.kind == "chatml" else last_stop(
                self, conv, ids, np.ones(len(ids), np.uint8), end, tools)  # GLM's <|user|> after the last reply
            return ids, mask, {"untrained_turns": 0, "no_stop_rows": self._no_stop(ids, conv, len(ids) if stop else end),
                               "rewritten_arguments": rewritten, "flagged_turns": 0, "dropped_reasoning": 0,
                               "chatml_rows": int(self.default or self.kind == "chatml"), "appended_stops": stop}
        why, located = {}, self.kind == "prefix"  # turns found by prefix renders: ~messages^2 (prepare_data warns)
        if self.kind == "chatml":
            ids, spans = self._chatml(conv)
        elif self.kind == "markers":
            ids, spans, why = self._markers(conv, tools)
            if spans is None:  # the markers do not give one run per assistant turn: find the turns by prefixes
                ids, spans, why = locate(self, as_rendered(self, conv, tools), wanted, tools)
                located = True
            else:
                self._tool_calls_shown(conv, wanted, {k: ids[a:b] for k, (a, b) in spans.items()})
                why = {k: w for k in wanted if (w := why.get(k) or self._eot_text(conv, k))}
                spans = {k: s for k, s in spans.items()
                         if k in wanted and k not in why and shows(self, ids, s[0], s[1], conv[k])}
        else:  # the history's reasoning as the whole conversation renders it (gpt-oss drops a call's once a final follows)
            ids, spans, why = locate(self, as_rendered(self, conv, tools), wanted, tools)
        for k in [k for k in wanted if k in spans and empty_reply(conv[k])]:  # raw ShareGPT dumps hold such turns
            del spans[k]
            why[k] = f"message {k}: an empty reply (no text, call or reasoning), which would teach the model to stop at once"
        if self.kind != "chatml" and (lost := [k for k in wanted if k not in spans and quoted_close(self, conv[k])]):
            text = self.tok.hf.decode(ids)  # a quoted </think> the template cut at, said (rare: one decode a row)
            why.update({k: w for k in lost if (w := cut_why(self, conv, k, text))})
        mask = np.zeros(len(ids), np.uint8)
        untrained = 0
        for k in wanted:
            span = spans.get(k)
            if span is None:
                untrained += 1
                continue
            mask[span[0]:span[1]] = 1
        history = history_ends(self, ids, spans, mask) if self.kind != "chatml" else {}  # gpt-oss's <|end|>, marked too
        if not mask[1:].any():
            reason = next(iter(why.values()), "its span does not show its text")
            raise RowError(f"none of the {untrained} assistant turn(s) could be located in {self.name}: {reason}; "
                           "docs/sft.md")
        last = spans.get(len(conv) - 1)
        ids, mask, stop = last_stop(self, conv, ids, mask, last[1] if last else None, tools)  # GLM's <|user|> after it
        return ids, mask, {"untrained_turns": untrained, "why": [why.get(k, f"message {k}: its span does not show "
                                                                   "its text") for k in wanted if k not in spans],
                           "no_stop_rows": self._no_stop(ids, conv, len(ids) if stop else last[1] if last else None),
                           "appended_stops": stop,
                           "rewritten_arguments": rewritten, "flagged_turns": flagged,
                           "dropped_reasoning": dropped(self, ids, spans, conv), **history,
                           "chatml_rows": int(self.default or self.kind == "chatml"),
                           "prefix_messages": len(conv) if located else 0}

    def _no_stop(self, ids: list[int], conv: list[dict], end: int | None) -> int:
        """1 where the conversation ends with a reply trained up to `end` and no control token ends it: the template
        writes its end-of-turn only when a message follows (Qwen1.5), so the model is never shown where to stop
        (counted in the preparation summary, data/prepare_data.py); else 0. Blanks trained after it (`--loss_on all`;
        TRL's training templates mark `<|im_end|>\n` inside `{% generation %}`) are stepped back over first."""
        while end and self.hf is not None and not self.tok.hf.decode(ids[end - 1:end]).strip():
            end -= 1  # a template's blank after its end-of-turn (ChatML templates' "\n")
        return int(conv[-1]["role"] == "assistant" and bool(end) and ids[end - 1] not in self.special)

    # ---- where a reply is
    def _tool_calls_shown(self, conv: list[dict], turns: list[int], rendered: dict[int, list[int]]) -> None:
        """A RowError where the template does not render a turn's tool calls (Llama 3.0, SmolLM2): the turn would
        train an empty reply, the model learning to stop where it should call a tool."""
        for k in turns:
            calls = conv[k].get("tool_calls") or []
            if k in rendered and calls:
                text = self.tok.hf.decode(rendered[k])
                missing = [call_name(c) for c in calls if call_name(c) not in text]
                if len(missing) == len(calls):
                    raise RowError(f"message {k} (assistant): {self.name} does not render its tool call(s) "
                                   f"{missing}, so an empty reply would be trained: use a template that renders "
                                   "tool_calls, or drop the calls")
                if missing:  # gpt-oss writes a reply's first call alone
                    raise RowError(f"message {k} (assistant): {self.name} renders only some of its tool calls, not "
                                   f"{missing}, so the reply would be trained without them: give one call per reply, "
                                   "or drop them")

    def _eot_text(self, conv: list[dict], k: int) -> str | None:
        """Why turn k gets no loss when its text holds the text of an end-of-turn token, the EOS or the family's
        end-of-text token (Tokenizer.sep_id: Qwen2.5's `<|endoftext|>`, Llama 3.1's `<|end_of_text|>`, stops of their
        generation configs): tokenized as that token, as TRL and inference servers do, it would teach the model to stop
        inside the reply. Without a generation_config.json beside the tokenizer (tokenizer.save_pretrained writes none)
        only the end-of-turn was checked, and `<|endoftext|>` quoted in code about GPT-2 trained as a mid-reply EOS."""
        return f"message {k}: {why}" if (why := self._stop_text(conv[k]["content"])) else None

    def _stop_names(self) -> dict[str, bool]:
        """The stops' texts (_eot_text) -> whether an end-of-turn token's; none for a sentencepiece model, which reads
        none from text."""
        if self.tok.hf is None:
            return {}
        eot = set(self.eot.tolist()) if self.hf is not None else set()
        stops = eot | {self.tok.eos_id, getattr(self.tok, "sep_id", self.tok.eos_id)}
        return {n: i in eot for n, i in self._names().items() if i in stops}

    def _stop_text(self, text: str) -> str | None:
        """_eot_text's reason for a reply's `text` (a messages turn's, a string completion's), None where it holds no
        stop's text."""
        stops = self._stop_names()
        names = [n for n in stops if n in text]
        what = "the end-of-turn token's text" if any(stops[n] for n in names) else \
            "the text of the EOS / end-of-text token (a stop)"
        return f"its text holds {what} {names}, which is tokenized as that token" if names else None

    def _before_stops(self, text: str) -> str:
        """A reply's `text` up to the stops it ends with (only stops' texts and blanks after the first: TRL's `text +
        eos_token` once or twice, ' Paris</s>\\n', Qwen's ' Paris<|endoftext|>'), else as given: they end it where its
        template's end-of-turn or a completion's one EOS does; a stop with text after it is still refused. TRL's add_eos
        appends the EOS only to a text not ending with it and trains every stop written (trl/trainer/sft_trainer.py): a
        stop after the first is never reached at inference, which ends at the first. Cost: one suffix test a reply."""
        stops, t = sorted(self._stop_names(), key=len, reverse=True), text
        while stops and (s := t.rstrip()).endswith(tuple(stops)):
            t = s[:-len(next(n for n in stops if s.endswith(n)))]
        return t

    def encode_long(self, messages: list[dict], at: int, stats: bool = False):
        """(ids, mask) of `messages` (OpenAI form) whose message `at` is long (a haystack): what `encode` gives, with
        that message's content tokenized once (data/chat_splice.py). `stats=True`: (ids, mask, stats)."""
        return encode_long(self, messages, at, stats)

    def _chatml(self, conv: list[dict]) -> tuple[list[int], dict]:
        """The documented default for a sentencepiece file (no Hugging Face tokenizer renders it), token by token."""
        ids, spans = [], {}
        for k, m in enumerate(conv):
            ids += self.tok.encode(f"<|im_start|>{m['role']}\n")
            a = len(ids)
            ids += self.tok.encode(m["content"]) + [self.default_eot]
            spans[k] = (a, len(ids))
            ids += self.tok.encode("\n")
        return ids, spans

    def _markers(self, conv: list[dict], tools: list | None = None) -> tuple[list[int], dict | None, dict]:
        """(ids, {turn: span}, {turn: why not trained}) from the template's `{% generation %}` runs (spans None: find
        the turns by prefixes), each run cut where the generation prompt ends (data/chat_locate.prompt_cut)."""
        try:
            with self.clock:
                out = self.hf.apply_chat_template(conv, tools=tools, tokenize=True, return_dict=True,
                                                  return_assistant_tokens_mask=True, chat_template=self.template,
                                                  **self._row_kw)
        except Exception as e:  # (a list changed in place: transformers' sandbox forbids it, chat_render.sandboxed)
            why = sandboxed(e) or f"refuses this conversation: {str(e).splitlines()[0][:160]}"
            raise RowError(f"{self.name} {why}") from None
        ids, m = list(out["input_ids"]), np.asarray(out["assistant_masks"], dtype=np.uint8)
        # runs of 1 in generation order are the assistant turns, in order
        edges = np.flatnonzero(np.diff(np.concatenate([[0], m, [0]])))
        runs = list(zip(edges[::2].tolist(), edges[1::2].tolist()))
        turns = [k for k, msg in enumerate(conv) if msg["role"] == "assistant"]
        if len(runs) != len(turns) or (runs and marked_header(self, ids, runs[0])):  # merged or missing runs, the
            return ids, None, {}  # whole header marked (SmolLM3's)
        # Tokenized once: HF's mask maps the generation blocks' characters through its one encode with offsets
        # (transformers tokenization_utils_base.apply_chat_template, out.char_to_token); the prefixes are views on
        # those tokens. _text renders the same text (same call, arguments, instant: the tracker only records where
        # blocks start, chat_template_utils._render_with_assistant_indices), Tokenizer.encode is the same call.
        # Renders tokenized it again before, only to compare: 2.7x the prefix path's CPU on a 4 MB row (docs/sft.md).
        r = Renders(self, conv, self.linear, tools, given=(ids, out.token_to_chars))
        del out  # its Encoding (offsets, token strings), not held through the prefix renders
        return (ids, *prompt_cut(self, conv, turns, runs, r))  # none of what the generation prompt writes
