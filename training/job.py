"""The process around one rank of a training job: exit codes, a world of one without a launcher, and what a rank
does when it ends, well or not (train.py's last lines: `sys.exit(run_job(main))`).

Exit codes (base/exits.py has the table): 0 done, 1 failure (traceback in OUTPUT_DIR/logs/rankN.log), 2 bad input
(one line, before any work) or a full disk / quota (ENOSPC, EDQUOT: one line naming the path, any time), 69 a peer
lost (requeue), 75 saved after a preemption signal or near the time limit (requeue and `--resume auto`), 130 a
Ctrl-C before train.py's stop flag handles it (the start-up: one line, no crash record). A failing rank posts its
failure on the abort channel (base/comm.py) first, so every other rank stops within seconds instead of waiting in
a collective; every rank records its code where scripts/launch.sh reads it.

From its first line a rank records SIGUSR1/SIGUSR2 (a save request) instead of dying of them: ssh (pdsh mode) and
slurmstepd (`srun python train.py`, `scancel --signal=USR1` without --batch) start it with their default action,
terminate, and training/preemption.PreemptionFlag.install() comes only after the process group, the resume lookup and
the data (minutes at scale). install() takes a recorded one as received. SIGTERM is not recorded: before the flag a
rank has nothing to save, and the launchers that send it (deepspeed's launch.py and torchrun tearing down after a
rank's exit) SIGKILL 30 s later; dying of it at once keeps the -15 launch.sh reads as "failed on nobody's account".
Under a plain deepspeed launcher it also notes launch.py and its runner there: their death is a stop (launcher_gone);
which launchers are refused or noted, and that watch, is training/launcher.py.
"""

from __future__ import annotations

import errno
import os
import sys
import time
from collections.abc import Callable

from base.atomic import full_disk
from base.exits import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_PEER_LOST, EXIT_PREEMPTED, EXIT_USAGE  # noqa: F401 -- the table: base/exits.py
from training.launcher import _WATCH, launcher_note, launcher_refusal, watch_launcher

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout: "our own code" lives below it


_EARLY: list[int] = []  # save requests received before PreemptionFlag.install(), in order


def record_early_signals() -> None:
    """SIGUSR1/SIGUSR2 are recorded from here on until PreemptionFlag.install() (training/preemption.py) takes them
    (main thread only: elsewhere Python installs no handler)."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(s, lambda signum, frame: _EARLY.append(signum))  # no I/O in a handler


_FAULTS: list = []  # the open fault record (faulthandler writes to it from a signal handler: it must stay open)


def _launch_file(kind: str) -> str | None:
    """This rank's note `kind`<RANK> in the folder scripts/launch.sh reads (LAUNCH_EXIT_DIR); None without one."""
    where = os.environ.get("LAUNCH_EXIT_DIR")
    return os.path.join(where, f"{kind}{os.environ.get('RANK', '0')}") if where and os.path.isdir(where) else None


def record_faults() -> None:
    """A fatal signal's traceback (Python's faulthandler: SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT) is written to
    LAUNCH_EXIT_DIR/fault<RANK>, where scripts/launch_crash.sh reads which signal ended a rank that left without an
    exit of its own (a segfault is this node's `died`, the crash's origin; its traceback goes to the job's log)."""
    path = _launch_file("fault")
    if _FAULTS or path is None:
        return
    import faulthandler

    _FAULTS.append(open(path, "w"))  # noqa: SIM115
    faulthandler.enable(file=_FAULTS[0], all_threads=True)


def early_signals() -> list[int]:
    """The save requests recorded since record_early_signals(), oldest first; each is handed out once."""
    got = list(_EARLY)
    del _EARLY[: len(got)]
    return got


class Requeue(Exception):
    """Stop before doing work and be requeued (exit 75), raised on every rank from one decision (rank 0's, broadcast):
    e.g. a universal conversion that cannot finish before the job's end (training/universal.py)."""


