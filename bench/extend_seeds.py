"""The extension demo (`make demo`: recipes/tiny_cpu_extend.yaml) on several seeds and both RMSNorms: does it
hold, or was it tuned onto one seed? Issue 27's three criteria per run (passkey exact match, mean over depths):
>= 0.9 at the final length after the curriculum, <= 0.1 there after stage 1 alone, and the short (first) length
at most 0.05 below its stage-1 value; plus the wall time of the whole run (start-up, training, evaluation, export).

    python -m bench.extend_seeds                          # seeds 0-4 x {lean, hf}: 10 runs, ~1 h on 2 idle cores
    python -m bench.extend_seeds --seeds 0 --norms lean   # one run

Runs go one at a time (each uses both cores: 2 ranks, one thread each) through the deepspeed launcher, as
`make demo` does. The JSON (bench/results/extend_seeds.json) is rewritten after every run, so a stopped
benchmark keeps what it measured; it records the load average before and after each run, since wall times
measured while other jobs share the cores are inflated. The run named by --figures (default: seed 0, lean
norm) has its evaluation outputs copied to bench/results/demo_extend/ (summary.md, stage*.json, heat maps and
curves), which docs/results/curriculum.md cites.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import glob
import json
import os
import shutil
import subprocess
import sys
import threading

from bench.harness import (
    ROOT,
    bench_env,
    format_table,
    free_port,
    launch,
    launch_failure,
    read_steps,
    result_path,
    write_json,
)

RECIPE = "recipes/tiny_cpu_extend.yaml"
NORMS = {"lean": "--lean_rmsnorm", "hf": "--no-lean_rmsnorm"}


def criteria(ev: list[dict], final_len: int, short_len: int) -> dict:
    """The three criteria from the first and last stage's evaluation (passkey mean over depths per length)."""
    first, last = ev[0]["task_mean"]["passkey"], ev[-1]["task_mean"]["passkey"]
    rec = {"before_final": first[str(final_len)], "after_final": last[str(final_len)],
           "short_stage1": first[str(short_len)], "short_final": last[str(short_len)]}
    rec["pass"] = {"final": rec["after_final"] >= 0.9, "before": rec["before_final"] <= 0.1,
                   "short": rec["short_final"] >= rec["short_stage1"] - 0.05 - 1e-9}
    rec["ok"] = all(rec["pass"].values())
    return rec


def s_per_step_by_len(steps: list[dict]) -> dict[str, float]:
    """Mean seconds per trained step at each length. A step skipped for want of a supervised token (optimizer_skipped)
    logs tokens_per_s null and 0 tokens: it is left out (it was a TypeError here)."""
    timed = [r for r in steps if r.get("tokens_per_s") and r.get("tokens")]
    return {str(n): round(sum(r["tokens"] / r["tokens_per_s"] for r in timed if r["seq_len"] == n)
                          / max(1, sum(r["seq_len"] == n for r in timed)), 2)
            for n in sorted({r["seq_len"] for r in timed})}


