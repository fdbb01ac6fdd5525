"""How data/chat.py's ChatEncoder renders a conversation through the tokenizer's template, and what that costs: every
render at one instant (`FrozenClock`), a template's refusal as one line naming it (`Rendering._text`: jinja's
raise_exception, and the tool list a template renders only with), the rendering's tokens, the tokenizer's added and
control tokens. `ChatEncoder` is a `Rendering`; split out of data/chat.py.

Cost: the template is rendered as text once per reply's prefix where it has no `{% generation %}` markers, quadratic:
~8 us x messages^2 (measured: 1,000 messages ~5 s, 5,000 ~213 s a row; markers are linear, ~10 us a token), so
prepare_data warns once of such rows (`prefix_costly`, `prefix_cost_note`; docs/sft.md). `_render` tokenizes a render
whole; the prefix path's renders are views on the conversation's one tokenization instead (data/chat_views.py).
"""

from __future__ import annotations

import datetime
import os

from data.chat_message import PARTS
from data.chat_rows import RowError

_ASK = {"role": "user", "content": "Probe question?"}
_CHUNKS = [_ASK, {"role": "assistant", "content": [{"type": "thinking", "thinking": "Probe reasoning."},
                                                    {"type": "text", "text": "Probe answer."}]}]


def prefix_costly(messages: int, tokens: int) -> bool:
    """Whether a conversation whose replies were found by prefix renders (`prefix_messages` in encode's stats) is one
    prepare_data warns of: its renders, ~8 us x messages^2, cost >= 2 s and more than a template with `{% generation %}`
    markers would (linear: ~10 us a token; measured, docs/sft.md)."""
    return messages >= 500 and 8 * messages * messages > 10 * tokens


def prefix_cost_note(where: str, messages: int, tokens: int) -> str:
    """prepare_data's one warning of the costliest such row (said once, where the first one is encoded)."""
    return (f"warning: {where}: a conversation of {messages} messages, its replies found by rendering the template "
            f"once per reply's prefix (it has no {{% generation %}} markers): ~8 us x messages^2 of CPU, "
            f"~{8e-6 * messages ** 2:.1f} s for this row (measured: 1,000 messages ~5 s, 5,000 ~213 s), said once; a "
            f"template with the markers is linear, ~{1e-5 * tokens:.1f} s for its {tokens} tokens: a tokenizer folder "
            "whose chat_template.jinja has them (TRL's training templates: qwen2_5_training.jinja ...), or "
            "--chat_template chatml for a ChatML model (its default has them); docs/sft.md")


def sandboxed(e: Exception) -> str | None:
    """Why a template cannot be rendered at all where `e` is jinja's SecurityError, None for any other error. transformers
    renders chat templates in jinja2's ImmutableSandboxedEnvironment (chat_template_utils), which forbids a method that
    changes a list or dict in place (`.append`, `.pop`, `.update`): Kimi K2 Instruct 0905's and Thinking's templates as
    llama.cpp stores them (models/templates, whose minja allows it) queue tool-call ids with `ids.append(...)` and
    `ids.pop(0)`, so Hugging Face's own apply_chat_template raises on every row with a tool call (transformers 5.23:
    "access to attribute 'append' of 'list' object is unsafe."). The fix is a copy that builds the list anew
    (`{% set ns.ids = ns.ids + [x] %}`; the jinja workaround, home-assistant/core#33678), no stored fixed copy found."""
    from jinja2.exceptions import SecurityError

    if not isinstance(e, SecurityError):
        return None
    return (f"cannot be rendered: it changes a list in place ({str(e).splitlines()[0][:80]}), which transformers' "
            "sandboxed jinja forbids (Hugging Face's apply_chat_template fails the same): give the tokenizer folder a "
            "chat_template.jinja with it rewritten, `{% set ns.ids = ns.ids + [x] %}` for `ns.ids.append(x)` and "
            "`ns.ids[0]` then `{% set ns.ids = ns.ids[1:] %}` for `ns.ids.pop(0)`")


