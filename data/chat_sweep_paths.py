"""The chat-template sweep over every path a conversation takes to training: every family x every path, one property.

    python -m data.chat_sweep_paths [--only FAMILY ...]     # the table (a few seconds, no network)

data/chat_sweep.py encodes each family's conversations (ALL_CASES) as `messages` rows under `--loss_on assistant`. Here the
same conversations take the other paths users take, over the same tokenizers, encoders and renderings (`sweep(keep=)`),
and over the sentencepiece ChatML default (no template: the demo's tokenizer, `SENTENCEPIECE`). The property, for every
family x path x conversation:

  the path's ids are the template's rendering (Hugging Face's apply_chat_template of the family's marked template,
  the oracle; a stop appended after the last reply where the history ends one with it: data/chat_ends.last_stop), which
  shows every message's text and tool calls' names (what the template drops refuses the row; a prompt's reply: its
  calls, its text as the template writes history), and its supervised tokens are exactly the oracle's assistant
  regions (`{% generation %}` runs) of the replies the path trains, each whole or not at all, the ones not trained
  counted, as data/chat_sweep.check states it; or the row is refused in one line. What each path trains:
  - `pair`: TRL's conversational prompt / completion (prompt = the messages before the last reply), `--loss_on auto`:
    the completion's replies only, the prompt's never;
  - `pair, assistant`: the same row under `--loss_on assistant`: every reply, the prompt's too;
  - `completion`: a `messages` row under `--loss_on completion`: every reply (the whole conversation is completion);
  - `all`: `--loss_on all`: every token of the rendering; a row the messages path refuses because the template drops
    part of it (a tool call, a reply's text or reasoning, a tool list, a role: DROPS) is refused too;
  - `ids`: pre-tokenized rows read as prepare_data reads them (data/readers.parse_item, data/ids_rows.py, the encoder):
    the oracle's ids with its own mask (what TRL stores for assistant_only_loss) as `assistant_masks`, as `labels`
    (-100 where not trained), padded (pad ids, `attention_mask` 0), packed with the next conversation (`seq_lengths`;
    restarting `position_ids`): each conversation's ids and mask as given (under `--loss_on all`: every token);
  - `long`: `ChatEncoder.encode_long` with the first message that is no reply as the long one (spliced in 47 of the 49
    families before stop 72 added 21, the rest rendered whole; rows without `tools` or template arguments: it takes neither, data/tasks.py's
    trials carry none): the messages path's property;
  - `packed`: an SFT stage's samples (data/packing.ConvPack) of the family's trained conversations (messages and
    pair), a text document and a `--loss_on all` conversation: each document's ids and mask unchanged at its place,
    positions restarting at 0 at each, no label across a document bound (a document's last token predicts nothing,
    its first is predicted by nothing), the padding untrained, each document in exactly one sample;
  - `held out`: the held-out split (data/heldout.py through data/pipeline.RunData) of those documents, its room one
    sample and 7 tokens (so it meets a document it would cut): no conversation cut, each whole in the training
    samples or the held-out ones (the text document may be cut), packed as above.
Sampled, to keep the test within its budget: SAMPLED paths (documented equal to the messages path's turns) take every
third conversation of a family, rotating with the family, and `ids` one row form per conversation, rotating (every
form in every family); every other path every conversation; the sentencepiece default everything. Its oracle (no
Hugging Face tokenizer): the documented ChatML layout rendered by transformers (render_jinja_template's generation
indices: which characters are the replies), tokenized part by part as the default is built (data/chat.py point 3). A
traceback on a user's row is WRONG. A WRONG cell passes the test only where WRONG below records the bug it shows (in
the code of that path, not fixed yet); fixed, the record goes. Cost: ~3.5 s of CPU over the 70 families (the
renderings are the messages sweep's), plus data/pipeline's import of torch where no test before imported it.
"""

from __future__ import annotations

import argparse
import json
import os
import re

import numpy as np

from data.chat import ChatEncoder, RowError
from data.chat_sweep import ALL_CASES, TOOLS, check, families, outcome, rendering, sweep, unshown
from data.tokenizer import Tokenizer

