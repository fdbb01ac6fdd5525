"""Evaluation's own memory next to a training step's, per rank, on CPU (2 ranks, SP=2), and what sets the
whole-run peak.

    python -m bench.eval_memory            # bench/results/eval_memory.json + eval_memory.png, a table
    python -m bench.eval_memory --quick    # a smaller shape, for a smoke check
    python -m bench.eval_memory --report bench/results/eval_memory.json   # the table again from saved results
    MALLOC_MMAP_THRESHOLD_=65536 python -m bench.eval_memory --ce_layout   # one tile's cross-entropy

Each configuration is one 2-rank launch (bench/harness.py's spawn: plain subprocesses) of this file's worker, which
builds the real engine (training.engine.build_engine: ZeRO-3 with both CPU offloads, ds_configs/
zero3_offload.json, fp32) over a Llama of small hidden size and a large vocabulary, then runs phases in order:
three training steps (training.step.train_step with the loss train.py uses), the evaluation train.py runs
(training.evaluation.sample_stats -> model_utils/tiled_loss.eval_stats) and the old evaluation (the whole
`[bs, sl_local, vocab]` logits: engine(...).logits.float(), then cross-entropy and argmax), both twice,
alternating, then a fourth training step. Per phase and rank:

    peak above start = VmHWM after the phase - VmRSS at its start,

with VmHWM reset at the start of the phase by writing "5" to /proc/self/clear_refs (Linux >= 4.0; checked in
every run); every rank runs with glibc MALLOC_MMAP_THRESHOLD_=65536 (as bench/memory.py), so blocks
of 64 KiB and more are returned to the OS when freed and RSS follows live tensors. The first training step also
allocates the Adam moments, so the training-step figure compared is the largest of steps 2-4; an evaluation's
figure is the larger of its two runs. The absolute peak RSS of each phase is compared too.

Target: evaluation's peak <= the training step's, with and without --tiled_logits. With the real tile size
(LOGITS_TILE_BYTES = 1 GiB) a shard of a thousand tokens is one tile, so tiled evaluation holds the same logits
as the old one; `--tile_mib` scales the tile down so that one shard is many tiles, as at the target scale
(Llama 3, 128k tokens, SP=2: 31 GiB of logits per shard = 32 tiles of 1 GiB). A small-vocabulary launch at
the same length separates what the vocabulary costs from the rest of the whole-run peak (the RSS after
imports, after the process group, after the engine build, after the first step, after the evaluations).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import sys
import tempfile
import time

from bench.harness import ROOT, bench_model, result_path, run

MiB = 2**20
MMAP_THRESHOLD = "65536"
TRAIN_STEPS = ("train step 2", "train step 3", "train step 4")
EVAL_TILED = ("eval (tiled, train.py's)", "eval (tiled, train.py's) 2")
EVAL_FULL = ("eval (full logits, old)", "eval (full logits, old) 2")


# --- measuring one process ------------------------------------------------------------------------------

def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        return int(re.search(rf"^{field}:\s+(\d+) kB", fh.read(), re.M).group(1))


def reset_peak() -> None:
    """VmHWM := VmRSS (Linux: "5" to clear_refs resets the peak resident set size)."""
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def peak_reset_works() -> bool:
    """Touch and free 64 MiB, reset: the peak must fall back below it."""
    import numpy as np

    a = np.ones(64 * MiB // 8)
    del a
    before = _status_kib("VmHWM")
    reset_peak()
    return _status_kib("VmHWM") < before - 32 * 1024


def measure(name: str, fn, log: list[dict]):
    """Run fn() as one phase (ranks aligned by a barrier first); record MiB at start, peak and end."""
    from base import comm

    gc.collect()
    comm.barrier()
    reset_peak()
    start = _status_kib("VmRSS")
    t0 = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - t0
    peak, end = _status_kib("VmHWM"), _status_kib("VmRSS")
    log.append({"phase": name, "start_mib": start / 1024, "peak_mib": peak / 1024, "end_mib": end / 1024,
                "peak_above_start_mib": (peak - start) / 1024, "seconds": round(seconds, 3)})
    return out


# --- worker: one configuration on one rank ----------------------------------------------------------------

def worker(case: dict) -> None:
    import numpy as np
    import torch
    import torch.nn.functional as F

    import model_utils.tiled_loss as tiled_loss
    from base import comm
    from base.parallel import init_distributed
    from data.sharding import collate, shard
    from model_utils.build import load_hf_config
    from model_utils.memory import make_loss_fn
    from training.config import config_from_dict
    from training.engine import build_engine, features_of
    from training.evaluation import sample_stats
    from training.step import train_step

    marks = {"imports_mib": _status_kib("VmRSS") / 1024}
    tiled_loss.LOGITS_TILE_BYTES = case["tile_mib"] * MiB
    cfg = config_from_dict({"model_name_or_path": case["model"], "max_seq_length": case["seq_len"],
                            "sequence_parallel_size": 2, "learning_rate": 1e-4, "max_steps": 10, "report_to": "none",
                            "seed": 0, "tiled_logits": case["tiled_logits"],
                            "deepspeed": os.path.join(ROOT, "ds_configs/zero3_offload.json")})
    hf = load_hf_config(cfg.model_name_or_path)
    dims = init_distributed(cfg.sequence_parallel_size, timeout_s=600)
    marks["init_mib"] = _status_kib("VmRSS") / 1024
    phases: list[dict] = []
    engine = measure("engine build", lambda: build_engine(cfg, dims, hf, "sdpa", bf16=False, seed=0), phases)
    marks["engine_mib"] = _status_kib("VmRSS") / 1024

    rng = np.random.default_rng(0)
    vocab = hf.get_text_config().vocab_size

    def sample() -> dict:
        ids = rng.integers(0, vocab, case["seq_len"] + 1)
        return {"input_ids": ids[:-1], "shift_labels": ids[1:], "position_ids": np.arange(case["seq_len"])}

    samples = [sample() for _ in range(4)]
    loss_fn = make_loss_fn(features_of(cfg))

    def step(i):
        return lambda: train_step(engine, [shard(collate([samples[i]], 2, 0), 2, dims.sp_rank)], dims.world,
                                  loss_fn=loss_fn)

    for i in range(3):
        measure(f"train step {i + 1}", step(i), phases)
        marks[f"after_step{i + 1}_mib"] = _status_kib("VmRSS") / 1024

    def eval_tiled():
        engine.eval()
        out = sample_stats(engine, samples[3:], dims, 1, 0)
        engine.train()
        return out

    def eval_full():  # the old way: the whole [bs, sl_local, vocab] logits of the shard
        engine.eval()
        mb = shard(collate(samples[3:], 2, 0), 2, dims.sp_rank)
        with torch.no_grad():
            logits = engine(input_ids=mb["input_ids"], position_ids=mb["position_ids"], use_cache=False).logits.float()
            y = mb["shift_labels"]
            ce = F.cross_entropy(logits.transpose(1, 2), y, ignore_index=-100, reduction="none")
            stats = torch.stack([ce.sum(1).double(), (y != -100).sum(1).double(),
                                 ((logits.argmax(-1) != y) & (y != -100)).sum(1).double()], 1)
        engine.train()
        return comm.all_reduce(stats)

    # twice, alternating: the first evaluation also leaves the embedding and LM head gathered (see docs/memory_model.md)
    tiled = measure(EVAL_TILED[0], eval_tiled, phases)
    full = measure(EVAL_FULL[0], eval_full, phases)
    measure(EVAL_TILED[1], eval_tiled, phases)
    measure(EVAL_FULL[1], eval_full, phases)
    marks["after_evals_mib"] = _status_kib("VmRSS") / 1024
    measure("train step 4", step(2), phases)
    marks["end_mib"] = _status_kib("VmRSS") / 1024
    assert torch.allclose(tiled, full, rtol=1e-4), (tiled, full)  # the same numbers, only the memory differs
    with open(os.path.join(case["out"], f"rank{dims.rank}.json"), "w") as fh:
        json.dump({"phases": phases, "marks": marks, "tiles": tiled_loss.logits_tiles(1, case["seq_len"] // 2, vocab),
                   "peak_reset_works": peak_reset_works()}, fh)
    engine.destroy()
    comm.barrier()


def ce_layout(tokens: int = 1024, vocab: int = 128256) -> dict:
    """Peak above start of cross_entropy(reduction="none") over one [1, tokens, vocab] fp32 tile without autograd,
    as tiled_loss._stats calls it ([bs, V, tile], transposed) and flattened ([bs*tile, V]); alternated, twice."""
    import torch
    import torch.nn.functional as F

    y = torch.randint(0, vocab, (1, tokens))
    out: dict[str, list[float]] = {"transposed": [], "flattened": []}
    for name in ["transposed", "flattened"] * 2:
        logits = torch.randn(1, tokens, vocab)
        gc.collect()
        reset_peak()
        start = _status_kib("VmRSS")
        with torch.no_grad():
            if name == "transposed":
                ce = F.cross_entropy(logits.transpose(1, 2), y, reduction="none")
            else:
                ce = F.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1), reduction="none")
        out[name].append((_status_kib("VmHWM") - start) / 1024)
        del logits, ce
    return {"logits_mib": tokens * vocab * 4 / MiB, **out}


# --- driver -----------------------------------------------------------------------------------------------

def run_case(case: dict, log_root: str) -> list[dict]:
    os.makedirs(case["out"], exist_ok=True)
    run("bench.eval_memory", ["--worker", json.dumps(case)], 2, os.path.join(log_root, case["name"]),
        timeout=1800, extra_env={"MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD})
    ranks = []
    for r in range(2):
        with open(os.path.join(case["out"], f"rank{r}.json")) as fh:
            ranks.append(json.load(fh))
    return ranks


def summarize(case: dict, ranks: list[dict]) -> dict:
    """Max over ranks of each phase's peak above start and peak RSS; training step: steps 2-4."""
    names = [p["phase"] for p in ranks[0]["phases"]]
    above = {n: max(r["phases"][i]["peak_above_start_mib"] for r in ranks) for i, n in enumerate(names)}
    peak = {n: max(r["phases"][i]["peak_mib"] for r in ranks) for i, n in enumerate(names)}
    out = {k: case[k] for k in ("name", "vocab", "hidden", "layers", "seq_len", "tile_mib", "tiled_logits")}
    out.update(tokens_per_rank=case["seq_len"] // 2, logits_tiles=ranks[0]["tiles"],
               full_logits_mib_per_rank=case["seq_len"] // 2 * case["vocab"] * 4 / MiB,
               peak_above_start_mib=above, phase_peak_rss_mib=peak,
               rss_marks_mib={k: max(r["marks"][k] for r in ranks) for k in ranks[0]["marks"]},
               whole_run_peak_mib=max(peak.values()))
    for key, group in (("train_step", TRAIN_STEPS), ("eval_tiled", EVAL_TILED), ("eval_full", EVAL_FULL)):
        out[f"{key}_mib"] = max(above[n] for n in group)
        out[f"{key}_peak_rss_mib"] = max(peak[n] for n in group)
    out["eval_tiled_steady_mib"], out["eval_full_steady_mib"] = above[EVAL_TILED[1]], above[EVAL_FULL[1]]
    out["eval_within_train"] = (out["eval_tiled_mib"] <= out["train_step_mib"]
                                and out["eval_tiled_peak_rss_mib"] <= out["train_step_peak_rss_mib"])
    out["peak_reset_works"] = all(r["peak_reset_works"] for r in ranks)
    out["per_rank"] = ranks
    return out


