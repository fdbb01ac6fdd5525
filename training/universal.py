"""DeepSpeed universal checkpoints: a checkpoint written by N ranks, converted for a run of another world size.

    OUTPUT_DIR/universal/                  this run's conversions: written where this run may write, never beside
                                           their source (it may be read-only, another team's, or rotated by its run)
        <key>/                             one finished conversion; key: the first 24 hex digits of the SHA-256 of the
                                           source's MANIFEST.json (DeepSpeed loads load_dir=universal/<key>, tag=step_N)
            step_000200/                   ds_to_universal's output
            DONE                           {"source": key, "source_path", "files": {name: size}, "bytes", "seconds"}
        <key>.lock/                        held while <key> is converted: OWNER (job id, requeue count, host, pid);
                                           its mtime is the owner's heartbeat (touched every HEARTBEAT_S)
        <key>.tmp.<host>.<pid>/            a conversion being written by that process; renamed to <key> once DONE is
                                           in it (a rename onto an existing <key> fails: the first complete one wins);
                                           a failed, losing or taken-over one is renamed into checkpoints/.trash
        RATE.json                          the last conversion's measured bytes and seconds (the next estimate)

**Keyed by content, not by name.** A branch (`--resume step_000100`) writes a new `step_000200` under an old name;
a conversion is found by the identity of the checkpoint there now: the SHA-256 of its MANIFEST.json, which lists
every file's size and CRC32 (and the step, world, layout). Another content is another key: converted again, never
loaded through an old conversion. This run's rotation (training/rotation.py) keeps the conversions of its newest `keep`
checkpoints and the resumed one only (a stage end's is made again if needed), never one in progress; no other run's.

**Two jobs, one source** (two branches started at once, a requeued job whose earlier incarnation still runs; the lock
is training/universal_lock.py): the first to create `<key>.lock` (an atomic mkdir, also on NFS) converts; the others
wait for `<key>/DONE` and load it. A lock whose owner is gone is taken over: its heartbeat older than STALE_S, its
process gone (same host), it was an earlier run of this same Slurm job (SLURM_JOB_ID equal, SLURM_RESTART_COUNT
lower), or its job is another job of this cluster that Slurm says has ended (`scontrol show job`: not RUNNING,
SUSPENDED, COMPLETING, ...; base/run_lock.py) once its heartbeat is late (a killed conversion, then a new sbatch on
other hosts: ~1 min, not STALE_S's 10 min of the whole allocation idle, ~85 GPU-hours at 512 ranks). Each converter
writes only its own `<key>.tmp.<host>.<pid>` and renames it into place: even two converters at once (a suspended owner
resumed after its lock was taken over) never delete or overwrite each other's files.

**Bounded by the job's end.** `python -m deepspeed.checkpoint.ds_to_universal` runs in one process on rank 0 and
cannot resume (killed at the time limit, it started again from nothing on every requeue). Rank 0 estimates its time
from the checkpoint's bytes and the last measured rate (RATE.json; `RATE_GUESS_BPS` until a conversion of at least
`TRUST_BYTES` was measured) and starts it only if it, a step and a save fit before the job's end (`Deadline`:
SLURM_JOB_END_TIME, before Slurm 23.02 scontrol's EndTime, or --time_limit_s); else exit 75 (requeue), or 2 with the
fix when it cannot fit even a whole allocation (END - SLURM_JOB_START_TIME, before 23.02 as scripts/slurm.sbatch
exports them): convert in a longer job (`python -m training.universal CHECKPOINT OUTPUT_DIR`) or resume at the saved
world size. One that runs past its estimate (or a wait for another job's) is stopped before the end, its time recorded
for the next estimate, exit 75. An output dir this job cannot write: exit 2, one line.

Cost at target scale (Llama-3-8B, 32 ranks, ZeRO-3): the checkpoint is ~100 GB, 96 GB of fp32 master weights and
Adam moments in 32 partitions. ds_to_universal reads them, writes one fragment per parameter, state and partition
(291 x 3 x 32 = 28k files, 96 GB; 447k at 512 ranks), reads them back and writes the merged tensors: ~390 GB of I/O
from one node. On disk in the converting run's output dir (its quota) the fragments stay until the merged tensors and
rank 0's whole optimizer file (1/W) are written: (2 + 1/W)x the checkpoint at the peak (~203 GB), (1 + 1/W)x kept;
refused before it starts without that room (`prepare`). At 1-2 GB/s that is 3-7 minutes; at the 149 MB/s per node
measured for saves (docs/results/checkpoints.md) ~45 minutes; the guess (50 MB/s of checkpoint bytes) says 33. A second
job branching from the same source waits instead (its lock: a mkdir, a 100-byte file, a utime per HEARTBEAT_S). The
other ranks wait in `comm.run_on_main` (a host gloo group, 6 h timeout); the abort channel's heartbeat comes from a
helper process of each rank (base/comm.py), so the wait is never taken for a stall.

Offline: `python -m training.universal RUN/checkpoints/step_000200 [OUTPUT_DIR]` converts it with no deadline into
OUTPUT_DIR/universal/ (default: RUN), in a job of its own before a resume at another world size there, recorded alike.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time

from base import stopped
from base.log import print0
from training.checkpoint_files import MANIFEST, atomic_write, list_files, manifest_sha256, read_json
from training.universal_lock import STALE_S, Lock, _me, _tmp, gone, to_trash

DONE = "DONE"
RATE = "RATE.json"
START_S = 30.0  # the converter's own start-up (python, torch, deepspeed imports) and its small files
RATE_GUESS_BPS = 50e6  # checkpoint bytes per second until measured (see the module docstring)
TRUST_BYTES = 2**30  # a finished conversion smaller than this measures start-up, not the file system's rate
SAFETY = 1.25  # a measured rate varies with the file system's load
WAIT_EVERY_S = 5.0  # how often a job waiting for another's conversion looks for its DONE (by name)
CONVERTER = "deepspeed.checkpoint.ds_to_universal"
# The converter runs with SIGUSR1 / SIGUSR2 ignored (its worker pool inherits that): a save request sent to every
# process of a Slurm step (`--signal=USR1@T` without B:, `scancel --signal=USR2` without --batch) killed it, a
# traceback and exit 1 (a crash requeue that excluded a healthy node). The rank takes the request itself, after.
_CHILD = ("import runpy, signal, sys; [signal.signal(s, signal.SIG_IGN) for s in (signal.SIGUSR1, signal.SIGUSR2)]; "
          "m = sys.argv.pop(1); sys.argv[0] = m; runpy.run_module(m, run_name='__main__', alter_sys=True)")
KEY = re.compile(r"^[0-9a-f]{24}$")
PARTIAL = re.compile(r"^[0-9a-f]{24}\.tmp\.")  # a converter's folder; in the trash never walked (~10^5 files at 512)


def source_id(ckpt: str) -> str | None:
    """The content identity of the checkpoint at `ckpt`: SHA-256 of its manifest (every file's size and CRC32)."""
    sha = manifest_sha256(ckpt)
    return sha and sha[:24]


def home(output_dir: str) -> str:
    """The folder of this run's conversions: OUTPUT_DIR/universal."""
    return os.path.join(os.path.abspath(output_dir), "universal")


def folder(ckpt: str, output_dir: str) -> str | None:
    """Where the conversion of the checkpoint now at `ckpt` lives for the run in `output_dir` (None: no manifest)."""
    sid = source_id(ckpt)
    return sid and os.path.join(home(output_dir), sid)


def record(out: str, name: str = DONE) -> dict:
    """The DONE record of the conversion in `out` (`name`: another record there, RATE), {} if none or unreadable."""
    got = read_json(os.path.join(out, name))
    return got["json"] if isinstance(got.get("json"), dict) else {}


def is_conversion_of(out: str, ckpt: str) -> bool:
    """Whether `out` holds a finished conversion of exactly the checkpoint now at `ckpt`."""
    sid = source_id(ckpt)
    return sid is not None and record(out).get("source") == sid


def estimate_s(nbytes: int, measured: dict) -> float:
    """Seconds to convert `nbytes` of checkpoint: start-up plus bytes at the measured rate (a finished conversion of
    at least TRUST_BYTES, or one stopped unfinished: its time is a lower bound), else at the guess."""
    rate = RATE_GUESS_BPS
    if measured.get("bytes") and (measured["bytes"] >= TRUST_BYTES or not measured.get("finished", True)):
        rate = measured["bytes"] / max(float(measured["seconds"]) - START_S, 1.0) / SAFETY
    return START_S + nbytes / rate


# ---------------------------------------------------------------- what rotation keeps


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except FileNotFoundError:  # removed meanwhile
        return time.time()


def bound(where: str, keep: set[str], remove=None) -> None:
    """Rank 0, after a commit: drop this run's finished conversions whose source is not in `keep` (rotation's: its
    newest checkpoints' keys and the resumed one's; ~100 GB each at 8B) and what a gone converter left (its lock, its
    partial folder). Never a conversion in progress: a key whose lock's owner is alive is left whole."""
    if not os.path.isdir(where):
        return
    remove = remove or (lambda p: shutil.rmtree(p, ignore_errors=True))  # rotation passes its background Trash
    live: dict[str, bool] = {}  # key -> its lock's owner may still be converting (looked up by name, not listed)
    for n in sorted(os.listdir(where)):
        key, p = n[:24], os.path.join(where, n)
        if not KEY.match(key) or live.setdefault(key, gone(os.path.join(where, key + ".lock")) is None):
            continue
        if n == key and key not in keep:
            remove(p)
        elif n.endswith(".lock") or ".stale." in n:
            remove(p)
        elif ".tmp." in n and time.time() - _mtime(p) > STALE_S:  # no live lock: its owner was taken over
            remove(p)


# ---------------------------------------------------------------- conversion


DISK_MARGIN = 1.05  # as a save's room check (training/checkpoint_room.py)


def conversion_peak_bytes(nbytes: int, saved_world: int | None) -> float:
    """The most ds_to_universal (deepspeed 0.19.8, ZeRO-3 `main`) holds on disk converting `nbytes` written by
    `saved_world` ranks: every fragment under <output>/tmp (1x), the merged zero/* (1x), then rank 0's whole optimizer
    file (1/W) before tmp goes at the end: (2 + 1/W)x (measured 2.50x at W=2). An unknown world counts as 1 (3x)."""
    return nbytes * (2 + 1 / max(saved_world or 1, 1))


def conversion_kept_bytes(nbytes: int, saved_world: int | None) -> float:
    """What the finished conversion keeps: the merged tensors and optimizer_state.pt, (1 + 1/W)x the checkpoint."""
    return nbytes * (1 + 1 / max(saved_world or 1, 1))


def tree_bytes(folder: str, skip: re.Pattern | None = None) -> int:
    """Bytes of the files under `folder` (0 when there is none; its folders named as `skip` left out). The trash
    thread deletes them meanwhile: a file gone between the listing and its stat counts 0 (a FileNotFoundError once)."""
    total = 0
    for d, ds, fs in os.walk(folder):
        ds[:] = [n for n in ds if d != folder or skip is None or not skip.match(n)]
        for f in fs:
            try:
                total += os.lstat(os.path.join(d, f)).st_size
            except OSError:
                pass
    return total


def _writable(where: str) -> str | None:
    """None if this process can create folders in `where` (made if missing), else why not."""
    try:
        os.makedirs(where, exist_ok=True)
        probe = os.path.join(where, f".probe.{socket.gethostname()}.{os.getpid()}")
        os.mkdir(probe)
        os.rmdir(probe)
    except OSError as e:
        return e.strerror or str(e)
    return None


def prepare(ckpt: str, saved_world: int, world: int | None, output_dir: str, deadline=None) -> dict:
    """Rank 0: the conversion of `ckpt` ready to load, made now (or by another job now) if needed and if it fits before
    `deadline`. Returns {"dir": load_dir, "files": {name: size}}, {"requeue": reason} or {"refuse": reason} (a line)."""
    sid = source_id(ckpt)
    if sid is None:
        return {"refuse": f"checkpoint {ckpt} has no readable {MANIFEST}: resume from a committed checkpoint"}
    where = home(output_dir)
    out = os.path.join(where, sid)
    done = record(out)
    if done.get("source") == sid:
        return {"dir": out, "files": done["files"]}
    why = _writable(where)
    if why:
        return {"refuse": f"checkpoint {ckpt} (written by {saved_world} ranks) needs a universal conversion for "
                          f"{world} ranks, written under {where}, which this job cannot write ({why}): give "
                          "--output_dir a folder this job may write, or resume with the saved world size"}
    manifest = read_json(os.path.join(ckpt, MANIFEST)).get("json") or {}
    nbytes = sum(int(e["size"]) for e in manifest.get("files", {}).values())
    trash = os.path.join(output_dir, "checkpoints", ".trash")
    room = shutil.disk_usage(where).free + tree_bytes(trash, PARTIAL)
    peak = conversion_peak_bytes(nbytes, saved_world) * DISK_MARGIN  # a full disk half-way lost the hour
    if peak > room and os.path.isdir(trash):  # a killed conversion's fragments in the trash, which nothing may be
        for n in os.listdir(trash):  # deleting (`python -m training.universal`, evaluate.py): removed now where the
            if PARTIAL.match(n):  # room needs them (~10^5 files at 512 ranks: minutes; the conversion takes longer)
                shutil.rmtree(os.path.join(trash, n), ignore_errors=True)
        room = shutil.disk_usage(where).free + tree_bytes(trash, PARTIAL)
    if peak > room:
        return {"refuse": f"checkpoint {ckpt} (written by {saved_world} ranks) needs a universal conversion for "
                          f"{world} ranks of ~{peak / 1e9:.1f} GB under {where} while it converts (~"
                          f"{conversion_kept_bytes(nbytes, saved_world) / 1e9:.1f} GB kept), {room / 1e9:.1f} GB "
                          "free there: free space, give --output_dir a larger file system, or resume with "
                          f"{saved_world} ranks"}
    est = estimate_s(nbytes, record(where, RATE))
    timeout = None
    end = deadline.known() if deadline is not None else None  # Slurm < 23.02: scontrol's EndTime (preemption.py)
    if end is not None:
        needed = deadline.needed_s(ahead_s=est)  # the conversion, then a step, a save and the margin
        start = os.environ.get("SLURM_JOB_START_TIME")
        what = (f"checkpoint {ckpt} ({nbytes / 1e9:.1f} GB, written by {saved_world} ranks) needs a universal "
                f"conversion for {world} ranks of about {est / 60:.0f} min")
        if start and end - float(start) < needed:
            return {"refuse": f"{what}, more than this job's whole allocation ({(end - float(start)) / 60:.0f} min) "
                              f"with a step and a save after it: convert it in a longer job first (python -m "
                              f"training.universal {ckpt} {os.path.abspath(output_dir)}), or resume with "
                              f"{saved_world} ranks"}
        left = end - time.time()
        if left < needed:
            return {"requeue": f"{what}; {left / 60:.0f} min are left before the job's end, not enough with a step "
                               "and a save after it: not started, exiting 75 to be requeued"}
        timeout = left - (needed - est)  # stop it in time to exit before the end, whatever the estimate said
    give_up = None if timeout is None else time.monotonic() + timeout
    lock, said = Lock(out), False
    while (holder := lock.acquire()) is not None:  # another job converts this very source: wait for its DONE
        done = record(out)
        if done.get("source") == sid:
            return {"dir": out, "files": done["files"]}
        if give_up is not None and time.monotonic() >= give_up:
            return {"requeue": f"the universal conversion of {ckpt} by job {holder.get('job')} on {holder.get('host')} "
                               f"(pid {holder.get('pid')}) did not finish before this job's end: exiting 75 to be "
                               "requeued"}
        if not said:
            print0(f"checkpoint {ckpt} is being converted to a universal checkpoint in {out} by job "
                   f"{holder.get('job')} on {holder.get('host')} (pid {holder.get('pid')}): waiting for it")
            said = True
        time.sleep(WAIT_EVERY_S)
    try:
        done = record(out)  # finished by the job whose lock was just released
        if done.get("source") == sid:
            return {"dir": out, "files": done["files"]}
        print0(f"checkpoint {ckpt} was written by {saved_world} ranks"
               + ("" if world is None else f", this run has {world}")
               + f": converting it to a DeepSpeed universal checkpoint in {out} (about {est / 60:.1f} min estimated)")
        left = None if give_up is None else max(give_up - time.monotonic(), 1.0)
        return {"dir": out, "files": convert(ckpt, out, sid, nbytes, left)["files"]}
    except subprocess.TimeoutExpired as e:
        return {"requeue": f"the universal conversion of {ckpt} was stopped after {e.timeout / 60:.0f} min, before the "
                           "job's end (its time is recorded for the next estimate): exiting 75 to be requeued"}
    except subprocess.CalledProcessError as e:  # killed by Slurm ending the job's steps (the time limit, a
        import signal  # preemption, srun's --kill-on-bad-exit: TERM, INT, HUP): a stop; any other death (an OOM
        # kill, a segfault) is the converter's failure, said as it is
        stops = {-signal.SIGTERM, -signal.SIGINT, -signal.SIGHUP}
        if e.returncode not in stops:
            raise
        return {"requeue": f"the universal conversion of {ckpt} was ended by {signal.Signals(-e.returncode).name} "
                           "(the job's processes are being stopped): exiting 75 to be requeued"}
    finally:
        lock.release()


def workers(ckpt: str, cpus: int | None = None, free: int | None = None) -> tuple[int, int]:
    """ds_to_universal's process counts (extract, merge) for this node: every GPU waits on it (run_on_main), and 2 / 1
    (one merge worker is DeepSpeed's serial "unit testing" pass) merged Llama-3-8B's 291 parameters x 3 states from
    every rank's fragments one at a time (~56k reads, 30-45 min on a shared file system at 64 ranks). Extract: half the
    usable CPUs, at most 8, each holding one rank's optimizer file (x2 while split) within half the job's free host
    memory; merge: a CPU in 16, at most 4 (each holds a parameter's states whole: 8B's embedding, 2.1 GB a state)."""
    from base.host import job_memory_available, usable_cpus

    cpus = len(usable_cpus()) if cpus is None else cpus
    free = job_memory_available() if free is None else free
    files = [os.path.join(ckpt, f) for f in list_files(ckpt) if f.endswith("optim_states.pt")]
    biggest = max((os.path.getsize(f) for f in files), default=0)
    extract = max(2, min(8, cpus // 2))
    if free and biggest:
        extract = max(1, min(extract, free // 2 // (2 * biggest)))
    return extract, max(1, min(4, cpus // 16))


def convert(ckpt: str, out: str, sid: str | None, nbytes: int, timeout: float | None = None) -> dict:
    """Run ds_to_universal from `ckpt` into this process's own `<out>.tmp.<host>.<pid>`, write DONE in it, rename it to
    `out` (another converter's already there is kept, ours trashed), record the measured rate; returns the record.
    Stopped at `timeout`: its time recorded as unfinished, TimeoutExpired raised. The caller holds `out`'s lock.
    The time recorded is the conversion's running time: the seconds this process was stopped within it (`scontrol
    suspend`, gang scheduling: the whole job frozen, the converter with it) are left out (base/stopped.py's COUNTER).
    A 2 h suspend during a 10 min conversion recorded 130 min: the next allocation's estimate (estimate_s) was 13x
    the conversion, and a job whose allocation could not hold that was refused (exit 2) for a conversion that fits."""
    tag, where = os.path.basename(os.path.abspath(ckpt.rstrip("/"))), os.path.dirname(out)
    tmp = _tmp(out, _me())
    shutil.rmtree(tmp, ignore_errors=True)  # this process's own leftover only
    os.makedirs(tmp)
    counter = stopped.COUNTER.start()  # looking from now on (a rank's Deadline started it already)
    t0 = time.monotonic()
    try:
        extract, merge = workers(ckpt)
        subprocess.run([sys.executable, "-c", _CHILD, CONVERTER, "--input_folder", ckpt,
                        "--output_folder", os.path.join(tmp, tag), "--num_extract_workers", str(extract),
                        "--num_merge_workers", str(merge), "--inject_missing_state"],
                       check=True, stdout=subprocess.DEVNULL, timeout=timeout)
    except BaseException as e:
        to_trash(tmp)  # renamed, deleted in the background: a stop's exit is not held up by its fragments
        if isinstance(e, subprocess.TimeoutExpired):
            atomic_write(os.path.join(where, RATE), json.dumps(
                {"bytes": nbytes, "seconds": counter.running(time.monotonic() - t0), "finished": False}))
        raise
    seconds = counter.running(time.monotonic() - t0)
    files = {f: os.path.getsize(os.path.join(tmp, tag, f)) for f in list_files(os.path.join(tmp, tag))}
    done = {"source": sid, "source_path": ckpt, "files": files, "bytes": nbytes, "seconds": round(seconds, 1)}
    atomic_write(os.path.join(tmp, DONE), json.dumps(done))
    try:
        os.rename(tmp, out)
    except OSError as e:  # ENOTEMPTY / EEXIST: another converter's complete one is in place first
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST) or record(out).get("source") != sid:
            raise
        to_trash(tmp)
        done = record(out)
    atomic_write(os.path.join(where, RATE), json.dumps({"bytes": nbytes, "seconds": seconds, "finished": True}))
    return done


def main(argv: list[str] | None = None) -> int:
    """python -m training.universal CHECKPOINT [OUTPUT_DIR]: convert it now, no deadline (a job of its own), into
    OUTPUT_DIR/universal/ (default: CHECKPOINT's run folder), where a resume with that --output_dir finds it. Exit 2
    with one line for a CHECKPOINT that is not one or an OUTPUT_DIR this user cannot write."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (1, 2) or source_id(args[0]) is None:
        print("usage: python -m training.universal OUTPUT_DIR/checkpoints/step_N [OUTPUT_DIR of the run that will "
              "resume from it] (a committed checkpoint: MANIFEST.json)", file=sys.stderr)
        return 2
    ckpt = os.path.abspath(args[0].rstrip("/"))
    output_dir = args[1] if len(args) == 2 else os.path.dirname(os.path.dirname(ckpt))
    out = folder(ckpt, output_dir)
    if is_conversion_of(out, ckpt):
        print(f"{out} already holds the conversion of {ckpt}")
        return 0
    saved = (read_json(os.path.join(ckpt, MANIFEST)).get("json") or {}).get("world")
    got = prepare(ckpt, saved, None, output_dir)
    if "dir" not in got:
        print(f"error: {got.get('refuse') or got.get('requeue')}", file=sys.stderr)
        return 2
    done = record(got["dir"])
    print(f"converted {ckpt} ({done.get('bytes', 0) / 1e9:.1f} GB) in {done.get('seconds', 0) / 60:.1f} min into "
          f"{got['dir']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
