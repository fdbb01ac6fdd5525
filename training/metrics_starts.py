"""metrics.jsonl and W&B across a run's starts (training/metrics.py's MetricsLogger, the logging rank only): the
resume record, the records W&B lost when its service died, offline run folders that hold no record, and the run's
totals at its end.

- A start that drops steps an earlier start logged without saving them (a SIGKILL after step 70, the last save at 64)
  says so in one line, and its first step record is preceded by `{"event": "resume", "step": 64, "dropped_through":
  70}` (every resumed start has one, `dropped_through` where it dropped steps; written with that record, so a start
  that logs no step leaves the file as it was). Readers skip it (no "loss": scripts/plot_metrics.py draws it as a grey
  line).
- wandb-core (W&B's service, a child of rank 0) dies on the SIGTERM that deepspeed's launch.py teardown
  (terminate_process_tree: every child, recursively) or slurmstepd sends: nothing in wandb 0.31 shields it (it runs in
  a session of its own, wandb/sdk/lib/service/service_process.py, but psutil's children() finds it; Go unblocks and
  re-handles SIGTERM whatever mask or SIG_IGN it inherits: tried), and it dies without writing what it buffered: its
  transaction log (the .wandb file) is written every x_transaction_log_flush_interval = 15 s
  (wandb/sdk/wandb_settings.py) and an online run's history uploaded every 15 s (core/internal/filestream,
  defaultTransmitInterval). So the records of its last <= 15 s are lost, not only those after its death (an audit: steps
  48-51 of a stop at 51). The rank that logs notes, when W&B goes off, the first step that may be missing:
  the earliest record sent within UNSENT_WINDOW_S before the third-last one that went through (a send into a dead
  socket can still succeed once), in OUTPUT_DIR/wandb_unsent.json (atomic, one write); the next start re-sends
  metrics.jsonl's records from that step through its resumed step to the same run, then removes the note. A step sent
  twice is two points at one x, which the design accepts (training/metrics.py's docstring).
- An offline run folder whose .wandb holds its 7-byte header only (a start stopped within seconds of its W&B start:
  nothing flushed) makes `wandb sync OUTPUT_DIR/wandb/offline-run-*` fail ("transactionlog: error getting next
  record: EOF"): each start moves this run's such folders into OUTPUT_DIR/wandb/empty/, said in one line.
- At COMPLETE, `{"event": "run_end", "step", "total_tokens", "starts", "train_s"}` and one line: `starts` counts the
  starts that logged a step (1 + the resume records), `train_s` sums the kept steps' own time (tokens / tokens_per_s:
  saves, evaluations, builds and the steps a resume trained again are not in it). From metrics.jsonl, read once.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import shutil

from base.atomic import atomic_write

UNSENT = "wandb_unsent.json"  # OUTPUT_DIR/: {"run_id": ..., "step": the first step W&B may lack}
UNSENT_WINDOW_S = 30.0  # 2 x wandb-core's 15 s flush / upload interval (module docstring)
HEADER_BYTES = 7  # a .wandb file's header alone (":W&B", magic, version: core/internal/stream/store.go)


def lines_backwards(fh, block: int = 1 << 16):
    """(offset, bytes, 1 if a newline ends it else 0) of each line of the binary file `fh`, the last first: reads
    only as far back as the caller goes (metrics.jsonl's tail), a block at a time."""
    pos = fh.seek(0, os.SEEK_END)
    rest, final = b"", True  # rest: the block's first piece (its line may start further back); final: the file's end
    while pos > 0:
        n = min(block, pos)
        pos -= n
        fh.seek(pos)
        parts = (fh.read(n) + rest).split(b"\n")
        starts = [pos]
        for p in parts[:-1]:
            starts.append(starts[-1] + len(p) + 1)
        for i in range(len(parts) - 1, 0, -1):
            yield starts[i], parts[i], int(not final)
            final = False
        rest = parts[0]
    if rest or not final:
        yield 0, rest, int(not final)


def _step_of(rec) -> int | None:
    at = rec.get("step") if isinstance(rec, dict) else None
    return int(at) if isinstance(at, (int, float)) and not isinstance(at, bool) else None


def dropped_line(resumed: int, last: int, branch: bool) -> str:
    if branch:
        return (f"steps {resumed + 1}-{last} of the line this branch leaves are dropped from metrics.jsonl (its "
                f"branch from step {resumed} trains them again)")
    return f"steps {resumed + 1}-{last} logged by an earlier start that ended without a save are dropped and trained again"


def first_unsent(sent, failed: int | None, start: int) -> int:
    """The first step W&B may lack when its service is found gone: `sent` holds (monotonic time, step) of the records
    that went through (the last ones, MetricsLogger._sent), `failed` the step of the record that did not, `start`
    this start's resumed step (nothing went through: all of this start's records)."""
    sent = list(sent)
    if not sent:
        return start if failed is None else min(start, failed)
    ref = sent[-3][0] if len(sent) >= 3 else sent[0][0]
    first = min(s for t, s in sent if t >= ref - UNSENT_WINDOW_S)
    return first if failed is None else min(first, failed)


def note_unsent(output_dir: str, run_id: str | None, step: int) -> None:
    """Record that W&B run `run_id` may lack the steps from `step` on (an earlier note of the same run, not yet
    re-sent, keeps its earlier step)."""
    path = os.path.join(output_dir, UNSENT)
    old = read_unsent(output_dir)
    if old and old.get("run_id") == run_id and isinstance(old.get("step"), int):
        step = min(step, old["step"])
    with contextlib.suppress(OSError):  # a full disk: metrics.jsonl keeps the records, the re-send is lost
        atomic_write(path, json.dumps({"run_id": run_id, "step": int(step)}).encode())


def read_unsent(output_dir: str) -> dict | None:
    try:
        with open(os.path.join(output_dir, UNSENT)) as fh:
            got = json.load(fh)
    except (OSError, ValueError):
        return None
    return got if isinstance(got, dict) else None


def clear_unsent(output_dir: str) -> None:
    with contextlib.suppress(OSError):
        os.remove(os.path.join(output_dir, UNSENT))


def owed(output_dir: str, run_id: str | None, path: str, upto: int) -> tuple[int | None, list[dict]]:
    """(the noted step, metrics.jsonl's records from it) that W&B run `run_id` may lack, where a note says so and
    they lie at or before `upto`; else the note is removed (nothing owed, or another run's: a branch logging to a
    run of its own) and (None, [])."""
    note = read_unsent(output_dir) or {}
    first = note.get("step")
    if note.get("run_id") != run_id or not isinstance(first, int) or first > upto:
        if note:
            clear_unsent(output_dir)
        return None, []
    return first, records_from(path, first)


def records_from(path: str, first: int) -> list[dict]:
    """metrics.jsonl's records from step `first` to its end (its tail, read backwards to the first record before
    `first`: a few blocks after a stop, not the whole file), in file order."""
    out = []
    with contextlib.suppress(OSError), open(path, "rb") as fh:
        for _, ln, _ in lines_backwards(fh):
            try:
                rec = json.loads(ln.decode(errors="replace")) if ln.strip() else None
            except ValueError:
                continue
            at = _step_of(rec)
            if at is None:
                continue
            if at < first:
                break
            out.append(rec)
    return out[::-1]


def move_empty_offline_runs(wandb_dir: str, run_id: str | None) -> None:
    """Move run `run_id`'s offline run folders under `wandb_dir`/wandb whose .wandb holds its header alone into
    `wandb_dir`/wandb/empty/, said in one line (before this start's wandb.init: its own folder is not
    there yet). Only this run's: another run in a shared WANDB_DIR may be seconds into its start. A stat per folder."""
    if not run_id:
        return
    root = os.path.join(wandb_dir, "wandb")
    ours = re.compile(rf"offline-run-\d{{8}}_\d{{6}}-{re.escape(run_id)}")  # wandb's name; a glob's `*-{id}` also
    empty = []  # matched run `llama-exp1`'s folders for run `exp1` (a review), records and all
    for d in sorted(glob.glob(os.path.join(glob.escape(root), f"offline-run-*-{glob.escape(run_id)}"))):
        if not ours.fullmatch(os.path.basename(d)):
            continue
        try:  # no .wandb of this run's name: not one of its folders as wandb writes them, left alone
            size = os.path.getsize(os.path.join(d, f"run-{run_id}.wandb"))
        except OSError:
            continue
        if size <= HEADER_BYTES:
            empty.append(d)
    moved = []
    for d in empty:
        with contextlib.suppress(OSError, shutil.Error):
            os.makedirs(os.path.join(root, "empty"), exist_ok=True)
            shutil.move(d, os.path.join(root, "empty", os.path.basename(d)))
            moved.append(os.path.basename(d))
    if moved:
        names = ", ".join(moved[:3]) + (f" and {len(moved) - 3} more" if len(moved) > 3 else "")
        print(f"W&B: {len(moved)} offline run folder(s) of run {run_id} hold no record (a start stopped seconds into "
              f"its W&B start), which `wandb sync` fails on: moved to {root}/empty/ ({names})", flush=True)


def stamp(path: str):
    """A file's identity now (inode, mtime, size), or None: one written in between differs (scripts/slurm_run.sh's
    complete_stamp, the same test of COMPLETE)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def run_totals(path: str) -> dict | None:
    """The run_end record's fields from the whole of metrics.jsonl (once, at the run's end: ~1 s at 80k lines, no rank
    waiting), or None: no step on record, or a run_end already at its last step (a finished run started again)."""
    step = tokens = None
    starts, train_s, ended = 1, 0.0, None
    try:
        fh = open(path, encoding="utf-8", errors="replace")
    except OSError:
        return None
    with fh:
        for ln in fh:
            try:
                rec = json.loads(ln)
            except ValueError:
                continue
            if not isinstance(rec, dict):
                continue
            event = rec.get("event")
            if event == "resume":
                starts += 1
            elif event == "run_end":
                ended = _step_of(rec)
            elif event is None and "loss" in rec and _step_of(rec) is not None:
                step, tokens, ended = _step_of(rec), rec.get("total_tokens", tokens), None
                n, rate = rec.get("tokens"), rec.get("tokens_per_s")
                if isinstance(n, (int, float)) and isinstance(rate, (int, float)) and n > 0 and rate > 0:
                    train_s += n / rate
    if step is None or ended == step:
        return None
    return {"step": step, "total_tokens": tokens, "starts": starts, "train_s": round(train_s, 1)}


def end_line(t: dict) -> str:
    s = round(t["train_s"])
    tokens = t["total_tokens"]
    return (f"run complete at step {t['step']}: {f'{tokens:,}' if isinstance(tokens, int) else '?'} tokens, "
            f"{t['starts']} start(s), {s // 3600}h{s // 60 % 60:02d}m{s % 60:02d}s in its steps' own time "
            "(saves, evaluations and builds not counted; metrics.jsonl: run_end)")
