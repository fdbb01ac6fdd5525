"""What one prepare_data worker does to one batch of rows: parse each row (data/readers.parse_item), tokenize it (a text
framed by data/tokenizer.py `frame_texts`, pre-tokenized ids given the BOS a text gets, a chat row encoded with its loss
mask by data/chat.py's ChatEncoder, a packed row's every piece as a row of its own: data/ids_rows.py), check its ids
against the vocabulary bound and count what each kind of row did (`STATS`, summed per shard into the manifest).
data/prepare_data.py's reading process hands the batches out and takes the results in input order
(data/prepare_pool.py); split out of data/prepare_data.py.

A worker builds its tokenizer and chat encoder once, when the pool starts it (`_init_worker`: ~0.5 GB a worker,
data/prepare_pool.py); a batch's result is its tokens, its loss mask where a row has one, and each document's length
and source, of the order of the batch's raw bytes (a 1M-token conversation: ~4 MB of JSON, ~5 MB of result,
data/prepare_pool.py).
"""

from __future__ import annotations

import os

import numpy as np

from data.chat_render import prefix_costly
from data.ids_rows import MASKED, documents, rows_over, trained_end
from data.readers import Fields, parse_item

CHAT_STATS = ("chat_docs", "supervised_tokens", "untrained_turns", "no_stop_rows",  # per shard, summed in the manifest
              "rewritten_arguments", "flagged_turns", "dropped_reasoning", "chatml_rows", "history_ends",
              "history_ends_unknown", "appended_stops")
# texts holding a special-token string kept as text, texts read with theirs as control tokens, ids given the BOS, ids
# rows shaped by their columns (a loss mask, packing, padding: data/ids_rows.py; read by output_lock.check_rules),
# texts ending with the tokenizer's EOS string (frame_texts), ids rows whose final EOS their labels masked (trained_end)
STATS = CHAT_STATS + ("special_text_docs", "parsed_text_docs", "ids_given_bos", "ids_beside_rows", "eos_text_docs",
                      "eos_labels_trained")

_W: dict = {}


def _init_worker(tokenizer_path: str | None, fields: Fields, vocab_bound: int, eos_id: int | None, dtype: str,
                 loss_on: str = "auto", chat_template: str = "auto", text_specials: str = "auto", now=None):
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one core per worker
    from data.chat import ChatEncoder
    from data.chat_template import literal
    from data.tokenizer import Tokenizer

    tok = Tokenizer(tokenizer_path) if tokenizer_path else None
    if tok is not None and literal(chat_template):
        tok.run_template = chat_template  # its turn starts begin a rendered text document too (Tokenizer.rendered_start)
    _W.update(tok=tok, fields=fields, bound=vocab_bound, eos=eos_id, dtype=np.dtype(dtype), specials=text_specials,
              chat=ChatEncoder(tok, loss_on, chat_template, now) if tok else None, loss_on=loss_on)


def _tokenize_batch(items: list[tuple[int, int, object]]) -> dict:
    """items: (unit index, row, raw item) -> tokens of the kept documents (a text document as BOS + text + separator,
    pre-tokenized ids, a packed row's each piece too, with the BOS and the separator: Tokenizer.frame_texts / with_bos;
    a chat row's tokens and loss mask as its template renders them, data/chat.py) and what was dropped."""
    from data.chat import RowError

    fields, tok, eos, bound = _W["fields"], _W["tok"], _W["eos"], _W["bound"]
    docs, bad, masks, chat, long = [], [], {}, dict.fromkeys(STATS, 0), None
    for u, row, item in items:
        value, src, err = parse_item(item, fields)
        if err is None and tok is not None and tok.pad_id == tok.eos_id:  # labels that masked the EOS as a pad
            value, trained = trained_end(value, tok.eos_id)
            chat["eos_labels_trained"] += trained
        pieces, shaped = documents(value) if err is None else ([value], False)
        chat["ids_beside_rows"] += shaped
        for value in pieces:  # each document of a packed row as a row of its own (one bad piece: the row's error)
            if err is None and tok is None and (isinstance(value, str) or isinstance(value, dict) and MASKED not in value):
                err = "a text or chat document needs a tokenizer (--tokenizer_name_or_path), or give input_ids"
            if err is None and isinstance(value, dict):
                try:  # no tokenizer: only ids with their own loss mask get here (assistant_masks ...: data/ids_rows.py)
                    value, masks[len(docs)], st = _W["chat"].encode(value) if tok else (*value[MASKED], {})
                    if tok is None and _W["loss_on"] == "all":  # as ChatEncoder.encode reads them: every token a target
                        masks[len(docs)] = np.ones(len(value), np.uint8)
                except RowError as e:
                    err = f"chat row: {e}"
                else:
                    chat["chat_docs"] += 1
                    for k in CHAT_STATS[2:]:  # the encoder's counts (chat_docs above, supervised_tokens below)
                        chat[k] += st.get(k, 0)
                    if prefix_costly(m := st.get("prefix_messages", 0), len(value)) and m > (long or (0, 0, 0))[2]:
                        long = (u, row, m, len(value))  # the batch's longest: warned of once (prefix_cost_note)
            if err:
                bad.append((u, row, err))
                break
            docs.append((u, row, value, src))
    for i, d in enumerate(docs):
        if tok is not None and i not in masks and not isinstance(d[2], str):  # pre-tokenized: the BOS a text gets
            ids, added = tok.with_bos(d[2])
            docs[i], chat["ids_given_bos"] = (*d[:2], ids, d[3]), chat["ids_given_bos"] + added
    texts = [i for i, d in enumerate(docs) if isinstance(d[2], str)]
    if texts:
        framed, *counts = tok.frame_texts([docs[i][2] for i in texts], eos, _W["specials"])
        chat["special_text_docs"], chat["parsed_text_docs"], chat["eos_text_docs"] = counts
        for i, ids in zip(texts, framed):
            docs[i] = (*docs[i][:2], ids, docs[i][3])
    arrays, lens, srcs, empty, max_id, mask_parts = [], [], [], 0, -1, []
    dropped = rows_over(docs, bad, bound)  # a row with a bad piece: none of its pieces kept, counted once
    for d, (u, row, ids, src) in enumerate(docs):
        if (u, row) in dropped or not len(ids):
            empty += (u, row) not in dropped
            continue
        a = np.asarray(ids, dtype=np.int64)
        max_id = max(max_id, int(a.max()))
        arrays.append(a)
        # a conversation ends with its own end-of-turn token; a document whose ids end with the separator (`...</s>`
        # in the text, pre-tokenized ids with theirs) or the tokenizer's own EOS (ids + [eos_token_id]) gets no other
        add_eos = eos is not None and d not in masks and int(a[-1]) not in (eos, tok.eos_id if tok else eos)
        if add_eos:
            arrays.append(np.asarray([eos], dtype=np.int64))
            max_id = max(max_id, eos)
        lens.append(len(a) + add_eos)
        srcs.append((u, src))
        mask_parts.append(masks[d] if d in masks else np.ones(lens[-1], np.uint8))
        chat["supervised_tokens"] += int(masks[d][1:].sum()) if d in masks else 0
    flat = np.concatenate(arrays).astype(_W["dtype"]) if arrays else np.zeros(0, _W["dtype"])
    mask = np.concatenate(mask_parts) if masks and mask_parts else None  # None: every token a target (text only)
    return {"tokens": flat, "mask": mask, "lens": lens, "srcs": srcs, "bad": sorted(bad, key=lambda b: b[:2]),
            "empty": empty, "max_id": max_id, "last": items[-1][:2], "chat": chat, "long": long}
