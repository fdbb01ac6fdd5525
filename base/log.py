"""Console and log output of every rank: one rank-0 print helper and a log file per rank.

`print0` prints on rank 0 only (flushed: launchers buffer child output) and keeps the line in every rank's
own log, OUTPUT_DIR/logs/rankNNNNN.log, which `open_rank_log` opens (DeepSpeed's logger writes there too).
"""

from __future__ import annotations

import logging
import os

_IS_MAIN = os.environ.get("RANK", "0") == "0"
_RANK_LOG = logging.getLogger("ulysses_longtrain.rank")


def cause(e: BaseException, width: int = 120) -> str:
    """A library's exception as one line for a user's refusal: its type and its first non-empty line."""
    first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
    return f"{type(e).__name__}: {first[:width]}" if first else type(e).__name__


def set_main(is_main: bool) -> None:
    global _IS_MAIN
    _IS_MAIN = is_main


def print0(*args, **kwargs) -> None:
    """Print on rank 0 only (flushed: launchers buffer child output); every rank keeps it in its log file."""
    if _IS_MAIN:
        print(*args, **kwargs, flush=True)
    _RANK_LOG.info(" ".join(str(a) for a in args))


def open_rank_log(output_dir: str, rank: int) -> str:
    """OUTPUT_DIR/logs/rank00003.log for every rank: our messages, per-step timings and DeepSpeed's log."""
    from deepspeed.utils import logger as ds_logger

    path = os.path.join(output_dir, "logs", f"rank{rank:05d}.log")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter(f"%(asctime)s rank{rank} %(levelname)s %(message)s"))
    for log in (_RANK_LOG, ds_logger):
        log.addHandler(handler)
    _RANK_LOG.setLevel(logging.INFO)
    _RANK_LOG.propagate = False
    return path


def rank_log(msg: str) -> None:
    """A line in this rank's own log file only (for debugging one rank of many)."""
    _RANK_LOG.info(msg)
