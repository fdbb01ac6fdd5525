"""Which template a ChatEncoder renders with (`pick_template`) and with which arguments (`row_kwargs`).

A row may carry `chat_template_kwargs` (SmolTalk2's column; TRL's SFTTrainer passes `**example["chat_template_kwargs"]`
to every apply_chat_template call): SmolLM3 reads `enable_thinking` (a no-think row's replies open with an empty
`<think>` block) and `xml_tools` (the tool list, in its system prompt); gpt-oss reads `reasoning_effort`, Granite
`thinking`, DeepSeek-V3.1 `thinking`. Dropped, a no-think row trained as a thinking one without reasoning and a tool
trace as calls to tools never offered. They are passed to every render of the row (`ChatEncoder.bound`: an encoder of
the same template whose probes are read under those arguments, since they may change what the template writes). A
value the template does not read (its name absent from the template's text) would vanish from the trained tokens:
refused in one line, as a tool list the template drops is (data/chat_tools.py); nulls are dropped (Arrow writes one
for every key another row has), as are an empty value and a flag for an argument the template never reads (SmolTalk2's
rows carry `custom_instructions: ""`, `python_tools: []`: nothing of them is lost on Qwen3's template). What a template
reads is jinja's own list of the names it takes (`reads`).
"""

from __future__ import annotations

import functools
import json
import os

from data.chat_rows import RowError, without_nulls
from data.chat_tools import row_tools

# apply_chat_template's own parameters: a row setting one would change what is rendered, not what the template reads
RESERVED = {"conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
            "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
            "return_assistant_tokens_mask", "tokenizer_kwargs", "messages"}


CHOICES = ("auto", "chatml", "none")
FILE_ENDS = (".jinja", ".j2", ".jinja2", ".json", ".txt", ".tmpl")


def literal(template: str) -> bool:
    """Whether a --chat_template value is a template's text (a FILE's, as `given_template` read it: what a manifest
    records), not a choice nor a name: jinja's delimiters, which no template name holds."""
    return "{{" in template or "{%" in template


def given_template(value: str) -> str:
    """--chat_template as the preparation records it: auto / chatml / none / a named template's name as given; a FILE
    (TRL's chat_template_path, Axolotl's chat_template_jinja: a user's own jinja, or a fixed copy of a template that
    fails, as Kimi K2's) replaced by its text, so the manifest, the shard plan, the export and evaluate.py hold what
    the rows were rendered with, not a path that moves or a file edited after. A FILE is a `.jinja` (or any text)
    file, a `.json` with a `chat_template` string (tokenizer_config.json, chat_template.json), or a folder shipping
    chat_template.jinja / .json / tokenizer_config.json. One-line ValueError for a path that is not there, holds no
    template or does not compile (jinja's line and message), before any work."""
    if value in CHOICES or literal(value) or not (os.path.exists(value) or os.sep in value
                                                     or value.endswith(FILE_ENDS)):
        return value
    flag = f"--chat_template {value}"
    if not os.path.exists(value):
        raise ValueError(f"{flag}: no such file: give a jinja template file, a folder shipping one, or auto / chatml / "
                         "none / a named template's name")
    if os.path.isdir(value):
        found = [f for f in ("chat_template.jinja", "chat_template.json", "tokenizer_config.json")
                 if os.path.isfile(os.path.join(value, f))]
        if not found:
            raise ValueError(f"{flag}: the folder has no chat_template.jinja, chat_template.json nor "
                             "tokenizer_config.json: give the template file itself")
        return given_template(os.path.join(value, found[0]))
    try:
        with open(value, encoding="utf-8") as fh:
            text = fh.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{flag}: not readable as UTF-8 text ({type(e).__name__}: {e})") from None
    if value.endswith(".json"):
        try:
            text = json.loads(text).get("chat_template")
        except (ValueError, AttributeError):
            text = None
        if not isinstance(text, str):  # a list of named ones: the tokenizer folder itself names them (NAME)
            raise ValueError(f"{flag}: no `chat_template` string in this JSON: give the template's .jinja file, or its "
                             "tokenizer folder as --tokenizer_name_or_path with --chat_template NAME for a named one")
    if not literal(text):
        raise ValueError(f"{flag}: holds no jinja ({{{{ ... }}}} / {{% ... %}}): not a chat template")
    from jinja2 import TemplateSyntaxError

    try:
        _environment(text).parse(text)
    except TemplateSyntaxError as e:
        raise ValueError(f"{flag}: line {e.lineno}: {e.message}: not a template transformers compiles") from None
    return text


