"""A pre-tokenized row's columns beside its ids, for data/readers.parse_item and data/jsonl.read_documents: `labels`
(axolotl's / LLaMA-Factory's preprocessed output), `attention_mask` (a tokenizer's padding), TRL's loss masks
(`assistant_masks`, `completion_mask`: 1 = the token is a target) and packing columns (`seq_lengths`, `position_ids`
that restart: several documents in one row, TRL's pack_dataset / axolotl's sample packing).

- `attention_mask`: all ones is no change; zeros at the row's start or end are padding, stripped with the same
  slice of every other column (labels of -100 over the padding then match); zeros between ones are refused. Without
  one, padding its labels show (`_label_pads`: -100 over a run of one id at the end, or of id 0 at the start) is cut.
- A 0/1 mask of the ids' length is the row's loss mask (both: a token is a target where both say so, as TRL builds its
  labels): `{MASKED: (ids, mask)}`, which data/chat.py's encoder hands on as a chat row's (ids, mask): stored in
  mask-*.bin, counted in `chat_docs` / `supervised_tokens`, its ids as given, its masked tokens the only targets.
- `labels` that differ from the ids are a loss mask where each is -100 or its own token's id (unshifted: TRL 1.16.0's
  processed rows, `_prepare_dataset`'s build_labels, its packed rows with `seq_lengths`; axolotl's and
  LLaMA-Factory's preprocessed output): a target where the label is the id, beside a mask column where both say so.
  Labels one position ahead of their ids (shifted already, as a model's loss shifts them: trained so, each token
  would learn the one after next) or holding other values are refused in one line. Equal to the ids (run_clm's
  group_texts): every token, read as plain ids. Labels ending with -100 over the tokenizer's EOS where its pad is the
  EOS (a collator's padding, the real EOS masked with it) after a trained token end with one trained EOS
  (`trained_end`).
- A packed row is split into its documents, at its `seq_lengths` or where its `position_ids` restart at 0 (each
  column sliced to match): `{PIECES: [ids or {MASKED: ...}, ...]}`, each piece a document of its own, read exactly as
  a separate row of the same tokens (data/prepare_data.py): a piece without a loss mask gets the tokenizer's BOS where
  it does not start with it and the separator where it does not end with it or the tokenizer's EOS (axolotl's
  pieces carry their own BOS ... EOS: nothing is added), a piece with one is stored as given (no BOS, no EOS: a
  conversation as its template rendered it). Its documents do not attend to each other (positions restart at each).
A packed row with a bad piece (an id >= the vocabulary: --skip_bad_rows) is dropped whole, counted once (rows_over).
Cost: a row's columns that change nothing (labels equal to the ids, positions 0..n-1, `seq_lengths: [n]`, an all-ones
attention_mask) are list compares (plain_ids: ~10 ms per 1M tokens for labels, ~60 ms for positions or a mask, whose
list to compare with is built), in the reading process for a table (Arrow's decoding of the column to Python lists,
~0.1 s per 1M tokens, is paid there too); the row is then plain ids, batched by its length. Any other row is checked
and split in the workers, ~0.15-0.2 s per 1M tokens (numpy over each column), batched by its ids x (1 + columns).
"""

from __future__ import annotations

import numpy as np

MASKS = ("assistant_masks", "completion_mask")
PACKED = ("seq_lengths", "position_ids")
BESIDE_IDS = ("labels", "attention_mask") + MASKS + PACKED  # read beside a row's ids (a table's columns too)
MASKED = "input_ids\x00mask"  # a row read with its loss mask: {MASKED: (ids, mask)} (not a column name)
BESIDE = "input_ids\x00beside"  # a table's row: {BESIDE: (ids, {column: value})}, checked in the worker
PIECES = "input_ids\x00pieces"  # a row read as several documents, or with its padding stripped: {PIECES: [...]}
END = "input_ids\x00end"  # beside MASKED / PIECES: the id of the -100 run its labels end with (trained_end)
_FIX = "prepare from the rows they were made from (messages, prompt / completion: docs/sft.md)"
_DROP = "fix the column, or drop it"
# what a column holds where it changes nothing: read as plain ids where every filled column does (plain_ids)
_PLAIN = {"labels": lambda ids: ids, "attention_mask": lambda ids: [1] * len(ids),
          "position_ids": lambda ids: list(range(len(ids))), "seq_lengths": lambda ids: [len(ids)]}


