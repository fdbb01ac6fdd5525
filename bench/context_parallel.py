"""The cost of context parallelism on CPU, side by side in one run: SP = ulysses x cp
(model_utils/context_parallel.py) against pure Ulysses at the same SP degree. Tokens/s of a train step and peak
RSS per rank of the real train.py.

    python -m bench.context_parallel           # the full run (352 s on 2 idle cores):
                                               # bench/results/context_parallel.json + .png and
                                               # docs/results/context_parallel.md rendered from that JSON
    python -m bench.context_parallel --quick   # tiny settings (~3 min): /tmp/context_parallel_quick.json, no docs
    python -m bench.context_parallel --render bench/results/context_parallel.json   # the docs page again, no launch

Every configuration (ulysses, cp) is its own world of sp = ulysses x cp ranks (DP = 1): one train.py launch
through bench/harness.py's `run` (plain subprocesses over gloo, one thread per rank, ZeRO-3 with train.py's
default CPU offload, fp32, evaluation off, glibc MALLOC_MMAP_THRESHOLD_=64 KiB so peak RSS follows live tensors).
The model is a 2-layer Llama of hidden 384 with 12 query heads and 12 KV heads (head dim 32): 12 is the smallest
head count that allows Ulysses at 2, 3 and 4, and with its 12 KV heads the configuration gathers the most K/V a
query head can need, so cp's all-gather is at its largest (a GQA model gathers fewer bytes; 12 heads allow no
KV count between 1 and 12 that suits Ulysses 2, 3 and 4 alike). The data is the built-in demo corpus with
`--reset_position_ids no` (default): every sample is one causal sequence, the long-document case context
parallelism is for (`--reset_position_ids auto` measures document-masked attention instead).

The configurations:
(a) hybrid vs pure Ulysses at the same SP (`--hybrid_sp`, default 4): every (ulysses, cp) the heads allow, here
    (4,1), (2,2), (1,4);
(b) the cost of cp at `--degrees` (default 2,3,4) ranks: pure cp (1, d) vs pure Ulysses (d, 1).
They share the points they have in common, and run grouped by world (a world's points one after the other,
pure Ulysses first), so a change in the machine's load falls on the points compared with each other as little as
possible. Per point: tokens/s is the median over the steps after `--warmup` of seq_len / step time (the SP group's
throughput), peak is train.py's peak_mem_gb (peak RSS since the stage's start, max over ranks and steps). With
`--baseline_len` > 0 each world also runs pure Ulysses at that tiny length, and `net` = peak - that baseline: the
memory that grows with the sequence (the ~0.5 GiB interpreter and libraries are the same in every
configuration and dilute the raw ratio). Ratios compare a point with pure Ulysses at the same SP in this run.

The machine is shared: each point records the load average before and after it and `other_cpu`, the share of
the machine's CPU time during the point that this benchmark's ranks did not use (from /proc/stat minus the
ranks' own CPU time): 0 means no other process competed, 0.5 on 2 cores means one core's worth did.
Absolute CPU times are noise; compare ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import textwrap
import time

from base.atomic import atomic_write
from bench.harness import (
    NO_EVAL,
    ROOT,
    bench_model,
    format_table,
    read_json,
    read_metrics,
    read_steps,
    result_path,
    run,
    write_json,
)

MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(64 * 2**10)}
DOC = os.path.join(ROOT, "docs", "results", "context_parallel.md")


# ---- the plan and the figures (pure) ----------------------------------------------------------------------------

def plan(degrees: list[int], hybrid_sp: int, heads: int, kv_heads: int) -> list[tuple[int, int]]:
    """(ulysses, cp) per launch, grouped by SP degree (ascending): pure Ulysses first where the heads allow it,
    then the hybrids (only at hybrid_sp), then pure cp; each configuration once."""
    from base.parallel import ulysses_options

    out: list[tuple[int, int]] = []
    for sp in sorted(set(degrees) | {hybrid_sp}):
        us = ulysses_options(sp, heads, kv_heads)  # ascending; 1 (pure cp) is always there
        if sp != hybrid_sp:
            us = [u for u in us if u in (1, sp)]
        for u in sorted(us, reverse=True):
            if (u, sp // u) not in out:
                out.append((u, sp // u))
    return out


def step_summary(steps: list[dict], warmup: int) -> dict:
    """Median tokens/s over the steps after the first `warmup` (all of them when there are no more) and the max
    peak_mem_gb over all steps, with the per-step values; a skipped step (tokens_per_s null) ran nothing: left out."""
    steps = [r for r in steps if r.get("tokens_per_s") is not None]
    later = steps[warmup:] or steps
    return {"tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in later), 1),
            "peak_mem_gb": max(r["peak_mem_gb"] for r in steps),
            "step_tokens_per_s": [round(r["tokens_per_s"], 1) for r in steps]}


def busy_jiffies(stat_line: str) -> int:
    """CPU time in use (all but idle and iowait) from /proc/stat's first line ("cpu user nice system idle ...")."""
    f = [int(x) for x in stat_line.split()[1:9]]
    return sum(f) - f[3] - f[4]


