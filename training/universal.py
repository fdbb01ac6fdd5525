"""DeepSpeed universal checkpoints: a checkpoint written by N ranks, converted for a run of another world size.

    checkpoints/universal/step_000200/   the conversion (DeepSpeed loads it as load_dir=universal/, tag=step_000200)
        DONE                             written last: {"source": id, "files": {name: size}, "bytes", "seconds"}
    checkpoints/universal/RATE.json      the last conversion's measured bytes and seconds (the next estimate)

**Keyed by content, not by name.** A branch (`--resume step_000100`) writes a new `step_000200` under an old name;
a conversion is used only when its recorded `source` equals the identity of the checkpoint there now: the SHA-256 of
its MANIFEST.json, which lists every file's size and CRC32 (and the step, world, layout). Any other conversion is
redone, never loaded; checkpoints without a matching conversion get theirs dropped at the next save.

**Bounded by the job's end.** `python -m deepspeed.checkpoint.ds_to_universal` runs in one process on rank 0 and
cannot resume: killed at the time limit, it started again from nothing on every requeue. Before starting it, rank 0
estimates its time from the checkpoint's bytes and the last measured rate (RATE.json; `RATE_GUESS_BPS` until a
conversion of at least `TRUST_BYTES` was measured) and starts it only if it, a step and a save fit before the job's
end (`Deadline`: SLURM_JOB_END_TIME or --time_limit_s). Otherwise the job exits 75 (requeue) without starting it,
or, when it cannot fit even a whole allocation (SLURM_JOB_END_TIME - SLURM_JOB_START_TIME), 2 with the fix: convert
in a longer job (`python -m training.universal CHECKPOINT`) or resume at the saved world size. A conversion that runs
past its estimate is stopped before the end, its time recorded (so the next estimate is at least that), exit 75.

Cost at target scale (Llama-3-8B, 32 ranks, ZeRO-3): the checkpoint is ~100 GB, of which 96 GB are fp32 master
weights and Adam moments in 32 partitions. ds_to_universal reads them (96 GB), writes one fragment per parameter, state
and partition (291 x 3 x 32 = 28k files, 96 GB), reads them back and writes the merged tensors (96 GB): ~390 GB of
I/O from one node. At 1-2 GB/s to a parallel file system that is 3-7 minutes; at the 149 MB/s per node measured for
saves here (docs/results/checkpoints.md) about 45 minutes. The guess, 50 MB/s of checkpoint bytes (~200 MB/s of
I/O), says 33 minutes until the first measurement. The other ranks wait meanwhile in `comm.run_on_main` (a host gloo
group with a 6 h timeout, not the training group's `dist_timeout_s`); the abort channel's heartbeat comes from a
helper process of each rank (base/comm.py), not from the waiting thread, so the wait is never taken for a stall.

Offline: `python -m training.universal OUTPUT_DIR/checkpoints/step_000200` converts it with no deadline (in a job
of its own, before a resume at another world size), recorded the same way.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

from base.log import print0
from training.checkpoint_files import MANIFEST, atomic_write, list_files, manifest_sha256, read_json

DONE = "DONE"
RATE = "RATE.json"
START_S = 30.0  # the converter's own start-up (python, torch, deepspeed imports) and its small files
RATE_GUESS_BPS = 50e6  # checkpoint bytes per second until measured (see the module docstring)
TRUST_BYTES = 2**30  # a finished conversion smaller than this measures start-up, not the file system's rate
SAFETY = 1.25  # a measured rate varies with the file system's load


def source_id(ckpt: str) -> str | None:
    """The content identity of the checkpoint at `ckpt`: SHA-256 of its manifest (every file's size and CRC32)."""
    sha = manifest_sha256(ckpt)
    return sha and sha[:24]


def folder(ckpt: str) -> str:
    """Where the conversion of `ckpt` (ROOT/checkpoints/step_N) lives: ROOT/checkpoints/universal/step_N."""
    root, tag = os.path.split(os.path.abspath(ckpt.rstrip("/")))
    return os.path.join(root, "universal", tag)


def record(out: str) -> dict:
    """The DONE record of the conversion in `out` ({} if none or unreadable)."""
    got = read_json(os.path.join(out, DONE))
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


def _measured(out: str) -> dict:
    got = read_json(os.path.join(os.path.dirname(out), RATE))
    return got["json"] if isinstance(got.get("json"), dict) else {}


def prepare(ckpt: str, saved_world: int, world: int, deadline=None) -> dict:
    """Rank 0: the conversion of `ckpt` ready to load, made now if needed and if it fits before `deadline`.
    Returns {"dir": load_dir, "files": {name: size}} or {"requeue": reason} or {"refuse": reason} (one line each)."""
    out = folder(ckpt)
    sid = source_id(ckpt)
    done = record(out)
    if sid is not None and done.get("source") == sid:
        return {"dir": os.path.dirname(out), "files": done["files"]}
    manifest = read_json(os.path.join(ckpt, MANIFEST)).get("json") or {}
    nbytes = sum(int(e["size"]) for e in manifest.get("files", {}).values())
    est = estimate_s(nbytes, _measured(out))
    timeout = None
    end = getattr(deadline, "end", None)
    if end is not None:
        needed = deadline.needed_s(ahead_s=est)  # the conversion, then a step, a save and the margin
        start = os.environ.get("SLURM_JOB_START_TIME")
        what = (f"checkpoint {ckpt} ({nbytes / 1e9:.1f} GB, written by {saved_world} ranks) needs a universal "
                f"conversion for {world} ranks of about {est / 60:.0f} min")
        if start and end - float(start) < needed:
            return {"refuse": f"{what}, more than this job's whole allocation ({(end - float(start)) / 60:.0f} min) "
                              f"with a step and a save after it: convert it in a longer job first (python -m "
                              f"training.universal {ckpt}), or resume with {saved_world} ranks"}
        left = end - time.time()
        if left < needed:
            return {"requeue": f"{what}; {left / 60:.0f} min are left before the job's end, not enough with a step "
                               "and a save after it: not started, exiting 75 to be requeued"}
        timeout = left - (needed - est)  # stop it in time to exit before the end, whatever the estimate said
    print0(f"checkpoint {ckpt} was written by {saved_world} ranks, this run has {world}: converting it to a DeepSpeed "
           f"universal checkpoint in {out} (about {est / 60:.1f} min estimated)")
    try:
        return {"dir": os.path.dirname(out), "files": convert(ckpt, out, sid, nbytes, timeout)["files"]}
    except subprocess.TimeoutExpired as e:
        return {"requeue": f"the universal conversion of {ckpt} was stopped after {e.timeout / 60:.0f} min, before the "
                           "job's end (its time is recorded for the next estimate): exiting 75 to be requeued"}


def convert(ckpt: str, out: str, sid: str | None, nbytes: int, timeout: float | None = None) -> dict:
    """Run ds_to_universal from `ckpt` into `out` (emptied first), then write the DONE record and the measured rate.
    Returns the record. A conversion stopped at `timeout` records its time as unfinished and raises TimeoutExpired."""
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    t0 = time.time()
    try:
        subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", ckpt,
                        "--output_folder", out, "--num_extract_workers", "2", "--num_merge_workers", "1",
                        "--inject_missing_state"], check=True, stdout=subprocess.DEVNULL, timeout=timeout)
    except subprocess.TimeoutExpired:
        atomic_write(os.path.join(os.path.dirname(out), RATE),
                     json.dumps({"bytes": nbytes, "seconds": time.time() - t0, "finished": False}))
        raise
    seconds = time.time() - t0
    files = {f: os.path.getsize(os.path.join(out, f)) for f in list_files(out) if f != DONE}
    done = {"source": sid, "source_path": ckpt, "files": files, "bytes": nbytes, "seconds": round(seconds, 1)}
    atomic_write(os.path.join(out, DONE), json.dumps(done))
    atomic_write(os.path.join(os.path.dirname(out), RATE),
                 json.dumps({"bytes": nbytes, "seconds": seconds, "finished": True}))
    return done


def main(argv: list[str] | None = None) -> int:
    """python -m training.universal CHECKPOINT: convert it now, with no deadline (a job of its own)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or source_id(args[0]) is None:
        print("usage: python -m training.universal OUTPUT_DIR/checkpoints/step_N (a committed checkpoint: "
              "MANIFEST.json)", file=sys.stderr)
        return 2
    ckpt = os.path.abspath(args[0].rstrip("/"))
    manifest = read_json(os.path.join(ckpt, MANIFEST))["json"]
    nbytes = sum(int(e["size"]) for e in manifest["files"].values())
    if is_conversion_of(folder(ckpt), ckpt):
        print(f"{folder(ckpt)} already holds the conversion of {ckpt}")
        return 0
    done = convert(ckpt, folder(ckpt), source_id(ckpt), nbytes)
    print(f"converted {ckpt} ({nbytes / 1e9:.1f} GB) in {done['seconds'] / 60:.1f} min into {folder(ckpt)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
