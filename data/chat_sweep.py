"""The chat-template sweep: every family users fine-tune, one property, a table of what trains and what is refused.

    python -m data.chat_sweep [--markdown]      # the table in docs/sft.md (a few seconds, no network)

Each family (data/chat_templates/families.json) has a template written here that renders what the family's own
renders, with `{% generation %}` around what the model writes after its generation prompt (the reply, its
reasoning and tool calls where the family renders them, and its end-of-turn token). The template as the family
ships it is that text without the markers (the generation-marker family keeps them); the families added in 2026
(Phi-4, LFM2, GLM-4.6, DeepSeek-V3.1, Llama 4, Qwen3-Coder, Gemma 4, Seed-OSS, Phi-4-reasoning, Mistral Small 3.2,
Granite 4.0, MiniMax-M2, Nemotron Nano v2, Apertus, Command R7B's two named templates, `files`; Apriel-1.6, rendered
with and without its `training_prompt` switch, `kwargs`: the row's chat_template_kwargs; Kimi K2 0711, 0905 and
Thinking, Ministral 3 Reasoning, Magistral Small 2509, Devstral 2505 and 2507, SmolLM3 and Nemotron 3 Nano each with
thinking on and off, Qwen3-Next, Llama-3.3-Nemotron-Super-49B, Llama-3.1-Nemotron-70B, DeepSeek-R1-0528, ERNIE-4.5,
Hunyuan-A13B, EXAONE 4.0 with and without thinking, OLMo 3 Think, Phi-4-mini-reasoning) keep the template byte for byte
(ERNIE-4.5's and OLMo 3 Think's as their Python sources' literals evaluate; EXAONE 4.0's as a docstring quotes it: a
copy, its `checked` says) and a marked copy beside it (`oracle`; Phi-4-reasoning ships its markers, its own), held to
the same render by the ids check below. A small byte-level BPE tokenizer gets the family's control tokens (as single
special tokens) and its plain added tokens.

For each family and each kind of conversation (CASES; PART_CASES, contents given as lists of parts: ALL_CASES)
data/chat.py's ChatEncoder encodes the row through the shipped template, and Hugging Face's own assistant mask of the
marked template (rendering the row as given) is the oracle. The property:
- the ids are the template's rendering, tokenized, and it shows every message's text (a reply's past its reasoning)
  and its tool calls' names: what the template drops refuses the row;
- every supervised token lies in an assistant message's marked region, and every region is supervised whole or
  not at all (no token of a header, a system, user or tool message is ever supervised; no reply cut short);
- the regions not supervised are exactly the turns the encoder counts (`untrained_turns`) and the replies the row
  flags not to train (`weight` 0: never supervised, counted as `flagged_turns`);
- every supervised span decodes to text holding its reply (past its reasoning: a leading think block, or the text
  before a `</think>` the template reads as reasoning, data/chat_reasoning.think_parts; the rest whole) and its tool
  calls' names.
The same property over every other path a conversation takes to training (a prompt / completion, --loss_on
completion and all, pre-tokenized rows, encode_long, packing, the held-out split) and the sentencepiece ChatML default:
data/chat_sweep_paths.py, which reuses this sweep's tokenizers, encoders and renderings (`sweep(keep=)`).
A row the encoder refuses (RowError, one line, naming the template and the fix) passes as a refusal; a branch of
a family's template not written here (`unchecked` in families.json) is `not checked`; a WRONG cell stays WRONG in
the table, and the test allows it only in a family whose `wrong` says why (an encoder bug found, not fixed yet). `checked` names the stored
copy of the family's own template (repository and path) ours was compared with, or says that none was found. Anything else is WRONG:
tests/unit/data/test_chat_sweep.py fails on it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile

import numpy as np

from data.chat import ChatEncoder, RowError
from data.chat_reasoning import reasoning, think_parts
from data.chat_rows import REASONING
from data.chat_template import row_template
from data.tokenizer import Tokenizer

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "chat_templates")
MARKER = re.compile(r"\{%-?\s*(end)?generation\s*-?%\}")

_ASK = {"role": "user", "content": "Say exactly: apple river"}  # the reply's text comes first in a user turn
_CALL = {"id": "call00001", "type": "function",  # 9 characters: Mistral's templates refuse other ids
         "function": {"name": "count_words", "arguments": {"text": "apple river"}}}
_THINK = "Two words: apple, river."
_DEFS = json.dumps([{"name": "count_words", "description": "Count the words of a text",  # a tool list on a system
                    "parameters": {"text": {"type": "str"}}}])  # message, a JSON string (Phi-4-mini's template)
# the row's `tools` (OpenAI / TRL): a JSON-schema function, its parameter described (Command-R's tool_use needs it)
_TOOLS = [{"type": "function", "function": {"name": "count_words", "description": "Count the words of a text",
                                            "parameters": {"type": "object", "required": ["text"], "properties": {
                                                "text": {"type": "string", "description": "The text"}}}}}]
CASES = {  # name -> a conversation (every assistant message is a turn to train)
    "multi-turn": [_ASK, {"role": "assistant", "content": "apple river"},
                   {"role": "user", "content": "Count them."}, {"role": "assistant", "content": "2 words"}],
    "system": [{"role": "system", "content": "You are terse."}, _ASK, {"role": "assistant", "content": "apple river"},
               {"role": "user", "content": "Count them."}, {"role": "assistant", "content": "2 words"}],
    "tool call": [{"role": "user", "content": "How many words in apple river?"},
                  {"role": "assistant", "content": "", "tool_calls": [_CALL]},
                  {"role": "tool", "tool_call_id": "call00001", "content": "2"},
                  {"role": "assistant", "content": "2 words"}],
    "reasoning": [_ASK, {"role": "assistant", "content": "apple river", "reasoning_content": _THINK, "thinking": _THINK},
                  {"role": "user", "content": "Count them."},
                  {"role": "assistant", "content": "2 words", "reasoning_content": _THINK, "thinking": _THINK}],
    "reasoning in the content": [_ASK, {"role": "assistant", "content": f"<think>\n{_THINK}\n</think>\n\napple river"},
                                 {"role": "user", "content": "Count them."},
                                 {"role": "assistant", "content": f"<think>\n{_THINK}\n</think>\n\n2 words"}],
    "assistant first": [{"role": "assistant", "content": "Hello, what shall I count?"}, _ASK,
                        {"role": "assistant", "content": "apple river"}],
    "environment turn": [{"role": "user", "content": "How many words in apple river?"},  # OLMo 3's tool result
                         {"role": "assistant", "content": "Counting them."},
                         {"role": "environment", "content": "count_words returned 2"},
                         {"role": "assistant", "content": "2 words"}],
    "tool definitions": [{"role": "system", "content": "You are terse.", "tools": _DEFS}, _ASK,  # Phi-4-mini's form
                         {"role": "assistant", "content": "apple river"}, {"role": "user", "content": "Count them."},
                         {"role": "assistant", "content": "2 words"}],
    "tool list": [{"role": "user", "content": "How many words in apple river?"},  # with the row's `tools` (TOOLS)
                  {"role": "assistant", "content": "", "tool_calls": [_CALL]},
                  {"role": "tool", "tool_call_id": "call00001", "content": "2"},
                  {"role": "assistant", "content": "2 words"}],
    "arguments as JSON text": [{"role": "user", "content": "How many words in apple river?"},  # OpenAI's form
                               {"role": "assistant", "content": "", "tool_calls": [
                                   {**_CALL, "function": {**_CALL["function"], "arguments": '{"text": "apple river"}'}}]},
                               {"role": "tool", "tool_call_id": "call00001", "content": "2"},
                               {"role": "assistant", "content": "2 words"}],
    "a reply weighted 0": [_ASK, {"role": "assistant", "content": "apple river", "weight": 0},  # OpenAI's flag
                           {"role": "user", "content": "Count them."}, {"role": "assistant", "content": "2 words"}],
    "tool call with reasoning": [{"role": "user", "content": "How many words in apple river?"},  # gpt-oss's agents
                                 {"role": "assistant", "content": "", "tool_calls": [_CALL], "reasoning_content": _THINK,
                                  "thinking": _THINK},
                                 {"role": "tool", "tool_call_id": "call00001", "content": "2"},
                                 {"role": "assistant", "content": "2 words"}],
    "tool call with text": [{"role": "user", "content": "How many words in apple river?"},
                            {"role": "assistant", "content": "Counting them.", "tool_calls": [_CALL]},
                            {"role": "tool", "tool_call_id": "call00001", "content": "2"},
                            {"role": "assistant", "content": "2 words"}],
    "reasoning as `reasoning`": [_ASK, {"role": "assistant", "content": "apple river", "reasoning": _THINK},  # OpenRouter's
                                 {"role": "user", "content": "Count them."},  # name (data/chat_rows.py gives every name)
                                 {"role": "assistant", "content": "2 words", "reasoning": _THINK}],
    "end-of-turn text in a reply": [_ASK, {"role": "assistant", "content": "apple river"},
                                    {"role": "user", "content": "What ends your turn?"},
                                    {"role": "assistant", "content": "The token {eot} ends it."}],
}
PART_CASES = {  # conversations whose contents are lists of parts, swept and tabled after CASES (whose contents are
    # text: what the tests reading CASES take); data/chat_render `Rendering._parts`
    "reasoning as thinking parts": [_ASK, {"role": "assistant", "content": [  # mistral-common's ThinkChunk (Magistral's
        {"type": "thinking", "thinking": _THINK}, {"type": "text", "text": "apple river"}]},  # and Ministral's exports)
                                    {"role": "user", "content": "Count them."},
                                    {"role": "assistant", "content": [{"type": "thinking", "thinking": _THINK},
                                                                      {"type": "text", "text": "2 words"}]}],
}
ALL_CASES = {**CASES, **PART_CASES}
TOOLS = {"tool list": _TOOLS}  # case -> the row's top-level `tools`, passed to the template as tools=
CORPUS = ["Say exactly: apple river. Count them. 2 words. How many words in apple river? Two words: apple, river.",
          "You are terse. Hello, what shall I count? The token ends it. What ends your turn?",
          "system user assistant model tool ipython environment developer function functions count_words text",
          "[INST] [/INST] <<SYS>> USER: ASSISTANT: ```json {\"name\": \"arguments\": \"parameters\": } <think> </think>",
          "You are a helpful assistant. Cutting Knowledge Date: December 2023 Today Date: 26 Jul 2024"] * 20


def said(m: dict) -> dict:
    """The message with its content as the text a rendering must show: a content list's text parts, as a template
    that renders the list writes them (no separator; a thinking part is reasoning, not reply text)."""
    if not isinstance(m.get("content"), list):
        return m
    return {**m, "content": "".join(p["text"] for p in m["content"] if p.get("type") == "text")}


def families() -> dict[str, dict]:
    with open(os.path.join(HERE, "families.json")) as fh:
        return {k: v for k, v in json.load(fh).items() if not k.startswith("_")}


def marked(fam: dict, name: str | None = None) -> str:
    """The family's template with its generation markers (the oracle): its file (its `oracle`, the marked copy, where
    the file is the template verbatim), after the family's `prelude` (a line setting what tells two families of one
    file apart: Llama 3.2's date from the clock, DeepSeek-R1's think rules)."""
    path = (fam.get("named") or {}).get(name, fam["file"]) if name else fam.get("oracle", fam["file"])
    with open(os.path.join(HERE, path)) as fh:
        return fam.get("prelude", "") + fh.read()


def shipped(text: str) -> str:
    """The template as the family ships it: the markers taken out (they render nothing)."""
    return MARKER.sub("", text)


def as_shipped(fam: dict) -> str:
    """The family's template as it ships: its file verbatim where an `oracle` holds the marked copy (the templates
    added in 2026, kept byte for byte; the sweep's ids check holds the two equal on every conversation), else its
    marked file without the markers."""
    if not fam.get("oracle"):
        return shipped(marked(fam))
    return _read(fam["file"])


def _read(name: str) -> str:
    with open(os.path.join(HERE, name)) as fh:
        return fh.read()


def build_tokenizer(root: str, key: str, fam: dict) -> str:
    """A Hugging Face tokenizer folder for `fam` under `root` (its path): a byte-level BPE trained in a fraction of a
    second, the family's control tokens as special tokens, its template as shipped (named templates as a dict)."""
    from tokenizers import Tokenizer as Bpe
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    out = os.path.join(root, key)
    if os.path.isdir(out):
        return out
    base = os.path.join(root, "_bpe.json")
    if not os.path.exists(base):
        t = Bpe(models.BPE())
        t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        t.decoder = decoders.ByteLevel()
        t.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=500, show_progress=False,
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        t.save(base)
    tok = PreTrainedTokenizerFast(tokenizer_file=base)
    special = {"eos_token": fam["eos"], "additional_special_tokens": list(fam.get("special", []))}
    if fam.get("bos"):
        special["bos_token"] = fam["bos"]
    tok.add_special_tokens(special)
    tok.add_tokens(list(fam.get("added", [])))
    if fam.get("named"):  # `files`: a named template kept verbatim (its marked copy in `named`)
        tok.chat_template = {n: _read(fam["files"][n]) if n in fam.get("files", {}) else shipped(marked(fam, n))
                             for n in fam["named"]}
    else:
        tok.chat_template = marked(fam) if fam.get("markers") else as_shipped(fam)
    tok.save_pretrained(out)
    if fam.get("stops"):  # the model's generation config: the ids generation stops on (data/chat_ends.py's history_ends)
        with open(os.path.join(out, "generation_config.json"), "w") as fh:
            json.dump({"eos_token_id": tok.convert_tokens_to_ids(fam["stops"])}, fh)
    return out