PATHS = ("pair", "pair, assistant", "completion", "all", "ids", "long", "packed", "held out")
SAMPLED = ("pair, assistant", "completion", "long")  # every third conversation of a family, rotating (module doc)
IDS_FORMS = ("assistant_masks", "labels", "padded", "seq_lengths", "position_ids")  # a family's conversations: one each
SENTENCEPIECE = "recipes/base/tiny_passkey256/tokenizer.model"  # the demo's model: no template, the ChatML default
DROPS = re.compile(r"does not render|never renders|renders only|renders a reply's reasoning only")
WRONG: dict[tuple[str, str], str] = {}  # (family, path) -> the bug its WRONG cells show (in data/chat*.py, not fixed
# yet); fixed, the record goes


def _first(conv: list[dict]) -> int:
    """Where a conversational pair's completion starts: at the last reply (TRL's prompt / completion split)."""
    return max(k for k, m in enumerate(conv) if m["role"] == "assistant")


def _extras(tools, kwargs) -> dict:
    return {**({"tools": tools} if tools is not None else {}), **({"chat_template_kwargs": kwargs} if kwargs else {})}


def check_all(enc: ChatEncoder, row: dict, out: dict | str, messages: str) -> str:
    """`--loss_on all`: every token supervised, the ids the rendering (and a stop appended); refused where the messages
    path (outcome `messages`) refuses a row because the template drops part of it."""
    refused, got = outcome(enc.encode, row)
    if refused:
        return refused
    ids, mask, stats = got
    if messages.startswith("refused") and DROPS.search(messages):
        return f"WRONG: trains every token of a row the template drops part of ({messages[9:90]})"
    if isinstance(out, str):
        return f"WRONG: trained a conversation the template refuses ({out})"
    rendered, extra = list(out["input_ids"]), stats.get("appended_stops", 0)
    if list(ids[:len(ids) - extra]) != rendered or len(ids) != len(rendered) + extra:
        return "WRONG: the ids are not the template's rendering"
    if (k := unshown(enc, row["messages"], ids)) is not None:
        return f"WRONG: trains every token of a rendering without message {k}'s text"
    if not mask.all():
        return f"WRONG: {int((mask == 0).sum())} token(s) not supervised"
    return "trains"


def _ids_rows(ids: list[int], mask: list[int], nxt: tuple[list[int], list[int]], pad: int) -> dict[str, tuple]:
    """Row form -> (the JSON row, the documents it holds: [(ids, mask)])."""
    labels = [t if m else -100 for t, m in zip(ids, mask)]
    both_ids, both_mask = ids + nxt[0], mask + nxt[1]
    return {
        "assistant_masks": ({"input_ids": ids, "assistant_masks": mask}, [(ids, mask)]),
        "labels": ({"input_ids": ids, "labels": labels}, [(ids, mask)]),
        "padded": ({"input_ids": ids + [pad] * 3, "completion_mask": mask + [0] * 3,
                    "attention_mask": [1] * len(ids) + [0] * 3}, [(ids, mask)]),
        "seq_lengths": ({"input_ids": both_ids, "assistant_masks": both_mask, "seq_lengths": [len(ids), len(nxt[0])]},
                        [(ids, mask), nxt]),
        "position_ids": ({"input_ids": both_ids, "labels": [t if m else -100 for t, m in zip(both_ids, both_mask)],
                          "position_ids": list(range(len(ids))) + list(range(len(nxt[0])))}, [(ids, mask), nxt]),
    }