class FrozenClock:
    """`with clock:` every template rendered inside sees one instant, `clock.at`. transformers' `strftime_now` (today's
    date in the system turn of gpt-oss, Llama 3.2 and 4, Mistral Small 3.2, Granite 3.3, Apertus) is its module's
    `datetime.now()`, read at every render; a row is rendered 4-11 times (the conversation, each prefix with and
    without the generation prompt), and a midnight between two of them left a prefix unlike the conversation at the
    date: the turn not located, the row refused for another reason or a reply left untrained. A callable given as a
    template argument does not replace it (transformers turns arguments to data). So the module's `datetime` is
    swapped for a subclass frozen at `at` and put back: process-wide, not for threads rendering with other instants
    (prepare_data's workers are processes, each rendering in one thread). Cost: two attribute sets a render (~1 us;
    a render is ~8 us x messages)."""

    def __init__(self, at: datetime.datetime | str | None = None):
        at = datetime.datetime.fromisoformat(at) if isinstance(at, str) else at or datetime.datetime.now()
        self.at, self._saved = at, []

        class Frozen(datetime.datetime):
            @classmethod
            def now(cls, tz=None):
                return at if tz is None else at.astimezone(tz)  # (a naive `at` is local time)

            @classmethod
            def today(cls):
                return at

        self._frozen = Frozen

    def __enter__(self) -> FrozenClock:
        import transformers.utils.chat_template_utils as ctu  # (imported already where a template renders)

        self._saved.append(ctu.datetime)  # a stack: a render inside another's (nested `with`) restores its own
        ctu.datetime = self._frozen
        return self

    def __exit__(self, *exc) -> None:
        import transformers.utils.chat_template_utils as ctu

        ctu.datetime = self._saved.pop()


