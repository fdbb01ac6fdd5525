"""Peak memory per rank and tokens/s against sequence length, SP degree and memory features, measured by
launching train.py once per point, and the memory planner checked against the measurements.

    python -m bench.memory                  # the full sweep: bench/results/memory.json + memory.png
    python -m bench.memory --quick          # a tiny sweep (~2-3 min): bench/results/memory_quick.json/.png
    python -m bench.memory --calibration    # also print predicted vs measured per point

(the planner's pass line on three of these points, in its own process: `make calibrate`, bench/calibration.py)

Each point is one `deepspeed --num_gpus SP train.py ...` launch of `--steps` optimizer steps (DP = 1) on a
Llama of hidden 256 (`--hidden/--layers`), built once into .cache/bench_models, with the default data (the
demo corpus) and evaluation switched off. Per point: the median tokens/s over the steps after the first
(tokens/s is the SP group's: seq_len / step time) and the max peak_mem_gb over steps. On CPU,
peak_mem_gb is the peak RSS in GiB, max over ranks; every rank runs with OMP_NUM_THREADS=1, so SP=1 uses
one core and SP=2 two. With a GPU (torch.cuda.is_available()) the same sweep runs at SP=1 on one GPU and
peak_mem_gb is torch.cuda.max_memory_allocated.

Peak RSS includes memory that does not depend on the sequence: the interpreter, torch / DeepSpeed /
transformers, gloo, the model states. Two baselines are measured and kept apart:
- `base_gb` (B): the raw peak of the same SP degree at a tiny length (`--baseline_len`, features off).
  `net_gb = peak - B` is the memory that grows with the sequence; the SP memory target uses it.
- `runtime_gb` (R = B - what planner.memory_model.predict_peak_bytes predicts for that tiny run): the part
  of the peak the memory model leaves out on purpose. `tensor_gb = peak - R` is what the model predicts;
  the calibration columns compare the two.

Targets, as measured ratios at `--target_len` (default 16384):
- memory: net_gb(SP=2) / net_gb(SP=1) <= 0.55 (the raw peak ratio is reported next to it);
- SP=2 scaling efficiency: tokens/s(SP=2) / (2 x tokens/s(SP=1)), one core per rank.
The machine is shared: the load average before and after each point is recorded with it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

from bench.harness import ROOT, GiB, bench_model, result_path, train_point, write_json

FEATURE_SETS: dict[str, tuple[str, ...]] = {
    "none": (),
    "tiled_mlp": ("tiled_mlp",),
    "tiled_logits": ("tiled_logits",),
    "ckpt": ("gradient_checkpointing",),
    "ckpt2": ("checkpoint_every=2",),  # selective: every 2nd decoder layer
    "ckpt4": ("checkpoint_every=4",),
    "alst": ("tiled_mlp", "tiled_logits", "gradient_checkpointing", "offload_activations"),
}
# train.py runs ZeRO-3 with both CPU offloads (ds_configs/zero3_offload.json): the planner must count them
OFFLOADS = ("offload_params", "offload_optimizer")


def feature_spec(features: tuple[str, ...]) -> dict:
    """The same features as planner.memory_model.Features.of takes them: {name: True or the value}; "no-X" is
    {X: False} (the flag --no-X)."""
    return {f.split("=")[0].removeprefix("no-"): int(f.split("=")[1]) if "=" in f else not f.startswith("no-")
            for f in features}


def predicted_gb(model: str, seq_len: int, sp: int, features: tuple[str, ...], device: str,
                 world: int | None = None) -> float:
    """planner.memory_model's peak tensor bytes of one rank, in GiB, for the run train.py does."""
    from planner.memory_model import load_shape, predict_peak_bytes

    precision = "bf16" if device == "cuda" else "fp32"  # train.py's default precision per device
    spec = {"lean_rmsnorm": True, "lean_mlp": True, **feature_spec(features), **dict.fromkeys(OFFLOADS, True)}  # train.py's defaults
    return predict_peak_bytes(load_shape(model), seq_len, sp, spec,
                              precision=precision,
                              device=device, world=world) / GiB


