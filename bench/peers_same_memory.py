"""The same-memory comparison of bench/peers.py (`--same_memory`): at one per-rank cap, each system's
fastest setting. The HF Trainer with and without gradient checkpointing (its pick: the faster whose measured
peak is under the cap); ours with `--memory_features auto --mem_cap_gb CAP` (every such run must stay under
the cap), then the choice, its neighbours, none, HF's own algorithm (checkpoint every layer) and every feature
explicitly (is the choice the fastest of those under the cap?), then paired AB/BA
launches auto vs the HF pick. Results: bench/results/peers_same_memory.*.

    python -m bench.peers --same_memory --lengths 4096,8192,12288,16384,24576 --cap_gb 1.0 --layers 4
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import time

from bench import harness as h

ALL = (True, True, 1, True, False)  # every ALST feature: bench.memory.FEATURE_SETS["alst"]
NONE = (False, False, 0, False, False)
HF_ALGO = (False, False, 1, False, False)  # checkpoint every layer, nothing tiled: HF's gradient checkpointing


def features_of(key: tuple) -> tuple[str, ...]:
    """(tiled_logits, tiled_mlp, checkpoint_every, offload_activations, keep_attention) -> train.py flags."""
    tl, tm, k, off, keep = key
    return tuple([n for n, on in (("tiled_logits", tl), ("tiled_mlp", tm)) if on]
                 + ([f"checkpoint_every={k}"] if k else []) + (["offload_activations"] if off else [])
                 + (["keep_attention"] if keep else []))


def key_of(choice: dict) -> tuple:
    return (bool(choice["tiled_logits"]), bool(choice["tiled_mlp"]), int(choice["checkpoint_every"] or 0),
            bool(choice["offload_activations"]), bool(choice.get("keep_attention", False)))


def label(key: tuple) -> str:
    return "+".join(f.replace("checkpoint_every=", "ckpt/") for f in features_of(key)) or "none"


def key_of_label(name: str) -> tuple:
    """label's inverse: "tiled_mlp+ckpt/2" -> (False, True, 2, False, False)."""
    parts = name.split("+")
    every = next((int(p[len("ckpt/"):]) for p in parts if p.startswith("ckpt/")), 0)
    return ("tiled_logits" in parts, "tiled_mlp" in parts, every, "offload_activations" in parts,
            "keep_attention" in parts)


def neighbours(key: tuple, layers: int) -> list[tuple]:
    """The settings one step away from `key` in auto's candidate space (training/auto_features.candidates on
    CPU: no offload): one tiled feature toggled, keep_attention toggled (with checkpointing), or one more / one
    fewer count of checkpointed layers. A cheaper setting that fits and is faster is always among them or
    beyond one of them."""
    from planner.auto_features import candidates

    ks = sorted({c.every for c in candidates(layers, {}, "cpu")}, key=lambda k: -math.ceil(layers / k) if k else 0)
    tl, tm, k, off, keep = key
    i = ks.index(k) if k in ks else 0
    out = [(not tl, tm, k, off, keep), (tl, not tm, k, off, keep)] + ([(tl, tm, k, off, not keep)] if k else [])
    out += [(tl, tm, ks[j], off, keep and bool(ks[j])) for j in (i - 1, i + 1) if 0 <= j < len(ks)]
    return out


