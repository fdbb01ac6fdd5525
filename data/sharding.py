"""Collate one micro-batch and keep this rank's slice of the sequence.

Deviation from DeepSpeed's `UlyssesSPDataLoaderAdapter` (which gathers a different sample from each SP
rank and scatters shards with collectives): here every rank of an SP group reads the same sample from
disk and slices it locally. Same result, no communication, and the data position is one number per DP
rank, which is what exact resume at micro-batch granularity needs.
"""

from __future__ import annotations

import numpy as np
import torch

from base.parallel import zigzag_chunks


def collate(samples: list[dict[str, np.ndarray]], sp: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Stack samples into [bs, sl], padded up to a multiple of `sp` (labels -100, positions continuing). Under
    context parallelism pass `dims.seq_multiple` (2 x sp: every rank holds two zigzag chunks)."""
    sl = len(samples[0]["input_ids"])
    padded = -(-sl // sp) * sp
    out = {}
    for key, fill in (("input_ids", pad_id), ("shift_labels", -100), ("position_ids", None)):
        rows = []
        for s in samples:
            x = s[key]
            if padded > sl:
                tail = np.arange(x[-1] + 1, x[-1] + 1 + padded - sl) if fill is None else np.full(padded - sl, fill)
                x = np.concatenate([x, tail])
            rows.append(torch.from_numpy(np.asarray(x, dtype=np.int64)))
        out[key] = torch.stack(rows)
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