def labelled(labels, ids: list[int], name: str) -> np.ndarray | str:
    """The loss mask `labels` beside `ids` give (module docstring: 1 where the label is its token's id, 0 at -100),
    or why they are none."""
    n = len(ids)
    lab = _ints(labels, n)
    if lab is None:
        what = f"{len(v)} values" if isinstance(v := _list(labels), list) else type(v).__name__
        return (f"labels ({what}) beside {n} {name!r} are no labels of the ids (one int per token, -100 where not "
                f"trained): {_FIX}, or {_DROP}")
    a, off = np.asarray(ids), lab != -100
    if (lab[off] == a[off]).all():
        return off.astype(np.uint8)
    if n > 1 and lab[-1] == -100 and (lab[:-1][off[:-1]] == a[1:][off[:-1]]).all():
        return (f"labels beside {name!r} are the ids shifted one position left (label i = id i+1): shifted already, "
                "as a model's loss shifts them, and shifted again here each token would learn the one after next; "
                "give them unshifted (each -100 or its own token's id, as TRL's processed rows), or drop 'labels'")
    at = int(np.flatnonzero(off & (lab != a))[0])
    return (f"labels beside {name!r} hold {int(lab[at])} at token {at} (id {int(a[at])}): labels are -100 (not "
            f"trained) or the token's own id; {_FIX}, or drop 'labels' to train every token")


def _list(v):
    return v.tolist() if hasattr(v, "tolist") else list(v) if isinstance(v, tuple) else v


def _shown(v) -> str:
    return f"[{', '.join(map(str, v[:4]))}{', ...' if len(v) > 4 else ''}]" if isinstance(v, list) else repr(v)


def _ints(v, n: int) -> np.ndarray | None:
    a = np.asarray(v) if isinstance(v := _list(v), list) else None
    return a if a is not None and a.ndim == 1 and len(a) == n and (not n or a.dtype.kind in "biu") else None


def _bits(m, col: str, n: int) -> np.ndarray | str:
    """The column's 0/1 mask as uint8, or why it is none."""
    m = _list(m)
    a = np.asarray(m) if isinstance(m, list) else None
    if a is None or a.ndim != 1 or len(a) != n or (n and (a.dtype.kind not in "biuf" or ((a != 0) & (a != 1)).any())):
        what = f"{len(m)} values" if isinstance(m, list) else type(m).__name__
        kind, fix = ("attention mask", _DROP) if col == "attention_mask" else ("loss mask", _FIX)
        return f"{col} ({what}) beside {n} ids is no 0/1 {kind} of the ids (one per token): {fix}"
    return a.astype(np.uint8)


def _kept(row: dict, n: int) -> tuple[int, int] | str:
    """The tokens an `attention_mask` keeps, [lo, hi) (its padding at either end cut), or why it is refused."""
    if row.get("attention_mask") is None:
        return 0, n
    if isinstance(a := _bits(row["attention_mask"], "attention_mask", n), str):
        return a
    on = np.flatnonzero(a)
    if len(on) and on[-1] - on[0] + 1 != len(on):
        at = int(on[np.flatnonzero(np.diff(on) > 1)[0]] + 1)  # the first 0 after a 1
        return (f"attention_mask has 0s between its 1s (token {at} of {n}): not padding at the row's start or end, "
                f"the only 0s read (stripped); {_DROP} (every token is then read)")
    return (int(on[0]), int(on[-1]) + 1) if len(on) else (0, 0)


def _label_pads(row: dict, ids: list[int], n: int) -> tuple[int, int] | None:
    """[lo, hi) of a row without `attention_mask` (nor packing columns) past the padding its `labels` show: a run of
    2+ tokens of one id labelled -100 at its end (nothing after it is trained), or id 0 at its start
    (`padding="max_length"` with the mask dropped). Kept, 80% pads were stored and ~5x the compute spent on untrained
    tokens, silently. The row stays read with its labels (as given, no separator added). Where the pad is the EOS, the
    run holds the row's real EOS too: its id is kept beside the row (END) for trained_end. None: no padding."""
    if row.get("attention_mask") is not None or any(row.get(c) is not None for c in PACKED) or n < 3:
        return None
    lab = _ints(row.get("labels"), n) if row.get("labels") is not None else None
    if lab is None:
        return None
    a, off = np.asarray(ids), lab == -100

    def run(x, o) -> int:  # the length of the run of one id labelled -100 that x starts with
        k = int(np.argmin(o & (x == x[0]))) if not (o & (x == x[0])).all() else len(x)
        return k if k >= 2 else 0
    hi = n - run(a[::-1], off[::-1])
    lo = run(a[:hi], off[:hi]) if hi and a[0] == 0 else 0
    return (lo, hi) if (lo, hi) != (0, n) and hi - lo >= 2 else None