def add_baselines(points: list[dict], base: dict[int, dict], model: str) -> None:
    """net_gb (peak minus the tiny-length peak of the same SP), tensor_gb (peak minus the runtime the memory
    model leaves out), the prediction and its relative error, in place."""
    for p in points:
        p["predicted_gb"] = round(predicted_gb(model, p["seq_len"], p["sp"], tuple(p["features"]), p["device"],
                                               p["nproc"]), 4)
        b = base.get(p["sp"])
        if not (p.get("ok") and b and b.get("ok")):
            continue
        runtime = b["peak_mem_gb"] - predicted_gb(model, b["seq_len"], b["sp"], (), b["device"], b["nproc"])
        p["base_gb"], p["runtime_gb"] = b["peak_mem_gb"], round(runtime, 4)
        p["net_gb"] = round(p["peak_mem_gb"] - b["peak_mem_gb"], 4)
        p["tensor_gb"] = round(p["peak_mem_gb"] - runtime, 4)
        p["pred_error"] = round(p["predicted_gb"] / p["tensor_gb"] - 1, 4) if p["tensor_gb"] > 0 else None


def find(points: list[dict], seq_len: int, sp: int, fs: str) -> dict | None:
    for p in points:
        if p["seq_len"] == seq_len and p["sp"] == sp and p["feature_set"] == fs and p.get("ok"):
            return p
    return None


def targets(points: list[dict], target_len: int) -> dict:
    """The measured SP=2 vs SP=1 ratios at target_len, per feature set measured there at both degrees."""
    out: dict = {"seq_len": target_len, "memory_target": "net_gb(SP=2) / net_gb(SP=1) <= 0.55",
                 "efficiency_definition": "tokens/s(SP=2) / (2 x tokens/s(SP=1)), OMP_NUM_THREADS=1 per rank",
                 "by_feature_set": {}}
    for fs in FEATURE_SETS:
        one, two = find(points, target_len, 1, fs), find(points, target_len, 2, fs)
        if not (one and two):
            continue
        r = {"raw_peak_ratio": round(two["peak_mem_gb"] / one["peak_mem_gb"], 3),
             "scaling_efficiency": round(two["tokens_per_s"] / (2 * one["tokens_per_s"]), 3),
             "tokens_per_s": {"sp1": round(one["tokens_per_s"], 1), "sp2": round(two["tokens_per_s"], 1)},
             "peak_mem_gb": {"sp1": one["peak_mem_gb"], "sp2": two["peak_mem_gb"]}}
        if "net_gb" in one and "net_gb" in two and one["net_gb"] > 0:
            r["net_ratio"] = round(two["net_gb"] / one["net_gb"], 3)
            r["net_gb"] = {"sp1": one["net_gb"], "sp2": two["net_gb"]}
            r["memory_target_met"] = r["net_ratio"] <= 0.55
        r["raw_ratio_meets_0.55"] = r["raw_peak_ratio"] <= 0.55
        out["by_feature_set"][fs] = r
    return out


