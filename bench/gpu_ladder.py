"""The GPU check's ladder (bench/gpu.py's `ladder` section): the model at SP=1, bf16, ZeRO-3 + CPU offload of params
and optimizer, in ONE train.py launch whose stages are the rungs (one model load; an out-of-memory rung ends the
launch after the rungs below it were recorded): the throughput rungs under `memory_features: auto` for the card the cap
stands for (train.py's own choice, head chunks included, read back from the run's `memory_choice` records), then the
planner's longest length with every memory feature on and one rung above it. Rungs whose predicted time does not fit
the budget left are dropped (the first one runs whenever the ladder does)."""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import threading

from bench import harness as bm

K = 1024
# (length, steps) of the throughput rungs; the dry run's stand-ins keep the shape of the plan at CPU sizes
# (512k: the MFU goal's length, issue 49)
THROUGHPUT = {"gpu": [(128 * K, 3), (256 * K, 2), (512 * K, 2)], "dry": [(256, 2)]}
LADDER_STEP = {"gpu": 64 * K, "dry": 512}
LEANEST = {"tiled_mlp": True, "tiled_logits": True, "gradient_checkpointing": True, "offload_activations": True}
OFFLOADS = {"zero_optimization": {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}}
GiB = 2**30


def load_layers(model: str) -> int:
    from planner.memory_model import load_shape

    return load_shape(model).num_layers


def auto_features(model: str, length: int, device: str, cap_gib: float) -> dict:
    """What memory_features auto picks for one rank at `length` with cap_gib usable (the planner's chooser with both
    ZeRO-3 offloads held on); {} when nothing fits (the rung is dropped: the launch would refuse it)."""
    from planner import auto_features as af
    from planner.memory_model import Features, load_shape

    shape = load_shape(model)
    offloads = Features(offload_params=True, offload_optimizer=True, lean_rmsnorm=True, lean_mlp=True)
    try:
        c = af.choose(shape, length, 1, int(cap_gib * GiB), sp=1, offloads=offloads, device=device,
                      precision="bf16" if device == "cuda" else "fp32", ranks_per_node=1)
    except ValueError:
        return {}
    f = c.features
    return {"tiled_mlp": f.tiled_mlp, "tiled_logits": f.tiled_logits, "checkpoint_every": f.every,
            "offload_activations": f.offload_activations, "attention_head_chunks": f.attention_head_chunks}


def predicted_gib(model: str, length: int, feats: dict, device: str) -> float:
    from planner.memory_model import load_shape, predict_peak_bytes

    spec = {"lean_rmsnorm": True, "lean_mlp": True, "offload_params": True, "offload_optimizer": True, **feats}
    return predict_peak_bytes(load_shape(model), length, 1, spec, precision="bf16" if device == "cuda" else "fp32",
                              device=device) / GiB


def planner_longest(model: str, feats: dict, device: str, cap_gib: float, step: int) -> int:
    """Longest multiple of `step` whose predicted peak fits cap_gib (the peak grows with the length)."""
    from planner.cluster import longest_multiple

    return longest_multiple(lambda n: predicted_gib(model, n, feats, device) <= cap_gib, step, 1 << 26)


def stage_yaml(name: str, length: int, steps: int, feats: dict | str) -> str:
    mf = feats if isinstance(feats, str) else "{" + ", ".join(f"{k}: {json.dumps(v)}" for k, v in feats.items()) + "}"
    return (f"  - {{name: {name}, max_seq_length: {length}, max_steps: {steps}, memory_features: {mf},\n"
            f"     deepspeed_overrides: {json.dumps(OFFLOADS)}, eval: {{passkey_trials: 0, heldout_samples: 0}}}}\n")


