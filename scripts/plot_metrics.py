"""Plot loss, tokens/s and peak memory against the optimizer step from a run's metrics.jsonl, and the
evaluations between stages.

    python scripts/plot_metrics.py checkpoints/RUN/metrics.jsonl -o checkpoints/RUN/metrics.png

One PNG with three panels sharing the step axis; a dashed vertical line marks each curriculum stage
boundary (the first step of a new stage), labelled with the stage and its sequence length, and a thin grey one each
resume (`"event": "resume"`: a later start continued after that step; `peak_mem_gb` starts again there, each start's
own). Anything without "step" and "loss" is skipped there; files written before stages existed have no "stage" key and
count as stage 0; a record whose step (or an evaluation's stage) is not an integer is skipped, counted in one
note. A file that cannot be read (not UTF-8, no permission) is refused in one line (exit 2). `-o` names the image
(.png, or another extension matplotlib writes: .svg, .pdf ...); a folder, a name without an extension or another
extension is refused in one line (exit 2).

When the file has evaluation lines ("event": "eval", training/evaluation.py), a second PNG next to it
(`metrics_eval.png` for `-o metrics.png`): per task, one depth x length accuracy heat map per stage (the
needle-in-a-haystack picture: green where the model retrieves, red where it does not; lengths beyond the
stage's own are to the right of its dashed line), accuracy vs stage (one line per task and length), and the
held-out loss by position for each stage.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

PANELS = (("loss", "loss"), ("tokens_per_s", "tokens/s"), ("peak_mem_gb", "peak memory (GB)"))


def _records(path: str):
    """Every JSON object of a metrics.jsonl; a torn last line (a job killed mid-write) is skipped. OSError /
    UnicodeDecodeError for a file that cannot be read (main: one line)."""
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict):
                yield rec


def _as_int(v) -> int | None:
    """A step or stage number as written (5, 5.0, "5"), or None (null, "abc", true, 1.5)."""
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        return None
    if isinstance(v, str):
        return int(v) if v.strip().isdigit() else None
    return int(v) if math.isfinite(v) and v == int(v) else None


def _is_step(r: dict) -> bool:
    return "step" in r and "loss" in r and r.get("event") != "eval"


def _is_eval(r: dict) -> bool:
    return r.get("event") == "eval" and "stage" in r


def read_steps(path: str | list[dict]) -> list[dict]:
    """Step records in step order (`path`: a metrics.jsonl or its records). A step logged twice (a job resumed behind its
    last log line) keeps its latest record; a torn last line (a job killed mid-write) is ignored, and so is a record
    whose step is not an integer (null, "abc": was a traceback). A step skipped for want of a supervised
    token (`"optimizer_skipped": true`) is a gap in the loss and tokens/s curves: it trained nothing (files written
    before it was logged as null say loss 0.0 and ~5e8 tokens/s, its ~1 ms of time, which the curves drew and the
    smoothed loss averaged in)."""
    recs = _records(path) if isinstance(path, str) else path
    by_step = {k: {**r, "step": k} for r in recs if _is_step(r) and (k := _as_int(r["step"])) is not None}
    return [_gap(by_step[s]) if by_step[s].get("optimizer_skipped") is True else by_step[s] for s in sorted(by_step)]


def _gap(rec: dict) -> dict:
    return {**rec, "loss": None, "tokens_per_s": None}


def read_evals(path: str | list[dict]) -> list[dict]:
    """The latest evaluation record of each stage, in stage order (a resumed run may log a stage twice); one whose
    stage is not an integer is ignored."""
    recs = _records(path) if isinstance(path, str) else path
    by_stage = {k: {**r, "stage": k} for r in recs if _is_eval(r) and (k := _as_int(r["stage"])) is not None}
    return [by_stage[s] for s in sorted(by_stage)]


def unnumbered(recs: list[dict]) -> int:
    """How many step / evaluation records read_steps / read_evals ignore for a step / stage that is not an integer."""
    return sum(1 for r in recs if (_is_step(r) and _as_int(r["step"]) is None)
               or (_is_eval(r) and _as_int(r["stage"]) is None))


def resumes(recs: list[dict]) -> list[int]:
    """The steps after which a later start continued (its resume records: training/metrics_starts.py), in order."""
    return sorted({k for r in recs if r.get("event") == "resume" and (k := _as_int(r.get("step"))) is not None})


def stage_boundaries(steps: list[dict]) -> list[int]:
    """The steps at which a new stage begins (never the first step of the file)."""
    return [cur["step"] for prev, cur in zip(steps, steps[1:]) if cur.get("stage", 0) != prev.get("stage", 0)]


def _value(rec: dict, key: str) -> float:
    v = rec.get(key)
    return float(v) if isinstance(v, (int, float)) else math.nan


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing mean over `window` points (NaNs skipped), so a noisy loss shows its trend."""
    out = []
    for i in range(len(values)):
        w = [v for v in values[max(0, i - window + 1): i + 1] if not math.isnan(v)]
        out.append(sum(w) / len(w) if w else math.nan)
    return out