class Rendering:
    """ChatEncoder's renders of its template, under the row's template arguments (`_row_kw`) and inside `self.clock`;
    it reads the encoder's `tok`, `hf`, `template`, `name` and `special` (data/chat.py)."""

    def _text(self, msgs: list[dict], gen: bool = False, tools: list | None = None, **kw) -> str:
        try:  # a row's `tools` as apply_chat_template and TRL pass them (data/chat_tools.py)
            with self.clock:
                return self.hf.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=gen,
                                                   chat_template=self.template, **{**self._row_kw, **kw})
        except Exception as e:  # jinja's raise_exception (roles must alternate, no system role, ...)
            if why := sandboxed(e):
                raise RowError(f"{self.name} {why}") from None
            why = str(e).splitlines()[0][:160]
            if tools is None and self._needs_tools(msgs, gen):  # Hermes' and Command-R's `tool_use` iterate `tools`
                why += (" (it renders only with a tool list: give the row's `tools`, or name another of the "
                        "tokenizer's templates with --chat_template)")
            raise RowError(f"{self.name} refuses this conversation: {why}") from None

    def _parts(self, conv: list[dict], tools: list | None = None) -> list[dict]:
        """The conversation with each content list (data/chat_message.PARTS: several parts, or a thinking part) as the
        one text the template renders it as, the key dropped. A template that renders the list itself (Mistral's,
        GLM-4.6's, Kimi K2's, Llama 4's ... `for block in content`) writes its text parts with no separator, and
        Magistral's reasoning templates (ministral3_reasoning.jinja) a thinking part (mistral-common's ThinkChunk) as
        `[THINK]...[/THINK]`, read once from a probe (`_chunks`); the text so joined is the template's rendering of the
        list as Hugging Face gives it, checked on the whole row (its list render against its text's, string by string).
        Elsewhere (a template that reads a string only: Qwen3's, Llama 3's, a list written as Python's repr or refused)
        text parts are joined by a newline (vLLM's reading for a string template), and a thinking part, which such a
        template never renders as reasoning, refuses the row in one line. Cost: two renders of a row with such a list
        (~8 us x messages each); none for any other row."""
        if not any(PARTS in m for m in conv):
            return conv
        thinking = [(k, j) for k, m in enumerate(conv) for j, p in enumerate(m.get(PARTS, ())) if p["type"] == "thinking"]
        wrap = self._chunks() if self.hf is not None and thinking else None
        plain = [{x: v for x, v in m.items() if x != PARTS} for m in conv]
        if thinking and wrap is None:
            k, j = thinking[0]
            raise RowError(f"message {k} ({conv[k]['role']}): content part {j} is a 'thinking' part (mistral-common's "
                           f"ThinkChunk), which {self.name} does not render: give the reply as one text with its reasoning "
                           "as the template writes it ([THINK]...[/THINK] for Magistral, <think>...</think> for Qwen3), "
                           "or as reasoning_content where the template renders that field")
        if self.hf is not None:
            joined = [{**m, "content": "".join(p["text"] if p["type"] == "text" else wrap[0] + p["thinking"] + wrap[1]
                                               for p in conv[k][PARTS])} if PARTS in conv[k] else m
                      for k, m in enumerate(plain)]
            listed = [{**m, "content": conv[k][PARTS]} if PARTS in conv[k] else m for k, m in enumerate(plain)]
            if (text := self._quiet(joined, tools)) is not None and text == self._quiet(listed, tools):
                return joined
        if thinking:  # (the template renders a probe's part, and this row's list otherwise: Magistral 2509's system)
            k, j = thinking[0]
            raise RowError(f"message {k} ({conv[k]['role']}): {self.name} renders this row's content parts otherwise "
                           "than as one text (it drops or reorders some): give the reasoning as the template writes it "
                           f"in the reply's text ({wrap[0]}...{wrap[1]})")
        return plain

    def _chunks(self) -> tuple[str, str] | None:
        """(the text before, the text after) a thinking part's text as the template renders a probe reply's
        [thinking, text] content list, None where that render is not the plain reply's with the reasoning inserted
        once (a template that reads a string, or only the first part's `text`: Magistral Small 2509's Unsloth copy),
        read once under the encoder's template arguments (reasoning_renders, reset by data/chat.py `_fresh`)."""
        if "chunks" not in self.reasoning_renders:
            a = self._quiet([_ASK, {"role": "assistant", "content": "Probe answer."}])
            b, wrap = self._quiet(_CHUNKS), None
            if a is not None and b is not None:
                i = len(os.path.commonprefix([a, b]))  # the texts' common head and tail, not overlapping in `a`
                j = min(len(os.path.commonprefix([a[::-1], b[::-1]])), len(a) - i)
                inserted = b[i:len(b) - j]
                if i + j == len(a) and inserted.count("Probe reasoning.") == 1:
                    wrap = tuple(inserted.split("Probe reasoning."))
            self.reasoning_renders["chunks"] = wrap
        return self.reasoning_renders["chunks"]

    def _quiet(self, msgs: list[dict], tools: list | None = None) -> str | None:
        """The template's rendering of `msgs`, None where it raises (a template reading a string given a list)."""
        try:
            with self.clock:
                return self.hf.apply_chat_template(msgs, tools=tools, tokenize=False, chat_template=self.template,
                                                   **self._row_kw)
        except Exception:  # noqa: BLE001 (what the row's own render would say, it says there)
            return None

    def _needs_tools(self, msgs: list[dict], gen: bool) -> bool:
        try:
            with self.clock:
                self.hf.apply_chat_template(msgs, tools=[], tokenize=False, add_generation_prompt=gen, **self._row_kw,
                                            chat_template=self.template)
        except Exception:  # noqa: BLE001 (it fails for another reason)
            return False
        return True

    def _render(self, msgs: list[dict], gen: bool = False, tools: list | None = None) -> list[int]:
        return self.tok.encode(self._text(msgs, gen, tools))

    def _added(self) -> set[int]:
        """The ids of the tokenizer's added tokens (control tokens and plain added ones): split out of a text before
        anything else is tokenized (data/chat_views.py)."""
        if self._added_ids is None:
            self._added_ids = set(getattr(self.hf, "added_tokens_decoder", {}) or {})
        return self._added_ids

    def _names(self) -> dict[str, int]:
        """The control tokens' texts -> ids."""
        if self._name_ids is None:
            self._name_ids = {n: i for i in self.special if (n := self.tok.hf.convert_ids_to_tokens(i))}
        return self._name_ids