def other_cpu(busy_s: float, ours_s: float, wall_s: float, ncpu: int) -> float:
    """Share of the machine's CPU time over `wall_s` that others used: (all busy - ours) / (wall x ncpu), >= 0."""
    return round(max(0.0, busy_s - ours_s) / (wall_s * ncpu), 3) if wall_s > 0 else 0.0


def comparisons(points: list[dict]) -> list[dict]:
    """Every measured point with cp > 1 against pure Ulysses (cp = 1) at the same SP in the same run:
    tokens/s ratio, raw peak ratio and net peak ratio (when both have one)."""
    ref = {p["sp"]: p for p in points if p.get("ok") and p["cp"] == 1 and not p.get("baseline")}
    out = []
    for p in points:
        r = ref.get(p["sp"])
        if not (p.get("ok") and p["cp"] > 1 and r and not p.get("baseline")):
            continue
        c = {"sp": p["sp"], "ulysses": p["ulysses"], "cp": p["cp"],
             "tokens_per_s_ratio": round(p["tokens_per_s"] / r["tokens_per_s"], 3),
             "peak_ratio": round(p["peak_mem_gb"] / r["peak_mem_gb"], 3)}
        if p.get("net_gb") and r.get("net_gb"):
            c["net_ratio"] = round(p["net_gb"] / r["net_gb"], 3)
        out.append(c)
    return out


def add_net(points: list[dict]) -> None:
    """net_gb = peak - the tiny-length baseline of the same world, in place (where both ran)."""
    base = {p["sp"]: p["peak_mem_gb"] for p in points if p.get("baseline") and p.get("ok")}
    for p in points:
        if p.get("ok") and not p.get("baseline") and p["sp"] in base:
            p["base_gb"] = base[p["sp"]]
            p["net_gb"] = round(p["peak_mem_gb"] - base[p["sp"]], 4)


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def rows(result: dict) -> list[list[str]]:
    """The table of the measured points (baselines left out): one row per (ulysses, cp), by SP."""
    comp = {(c["ulysses"], c["cp"]): c for c in result["comparisons"]}
    out = []
    for p in result["points"]:
        if p.get("baseline"):
            continue
        name = ("pure Ulysses" if p["cp"] == 1 else "pure cp" if p["ulysses"] == 1 else "hybrid")
        if not p.get("ok"):
            out.append([f"{p['ulysses']} x {p['cp']}", name, str(p["sp"]), "FAILED", "-", "-", "-", "-", "-",
                        _fmt(p.get("other_cpu"), ".2f")])
            continue
        c = comp.get((p["ulysses"], p["cp"]), {})
        out.append([f"{p['ulysses']} x {p['cp']}", name, str(p["sp"]), f"{p['tokens_per_s']:.0f}",
                    f"{p['peak_mem_gb']:.3f}", _fmt(p.get("net_gb"), ".3f"),
                    _fmt(c.get("tokens_per_s_ratio"), ".2f") if p["cp"] > 1 else "1",
                    _fmt(c.get("peak_ratio"), ".2f") if p["cp"] > 1 else "1",
                    _fmt(c.get("net_ratio"), ".2f") if p["cp"] > 1 else ("1" if p.get("net_gb") else "-"),
                    _fmt(p.get("other_cpu"), ".2f")])
    return out