def _spans(row: dict, n: int) -> list[tuple[int, int]] | str:
    """A packed row's documents as [start, end) spans (one span: one document), from `seq_lengths` (one length per
    document, adding up to the row's) or `position_ids` (runs 0, 1, 2, ... each restarting at 0 where a document
    starts); both: they must agree. Or why they are refused."""
    starts, one = None, "the row is then one document"
    if (lens := _list(row.get("seq_lengths"))) is not None:
        ints = isinstance(lens, list) and all(isinstance(k, int) and not isinstance(k, bool) for k in lens)
        if not ints or min(lens, default=0) < 1 or sum(lens) != n:
            total = "are no list of lengths" if not ints else f"add up to {sum(lens)}" if sum(lens) != n else \
                "hold a length below 1"
            return (f"seq_lengths {_shown(lens)} {total}, beside {n} ids: not the lengths of the row's documents "
                    f"(one per document, adding up to the row's); {_DROP} ({one})")
        starts = np.cumsum([0] + lens[:-1]).tolist()
    if (pos := row.get("position_ids")) is not None:
        p = _ints(pos, n)
        ok = None if p is None else np.r_[p[:1] == 0, (p[1:] == p[:-1] + 1) | (p[1:] == 0)]  # per token: in a run
        if ok is None or not ok.all():
            at = "" if ok is None else f" (token {int(np.flatnonzero(~ok)[0])})"
            return (f"position_ids {_shown(_list(pos))} beside {n} ids are no runs 0, 1, 2, ... restarting at 0 where "
                    f"a packed row's document starts{at}; {_DROP} ({one})")
        at = np.flatnonzero(p == 0).tolist()
        if starts is not None and at != starts:
            return (f"seq_lengths {_shown(lens)} and position_ids (restarting at tokens {_shown(at)}) disagree on where "
                    f"the row's documents start; {_DROP}")
        starts = at
    starts = starts or [0]
    return list(zip(starts, starts[1:] + [n]))


def processed(row, ids: str = "input_ids") -> bool:
    """Whether a row (a dict, or a table's column names) that fills a chat field beside its ids is one TRL already
    processed: `labels` beside the ids (TRL 1.16.0's _prepare_dataset keeps the prompt / completion or messages it
    tokenized, adds input_ids and labels, -100 where not trained). Read as its ids and labels, as TRL trains such a
    dataset (it skips preparing rows that hold input_ids); the chat fields are not rendered again. A row without
    labels stays "which is meant?" (data/row_errors.both)."""
    if isinstance(row, dict):
        return row.get(ids) is not None and row.get("labels") is not None
    return ids in row and "labels" in row


def plain_ids(extra: dict, ids) -> bool:
    """Whether a row's filled columns beside its ids change nothing (labels equal to them, as run_clm's group_texts
    writes, positions 0..n-1, `seq_lengths: [n]`, an all-ones attention_mask): read as plain ids in the reading
    process by list compares (~10-60 ms per column per 1M tokens: module docstring), not sent on to be checked."""
    return extra.keys() <= _PLAIN.keys() and isinstance(ids := _list(ids), list) and all(
        _list(v) == _PLAIN[c](ids) for c, v in extra.items())


def beside_ids(ids, row: dict, name: str) -> tuple[object, str | None]:
    """(value, None) or (None, why the row is refused): `ids` (the row's `name` column) as read, `{MASKED: (ids,
    mask)}` where a mask column holds one, or `{PIECES: [...]}` where the row is several documents or padded (module
    docstring). Ids that are no list of non-negative ints are handed back as given, for the caller's own check."""
    ids = _list(ids)
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        return ids, None
    whole, n, given = len(ids), len(ids), ids
    if isinstance(cut := _kept(row, n), str):
        return None, cut
    pads = cut == (0, n) and _label_pads(row, ids, n)  # no attention_mask: padding its labels show
    cut = pads or cut
    if cut != (0, n):  # padding: every column of the ids' length sliced as they are
        row = {c: v[slice(*cut)] if isinstance(v, list) and len(v) == n and c != "seq_lengths" else v
               for c, v in ((c, _list(v)) for c, v in row.items())}
        ids, n = ids[slice(*cut)], cut[1] - cut[0]
    if isinstance(spans := _spans(row, n), str):
        return None, spans
    mask, cols = None, [c for c in MASKS if row.get(c) is not None]
    for col in cols:
        m = _bits(row[col], col, n)
        if isinstance(m, str):
            return None, m
        mask = m if mask is None else mask & m
    if row.get("labels") is not None and (pads or _list(row["labels"]) != ids):  # (equal to the ids: every token)
        if isinstance(m := labelled(row["labels"], ids, name), str):
            return None, m
        mask, cols = m if mask is None else mask & m, ["labels"] + cols
    pieces = []
    for k, (s, e) in enumerate(spans):
        if mask is not None and not mask[s + 1:e].any():  # a document's first token is predicted from nothing
            where = f" in document {k + 1} of the row's {len(spans)} (tokens {s}-{e - 1})" if len(spans) > 1 else ""
            return None, f"{' and '.join(cols)} mark no token to train (past the first){where}: nothing to learn"
        pieces.append(ids[s:e] if mask is None else {MASKED: (ids[s:e], mask[s:e])})
    value = pieces[0] if len(pieces) == 1 and n == whole else {PIECES: pieces}
    if cols == ["labels"] and len(spans) == 1 and (pads and pads[1] < whole or not mask[-1]):  # labels end with -100
        value = {**value, END: given[pads[1]] if pads and pads[1] < whole else ids[-1]}  # (the run cut, or not)
    return value, None