def _runs(m: np.ndarray) -> list[tuple[int, int]]:
    edges = np.flatnonzero(np.diff(np.concatenate([[0], m, [0]])))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


def native(conv: list[dict], fam: dict) -> list[dict]:
    """conv with its tool calls' arguments in the form the family's template writes (`arguments` in families.json:
    "json string" for the templates that concatenate them, an object for the rest) and its reasoning under each name
    templates read: what the oracle renders, whatever form the row brought."""
    conv = [{**m, **dict.fromkeys(REASONING, why[1])} if m["role"] == "assistant" and (why := reasoning(said(m)))
            and why[0] == "field" else m for m in conv]  # a reply's reasoning under every name, as data/chat_message.py gives it

    def fix(a):
        if fam.get("arguments") == "json string":
            return json.dumps(a) if isinstance(a, dict) else a
        return json.loads(a) if isinstance(a, str) else a
    return [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": fix(c["function"]["arguments"])}}
                                 for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in conv]


def native_tools(tools: list | None, fam: dict) -> list | None:
    """The row's `tools` in the form the family's template reads (`tools_form` in families.json: "plain", each
    definition's function object, where it reads `tool.name` as Apertus-2509's does; OpenAI's as given for the rest)."""
    return [t.get("function", t) for t in tools] if tools and fam.get("tools_form") == "plain" else tools


