"""Launching a small multi-process world on this machine for tests (torch.distributed over gloo).

Each rank is a plain subprocess with RANK / WORLD_SIZE / MASTER_* set, the same environment the
deepspeed launcher gives its children; tests can signal or kill individual ranks.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from base.env import EXTENSIONS_DIR

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The collective timeout of every multi-process test (train.py's --dist_timeout_s, the workers' init): low, so a
# rank left waiting in a collective for another's long solo work fails a test here instead of a cluster job.
DIST_TIMEOUT_S = 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(script: str, args: list[str], nproc: int, log_dir: str, extra_env: dict | None = None) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    if script.endswith("train.py") and not any(a.startswith("--dist_timeout_s") for a in args):
        args = [*args, "--dist_timeout_s", str(DIST_TIMEOUT_S)]
    os.makedirs(log_dir, exist_ok=True)
    for rank in range(nproc):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
                   PYTHONPATH=ROOT, WANDB_MODE="offline")
        env.setdefault("TORCH_EXTENSIONS_DIR", EXTENSIONS_DIR)  # the checkout's built ops (base/env.py)
        env.update(extra_env or {})  # PYTHONPATH included (a stub folder in front of the repo)
        log = open(os.path.join(log_dir, f"rank{rank}.log"), "w")
        procs.append(subprocess.Popen([sys.executable, script, *args], cwd=ROOT, env=env, stdout=log,
                                      stderr=subprocess.STDOUT))
    return procs


def wait(procs: list[subprocess.Popen], log_dir: str, timeout: float = 600) -> list[int]:
    codes = []
    try:
        for p in procs:
            codes.append(p.wait(timeout=timeout))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return codes


def run(script: str, args: list[str], nproc: int, log_dir: str, timeout: float = 600, expect: int | None = 0,
        extra_env: dict | None = None) -> list[int]:
    """Run to completion; on an unexpected exit code fail with the tail of rank 0's log."""
    codes = wait(spawn(script, args, nproc, log_dir, extra_env), log_dir, timeout)
    if expect is not None and any(c != expect for c in codes):
        tails = []
        for r in range(nproc):
            with open(os.path.join(log_dir, f"rank{r}.log")) as fh:
                tails.append(f"--- rank{r} ---\n" + "".join(fh.readlines()[-25:]))
        raise AssertionError(f"exit codes {codes} (expected {expect})\n" + "\n".join(tails))
    return codes