def run_one(recipe: str, seed: int, norm: str, work: str, timeout: float) -> dict:
    out = os.path.join(work, f"seed{seed}_{norm}")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    cmd = [os.path.join(ROOT, ".venv", "bin", "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
           "train.py", "--config", recipe, "--seed", str(seed), NORMS[norm], "--output_dir", out, "--resume", "none",
           "--report_to", "none", "--no-progress_bar"]
    timing = os.path.join(out, "cpu_time.txt")
    if shutil.which("time") or os.path.exists("/usr/bin/time"):  # CPU seconds of the whole launch, ranks included
        cmd = ["/usr/bin/time", "-f", "%U %S %M", "-o", timing, *cmd]
    load0 = os.getloadavg()[0]
    code, wall = launch(cmd, bench_env("cpu"), os.path.join(out, "launch.log"), timeout)
    rec = {"seed": seed, "norm": norm, "wall_s": round(wall, 1), "load_before": round(load0, 2),
           "load_after": round(os.getloadavg()[0], 2), "exit_code": code, "out": os.path.relpath(out, ROOT)}
    fields = open(timing).read().split()[-3:] if os.path.exists(timing) else []
    if code == 0 and len(fields) == 3:  # (a launch killed from outside leaves the file empty)
        user, sys_s, rss_kb = fields
        # two ranks, one thread each, on two cores: on idle cores the wall time is about half the CPU time
        rec |= {"cpu_s": round(float(user) + float(sys_s), 1), "max_rss_gb": round(int(rss_kb) / 2**20, 2)}
    evals = sorted(glob.glob(os.path.join(out, "eval", "stage*.json")), key=lambda p: int(p.split("stage")[-1][:-5]))
    if code != 0 or not evals:
        return rec | {"ok": False} | launch_failure(os.path.join(out, "launch.log"))
    ev = [json.load(open(p)) for p in evals]
    steps = read_steps(out)
    rec["peak_mem_gb"] = max((r["peak_mem_gb"] for r in steps), default=None)
    rec["s_per_step_by_len"] = s_per_step_by_len(steps)
    rec["passkey_by_stage"] = [{"stage": e["stage_name"], **e["task_mean"]["passkey"]} for e in ev]
    return rec | criteria(ev, ev[-1]["seq_len"], ev[0]["seq_len"])


def table(runs: list[dict]) -> str:
    rows = []
    for r in runs:
        if "after_final" not in r:
            rows.append([r["seed"], r["norm"], "-", "-", "-", f"{r['wall_s'] / 60:.1f}", "-", f"{r['load_before']:.1f}",
                         "FAIL: " + r.get("error", "")[:60]])
            continue
        rows.append([r["seed"], r["norm"], f"{r['before_final']:.2f}", f"{r['after_final']:.2f}",
                     f"{r['short_stage1']:.2f} -> {r['short_final']:.2f}", f"{r['wall_s'] / 60:.1f}",
                     f"{r['cpu_s'] / 120:.1f}" if "cpu_s" in r else "-",
                     f"{r['load_before']:.1f}/{r['load_after']:.1f}",
                     "yes" if r["ok"] else "no: " + ",".join(k for k, v in r["pass"].items() if not v)])
    return format_table(["seed", "norm", "before@final", "after@final", "short: stage1 -> final", "wall min",
                         "cpu/2 min", "load", "criteria"], rows)


def copy_figures(rec: dict, dest: str) -> None:
    """The run's evaluation outputs and plots into `dest` (what docs/results/curriculum.md cites)."""
    src = os.path.join(ROOT, rec["out"])
    subprocess.run([sys.executable, "scripts/plot_metrics.py", os.path.join(src, "metrics.jsonl"), "-o",
                    os.path.join(src, "metrics.png")], cwd=ROOT, check=True, capture_output=True)
    for old in glob.glob(os.path.join(dest, "*.*")):
        os.remove(old)  # the previous figures (older runs' sub-folders, e.g. seed1/, are left alone)
    os.makedirs(dest, exist_ok=True)
    for p in glob.glob(os.path.join(src, "eval", "*")) + glob.glob(os.path.join(src, "metrics*")):
        if os.path.isfile(p):
            shutil.copy(p, dest)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default=RECIPE)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--norms", nargs="+", choices=list(NORMS), default=list(NORMS))
    ap.add_argument("--work", default=os.path.join(ROOT, "bench", "_runs", "extend_seeds"))
    ap.add_argument("--out", default=result_path("extend_seeds.json"))
    ap.add_argument("--figures", default="0:lean", help="seed:norm whose outputs go to bench/results/demo_extend/ "
                    "(none: keep the committed ones)")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--jobs", type=int, default=1, help="runs at a time (2 on a machine others load: a larger share "
                    "of the cores; each run's wall time is then no measure of an idle machine's, its CPU time is)")
    ap.add_argument("--keep", action="store_true", help="keep the finished runs of --out (same recipe) and do the rest")
    args = ap.parse_args(argv)
    runs: list[dict] = []
    if args.keep and os.path.exists(args.out):
        old = json.load(open(args.out))
        runs = [r for r in old["runs"] if old["recipe"] == args.recipe and "after_final" in r]
    result = {"recipe": args.recipe, "command": "python -m bench.extend_seeds " + " ".join(argv or sys.argv[1:]),
              "cpus": os.cpu_count(), "jobs": args.jobs, "runs": runs}
    done = {(r["seed"], r["norm"]) for r in runs}
    todo = [(seed, norm) for seed in args.seeds for norm in args.norms if (seed, norm) not in done]
    lock = threading.Lock()

    def one(seed_norm):
        rec = run_one(args.recipe, *seed_norm, args.work, args.timeout)
        with lock:
            runs.append(rec)
            runs.sort(key=lambda r: (r["seed"], list(NORMS).index(r["norm"])))
            write_json(args.out, result)
            print(table([rec]), flush=True)
            if f"{rec['seed']}:{rec['norm']}" == args.figures and "after_final" in rec:
                copy_figures(rec, result_path("demo_extend"))

    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(one, todo))
    ok = [r for r in runs if r.get("ok")]
    result["passed"] = f"{len(ok)}/{len(runs)}"
    write_json(args.out, result)
    print(f"\n{table(runs)}\n\nall three criteria met: {len(ok)} of {len(runs)} runs; wall <= 6 min: "
          f"{sum(r['wall_s'] <= 360 for r in runs)} of {len(runs)} -> {args.out}")
    return 0 if len(ok) == len(runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