def run_job(main: Callable[[], int], saves: bool = True) -> int:
    """Run `main` as one rank of a job; returns its exit code after leaving the abort channel and recording the
    code (an exception becomes 1, or 2 for the user's input or a full disk, after the others were told; Requeue 75;
    a Ctrl-C 130).
    `saves`: main installs a PreemptionFlag that takes the save requests recorded meanwhile (train.py); without one (evaluate.py:
    nothing to save) SIGUSR1/SIGUSR2 keep their default, the job's end, as `scancel --signal=USR2` means it."""
    if saves:
        record_early_signals()  # first: a save request during start-up must not kill the rank (module docstring)
        _WATCH[:] = [w for w in [watch_launcher(os.environ, os.getppid())] if w]  # before the runner can be gone
    record_faults()
    from base.env import configure

    # DeepSpeed's JIT ops from this checkout's cache, which scripts/setup.sh built, for every entry through here (not
    # only train.py's own call): without it a rank that reaches deepspeed.init_distributed on CPU loads the
    # shared-memory comm op from ~/.cache/torch_extensions, which every checkout shares and rebuilds with its own
    # include paths (90 s of compiling inside test_srun_python_starts_one_world after another clone had run it)
    configure()
    why = launcher_refusal(os.environ)
    if why:  # every rank has the same environment: the same line, before any process group
        _err(f"error: {why}")
        return _record(EXIT_USAGE)
    note = launcher_note(os.environ)
    if note and os.environ.get("RANK", "0") == "0":
        _err(note)
    _single_process_defaults()
    try:
        code = main()
    except Requeue as e:  # every rank raised it: a clean exit, nothing to tell the others
        if os.environ.get("RANK", "0") == "0":
            _err(f"requeue: {e}")
        code = EXIT_PREEMPTED
    except KeyboardInterrupt:  # a Ctrl-C no PreemptionFlag handles (train.py's start-up): the user's stop
        return _record(_interrupted())
    except Exception as e:
        try:
            code = _fail(e)
        except Exception:  # noqa: BLE001 -- a report that failed past _err's guard: the exit code is recorded
            code = EXIT_FAILED  # all the same (scripts/launch.sh reads LAUNCH_EXIT_DIR/rankN)
        return _record(code)
    _leave()
    return _record(code)


def _single_process_defaults() -> None:
    """Without a launcher's RANK: the world srun started (`srun python train.py`, one task per rank: base/slurm_env.py),
    else `python train.py ...` as a world of one."""
    from base.slurm_env import srun_world

    world = srun_world() if "RANK" not in os.environ else None
    if world is not None:
        os.environ.update(world)
    elif "RANK" not in os.environ:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", str(port)))


def _is_input_error(e: BaseException) -> bool:
    """A ValueError raised by this project's own code (input validation), not inside a library."""
    if not isinstance(e, ValueError) or e.__traceback__ is None:
        return False
    tb = e.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    where = os.path.realpath(tb.tb_frame.f_code.co_filename)  # a checkout reached through a symlink (a linked home)
    if not where.startswith(os.path.realpath(ROOT) + os.sep) or f"{os.sep}site-packages{os.sep}" in where:
        return False
    import linecache

    # our own `raise ValueError(...)`, not a C extension (numpy, torch) raising from a call on our line
    return linecache.getline(where, tb.tb_lineno).lstrip().startswith("raise ")


FULL = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded"}


NODE_LOCAL = ("/dev/shm", "/run/shm", "/run/user")  # a node's memory-backed folders: full there is the node's state
USER_DIRS: list[str] = []  # the run's own folders (--output_dir, the data cache, WANDB_DIR): set at its config's parse


