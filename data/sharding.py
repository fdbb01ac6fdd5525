"""Collate one micro-batch and keep this rank's slice of the sequence.

Deviation from DeepSpeed's `UlyssesSPDataLoaderAdapter` (which gathers a different sample from each SP
rank and scatters shards with collectives): here every rank of an SP group reads the same sample from
disk and slices it locally. Same result, no communication, and the data position is one number per DP
rank, which is what exact resume at micro-batch granularity needs.
"""

from __future__ import annotations

import numpy as np
import torch


def collate(samples: list[dict[str, np.ndarray]], sp: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Stack samples into [bs, sl], padded up to a multiple of `sp` (labels -100, positions continuing)."""
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


def shard(batch: dict[str, torch.Tensor], sp: int, sp_rank: int) -> dict[str, torch.Tensor]:
    """This SP rank's contiguous chunk of every [bs, sl] tensor -> [bs, sl / sp]."""
    sl = batch["input_ids"].shape[1]
    assert sl % sp == 0, f"collate pads to a multiple of sp; got sl={sl}, sp={sp}"
    chunk = sl // sp
    return {k: v[:, sp_rank * chunk:(sp_rank + 1) * chunk] for k, v in batch.items()}
