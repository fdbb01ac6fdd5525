"""Resumable sampling over data-parallel ranks, at micro-batch granularity.

Every rank of one SP group reads the same samples (each then keeps its own slice of the sequence);
different DP ranks read disjoint samples. The order is a seeded permutation per epoch, so the
position `(epoch, micro_batches_taken)` is all a checkpoint needs to continue exactly. An epoch reaches every
sample: its last global batch is filled from the permutation's start, as torch's DistributedSampler pads (it
was cut off: at 1M tokens a 1B-token set is ~1,000 packed samples, and dp 32 x micro-batch 1 left up to 31 of them,
~11k conversations, untrained every epoch).
"""

from __future__ import annotations

import numpy as np
import torch

WRAPPERS = {"replay": "replay lengths", "tasks": "synthetic tasks", "names": "mixture components"}  # outermost first
# (data/pipeline.stage_view: replay wraps tasks, which wrap a mixture or the one stream: ResumableSampler, key None)


def check_position(state: dict, key: str | None, mine=None) -> None:
    """A saved data position is loaded by the sampler of the same kind (`key`: its state's marking key, None for
    ResumableSampler) over the same components (`mine`), else a one-line ValueError naming the wrapper that saved it
    and this stage's: a stage's `replay:`, `tasks:` or `data:` removed since the checkpoint raised KeyError 'epoch'
    from the innermost sampler."""
    saved = next((k for k in WRAPPERS if k in state), None)
    if saved == key and (key is None or state[key] == mine):
        return
    order = [*WRAPPERS, None]
    if saved == key:
        what = f"{WRAPPERS[key]} {state[key]}; this stage has {mine}"
    elif order.index(saved) < order.index(key):  # a wrapper this stage no longer has
        what = f"{WRAPPERS[saved]} {state[saved]}; this stage has no {WRAPPERS[saved]}"
    else:  # a wrapper the stage has now and the checkpoint's did not
        what = f"no {WRAPPERS[key]}; this stage has {WRAPPERS[key]} {mine}"
    raise ValueError(f"the checkpoint's data position is for a stage with {what}: resume with the same recipe (or "
                     "--resume none)")


class ResumableSampler:
    def __init__(self, num_samples: int, dp: int, dp_rank: int, micro_batch: int, seed: int):
        if num_samples // dp // micro_batch < 1:
            raise ValueError(f"{num_samples} packed samples cannot give each of dp={dp} ranks one micro-batch of "
                             f"{micro_batch}: add data, shorten max_seq_length or lower the batch size")
        self.num_samples, self.dp, self.dp_rank, self.mb, self.seed = num_samples, dp, dp_rank, micro_batch, seed
        self.batches_per_epoch = -(-num_samples // (dp * micro_batch))  # the last one padded (module docstring)
        self.epoch, self.taken = 0, 0
        self._order = None

    def _epoch_order(self) -> np.ndarray:
        """This rank's samples of the epoch, kept as an int64 array (a Python list of them was ~5x the bytes: a 1M
        stage replaying 256-token samples over 25B tokens draws ~98M samples, ~0.9 GB of ints a rank at dp 4)."""
        g = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        perm = torch.randperm(self.num_samples, generator=g)
        pad = self.batches_per_epoch * self.mb * self.dp - self.num_samples  # < dp x micro-batch <= num_samples
        perm = torch.cat([perm, perm[:pad]])
        return perm[self.dp_rank:: self.dp].clone().numpy()

    def next_batch(self) -> list[int]:
        """Indices of the next micro-batch for this rank (wraps into the next epoch)."""
        if self.taken == self.batches_per_epoch:
            self.epoch, self.taken, self._order = self.epoch + 1, 0, None
        if self._order is None:
            self._order = self._epoch_order()
        lo = self.taken * self.mb
        self.taken += 1
        return self._order[lo: lo + self.mb].tolist()

    def source_shares(self) -> dict[str, float]:
        """Per-component token shares (MixtureSampler's interface); empty: no mixture, one stream."""
        return {}

    packing: str | None = None  # how an SFT stage's samples were packed (data/packing.ConvPack; a resume compares it)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "taken": self.taken, "seed": self.seed, "dp": self.dp,
                "micro_batch": self.mb, "num_samples": self.num_samples,
                **({"packing": self.packing} if self.packing else {})}

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state`; under another DP degree or batch size, at the same fraction of the epoch
        (exact when the layout is unchanged). The saved seed is kept: the run's order (a resume with another --seed
        repeated some samples of the epoch and skipped others)."""
        check_position(state, None)
        self.epoch, self._order, self.seed = state["epoch"], None, int(state.get("seed", self.seed))
        if state["dp"] == self.dp and state["micro_batch"] == self.mb and state["num_samples"] == self.num_samples:
            self.taken = state["taken"]
        else:
            consumed = state["taken"] * state["dp"] * state["micro_batch"]
            self.taken = min(self.batches_per_epoch, consumed // (self.dp * self.mb))
