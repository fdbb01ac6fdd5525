"""The longest length a run would train at: per split, the longest whose step stays within a time (TRAINABLE_S, 15
minutes) with the memory features `memory_features: auto` chooses AT THAT LENGTH (issue 49).

A fixed feature set is the wrong yardstick here: the features that let the longest length fit (every layer
checkpointed, its attention recomputed) are not what auto runs at a third of that length, where it keeps the
attention or checkpoints nothing and runs ~1.3x faster. So each candidate length asks auto
(planner.auto_features.choose, as train.py's start-up does, the split fixed) for its choice there and times that
choice at the measured FLOP rate (planner.step_time.step_time). A length counts when auto fits it at all and its
step is within the time.

    from planner.trainable import AutoRun, longest_trainable
    longest_trainable(900, load_shape("llama3-8b"), 8, 1, AutoRun(world=8, ranks_per_node=8, budget_bytes=78 * GiB))

Cost: a bisection over the multiples of the split's unit, bracketed above by the length at which even no feature at
all takes the time (step_time only, no memory model): ~log2(that length / unit) + 1 calls of choose, ~20 for
Llama-3-8B at 0.5-4M tokens. Each choose runs the memory model once per candidate feature set: ~600 sets (~0.05 s;
twice that under cp > 1, the ring tried too) with nothing pinned, a few dozen with --alst's features pinned; so
0.4-1 s per search unpinned (what plain `plan.py` adds per length asked), a few hundredths pinned (--compare).
The bisection assumes auto's step time grows with the length: the sets that fit a longer length fit every shorter
one (peaks grow with the length) and each set's time grows; auto ranks on its own cost model (MFU 0.4, offloads
counted twice), which may order two near-equal sets differently from step_time, a difference of a few percent at most.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, replace
from functools import lru_cache

from planner.auto_features import PEAK_TFLOPS, Choice, choose, describe, gpu_budget
from planner.cluster import longest_multiple
from planner.memory_model import Features, GiB, ModelShape
from planner.shapes import ROPE_MAX_POSITIONS
from planner.step_time import step_time

ALST = ("tiled_mlp", "tiled_logits", "gradient_checkpointing", "offload_activations")  # plan.py's --alst


@dataclass(frozen=True)
class AutoRun:
    """What auto is given at every length of a search: the cluster, the budget per rank (gpu_budget), the features
    pinned ((name, value) pairs), the ZeRO-3 offloads and lean norm / MLP the run has, the host per rank."""

    world: int
    ranks_per_node: int
    budget_bytes: int
    pinned: tuple = ()
    offloads: Features = field(default_factory=Features)
    host_bytes_per_rank: int | None = None
    precision: str = "bf16"
    peak_tflops: float = PEAK_TFLOPS

    @classmethod
    def of_args(cls, args: argparse.Namespace) -> AutoRun:
        """plan.py's flags as `plan.py --auto` reads them: the features on the command line pinned (--alst's,
        gradient checkpointing as checkpoint_every 1, --keep_attention / --no-keep_attention), auto picks the rest."""
        pinned = {k: True for k in ALST if getattr(args, k) or args.alst}
        if pinned.pop("gradient_checkpointing", False):
            pinned["checkpoint_every"] = 1
        if args.keep_attention is not None:
            pinned["keep_attention"] = args.keep_attention
        return cls(world=args.gpus_per_node * args.nodes, ranks_per_node=args.gpus_per_node,
                   budget_bytes=gpu_budget(args.gpu_mem_gb), pinned=tuple(sorted(pinned.items())),
                   offloads=Features(offload_params=args.offload_params, offload_optimizer=args.offload_optimizer,
                                     lean_rmsnorm=args.lean_rmsnorm, lean_mlp=args.lean_mlp),
                   host_bytes_per_rank=int((args.cpu_mem_gb / args.gpus_per_node - args.cpu_overhead_gb) * GiB),
                   precision=args.precision, peak_tflops=args.gpu_tflops)

    def choose(self, shape: ModelShape, seq_len: int, sp: int | None, cp: int | str, sp_max: int | None = None) -> Choice:
        """planner.auto_features.choose with these settings (ValueError, one line, when nothing fits)."""
        return choose(shape, seq_len, self.world, self.budget_bytes, sp=sp, cp=cp, sp_max=sp_max,
                      pinned=dict(self.pinned), offloads=self.offloads, precision=self.precision,
                      host_bytes_per_rank=self.host_bytes_per_rank, ranks_per_node=self.ranks_per_node)

    def features(self, c: Choice) -> Features:
        """A choice's features with the offloads and lean norm / MLP it runs with (what step_time reads)."""
        return replace(c.features, offload_params=c.offload_params, offload_optimizer=c.offload_optimizer,
                       lean_rmsnorm=self.offloads.lean_rmsnorm, lean_mlp=self.offloads.lean_mlp)


@lru_cache(maxsize=4096)
def auto_step(shape: ModelShape, seq_len: int, sp: int, cp: int, run: AutoRun) -> tuple[Choice, float] | None:
    """(auto's choice at this length and split, its step in seconds at the measured rate); None where nothing fits."""
    try:
        c = run.choose(shape, seq_len, sp, cp)
    except ValueError:
        return None
    return c, step_time(shape, seq_len, c.sp, run.features(c), world=run.world, ranks_per_node=run.ranks_per_node,
                        cp=c.cp, peak_tflops=run.peak_tflops)


def longest_trainable(seconds: float, shape: ModelShape, sp: int, cp: int, run: AutoRun,
                      upper: int = ROPE_MAX_POSITIONS) -> dict | None:
    """The longest length (a multiple of sp, of 2 sp under cp > 1; at most `upper`, 2**24: float32 RoPE positions
    collapse past it) that auto fits at this split and whose step with auto's choice there takes at most `seconds`: {seq_len, step_s, features (describe), sp, cp}; None where no length
    does. Cost: the module docstring."""
    unit = sp * (2 if cp > 1 else 1)
    bare = replace(run.offloads, lean_rmsnorm=False, lean_mlp=False)  # no feature: no set auto may pick is faster
    hi = longest_multiple(lambda n: step_time(shape, n, sp, bare, world=run.world, ranks_per_node=run.ranks_per_node,
                                              cp=cp, peak_tflops=run.peak_tflops) <= seconds, unit, upper)

    def within(n: int) -> bool:
        r = auto_step(shape, n, sp, cp, run)
        return r is not None and r[1] <= seconds

    n = longest_multiple(within, unit, hi)
    if not n:
        return None
    c, t = auto_step(shape, n, sp, cp, run)
    return dict(seq_len=n, step_s=t, features=describe(run.features(c)), sp=sp, cp=cp)