def rendering(enc: ChatEncoder, oracle_template: str, conv: list[dict], tools: list | None = None,
           kwargs: dict | None = None) -> dict | str:
    """Hugging Face's rendering of `conv` (ids and assistant mask, `{% generation %}` runs) through the marked template,
    at the encoder's instant (its FrozenClock: a date template rendered past midnight would differ); the template's
    own refusal as text."""
    try:
        with enc.clock:
            return enc.tok.hf.apply_chat_template(conv, tools=tools, chat_template=oracle_template, tokenize=True,
                                                  return_dict=True, return_assistant_tokens_mask=True, **(kwargs or {}))
    except Exception as e:  # noqa: BLE001 (the template's own refusal, which the encoder should have passed on)
        return str(e).splitlines()[0][:80] if str(e) else type(e).__name__


def outcome(encode, row: dict) -> tuple[str | None, tuple | None]:
    """(a refusal's outcome, None) or (None, what `encode(row)` gives): a RowError in one line is a refusal; in more,
    or any other exception (a traceback on a user's row), WRONG."""
    try:
        return None, encode(row)
    except RowError as e:
        msg = str(e)
        return (f"WRONG: a refusal of {len(msg.splitlines())} lines" if "\n" in msg else f"refused: {msg}"), None
    except Exception as e:  # noqa: BLE001 (a traceback on a user's row)
        return f"WRONG: {type(e).__name__} ({str(e).splitlines()[0][:80] if str(e) else ''})", None