def _prune(root: str, stop: threading.Event, gone: list[str], every_s: float = 1.0) -> None:
    """Delete, while the launch runs, every committed checkpoint but the newest (the one LATEST names): each rung is
    a stage and every stage's final checkpoint is kept for good, ~21 GB at Llama-3-8B's width and 2 layers, so five
    rungs overflow the device's 64 GiB disk (the 2026-11-28 ladder died in its fourth write). The next stage has
    loaded the newest at its start and nothing reads an older one; a folder without its manifest is being written
    and is left alone, and so is one newer than LATEST (its manifest is written before LATEST moves to it: a pruner
    that deleted every folder but LATEST's once took the newest stage's checkpoint in that window, under a loaded
    make test). `gone` receives the folders deleted."""
    while True:
        done = stop.is_set()
        try:
            with open(os.path.join(root, "LATEST")) as fh:
                newest = fh.read().strip()
            names = os.listdir(root)
        except OSError:
            names, newest = [], None
        top = _step(newest) if newest else None
        for name in names:
            path, step = os.path.join(root, name), _step(name)
            if (top is not None and step is not None and step < top
                    and os.path.exists(os.path.join(path, "MANIFEST.json"))):
                shutil.rmtree(path, ignore_errors=True)
                gone.append(name)
        if done:  # the pass after the launch ended has run: the last stage's LATEST seen
            return
        stop.wait(every_s)


def _step(name: str) -> int | None:
    """The step of a checkpoint folder's name (step_000012 -> 12); None for anything else."""
    head, _, num = name.partition("_")
    return int(num) if head == "step" and num.isdigit() else None


def _read_json(path: str) -> dict | None:
    """A rank's kernel counts (None where its exit did not write them: a killed launch)."""
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def flops(model: str, length: int) -> float:
    from planner.flops import flops_per_sequence
    from planner.memory_model import load_shape

    return flops_per_sequence(load_shape(model), length)