HEADER = ["ulysses x cp", "kind", "SP", "tokens/s", "peak GiB", "net GiB", "tok/s vs U", "peak vs U", "net vs U",
          "other CPU"]


def render_markdown(result: dict) -> str:
    """docs/results/context_parallel.md from a run's JSON: setup, the table, the ratios of (a) and (b), the load."""
    cfg = result["model_config"]
    load = result["load"]
    comp = result["comparisons"]
    lines = [
        "# Results: context parallelism (SP = ulysses x cp) vs pure Ulysses, on CPU",
        "",
        "Newest run only; generated by `bench/context_parallel.py` from `bench/results/context_parallel.json` "
        "(do not edit: rerun, or `python -m bench.context_parallel --render JSON`). How it runs and what the "
        "columns mean: the script's docstring; the design: [../context_parallel.md](../context_parallel.md).",
        "",
        f"Command: `{result['command']}`, {result['started_utc']} UTC, {result['sweep_seconds']} s. "
        f"Model: Llama, hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, "
        f"{cfg['num_attention_heads']} query / {cfg['num_key_value_heads']} KV heads, vocab {cfg['vocab_size']}, "
        f"fp32; {result['seq_len']} tokens per sample (`--reset_position_ids {result['reset_position_ids']}`), "
        f"{result['steps']} steps per launch, tokens/s = median of steps {result['warmup'] + 1}-{result['steps']}; "
        f"one world of SP ranks per configuration (DP = 1), ZeRO-3 with CPU offload, one thread per rank on "
        f"{result['machine']['cpus']} cores (SP 3 and 4 oversubscribe them: every configuration of one SP "
        f"degree equally). Peak: peak RSS per rank (max over ranks); "
        + (f"net: minus the same world's pure-Ulysses peak at {result['baseline_len']} tokens (the interpreter and "
           "libraries, the same in every configuration). " if result["baseline_len"] else "no baseline run (no net). ")
        + "\"vs U\": ratio to pure Ulysses at the same SP in this run; other CPU: the share of the machine's CPU "
        "that other processes used during the launch.",
        "",
        "| " + " | ".join(HEADER) + " |",
        "|" + "---|" * len(HEADER),
        *["| " + " | ".join(r) + " |" for r in rows(result)],
        "",
    ]
    hyb = [c for c in comp if c["sp"] == result["hybrid_sp"]]
    if hyb:
        lines.append(f"**(a) Hybrid vs pure Ulysses at SP={result['hybrid_sp']}**: "
                     + "; ".join(_ratio_text(c) for c in hyb) + ".")
        lines.append("")
    pure = [c for c in comp if c["ulysses"] == 1]
    if pure:
        lines.append("**(b) The cost of cp: pure cp vs pure Ulysses at the same degree**: "
                     + "; ".join(_ratio_text(c) for c in pure) + ".")
        lines.append("")
    failed = [p for p in result["points"] if not p.get("ok")]
    for p in failed:
        lines.append(f"FAILED: {p['ulysses']} x {p['cp']}{' (baseline)' if p.get('baseline') else ''}: "
                     f"{p.get('error', '')[:300]}")
    lines.append(f"Load during the run: load average {load['before'][0]:.2f} before, {load['after'][0]:.2f} after "
                 f"(1-minute; this benchmark's own ranks count in it); other processes' share of the CPU during "
                 f"the points {load['other_cpu_min']:.2f}-{load['other_cpu_max']:.2f} "
                 f"({'quiet' if load['other_cpu_max'] < 0.1 else 'the machine was shared: the ratios are less sure'}"
                 f"). Absolute CPU times are noise; the ratios are from one run.")
    return "\n".join(ln if ln.startswith("|") else _wrap(ln) for ln in lines) + "\n"