def predicted(case: dict) -> dict:
    """planner.memory_model's eval phase for the case (MiB, fp32), and what the first evaluation adds on CPU:
    ZeRO-3 leaves the embedding and the LM head gathered after it (2 V h fp32), until the next training step."""
    from planner.memory_model import ModelShape, eval_phase_bytes

    shape = ModelShape(vocab_size=case["vocab"], hidden_size=case["hidden"],
                       intermediate_size=round(case["hidden"] * 2.6875), num_layers=case["layers"], num_heads=4,
                       num_kv_heads=2, head_dim=case["hidden"] // 4)
    kept = 2 * 4 * shape.vocab_size * shape.hidden_size / MiB
    tiled = eval_phase_bytes(shape, case["seq_len"], 2, 4, tiled=True, tile_bytes=case["tile_mib"] * MiB) / MiB
    full = eval_phase_bytes(shape, case["seq_len"], 2, 4, tiled=False) / MiB
    return {"eval_tiled_mib": tiled, "eval_full_mib": full, "first_eval_keeps_gathered_mib": kept}


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    big = [r for r in results if r["name"] != "small-vocab"]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.27
    xs = range(len(big))
    for k, (key, label) in enumerate([("train_step_mib", "training step (max of steps 2-4)"),
                                      ("eval_tiled_mib", "evaluation (tiled, as train.py runs it)"),
                                      ("eval_full_mib", "evaluation with the whole logits (old)")]):
        ax.bar([x + (k - 1) * width for x in xs], [r[key] for r in big], width, label=label)
    ax.set_xticks(list(xs), [f"{'--tiled_logits' if r['tiled_logits'] else 'untiled loss'}\ntile {r['tile_mib']} MiB "
                             f"({r['logits_tiles']} tile{'s' if r['logits_tiles'] > 1 else ''})" for r in big])
    r0 = big[0]
    ax.set(ylabel="peak RSS above the phase's start (MiB, max over ranks)",
           title=f"SP=2, {r0['tokens_per_rank']} tokens/rank, vocab {r0['vocab']}, hidden {r0['hidden']}: "
                 f"full logits {r0['full_logits_mib_per_rank']:.0f} MiB/rank")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report(results: list[dict], out: str, command: str) -> int:
    for r in results:
        r["predicted_mib"] = predicted(r)
    with open(out, "w") as fh:
        json.dump({"command": command, "mmap_threshold": int(MMAP_THRESHOLD),
                   "measure": "per phase: VmHWM after (reset at start via /proc/self/clear_refs) - VmRSS at start, "
                              "max over the 2 ranks", "results": results}, fh, indent=1)
    plot(results, out.replace(".json", ".png"))
    r0 = results[0]
    print(f"\nMiB above each phase's start, max over ranks (SP=2, {r0['tokens_per_rank']} tokens/rank, vocab "
          f"{r0['vocab']}); eval: max of 2 runs (2nd run alone in brackets), pred: memory_model eval phase")
    print(f"{'configuration':<26}{'tiles':>6}{'train':>7}{'eval':>12}{'pred':>6}{'old eval':>13}{'pred':>6}"
          f"{'ok':>4}   peak RSS: {'train':>6}{'eval':>6}{'old':>6}")
    for r in results:
        p = r["predicted_mib"]
        print(f"{r['name']:<26}{r['logits_tiles']:>6}{r['train_step_mib']:>7.0f}"
              f"{r['eval_tiled_mib']:>6.0f} ({r['eval_tiled_steady_mib']:>4.0f}){p['eval_tiled_mib']:>6.0f}"
              f"{r['eval_full_mib']:>7.0f} ({r['eval_full_steady_mib']:>4.0f}){p['eval_full_mib']:>6.0f}"
              f"{'yes' if r['eval_within_train'] else 'NO':>4}   {'':>10}{r['train_step_peak_rss_mib']:>6.0f}"
              f"{r['eval_tiled_peak_rss_mib']:>6.0f}{r['eval_full_peak_rss_mib']:>6.0f}")
    print("\nwhole-run RSS (MiB, max over ranks): imports, process group, engine built, after step 1, after the "
          "evaluations, whole-run peak")
    for r in results:
        m = r["rss_marks_mib"]
        print(f"{r['name']:<26}{m['imports_mib']:>8.0f}{m['init_mib']:>8.0f}{m['engine_mib']:>8.0f}"
              f"{m['after_step1_mib']:>8.0f}{m['after_evals_mib']:>8.0f}{r['whole_run_peak_mib']:>8.0f}")
    print(f"peak reset via clear_refs works: {all(r['peak_reset_works'] for r in results)}")
    print(f"wrote {out} and {out.replace('.json', '.png')}")
    return 0 if all(r["eval_within_train"] for r in results) else 1


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(json.loads(sys.argv[2]))
        return 0
    if sys.argv[1:] == ["--ce_layout"]:  # run with MALLOC_MMAP_THRESHOLD_=65536 in the environment
        print(json.dumps(ce_layout()))
        return 0
    if len(sys.argv) > 2 and sys.argv[1] == "--report":  # re-derive the summary and table from a saved JSON
        with open(sys.argv[2]) as fh:
            saved = json.load(fh)
        return report([summarize(r, r["per_rank"]) for r in saved["results"]], sys.argv[2], saved["command"])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq_len", type=int, default=2048, help="tokens per sample; SP=2, so half per rank")
    p.add_argument("--tile_mib", type=int, default=32, help="the scaled-down logits tile (MiB of fp32 logits)")
    p.add_argument("--small_vocab", type=int, default=2048, help="vocabulary of the breakdown launch")
    p.add_argument("--quick", action="store_true", help="seq_len 512, vocab 32000: a smoke run")
    p.add_argument("--out", default=result_path("eval_memory.json"))
    a = p.parse_args()
    if a.quick:
        a.seq_len, a.vocab = 512, 32000
        a.out = a.out.replace(".json", "_quick.json")
    real_tile = 2**30 // MiB
    configs = [("tile1GiB-untiled", a.vocab, real_tile, False), ("tile1GiB-tiled_logits", a.vocab, real_tile, True),
               (f"tile{a.tile_mib}MiB-untiled", a.vocab, a.tile_mib, False),
               (f"tile{a.tile_mib}MiB-tiled_logits", a.vocab, a.tile_mib, True),
               ("small-vocab", a.small_vocab, real_tile, False)]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, vocab, tile, tiled in configs:
            case = {"name": name, "model": bench_model(a.hidden, a.layers, 4, 2, vocab), "vocab": vocab,
                    "hidden": a.hidden, "layers": a.layers, "seq_len": a.seq_len, "tile_mib": tile,
                    "tiled_logits": tiled, "out": os.path.join(tmp, name)}
            t0 = time.time()
            r = summarize(case, run_case(case, os.path.join(tmp, "logs")))
            results.append(r)
            print(f"{name}: train {r['train_step_mib']:.0f} MiB, eval tiled {r['eval_tiled_mib']:.0f}, "
                  f"eval full {r['eval_full_mib']:.0f} ({time.time() - t0:.0f}s)", flush=True)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    return report(results, a.out, " ".join(["python -m bench.eval_memory", *sys.argv[1:]]))


if __name__ == "__main__":
    sys.exit(main())