def same_memory(lengths: list[int], cap: float, layers: int, rounds: int, tol: float, run_ours, run_hf,
                on_row=None) -> dict:
    """The ladder of the issue's claim. At each length: the HF Trainer with and without gradient checkpointing
    (its pick: the faster whose measured peak <= cap, an oracle pick that favours it); ours with
    `--memory_features auto --mem_cap_gb cap` (the planner picks before any step; its measured peak must stay
    under the cap: an 'OOM' otherwise); ours with the auto choice, its neighbours, none and every feature set
    explicitly (is the choice the fastest of those that fit?); then `rounds` paired launches auto vs the HF pick
    (AB, BA, ...). A setting whose peak passed the cap is not run at longer lengths (peaks grow with length).
    The ladder ends when neither system has anything left that fits. `on_row(summary so far)` after each length
    (the run saves it: a ladder stopped by a time limit keeps its finished lengths)."""
    over: set = set()
    rows = []
    for L in lengths:
        row: dict = {"seq_len": L, "hf": {}, "ours": {}}
        for gc in (False, True):
            name = "gradient_checkpointing" if gc else "none"
            if ("hf", gc) in over:
                continue
            rec = run_hf(L, gc)
            row["hf"][name] = rec
            if not rec["ok"] or rec["peak_mem_gb"] > cap:
                over.add(("hf", gc))
        hf_fit = {n: r for n, r in row["hf"].items() if r["ok"] and r["peak_mem_gb"] <= cap}
        row["hf_pick"] = max(hf_fit, key=lambda n: hf_fit[n]["tokens_per_s"]) if hf_fit else None

        auto = run_ours(L, None)
        row["auto"] = auto
        choice = key_of(auto["memory_choice"]) if auto.get("memory_choice") else None
        row["auto_refused"] = choice is None
        row["auto_over_cap"] = bool(auto["ok"] and auto["peak_mem_gb"] > cap)
        row["auto_choice"] = label(choice) if choice else None
        todo = [choice, *neighbours(choice, layers)] if choice else []
        for k in dict.fromkeys([*todo, NONE, HF_ALGO, ALL]):
            if ("ours", k) in over:
                continue
            rec = run_ours(L, k)
            row["ours"][label(k)] = rec
            if not rec["ok"] or rec["peak_mem_gb"] > cap:
                over.add(("ours", k))
        if choice and row["hf_pick"] and rounds:
            gc = row["hf_pick"] == "gradient_checkpointing"
            per_round = []
            for r in range(rounds):
                recs = {}
                for side in (("ours", "hf") if r % 2 == 0 else ("hf", "ours")):
                    recs[side] = run_ours(L, None) if side == "ours" else run_hf(L, gc)
                if not all(x["ok"] for x in recs.values()):
                    per_round.append({"ok": False, "error": next(x for x in recs.values() if not x["ok"])["error"]})
                    continue
                per_round.append({"ok": True, "ours": round(recs["ours"]["tokens_per_s"], 1),
                                  "hf": round(recs["hf"]["tokens_per_s"], 1),
                                  "ratio": round(recs["ours"]["tokens_per_s"] / recs["hf"]["tokens_per_s"], 3),
                                  "ours_peak_gb": recs["ours"]["peak_mem_gb"], "hf_peak_gb": recs["hf"]["peak_mem_gb"]})
            ratios = [x["ratio"] for x in per_round if x["ok"]]
            row["paired"] = {"rounds": per_round, **({"median_ratio": round(statistics.median(ratios), 3),
                                                     "min_ratio": min(ratios), "max_ratio": max(ratios)} if ratios else {})}
            row["auto_over_cap"] |= any(x["ok"] and x["ours_peak_gb"] > cap for x in per_round)
        rows.append(row)
        if on_row:
            on_row(summarize_same_memory(rows, cap, tol))
        if row["auto_refused"] and ("ours", ALL) in over and ("hf", True) in over and ("hf", False) in over:
            break
    return summarize_same_memory(rows, cap, tol)


def judge(row: dict, cap: float, tol: float) -> None:
    """Is auto's choice the fastest of our settings measured under the cap at this length (within `tol`)? And
    what did it leave: faster settings under the cap, with how far under it they peaked (auto keeps HEADROOM,
    10%, of its budget free and allows CPU_ENGINE_OVERHEAD (0.10 GiB) for the engine: a setting that close to
    the cap is refused on purpose). `choice_is_fastest_with_headroom` asks the same of the settings whose
    measured peak also left that 10% free: the rule auto is asked to follow ("the fastest that fits with
    headroom"), judged on measurement instead of the planner's prediction."""
    from planner.auto_features import HEADROOM

    for k in ("fastest_measured", "choice_vs_fastest", "choice_is_fastest", "faster_under_cap",
              "choice_is_fastest_with_headroom", "choice_is_fastest_paired"):
        row.pop(k, None)
    fit = {n: r for n, r in row["ours"].items() if r["ok"] and r["peak_mem_gb"] <= cap}
    if not row["auto_choice"] or not fit:
        return
    best = max(fit, key=lambda n: fit[n]["tokens_per_s"])
    mine = fit.get(row["auto_choice"])
    row["fastest_measured"] = best
    row["choice_vs_fastest"] = round(mine["tokens_per_s"] / fit[best]["tokens_per_s"], 3) if mine else None
    row["choice_is_fastest"] = bool(mine) and mine["tokens_per_s"] >= (1 - tol) * fit[best]["tokens_per_s"]
    row["faster_under_cap"] = [
        {"setting": n, "speed_vs_choice": round(r["tokens_per_s"] / mine["tokens_per_s"], 3), "peak_gb": r["peak_mem_gb"],
         "below_cap": round(1 - r["peak_mem_gb"] / cap, 3)}
        for n, r in fit.items() if mine and r["tokens_per_s"] > (1 + tol) * mine["tokens_per_s"]]
    roomy = [r["tokens_per_s"] for r in fit.values() if r["peak_mem_gb"] <= cap * (1 - HEADROOM)]
    row["choice_is_fastest_with_headroom"] = bool(mine) and mine["tokens_per_s"] >= (1 - tol) * max(
        roomy + [mine["tokens_per_s"]])
    # single launches differ by 10-15% on this CPU: a contender rechecked in paired rounds is judged on those
    rc = row.get("recheck")
    row["choice_is_fastest_paired"] = row["choice_is_fastest"] if not rc else all(
        c["median_ratio"] >= 1 - tol for c in rc)


