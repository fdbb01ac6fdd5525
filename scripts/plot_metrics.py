"""Plot loss, tokens/s and peak memory against the optimizer step from a run's metrics.jsonl.

    python scripts/plot_metrics.py checkpoints/RUN/metrics.jsonl -o checkpoints/RUN/metrics.png

One PNG with three panels sharing the step axis; a dashed vertical line marks each curriculum stage
boundary (the first step of a new stage), labelled with the stage and its sequence length. Evaluation
lines ("event": "eval") and anything without "step" and "loss" are skipped; files written before
stages existed have no "stage" key and count as stage 0.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

PANELS = (("loss", "loss"), ("tokens_per_s", "tokens/s"), ("peak_mem_gb", "peak memory (GB)"))


def read_steps(path: str) -> list[dict]:
    """Step records in step order. A step logged twice (a job resumed behind its last log line) keeps
    its latest record; a torn last line (a job killed mid-write) is ignored."""
    by_step: dict[int, dict] = {}
    with open(path) as fh:
        for line in fh:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and "step" in rec and "loss" in rec and rec.get("event") != "eval":
                by_step[int(rec["step"])] = rec
    return [by_step[s] for s in sorted(by_step)]


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


def plot(steps: list[dict], out: str, title: str = "") -> None:
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("metrics", help="OUTPUT_DIR/metrics.jsonl")
    p.add_argument("-o", "--out", help="PNG to write (default: next to the metrics file, .png)")
    args = p.parse_args(argv)
    steps = read_steps(args.metrics)
    if not steps:
        print(f"error: {args.metrics} has no step records (lines with 'step' and 'loss')", file=sys.stderr)
        return 2
    out = args.out or args.metrics.rsplit(".", 1)[0] + ".png"
    plot(steps, out, title=args.metrics)
    print(f"{out}: {len(steps)} steps, stage boundaries at {stage_boundaries(steps) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