def unshown(enc: ChatEncoder, conv: list[dict], ids: list[int], first: int = 0) -> int | None:
    """The first message whose text (a reply's past its reasoning: a template may drop an earlier reply's, as at
    inference; a prompt's reply, before `first`, as the template writes history) or tool calls' names the rendering
    `ids` does not show; None where it shows every one."""
    text = enc.tok.decode(ids)
    for k, m in enumerate(map(said, conv)):
        want = "" if m["role"] == "assistant" and k < first else think_parts(enc, m["content"])[1] \
            if m["role"] == "assistant" else m["content"]
        if want.strip() not in text or not all(c["function"]["name"] in text for c in m.get("tool_calls") or []):
            return k
    return None


def check(enc: ChatEncoder, oracle_template: str, conv: list[dict], tools: list | None = None,
          oracle_conv: list[dict] | None = None, kwargs: dict | None = None, oracle_tools: list | None = None, *,
          row: dict | None = None, encode=None, first: int = 0, out: dict | str | None = None,
          seen: dict | None = None) -> str:
    """One family x one conversation (with the row's `tools` and `chat_template_kwargs`): `trains`, `trains k of n:
    why`, `refused: why` or `WRONG: what`. The oracle renders `oracle_conv` (conv with its tool-call arguments in the
    template's form) with `oracle_tools` (the row's `tools` in the form the template reads: native_tools); `out`: that
    rendering, done already (`rendering`). The other paths (data/chat_sweep_paths.py) give `row` (the conversation as
    another row form), `encode` (row -> (ids, mask, stats): another entry point) and `first` (the first message the path
    trains: the replies before it are never supervised, a prompt's); `seen` gets the rendering and the encoding."""
    decode = enc.tok.decode  # (Hugging Face's decode; a sentencepiece model's: the ChatML default's paths)
    row = row or {"messages": conv, **({"tools": tools} if tools is not None else {}),
                  **({"chat_template_kwargs": kwargs} if kwargs else {})}
    refused, got = outcome(encode or enc.encode, row)
    if refused:
        return refused
    ids, mask, stats = got
    if out is None:
        out = rendering(enc, oracle_template, oracle_conv or conv, tools if oracle_tools is None else oracle_tools, kwargs)
    if seen is not None:
        seen.update(out=out, encoded=got)
    if isinstance(out, str):
        return f"WRONG: trained a conversation the template refuses ({out})"
    rendered = list(out["input_ids"])  # and the stop the history ends a reply with, appended after the last one and
    extra = len(ids) - len(rendered) if stats.get("appended_stops") else 0  # trained (data/chat_ends.last_stop)
    if rendered != list(ids[:len(ids) - extra]) or extra and not (mask[-extra:].all() and ids[-1] in enc.special):
        return "WRONG: the ids are not the template's rendering" + (" and a stop" if extra else "")
    ids, mask = ids[:len(rendered)], mask[:len(rendered)]
    if (k := unshown(enc, conv, ids, first)) is not None:
        return f"WRONG: trains a rendering without message {k}'s text"
    oracle = np.asarray(out["assistant_masks"], dtype=np.uint8)
    turns = [k for k, m in enumerate(conv) if m["role"] == "assistant"]
    runs = _runs(oracle)
    if len(runs) != len(turns):
        return f"WRONG: the oracle marks {len(runs)} regions for {len(turns)} assistant turns (the sweep's template)"
    if (mask.astype(bool) & ~oracle.astype(bool))[1:].any():
        bad = int(np.flatnonzero(mask.astype(bool) & ~oracle.astype(bool))[-1])
        return f"WRONG: supervises a token outside every reply ({decode(ids[max(bad - 3, 0):bad + 1])!r})"
    turns, prompt = [k for k in turns if k >= first], [r for k, r in zip(turns, runs) if k < first]
    runs = runs[len(prompt):]
    if any(mask[a:b].any() for a, b in prompt):
        return "WRONG: a reply of the prompt is supervised"
    untrained, flagged, dropped = 0, [k for k in turns if conv[k].get("weight") == 0], 0
    for k, (a, b) in zip(turns, runs):
        got = mask[a:b]
        if k in flagged:
            if got.any():
                return f"WRONG: message {k}, weighted 0, is supervised"
        elif got.all():
            text = decode(ids[a:b])
            want = think_parts(enc, said(conv[k])["content"])[1]  # past its reasoning, as the template reads it, whole
            names = [c["function"]["name"] for c in conv[k].get("tool_calls") or []]  # and a thinking part's text
            names += [p["thinking"] for p in conv[k]["content"] if p.get("type") == "thinking"] \
                if isinstance(conv[k]["content"], list) else []
            if want not in text or not all(n in text for n in names):
                return f"WRONG: the span of message {k} does not show its reply ({text!r})"
            dropped += bool((why := reasoning(said(conv[k]), enc)) and why[1] not in text)
        elif not got.any():
            untrained += 1
        else:
            return f"WRONG: message {k} is supervised in part ({int(got.sum())} of {b - a} tokens)"
    if len(flagged) != stats.get("flagged_turns", 0):
        return f"WRONG: {len(flagged)} turns weighted 0, {stats['flagged_turns']} counted"
    if dropped != stats.get("dropped_reasoning", 0):
        return f"WRONG: {dropped} replies trained without their reasoning, {stats.get('dropped_reasoning', 0)} counted"
    if untrained != stats["untrained_turns"]:
        return f"WRONG: {untrained} turns untrained, {stats['untrained_turns']} counted"
    if untrained:
        return f"trains {len(turns) - untrained} of {len(turns)}: " + "; ".join(stats["why"]) + " (counted)"
    if dropped:
        return f"trains: {dropped} earlier reply's reasoning not rendered by the template (as at inference; counted)"
    return "trains"


