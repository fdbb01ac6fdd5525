"""Headwise-chunked attention against all heads at once, side by side in one run, on CPU: tokens/s and peak RSS per
rank at the same lengths, and the longest length of the ladder each fits under one RSS cap.

    python -m bench.head_chunks                 # bench/results/head_chunks.json (+ .png), a table
    python -m bench.head_chunks --report bench/results/head_chunks.json   # the table again from saved results

Each point is one process (a fresh interpreter, one rank, SP 1) that builds a Llama of
hidden 512, 8 query / 2 KV heads, 4 layers, vocab 2048 (seed 0, fp32) through this project's memory features
(model_utils.memory.apply_memory_features, make_loss_fn: lean RMSNorm and MLP, tiled MLP and logits with 4 MiB
logits tiles, no checkpointing: see FEATURES) with `attention_head_chunks` 1 and 8 (every head alone), and runs 2 forward +
backward steps (weight gradients dropped as produced, as ZeRO-3 releases them). Peak RSS = VmHWM after the steps
(reset by writing 5 to /proc/self/clear_refs after the model exists, so the figure is the steps' own high-water
mark over the model, with glibc MALLOC_MMAP_THRESHOLD_=65536 as bench/memory.py: RSS follows live tensors);
tokens/s = of step 2. The two settings alternate at each length, so the machine's load falls on both
alike. The RSS cap is the unchunked run's peak at the second-longest length: the ladder says whether chunking
reaches the next rung under the memory the unchunked run needed one rung lower.

One rank, the model path (no DeepSpeed engine): what chunking changes in the layer, without ZeRO-3's buffers in the
RSS. Under train.py + ZeRO-3 chunks once failed at the second step (the leaf module's gradient hook fired before
the chunked backward; fixed 2026-11-27, docs/attention.md); test_parity checks 3 steps there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from bench.harness import ROOT, format_table, read_json, result_path, write_json

# No checkpointing: with it (and ALST's 1 GiB logits tile) the logits and the MLP set the peak of this small model, and
# chunking moved nothing (2048-8192 tokens, 2 layers, 2026-11-26: peak RSS ratio 0.989-1.002). Without it every layer
# keeps its attention for backward: q, k, v, o (3 [T, h] units here) unchunked, the kernel output (1u) chunked.
FEATURES = dict(gradient_checkpointing=False, tiled_mlp=True, tiled_logits=True, lean_rmsnorm=True, lean_mlp=True)
SHAPE = dict(hidden=512, layers=4, heads=8, kv_heads=2, vocab=2048)
STEPS = 2


def _rss(field: str) -> int:
    with open("/proc/self/status") as fh:
        return next(int(ln.split()[1]) * 1024 for ln in fh if ln.startswith(field + ":"))


def worker(seq_len: int, chunks: int) -> dict:
    """One point, in this process: peak RSS above the built model and tokens/s of STEPS steps."""
    import types

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from model_utils.head_chunks import install
    from model_utils.memory import apply_memory_features, make_loss_fn

    torch.set_num_threads(1)
    cfg = AutoConfig.for_model("llama", hidden_size=SHAPE["hidden"], intermediate_size=round(SHAPE["hidden"] * 2.6875),
                               num_attention_heads=SHAPE["heads"], num_key_value_heads=SHAPE["kv_heads"],
                               vocab_size=SHAPE["vocab"], num_hidden_layers=SHAPE["layers"], tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float().train()
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    opts = types.SimpleNamespace(checkpoint_every=0, offload_activations=False, keep_attention=False,
                                 attention_head_chunks=chunks, **FEATURES)
    apply_memory_features(model, opts)
    install(model, chunks)
    import model_utils.tiled_loss
    model_utils.tiled_loss.LOGITS_TILE_BYTES = 4 * 2**20  # small logits tiles: the layers, not the logits, set the peak
    loss_fn = make_loss_fn(opts)
    ids = torch.randint(0, SHAPE["vocab"], (1, seq_len))
    mb = {"input_ids": ids, "position_ids": torch.arange(seq_len)[None], "shift_labels": ids}
    base = _rss("VmRSS")
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    times = []
    for _ in range(STEPS):
        t0 = time.perf_counter()
        loss_fn(model, mb).backward()
        times.append(time.perf_counter() - t0)
    peak = _rss("VmHWM")
    return {"seq_len": seq_len, "head_chunks": chunks, "ok": True, "peak_mem_gb": peak / 2**30,
            "peak_above_model_gb": (peak - base) / 2**30, "tokens_per_s": seq_len / statistics.median(times[1:]),
            "step_s": [round(t, 2) for t in times]}


def run(lengths: list[int], chunks: int, timeout: float = 400) -> dict:
    points = []
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
               PYTHONPATH=ROOT)
    for seq_len in lengths:
        for n in (1, chunks):
            cmd = [sys.executable, "-m", "bench.head_chunks", "--worker", str(seq_len), str(n)]
            try:
                out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
                rec = (json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else
                       {"seq_len": seq_len, "head_chunks": n, "ok": False, "error": out.stderr.strip()[-300:]})
            except subprocess.TimeoutExpired:
                rec = {"seq_len": seq_len, "head_chunks": n, "ok": False, "error": f"timeout {timeout}s"}
            points.append(rec)
            print(f"L={seq_len} chunks={n}: " + (f"{rec['tokens_per_s']:.0f} tok/s, {rec['peak_mem_gb']:.3f} GiB"
                                                  if rec["ok"] else f"failed: {rec['error']}"), flush=True)
    return summarize({"shape": SHAPE, "sp": 1, "features": FEATURES, "chunks": chunks, "steps": STEPS,
                      "points": points})


def summarize(res: dict) -> dict:
    """Per length the chunked / unchunked ratios; the RSS cap and the longest length each setting fits under it."""
    ok = [p for p in res["points"] if p["ok"]]
    by = {(p["seq_len"], p["head_chunks"]): p for p in ok}
    lengths = sorted({p["seq_len"] for p in ok})
    res["ratios"] = [{"seq_len": L, "tokens_per_s": by[L, res["chunks"]]["tokens_per_s"] / by[L, 1]["tokens_per_s"],
                      "peak_rss": by[L, res["chunks"]]["peak_mem_gb"] / by[L, 1]["peak_mem_gb"]}
                     for L in lengths if (L, 1) in by and (L, res["chunks"]) in by]
    if len(lengths) >= 2 and (lengths[-2], 1) in by:
        cap = by[lengths[-2], 1]["peak_mem_gb"]
        res["rss_cap_gb"] = cap
        res["longest_under_cap"] = {str(n): max([L for L in lengths if (L, n) in by and by[L, n]["peak_mem_gb"] <= cap],
                                                default=0) for n in (1, res["chunks"])}
    return res


def table(res: dict) -> str:
    rows = []
    for r in res["ratios"]:
        a, b = ({p["head_chunks"]: p for p in res["points"] if p["ok"] and p["seq_len"] == r["seq_len"]}[n]
                for n in (1, res["chunks"]))
        rows.append([r["seq_len"], f"{a['tokens_per_s']:.0f}", f"{b['tokens_per_s']:.0f}", f"{r['tokens_per_s']:.3f}",
                     f"{a['peak_mem_gb']:.3f}", f"{b['peak_mem_gb']:.3f}", f"{r['peak_rss']:.3f}"])
    out = format_table(["seq_len", "tok/s n=1", f"tok/s n={res['chunks']}", "ratio", "peak RSS GiB n=1",
                        f"peak RSS GiB n={res['chunks']}", "ratio"], rows)
    if "rss_cap_gb" in res:
        out += (f"\nRSS cap {res['rss_cap_gb']:.3f} GiB per rank: longest under it, unchunked "
                f"{res['longest_under_cap']['1']:,}, {res['chunks']} chunks {res['longest_under_cap'][str(res['chunks'])]:,}")
    return out


def report(path: str) -> str:
    """table of a saved result (--report); ValueError (one line) for a file that is not one."""
    what = "give bench/results/head_chunks.json (a run of python -m bench.head_chunks)"
    res = read_json(path, "--report", what)
    if not (isinstance(res, dict) and isinstance(res.get("ratios"), list) and isinstance(res.get("points"), list)
            and "chunks" in res):
        raise ValueError(f"--report {path}: not a head-chunks run (chunks, points, ratios): {what}")
    try:
        return table(res)
    except (KeyError, TypeError, ValueError, AttributeError) as e:  # a hand-edited point
        raise ValueError(f"--report {path}: a field is not what a run writes ({type(e).__name__}: {e}): {what}") from None


def plot(res: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for n in (1, res["chunks"]):
        pts = sorted((p for p in res["points"] if p["ok"] and p["head_chunks"] == n), key=lambda p: p["seq_len"])
        axes[0].plot([p["seq_len"] for p in pts], [p["peak_mem_gb"] for p in pts], "o-", label=f"{n} chunk(s)")
        axes[1].plot([p["seq_len"] for p in pts], [p["tokens_per_s"] for p in pts], "o-", label=f"{n} chunk(s)")
    if "rss_cap_gb" in res:
        axes[0].axhline(res["rss_cap_gb"], ls="--", c="gray", label="RSS cap")
    axes[0].set(xlabel="tokens", ylabel="peak RSS per rank (GiB)")
    axes[1].set(xlabel="tokens", ylabel="tokens/s")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="2048,4096,8192")
    p.add_argument("--chunks", type=int, default=8, help="head chunks of the chunked runs (8: every head alone)")
    p.add_argument("--worker", nargs=2, type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=result_path("head_chunks.json"))
    p.add_argument("--report", default=None, help="print the table of a saved result")
    a = p.parse_args(argv)
    if a.worker:
        print(json.dumps(worker(*a.worker)))
        return 0
    if a.report:
        print(report(a.report))
        return 0
    t0, load0 = time.time(), os.getloadavg()
    res = run([int(x) for x in a.lengths.split(",")], a.chunks)
    res.update(wall_s=round(time.time() - t0, 1), load_before_after=[load0, os.getloadavg()])
    write_json(a.out, res)
    try:
        plot(res, a.out[:-5] + ".png")
    except ImportError:
        pass
    print(table(res))
    return 0


if __name__ == "__main__":
    from base.exits import EXIT_USAGE

    try:
        sys.exit(main())
    except ValueError as e:  # the user's input (--report): one line, exit 2 as every script (base/exits.py)
        print(f"error: {e}", file=sys.stderr)
        sys.exit(EXIT_USAGE)