def recheck(res: dict, rounds: int, tol: float, run_ours) -> dict:
    """Paired rounds (AB, BA, ...) of auto's choice, launched with its features explicitly, against every setting
    that a single launch measured faster than it under the cap (`faster_under_cap`); the rows get `recheck`:
    [{contender, rounds: [[choice tok/s, contender tok/s]], median_ratio}] (choice / contender)."""
    for row in res["rows"]:
        judge(row, res["cap_gb"], tol)
        names = [x["setting"] for x in row.get("faster_under_cap") or []]
        if not names:
            continue
        mine, out = key_of_label(row["auto_choice"]), []
        for name in names:
            theirs, pairs = key_of_label(name), []
            for r in range(rounds):
                got = {k: run_ours(row["seq_len"], k) for k in ((mine, theirs) if r % 2 == 0 else (theirs, mine))}
                if all(g["ok"] for g in got.values()):
                    pairs.append([got[mine]["tokens_per_s"], got[theirs]["tokens_per_s"]])
            out.append({"contender": name, "rounds": pairs,
                        "median_ratio": round(statistics.median(a / b for a, b in pairs), 3) if pairs else None})
        row["recheck"] = [c for c in out if c["median_ratio"] is not None]
    res.update(summarize_same_memory(res["rows"], res["cap_gb"], tol))
    return res


def summarize_same_memory(rows: list[dict], cap: float, tol: float) -> dict:
    def longest(pred):
        ok = [r["seq_len"] for r in rows if pred(r)]
        return max(ok) if ok else None

    fits = lambda rec: bool(rec and rec["ok"] and rec["peak_mem_gb"] <= cap)  # noqa: E731
    for r in rows:
        judge(r, cap, tol)
    judged = [r for r in rows if "choice_is_fastest" in r]

    def share(key: str) -> dict:
        hits = sum(r[key] for r in judged)
        return {"tolerance": tol, "lengths": len(judged), "fastest": hits,
                "share": round(hits / len(judged), 3) if judged else None}

    gc_rows = [r for r in rows if r["hf_pick"] == "gradient_checkpointing" and "median_ratio" in r.get("paired", {})]
    plain_rows = [r for r in rows if r["hf_pick"] == "none" and "median_ratio" in r.get("paired", {})]
    auto_runs = [r["auto"] for r in rows if r["auto"]["ok"]] + [
        x for r in rows for x in r.get("paired", {}).get("rounds", []) if x["ok"]]
    return {
        "rows": rows,
        "longest_under_cap": {"ours_auto": longest(lambda r: fits(r["auto"])),
                              "ours_all_features": longest(lambda r: fits(r["ours"].get(label(ALL)))),
                              "hf_best": longest(lambda r: r["hf_pick"] is not None)},
        "auto_runs": len(auto_runs),
        "auto_over_cap": sum(r["auto_over_cap"] for r in rows),
        "choice_fastest": share("choice_is_fastest"),
        "choice_fastest_with_headroom": share("choice_is_fastest_with_headroom"),
        "choice_fastest_paired": share("choice_is_fastest_paired"),
        "ratio_where_hf_needs_checkpointing": {str(r["seq_len"]): r["paired"]["median_ratio"] for r in gc_rows},
        "ratio_where_hf_fits_without": {str(r["seq_len"]): r["paired"]["median_ratio"] for r in plain_rows},
    }