def sweep(root: str | None = None, only: list[str] | None = None,
          keep: dict | None = None) -> dict[str, dict[str, str]]:
    """{family: {case: outcome}} over every family (or `only`), tokenizers built under `root` (a temp dir). `keep`
    gets, per (family, case), what the other paths reuse (data/chat_sweep_paths.py): the encoder, the rendering, the
    encoding and the arguments of `check`."""
    root = root or tempfile.mkdtemp(prefix="chat_sweep_")
    table = {}
    for key, fam in families().items():
        if only and key not in only:
            continue
        tok = Tokenizer(build_tokenizer(root, key, fam))
        try:
            enc = ChatEncoder(tok, "assistant", fam.get("template", "auto"))
        except ValueError as e:
            table[key] = {case: f"refused: {e}" for case in ALL_CASES}
            continue
        oracle = marked(fam, fam.get("template"))
        row = {}
        for case, conv in ALL_CASES.items():
            if case in fam.get("unchecked", {}):  # a branch of the family's template not written here
                row[case] = f"not checked: {fam['unchecked'][case]}"
                continue
            conv = [{**m, "content": m["content"].replace("{eot}", fam["eot"])} if isinstance(m["content"], str) else m
                    for m in conv]
            tools = TOOLS.get(case) or (TOOLS["tool list"] if fam.get("tools") == "always" else None)
            pick = row_template(fam.get("named"), fam.get("template", "auto"), {"tools": tools})  # auto: per row
            args = (enc, oracle if pick == fam.get("template", "auto") else marked(fam, pick), conv, tools,
                    native(conv, fam), fam.get("kwargs"), native_tools(tools, fam))
            seen = {"args": args}
            row[case] = check(*args, seen=seen).replace(os.path.join(root, ""), "")
            if keep is not None:
                keep[key, case] = {**seen, "outcome": row[case]}
        table[key] = row
    return table


