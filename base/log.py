"""Console and log output of every rank: one rank-0 print helper and a log file per rank.

`print0` prints on rank 0 only (flushed: launchers buffer child output) and keeps the line in every rank's
own log, OUTPUT_DIR/logs/rankNNNNN.log, which `open_rank_log` opens (DeepSpeed's logger writes there too).
A console that is gone (a closed terminal or ssh session: EIO; a `| tee` that died with it: EPIPE) or a file on a full
disk (ENOSPC, EDQUOT) ends the console output only: its descriptors are pointed at /dev/null and the rank log goes on
(`console_gone`).
"""

from __future__ import annotations

import errno
import logging
import os
import select
import socket
import sys

_IS_MAIN = os.environ.get("RANK", "0") == "0"
_RANK_LOG = logging.getLogger("ulysses_longtrain.rank")
_GONE = (errno.EIO, errno.EPIPE)  # a hung-up terminal, a pipe without its reader
_FULL = (errno.ENOSPC, errno.EDQUOT)  # a console redirected to a file (`> out.log 2>&1`) on a full disk or quota


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
        say(*args, **kwargs)
    _RANK_LOG.info(" ".join(str(a) for a in args))


def say(*args, **kwargs) -> None:
    """Print to the console only (flushed), surviving a console that is gone (`console_gone`): the step lines of a run
    under `2>&1 | tee log` whose tee died with the terminal raised BrokenPipeError (exit 1, no save). A console that
    is a file on a full disk or quota (`python train.py > out.log 2>&1`) ends the same way: a step line's ENOSPC was
    exit 1 with a crash record, a node-0 requeue onto the same disk (an audit). The run goes on; a save or write that
    hits the full disk ends it with exit 2 (training/job.py)."""
    stream = kwargs.get("file") or sys.stdout
    try:
        print(*args, **kwargs, flush=True)
    except OSError as e:
        if e.errno not in _GONE + _FULL:
            raise
        console_gone(stream, e)


def _hung_up(fd: int) -> bool:
    """True when writing to fd can only fail: a pipe whose reader is gone, a terminal hung up (poll's ERR/HUP)."""
    p = select.poll()
    p.register(fd, select.POLLOUT)
    return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in p.poll(0))


def console_gone(stream, e: OSError) -> None:
    """`stream`'s terminal or pipe is gone, or its file's disk is full (the write raised `e`): it, and stdout/stderr
    where they are gone too, now write to /dev/null, so every later print (ours, a library's) and the interpreter's
    flush at exit succeed (either raised: exit 1 with a traceback instead of the 75 after a save). The rank log goes
    on."""
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        for s in dict.fromkeys((stream, sys.stdout, sys.stderr)):
            try:
                fd = s.fileno()
                if s is stream or _hung_up(fd):
                    os.dup2(null, fd)
            except (AttributeError, OSError, ValueError):  # no descriptor (a test's capture): nothing to point
                continue
    finally:
        os.close(null)
    _RANK_LOG.warning("console gone (%s): console output stopped; this log goes on", os.strerror(e.errno))


def open_rank_log(output_dir: str, rank: int) -> str:
    """OUTPUT_DIR/logs/rank00003.log for every rank: our messages, per-step timings and DeepSpeed's log. Appended by
    every start of the run: each start's part begins with a line naming its host, pid and Slurm job and restart (at
    512 ranks and 100+ requeues, which node and which requeue wrote a part is otherwise a guess from timestamps).
    A logs/ folder or log another user wrote (a requeue in a root container) is refused in one line, as base/run_lock.py
    refuses the output folder itself (a PermissionError traceback before: exit 1, which a requeue chain reads as a bug)."""
    from deepspeed.utils import logger as ds_logger

    path = os.path.join(output_dir, "logs", f"rank{rank:05d}.log")
    logs = os.path.dirname(path)
    try:
        os.makedirs(logs, exist_ok=True)
        if not os.access(logs, os.W_OK | os.X_OK) or os.path.exists(path) and not os.access(path, os.W_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        handler = logging.FileHandler(path)
    except OSError as e:
        if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EEXIST):
            raise  # a node's mount (ESTALE, EIO): a crash of this node, requeued without it (run_lock.acquire)
        raise ValueError(f"--output_dir {output_dir}: this user (uid {os.getuid()}) cannot write {e.filename or logs} "
                         f"({e.strerror}; written by another user: a run as root in a container?): give the folder to "
                         "this user (chown -R) or use another --output_dir") from None
    handler.setFormatter(logging.Formatter(f"%(asctime)s rank{rank} %(levelname)s %(message)s"))
    for log in (_RANK_LOG, ds_logger):
        log.addHandler(handler)
    _RANK_LOG.setLevel(logging.INFO)
    _RANK_LOG.propagate = False
    slurm = "".join(f" {k} {os.environ[k]}" for k in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT") if os.environ.get(k))
    _RANK_LOG.info(f"start: host {socket.gethostname()} pid {os.getpid()}{slurm}")
    return path


def rank_log(msg: str) -> None:
    """A line in this rank's own log file only (for debugging one rank of many)."""
    _RANK_LOG.info(msg)
