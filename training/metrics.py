"""Metrics and console output: metrics.jsonl, the step line and progress bar, each stage's evaluation record, peak
memory, and every record mirrored to Weights & Biases (whether it logs there, its start online or offline, what it
lost at the end: training/metrics_wandb.py).

Every metric is plotted against our own `step` (wandb.define_metric("*", step_metric="step"), each record carrying
it), never logged with wandb.log(step=): W&B drops a log at a step lower than its run's current one, and a plain
resume re-logs steps N+1..M (the steps after the checkpoint that a SIGKILL, or an async save still behind the steps,
lost): the chart kept the dead attempt's values and the resumed start's events at step N were dropped
(wandb/wandb#4482). Now every record is kept: steps N+1..M show the dead attempt's points and the retrained ones at
the same x; metrics.jsonl holds the retrained ones only (_truncate).
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import os
import sys
import tempfile
import threading
import time

import torch

from base import comm
from base.atomic import atomic_write
from base.exits import EXIT_PREEMPTED
from base.host import peak_rss_bytes
from base.log import print0, say
from training import metrics_starts as starts
from training.eval_tables import eval_tables
from training.metrics_starts import lines_backwards as _lines_backwards
from training.metrics_wandb import said_lost_records, start_wandb, wandb_enabled


def profiled_peak_bytes(fn) -> int:
    """Peak live tensor bytes while `fn()` runs, above those live before it: the torch profiler's allocation
    events (the CPU counterpart of max_memory_allocated). For tests and benchmarks: profiling is slow."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as fh:
            events = [e["args"] for e in json.load(fh)["traceEvents"] if e.get("name") == "[memory]"]
    finally:
        os.unlink(path)
    before = events[0]["Total Allocated"] - events[0]["Bytes"]
    return max(e["Total Allocated"] for e in events) - before