def trained_end(value, eos: int) -> tuple[object, int]:
    """(`value`, 1) with its final EOS trained where its labels end with a -100 run of `eos` (END), which the caller
    passes only where the tokenizer's pad is its EOS; else (`value`, 0). Such labels are padding's: transformers'
    DataCollatorForLanguageModeling writes -100 at every pad id (src/transformers/data/data_collator.py, `labels[labels
    == self.tokenizer.pad_token_id] = -100`), the real EOS included when pad == eos (Qwen2.5 base, GPT-2 or Llama with
    pad set to eos). Read as given, the run was cut whole (_label_pads) or its one EOS kept untrained, and a row with
    a loss mask gets no separator: rows ran into each other (a pack's row trained its last token to predict the next
    row's first) and the model never learnt to stop. One EOS is kept and trained, as TRL trains it: its SFT appends the
    EOS to a text or completion (`add_eos`), its completion_mask covers it and its collator pads labels with -100, not
    by pad id (trl/trainer/sft_trainer.py). Right for SFT labels too (prompt -100, completion labelled, then pad): the
    completion's EOS is the one a reply ends with. Only where the token before the run is trained: labels that stopped
    training before it (a ChatML reply's `<|im_end|>` trained, its "\\n" not; a last user turn) ended the trained text
    there, and the run is only padding (an EOS trained after an untrained token: a second end-of-turn, or the model
    taught to stop after a user's words). Cost: one dict look-up a row; a copy of the row's mask where set."""
    if not isinstance(value, dict) or value.get(END) != eos:
        return value, 0
    pieces = value[PIECES] if PIECES in value else [value]
    ids, mask = pieces[-1][MASKED]
    k = len(ids)
    while k and ids[k - 1] == eos and not mask[k - 1]:  # the -100 run of the EOS left (one, or an attention_mask's cut)
        k -= 1
    if not k or not mask[k - 1] or k == len(ids) and ids[-1] == eos:  # the token before untrained, or an EOS trained
        return value, 0  # already (the run cut after it)
    if k < len(ids):  # the run's first EOS, right after the trained text
        mask = mask.copy()
        mask[k] = 1
    else:  # the whole run was cut as padding
        ids, mask = [*ids, eos], np.append(mask, np.uint8(1))
    last = {MASKED: (ids, mask)}
    return ({PIECES: [*pieces[:-1], last]} if PIECES in value else last), 1


def documents(value) -> tuple[list, bool]:
    """A parsed row's documents (a packed row's pieces, else itself), and whether columns beside its ids shaped them
    (a loss mask, packing, padding: counted in a shard's record, data/output_lock.py)."""
    if isinstance(value, dict) and PIECES in value:
        return value[PIECES], True
    return [value], isinstance(value, dict) and MASKED in value


def no_mask_here(cols: list[str]) -> str:
    """The in-process stream's refusal (data/packing.build_token_stream: ids only, no mask); `cols` the mask columns
    (none: the row's 'labels' hold its mask)."""
    what = " and ".join(cols) or "'labels' that differ from the ids (-100 where not trained)"
    return (f"{what} beside input_ids: a loss mask, which this in-process reader cannot carry (every token would be "
            "trained): prepare the rows with scripts/prepare_data.py, which reads it (docs/sft.md)")


def rows_over(docs: list, bad: list, bound: int) -> set:
    """The (unit, row) keys whose documents (`docs`: (unit, row, ids, source) each) are all dropped: a row in `bad`, or
    one holding an id >= `bound` (its error added to `bad` once). A packed row's pieces go or stay together (its
    earlier pieces were stored and trained while the row was reported skipped). Cost: one max over each document's
    ids (~10 ms per 1M ids in a list, ~1 ms in an array)."""
    dropped = {b[:2] for b in bad}
    for u, row, ids, _ in docs:
        top = int(max(ids)) if isinstance(ids, list) and ids else int(np.max(ids)) if len(ids) else -1  # list: no copy
        if top >= bound and (u, row) not in dropped:
            dropped.add((u, row))
            bad.append((u, row, f"token id {top} >= the vocabulary size {bound} (--vocab_size or the tokenizer's)"))
    return dropped
