"""The held-out conversation loss of scripts/evaluate.py `--heldout`: the held-out set read (chat rows rendered by
data/chat.py, or a prepared folder's conversations with their masks as written) and scored through the sharded engine
(training/evaluation.py `sample_stats`), the conversations packed whole as an SFT stage packs them. The in-run
counterpart is training/evaluation.py `evaluate_stage` (`heldout_chat_loss`, RunData.heldout with `sft`).

Only conversations count: a prepared folder that mixes text and chats (what docs/sft.md recommends) gives its chat
documents only (data/packing.py `chat_documents`); a set with no supervised token reports no loss (absent), never 0.0.
"""

from __future__ import annotations


def heldout_set(path: str, tok, template: str, limit: int = 0) -> dict:
    """The held-out conversations of --heldout as {"ids": int64 [n], "mask": uint8 [n], "lens": int64 [docs]} (the
    documents laid end to end): chat rows rendered by data/chat.py (`template`: auto | chatml; the loss on the
    assistant's tokens, the completion of a pair), or a prepared folder's tokens and mask-*.bin as written. Rank 0
    reads it (main broadcasts it: a held-out set is small, ~9 bytes a token, 9 MB for 1M tokens); a bad row, a folder
    without chat documents or prepared with another tokenizer: one-line ValueError."""
    import numpy as np

    from data.packing import chat_documents
    from data.store import MANIFEST, Prepared, is_prepared, tokenizer_identity

    if is_prepared(path):
        p = Prepared(path)
        prepared_with = (p.manifest.get("tokenizer") or {}).get("sha256")
        if prepared_with and prepared_with != tokenizer_identity(tok.path):
            raise ValueError(f"--heldout {path}: prepared with tokenizer {p.manifest['tokenizer']['path']}, not the "
                             f"model's {tok.path}: prepare it again with the model's tokenizer, or pass the chat rows")
        if p.mask is None:
            raise ValueError(f"--heldout {path}: no chat documents (no mask-*.bin in {MANIFEST}): prepare chat rows "
                             "(messages, conversations, prompt/completion) with scripts/prepare_data.py")
        idx = chat_documents(p.mask, p.starts, p.lens, limit)  # a mixed folder's text documents are not conversations
        if not len(idx):
            raise ValueError(f"--heldout {path}: no chat documents (every document trains every token: text): prepare "
                             "chat rows (messages, conversations, prompt/completion) with scripts/prepare_data.py")
        spans = [(int(p.starts[k]), int(p.starts[k] + p.lens[k])) for k in idx]
        return {"ids": np.concatenate([p.tokens.read(a, b) for a, b in spans]).astype(np.int64),
                "mask": np.concatenate([np.asarray(p.mask.read(a, b), np.uint8) for a, b in spans]),
                "lens": p.lens[idx].astype(np.int64)}
    from data.chat import ChatEncoder, RowError
    from data.discover import discover
    from data.readers import Fields, iter_rows, parse_item

    enc, fields = ChatEncoder(tok, "auto", template), Fields()
    ids, masks = [], []
    for unit in discover(path):
        for row, item in iter_rows(unit, fields):
            if limit and len(ids) == limit:
                break
            value, _, err = parse_item(item, fields)
            where = unit.where(row)
            if err is None and not isinstance(value, dict):
                err = "not a chat row: expected messages, conversations or prompt + completion"
            try:
                if err is not None:
                    raise RowError(err)
                i, m, _ = enc.encode(value)
            except RowError as e:
                raise ValueError(f"--heldout {where}: {e}") from None
            ids.append(np.asarray(i, np.int64))
            masks.append(np.asarray(m, np.uint8))
    if not ids:
        raise ValueError(f"--heldout {path}: no conversation in it")
    return {"ids": np.concatenate(ids), "mask": np.concatenate(masks), "lens": np.asarray([len(i) for i in ids])}


def heldout_loss(engine, dims, micro_batch: int, pad_id: int, held: dict, length: int) -> dict:
    """The held-out conversation loss: the conversations packed whole at `length` (ConvPack, as an SFT stage packs
    them), the mean CE over every supervised token (sum over the set / count: a long reply weighs by its tokens, as
    the training loss does), through training/evaluation.py `sample_stats` (the sharded engine, the tiled loss).
    Cost: one forward of `length` tokens per packed sample, no backward."""
    import numpy as np

    from data.packing import ConvPack
    from training.evaluation import sample_stats

    starts = np.concatenate([[0], np.cumsum(held["lens"])[:-1]]).astype(np.int64)
    pack = ConvPack(held["ids"], held["mask"], starts, held["lens"], length, pad_id)
    stats = sample_stats(engine, [pack[i] for i in range(len(pack))], dims, micro_batch, pad_id).sum(0)
    loss = {"heldout_chat_loss": (stats[0] / stats[1]).item()} if stats[1] > 0 else {}  # nothing scored: none, not 0.0
    return {**loss, "heldout_chat_tokens": int(stats[1].item()),
            "heldout_chat_conversations": int(len(held["lens"]) - pack.dropped), "heldout_chat_length": length,
            "heldout_chat_truncated": pack.truncated, "heldout_chat_dropped": pack.dropped}
