"""The planner's memory calibration, a benchmark with a pass line: planner.memory_model.predict_peak_bytes
within 20% of the measured per-rank peak of real train.py runs on CPU (2 ranks, SP=2, 8192 tokens, 2 steps:
no memory feature, activation checkpointing, all four ALST features). Exit code 1 when a point is outside
the bound (or the runtime baseline is implausible, or a launch failed); the full sweep is bench/memory.py.

    python -m bench.calibration                                        # = make calibrate (~2 min on 2 cores)
    python -m bench.calibration --report bench/results/calibration.json   # the table and verdict again

predict_peak_bytes counts tensor bytes only, so the measurement is the rank's peak RSS minus a runtime
baseline, defined as: the peak RSS of the same layout at a tiny length (256 tokens) minus what the model
predicts for that tiny run (its ZeRO-3 model states and a few MB of activations). What is left is what the
model leaves out on purpose: the interpreter, torch / DeepSpeed / transformers code and buffers, gloo.
Every rank runs with MALLOC_MMAP_THRESHOLD_=64 KiB so that glibc hands freed blocks of 64 KiB or more
back at once and peak RSS follows live tensors. With glibc's default (a threshold that rises to 32 MiB as
blocks are freed) freed activations stay in the heap and peak RSS was 20-80% above the tensor bytes; at
1 MiB the tiled-MLP sets still measured 30-45 MB over the model (predicted/measured 0.77-0.85), because
TiledMLP's per-tile tensors ([~h, I] fp32, 704 KiB here) are under 1 MiB and their freed blocks stayed in
the heap; at 64 KiB the same runs measured 0.94-0.95. That is the allocator, not the model.

It runs as a process of its own (it was a pytest test, whose runtime baseline rose from 0.43 to 0.57-0.64 GiB
in one long session with whatever earlier tests left behind).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

from bench.harness import (
    NO_EVAL,
    ROOT,
    bench_model,
    format_table,
    read_json,
    read_steps,
    result_path,
    run,
    summarize_steps,
    write_json,
)
from bench.memory import FEATURE_SETS, predicted_gb

SP, STEPS, TINY, LONG = 2, 2, 256, 8192
MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(64 * 2**10)}
BOUND = (0.8, 1.2)  # predicted / measured
RUNTIME_GB = (0.2, 2.0)  # a plausible interpreter + libraries size for the runtime baseline
CASES: dict[str, tuple[str, ...]] = {"none": (), "ckpt": ("gradient_checkpointing",), "alst": FEATURE_SETS["alst"]}


def peak_gb(work: str, model: str, data: str, seq_len: int, features: tuple[str, ...]) -> float:
    """One 2-rank train.py run (plain subprocesses, bench.harness.spawn); its peak_mem_gb (max over steps)."""
    out = os.path.join(work, f"L{seq_len}_{'-'.join(features) or 'none'}")
    cfg = os.path.join(work, "noeval.yaml")
    with open(cfg, "w") as fh:
        fh.write(NO_EVAL)
    args = ["--config", cfg, "--model_name_or_path", model, "--dataset_path", data, "--max_seq_length",
            str(seq_len), "--sequence_parallel_size", str(SP), "--max_steps", str(STEPS), "--output_dir", out,
            "--report_to", "none", "--no-export_hf", "--resume", "none", "--no-progress_bar",
            *[f"--{f}" for f in features]]
    run(os.path.join(ROOT, "train.py"), args, SP, os.path.join(out, "launch"), timeout=300, extra_env=MALLOC)
    return summarize_steps(read_steps(out))["peak_mem_gb"]


def write_tokens(path: str) -> None:
    """3 documents of 9k token ids: enough for STEPS samples of LONG tokens."""
    with open(path, "w") as fh:
        for d in range(3):
            fh.write(json.dumps({"input_ids": [4 + (d * 7919 + i * 104729) % 2000 for i in range(9000)]}) + "\n")


def judge(runtime_gb: float | None, points: list[dict], bound: tuple[float, float] = BOUND,
          runtime_bound: tuple[float, float] = RUNTIME_GB) -> list[str]:
    """What fails the pass line, one line each ([] = pass): an implausible runtime baseline, a failed launch,
    a point whose predicted / measured is outside `bound`."""
    bad = []
    if runtime_gb is None or not runtime_bound[0] < runtime_gb < runtime_bound[1]:
        bad.append(f"runtime baseline {runtime_gb} GiB is not a plausible interpreter+libraries size "
                   f"({runtime_bound[0]}-{runtime_bound[1]} GiB)")
    for p in points:
        if not p.get("ok"):
            bad.append(f"{p['name']}: launch failed: {p.get('error', '')[:300]}")
        elif p["ratio"] is None or not bound[0] <= p["ratio"] <= bound[1]:
            bad.append(f"{p['name']}: predicted/measured {p['ratio']} outside {bound[0]}-{bound[1]}")
    return bad


def table(result: dict) -> str:
    rows = []
    for p in result["points"]:
        if p.get("ok"):
            rows.append([p["name"], p["seq_len"], f"{p['peak_gb']:.3f}", f"{p['measured_gb']:.3f}",
                         f"{p['predicted_gb']:.3f}", f"{p['ratio']:.2f}"])
        else:
            rows.append([p["name"], p["seq_len"], "FAILED", "-", "-", "-"])
    head = ["features", "seq_len", "peak GiB", "measured GiB", "pred GiB", "pred/meas"]
    return (f"runtime baseline {result['runtime_gb']} GiB (peak at {TINY} tokens minus its prediction); "
            f"measured = peak - runtime\n" + format_table(head, rows, [10, 9, 10, 14, 10, 11]))


def verdict(result: dict) -> int:
    """Print the table and the pass line (both computed first: a malformed result prints nothing); 0 when every
    point is inside the bound."""
    text, bad = table(result), judge(result["runtime_gb"], result["points"], tuple(result["bound"]))
    print(text)
    for b in bad:
        print(f"FAIL {b}")
    print(f"calibration: {'PASS' if not bad else 'FAIL'} ({sum(p.get('ok', False) for p in result['points'])} "
          f"points, predicted/measured within {result['bound'][0]}-{result['bound'][1]})")
    return 1 if bad else 0


def report(path: str) -> int:
    """verdict of a saved run (--report); ValueError (one line) for a file that is not one, before any output."""
    what = "give bench/results/calibration.json (a run of python -m bench.calibration)"
    result = read_json(path, "--report", what)
    if not (isinstance(result, dict) and isinstance(result.get("points"), list) and "runtime_gb" in result
            and isinstance(result.get("bound"), list) and len(result["bound"]) == 2):
        raise ValueError(f"--report {path}: not a calibration run (runtime_gb, bound, points): {what}")
    try:  # verdict computes its table and judgement before it prints
        return verdict(result)
    except (KeyError, TypeError, ValueError, AttributeError) as e:  # a hand-edited point
        raise ValueError(f"--report {path}: a field is not what a run writes ({type(e).__name__}: {e}): {what}") from None


def measure(work: str) -> dict:
    model = bench_model()  # hidden 256, 2 layers: activations dominate at 8k tokens
    data = os.path.join(work, "tokens.jsonl")
    write_tokens(data)
    t0 = time.time()
    base = peak_gb(work, model, data, TINY, ())
    runtime = base - predicted_gb(model, TINY, SP, (), "cpu")
    print(f"baseline at {TINY} tokens: peak {base:.3f} GiB, runtime {runtime:.3f} GiB", flush=True)
    points = []
    for name, features in CASES.items():
        pred = predicted_gb(model, LONG, SP, features, "cpu")
        try:
            peak = peak_gb(work, model, data, LONG, features)
        except AssertionError as err:  # bench.harness.run: a rank exited non-zero
            points.append({"name": name, "features": list(features), "seq_len": LONG, "ok": False,
                           "predicted_gb": round(pred, 4), "error": str(err)[-2000:]})
            print(f"{name}: FAILED", flush=True)
            continue
        measured = peak - runtime
        ratio = round(pred / measured, 3) if measured > 0 else None
        points.append({"name": name, "features": list(features), "seq_len": LONG, "ok": True, "peak_gb": peak,
                       "measured_gb": round(measured, 4), "predicted_gb": round(pred, 4), "ratio": ratio})
        print(f"{name}: predicted {pred:.3f} GiB, measured {measured:.3f} GiB, predicted/measured {ratio}",
              flush=True)
    return {"model": os.path.basename(model), "sp": SP, "steps": STEPS, "baseline_len": TINY,
            "malloc_env": MALLOC, "base_peak_gb": base, "runtime_gb": round(runtime, 4), "bound": list(BOUND),
            "runtime_bound_gb": list(RUNTIME_GB), "points": points, "seconds": round(time.time() - t0),
            "definitions": {"runtime_gb": f"peak_mem_gb at {TINY} tokens - predict_peak_bytes of that run",
                            "measured_gb": "peak_mem_gb - runtime_gb (peak RSS, max over ranks and steps)",
                            "ratio": "predicted_gb / measured_gb"}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=result_path("calibration.json"))
    p.add_argument("--report", metavar="JSON", help="print the table and verdict of a saved run; no launch")
    p.add_argument("--keep", action="store_true", help="keep the run folders (logs) under bench/_runs/calibration")
    a = p.parse_args(argv)
    if a.report:
        return report(a.report)
    work = os.path.join(ROOT, "bench", "_runs", "calibration") if a.keep else tempfile.mkdtemp(
        prefix="bench_calibration_")
    os.makedirs(work, exist_ok=True)
    try:
        result = measure(work)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    result["command"] = " ".join(["python -m bench.calibration", *(argv if argv is not None else sys.argv[1:])])
    write_json(a.out, result)
    code = verdict(result)
    print(f"wrote {a.out}")
    return code


if __name__ == "__main__":
    from base.exits import EXIT_USAGE

    try:
        sys.exit(main())
    except ValueError as e:  # the user's input (--report): one line, exit 2 as every script (base/exits.py)
        print(f"error: {e}", file=sys.stderr)
        sys.exit(EXIT_USAGE)
