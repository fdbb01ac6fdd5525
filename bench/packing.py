"""Packing whole conversations: fill of the samples before (next-fit in stream order, the old ConvPack) and after
(best-fit decreasing within a bounded window, data/packing.py `best_fit_bins`), the padding's share of the attention
cost, and the packer's cost. Lengths only (no tokens, no model): seconds on one core.

    python -m bench.packing          # table on stdout; bench/results/packing.json

Four distributions of conversation lengths (seeded, numpy):
- `longalign_64k`: LongAlign-like, uniform 8k-64k tokens, into 64k samples (4,000 conversations);
- `mix90_128k`: 90% short chats (lognormal, median 1.5k, 100-8k) / 10% long (uniform 30k-100k), into 128k samples
  (40,000 conversations);
- `chats_64k`: short chats (lognormal, median 600, 30-8k) into 64k samples (100,000 conversations);
- `chats_4k`: the same short chats into 4k samples (a short-context SFT, where a sample holds few chats).
Fill = conversation tokens / sample tokens. Padding attention = the padding's share of a sample's causal attention
work under document masking (sum over documents of len^2): the old tail was one document (tail^2), the new one is
cut into PAD_PIECE-token documents. Build = seconds to pack, and per million conversations.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from bench.harness import format_table, result_path, write_json
from data.packing import PACK_WINDOW, PAD_PIECE, best_fit_bins

K = 1024


def distributions(seed: int = 0) -> dict[str, tuple[np.ndarray, int]]:
    rng = np.random.default_rng(seed)
    n = 40_000
    short = np.clip(rng.lognormal(np.log(1500), 0.8, n), 100, 8 * K).astype(np.int64)
    long = rng.integers(30 * K, 100 * K + 1, n)
    chats = np.clip(rng.lognormal(np.log(600), 0.9, 100_000), 30, 8 * K).astype(np.int64)
    return {"longalign_64k": (rng.integers(8 * K, 64 * K + 1, 4000), 64 * K),
            "mix90_128k": (np.where(rng.random(n) < 0.1, long, short), 128 * K),
            "chats_64k": (chats, 64 * K), "chats_4k": (chats, 4 * K)}


def next_fit(lens: np.ndarray, seq_len: int) -> list[list[int]]:
    """The old ConvPack's rule: stream order, a new sample when the next conversation does not fit."""
    bins, cur, fill = [], [], 0
    for ln in lens.tolist():
        if fill + ln > seq_len:
            bins.append(cur)
            cur, fill = [], 0
        cur.append(ln)
        fill += ln
    return bins + [cur] * bool(cur)


def pad_attention(bins: list[list[int]], seq_len: int, piece: int | None) -> float:
    """The padding's share of the causal attention work (sum of document length^2) over all samples."""
    docs = pad = 0.0
    for b in bins:
        docs += sum(float(x) ** 2 for x in b)
        tail = seq_len - sum(b)
        pad += float(tail) ** 2 if piece is None else (tail // piece) * float(piece) ** 2 + float(tail % piece) ** 2
    return pad / (docs + pad)


def measure(lens: np.ndarray, seq_len: int, window: int) -> dict:
    lens = np.minimum(lens, seq_len)  # ConvPack cuts a longer one to the length, alone in its sample
    old = next_fit(lens, seq_len)
    t0 = time.perf_counter()
    order, bounds = best_fit_bins(lens, seq_len, window)
    build = time.perf_counter() - t0
    new = [lens[order[a:b]].tolist() for a, b in zip(bounds[:-1], bounds[1:])]
    total = int(lens.sum())
    return {"seq_len": seq_len, "conversations": len(lens), "mean_len": round(float(lens.mean())),
            "samples_before": len(old), "samples_after": len(new),
            "fill_before": round(total / (len(old) * seq_len), 4), "fill_after": round(total / (len(new) * seq_len), 4),
            "pad_attention_before": round(pad_attention(old, seq_len, None), 4),
            "pad_attention_after": round(pad_attention(new, seq_len, PAD_PIECE), 6),
            "build_s": round(build, 3), "build_s_per_million": round(build / len(lens) * 1e6, 2)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--window", type=int, default=PACK_WINDOW, help="samples' worth of conversations sorted together")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=result_path("packing.json"))
    a = p.parse_args(argv)
    rows = {name: measure(lens, n, a.window) for name, (lens, n) in distributions(a.seed).items()}
    print(format_table(["distribution", "length", "convs", "fill before", "fill after", "samples", "pad attn before",
                        "pad attn after", "build s/1M"],
                       [[k, r["seq_len"], r["conversations"], f"{r['fill_before']:.3f}", f"{r['fill_after']:.3f}",
                         f"{r['samples_before']} -> {r['samples_after']}", f"{r['pad_attention_before']:.3f}",
                         f"{r['pad_attention_after']:.5f}", r["build_s_per_million"]] for k, r in rows.items()]))
    out = {"window": a.window, "pad_piece": PAD_PIECE, "seed": a.seed, "distributions": rows}
    write_json(a.out, out)
    print(f"wrote {a.out}")
    return out


if __name__ == "__main__":
    main()