def disk_full(e: BaseException | None) -> OSError | None:
    """The OSError ENOSPC / EDQUOT anywhere in `e`'s chain (its __cause__ / __context__), else None: torch's zip writer
    turns a short write into `RuntimeError [enforce fail at inline_container.cc] unexpected pos` with the OSError only
    as its context, a background save's error comes wrapped (training/async_save.py). A named OSError without errno
    (numpy's tofile: '54784 requested and 27120 written') counts where its file system has no block left
    (base/atomic.full_disk: one statvfs)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is None and e.filename:  # numpy's short write: no errno (base/atomic)
            full_disk(e, str(e.filename))
        if isinstance(e, OSError) and e.errno in FULL:
            return e
        e = e.__cause__ or e.__context__
    return None


def users_disk(e: BaseException | None) -> OSError | None:
    """disk_full's OSError where it names the file or folder written (a checkpoint's step folder: `naming`; an open()
    names its own) under one of the run's own folders (USER_DIRS; before they are known, anywhere but a node's
    memory-backed folders): the user's disk or quota (exit 2, no requeue). A full /dev/shm (multiprocessing's
    semaphores, NCCL's segments), a node's /tmp (torch's compile caches), or a write that names nothing stays a crash
    of this node (a requeue without it), as before: a node-local problem must not end the job for good."""
    full = disk_full(e)
    if full is None or not (full.filename or full.filename2):
        return None
    # a copy's OSError (shutil.copyfile: DeepSpeed's zero_to_fp32.py copied into checkpoints/ at every save) names its
    # source (site-packages) and the destination written as filename2: either under the run's folders is the user's
    wheres = [os.path.realpath(str(f)) for f in (full.filename2, full.filename) if f]
    under = lambda dirs: any(w == d or w.startswith(d.rstrip(os.sep) + os.sep)  # noqa: E731
                             for w in wheres for d in dirs)
    if USER_DIRS:
        return full if under([os.path.realpath(d) for d in USER_DIRS if d]) else None
    return None if under(NODE_LOCAL) else full


def naming(e: BaseException, path: str) -> None:
    """Name `path` (a file or the folder being written) as where `e`'s disk-full OSError happened, when the OSError
    names none itself (a write() into an open file never does): the refusal says where to free space."""
    full = disk_full(e)
    if full is not None and not full.filename:
        full.filename = path


def disk_full_line(full: OSError, flag: str = "--output_dir", again: str | None = None) -> str:
    """The one line for a write the file system refused for room (a user's disk or quota, not a crash): which path,
    the errno's text, what to run to see it. `flag` / `again`: another tool's output flag and next step
    (scripts/export_hf.py: --out, run the export again)."""
    where = str(full.filename2 or full.filename or "")  # a copy's destination (users_disk), else the file written
    what = f"{FULL[full.errno]} ({errno.errorcode[full.errno]}) writing " + (
        where or "a file the error does not name (under --output_dir, WANDB_DIR or the data cache ULYSSES_CACHE)")
    folder = (where if os.path.isdir(where) else os.path.dirname(where)) or "DIR"
    if full.errno == errno.EDQUOT:  # user/group/project quotas: statvfs (shutil.disk_usage) never sees them
        return (f"{what}: a quota is full; see it with `lfs quota -hu $USER {folder}` (Lustre) or `quota -s`, free "
                f"space within it or give {flag} a file system with room, "
                f"{again or 'then start the run again (--resume auto)'}")
    return (f"{what}: free space there (`df -h {folder}`) or give {flag} a larger file system, "
            f"{again or 'then start the run again (--resume auto continues from the newest complete checkpoint)'}")


def _await_monitor_exit() -> None:
    """After a hang this rank's monitor declared: its thread ends the process (os._exit 69) once the others have read
    why. Returning instead raced it into the interpreter's shutdown with the process group's threads alive ("terminate
    called without an active exception", SIGABRT: exit -6 in a clean clone of 32b1b03). Waits for it, bounded as
    comm.abort bounds itself, then exits the same way."""
    from base import watcher

    time.sleep(watcher.ABORT_WAIT_S + watcher.EXIT_GRACE_S)
    os._exit(EXIT_PEER_LOST)



def _err(text: str) -> None:
    """`text` on stderr, whatever stderr is: a file on the full disk this rank is reporting (`python train.py > log
    2>&1`) raised ENOSPC from _fail's own print, and the exit-2 path became exit 1 with no exit record (an audit).
    base.log.say points a full or gone console at /dev/null; anything else it raises is dropped here."""
    try:
        from base.log import say

        say(text, file=sys.stderr)
    except Exception:  # noqa: BLE001 -- the report is lost, the exit code is not
        pass


def _interrupted() -> int:
    """A Ctrl-C (SIGINT: Python's KeyboardInterrupt) where no PreemptionFlag handles it: train.py's start-up (the
    process group, the resume lookup, the model and the data: minutes at 8B / 1M) or evaluate.py, nothing to save.
    The user's stop, not a failure: one line, no traceback, no crash record (it had a node requeued without it), exit
    130. A rank the signal did not reach is told through the abort channel where it is up (base/comm.py: seconds),
    instead of waiting in a collective."""
    rank = os.environ.get("RANK", "0")
    line = f"rank {rank} stopped by Ctrl-C (SIGINT) with nothing to save yet: exiting {EXIT_INTERRUPTED}"
    comm = sys.modules.get("base.comm")  # not imported yet: no process group to tell (and no torch import for it)
    if comm is not None:
        comm.abort(line, EXIT_INTERRUPTED)
    if rank == "0":
        _err(f"stopped: {line}")
    return EXIT_INTERRUPTED


def _fail(e: BaseException) -> int:
    """This rank's exception ends the job: post it on the abort channel first (every other rank stops within
    seconds instead of waiting in a collective for dist_timeout_s), then report it here. Returns the exit code."""
    rank = os.environ.get("RANK", "0")
    try:
        from base import comm, progress
    except Exception:  # noqa: BLE001 -- the failure was importing our own stack: nothing to tell the others
        comm = progress = None
    if progress is not None and progress.DECLARED:  # this rank's monitor ended the job as a hang (it exits 69 itself
        # once the others have read it); what the main thread raised since is the hung rank leaving its collective
        _err(f"error: the first failure of the job: {progress.DECLARED}")
        _await_monitor_exit()
        return EXIT_PEER_LOST
    full = users_disk(e)
    if full is not None or _is_input_error(e):  # our validation of the user's input: one line, no traceback, nothing
        # saved touched; or a full disk / quota under the run's folders (a write naming its file: a checkpoint's, an
        # open(); users_disk), the user's to fix, not a node's fault: exit 2 everywhere, never a crash record (a
        # failure only rank 0 hits made node 0 the only node that crashed on its own: requeued without a healthy node).
        # The line itself goes to every rank: a check one node fails alone (its network interface, a path it lacks)
        # is not on rank 0's output. Printed once per node (its local rank 0), by rank 0, and by the rank on record
        e = ValueError(disk_full_line(full)) if full is not None else e
        own = f"rank {rank} stopped on {'a full disk' if full is not None else 'an input error'}: {e}"
        first = comm.abort(own, EXIT_USAGE) if comm is not None else own
        local = os.environ.get("ULYSSES_LOCAL_RANK") or os.environ.get("LOCAL_RANK", "0")  # base/comm.init
        if "0" in (rank, local) or first.startswith(f"rank {rank} "):
            _err(f"error: {e}")
        return EXIT_USAGE
    # anything else is a failure: the traceback in this rank's log (and stderr), one summary line
    import traceback

    own = f"rank {rank} failed: {type(e).__name__}: {e}"
    watching = getattr(comm, "_WATCHER", None) if comm is not None else None
    posted = watching.post(own, EXIT_FAILED) if watching is not None else own  # posted: first wins
    stopping = getattr(sys.modules.get("training.preemption"), "WINDOWED_AT", None)
    if not stopping:  # after this rank's SIGTERM: the stop's teardown, no crash of this node's own (preemption.py)
        _crash_record(rank, posted)
    first = comm.abort(own, EXIT_FAILED) if comm is not None else own
    text = traceback.format_exc()
    try:
        from base.log import rank_log

        rank_log(text)
    except Exception:  # noqa: BLE001
        pass
    _err(text)
    _err(f"error: rank {rank} failed with {type(e).__name__}: {e} (traceback above and in the rank log)")
    if not first.startswith(f"rank {rank} failed:"):
        _err(f"error: the first failure of the job: {first}")
    return EXIT_FAILED


def _crash_record(rank: str, first: str) -> None:
    """This node's crash verdict for scripts/slurm.sbatch (LAUNCH_CRASH_FILE, set per node): `first` when this rank's
    failure is the job's first on record, else `own` (a rank here raised too, after another's failure), `first`
    winning over `own`. Written by the failing rank itself, as soon as its failure is posted and before it waits for
    the others: its launcher's own verdict (launch.sh, through node 0's job store) can come too late, node 0's store
    gone, or srun's SIGTERM ending the launcher first. Bounded (2 s: the file is on the shared file system)."""
    where = os.environ.get("LAUNCH_CRASH_FILE")
    if not where:
        return
    verdict = "first" if first.startswith(f"rank {rank} failed:") else "own"

    def write() -> None:
        try:
            flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if verdict == "first" else os.O_EXCL)
            with os.fdopen(os.open(where, flags, 0o644), "w") as fh:
                fh.write(f"{verdict}\n")
        except OSError:  # `own` with a verdict there already, or the folder gone: launch.sh's verdict stands
            pass

    import threading

    t = threading.Thread(target=write, daemon=True)
    t.start()
    t.join(2.0)


def _leave() -> None:
    """main() returned on every rank (0, or 75 after the agreed save): leave the abort channel cleanly."""
    if "base.comm" in sys.modules:
        sys.modules["base.comm"].leave()


def _record(code: int) -> int:
    """Record `code` where scripts/launch.sh reads it (LAUNCH_EXIT_DIR): a launcher that was signalled too (SLURM
    signals every process of a job) reports its own code, not the ranks'. Returns `code`."""
    if "base.run_lock" in sys.modules:  # rank 0's hold on the output folder ends with the run, whatever its end
        sys.modules["base.run_lock"].release()
    path = _launch_file("rank")
    if path is not None:
        with open(path, "w") as fh:
            fh.write(f"{code}\n")
    return code
