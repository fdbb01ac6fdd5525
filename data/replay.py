"""Short-context replay: a stage trains a share of its tokens on samples of earlier, shorter lengths.

Extending a model's context can erase what it did at its original length (ProLong trains 40% short data,
LongRoPE2 mixes short windows in). A stage key sets the token share per shorter length:

    replay: {256: 0.3}                          # 30% of the stage's tokens are 256-token samples
    replay: {share: 0.3, lengths: [256, 512]}   # the same share split evenly over the lengths

A replay sample keeps the stage's length L: it is L / l samples of length l packed side by side, each with
its own position ids from 0, so the attention masks them apart (model_utils/attention.py reads the restarts:
no attention across them, on every backend and under SP). The short samples are what the stage would train
at length l: the same `data:` mixture packed to l and the same `tasks:` fractions generated at l.

`ReplaySampler` decides per micro-step (all DP ranks together) whether it is the stage's own micro-batch or a
replay micro-batch at one length, by the rule of MixtureSampler (the component furthest below its share goes
next), so token shares track the recipe within one micro-step at every point. A replay micro-batch is one
`next_batch()` of that length's own sampler (mb x L/l short samples for this rank), so a replay micro-step is
all synthetic or all stream when the stage has `tasks:`, as the stage's own micro-steps are. Its state (two
counters and every wrapped sampler's state) is the whole data position.
"""

from __future__ import annotations

import numpy as np


def parse_replay(spec, seq_len: int, where: str = "replay") -> dict[int, float]:
    """{length: token share} of a stage's `replay:` value, checked against the stage's length; one-line
    ValueError on a bad spec. Empty when there is none."""
    if not spec:
        return {}
    if not isinstance(spec, dict):
        raise ValueError(f"{where}: expected {{length: share}} or {{share: S, lengths: [...]}}, got {spec!r}")
    if "share" in spec or "lengths" in spec:
        if set(spec) != {"share", "lengths"} or not isinstance(spec["lengths"], list) or not spec["lengths"]:
            raise ValueError(f"{where}: the long form is {{share: S, lengths: [L1, ...]}} (both keys), got {spec!r}")
        share = spec["share"]
        if not isinstance(share, (int, float)) or isinstance(share, bool):
            raise ValueError(f"{where}: share must be a number in (0, 1), got {share!r}")
        spec = {n: share / len(spec["lengths"]) for n in spec["lengths"]}
    out = {}
    for n, share in spec.items():
        try:
            n = int(n)
        except (TypeError, ValueError):
            raise ValueError(f"{where}: key {n!r} is not a length (or use {{share: S, lengths: [...]}})") from None
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share < 1:
            raise ValueError(f"{where}: share of length {n} must be a number in (0, 1), got {share!r}")
        if not 0 < n < seq_len or seq_len % n:
            raise ValueError(f"{where}: length {n} must be shorter than the stage's {seq_len} and divide it")
        out[n] = out.get(n, 0.0) + float(share)
    if sum(out.values()) >= 1:
        raise ValueError(f"{where}: replay shares {out} sum to {sum(out.values()):.3f}; they must sum below 1")
    return dict(sorted(out.items()))


class ReplayDataset:
    """The stage's dataset plus replay samples: an int index is the stage's own sample, a tuple
    `(length, (i_1, ..., i_k))` is those k samples of that length's dataset packed into one sample."""

    def __init__(self, base, short: dict[int, object]):
        self.base, self.short = base, short

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i):
        if not isinstance(i, tuple):
            return self.base[i]
        n, idx = i
        parts = [self.short[n][j] for j in idx]
        return {k: np.concatenate([np.asarray(p[k], dtype=np.int64) for p in parts])
                for k in ("input_ids", "shift_labels", "position_ids")}


class ReplaySampler:
    """Wraps the stage's sampler and one sampler per replay length (built with micro-batch mb x L/l)."""

    def __init__(self, base, short: dict[int, object], shares: dict[int, float], seq_len: int, micro_batch: int):
        assert list(short) == list(shares)
        self.base, self.short, self.lengths = base, short, list(shares)
        self.seq_len, self.mb = seq_len, micro_batch
        self.weights = np.asarray([1.0 - sum(shares.values()), *shares.values()], dtype=np.float64)
        self.drawn, self.counts = 0, np.zeros(len(self.weights), dtype=np.int64)

    def next_batch(self) -> list:
        c = int(np.argmax(self.weights * (self.drawn + 1) - self.counts))
        self.counts[c] += 1
        self.drawn += 1
        if c == 0:
            return self.base.next_batch()
        n = self.lengths[c - 1]
        k = self.seq_len // n
        idx = self.short[n].next_batch()
        return [(n, tuple(idx[j * k:(j + 1) * k])) for j in range(self.mb)]

    def source_shares(self) -> dict[str, float]:
        """Token shares: the stage's own components (scaled by its share) and `replay<length>`."""
        d = max(1, self.drawn)
        own = self.counts[0] / d
        shares = {k: v * own for k, v in self.base.source_shares().items()} or {"stream": float(own)}
        shares.update({f"replay{n}": float(c) / d for n, c in zip(self.lengths, self.counts[1:])})
        return shares

    def state_dict(self) -> dict:
        return {"replay": self.lengths, "drawn": self.drawn, "counts": self.counts.tolist(),
                "base": self.base.state_dict(), "short": {str(n): s.state_dict() for n, s in self.short.items()}}

    def load_state_dict(self, state: dict) -> None:
        from data.sampler import check_position  # (torch: imported with the sampler, not with this module)

        check_position(state, "replay", self.lengths)  # one line where the recipe changed (data/sampler.py)
        self.drawn, self.counts = int(state["drawn"]), np.asarray(state["counts"], dtype=np.int64)
        self.base.load_state_dict(state["base"])
        for n, s in self.short.items():
            s.load_state_dict(state["short"][str(n)])
