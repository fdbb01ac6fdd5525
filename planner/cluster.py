"""One cluster's plan, a (length, split) at a time: scripts/plan.py's Planner and the SP splits it plans.

`Planner(args, shape, feats)` holds the cluster's limits (args: plan.py's parsed flags: gpus_per_node, nodes,
gpu_mem_gb, cpu_mem_gb, cpu_overhead_gb, precision, async_save, alloc_conf, attention_head_chunks, mfu,
gpu_tflops) and evaluates one (seq_len, sp, cp) at a time against the run's own rule (usable_bytes: the GPU less
GPU_RESERVED less HEADROOM; the host per node), finds the longest length that fits and the SP communication.
Torch-free, like the rest of the planner.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import replace

from base.parallel import check_layout, split_sp
from planner.attention_sp import head_chunk_choices
from planner.auto_features import gpu_budget, sp_splits, usable_bytes
from planner.comm_model import layer_comm
from planner.memory_model import (
    GRAD_ACCUM_DEFAULT,
    Estimate,
    Features,
    GiB,
    ModelShape,
    estimate,
    pinned_round_limit,
)
from planner.shapes import ROPE_MAX_POSITIONS

# What a rank's process holds on the host beyond the planner's host terms (the CUDA runtime and its host allocations,
# the interpreter, torch, DeepSpeed and the other libraries, the model file's pages while it loads): MEASURED on the
# GPU run of 2026-11-28 (docs/results/gpu.md, the headline's configuration): peak RSS 54.43 GiB against 52.46 of host
# terms (pinned blocks, arena and RSS each matched the planner within 0.1%), so 1.98 GiB. One run, one rank, one
# machine: a fit, not a law (a model of another size maps another weights file).
RUNTIME_HOST_GIB = 1.98


def longest_multiple(fits: Callable[[int], bool], step: int, upper: int) -> int:
    """The longest multiple of `step` below `upper` for which `fits` holds, `fits` holding for every shorter one
    (peak memory and step time grow with the length); 0 when none does. A bisection: ~log2(upper / step) calls."""
    lo, hi = 0, upper // step
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid * step) else (lo, mid - 1)
    return lo * step


def _int_or_auto(flag: str, value: str) -> int | str:
    if value == "auto":
        return value
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:  # 0 reached the split's list as an IndexError
        raise ValueError(f"--{flag} {value!r}: use an integer >= 1 or auto")
    return n


def _valid_splits(shape: ModelShape, world: int, seq_len: int, args: argparse.Namespace) -> list[tuple[int, int]]:
    """(sp, cp) rows to plan: the requested split of each SP degree, then pure Ulysses (cp 1) where --cp is auto,
    that differs and the heads allow it."""
    sp_req, cp = _int_or_auto("sp", args.sp), _int_or_auto("cp", args.cp)
    if args.ulysses is not None:
        if sp_req == "auto" or args.ulysses < 1 or sp_req % args.ulysses:
            raise ValueError(f"--ulysses {args.ulysses} needs --sp N with N a multiple of it (cp = N / ulysses)")
        cp = sp_req // args.ulysses
    gpn = args.gpus_per_node
    if sp_req == "auto":
        rows = sp_splits(shape, world, seq_len, world, cp, gpn)
    else:
        c = split_sp(sp_req, shape.num_heads, shape.num_kv_heads, gpn)[1] if cp == "auto" else cp
        check_layout(world, sp_req, shape.num_heads, shape.num_kv_heads, seq_len, cp=c)
        rows = [(sp_req, c)]
    if cp == "auto":
        pure = {sp for sp, _ in sp_splits(shape, world, seq_len, world, 1)}
        rows = [r for sp, c in rows for r in ([(sp, c), (sp, 1)] if c > 1 and sp in pure else [(sp, c)])]
    return rows


def split_label(sp: int, cp: int) -> str:
    """'8' (pure Ulysses) or '8=4x2' (ulysses x cp)."""
    return str(sp) if cp == 1 else f"{sp}={sp // cp}x{cp}"


class Planner:
    """Cluster limits plus the model; evaluates one (seq_len, sp) at a time."""

    def __init__(self, args: argparse.Namespace, shape: ModelShape, feats: Features):
        self.args, self.shape, self.feats = args, shape, feats
        self.world = args.gpus_per_node * args.nodes
        self.gpu_limit = usable_bytes(gpu_budget(args.gpu_mem_gb))  # the run's rule (module docstring)
        self.cpu_limit = int(args.cpu_mem_gb * GiB)

    def chunks(self, sp: int, cp: int) -> int:
        """--attention_head_chunks at this split: the largest valid count <= N (max: the largest)."""
        want = self.args.attention_head_chunks
        if not self.shape.head_chunks_ok:  # a family chunks cannot run (planner/shapes.py): train.py refuses N > 1
            if want not in ("max", 1, "1"):
                raise ValueError(f"--attention_head_chunks {want}: {self.shape.model_type} cannot run its attention in "
                                 "head chunks (planner/shapes.head_chunks_refusal): use 1, max or leave it")
            return 1
        ok = head_chunk_choices(self.shape.num_heads, self.shape.num_kv_heads, sp // cp)
        return max(ok) if want == "max" else max(c for c in ok if c <= int(want))

    def evaluate(self, seq_len: int, sp: int, feats: Features | None = None, cp: int = 1) -> tuple[Estimate, bool, bool]:
        feats = feats or replace(self.feats, attention_head_chunks=self.chunks(sp, cp))
        # ds_recommendation's JSON (ds_configs/zero3_offload.json) pins the offloaded buffers: counted as pinned
        est = estimate(self.shape, seq_len, sp, self.world, feats, self.args.precision,
                       self.args.gpus_per_node, cp=cp, async_save=self.args.async_save, pinned_offloads=True,
                       pinned_limit=pinned_round_limit(self.args.alloc_conf), grad_accum=GRAD_ACCUM_DEFAULT)
        est.cpu_per_rank["process runtime (measured)"] = int(self.args.cpu_overhead_gb * GiB)
        return est, est.gpu_peak <= self.gpu_limit, est.cpu_per_node <= self.cpu_limit

    def longest(self, sp: int, feats: Features | None = None, cp: int = 1) -> int:
        """Longest multiple of sp (of 2*sp under cp > 1: zigzag) that fits (peak memory grows with length), at most
        ROPE_MAX_POSITIONS (2**24: float32 RoPE positions collapse past it; a run refuses a longer stage)."""
        return longest_multiple(lambda n: all(self.evaluate(n, sp, feats, cp)[1:]), sp * (2 if cp > 1 else 1),
                                ROPE_MAX_POSITIONS)

    def comm(self, seq_len: int, sp: int, cp: int) -> dict:
        a = self.args
        return layer_comm(self.shape, seq_len, sp, cp, a.gpus_per_node, a.precision, a.mfu, a.gpu_tflops,
                          ring=self.feats.ring_attention)