def check_ids(encs: dict[str, ChatEncoder], ids: list[int], mask: list[int], nxt, pad: int,
              forms: tuple[str, ...] = IDS_FORMS) -> str:
    """Pre-tokenized rows (data/ids_rows.py) in `forms`, read as data/prepare_data.py reads them: each document as
    given."""
    from data.ids_rows import MASKED, documents
    from data.readers import Fields, parse_item

    for form, (obj, want) in _ids_rows(ids, mask, nxt, pad).items():
        if form not in forms:
            continue
        value, _, err = parse_item(json.dumps(obj).encode(), Fields())
        if err:
            if "\n" in err:
                return f"WRONG: {form}: a refusal of {len(err.splitlines())} lines"
            if not all(np.asarray(m)[1:].any() for _, m in want):  # (a document with nothing to train, an oracle of a
                continue  # template that drops a reply's text: data/ids_rows.py refuses the row, rightly)
            return f"WRONG: {form}: refused ({err[:100]})"
        pieces = documents(value)[0]
        if len(pieces) != len(want) or not all(isinstance(p, dict) and MASKED in p for p in pieces):
            return f"WRONG: {form}: read as {len(pieces)} document(s) without their mask, given {len(want)}"
        for loss_on, enc in encs.items():
            for p, (w_ids, w_mask) in zip(pieces, want):
                refused, got = outcome(enc.encode, p)
                if refused:
                    return f"WRONG: {form} (--loss_on {loss_on}): {refused[7 if refused.startswith('WRONG') else 0:]}"
                got_ids, got_mask, _ = got
                w_mask = [1] * len(w_ids) if loss_on == "all" else w_mask
                if list(got_ids) != list(w_ids) or np.asarray(got_mask).tolist() != list(w_mask):
                    return f"WRONG: {form} (--loss_on {loss_on}): the ids or the mask are not the row's"
    return "trains"


def check_pack(pack, tokens: np.ndarray, mask: np.ndarray, want: set[tuple[int, int]]) -> str:
    """An SFT pack's samples against the stream they were cut from: `want` the (start, length) of every document the
    pack must hold, whole, once."""
    placed = []
    for i in range(len(pack)):
        s = pack[i]
        ids, labels, pos = s["input_ids"], s["shift_labels"], s["position_ids"]
        at = 0
        for k in pack.order[pack.bounds[i]:pack.bounds[i + 1]].tolist():
            st, ln = int(pack.starts[k]), int(pack.lens[k])
            placed.append((st, ln))
            doc, m = tokens[st:st + ln], mask[st:st + ln].astype(bool)
            if not np.array_equal(ids[at:at + ln], doc):
                return f"WRONG: sample {i}: the document at {at} is not its ids"
            if not np.array_equal(pos[at:at + ln], np.arange(ln)):
                return f"WRONG: sample {i}: positions do not restart at 0 at the document at {at}"
            want_labels = np.where(m[1:], doc[1:], -100)
            if not np.array_equal(labels[at:at + ln - 1], want_labels):
                return f"WRONG: sample {i}: the labels of the document at {at} are not its mask's"
            if labels[at + ln - 1] != -100:
                return f"WRONG: sample {i}: the document at {at} predicts the next one's first token"
            at += ln
        if at < len(ids) and ((labels[at:] != -100).any() or pos[at] != 0 or (at and labels[at - 1] != -100)):
            return f"WRONG: sample {i}: its padding is supervised or attends to the documents"
    if sorted(placed) != sorted(want):
        return f"WRONG: {len(placed)} documents placed, {len(want)} given (lost, cut or twice)"
    return "trains"


def check_stream(docs: list[tuple[list[int], np.ndarray]], pad: int) -> tuple[str, str]:
    """(`packed`, `held out`) outcomes of the documents (ids, mask) as one prepared stream."""
    import types

    from data.heldout import heldout_split
    from data.packing import ConvPack
    from data.pipeline import RunData, _chat

    lens = np.asarray([len(i) for i, _ in docs], np.int64)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
    tokens = np.concatenate([np.asarray(i, np.int64) for i, _ in docs])
    mask = np.concatenate([np.asarray(m, np.uint8) for _, m in docs])
    L = int(2 * lens.max())
    whole = {(int(s), int(n)) for s, n in zip(starts, lens)}
    packed = check_pack(ConvPack(tokens, mask, starts, lens, L, pad), tokens, mask, whole)
    prepared = types.SimpleNamespace(tokens=tokens, starts=starts, lens=lens, mask=mask)
    # room for one sample and 7 tokens more: the split takes whole documents, then meets one it would cut
    cut, held, _ = heldout_split(lens, [(L, 2)], int(lens.sum()) - L - 7, chat=_chat(prepared))
    chat = np.asarray([not np.asarray(m)[1:].all() for _, m in docs])
    if ((cut > 0) & (cut < lens) & chat).any():
        return packed, f"WRONG: conversation {int(np.flatnonzero((cut > 0) & (cut < lens) & chat)[0])} cut in two"
    run = RunData(prepared, cut, held, None, True)
    train = {(int(s), int(c)) for s, c in zip(starts, cut) if mask[s + 1:s + c].any()}  # (a text head of 1: none)
    out = check_pack(run.train_set(L, sft=True), tokens, mask, train)
    if not out.startswith("WRONG"):
        test = {(int(starts[d]), int(lens[d])) for d in held.tolist() if chat[d]}
        out = check_pack(run._heldout_conversations(L)[0], tokens, mask, test)
    return packed, out


