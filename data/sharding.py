"""Collate one micro-batch and keep this rank's slice of the sequence.

Deviation from DeepSpeed's `UlyssesSPDataLoaderAdapter` (which gathers a different sample from each SP
rank and scatters shards with collectives): here every rank of an SP group reads the same sample from
disk and slices it locally. Same result, no communication, and the data position is one number per DP
rank, which is what exact resume at micro-batch granularity needs.

Labels are shifted here at the latest, on the whole sample, before `shard` cuts it: the last token of
shard r keeps its label, the first token of shard r + 1 (-100 when that token is not supervised). Shifting
each shard instead would drop one label per shard boundary and let the token before it go untrained.
The per-conversation loss weights (LongAlign, `--loss_weighting conversation`) are computed here too, on
the whole sample, so that a conversation cut by a shard boundary still counts its N_i supervised tokens once.
"""

from __future__ import annotations

import numpy as np
import torch

from base.parallel import zigzag_chunks

LOSS_WEIGHTINGS = ("token", "conversation")


def segment_ids(position_ids: np.ndarray) -> np.ndarray:
    """0, 1, 2, ... per packed document: a new one starts wherever the position ids do not continue (they restart
    at every document start under reset_position_ids; the sample's first token starts segment 0)."""
    pos = np.asarray(position_ids, dtype=np.int64)
    starts = np.ones(len(pos), dtype=bool)
    starts[1:] = pos[1:] != pos[:-1] + 1
    return np.cumsum(starts) - 1


def shifted_labels(sample: dict[str, np.ndarray]) -> np.ndarray:
    """The next-token targets of a sample: its `shift_labels` (already shifted by the packer), or the Hugging
    Face convention `labels` (aligned with input_ids, -100 ignored) or a per-token `loss_mask` (1: the token is
    a target, data/chat.py) shifted here, inside the whole sample, with no label across a document start (no
    conversation predicts the next one's first token)."""
    if "shift_labels" in sample:
        return np.asarray(sample["shift_labels"], dtype=np.int64)
    if "labels" in sample:
        labels = np.asarray(sample["labels"], dtype=np.int64)
    else:
        labels = np.where(np.asarray(sample["loss_mask"]) != 0, np.asarray(sample["input_ids"], dtype=np.int64), -100)
    out = np.full_like(labels, -100)
    out[:-1] = labels[1:]
    seg = segment_ids(sample["position_ids"])
    out[:-1][seg[1:] != seg[:-1]] = -100
    return out


def conversation_weights(shift_labels: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
    """LongAlign's per-conversation weighting: every supervised position of document i weighs 1 / N_i (N_i: its
    supervised tokens in this sample), others 0, so the weighted sum over a global batch divided by the sum of the
    weights (the number of conversations with a supervised token) is the mean over conversations of each one's
    mean loss. A position's label belongs to the document of the token that predicts it."""
    seg = segment_ids(position_ids)
    sup = shift_labels != -100
    n = np.bincount(seg[sup], minlength=int(seg[-1]) + 1 if len(seg) else 0)
    w = np.zeros(len(seg), dtype=np.float32)
    w[sup] = 1.0 / n[seg[sup]]
    return w


def collate(samples: list[dict[str, np.ndarray]], sp: int, pad_id: int,
            loss_weighting: str = "token") -> dict[str, torch.Tensor]:
    """Stack samples into [bs, sl], padded up to a multiple of `sp` (labels -100, positions continuing). Under
    context parallelism pass `dims.seq_multiple` (2 x sp: every rank holds two zigzag chunks). With
    `loss_weighting` "conversation", a float32 `loss_weights` [bs, sl] (conversation_weights; 0 on padding)."""
    if loss_weighting not in LOSS_WEIGHTINGS:
        raise ValueError(f"--loss_weighting {loss_weighting!r}: use token or conversation")
    sl = len(samples[0]["input_ids"])
    padded = -(-sl // sp) * sp
    rows = []
    for s in samples:
        row = {"input_ids": s["input_ids"], "shift_labels": shifted_labels(s), "position_ids": s["position_ids"]}
        if loss_weighting == "conversation":
            row["loss_weights"] = conversation_weights(row["shift_labels"], s["position_ids"])
        rows.append(row)
    out = {}
    for key, fill in (("input_ids", pad_id), ("shift_labels", -100), ("position_ids", None), ("loss_weights", 0.0)):
        if key not in rows[0]:
            continue
        stacked = []
        for r in rows:
            x = r[key]
            if padded > sl:
                tail = np.arange(x[-1] + 1, x[-1] + 1 + padded - sl) if fill is None else np.full(padded - sl, fill)
                x = np.concatenate([x, tail])
            stacked.append(torch.from_numpy(np.asarray(x, dtype=np.float32 if key == "loss_weights" else np.int64)))
        out[key] = torch.stack(stacked)
    return out


def shard(batch: dict[str, torch.Tensor], sp: int, sp_rank: int, cp: int = 1) -> dict[str, torch.Tensor]:
    """This SP rank's [bs, sl / sp] slice of every [bs, sl] tensor: a contiguous chunk, or under context
    parallelism (cp > 1) a contiguous slice of the zigzag-ordered sample (2 * cp chunks, cp rank c holding
    chunks c and 2cp - 1 - c, each split over its Ulysses group's ranks). Labels are already shifted and the
    position ids travel with their tokens, so the loss (a sum over tokens) and RoPE do not see the order."""
    sl = batch["input_ids"].shape[1]
    assert sl % (sp * (2 if cp > 1 else 1)) == 0, f"collate pads to dims.seq_multiple; got sl={sl}, sp={sp}, cp={cp}"
    chunk = sl // sp
    if cp > 1:
        c = sl // (2 * cp)
        order = torch.cat([torch.arange(i * c, (i + 1) * c) for i in zigzag_chunks(cp)])
        mine = order[sp_rank * chunk:(sp_rank + 1) * chunk]
        return {k: v[:, mine] for k, v in batch.items()}
    return {k: v[:, sp_rank * chunk:(sp_rank + 1) * chunk] for k, v in batch.items()}
