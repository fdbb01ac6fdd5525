"""Launching a small multi-process world on this machine for tests (torch.distributed over gloo).

Each rank is a plain subprocess with RANK / WORLD_SIZE / MASTER_* set, the same environment the
deepspeed launcher gives its children; tests can signal or kill individual ranks. The launcher lives in
bench/harness.py, which the benchmarks share (tests may import bench; bench never imports tests).
"""

from __future__ import annotations

from bench.harness import DIST_TIMEOUT_S, ROOT, free_port, run, spawn, wait

__all__ = ["DIST_TIMEOUT_S", "ROOT", "free_port", "run", "spawn", "wait"]