def ladder(rec, model: str, device: str, dry: bool, cap_gib: float, work: str, peak: float | None,
           timeout: float, gpu_mem_gb: float) -> dict:
    from planner.auto_features import gpu_budget

    kind = "dry" if dry else "gpu"
    if dry:  # a cap that the tiny model reaches at ~2k tokens, so the dry ladder ends where the GPU one would
        cap_gib = round(predicted_gib(model, 2304, LEANEST, device), 4)
    # train.py's auto plans for the card the cap stands for (--gpu_mem_gb 80: (80 - 2) x 0.9 usable); the dry run's
    # CPU stand-in plans under the tiny cap
    plan_gib = cap_gib if dry else gpu_budget(gpu_mem_gb) / GiB
    rungs = [dict(length=n, steps=s, kind="throughput", features=auto_features(model, n, device, plan_gib))
             for n, s in THROUGHPUT[kind]]
    longest = planner_longest(model, LEANEST, device, cap_gib, LADDER_STEP[kind])
    top = max(longest // LADDER_STEP[kind] * LADDER_STEP[kind], rungs[-1]["length"] + LADDER_STEP[kind])
    rungs += [dict(length=n, steps=1, kind="ladder", features=dict(LEANEST)) for n in (top, top + 2 * LADDER_STEP[kind])]
    for r in rungs:
        r["predicted_gib"] = round(predicted_gib(model, r["length"], r["features"], device), 2) if r["features"] else None
    # keep the rungs whose predicted time fits: 1.5 min of start-up and engine builds, then the steps at 40% MFU
    # (recompute included) - checked again against the measured rate once the throughput rungs have run
    budget = timeout - (30 if dry else 75)
    kept = []
    for r in rungs:
        est = r["steps"] * flops(model, r["length"]) * 4 / 3 / (0.4 * (peak or 989.0) * 1e12) + (5 if dry else 15)
        if dry or budget - est > 0 or r is rungs[0]:  # the first rung always: the launch's own check
            kept.append(r)
            budget -= est
    dropped = [r["length"] for r in rungs if r not in kept]
    rungs = [r for r in kept if r["features"] or r["kind"] == "ladder"]
    rec.say(f"ladder: rungs {[r['length'] for r in rungs]} (planner's longest with every feature under "
            f"{cap_gib} GiB: {longest:,}; dropped for time: {dropped})")
    out = os.path.join(work, "ladder")
    os.makedirs(out, exist_ok=True)
    cfg = os.path.join(work, "ladder.yaml")
    with open(cfg, "w") as fh:
        fh.write("stages:\n" + "".join(stage_yaml(f"L{r['length']}", r["length"], r["steps"],
                                                   "auto" if r["kind"] == "throughput" else r["features"])
                                       for r in rungs))
    env = bm.bench_env(device)
    kernels = os.path.join(work, "ladder_kernels")  # the attention kernels the rungs ran (bench/gpu_site)
    env.update(BENCH_GPU_KERNELS=kernels,
               PYTHONPATH=os.pathsep.join([os.path.join(bm.ROOT, "bench", "gpu_site"), env["PYTHONPATH"]]))
    if not dry:  # the allocator cap (bench/gpu_site/sitecustomize.py) in the ranks
        env.update(BENCH_GPU_CAP_GIB=str(cap_gib))
    cmd = [*bm.launcher(), "--num_gpus", "1", "--master_port", str(bm.free_port()), "train.py", "--config", cfg,
           "--model_name_or_path", model, "--sequence_parallel_size", "1", "--output_dir", out,
           "--report_to", "none", "--no-export_hf", "--save_steps", "0", "--resume", "none", "--no-progress_bar",
           "--learning_rate", "1e-5", "--warmup_steps", "0", "--reset_position_ids", "no", "--from_scratch", "--memory_features",
           "manual", "--dist_timeout_s", "600"] + (["--mem_cap_gb", "8"] if dry else ["--gpu_mem_gb", str(gpu_mem_gb)])
    log = os.path.join(work, "ladder.log")
    stop, pruned = threading.Event(), []
    pruner = threading.Thread(target=_prune, args=(os.path.join(out, "checkpoints"), stop, pruned), daemon=True)
    pruner.start()
    try:
        code, wall = bm.launch(cmd, env, log, max(timeout, 60))
    finally:
        stop.set()
        pruner.join()
    records = bm.read_metrics(out)
    steps = bm.read_steps(out, records)
    chosen = {e["stage"]: e for e in records if e.get("event") == "memory_choice"}
    for i, r in enumerate(rungs):  # what train.py's auto chose for the throughput rungs, as the run recorded it
        if r["kind"] == "throughput" and i in chosen:
            r["features"] = {k: chosen[i].get(k) for k in r["features"]}
            r["predicted_gib"] = chosen[i].get("predicted_peak_gb")
    with open(log, errors="replace") as fh:
        text = fh.read()
    oom = bool(re.search(r"OutOfMemoryError|CUDA out of memory|out of memory", text))
    result = {"model": os.path.basename(model), "layers": load_layers(model), "cap_gib": cap_gib, "planner_longest_leanest": longest,
              "exit_code": code, "wall_s": round(wall, 1), "dropped_for_time": dropped, "pruned_checkpoints": pruned,
              "rungs": [], "attention_kernels": _read_json(kernels + ".rank0.json"),
              # each stage end's release (training/stage.py): `alive` 0 = no engine left behind for the next rung
              "engine_released": [{k: e.get(k) for k in ("stage", "alive", "host_rss_gb")}
                                  for e in records if e.get("event") == "engine_released"]}
    for r in rungs:
        mine = [s for s in steps if s["seq_len"] == r["length"]]
        row = {**r, "steps_done": len(mine)}
        if len(mine) >= r["steps"]:
            tps = statistics.median(s["tokens_per_s"] for s in (mine[1:] or mine))
            row.update(fits=True, tokens_per_s=round(tps, 1), peak_gib=round(max(s["peak_mem_gb"] for s in mine), 2),
                       step_s=[round(s["seq_len"] / s["tokens_per_s"], 2) for s in mine])
            if peak:
                row["mfu"] = round(tps * flops(model, r["length"]) / r["length"] / (peak * 1e12), 4)
            if row.get("predicted_gib"):
                row["measured_over_predicted"] = round(row["peak_gib"] / row["predicted_gib"], 3)
        else:
            row.update(fits=False, why="out of memory" if oom and code != 0 else
                       ("time limit" if code == -9 else bm.launch_failure(log)["error"]))
            result["rungs"].append(row)
            break  # the launch ended here
        result["rungs"].append(row)
    if code != 0 and not oom:
        result["log_tail"] = bm.launch_failure(log)["log_tail"]
    rec.say(f"  attention kernels: {result['attention_kernels']}")
    for e in result["engine_released"]:
        rec.say(f"  stage {e['stage']} released: engines alive {e['alive']}, host RSS {e['host_rss_gb']} GiB")
    for row in result["rungs"]:
        rec.say(f"  {row['length']:>8} {row['kind']:<10} fits={row['fits']} tok/s={row.get('tokens_per_s')} "
                f"mfu={row.get('mfu')} peak={row.get('peak_gib')} predicted={row.get('predicted_gib')}")
    return result

