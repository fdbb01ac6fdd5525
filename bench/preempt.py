"""Preemption, measured end to end: SIGTERM to every rank of a running 2-rank train.py until both have exited
with 75, and what it means for Llama-3-8B on a cluster.

    python -m bench.preempt [--hidden 1024 --layers 16 --rounds 2] [--project llama3-8b --world 32 --per_node 8]

The ranks are plain subprocesses (bench/harness.py's spawn: what scripts/launch.sh does, it signals the
ranks directly), ZeRO-3 with both CPU offloads, fp32, SP=2, on a Llama of the given hidden size and depth
(saved once under .cache/bench_models). Each round starts a fresh run, waits until `--after` steps are logged,
waits a random fraction of a step more (so the signal lands anywhere inside a step), sends SIGTERM to both
ranks and times until both have exited. Per round it records:
- step time (the median logged step time), the signal's position inside the step in flight,
- the save time train.py prints ("saved ... in Xs": DeepSpeed's files with CRC32 computed while writing,
  fsync, the manifest and LATEST commit) and the checkpoint's size, so the write throughput per node,
- stop-to-exit: SIGTERM to the last rank's exit. It is the rest of the step in flight (the flag is agreed by an
  all-reduce after the step) + the save + tearing down (engine destroy, process group, interpreter exit);
  the split comes from the millisecond timestamps of rank 0's log (the step's line, the "saved" line).

The projection scales the save to Llama-3-8B (bytes per parameter as measured here: ZeRO-3 writes the fp32
partition and Adam's two moments, 12 bytes per parameter, and no 16-bit weights, in a bf16 run too) on `--world` ranks,
`--per_node` per node, assuming every node writes at the throughput measured here (node-local disk, or a
parallel file system whose aggregate bandwidth scales with the nodes), and adds the measured non-save
overhead and one step of the target run (an input, `--target_step_s`) to compare with SLURM's
`--signal=B:USR1@120` warning.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time

from bench.harness import ROOT, bench_model, result_path, spawn, write_json

MB = 1e6


def _metrics(out: str) -> list[dict]:
    p = os.path.join(out, "metrics.jsonl")
    if not os.path.exists(p):
        return []
    with open(p) as fh:
        return [json.loads(x) for x in fh if x.strip() and '"loss"' in x]


def step_seconds(recs: list[dict]) -> list[float]:
    """Each trained step's seconds from its record. A step skipped for want of a supervised token (optimizer_skipped)
    logs tokens_per_s null and 0 tokens: it has no step time (was a TypeError here)."""
    return [r["tokens"] / r["tokens_per_s"] for r in recs if r.get("tokens_per_s") and r.get("tokens")]


def _stamp(line: str) -> float:
    """Epoch seconds of a rank-log line ("2026-11-24 10:43:15,531 rank0 INFO ..."; local time, like asctime)."""
    day, clock = line.split()[:2]
    return time.mktime(time.strptime(f"{day} {clock[:8]}", "%Y-%m-%d %H:%M:%S")) + int(clock[9:12]) / 1000


def one_round(model: str, seq_len: int, after: int, tmp: str, rng: random.Random) -> dict:
    out = os.path.join(tmp, "run")
    shutil.rmtree(out, ignore_errors=True)
    args = ["--model_name_or_path", model, "--max_seq_length", str(seq_len), "--sequence_parallel_size", "2",
            "--max_steps", "100000", "--output_dir", out, "--report_to", "none", "--no-export_hf",
            "--no-progress_bar", "--learning_rate", "1e-5", "--seed", "0"]
    logs = os.path.join(tmp, "logs")
    procs = spawn(os.path.join(ROOT, "train.py"), args, 2, logs)
    try:
        while len(_metrics(out)) < after:
            if any(p.poll() is not None for p in procs):
                raise RuntimeError(f"train.py exited early: {[p.poll() for p in procs]}; see {logs}")
            time.sleep(0.05)
        recs = _metrics(out)
        step_times = step_seconds(recs[1:])  # the first step allocates Adam states
        step_s = statistics.median(step_times or [0.0])
        since_log = time.time() - recs[-1]["time"]
        time.sleep(max(0.0, rng.uniform(0, step_s) - since_log))
        t0 = time.time()
        into_step = t0 - _metrics(out)[-1]["time"]
        for p in procs:
            p.send_signal(signal.SIGTERM)
        exits = [None, None]
        while any(e is None for e in exits):
            for i, p in enumerate(procs):
                if exits[i] is None and p.poll() is not None:
                    exits[i] = time.time() - t0
            time.sleep(0.01)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    codes = [p.returncode for p in procs]
    with open(os.path.join(logs, "rank0.log")) as fh:
        m = re.findall(r"saved (\S+) in ([0-9.]+)s", fh.read())
    if codes != [75, 75] or not m:
        raise RuntimeError(f"exit codes {codes} (expected 75), save lines {m}; see {logs}")
    ck, save_s = m[-1][0], float(m[-1][1])
    # the timeline from rank 0's own log (train.py's OUTPUT_DIR/logs, ms timestamps): end of the step in flight,
    # end of the save; then the exit seen here
    with open(os.path.join(out, "logs", "rank00000.log")) as fh:
        lines = fh.read().splitlines()
    step_end = max(_stamp(ln) for ln in lines if re.search(r"rank0 INFO step \d+ stage", ln))
    saved_at = max(_stamp(ln) for ln in lines if " INFO saved " in ln)
    size = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(ck) for f in fs)
    final = _metrics(out)
    return {"step_s": round(step_s, 3), "step_times_s": [round(x, 3) for x in step_times],
            "signal_into_step_s": round(into_step, 3), "steps_at_signal": len(recs), "steps_done": len(final),
            "save_s": save_s, "checkpoint_bytes": size, "stop_to_exit_s": round(max(exits), 3),
            "signal_to_step_end_s": round(step_end - t0, 3), "step_end_to_saved_s": round(saved_at - step_end, 3),
            "saved_to_exit_s": round(max(exits) - (saved_at - t0), 3),
            "exit_s_per_rank": [round(x, 3) for x in exits], "exit_codes": codes,
            "node_MBps": round(size / save_s / MB, 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--after", type=int, default=3, help="logged steps before the signal")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--project", default="llama3-8b", help="preset whose preemption to project")
    p.add_argument("--world", type=int, default=32)
    p.add_argument("--per_node", type=int, default=8)
    p.add_argument("--target_step_s", type=float, default=30.0,
                   help="step time of the target run (worst case: the whole step is still to run)")
    p.add_argument("--window_s", type=float, default=120.0, help="SLURM --signal=B:USR1@N warning")
    p.add_argument("--out", default=result_path("preempt.json"))
    p.add_argument("--report", action="store_true", help="redo the projection from --out's saved rounds")
    a = p.parse_args()
    if a.report:
        with open(a.out) as fh:
            return report(json.load(fh), a)

    from transformers import AutoConfig

    from planner.memory_model import ModelShape

    model = bench_model(a.hidden, a.layers, 8, 8, a.vocab)
    n_params = ModelShape.from_config(AutoConfig.from_pretrained(model).to_dict()).num_params()
    rng = random.Random(0)
    rounds = []
    with tempfile.TemporaryDirectory(dir=os.path.join(ROOT, "checkpoints") if os.path.isdir(
            os.path.join(ROOT, "checkpoints")) else None) as tmp:
        for i in range(a.rounds):
            r = one_round(model, a.seq_len, a.after, tmp, rng)
            rounds.append(r)
            print(f"round {i + 1}: step {r['step_s']}s, signal {r['signal_into_step_s']}s into the step, save "
                  f"{r['save_s']}s ({r['checkpoint_bytes'] / 2**30:.2f} GiB, {r['node_MBps']} MB/s), stop-to-exit "
                  f"{r['stop_to_exit_s']}s = {r['signal_to_step_end_s']}s to the step's end + "
                  f"{r['step_end_to_saved_s']}s to the save's end + {r['saved_to_exit_s']}s to exit, exit codes "
                  f"{r['exit_codes']}", flush=True)
    result = {"command": " ".join(["python -m bench.preempt", *sys.argv[1:]]), "params": n_params, "hidden": a.hidden, "layers": a.layers,
              "vocab": a.vocab, "seq_len": a.seq_len, "sp": 2, "precision": "fp32", "rounds": rounds}
    return report(result, a)


def report(result: dict, a: argparse.Namespace) -> int:
    """Medians over the rounds and the projection; writes the JSON and prints the summary."""
    from planner.memory_model import load_shape

    rounds, n_params = result["rounds"], result["params"]
    size = statistics.median(r["checkpoint_bytes"] for r in rounds)
    rate = statistics.median(r["checkpoint_bytes"] / r["save_s"] for r in rounds)  # bytes/s, this node
    # neither the save nor the rest of the step in flight: agreeing the flag, the metrics line, engine teardown,
    # interpreter exit (rank 0's log timestamps)
    other = statistics.median(r["stop_to_exit_s"] - r["save_s"] - r["signal_to_step_end_s"] for r in rounds)
    bpp = size / n_params  # ZeRO-3 saves the fp32 partition + Adam m, v (12 B/param) in fp32 and bf16 runs alike
    big = load_shape(a.project).num_params()
    node_bytes = big * bpp / a.world * a.per_node
    save_big = node_bytes / rate
    proj = {"model": a.project, "params": big, "world": a.world, "per_node": a.per_node,
            "bytes_per_node": node_bytes, "save_s_at_measured_node_rate": round(save_big, 1),
            "target_step_s": a.target_step_s, "teardown_s_measured": round(other, 2),
            "stop_to_exit_worst_s": round(a.target_step_s + save_big + other, 1), "window_s": a.window_s,
            "required_node_MBps_for_window": round(node_bytes / max(1e-9, a.window_s - a.target_step_s - other)
                                                   / MB, 1),
            "assumption": "every node writes its ranks' shards at the per-node rate measured here (node-local "
                          "NVMe, or a parallel file system whose aggregate bandwidth grows with the nodes: 4 nodes "
                          "need 4x this rate in aggregate); the step in flight may have just started (worst case)"}
    result.update(checkpoint_bytes=size, bytes_per_param=round(bpp, 2), node_MBps=round(rate / MB, 1),
                  step_s_median=statistics.median(r["step_s"] for r in rounds),
                  save_s_median=statistics.median(r["save_s"] for r in rounds),
                  stop_to_exit_s_median=statistics.median(r["stop_to_exit_s"] for r in rounds), projection=proj)
    write_json(a.out, result)
    print(f"measured: {n_params / 1e6:.0f}M params, {size / 2**30:.2f} GiB checkpoint, {bpp:.1f} bytes/param, "
          f"{rate / MB:.0f} MB/s for the node (2 ranks, median); step {result['step_s_median']}s, save "
          f"{result['save_s_median']}s, stop-to-exit {result['stop_to_exit_s_median']}s (medians); beyond the "
          f"step's rest and the save: {other:.2f}s")
    print(f"projected: {a.project} on {a.world} ranks ({a.per_node}/node): {node_bytes / 2**30:.1f} GiB per node -> "
          f"save {proj['save_s_at_measured_node_rate']}s at the same rate; worst stop-to-exit with a "
          f"{a.target_step_s:g}s step: {proj['stop_to_exit_worst_s']}s vs the {a.window_s:g}s window (needs "
          f">= {proj['required_node_MBps_for_window']} MB/s per node); wrote {a.out}")
    return 0

if __name__ == "__main__":
    sys.exit(main())