def same_memory_table(res: dict, cap: float) -> str:
    out = [f"per-rank cap {cap} GiB; tokens/s of {res.get('ranks', 2)} rank(s) on {res.get('device', 'cpu')}; "
           "peak GiB per rank; x = over the cap or failed",
           f"{'seq_len':>7} | {'HF none':>15} | {'HF grad-ckpt':>15} | {'ours auto (choice)':>40} | "
           f"{'fastest of ours measured':>28} | paired ours/HF"]

    def cell(rec):
        if not rec:
            return "-"
        if not rec["ok"]:
            return "x failed"
        return f"{rec['tokens_per_s']:.0f} @{rec['peak_mem_gb']:.2f}" + (" x" if rec["peak_mem_gb"] > cap else "")

    for r in res["rows"]:
        auto = "refused: nothing fits" if r["auto_refused"] else f"{cell(r['auto'])} ({r['auto_choice']})"
        fastest = (f"{r['fastest_measured']} ({r['choice_vs_fastest']})" if "fastest_measured" in r else "-")
        if r.get("faster_under_cap"):
            fastest += " [" + ", ".join(f"{x['setting']} {x['below_cap']:.0%} under cap" for x in r["faster_under_cap"]) + "]"
        pr = r.get("paired", {})
        paired = (f"{pr['median_ratio']:.2f} vs {r['hf_pick']} ({pr['min_ratio']:.2f}-{pr['max_ratio']:.2f})"
                  if "median_ratio" in pr else "-")
        out.append(f"{r['seq_len']:>7} | {cell(r['hf'].get('none')):>15} | {cell(r['hf'].get('gradient_checkpointing')):>15}"
                   f" | {auto:>40} | {fastest:>28} | {paired}")
    lg, cf = res["longest_under_cap"], res["choice_fastest"]
    out.append(f"longest under the cap: ours auto {lg['ours_auto']}, ours with every feature {lg['ours_all_features']}, "
               f"HF best {lg['hf_best']}")
    out.append(f"auto runs over the cap: {res['auto_over_cap']} of {res['auto_runs']}; auto's choice the fastest measured "
               f"(within {cf['tolerance']:.0%}) at {cf['fastest']} of {cf['lengths']} lengths")
    ch = res["choice_fastest_with_headroom"]
    out.append(f"  ... of the settings whose measured peak also left auto's 10% headroom free: {ch['fastest']} of "
               f"{ch['lengths']} lengths")
    cp = res.get("choice_fastest_paired")
    for r in res["rows"]:
        for c in r.get("recheck") or []:
            out.append(f"  recheck at {r['seq_len']}: {r['auto_choice']} / {c['contender']} in {len(c['rounds'])} paired "
                       f"rounds: median {c['median_ratio']:.3f} (" + ", ".join(f"{a / b:.3f}" for a, b in c["rounds"]) + ")")
    if cp and any(r.get("recheck") for r in res["rows"]):
        out.append(f"  ... judged on the paired rechecks where a single launch said otherwise: {cp['fastest']} of "
                   f"{cp['lengths']} lengths")
    return "\n".join(out)


