"""This project against two peers on the same tiny model, sequence lengths and ranks, in one run:

    (a) ulysses-longtrain: train.py, Ulysses SP=2 on 2 ranks (ZeRO-3 + CPU offload, fp32), no memory feature;
    (a') ulysses-longtrain+alst: the same with the memory features a long run turns on (tiled MLP, tiled
        logits + loss, activation checkpointing with offload);
    (b) hf-trainer-sp: the Hugging Face Trainer with accelerate's ParallelismConfig(sp_backend="deepspeed",
        sp_size=2, ...) on 2 ranks, the same DeepSpeed JSON (bench/peers_hf/hf_trainer_sp.py);
    (c) zero3-dp2: plain DeepSpeed ZeRO-3 without SP, train.py --sequence_parallel_size 1 on 2 ranks (DP=2:
        every rank holds a whole sequence; tokens/s counts both ranks' sequences).

    python -m bench.peers                      # bench/results/peers.json + peers.png
    python -m bench.peers --cap_gb 1.5 --lengths 4096,8192,16384

For each system the lengths are stepped up until the per-rank peak (peak RSS on CPU, max over ranks, the
same measurement in all three) exceeds `--cap_gb` or a launch fails; the longest length whose peak stayed
under the cap is reported. Tokens/s (median after the first step, all ranks together) are compared at every
length that all systems ran. Each rank runs with OMP_NUM_THREADS=1; the load average is recorded per point
because this machine is shared.

The ladder runs one system after another, so machine drift lands on one system's numbers. The tokens/s
claim against the HF integration therefore comes from a paired phase (`--paired_rounds`, 0 to skip): at
each of `--paired_lengths`, ulysses-longtrain and hf-trainer-sp run alternately, the order flipped every
round (AB, BA, AB, ...), `--paired_steps` steps each, and the ratio ours / HF is taken per round; the
median, min and max over rounds are reported, and over all rounds of all lengths the geometric mean ratio
with a 95% bootstrap interval.

`--same_memory` (bench/results/peers_same_memory.{json,png}) asks the other question: at the same per-rank cap, is
`memory_features: auto` faster than the HF integration's best setting, and is its choice right? Per length:
HF with and without gradient checkpointing (the faster that stays under the cap, picked by measurement), ours
with `--memory_features auto --mem_cap_gb CAP` (every such run must stay under the cap), the choice, its
neighbours, none and every feature explicitly (is the choice the fastest of those under the cap?), then
`--paired_rounds` AB/BA launches auto vs the HF pick (bench/peers_same_memory.py).

    python -m bench.peers --same_memory --lengths 4096,8192,12288,16384,24576 --cap_gb 1.0 --layers 4
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time

from bench import harness as h
from bench import memory as bm
from bench import peers_same_memory as sm

SYSTEMS = {
    "ulysses-longtrain": "train.py, Ulysses SP=2, 2 ranks",
    "ulysses-longtrain+alst": "train.py, Ulysses SP=2, 2 ranks, --tiled_mlp --tiled_logits --offload_activations",
    "hf-trainer-sp": "HF Trainer + accelerate ParallelismConfig(sp_backend=deepspeed, sp_size=2), 2 ranks",
    "zero3-dp2": "train.py --sequence_parallel_size 1 on 2 ranks (plain ZeRO-3, DP=2, no SP)",
}
HF_SCRIPT = os.path.join(h.ROOT, "bench", "peers_hf", "hf_trainer_sp.py")


def hf_point(model: str, seq_len: int, steps: int, device: str, work: str, timeout: float, env: dict,
             gradient_checkpointing: bool = False, nproc: int = 2, sp: int = 2) -> dict:
    out = os.path.join(work, f"hf_L{seq_len}{'_gc' if gradient_checkpointing else ''}")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    cmd = [*h.launcher(), "--num_gpus", str(nproc), "--master_port", str(h.free_port()),
           HF_SCRIPT, "--model", model, "--seq_len", str(seq_len), "--sp", str(sp), "--steps", str(steps),
           "--output_dir", out, *(["--gradient_checkpointing"] if gradient_checkpointing else [])]
    load0 = os.getloadavg()[0]
    code, wall = h.launch(cmd, h.bench_env(device, env), os.path.join(out, "launch.log"), timeout)
    rec = {"seq_len": seq_len, "sp": sp, "nproc": nproc, "wall_s": round(wall, 1), "load_before": round(load0, 2),
           "load_after": round(os.getloadavg()[0], 2)}
    done = h.read_steps(out)
    if code != 0 or len(done) < steps:
        return rec | {"ok": False, "exit_code": code} | h.launch_failure(os.path.join(out, "launch.log"))
    return rec | {"ok": True} | h.summarize_steps(done)


def point(system: str, model: str, seq_len: int, steps: int, device: str, work: str, timeout: float,
          env: dict) -> dict:
    if system == "hf-trainer-sp":
        rec = hf_point(model, seq_len, steps, device, work, timeout, env)
    else:
        sp = 1 if system == "zero3-dp2" else 2
        features = bm.FEATURE_SETS["alst"] if system.endswith("+alst") else ()
        rec = h.train_point(model, seq_len, sp, features, steps, device, work, nproc=2, timeout=timeout, env=env)
    return rec | {"system": system}


def ladder(system: str, lengths: list[int], cap: float, run) -> tuple[list[dict], int | None, str]:
    """Run lengths in order until the peak passes the cap; (points, longest under the cap, why it stopped)."""
    points, longest = [], None
    for L in lengths:
        rec = run(system, L)
        points.append(rec)
        if not rec["ok"]:
            return points, longest, f"launch failed at {L}: {rec['error']}"
        if rec["peak_mem_gb"] > cap:
            return points, longest, f"peak {rec['peak_mem_gb']:.3f} GiB > cap at {L}"
        longest = L
    return points, longest, f"all lengths up to {lengths[-1]} stayed under the cap (longer ones not tried)"


def paired(lengths: list[int], rounds: int, steps: int, run) -> dict:
    """Interleaved ours-vs-HF tokens/s: per length, per round, the ratio of the two launches of that round."""
    pair = ("ulysses-longtrain", "hf-trainer-sp")
    out: dict = {"steps": steps, "rounds": rounds, "order": "AB, BA, ... (A = ulysses-longtrain)", "by_length": {}}
    for L in lengths:
        per_round = []
        for r in range(rounds):
            recs = {s: run(s, L, steps) for s in (pair if r % 2 == 0 else pair[::-1])}
            if not all(rec["ok"] for rec in recs.values()):
                bad = next(x for x in recs.values() if not x["ok"])
                per_round.append({"ok": False, "error": bad["error"], "log_tail": bad.get("log_tail")})
                continue
            a, b = (recs[s]["tokens_per_s"] for s in pair)
            per_round.append({"ok": True, "ulysses-longtrain": round(a, 1), "hf-trainer-sp": round(b, 1),
                              "ratio": round(a / b, 3)})
        ratios = [x["ratio"] for x in per_round if x["ok"]]
        out["by_length"][L] = {"rounds": per_round} | ({"median_ratio": round(statistics.median(ratios), 3),
                                                        "min_ratio": min(ratios), "max_ratio": max(ratios)}
                                                       if ratios else {})
    meds = [v["median_ratio"] for v in out["by_length"].values() if "median_ratio" in v]
    if meds:
        out["geomean_of_medians"] = round(statistics.geometric_mean(meds), 3)
    all_ratios = [x["ratio"] for v in out["by_length"].values() for x in v["rounds"] if x["ok"]]
    if all_ratios:
        out["all_rounds"] = ratio_summary(all_ratios)
    return out


def ratio_summary(ratios: list[float], resamples: int = 20000, seed: int = 0) -> dict:
    """Geometric mean of paired ratios with a 95% percentile-bootstrap interval (rounds resampled with
    replacement, fixed seed), and how many rounds ours was at least as fast."""
    import random

    logs = [math.log(r) for r in ratios]
    rng = random.Random(seed)
    boot = sorted(sum(rng.choices(logs, k=len(logs))) / len(logs) for _ in range(resamples))
    lo, hi = boot[int(0.025 * resamples)], boot[int(0.975 * resamples) - 1]
    return {"n": len(ratios), "geomean_ratio": round(statistics.geometric_mean(ratios), 3),
            "ci95": [round(math.exp(lo), 3), round(math.exp(hi), 3)],
            "rounds_ours_at_least_as_fast": sum(r >= 1.0 for r in ratios)}


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pair = result.get("paired_throughput") or {}
    fig, ax = plt.subplots(1, 3 if pair else 2, figsize=(17 if pair else 12, 4.6))
    for name in SYSTEMS:
        pts = sorted((p for p in result["points"] if p["system"] == name and p.get("ok") and not p.get("baseline")),
                     key=lambda p: p["seq_len"])
        if not pts:
            continue
        x = [p["seq_len"] for p in pts]
        ax[0].plot(x, [p["peak_mem_gb"] for p in pts], marker="o", label=name)
        ax[1].plot(x, [p["tokens_per_s"] for p in pts], marker="o", label=name)
    ax[0].axhline(result["cap_gb"], color="k", ls="--", lw=0.8, label=f"cap {result['cap_gb']} GiB")
    ax[0].set(xscale="log", xlabel="sequence length", ylabel="peak GiB per rank", title="per-rank peak (RSS)")
    ax[1].set(xscale="log", yscale="log", xlabel="sequence length", ylabel="tokens/s (2 ranks together)",
              title="throughput, 1 core per rank")
    if pair:
        lengths = sorted(pair["by_length"], key=int)
        for i, L in enumerate(lengths):
            v = pair["by_length"][L]
            ratios = [x["ratio"] for x in v["rounds"] if x["ok"]]
            ax[2].scatter([i] * len(ratios), ratios, color="tab:blue", alpha=0.6, s=22,
                          label="one round (AB or BA)" if i == 0 else None)
            if "median_ratio" in v:
                ax[2].scatter([i], [v["median_ratio"]], color="k", marker="_", s=400,
                              label="median" if i == 0 else None)
        ax[2].axhline(1.0, color="k", lw=0.8)
        title = "paired tokens/s, ulysses-longtrain / hf-trainer-sp"
        if "all_rounds" in pair:
            r = pair["all_rounds"]
            title += f"\nall {r['n']} rounds: geomean {r['geomean_ratio']:.3f}, 95% CI {r['ci95'][0]:.3f}-{r['ci95'][1]:.3f}"
        ax[2].set(xticks=range(len(lengths)), xticklabels=lengths, xlabel="sequence length", ylabel="ratio",
                  title=title)
    for a in ax:
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.suptitle(f"{result['model']}: 2 ranks on {result['device']}, {result['steps']} steps per point", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def resummarized(path: str, tolerance: float) -> dict:
    """--resummarize: a saved --same_memory result with its summary recomputed (and its table tried), before the file
    is rewritten; ValueError (one line) for a file that is not one (it is left as it was)."""
    what = "give bench/results/peers_same_memory.json (a run of python -m bench.peers --same_memory)"
    res = h.read_json(path, "--resummarize", what)
    if not (isinstance(res, dict) and isinstance(res.get("rows"), list) and isinstance(res.get("cap_gb"), (int, float))):
        raise ValueError(f"--resummarize {path}: not a same-memory run (rows, cap_gb): {what}")
    try:
        res.update(sm.summarize_same_memory(res["rows"], res["cap_gb"], tolerance))
        sm.same_memory_table(res, res["cap_gb"])
    except (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError) as e:  # a hand-edited row
        raise ValueError(f"--resummarize {path}: a row is not what a run writes ({type(e).__name__}: {e}): "
                         f"{what}") from None
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="4096,6144,8192,12288,16384,24576,32768", help="the ladder, increasing")
    p.add_argument("--cap_gb", type=float, default=1.25, help="per-rank peak memory cap, GiB")
    p.add_argument("--baseline_len", type=int, default=256, help="0: no tiny-length baseline per system")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv_heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--nproc", type=int, default=2, help="--same_memory: ranks of every launch (1 on a one-GPU machine)")
    p.add_argument("--sp", type=int, default=2, help="--same_memory: SP degree of every launch (ours and HF's)")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--mmap_threshold", type=int, default=64 * 2**10,
                   help="glibc MALLOC_MMAP_THRESHOLD_ (bytes) in every rank of every system, as in bench_memory.py "
                        "(default 65536; 0: glibc's own)")
    p.add_argument("--paired_rounds", type=int, default=3,
                   help="rounds of the interleaved ours-vs-HF throughput phase (0: skip it)")
    p.add_argument("--paired_lengths", default="2048,4096,8192", help="lengths of the paired phase")
    p.add_argument("--paired_steps", type=int, default=6, help="steps per launch in the paired phase")
    p.add_argument("--same_memory", action="store_true",
                   help="the same-memory comparison instead (issue 15): HF with/without gradient checkpointing vs ours "
                        "with memory_features auto under --cap_gb; writes bench/results/peers_same_memory.{json,png}")
    p.add_argument("--tolerance", type=float, default=0.05,
                   help="--same_memory: auto's choice counts as the fastest when within this fraction of the fastest")
    p.add_argument("--out", default=None, help="default bench/results/peers.json (peers_same_memory.json)")
    p.add_argument("--keep", action="store_true", help="keep run folders under bench/_runs_peers")
    p.add_argument("--recheck", metavar="JSON", help="--same_memory: paired rounds (--paired_rounds) of auto's choice "
                   "against each setting a single launch measured faster under the cap, added to JSON in place")
    p.add_argument("--resummarize", metavar="JSON", help="--same_memory: recompute the summary, table and plot of a "
                   "saved result (e.g. with another --tolerance) without running anything")
    a = p.parse_args(argv)
    if a.resummarize:
        sm.save_same_memory(resummarized(a.resummarize, a.tolerance), a.resummarize)
        return 0
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    lengths = bm.parse_ints(a.lengths)
    systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    if any(s not in SYSTEMS for s in systems) or lengths != sorted(lengths):
        raise ValueError(f"--systems from {list(SYSTEMS)}; --lengths increasing")
    model = h.bench_model(a.hidden, a.layers, a.heads, a.kv_heads, a.vocab)
    work = os.path.join(h.ROOT, "bench", "_runs_peers") if a.keep else tempfile.mkdtemp(prefix="bench_peers_")
    malloc = {"MALLOC_MMAP_THRESHOLD_": str(a.mmap_threshold)} if a.mmap_threshold else {}
    t0 = time.time()
    if a.same_memory:
        return sm.run_same_memory(a, model, lengths, device, work, malloc, t0, hf_point)

    def run(system: str, L: int, steps: int | None = None) -> dict:
        rec = point(system, model, L, steps or a.steps, device, work, a.timeout, malloc)
        status = (f"{rec['tokens_per_s']:.0f} tok/s, peak {rec['peak_mem_gb']:.3f} GiB" if rec["ok"]
                  else f"FAILED ({rec['error'][:160]})")
        print(f"[{time.time() - t0:5.0f}s] {system:<18} L={L:<6}: {status}  (load {rec['load_after']})", flush=True)
        return rec

    points, summary = [], {}
    try:
        for s in systems:
            if a.baseline_len:
                points.append(run(s, a.baseline_len) | {"baseline": True})
            pts, longest, why = ladder(s, lengths, a.cap_gb, run)
            points += pts
            base = points[-len(pts) - 1] if a.baseline_len else None
            summary[s] = {"description": SYSTEMS[s], "longest_under_cap": longest, "stopped": why,
                          "baseline_peak_gb": base["peak_mem_gb"] if base and base.get("ok") else None,
                          "baseline_error": base.get("error") if base and not base.get("ok") else None}
        pair_result = (paired(bm.parse_ints(a.paired_lengths), a.paired_rounds, a.paired_steps, run)
                       if a.paired_rounds and {"ulysses-longtrain", "hf-trainer-sp"} <= set(systems) else None)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    ok = {(p["system"], p["seq_len"]): p for p in points if p.get("ok") and not p.get("baseline")}
    common = [L for L in lengths if all((s, L) in ok for s in systems)]
    ratios = {L: {s: round(ok[(s, L)]["tokens_per_s"] / ok[(systems[0], L)]["tokens_per_s"], 3) for s in systems}
              for L in common}
    result = {"model": os.path.basename(model), "device": device, "ranks": 2, "steps": a.steps, "cap_gb": a.cap_gb,
              "malloc_env": malloc or "glibc defaults",
              "lengths": lengths, "seconds": round(time.time() - t0), "systems": summary,
              "tokens_per_s_ratio_to_" + systems[0]: ratios,
              "paired_throughput": pair_result,
              "definitions": {"tokens_per_s": "median over steps 2..N of (tokens of all ranks in the step) / step time",
                              "peak_mem_gb": "max over steps of peak RSS (GiB), max over ranks"},
              "points": points}
    a.out = a.out or h.result_path("peers.json")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(result, fh, indent=1)
    plot(result, os.path.splitext(a.out)[0] + ".png")

    print(f"\n{'system':<19}{'seq_len':>8}{'tok/s':>9}{'peak GiB':>10}{'load':>6}")
    for pt in points:
        tag = " (baseline)" if pt.get("baseline") else ""
        if pt.get("ok"):
            print(f"{pt['system']:<19}{pt['seq_len']:>8}{pt['tokens_per_s']:>9.0f}{pt['peak_mem_gb']:>10.3f}"
                  f"{pt['load_after']:>6.1f}{tag}")
        else:
            print(f"{pt['system']:<19}{pt['seq_len']:>8}  FAILED{tag}: {pt['error'][:200]}")
    print(f"\nlongest sequence with per-rank peak <= {a.cap_gb} GiB:")
    for s, v in summary.items():
        print(f"  {s:<19}{v['longest_under_cap'] or 'none':>8}   ({v['stopped'][:160]})")
    for L, r in ratios.items():
        print(f"tokens/s relative to {systems[0]} at {L}: " + ", ".join(f"{s} {x:.2f}" for s, x in r.items()))
    if pair_result:
        print(f"\npaired ulysses-longtrain / hf-trainer-sp tokens/s ({a.paired_rounds} rounds, AB/BA, "
              f"{a.paired_steps} steps per launch):")
        for L, v in pair_result["by_length"].items():
            if "median_ratio" in v:
                print(f"  {L:>6}: median {v['median_ratio']:.3f}  (min {v['min_ratio']:.3f}, max {v['max_ratio']:.3f})")
            else:
                print(f"  {L:>6}: no complete round")
        if "geomean_of_medians" in pair_result:
            print(f"  geometric mean of the medians: {pair_result['geomean_of_medians']:.3f}")
        if "all_rounds" in pair_result:
            r = pair_result["all_rounds"]
            print(f"  all {r['n']} rounds: geometric mean {r['geomean_ratio']:.3f}, 95% bootstrap interval "
                  f"{r['ci95'][0]:.3f}-{r['ci95'][1]:.3f}; ours at least as fast in {r['rounds_ours_at_least_as_fast']}")
    print(f"wrote {a.out} and {os.path.splitext(a.out)[0]}.png in {result['seconds']} s")
    return 0


if __name__ == "__main__":
    from base.exits import EXIT_USAGE

    try:
        sys.exit(main())
    except ValueError as err:  # the user's input: one line, exit 2 as every script (base/exits.py)
        print(f"error: {err}", file=sys.stderr)
        sys.exit(EXIT_USAGE)