def reset_peak_memory() -> None:
    """Start a new peak (at every stage's start, so `peak_mem_gb` is the stage's own at this start: a resume in the
    middle of a stage is a new process, whose count starts again; not carried across, a restore's own peak would hide
    in it): the device's peak allocation counters on GPU; on CPU the process' VmHWM, which Linux resets on writing 5
    to /proc/self/clear_refs (no effect where that file is missing)."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        return
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def peak_memory_gb(engagement: dict | None = None) -> float:
    """The peak memory of any rank since the last reset_peak_memory (the stage's start): device memory on GPU,
    peak resident set size on CPU. Max over ranks.

    `engagement` (model_utils/engagement.take's {"engaged": {...}, "expected": {...}}) rides in the same all-reduce:
    its "engaged" counts become the minimum over ranks, in place (max of the negatives), so the step's counters and
    the stop they may decide cost no collective of their own and read the same on every rank."""
    if torch.cuda.is_available():
        peak = torch.cuda.max_memory_allocated() / 2**30
    else:
        peak = peak_rss_bytes() / 2**30
    names = list(engagement["engaged"]) if engagement else []
    got = comm.all_reduce([peak, *(-float(engagement["engaged"][k]) for k in names)], op="max")
    for k, v in zip(names, got[1:].tolist()):
        engagement["engaged"][k] = int(-v)
    return round(got[0].item(), 4)


SKIPPED = {True: " (no supervised token: optimizer step skipped)", "overflow": " (non-finite gradient norm: update skipped)"}
ETA_WINDOW = 20  # steps whose mean wall-clock time (saves included) gives the log line's ETA
STEP_KEY = "step"  # the record key W&B plots every metric against (define_metric): never wandb.log(step=)


class MetricsLogger:
    """Rank 0 appends one JSON line per event to OUTPUT_DIR/metrics.jsonl and mirrors it to W&B."""

    def __init__(self, output_dir: str, is_main: bool, report_to: str, project: str | None, run_id: str | None,
                 config: dict, total_steps: int, progress_bar: bool, resume_step: int = 0, branch: bool = False,
                 home: str | None = None):
        self.is_main = is_main
        # the real path of the folder whose run `run_id` is (the checkpoint's wandb_home): another folder's, while
        # that one still holds its run, is a copy or a branch into a new folder, logged to a run of its own
        self.home = os.path.realpath(output_dir)
        other = home and home != self.home and os.path.isdir(os.path.join(home, "checkpoints"))
        # one folder under two real paths (a bind mount, two NFS mounts of one export) is the same folder
        self._other_home = home if other and not (os.path.isdir(self.home) and os.path.samefile(home, self.home)) \
            else None
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self.wandb = None
        self.run_id = run_id
        self.wandb_dir = os.environ.get("WANDB_DIR") or output_dir
        self.bar = None
        self.total_steps = total_steps
        self.stage_end: int | None = None  # begin_stage
        self._bar_base = 0  # the run's step at the bar's 0 (a stage's first step moves it to the stage's start)
        self._bar_stage: tuple[int | None] | None = None  # begin_stage's (start,) until the stage's first step
        self._ticks: collections.deque = collections.deque(maxlen=ETA_WINDOW + 1)  # (stage, monotonic time) per step
        self.eval_dir = os.path.join(output_dir, "eval")
        self.output_dir, self.start_step = output_dir, resume_step
        self._sent: collections.deque = collections.deque()  # (monotonic time, step) of the last records W&B took
        self._resume: dict | None = None  # this start's resume record, written before its first step record
        if not is_main:
            return
        os.makedirs(self.eval_dir, exist_ok=True)
        if self._table_stale():  # a rebuild never stops a start: a record another version wrote may lack a field
            try:
                self._write_eval_table()
            except (KeyError, TypeError, ValueError, OSError) as e:
                print0(f"warning: {self.eval_dir}/summary.md not rebuilt from its stage records ({type(e).__name__}: "
                       f"{e}); the records themselves are kept")
        earlier = os.path.exists(self.path) and os.path.getsize(self.path) > 0
        logged = self._truncate(resume_step)
        if earlier or resume_step:  # a start after another (training/metrics_starts.py): its boundary on record
            self._resume = {"event": "resume", "step": resume_step,
                            **({"dropped_through": logged} if logged > resume_step else {})}
        if logged > resume_step:
            print0(starts.dropped_line(resume_step, logged, branch))
        self._complete = starts.stamp(os.path.join(output_dir, "COMPLETE"))  # close: written during this start, or not
        if wandb_enabled(report_to):
            starts.move_empty_offline_runs(self.wandb_dir, run_id)  # before wandb.init makes this start's own folder
            self.wandb = start_wandb(self, output_dir, project, run_id, config, logged, resume_step, branch)
            self._wb(lambda run: (run.define_metric(STEP_KEY),  # our step: every metric's x-axis (module docstring)
                                  run.define_metric("*", step_metric=STEP_KEY)))
            if self.wandb is None:  # it could not start: this start's records are owed to the run
                starts.note_unsent(output_dir, self.run_id, resume_step)
            else:
                self._resend(resume_step)
        if progress_bar and sys.stderr.isatty():
            from tqdm import tqdm

            # initial: the resumed steps are not counted as done in this start's time (rate and ETA were 100x off)
            self.bar = tqdm(total=total_steps, initial=resume_step, dynamic_ncols=True, desc="train")

    def _wb(self, call, step: int | None = None) -> None:
        """call(run) on rank 0's W&B run (None elsewhere: no collective waits on it); any error turns W&B off, said once:
        wandb-core dies on a launcher's or slurmstepd's SIGTERM/SIGINT, and a log raised before the agreed save (exit 1).
        `step`: the record's, kept when it went through; when W&B goes off, the first step it may lack is noted for the
        next start to re-send (training/metrics_starts.py: its last ~15 s die with its service)."""
        if self.wandb is None:
            return
        try:
            call(self.wandb)
        except Exception as e:  # noqa: BLE001  any of W&B's errors: metrics.jsonl and the run go on without it
            self.wandb, why = None, (str(e).strip().splitlines() or [""])[0][:200]
            print(f"warning: W&B stopped answering ({type(e).__name__}: {why}): W&B off for the rest of this run; "
                  "metrics.jsonl keeps every record, and the next start sends W&B those it may lack", flush=True)
            starts.note_unsent(self.output_dir, self.run_id, starts.first_unsent(self._sent, step, self.start_step))
            if isinstance(e, ConnectionError):  # wandb-core gone: its exit hook would print this again, a traceback
                from wandb import teardown
                with contextlib.suppress(Exception):  # unhooks it, then raises at once (the socket is broken)
                    teardown()
            return
        if step is not None:  # in memory: the records of the last starts.UNSENT_WINDOW_S and 3 more (O(1) a record)
            q = self._sent
            q.append((time.monotonic(), step))
            while len(q) > 3 and q[0][0] < q[-3][0] - starts.UNSENT_WINDOW_S:
                q.popleft()

    def _resend(self, upto: int) -> None:
        """Send W&B the records an earlier start's W&B lost (training/metrics_starts.py), through `upto` (the resumed
        step: metrics.jsonl holds nothing after it now); the note goes once they went through."""
        first, recs = starts.owed(self.output_dir, self.run_id, self.path, upto)
        for rec in recs:
            self._wb(lambda run, rec=rec: run.log(_wandb_row(rec)), rec.get("step"))
        if first is not None and self.wandb is not None:
            starts.clear_unsent(self.output_dir)
            print0(f"W&B: {len(recs)} record(s) of steps {first}-{upto} sent again from metrics.jsonl (its service "
                   "died at an earlier start with them unwritten)")

    def _truncate(self, step: int) -> int:
        """Drop lines of steps after the checkpoint we resume from: they will be trained again. Records are appended
        in step order, so they are the file's tail: it is read backwards from the end to the last record at or before
        `step` and the file cut there in place (ftruncate, fsynced), never rewritten (a rewrite read and wrote all of
        it at every start, every rank waiting: 60 MB, ~2 s at 80k lines, more on Lustre; its rename, unsynced, could
        leave the record short after a node's loss). Nothing past `step`: untouched. A line that does not parse (a job
        killed mid-write leaves its last line torn) is dropped with one warning line: it would otherwise stop rank 0
        here at every requeue. Returns the last step on record before (0: none)."""
        if not os.path.exists(self.path):
            return 0
        cut, torn, last, newline = 0, 0, 0, False  # cut: the offset the kept records end at
        with open(self.path, "rb") as fh:
            for start, ln, ended in _lines_backwards(fh):
                if not ln.strip():
                    continue
                try:
                    rec = json.loads(ln.decode(errors="replace"))
                except ValueError:
                    rec = None
                if not isinstance(rec, dict):
                    torn += 1
                    continue
                at = rec.get("step", 0)
                at = at if isinstance(at, (int, float)) and not isinstance(at, bool) else None
                last = max(last, int(at or 0))
                if at is not None and at <= step and "step" in rec:
                    cut, newline = start + len(ln) + ended, not ended
                    break
            size = fh.seek(0, os.SEEK_END)
        if torn:
            print0(f"warning: {self.path}: dropped {torn} unreadable line(s) (a job killed while writing); "
                   f"kept the records up to step {step}")
        if cut < size or newline:
            with open(self.path, "r+b") as fh:
                fh.truncate(cut)
                if newline:  # the kept last record lacks its newline: the next one would be appended onto it
                    fh.seek(cut)
                    fh.write(b"\n")
                fh.flush()
                os.fsync(fh.fileno())
        return last

    def has_eval(self, stage: int) -> bool:
        return os.path.exists(os.path.join(self.eval_dir, f"stage{stage}.json"))

    def evaluated(self, n_stages: int) -> set[int]:
        """The stages whose evaluation is on record, as rank 0 sees them; the same set on every rank (collective):
        a node with a stale view of eval/ would otherwise redo a stage the others skip."""
        return set(comm.run_on_main(lambda: [i for i in range(n_stages) if self.has_eval(i)]))

    def log_eval(self, stage: int, result: dict) -> None:
        """Record a stage's evaluation: a line in metrics.jsonl, W&B (the nested results, task -> length -> depth, as
        scalars: eval/tasks/passkey/8192/0.5), and eval/stage{N}.json (written last)."""
        if not self.is_main:
            return
        self.log({"event": "eval", **result})
        self._wb(lambda run: run.log({**_nested(result), **_at(result.get("step"))}), result.get("step"))
        # strict JSON, as metrics.jsonl: an empty position bucket's NaN is null (a bare NaN, which jq and most readers
        # refuse, was written here); eval_tables reads both, records from before too
        atomic_write(os.path.join(self.eval_dir, f"stage{stage}.json"), json.dumps(strict(result), indent=1).encode())
        self._write_eval_table()

    def _write_eval_table(self) -> None:
        """OUTPUT_DIR/eval/summary.md: one row per evaluated stage (held-out loss, at the first stage's length
        too, passkey by depth at the stage's length), then per task one row per stage of accuracy (mean over
        depths) at every length tried, then the held-out loss by position bucket."""
        rows = []
        for name in sorted(os.listdir(self.eval_dir), key=lambda n: (len(n), n)):
            if name.startswith("stage") and name.endswith(".json"):
                with open(os.path.join(self.eval_dir, name)) as fh:
                    rows.append(json.load(fh))
        # whole or not at all (a full disk left it empty, and nothing wrote it again): the one before stays
        atomic_write(os.path.join(self.eval_dir, "summary.md"), ("\n".join(eval_tables(rows)) + "\n").encode())

    def _table_stale(self) -> bool:
        """Whether summary.md misses a stage's evaluation on record (older than a stageN.json, or absent): its write
        failed after the stage's record (a full disk), and a resume skips that stage's evaluation."""
        try:
            made = os.path.getmtime(os.path.join(self.eval_dir, "summary.md"))
        except OSError:
            made = None
        for name in os.listdir(self.eval_dir):
            if name.startswith("stage") and name.endswith(".json") and (
                    made is None or os.path.getmtime(os.path.join(self.eval_dir, name)) > made):
                return True
        return False

    def log(self, record: dict) -> None:
        if not self.is_main:
            return
        first = [self._resume] if self._resume and "loss" in record else []  # this start's first step: its boundary
        try:
            with open(self.path, "a") as fh:
                fh.write("".join(json.dumps(strict(r)) + "\n" for r in (*first, record)))
        except OSError as e:  # a write into the open file names none: a full disk here is the user's (training/job.py
            e.filename = e.filename or self.path  # users_disk), one line and exit 2, not node 0's crash
            raise
        for r in (*first, record):
            self._wb(lambda run, r=r: run.log({**_wandb_fields(r), **_at(r.get("step"))}), r.get("step"))
        if first:
            self._resume = None
        if "loss" in record and "step" in record:
            step, loss, rate = record["step"], record["loss"], record.get("tokens_per_s")  # null: a skipped step
            mfu = record.get("mfu")  # none where the device's peak is not known (a CPU run): the line as it was
            line = (f"step {step} stage {record.get('stage', 0)} loss {'-' if loss is None else f'{loss:.4f}'} "
                    f"lr {record['lr']:.2e} tok/s {'-' if rate is None else f'{rate:.0f}'} "
                    f"mem {record['peak_mem_gb']:.2f}GB" + ("" if mfu is None else f" mfu {mfu:.0%}")
                    + SKIPPED.get(record.get("optimizer_skipped"), ""))
            if self.bar is not None:
                if self._bar_stage is not None:
                    self._restart_bar(step, *self._bar_stage)
                self.bar.update(step - self._bar_base - self.bar.n)  # counted, not set: tqdm's rate and ETA follow
                self.bar.set_postfix_str(line.replace(f"step {step} ", f"step {step}/{self.total_steps} ", 1))
                self.bar.refresh()
            else:  # a log file (every SLURM job's): the total and an ETA, as the bar would show them
                line = line.replace(f"step {step} ", f"step {step}/{self.total_steps} ", 1) + self._eta(step, record)
                say(line)  # a console gone (a dead `| tee`): console output stops, not the rank

    def begin_stage(self, end: int, start: int | None = None) -> None:
        """The step the stage now training ends at (and, where given, the one it started from): the log line's ETA
        and the bar are to it (a later stage's longer steps are not this one's: an ETA of the whole curriculum at
        stage 0's rate was several times too short, 6.7x after a 1k stage's fast steps). The bar starts again at
        the stage's first step: it counts the stage's steps (from `start`; without it, those left at this start), its rate is the
        stage's own from its second step, and its postfix keeps the run's position (`step N/TOTAL`)."""
        self.stage_end = end
        self._bar_stage = (start,)

    def _restart_bar(self, step: int, start: int | None) -> None:
        """The bar of the stage whose first step `step` is: total the stage's steps (from `start`, else from the last
        step logged), that first step counted as done, not timed (the engine build lies before it), as _eta does."""
        at = self._bar_base + self.bar.n  # the last step logged (the resumed one before any)
        self._bar_base, self._bar_stage = (at if start is None else min(start, at)), None
        self.bar.reset(total=max(self.stage_end - self._bar_base, 0))
        self.bar.n = self.bar.initial = self.bar.last_print_n = step - self._bar_base
        self.bar.set_description(f"stage to step {self.stage_end}", refresh=False)

    def _eta(self, step: int, record: dict) -> str:
        """' stage eta 1h02m': the stage's remaining steps (the run's, where no stage was begun) at the mean
        wall-clock time of its last ETA_WINDOW steps (saves included; the first steps of a stage, its engine build in
        between, are not counted); '' before two steps."""
        stage, now = record.get("stage", 0), time.monotonic()
        if self._ticks and self._ticks[-1][0] != stage:
            self._ticks.clear()  # another length: the previous stage's step time says nothing of this one's
        self._ticks.append((stage, now))
        if len(self._ticks) < 2:
            return ""
        end, what = (self.stage_end, "stage eta") if self.stage_end is not None else (self.total_steps, "eta")
        left = round(max(end - step, 0) * (now - self._ticks[0][1]) / (len(self._ticks) - 1))
        h, m, sec = left // 3600, left // 60 % 60, left % 60
        return f" {what} {h}h{m:02d}m" if h else f" {what} {m}m{sec:02d}s"

    def record_stage(self, stage, world: int) -> None:
        """The W&B config's resolved layout of `stage` (steps, seq_len, sp, cp, dp, warmup, lr) and the world size, at
        the stage's start (the flags alone, `config`, do not say what each stage ran with)."""
        self._wb(lambda run: run.config.update({"world": world, f"stage{stage.index}": {
            "name": stage.name, "steps": stage.max_steps, "seq_len": stage.max_seq_length, "sp": stage.sp,
            "cp": stage.cp, "dp": world // stage.sp, "warmup": stage.warmup_steps, "lr": stage.learning_rate}},
            allow_val_change=True))  # a resume on another world size

    def log_table(self, name: str, columns: list[str], rows: list[list], step: int | None = None) -> None:
        """A table on W&B at our `step` (the evaluation's; module docstring)."""
        if self.wandb is not None:  # rank 0's only
            from wandb import Table
            self._wb(lambda run: run.log({name: Table(columns=columns, data=rows), **_at(step)}))

    def close(self, timeout_s: float | None = None) -> None:
        """End the bar and the W&B run; its finish (an online run's last upload) waited for at most `timeout_s`
        (a SIGTERM window's stop: the launcher's SIGKILL must not come before the rank records its 75).

        train.py closes twice: after writing COMPLETE (rank 0, just before), and in the preempted exit (stage.py's
        Run.exit_preempted). COMPLETE written during this start: the run_end record and line (metrics_starts.py);
        else the preempted exit: W&B's run is marked preempting and finishes with 75, as the rank exits (it showed
        "finished", exit 0, at every requeue; wandb/sdk/wandb_run.py mark_preempting, finish(exit_code))."""
        if self.bar is not None:
            self.bar.close()
        complete = self.is_main and starts.stamp(os.path.join(self.output_dir, "COMPLETE")) not in (None, self._complete)
        if complete and (totals := starts.run_totals(self.path)):
            self.log({"event": "run_end", **totals})
            print0(starts.end_line(totals))
        if self.wandb is None:
            return
        if not complete and hasattr(self.wandb, "mark_preempting"):  # an older wandb without it: finish alone
            self._wb(lambda run: run.mark_preempting())
        end = (lambda run: run.finish()) if complete else (lambda run: run.finish(exit_code=EXIT_PREEMPTED))
        run_dir = os.path.dirname(str(getattr(self.wandb, "dir", "") or "")) or None  # .../offline-run-*/ (files/)
        t = threading.Thread(target=self._wb, args=(end,), name="wandb-finish", daemon=True)
        t.start()
        t.join(timeout_s)  # None: an ordinary end, unbounded
        if t.is_alive():
            print(f"W&B: the run's finish did not end within {timeout_s:.0f} s of the stop's window: what it had not "
                  f"uploaded is in {self.wandb_dir}/wandb (`wandb sync` it)", flush=True)
        else:
            said_lost_records(run_dir)


def strict(v):
    """A record as strict JSON (jq and most readers refuse a bare NaN): a non-finite float is null, with "nan", "inf"
    or "-inf" under `<key>_nonfinite` beside it (in a list: null alone). W&B gets the floats as they are."""
    if isinstance(v, dict):
        return {**{k: strict(x) for k, x in v.items()},
                **{f"{k}_nonfinite": str(x) for k, x in v.items() if isinstance(x, float) and not math.isfinite(x)}}
    return [strict(x) for x in v] if isinstance(v, list) else None if isinstance(v, float) and not math.isfinite(v) else v


def _wandb_fields(record: dict) -> dict:
    """A metrics record's numbers for W&B. An event's (memory_choice, engine_released, eval) under its name:
    "memory_choice/sp". An event is logged at the step before it (a stage's memory choice at the previous stage's
    last step): its stage/sp/cp/dp replaced that step's own on the charts (W&B merged the logs of one step), and
    would still be drawn at that step beside them."""
    nums = {k: v for k, v in record.items() if isinstance(v, int | float)}
    event = record.get("event")
    if not event:
        return nums
    return {f"{event}/{k}": v for k, v in nums.items() if k != "step"}


def _nested(result: dict) -> dict:
    """An evaluation's nested results as W&B scalars (task -> length -> depth: eval/tasks/passkey/8192/0.5)."""
    return {k: v for k, v in _flatten(result, "eval").items() if "/" in k[5:]}


def _wandb_row(record: dict) -> dict:
    """What log (and log_eval) sent W&B for a metrics.jsonl record, as one row: a re-send (MetricsLogger._resend)."""
    return {**_wandb_fields(record), **(_nested(record) if record.get("event") == "eval" else {}), **_at(record.get("step"))}


def _at(step) -> dict:
    """The record's place on our step axis (STEP_KEY), where it has one."""
    return {} if step is None else {STEP_KEY: step}


def _flatten(d, prefix: str) -> dict:
    """{"a": {"b": 1.0}, "c": [2.0]} -> {"prefix/a/b": 1.0, "prefix/c/0": 2.0} (numbers only)."""
    out = {}
    items = d.items() if isinstance(d, dict) else enumerate(d) if isinstance(d, list) else ()
    for k, v in items:
        if isinstance(v, dict | list):
            out.update(_flatten(v, f"{prefix}/{k}"))
        elif isinstance(v, int | float) and not isinstance(v, bool):
            out[f"{prefix}/{k}"] = v
    return out