def markdown(table: dict[str, dict[str, str]]) -> str:
    """The table for docs/sft.md: one row per family, one column per kind of conversation; refusals in full below."""
    fams = families()
    lines = ["| family (template written here: data/chat_templates/) | " + " | ".join(ALL_CASES) + " |",
             "|---|" + "---|" * len(ALL_CASES)]
    notes: dict[str, int] = {}
    for key, row in table.items():
        cells = []
        for case in ALL_CASES:
            out = row[case]
            if out == "trains":
                cells.append("trains")
                continue
            head, _, why = out.partition(": ")
            why = re.sub(r"token's text \[[^\]]*\]", "token's text", why.replace(f"{key}'s ", "the "))
            n = notes.setdefault(why, len(notes) + 1)
            cells.append(f"{head} [{n}]")
        lines.append(f"| {fams[key]['name']} (`{fams[key]['file']}`) | " + " | ".join(cells) + " |")
    lines.append("")
    lines += [f"[{n}] {why}" + "  " for why, n in notes.items()]
    lines += ["", "What each template written here was compared with (`checked` in families.json; rendered: the same "
              "conversations through both, string by string):", ""]
    lines += [f"- {fams[key]['name']}: {fams[key].get('checked', 'not recorded')}" for key in table]
    lines += ["", "Open (a WRONG cell: the encoder trains what the property forbids; `wrong` in families.json):", ""]
    lines += [f"- {fams[key]['name']}: {fams[key]['wrong']}" for key in table if fams[key].get("wrong")] or ["- none"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="*", help="family keys (families.json); all by default")
    p.add_argument("--markdown", action="store_true", help="the table as docs/sft.md holds it")
    a = p.parse_args(argv)
    table = sweep(only=a.only)
    if a.markdown:
        print(markdown(table))
    else:
        for key, row in table.items():
            for case, out in row.items():
                print(f"{key:20s} {case:30s} {out}")
    return int(any(o.startswith("WRONG") for row in table.values() for o in row.values()))


if __name__ == "__main__":
    raise SystemExit(main())