def plot(steps: list[dict], out: str, title: str = "", resumed: list[int] = ()) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    from matplotlib.transforms import blended_transform_factory

    x = [r["step"] for r in steps]
    bounds = stage_boundaries(steps)
    starts = [steps[0]] + [r for r in steps if r["step"] in set(bounds)]
    window = max(1, len(steps) // 40)
    fig, axes = plt.subplots(len(PANELS), 1, figsize=(10, 9), sharex=True)
    for ax, (key, label) in zip(axes, PANELS):
        y = [_value(r, key) for r in steps]
        if key == "loss" and window > 1:
            ax.plot(x, y, lw=0.8, alpha=0.35, color="tab:blue")
            ax.plot(x, smooth(y, window), lw=1.6, color="tab:blue", label=f"mean of {window} steps")
            ax.legend(loc="lower left", fontsize=8)
        else:
            ax.plot(x, y, lw=1.2, color="tab:blue", marker="." if len(x) < 60 else None)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        for b in bounds:
            ax.axvline(b - 0.5, color="tab:red", ls="--", lw=1)  # between the last step of a stage and the next
        for r in resumed:
            ax.axvline(r + 0.5, color="0.6", lw=0.6)  # between the resumed step and the next start's first
    # stage labels written along the boundary lines, so short stages do not overlap
    where = blended_transform_factory(axes[0].transData, axes[0].transAxes)
    for r in starts:
        axes[0].text(r["step"] - 0.5, 0.98, f"stage {r.get('stage', 0)}: {r.get('seq_len', '?')} tok ",
                     transform=where, rotation=90, ha="right", va="top", fontsize=8, color="tab:red")
    axes[-1].set_xlabel("optimizer step")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_eval(evals: list[dict], out: str, title: str = "") -> None:
    """Heat maps (task x stage: depth x length), accuracy vs stage, held-out loss by position per stage."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(t for r in evals for t in r.get("tasks", {})))
    ncol = max(2, len(evals))
    fig = plt.figure(figsize=(3.2 * ncol + 1.0, 2.6 * len(tasks) + 3.6))
    grid = fig.add_gridspec(len(tasks) + 1, ncol, hspace=0.55, wspace=0.35, right=0.88,
                            height_ratios=[1] * len(tasks) + [1.25])
    cmap = plt.get_cmap("RdYlGn")
    image = None
    for row, task in enumerate(tasks):
        for col, r in enumerate(evals):
            ax = fig.add_subplot(grid[row, col])
            acc = r.get("tasks", {}).get(task)
            if not acc:
                ax.axis("off")
                continue
            lengths = sorted(acc, key=int)
            depths = sorted({d for a in acc.values() for d in a}, key=float)
            z = [[acc[n].get(d, math.nan) for n in lengths] for d in depths]
            image = ax.imshow(z, cmap=cmap, vmin=0, vmax=1, aspect="auto")
            for i, zr in enumerate(z):
                for j, v in enumerate(zr):
                    ax.text(j, i, f"{v:.1f}", ha="center", va="center", fontsize=7)
            ax.set_xticks(range(len(lengths)), [f"{int(n) // 1024}k" if int(n) % 1024 == 0 else n for n in lengths],
                          fontsize=7)
            ax.set_yticks(range(len(depths)), depths, fontsize=7)
            trained = [j for j, n in enumerate(lengths) if int(n) <= r["seq_len"]]
            if trained and trained[-1] < len(lengths) - 1:
                ax.axvline(trained[-1] + 0.5, color="black", ls="--", lw=1)  # right of it: longer than trained
            ax.set_title(f"{task}, after stage {r['stage']} ({r['seq_len']} tok)", fontsize=8)
            if col == 0:
                ax.set_ylabel("depth of the needle", fontsize=8)
            if row == len(tasks) - 1:
                ax.set_xlabel("evaluated length", fontsize=8)
    if image is not None:
        top = grid[0, 0].get_position(fig).y1
        bottom = grid[len(tasks) - 1, 0].get_position(fig).y0
        fig.colorbar(image, cax=fig.add_axes([0.9, bottom, 0.015, top - bottom]), label="accuracy (exact match)")
    half = max(1, ncol // 2)
    ax = fig.add_subplot(grid[len(tasks), :half])
    stages = [r["stage"] for r in evals]
    for k, task in enumerate(tasks):
        lengths = sorted({n for r in evals for n in r.get("task_mean", {}).get(task, {})}, key=int)
        for n in lengths:
            y = [r.get("task_mean", {}).get(task, {}).get(n, math.nan) for r in evals]
            ax.plot(stages, y, marker="o", lw=1.2, color=f"C{k}", alpha=0.35 + 0.65 * (int(n) / int(lengths[-1])),
                    label=f"{task} @ {n}")
    ax.set_xticks(stages, [f"{r['stage']}\n{r.get('seq_len', '?')}" for r in evals], fontsize=7)  # older runs: no length
    ax.set_xlabel("after stage (trained length)", fontsize=8)
    ax.set_ylabel("accuracy (mean over depths)", fontsize=8)
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    if tasks:  # below the panel: the lines end near 0 or 1, where a legend inside would hide them
        ax.legend(fontsize=6, ncol=max(1, len(tasks)), loc="upper left", bbox_to_anchor=(0, -0.3))
    ax = fig.add_subplot(grid[len(tasks), half:])
    for r in evals:
        pos = r.get("heldout_loss_by_position")
        if pos:
            x = [(i + 0.5) / len(pos) for i in range(len(pos))]
            ax.plot(x, pos, marker=".", lw=1.2, label=f"stage {r['stage']} ({r['seq_len']} tok)")
    ax.set_xlabel("position in the document (fraction of the stage's length)", fontsize=8)
    ax.set_ylabel("held-out loss", fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)


def out_problem(out: str) -> str | None:
    """Why -o cannot be the plot's file (a folder, a missing folder, an extension matplotlib does not write: it
    appends .png to a name without one and prints nothing of it), or None."""
    if os.path.isdir(out):
        return f"a folder: name the image file, e.g. {os.path.join(out, 'metrics.png')}"
    if not os.path.isdir(os.path.dirname(os.path.abspath(out))):
        return "its folder does not exist"
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    kinds = FigureCanvasAgg.get_supported_filetypes()
    ext = os.path.splitext(out)[1].lstrip(".").lower()
    if ext not in kinds:
        return f"{'no extension' if not ext else f'.{ext} is not an image format'}: end it in .png (or .svg, .pdf)"
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("metrics", help="OUTPUT_DIR/metrics.jsonl (or the run's OUTPUT_DIR)")
    p.add_argument("-o", "--out", help="image to write, .png (or .svg, .pdf ...; default: next to the metrics file, "
                                       ".png); a folder or another extension is refused")
    args = p.parse_args(argv)
    if os.path.isdir(args.metrics):  # the run folder, as eval_summary.py takes it
        args.metrics = os.path.join(args.metrics, "metrics.jsonl")
    if not os.path.isfile(args.metrics):
        print(f"error: {args.metrics}: no such file (give a run's OUTPUT_DIR/metrics.jsonl)", file=sys.stderr)
        return 2
    why = args.out and out_problem(args.out)
    if why:
        print(f"error: --out {args.out}: {why}", file=sys.stderr)
        return 2
    try:  # the whole file at once: a file that cannot be read is refused before any image is written
        recs = list(_records(args.metrics))
    except (OSError, UnicodeDecodeError) as e:
        print(f"error: {args.metrics}: cannot be read ({getattr(e, 'strerror', None) or e}): give a run's "
              "metrics.jsonl (UTF-8 JSON lines, as train.py writes it)", file=sys.stderr)
        return 2
    steps, evals, odd = read_steps(recs), read_evals(recs), unnumbered(recs)
    if odd:
        print(f"note: {args.metrics}: {odd} record(s) whose step / stage is not an integer skipped", file=sys.stderr)
    if not steps:
        print(f"error: {args.metrics} has no step records (lines with 'step' and 'loss')", file=sys.stderr)
        return 2
    out = args.out or args.metrics.rsplit(".", 1)[0] + ".png"
    plot(steps, out, title=args.metrics, resumed=resumes(recs))
    print(f"{out}: {len(steps)} steps, stage boundaries at {stage_boundaries(steps) or 'none'}, resumed after steps "
          f"{resumes(recs) or 'none'}")
    if evals:
        eval_out = out.rsplit(".", 1)[0] + "_eval.png"
        plot_eval(evals, eval_out, title=args.metrics + ": evaluation after each stage")
        print(f"{eval_out}: evaluations of stages {[r['stage'] for r in evals]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