def pick_template(own, template: str, path: str) -> str | None:
    """The template text a ChatEncoder renders with: None for the ChatML default. `own` is the tokenizer's
    `chat_template` (a string, a dict of named templates, or None); `template` is auto | chatml | none | a name | a
    template's text (`given_template`'s, a FILE's)."""
    if template == "chatml":
        return None
    if literal(template):
        return template
    if isinstance(own, dict):
        name = "default" if template in ("auto", "none") else template
        if name not in own:
            lack = "none is named `default`" if name == "default" else f"none is named {name!r}"
            raise ValueError(f"tokenizer {path} ships named chat templates {sorted(own)} and {lack}: name one with "
                             "--chat_template NAME")
        return own[name]
    if template not in ("auto", "none"):
        raise ValueError(f"--chat_template {template!r}: tokenizer {path} has no named templates; use auto, chatml, "
                         "none or a template FILE")
    return own or None


def row_template(own, template: str, obj: dict) -> str:
    """The --chat_template a row is rendered with: `tool_use` where `template` is auto, the tokenizer's named set
    (`own`) has it and a `default` (Hermes-2-Pro / 3, Command-R / R7B) and the row's `tools` are a non-empty list, as
    transformers' apply_chat_template picks it (TRL passes each row's tools; vLLM resolves a request alike); else
    `template`. An empty list stays on `default` (transformers would pick `tool_use` for it: `tools is not None`),
    as a request without tools is served: LLaMA-Factory writes "[]" for a row offered none. A tools value that is no
    list refuses the row (data/chat_tools.row_tools), as it would in any template."""
    if template != "auto" or not isinstance(own, dict) or "tool_use" not in own or "default" not in own:
        return template
    return "tool_use" if row_tools(obj) else template


def resolve_template(hf, own, template: str, path: str) -> tuple[str | None, str, bool, str | None]:
    """(text, name, default, serves) of the template a ChatEncoder renders with: `default` where it is the ChatML
    default (a Hugging Face tokenizer without a template, or `--chat_template chatml`), rendered and tokenized as one
    text, as served; `serves`, what an export must carry (served_template)."""
    text = pick_template(own, template, path)
    name = ("the --chat_template file's template" if literal(template)
            else f"{path}'s `{'default' if template in ('auto', 'none') else template}` template" if isinstance(own, dict)
            else f"{path}'s template")
    default = text is None and hf is not None and template != "none"
    if default:
        text, name = chatml_template(hf), "the ChatML default"
    return text, name, default, served_template(own, template, text, default)


def chatml_template(hf) -> str:
    """The documented ChatML default for a Hugging Face tokenizer without a template (Llama 2 / Mistral v0.1 bases,
    any base model): each message `<|im_start|>role\n` + content + end-of-turn + `\n`, the end-of-turn `<|im_end|>`
    where it is a token, else the tokenizer's EOS. Rendered and tokenized as one text, as a server renders it:
    built token by token, a sentencepiece tokenizer's dummy prefix put a `▁` before every header and reply (each
    reply trained to open with a space inference never writes). Generation markers around each reply and its end."""
    im_end = hf.convert_tokens_to_ids("<|im_end|>")
    eot = "<|im_end|>" if isinstance(im_end, int) and im_end >= 0 and im_end != hf.unk_token_id else hf.eos_token
    return ("{%- for message in messages -%}{{- '<|im_start|>' + message['role'] + '\n' -}}"
            "{%- if message['role'] == 'assistant' -%}{% generation %}{{- message['content'] + " + repr(eot) +
            " -}}{% endgeneration %}{%- else -%}{{- message['content'] + " + repr(eot) + " -}}{%- endif -%}"
            "{{- '\n' -}}{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}")


def served_template(own, template: str, text: str | None, default: bool) -> str | None:
    """The template an export of a model trained on `text` must carry where the tokenizer's own default differs (the
    ChatML default on a tokenizer without one, `--chat_template chatml` over its own, a named template that is not its
    `default`): a server renders the tokenizer's default, another format than the one trained. None: the same."""
    if text is None:
        return None
    if default or template == "chatml":
        return text.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    return None if text == (own.get("default") if isinstance(own, dict) else own) else text


@functools.lru_cache(maxsize=16)
def reads(template: str) -> frozenset | None:
    """The names `template` reads from its context (jinja's undeclared variables, parsed by the environment transformers
    renders with, its `{% generation %}` tag included); None where it does not parse (the name is then looked for in the
    text: `thinking` inside `enable_thinking` passed, which Qwen3's template never reads)."""
    from jinja2 import TemplateError, meta

    try:
        return frozenset(meta.find_undeclared_variables(_environment(template).parse(template)))
    except TemplateError:  # a template transformers itself could not compile refuses every row anyway
        return None