RESULT_KEYS = ("model_config", "load", "comparisons", "points", "command", "started_utc", "sweep_seconds", "seq_len",
               "steps", "warmup", "baseline_len", "hybrid_sp", "reset_position_ids", "machine")


def render_saved(path: str) -> str:
    """render_markdown of a saved run's JSON; ValueError (one line) for a file that is not one (missing, not UTF-8
    JSON, a list, {}, a field of another kind), before any page is written."""
    what = "give bench/results/context_parallel.json (a run of python -m bench.context_parallel)"
    result = read_json(path, "--render", what)
    missing = [k for k in RESULT_KEYS if k not in result] if isinstance(result, dict) else []
    if not isinstance(result, dict) or missing:
        why = f"no {', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}" if missing else "not a JSON object"
        raise ValueError(f"--render {path}: not a context-parallel run ({why}): {what}")
    try:
        return render_markdown(result)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:  # a hand-edited field
        raise ValueError(f"--render {path}: a field is not what a run writes ({type(e).__name__}: {e}): {what}") from None


def _wrap(text: str, width: int = 110) -> str:
    return textwrap.fill(text, width, break_long_words=False, break_on_hyphens=False) if text else text


def _ratio_text(c: dict) -> str:
    net = f", net {c['net_ratio']:.2f}x" if "net_ratio" in c else ""
    return f"{c['ulysses']} x {c['cp']}: tokens/s {c['tokens_per_s_ratio']:.2f}x, peak {c['peak_ratio']:.2f}x{net}"


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [p for p in result["points"] if p.get("ok") and not p.get("baseline")]
    labels = [f"SP{p['sp']}\n{p['ulysses']}x{p['cp']}" for p in pts]
    colors = ["tab:blue" if p["cp"] == 1 else "tab:orange" if p["ulysses"] == 1 else "tab:green" for p in pts]
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    ax[0].bar(labels, [p["tokens_per_s"] for p in pts], color=colors)
    ax[0].set(ylabel="tokens/s (SP group)", title="train step throughput")
    ax[1].bar(labels, [p.get("net_gb", p["peak_mem_gb"]) for p in pts], color=colors)
    ax[1].set(ylabel="GiB per rank", title="peak RSS minus the world's tiny-length peak"
              if all("net_gb" in p for p in pts) else "peak RSS per rank")
    for a in ax:
        a.grid(axis="y", alpha=0.3)
        a.tick_params(axis="x", labelsize=8)
    fig.suptitle(f"ulysses x cp (blue: pure Ulysses, green: hybrid, orange: pure cp); {result['seq_len']} tokens, "
                 f"{result['machine']['cpus']} cores, other CPU {result['load']['other_cpu_max']:.2f} max",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---- measuring -------------------------------------------------------------------------------------------------

def _stat() -> int:
    with open("/proc/stat") as fh:
        return busy_jiffies(fh.readline())


def _children_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def point(model: str, seq_len: int, u: int, cp: int, steps: int, warmup: int, work: str, reset_positions: str,
          timeout: float, baseline: bool = False) -> dict:
    """One train.py world of sp = u x cp ranks; its record (ok False with the error when the launch failed)."""
    sp = u * cp
    out = os.path.join(work, f"L{seq_len}_u{u}_cp{cp}")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    cfg = os.path.join(out, "noeval.yaml")
    with open(cfg, "w") as fh:
        fh.write(NO_EVAL)
    args = ["--config", cfg, "--model_name_or_path", model, "--max_seq_length", str(seq_len),
            "--sequence_parallel_size", str(sp), "--context_parallel_size", str(cp),
            "--reset_position_ids", reset_positions, "--max_steps", str(steps), "--output_dir", out,
            "--report_to", "none", "--no-export_hf", "--save_steps", "0", "--resume", "none", "--no-progress_bar",
            "--learning_rate", "1e-4"]
    rec = {"ulysses": u, "cp": cp, "sp": sp, "seq_len": seq_len, "baseline": baseline,
           "load_before": [round(x, 2) for x in os.getloadavg()]}
    hz, busy0, ours0, t0 = os.sysconf("SC_CLK_TCK"), _stat(), _children_cpu_s(), time.time()
    try:
        run(os.path.join(ROOT, "train.py"), args, sp, os.path.join(out, "launch"), timeout=timeout, extra_env=MALLOC)
        err = None
    except AssertionError as e:  # bench.harness.run: a rank exited non-zero (the ranks' log tails)
        err = str(e)[-1500:]
    wall = time.time() - t0
    rec |= {"wall_s": round(wall, 1), "load_after": [round(x, 2) for x in os.getloadavg()],
            "other_cpu": other_cpu((_stat() - busy0) / hz, _children_cpu_s() - ours0, wall, os.cpu_count() or 1)}
    logged = read_steps(out, read_metrics(out))
    if err or len(logged) < steps:
        return rec | {"ok": False, "error": err or f"{len(logged)} of {steps} steps logged"}
    if any(r.get("cp", 1) != cp or r["sp"] != sp for r in logged):
        return rec | {"ok": False, "error": f"train.py logged sp/cp {logged[0]['sp']}/{logged[0].get('cp')}"}
    return rec | {"ok": True} | step_summary(logged, warmup)


def measure(a: argparse.Namespace, work: str) -> dict:
    model = bench_model(a.hidden, a.layers, a.heads, a.kv_heads)
    configs = plan(a.degrees, a.hybrid_sp, a.heads, a.kv_heads)
    todo = []
    for sp in sorted({u * c for u, c in configs}):
        if a.baseline_len:
            u0 = max(u for u, c in configs if u * c == sp)  # the world's largest Ulysses factor
            todo.append((u0, sp // u0, True))
        todo += [(u, c, False) for u, c in configs if u * c == sp]
    print(f"{len(todo)} launches: {', '.join(f'{u}x{c}' + (' (baseline)' if b else '') for u, c, b in todo)}; "
          f"model {os.path.basename(model)}, {a.seq_len} tokens, {a.steps} steps; logs in {work}", flush=True)
    load0, t0, started = os.getloadavg(), time.time(), time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    points = []
    for u, c, base in todo:
        L, steps = (a.baseline_len, 2) if base else (a.seq_len, a.steps)
        rec = point(model, L, u, c, steps, 0 if base else a.warmup, work, a.reset_position_ids, a.timeout, base)
        points.append(rec)
        status = (f"{rec['tokens_per_s']:.0f} tok/s, peak {rec['peak_mem_gb']:.3f} GiB" if rec["ok"]
                  else f"FAILED ({rec['error'][-200:]})")
        print(f"[{time.time() - t0:4.0f}s] {u} x {c}{' baseline' if base else ''} L={L}: {status}  "
              f"(load {rec['load_after'][0]}, other CPU {rec['other_cpu']})", flush=True)
    add_net(points)
    import deepspeed
    import torch
    import transformers

    with open(os.path.join(model, "config.json")) as fh:
        model_config = json.load(fh)
    others = [p["other_cpu"] for p in points]
    return {
        "model": os.path.basename(model), "model_config": model_config, "seq_len": a.seq_len, "steps": a.steps,
        "warmup": a.warmup, "baseline_len": a.baseline_len, "hybrid_sp": a.hybrid_sp, "degrees": a.degrees,
        "reset_position_ids": a.reset_position_ids, "malloc_env": MALLOC, "started_utc": started,
        "sweep_seconds": round(time.time() - t0),
        "machine": {"cpus": os.cpu_count(), "omp_threads_per_rank": 1, "torch": torch.__version__,
                    "deepspeed": deepspeed.__version__, "transformers": transformers.__version__},
        "load": {"before": [round(x, 2) for x in load0], "after": [round(x, 2) for x in os.getloadavg()],
                 "other_cpu_min": min(others), "other_cpu_max": max(others),
                 "other_cpu_mean": round(statistics.mean(others), 3)},
        "definitions": {
            "tokens_per_s": f"median over steps {a.warmup + 1}..{a.steps} of seq_len / step time (the SP group's)",
            "peak_mem_gb": "train.py's peak_mem_gb: peak RSS since the stage's start, max over ranks and steps, GiB",
            "net_gb": f"peak_mem_gb - base_gb (the same world's pure-Ulysses peak at {a.baseline_len} tokens)",
            "other_cpu": "(machine busy CPU time - this launch's ranks' CPU time) / (wall x cpus) during the point",
            "comparisons": "each point with cp > 1 / pure Ulysses (cp = 1) at the same SP, this run"},
        "points": points,
        "comparisons": comparisons(points),
    }


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny settings: 768 tokens, 3 steps, SP 2 and 4 only")
    p.add_argument("--render", metavar="JSON", help="write the docs page of a saved run; no launch")
    p.add_argument("--seq_len", type=int, default=6144, help="tokens per sample (a multiple of 24 needs no padding)")
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the tokens/s median")
    p.add_argument("--hybrid_sp", type=int, default=4, help="(a): every (ulysses, cp) of this SP degree")
    p.add_argument("--degrees", type=_ints, default=[2, 3, 4], help="(b): pure cp vs pure Ulysses at these degrees")
    p.add_argument("--baseline_len", type=int, default=384, help="tiny length of each world's baseline (0: none)")
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv_heads", type=int, default=12)
    p.add_argument("--reset_position_ids", default="no", choices=("no", "auto", "yes"))
    p.add_argument("--timeout", type=float, default=300, help="seconds per launch")
    p.add_argument("--out", default=None,
                   help="JSON path (default bench/results/context_parallel.json; --quick: /tmp)")
    p.add_argument("--doc", default=None, help=f"markdown page (default {os.path.relpath(DOC, ROOT)}; --quick: none)")
    p.add_argument("--keep", action="store_true",
                   help="keep the run folders (logs) under bench/_runs/context_parallel")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = build_parser().parse_args(argv)
    if a.render:
        doc = a.doc or DOC
        atomic_write(doc, render_saved(a.render).encode())  # rendered whole before the page is touched
        print(f"wrote {doc}")
        return 0
    if a.quick:
        a.seq_len, a.steps, a.warmup, a.degrees, a.baseline_len = 768, 3, 1, [2], 192
    out_json = a.out or ("/tmp/context_parallel_quick.json" if a.quick else result_path("context_parallel.json"))
    doc = a.doc or (None if a.quick else DOC)
    work = (os.path.join(ROOT, "bench", "_runs", "context_parallel") if a.keep
            else tempfile.mkdtemp(prefix="bench_cp_"))
    os.makedirs(work, exist_ok=True)
    try:
        result = measure(a, work)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    result["command"] = " ".join(["python -m bench.context_parallel", *argv])
    write_json(out_json, result)
    plot(result, os.path.splitext(out_json)[0] + ".png")
    print()
    print(format_table(HEADER, rows(result)))
    print()
    print(render_markdown(result).split("\n\n")[-1].strip())  # the load line
    if doc:
        atomic_write(doc, render_markdown(result).encode())
    print(f"wrote {out_json}, {os.path.splitext(out_json)[0]}.png{', ' + doc if doc else ''}")
    return 0


if __name__ == "__main__":
    from base.exits import EXIT_USAGE

    try:
        sys.exit(main())
    except ValueError as err:  # the user's input: one line, exit 2 as every script (base/exits.py)
        print(f"error: {err}", file=sys.stderr)
        sys.exit(EXIT_USAGE)