def sp_rendering(enc: ChatEncoder, conv: list[dict]) -> dict | str:
    """The ChatML default's oracle for a sentencepiece model: the documented template (data/chat_template.
    chatml_template) rendered by transformers with its generation indices, tokenized part by part (each header, content,
    end-of-turn and newline alone, as the default is built: data/chat.py point 3); `\x01` / `\x02` mark where the
    template's header starts and ends and where it writes the end-of-turn (a content holding their text is text)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    template = ("{%- for message in messages -%}{{- '\x01<|im_start|>' + message['role'] + '\n\x01' -}}"
                "{%- if message['role'] == 'assistant' -%}{% generation %}{{- message['content'] + '\x02' -}}"
                "{% endgeneration %}{%- else -%}{{- message['content'] + '\x02' -}}{%- endif -%}{{- '\n' -}}"
                "{%- endfor -%}")
    try:
        text, spans = render_jinja_template(conversations=[conv], chat_template=template,
                                            return_assistant_tokens_mask=True)
    except Exception as e:  # noqa: BLE001
        return str(e).splitlines()[0][:80]
    text, spans = text[0], spans[0]
    cuts = sorted({0, len(text)} | {i for i, c in enumerate(text) if c == "\x01"}
                  | {j for i, c in enumerate(text) if c == "\x02" for j in (i, i + 1)} | {x for s in spans for x in s})
    ids, mask = [], []
    for a, b in zip(cuts, cuts[1:]):
        part = text[a:b].replace("\x01", "")
        got = [enc.tok.eos_id] if part == "\x02" else enc.tok.encode(part) if part else []
        ids += got
        mask += [int(any(s <= a and b <= e for s, e in spans))] * len(got)
    return {"input_ids": ids, "assistant_masks": mask}


def _cells(key: str, kept: dict, encs: dict, index: int | None = None) -> dict[str, dict[str, str]]:
    """{path: {case: outcome}} of one family (the `index`-th: the SAMPLED paths take every third of its conversations,
    from the index on; None: every one, and the sentencepiece oracle)."""
    sp = index is None
    rows: dict[str, dict[str, str]] = {p: {} for p in PATHS}
    docs, oracles = [], []
    enc = encs["assistant"]
    pad = enc.tok.pad_id
    for j, case in enumerate(ALL_CASES):
        sampled = sp or (index + j) % 3 == 0
        seen = kept.get((key, case))
        if seen is None:  # `not checked` in the messages sweep: a branch of the template not written here
            continue
        args, messages = seen["args"], seen["outcome"]
        _, template, conv, tools, oconv, kwargs, otools = args
        out = seen.get("out") or (sp_rendering(enc, oconv) if sp else rendering(enc, template, oconv, otools, kwargs))
        first = _first(conv)
        pair = {"prompt": conv[:first], "completion": conv[first:], **_extras(tools, kwargs)}
        kept_pair = {}
        rows["pair"][case] = check(encs["auto"], *args[1:], row=pair, first=first, out=out, seen=kept_pair)
        if sampled:
            rows["pair, assistant"][case] = check(enc, *args[1:], row=pair, out=out)
            rows["completion"][case] = check(encs["completion"], *args[1:], out=out)
        rows["all"][case] = check_all(encs["all"], {"messages": conv, **_extras(tools, kwargs)}, out, messages)
        if sampled and tools is None and not kwargs:  # (encode_long takes neither: data/tasks.py's trials carry none)
            at = next(k for k, m in enumerate(conv) if m["role"] != "assistant")
            rows["long"][case] = check(enc, *args[1:], encode=lambda _, c=conv, a=at: enc.encode_long(c, a, True),
                                       out=out)
        if not isinstance(out, str):
            oracles.append((case, list(out["input_ids"]), [int(x) for x in out["assistant_masks"]]))
        for got, said in ((seen.get("encoded"), messages), (kept_pair.get("encoded"), rows["pair"][case])):
            if got and said.startswith("trains"):
                docs.append((list(got[0]), np.asarray(got[1], np.uint8)))
    for k, (case, ids, m) in enumerate(oracles):  # the oracle's own mask, as TRL stores it (assistant_only_loss)
        forms = IDS_FORMS if sp else IDS_FORMS[(index + k) % len(IDS_FORMS):][:1]  # one form a conversation, rotating
        rows["ids"][case] = check_ids({"assistant": enc, "all": encs["all"]}, ids, m, oracles[(k + 1) % len(oracles)][1:],
                                      pad, forms)
    if docs:  # and a text document (every token a target) and a conversation under --loss_on all
        text = enc.tok.encode("Two words: apple, river. Say exactly: apple river.") + [enc.tok.eos_id]
        docs.append((text, np.ones(len(text), np.uint8)))
        try:
            ids, m, _ = encs["all"].encode({"messages": kept[key, "multi-turn"]["args"][2]})
            docs.append((list(ids), np.asarray(m, np.uint8)))
        except (RowError, KeyError):
            pass
        rows["packed"]["every conversation"], rows["held out"]["every conversation"] = check_stream(docs, pad)
    return rows


def sweep_paths(root: str, kept: dict, only: list[str] | None = None) -> dict[str, dict[str, dict[str, str]]]:
    """{family: {path: {case: outcome}}} over the families `sweep(root, keep=kept)` swept (or `only`), and the
    sentencepiece ChatML default (`sentencepiece`)."""
    table = {}
    for index, (key, fam) in enumerate(families().items()):
        if only and key not in only or not any(k == key for k, _ in kept):
            continue
        first = kept[next(k for k in kept if k[0] == key)]["args"][0]
        tok, template = first.tok, fam.get("template", "auto")
        encs = {"assistant": first, **{lo: ChatEncoder(tok, lo, template, now=first.clock.at)
                                      for lo in ("auto", "completion", "all")}}
        table[key] = _cells(key, kept, encs, index)
    if not only or "sentencepiece" in only:
        tok = Tokenizer(SENTENCEPIECE)
        encs = {lo: ChatEncoder(tok, lo) for lo in ("assistant", "auto", "completion", "all")}
        kept_sp = {}
        for case, conv in ALL_CASES.items():
            conv = [{**m, "content": m["content"].replace("{eot}", "</s>")} if isinstance(m["content"], str) else m
                    for m in conv]
            tools = TOOLS.get(case)
            seen = {"args": (encs["assistant"], None, conv, tools, conv, None, tools)}
            out = sp_rendering(encs["assistant"], conv)
            seen["outcome"] = check(*seen["args"], out=out, seen=seen)
            seen["out"] = out
            kept_sp["sentencepiece", case] = seen
        table["sentencepiece"] = {"messages": {c: kept_sp["sentencepiece", c]["outcome"] for c in ALL_CASES},
                                  **_cells("sentencepiece", kept_sp, encs)}
    cut = os.path.join(root, "")
    return {f: {p: {c: out.replace(cut, "") for c, out in cells.items()} for p, cells in paths.items()}
            for f, paths in table.items()}


def wrong_cells(table: dict) -> dict[tuple[str, str, str], str]:
    return {(f, p, c): out for f, paths in table.items() for p, cells in paths.items() for c, out in cells.items()
            if out.startswith("WRONG")}


def main(argv: list[str] | None = None) -> int:
    import tempfile

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="*", help="family keys (families.json, or sentencepiece); all by default")
    a = p.parse_args(argv)
    root, kept = tempfile.mkdtemp(prefix="chat_sweep_"), {}
    fams = [f for f in a.only or [] if f != "sentencepiece"]
    if fams or not a.only:
        sweep(root, fams or None, keep=kept)
    table = sweep_paths(root, kept, a.only)
    for key, paths in table.items():
        for path, cells in paths.items():
            for case, out in cells.items():
                print(f"{key:20s} {path:16s} {case:28s} {out}")
    return int(bool(set((f, p) for f, p, _ in wrong_cells(table)) - set(WRONG)))


if __name__ == "__main__":
    raise SystemExit(main())