def _environment(template: str):
    """transformers' chat-template environment (its compile function has been `_compile_jinja_template` up to 5.0 and
    `_cached_compile_jinja_template` since), else our own with the same tags: a rename of its private function must
    not turn `reads` into None (an unread argument would then pass a substring test and train as if unset)."""
    try:
        from transformers.utils import chat_template_utils as ctu

        compile_ = getattr(ctu, "_cached_compile_jinja_template", None) or ctu._compile_jinja_template
        return compile_(template).environment
    except Exception:  # noqa: BLE001 (renamed, reshaped, an old jinja refused: ours parses; a syntax error there too)
        return _own_environment()


@functools.lru_cache(maxsize=1)
def _own_environment():
    """A sandboxed environment that parses what transformers' does: `{% generation %}...{% endgeneration %}` (a call
    block, as transformers' AssistantTracker makes it) and loop controls (`{% break %}`, `{% continue %}`)."""
    import jinja2.ext
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    return ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                         extensions=[Generation, jinja2.ext.loopcontrols])


def _passed_over(v) -> bool:
    """An argument value that changes nothing where the template does not read it: null, empty, a flag."""
    return v is None or isinstance(v, bool) or _empty(v)


def _empty(v) -> bool:
    return v is None or v is False or (isinstance(v, str | list | dict | tuple) and not v) or (
        hasattr(v, "__len__") and hasattr(v, "tolist") and not len(v))


def row_kwargs(obj: dict, template: str | None, name: str, conv: list | None = None) -> dict:
    """The row's `chat_template_kwargs` (an object, or JSON text of one) that `template` (None: the ChatML default)
    renders with; empty values dropped. RowError, one line, for another form, a reserved or unread key, and thinking
    turned off (enable_thinking / thinking false) in a row whose replies (`conv`) carry reasoning: the generation
    prompt then closes an empty thinking block, so no reply with reasoning can follow it (each was left untrained,
    with another turn's reason)."""
    value = obj.get("chat_template_kwargs") if isinstance(obj, dict) else None
    if value is None or isinstance(value, str) and not value.strip():
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise RowError(f"chat_template_kwargs: {value!r:.80} is not JSON: give an object of the template's "
                           "arguments, e.g. {\"enable_thinking\": false}") from None
    if not isinstance(value, dict):
        raise RowError(f"chat_template_kwargs: a {type(value).__name__}, not an object of the template's arguments")
    out = {}
    for k, v in value.items():
        if not (isinstance(k, str) and k.isidentifier()) or k in RESERVED:
            raise RowError(f"chat_template_kwargs: {k!r} is not a template argument a row can set "
                           f"({'apply_chat_template sets it' if k in RESERVED else 'not a name'}): drop it")
        unread = template is None or k not in (reads(template) or template)
        if v is None or unread and _passed_over(v):
            continue  # Arrow's null for a key another row has; an empty value or a flag the template never reads
        if unread:
            raise RowError(f"chat_template_kwargs: {k}={without_nulls(v)!r:.60} and "
                           f"{name if template else 'the ChatML default'} "
                           "never reads it: the row would train as if it were not set; drop it, or use the tokenizer "
                           "whose template reads it")
        out[k] = without_nulls(v)
    off = [k for k in ("enable_thinking", "thinking") if out.get(k) is False]
    why = next((i for i, m in enumerate(conv or []) if m.get("role") == "assistant" and (
        m.get("reasoning_content") or m.get("thinking") or "</think>" in m.get("content", ""))), None)
    if off and why is not None:
        raise RowError(f"chat_template_kwargs: {off[0]}=false and message {why} (assistant) carries reasoning, which "
                       "the template's prompt without thinking leaves no place for: drop the reasoning, or the argument")
    return out


def text_pair_kwargs(obj: dict) -> None:
    """A RowError where a prompt / completion of strings (no template renders it) carries template arguments."""
    value = obj.get("chat_template_kwargs")
    if not _empty(value) and not (isinstance(value, dict) and all(map(_passed_over, value.values()))):
        raise RowError("chat_template_kwargs with a prompt / completion of strings, which no template renders: give "
                       "them as message lists (TRL's conversational form), or drop the arguments")


def training_switch(chat_template: str | None, tokenizer_path: str | None) -> str:
    """Where the rows' template reads `training_prompt` (Apriel-1.6 writes the last reply's end-of-turn only with it):
    the per-row switch that trains it, for prepare_data's no-stop warning. Looked for as text in the --chat_template
    file's text or the tokenizer folder's template files (one read of each, only when that warning is given)."""
    if chat_template and literal(chat_template):
        return _SWITCH if "training_prompt" in chat_template else ""
    tok = tokenizer_path or ""
    files = [os.path.join(tok, f) for f in ("chat_template.jinja", "tokenizer_config.json")]
    for f in (f for f in files if os.path.isfile(f)):
        with open(f, encoding="utf-8", errors="replace") as fh:
            if "training_prompt" in fh.read():
                return _SWITCH
    return ""


_SWITCH = '; this template writes it with chat_template_kwargs {"training_prompt": true} in each row'

