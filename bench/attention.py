"""Cost of document masking: tokens/s and per-rank peak memory of the real train.py at SP=2 with position ids
that restart at every document (`--reset_position_ids yes`: the document-masked attention of
model_utils/attention.py) against monotonic ones (`no`: one plain causal sdpa call over the whole sample).

    python -m bench.attention                       # 16k and 32k tokens, 2 paired rounds: bench/results/attention.json/.png
    python -m bench.attention --lengths 4096 --rounds 1 --steps 2 --out /tmp/a.json    # a quick look
    python -m bench.attention --micro               # the attention function alone: bench/results/attention_micro.json

Every launch is bench/harness.py's `train_point` (Llama hidden 256, 2 layers, vocab 2048, fp32, ZeRO-3 +
CPU offload, one thread per rank, evaluation off) on a JSONL of token documents of 500-2500 tokens (mean 1500:
about 11 documents per 16k sample, 22 per 32k). The two modes alternate within each round and swap order
between rounds (AB, BA, ...), so a change in the machine's load hits both alike; the figure is the ratio
masked / plain per round (tokens/s: median over the steps after the first; peak: max over steps and ranks).
`--micro` times the attention function alone (forward + backward, one thread, 3 alternated rounds) at the
bench's shapes after the SP=2 all-to-all (16384 tokens, 2 query heads, 1 KV head, head dim 64) and counts the
bytes it saves for backward beyond q/k/v, plain vs document-masked with sdpa blocks of 2048 and 512 tokens, for
documents of 500-2500 and of 20-200 tokens.
The planner's `predict_peak_bytes` (which does not model the mask) is compared with the measured peak minus
the runtime it leaves out (bench/memory.py's `tensor_gb`, from one SP=2 launch at `--baseline_len`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

from bench.harness import bench_model, result_path, train_point, write_json
from bench.memory import add_baselines

MODES = {"masked": "yes", "plain": "no"}  # --reset_position_ids per mode
SP = 2


def write_docs(path: str, n_tokens: int, lo: int = 500, hi: int = 2500, vocab: int = 2048, seed: int = 0) -> list[int]:
    """A JSONL of token documents of uniform random length in [lo, hi] totalling >= n_tokens; their lengths."""
    import numpy as np

    rng = np.random.default_rng(seed)
    lens, total = [], 0
    with open(path, "w") as fh:
        while total < n_tokens:
            n = int(rng.integers(lo, hi + 1))
            fh.write(json.dumps({"input_ids": rng.integers(4, vocab, n).tolist()}) + "\n")
            lens.append(n)
            total += n
    return lens


def docs_per_sample(lens: list[int], seq_len: int, n_samples: int) -> tuple[int, float]:
    """(min, mean) number of documents that overlap each of the first n_samples samples of the packed stream."""
    import numpy as np

    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    counts = [int(((starts > i * seq_len) & (starts < (i + 1) * seq_len)).sum()) + 1 for i in range(n_samples)]
    return min(counts), statistics.mean(counts)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    lengths = sorted({p["seq_len"] for p in result["points"]})
    for ax, key, label in ((axes[0], "tokens_per_s", "tokens/s (SP group)"), (axes[1], "peak_mem_gb", "per-rank peak RSS (GiB)")):
        for mode, marker, color in (("masked", "o", "tab:blue"), ("plain", "s", "tab:orange")):
            for L in lengths:
                ys = [p[key] for p in result["points"] if p.get("ok") and p["mode"] == mode and p["seq_len"] == L]
                ax.scatter([L] * len(ys), ys, marker=marker, color=color, label=mode if L == lengths[0] else None)
        if key == "peak_mem_gb":
            pred = {L: result["summary"][str(L)].get("predicted_peak_gb") for L in lengths}
            ax.plot(lengths, [pred[L] for L in lengths], "k--", label="planner + runtime")
        ax.set_xlabel("tokens per sample")
        ax.set_ylabel(label)
        ax.set_xscale("log", base=2)
        ax.legend()
    fig.suptitle("document-masked vs plain causal attention, SP=2, CPU (each round's launches paired)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def summarize(points: list[dict], lengths: list[int]) -> dict:
    out = {}
    for L in lengths:
        rounds = sorted({p["round"] for p in points if p["seq_len"] == L})
        tput, mem, r = [], [], {}
        for k in rounds:
            pair = {p["mode"]: p for p in points if p["seq_len"] == L and p["round"] == k and p.get("ok")}
            if len(pair) == 2:
                tput.append(pair["masked"]["tokens_per_s"] / pair["plain"]["tokens_per_s"])
                mem.append(pair["masked"]["peak_mem_gb"] / pair["plain"]["peak_mem_gb"])
        ok = [p for p in points if p["seq_len"] == L and p.get("ok")]
        r["paired_rounds"] = len(tput)
        r["tokens_per_s_ratio_masked_over_plain"] = [round(x, 3) for x in tput]
        r["peak_ratio_masked_over_plain"] = [round(x, 4) for x in mem]
        if tput:
            r["tokens_per_s_ratio_geomean"] = round(statistics.geometric_mean(tput), 3)
            r["peak_ratio_geomean"] = round(statistics.geometric_mean(mem), 4)
        for mode in MODES:
            mine = [p for p in ok if p["mode"] == mode]
            if mine:
                r[mode] = {"tokens_per_s": [round(p["tokens_per_s"], 1) for p in mine],
                           "peak_mem_gb": [p["peak_mem_gb"] for p in mine],
                           "tensor_gb": [p.get("tensor_gb") for p in mine],
                           "pred_error": [p.get("pred_error") for p in mine]}
        if ok and ok[0].get("runtime_gb") is not None:
            r["predicted_gb"] = ok[0]["predicted_gb"]
            r["predicted_peak_gb"] = round(ok[0]["predicted_gb"] + ok[0]["runtime_gb"], 4)
            r["masked_within_planner"] = all(p["tensor_gb"] <= p["predicted_gb"] for p in ok if p["mode"] == "masked")
        out[str(L)] = r
    return out


def micro(out: str, sl: int = 16384, rounds: int = 3) -> dict:
    """Attention alone: median fwd+bwd seconds and MiB saved for backward beyond q/k/v, per mode and doc mix."""
    import numpy as np
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from model_utils import attention

    torch.set_num_threads(1)

    class Attn(torch.nn.Module):
        num_key_value_groups, is_causal, training = 2, True, True

    fn = attention.document_masked("sdpa", sdpa_attention_forward)
    torch.manual_seed(0)
    # [bs, h, sl, hd] views of [bs, sl, h, hd] tensors, as Ulysses' all-to-all hands them over
    q, k, v = (torch.randn(1, sl, h, 64).transpose(1, 2).requires_grad_() for h in (2, 1, 1))
    base = {t.untyped_storage().data_ptr() for t in (q, k, v)}

    def saved_mib(pos) -> float:
        seen = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(Attn(), q, k, v, None, position_ids=pos)
        return sum(b for ptr, b in seen.items() if ptr not in base) / 2**20

    result = {"seq_len": sl, "heads_q_kv_hd": [2, 1, 64], "rounds": rounds, "mixes": {}}
    for lo, hi in ((500, 2500), (20, 200)):
        rng = np.random.default_rng(0)
        lens = []
        while sum(lens) < sl:
            lens.append(int(rng.integers(lo, hi + 1)))
        lens[-1] -= sum(lens) - sl
        pos = torch.cat([torch.arange(n) for n in lens])[None]
        modes = [("plain", torch.arange(sl)[None], attention.BLOCK), ("masked_block2048", pos, 2048),
                 ("masked_block512", pos, 512)]
        times: dict[str, list[float]] = {m[0]: [] for m in modes}
        for r in range(rounds):
            for name, p, block in (modes if r % 2 == 0 else modes[::-1]):
                attention.BLOCK = block
                t0 = time.perf_counter()
                o, _ = fn(Attn(), q, k, v, None, position_ids=p)
                o.sum().backward()
                times[name].append(time.perf_counter() - t0)
        mix = {"documents": len(lens)}
        for name, p, block in modes:
            attention.BLOCK = block
            mix[name] = {"median_s": round(statistics.median(times[name]), 3), "runs_s": [round(x, 3) for x in times[name]],
                         "saved_mib_beyond_qkv": round(saved_mib(p), 1)}
        result["mixes"][f"{lo}-{hi}"] = mix
        print(f"documents of {lo}-{hi} tokens ({len(lens)}): " + ", ".join(
            f"{n} {mix[n]['median_s']}s / {mix[n]['saved_mib_beyond_qkv']} MiB" for n, _, _ in modes), flush=True)
    write_json(out, result)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", default="16384,32768")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--baseline_len", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--timeout", type=float, default=1500)
    p.add_argument("--mmap_threshold", type=int, default=65536, help="glibc MALLOC_MMAP_THRESHOLD_ (as bench_memory)")
    p.add_argument("--out", default=result_path("attention.json"))
    p.add_argument("--micro", action="store_true", help="the attention function alone (bench/results/attention_micro.json)")
    a = p.parse_args(argv)
    if a.micro:
        micro(result_path("attention_micro.json"))
        return 0
    lengths = [int(x) for x in a.lengths.split(",")]
    model = bench_model(a.hidden, a.layers)
    work = tempfile.mkdtemp(prefix="bench_attention_")
    data = os.path.join(work, "docs.jsonl")
    lens = write_docs(data, max(lengths) * (a.steps + 2))
    env = {"MALLOC_MMAP_THRESHOLD_": str(a.mmap_threshold)}
    plan = [(a.baseline_len, "plain", 0)]
    for k in range(a.rounds):
        for L in lengths:
            order = list(MODES) if k % 2 == 0 else list(MODES)[::-1]
            plan += [(L, mode, k) for mode in order]
    print(f"{len(plan)} launches of {a.steps} steps at SP={SP}; logs in {work}", flush=True)
    points, t0 = [], time.time()
    try:
        for L, mode, k in plan:
            rec = train_point(model, L, SP, (), a.steps, "cpu", os.path.join(work, f"{mode}_r{k}"), timeout=a.timeout,
                              env=env, extra_args=("--dataset_path", data, "--reset_position_ids", MODES[mode]))
            rec |= {"mode": mode, "round": k, "baseline": L == a.baseline_len and k == 0}
            rec["docs_per_sample_min_mean"] = docs_per_sample(lens, L, a.steps)
            points.append(rec)
            status = (f"{rec['tokens_per_s']:.0f} tok/s, peak {rec['peak_mem_gb']:.3f} GiB" if rec["ok"]
                      else f"FAILED ({rec['error'][:160]})")
            print(f"[{time.time() - t0:5.0f}s] round {k} {mode:<6} L={L:<6}: {status}  (load {rec['load_after']})",
                  flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = {SP: next(p for p in points if p["baseline"])}
    add_baselines(points, base, model)
    runs = [p for p in points if not p["baseline"]]
    import torch
    import transformers

    result = {"model": os.path.basename(model), "sp": SP, "steps": a.steps, "rounds": a.rounds,
              "doc_lengths": "uniform 500-2500 tokens", "malloc_env": env, "sweep_seconds": round(time.time() - t0),
              "machine": {"cpus": os.cpu_count(), "omp_threads_per_rank": 1, "torch": torch.__version__,
                          "transformers": transformers.__version__},
              "command": "python -m bench.attention " + " ".join(argv if argv is not None else sys.argv[1:]),
              "definitions": {"masked": "--reset_position_ids yes (document-masked attention)",
                              "plain": "--reset_position_ids no (one causal sdpa call per sample)",
                              "tensor_gb": "peak_mem_gb - runtime_gb (bench.memory): comparable with predicted_gb",
                              "predicted_peak_gb": "predicted_gb + runtime_gb"},
              "baseline": base[SP], "points": runs, "summary": summarize(runs, lengths)}
    write_json(a.out, result)
    plot(result, os.path.splitext(a.out)[0] + ".png")
    for L, r in result["summary"].items():
        print(f"L={L}: masked/plain tokens/s per round {r['tokens_per_s_ratio_masked_over_plain']} (geomean "
              f"{r.get('tokens_per_s_ratio_geomean')}), peak per round {r['peak_ratio_masked_over_plain']}; planner "
              f"{r.get('predicted_gb')} GiB vs masked tensor_gb {r.get('masked', {}).get('tensor_gb')} "
              f"(within: {r.get('masked_within_planner')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