def plot_same_memory(res: dict, cap: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    fig, ax = plt.subplots(1, 3, figsize=(17, 4.6))
    series = {"HF none": lambda r: r["hf"].get("none"), "HF grad-ckpt": lambda r: r["hf"].get("gradient_checkpointing"),
              "ours auto": lambda r: r["auto"], "ours every feature": lambda r: r["ours"].get(label(ALL)),
              "ours none": lambda r: r["ours"].get(label(NONE))}
    for name, get in series.items():
        pts = [(r["seq_len"], get(r)) for r in rows if get(r) and get(r)["ok"]]
        if pts:
            ax[0].plot([p[0] for p in pts], [p[1]["peak_mem_gb"] for p in pts], marker="o", label=name)
            ok = [(x, rec) for x, rec in pts if rec["peak_mem_gb"] <= cap]
            if ok:
                ax[1].plot([p[0] for p in ok], [p[1]["tokens_per_s"] for p in ok], marker="o", label=name)
    ax[0].axhline(cap, color="k", ls="--", lw=0.8, label=f"cap {cap} GiB")
    ax[0].set(xscale="log", xlabel="sequence length", ylabel="peak GiB per rank", title="per-rank peak")
    ax[1].set(xscale="log", yscale="log", xlabel="sequence length", ylabel=f"tokens/s ({res.get('ranks', 2)} rank(s))",
              title="throughput of the settings under the cap")
    paired = [(r["seq_len"], r["paired"], r["hf_pick"]) for r in rows if "median_ratio" in r.get("paired", {})]
    for i, (_, pr, pick) in enumerate(paired):
        rs = [x["ratio"] for x in pr["rounds"] if x["ok"]]
        ax[2].scatter([i] * len(rs), rs, alpha=0.6, s=22, color="tab:red" if pick == "gradient_checkpointing" else "tab:blue")
        ax[2].scatter([i], [pr["median_ratio"]], color="k", marker="_", s=400)
    ax[2].axhline(1.0, color="k", lw=0.8)
    ax[2].axhline(1.2, color="tab:red", lw=0.8, ls=":", label="1.2x goal where HF needs grad-ckpt (red points)")
    ax[2].set(xticks=range(len(paired)), xticklabels=[p[0] for p in paired], xlabel="sequence length",
              ylabel="tokens/s ours auto / HF pick", title="paired rounds (AB, BA, ...), median = bar")
    for a in ax:
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_same_memory(a, model: str, lengths: list[int], device: str, work: str, malloc: dict, t0: float,
                    hf_point) -> int:
    """The `--same_memory` run of bench.peers.main (its parsed arguments `a`; `hf_point`: its HF launcher)."""
    def show(what: str, rec: dict) -> dict:
        status = (f"{rec['tokens_per_s']:.0f} tok/s, peak {rec['peak_mem_gb']:.3f} GiB" if rec["ok"]
                  else f"FAILED ({rec['error'][:160]})")
        extra = f" -> {label(key_of(rec['memory_choice']))}" if rec.get("memory_choice") else ""
        print(f"[{time.time() - t0:5.0f}s] {what:<34} L={rec['seq_len']:<6}: {status}{extra}  (load {rec['load_after']})",
              flush=True)
        return rec

    budget = "--gpu_mem_gb" if device == "cuda" else "--mem_cap_gb"  # the cap: the GPU's memory, or peak RSS

    tile = {}  # seq_len -> the logits tile auto chose there: explicit tiled-logits runs use the same one

    def run_ours(L: int, key) -> dict:
        mb = tile.get(L) if key is not None and key[0] else None  # key[0]: tiled logits
        extra = (("--memory_features", "auto", budget, str(a.cap_gb)) if key is None
                 else ("--logits_tile_mb", str(mb)) if mb else ())
        rec = h.train_point(model, L, a.sp, features_of(key) if key else (), a.steps, device, work, nproc=a.nproc,
                             timeout=a.timeout, env=malloc, extra_args=extra)
        if key is None and rec.get("memory_choice", {}).get("logits_tile_mb"):
            tile[L] = rec["memory_choice"]["logits_tile_mb"]
        if mb:
            rec["logits_tile_mb"] = mb
        return show("ours " + ("auto" if key is None else label(key)), rec)

    def run_hf(L: int, gc: bool) -> dict:
        return show("hf " + ("grad-ckpt" if gc else "none"), hf_point(model, L, a.steps, device, work, a.timeout,
                                                                       malloc, gradient_checkpointing=gc,
                                                                       nproc=a.nproc, sp=a.sp))

    if a.recheck:  # paired rounds for the settings a single launch measured faster than the choice; in place
        with open(a.recheck) as fh:
            res = json.load(fh)
        try:
            res = recheck(res, a.paired_rounds, a.tolerance, run_ours)
        finally:
            if not a.keep:
                shutil.rmtree(work, ignore_errors=True)
        res["recheck_seconds"] = round(time.time() - t0)
        save_same_memory(res, a.recheck)
        return 0
    out = a.out or h.result_path("peers_same_memory.json")

    def result(summary: dict, partial: bool) -> dict:
        return {"model": os.path.basename(model), "device": device, "ranks": a.nproc, "sp": a.sp, "steps": a.steps,
                "cap_gb": a.cap_gb, "paired_rounds": a.paired_rounds, "malloc_env": malloc or "glibc defaults",
                "lengths": lengths, "seconds": round(time.time() - t0), "load_average_end": os.getloadavg(),
                **({"partial": "the lengths finished before the run stopped"} if partial else {}), **summary}

    try:
        res = result(same_memory(lengths, a.cap_gb, a.layers, a.paired_rounds, a.tolerance, run_ours, run_hf,
                                 on_row=lambda summary: save_same_memory(result(summary, True), out, quiet=True)),
                     False)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    save_same_memory(res, out)
    print(f"wrote {out} and {os.path.splitext(out)[0]}.png in {res['seconds']} s")
    return 0


def save_same_memory(res: dict, path: str, quiet: bool = False) -> None:
    """The result as JSON at `path`, its plot next to it (.png), and the table on stdout (a run and --resummarize;
    not when `quiet`)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(res, fh, indent=1)
    plot_same_memory(res, res["cap_gb"], os.path.splitext(path)[0] + ".png")
    if not quiet:
        print("\n" + same_memory_table(res, res["cap_gb"]))