def table(points: list[dict], calibration: bool) -> str:
    head = f"{'features':<13}{'seq_len':>8}{'sp':>4}{'tok/s':>9}{'peak GiB':>10}{'net GiB':>9}{'load':>6}"
    if calibration:
        head += f"{'tensor GiB':>11}{'pred GiB':>10}{'pred/meas':>10}"
    lines = [head]
    for p in points:
        row = f"{p['feature_set']:<13}{p['seq_len']:>8}{p['sp']:>4}"
        if not p.get("ok"):
            lines.append(row + f"  FAILED: {p.get('error', '')[:150]}")
            continue
        net = f"{p['net_gb']:.3f}" if "net_gb" in p else "-"
        row += f"{p['tokens_per_s']:>9.0f}{p['peak_mem_gb']:>10.3f}{net:>9}{p['load_after']:>6.1f}"
        if calibration:
            tens = f"{p['tensor_gb']:.3f}" if "tensor_gb" in p else "-"
            err = f"{p['pred_error'] + 1:.2f}" if p.get("pred_error") is not None else "-"
            row += f"{tens:>11}{p['predicted_gb']:>10.3f}{err:>10}"
        lines.append(row)
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [p for p in result["points"] if p.get("ok") and not p.get("baseline")]
    fig, ax = plt.subplots(1, 3, figsize=(17, 4.8))
    for fs in FEATURE_SETS:
        for sp in sorted({p["sp"] for p in pts}):
            sel = sorted((p for p in pts if p["feature_set"] == fs and p["sp"] == sp), key=lambda p: p["seq_len"])
            if not sel:
                continue
            style = dict(marker="o" if fs == "none" else "s", ls="-" if fs == "none" else ":", label=f"sp{sp} {fs}")
            x = [p["seq_len"] for p in sel]
            line = ax[0].plot(x, [p["peak_mem_gb"] for p in sel], **style)[0]
            if all("net_gb" in p for p in sel):
                ax[0].plot(x, [p["net_gb"] for p in sel], color=line.get_color(), marker=style["marker"], ls="--",
                           alpha=0.5)
            ax[1].plot(x, [p["tokens_per_s"] for p in sel], **style)
            cal = [p for p in sel if p.get("tensor_gb")]
            if cal:
                ax[2].scatter([p["tensor_gb"] for p in cal], [p["predicted_gb"] for p in cal], label=f"sp{sp} {fs}",
                              marker=style["marker"])
    ax[0].set(xscale="log", xlabel="sequence length", ylabel="GiB per rank",
              title="peak per rank (solid/dotted: raw; dashed: minus tiny-length peak)")
    ax[1].set(xscale="log", yscale="log", xlabel="sequence length", ylabel="tokens/s (SP group)",
              title="throughput, 1 core per rank")
    top = max([p.get("tensor_gb", 0) for p in pts] + [p["predicted_gb"] for p in pts] + [0.1])
    ax[2].plot([0, top], [0, top], "k-", lw=0.8)
    ax[2].fill_between([0, top], [0, 0.8 * top], [0, 1.2 * top], color="grey", alpha=0.15, label="+-20%")
    ax[2].set(xlabel="measured: peak - runtime baseline (GiB)", ylabel="predicted (GiB)",
              title="memory model vs measurement")
    for a in ax:
        a.grid(alpha=0.3)
    ax[0].legend(fontsize=7)
    ax[2].legend(fontsize=7)
    fig.suptitle(f"{result['model']} on {result['device']} ({result['machine']['cpus']} cores), "
                 f"{result['steps']} steps per point, malloc: {result['malloc_env']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sweep: SP 1,2; 1024,4096; features none,alst")
    p.add_argument("--sps", default="1,2,4", help="SP degrees (CPU; a GPU runs SP 1 only)")
    p.add_argument("--lengths", default="4096,8192,16384", help="lengths swept with no memory feature")
    p.add_argument("--features", default=",".join(FEATURE_SETS), help=f"feature sets: {', '.join(FEATURE_SETS)}")
    p.add_argument("--feature_lengths", default="8192", help="lengths at which the other feature sets run")
    p.add_argument("--feature_sps", default="1,2", help="SP degrees at which the other feature sets run")
    p.add_argument("--baseline_len", type=int, default=256, help="the tiny length of the baselines")
    p.add_argument("--target_len", type=int, default=16384)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--calibration", action="store_true", help="print predicted vs measured per point")
    p.add_argument("--mmap_threshold", type=int, default=64 * 2**10,
                   help="glibc's MALLOC_MMAP_THRESHOLD_ (bytes) in every rank: blocks at least this big are returned "
                        "to the OS when freed, so peak RSS follows live tensors; 64 KiB is under TiledMLP's tiles "
                        "(default 65536; 0: glibc's own, whose threshold rises to 32 MiB and keeps freed blocks)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per launch")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/memory.json, --quick: memory_quick.json)")
    p.add_argument("--keep", action="store_true", help="keep the run folders (logs) under bench/_runs")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.quick:
        a.sps, a.lengths, a.features, a.feature_lengths, a.feature_sps = "1,2", "1024,4096", "none,alst", "4096", "1,2"
        a.target_len, a.steps = 4096, 3
    out_json = a.out or result_path("memory_quick.json" if a.quick else "memory.json")
    device = a.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    sps = [1] if device == "cuda" else parse_ints(a.sps)
    feature_sets = [f.strip() for f in a.features.split(",") if f.strip()]
    unknown = [f for f in feature_sets if f not in FEATURE_SETS]
    if unknown:
        raise ValueError(f"--features {unknown}: use {', '.join(FEATURE_SETS)}")
    model = bench_model(a.hidden, a.layers)
    plan = [(a.baseline_len, sp, "none", True) for sp in sps]
    plan += [(L, sp, "none", False) for sp in sps for L in parse_ints(a.lengths)] if "none" in feature_sets else []
    plan += [(L, sp, fs, False) for fs in feature_sets if fs != "none"
             for sp in (sps if device == "cuda" else [s for s in parse_ints(a.feature_sps) if s in sps])
             for L in parse_ints(a.feature_lengths)]
    work = os.path.join(ROOT, "bench", "_runs") if a.keep else tempfile.mkdtemp(prefix="bench_memory_")
    print(f"{len(plan)} launches of {a.steps} steps, model {os.path.basename(model)}, device {device}; logs in {work}",
          flush=True)
    malloc = {"MALLOC_MMAP_THRESHOLD_": str(a.mmap_threshold)} if a.mmap_threshold else {}
    points, t0 = [], time.time()
    unavailable: dict[str, str] = {}
    try:
        for L, sp, fs, is_base in plan:
            if fs in unavailable:  # a feature set that failed to start fails the same way at every point
                points.append({"seq_len": L, "sp": sp, "nproc": sp, "feature_set": fs, "features": list(FEATURE_SETS[fs]),
                               "device": device, "ok": False, "skipped": True, "error": unavailable[fs]})
                continue
            rec = train_point(model, L, sp, FEATURE_SETS[fs], a.steps, device, work, timeout=a.timeout, env=malloc)
            rec |= {"feature_set": fs, "baseline": is_base}
            if not rec["ok"] and fs != "none" and rec["exit_code"] != -9 and not rec.get("steps_logged"):
                unavailable[fs] = f"not run: its first launch failed with: {rec['error']}"
            points.append(rec)
            status = (f"{rec['tokens_per_s']:.0f} tok/s, peak {rec['peak_mem_gb']:.3f} GiB" if rec["ok"]
                      else f"FAILED ({rec['error'][:120]})")
            print(f"[{time.time() - t0:5.0f}s] {fs:<12} L={L:<6} sp={sp}: {status}  (load {rec['load_after']})",
                  flush=True)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    base = {p["sp"]: p for p in points if p.get("baseline")}
    add_baselines(points, base, model)
    import deepspeed  # noqa: F401  (versions only)
    import torch
    import transformers

    cal = [p for p in points if p.get("pred_error") is not None and not p.get("baseline")]
    with open(os.path.join(model, "config.json")) as fh:
        model_config = json.load(fh)
    result = {
        "model": os.path.basename(model), "model_config": model_config,
        "device": device, "steps": a.steps, "malloc_env": malloc or "glibc defaults", "baseline_len": a.baseline_len,
        "sweep_seconds": round(time.time() - t0),
        "machine": {"cpus": os.cpu_count(), "omp_threads_per_rank": 1, "torch": torch.__version__,
                    "deepspeed": sys.modules["deepspeed"].__version__, "transformers": transformers.__version__},
        "definitions": {
            "tokens_per_s": "median over steps 2..N of seq_len / step time (the SP group's throughput)",
            "peak_mem_gb": "max over steps of peak RSS (CPU) or max_memory_allocated (GPU), GiB, max over ranks",
            "base_gb": f"peak_mem_gb of the same SP at seq_len {a.baseline_len}, no memory feature",
            "net_gb": "peak_mem_gb - base_gb: memory that grows with the sequence (the SP target uses this)",
            "runtime_gb": "base_gb - predict_peak_bytes(baseline run): what the memory model leaves out",
            "tensor_gb": "peak_mem_gb - runtime_gb: comparable with predicted_gb",
            "pred_error": "predicted_gb / tensor_gb - 1"},
        "points": points,
        "targets": targets(points, a.target_len),
        "calibration": {"points": len(cal),
                        "max_abs_error": max((abs(p["pred_error"]) for p in cal), default=None),
                        "within_20pct": sum(abs(p["pred_error"]) <= 0.2 for p in cal)},
    }
    write_json(out_json, result)
    plot(result, os.path.splitext(out_json)[0] + ".png")
    print()
    print(table(sorted(points, key=lambda p: (list(FEATURE_SETS).index(p["feature_set"]), p["sp"], p["seq_len"])),
                a.calibration))
    print()
    for fs, r in result["targets"]["by_feature_set"].items():
        net = (f"net {r['net_ratio']:.3f} ({'met' if r['memory_target_met'] else 'NOT met'})" if "net_ratio" in r
               else "net n/a")
        print(f"targets at {a.target_len} ({fs}): SP2/SP1 peak memory: {net}, raw {r['raw_peak_ratio']:.3f}; "
              f"SP=2 scaling efficiency {r['scaling_efficiency']:.3f} "
              f"({r['tokens_per_s']['sp2']:.0f} vs 2 x {r['tokens_per_s']['sp1']:.0f} tok/s)")
    c = result["calibration"]
    if c["points"]:
        print(f"calibration: {c['within_20pct']}/{c['points']} points within 20%, max |error| {c['max_abs_error']:.1%}")
    print(f"wrote {out_json} and {os.path.splitext(out_json)[0]}.png in {result['sweep_seconds']} s")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ValueError as err:
        sys.exit(f"error: {err}")
