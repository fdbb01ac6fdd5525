"""The GPU check's long-length launches (bench/gpu.py's headline, long and gap sections, issues 43 and 49): one
train.py launch per call with bench/gpu_probe.py in its rank, its stages' step records and per-segment peaks set
against the planner for the configuration each stage took (bench/gpu_compare.py), and the lengths they run at."""

from __future__ import annotations

import json
import os
import re
import shutil

from bench import harness as bm
from bench.gpu_compare import compare, engagement, planner_phases, read_probe, split_by_time
from bench.gpu_ladder import OFFLOADS, flops, load_layers
from planner.peaks import DENSE_BF16_TFLOPS

GiB = 2**30
PEAK_TFLOPS = dict(DENSE_BF16_TFLOPS)  # dense bf16 by a part of the device name: planner/peaks.py's one table
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                 vocab_size=128256, max_position_embeddings=1 << 21, rope_theta=500000.0, rms_norm_eps=1e-5)
TINY = dict(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2, vocab_size=2048,
            max_position_embeddings=1 << 16, rope_theta=10000.0)
K = 1024
# the 1-GPU headline's per-layer features (plan.py --compare's --alst row), pinned per stage, and its offloads
HEADLINE = {"tiled_mlp": True, "tiled_logits": True, "checkpoint_every": 1, "offload_activations": True,
            "keep_attention": False}


# --- 0. issue 43: one step at 1M tokens, per phase, against the planner --------------------------------------

LONG = {"gpu": 1 << 20, "dry": 2048}  # T = 1,048,576: T x h = 2^32 elements, past int32 indexing (ALST's 555K stop)
LONG_LAYERS = 2  # one layer checkpointed (its recompute) and one that keeps its activations (checkpoint_every 2)
PLAN_GPU_GB = 80.0  # the card plan.py --compare and the issue plan for; the run's own rule: (80 - 2) x 0.9 usable
# the gap near the cap: auto at a budget whose usable memory IS the cap (budget = cap / 0.9 + 2), at the shortest
# of these lengths where auto's predicted peak is within GAP_NEAR of the cap (2 layers at 256k: 77.2 of 78.5 GiB)
GAP_LENGTHS = {"gpu": [256 * K, 320 * K, 384 * K, 512 * K, 640 * K], "dry": [1024, 1536, 2048]}
GAP_NEAR = 0.95
# dry: the CPU stand-in pins what makes every probe path run (a recomputed layer, the tiled MLP, 2 head chunks)
DRY_PINS = {"checkpoint_every": 2, "tiled_mlp": True}
INDEX_ERRORS = r"illegal memory access|invalid configuration argument|numel|int32|2\^31|2147483647|overflow|" \
               r"CUDA error|cuDNN error|CUBLAS_STATUS|index out of bounds|device-side assert"


def stage_pins(name: str, dry: bool) -> dict:
    """A stage's own settings: the headline pins its features and both ZeRO-3 offloads; the dry stand-in pins
    DRY_PINS for the others (on a GPU they are auto's own choice)."""
    if name == "headline":
        return {"memory_features": HEADLINE, "deepspeed_overrides": OFFLOADS}
    return {"memory_features": DRY_PINS} if dry else {}


def long_run(rec, name: str, model: str, device: str, dry: bool, cap_gib: float, work: str,
             stages: list[tuple[str, int]], gpu_mem_gb: float, timeout: float, chunks: int | None = None) -> dict:
    """One train.py launch, one step per stage (name, length) under memory_features auto with the stage's pins
    (stage_pins: the headline's features, or none: the run's own start-up choice at gpu_mem_gb; on the CPU stand-in
    under an 8 GiB cap), `chunks` head chunks where given, the probe in its rank; per stage, the per-phase figures
    against the planner's for the configuration the run took: {stage name: result}. The GPU run launches each
    stage alone (their budgets differ); the dry run puts them in one launch (one start-up in the suite) and splits
    the probe's records at each stage's step record."""
    out = os.path.join(work, name)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    cfg = os.path.join(work, f"{name}.yaml")
    with open(cfg, "w") as fh:
        fh.write("stages:\n" + "".join(
            f"  - {{name: {s}, max_seq_length: {n}, max_steps: 1, "
            + "".join(f"{k}: {json.dumps(v)}, " for k, v in stage_pins(s, dry).items())
            + "eval: {passkey_trials: 0, heldout_samples: 0}}\n" for s, n in stages))
    probe_path = os.path.join(work, f"{name}.phases.jsonl")
    if os.path.exists(probe_path + ".rank0"):
        os.remove(probe_path + ".rank0")
    env = bm.bench_env(device)
    env.update(BENCH_GPU_PHASES=probe_path,
               PYTHONPATH=os.pathsep.join([os.path.join(bm.ROOT, "bench", "gpu_site"), env["PYTHONPATH"]]))
    if not dry:
        env["BENCH_GPU_CAP_GIB"] = str(cap_gib)
    budget = ["--mem_cap_gb", "8", "--attention_head_chunks", "2"] if dry else ["--gpu_mem_gb", str(gpu_mem_gb)] + (
        ["--attention_head_chunks", str(chunks)] if chunks else [])
    cmd = [*bm.launcher(), "--num_gpus", "1", "--master_port", str(bm.free_port()), "train.py", "--config", cfg,
           "--model_name_or_path", model, "--sequence_parallel_size", "1", "--output_dir", out,
           "--report_to", "none", "--no-export_hf", "--save_steps", "0", "--resume", "none", "--no-progress_bar",
           "--learning_rate", "1e-5", "--warmup_steps", "0", "--reset_position_ids", "no", "--from_scratch",
           "--memory_features", "auto", *budget, "--dist_timeout_s", "600"]
    log = os.path.join(work, f"{name}.log")
    rec.say(f"{name}: {', '.join(f'{s} {n:,} tokens' for s, n in stages)}, {os.path.basename(model)}, launch "
            f"(timeout {timeout:.0f} s)")
    code, wall = bm.launch(cmd, env, log, max(timeout, 30))
    records = bm.read_metrics(out)
    probe = read_probe(probe_path + ".rank0")
    with open(log, errors="replace") as fh:
        text = fh.read()
    # the index-overflow class (T x h = 2^32 at 1M): any kernel error text, whether or not the run survived it
    kernel_errors = sorted({ln.strip()[:300] for ln in text.splitlines()
                            if re.search(INDEX_ERRORS, ln) and re.search(r"Error|error|assert|failed", ln)
                            and "Warning" not in ln})[:10]
    stage_steps = [bm.read_steps(out, [r for r in records if r.get("stage") == i]) for i in range(len(stages))]
    parts = split_by_time(probe, stage_steps)
    results = {}
    for i, (stage, length) in enumerate(stages):
        mine, steps, part = [r for r in records if r.get("stage") == i], stage_steps[i], parts[i]
        choice = next((r for r in mine if r.get("event") == "memory_choice"), None)
        result = {"model": os.path.basename(model), "length": length, "cap_gib": cap_gib, "gpu_mem_gb": gpu_mem_gb,
                  "budget_args": " ".join(budget), "pinned": stage_pins(stage, dry), "exit_code": code, "wall_s": round(wall, 1),
                  "steps_done": len(steps), "memory_choice": choice, "engagement": engagement(mine),
                  "probe_records": len(part), "kernel_errors": kernel_errors}
        if steps:
            result["step_s"] = round(steps[0]["seq_len"] / steps[0]["tokens_per_s"], 2)
            # MFU as the page counts it (causal attention once, no recompute) at the H100/H200's 989 TFLOP/s
            result["mfu"] = round(flops(model, length) / result["step_s"] / (PEAK_TFLOPS["H100"] * 1e12), 4)
        if code != 0 or not steps:
            fail = bm.launch_failure(log)
            result.update(error=fail["error"], log_tail=fail["log_tail"],
                          oom=bool(re.search(r"OutOfMemoryError|CUDA out of memory", text)), time_limit=code == -9)
        if choice:
            plan = planner_phases(model, length, choice, device)
            result["planner"] = {"resident_gib": round(plan["resident"] / GiB, 3),
                                 "step_gib": round(plan["step"] / GiB, 3), "peak_phase": plan["peak_phase"],
                                 "predicted_peak_gb": choice.get("predicted_peak_gb"),
                                 "phases_gib": {k: round(v / GiB, 3) for k, v in plan["phases"].items()},
                                 "terms_gib": {k: (round(v / GiB, 3) if not isinstance(v, bool) else v)
                                               for k, v in plan["terms"].items()},
                                 "host_terms_gib": {k: round(v / GiB, 3) for k, v in plan["host_terms"].items()},
                                 "pinned_gib": round(plan["pinned"] / GiB, 3)}
            if part:
                from planner.auto_features import usable_bytes

                usable = usable_bytes(int(choice["budget_gb"] * GiB)) if choice.get("budget_gb") else None
                result.update(compare(part, plan, load_layers(model), usable))
        rec.say(f"{stage}: {length:,} tokens, {len(steps)} step, exit {code}")
        for row in result.get("rows", []):
            rec.say(f"  {row['phase']:<19} L{row['layer']:<2} allocated {row['measured_gib']} GiB (planner "
                    f"{row['planner_gib']}, x{row['ratio']}{' FLAG' if row['flag'] else ''}) reserved "
                    f"{row['reserved_gib']}")
        if result.get("over_usable"):
            rec.say(f"  ABOVE THE USABLE LIMIT ({result['usable_gib']} GiB): {', '.join(result['over_usable'])}")
        if result.get("attention_kernels"):
            rec.say(f"  attention kernels: {result['attention_kernels']}")
        if "step" in result:
            rec.say(f"  step peak {result['step']['measured_gib']} GiB vs planner {result['step']['planner_gib']}; "
                    f"pinned {result['host']['pinned']['measured_gib']} vs {result['host']['pinned']['planner_gib']}; "
                    f"flags: {result['flags'] or 'none'}")
        if result.get("error"):
            rec.say(f"  {stage} failed: {result['error']}")
        results[stage] = result
    return results


def gap_length(model: str | None, dry: bool, cap_gib: float, left: float, shape=None) -> tuple[int, float] | None:
    """(length, gpu_mem_gb) of the gap run: the budget whose usable memory is the cap (cap / 0.9 + 2 GiB), the
    shortest GAP_LENGTHS entry where auto's predicted peak reaches GAP_NEAR of the cap and whose predicted step
    (twice, + 90 s of start-up) fits the time left. None when none does. The dry run plans the GPU's (the real
    shape, arithmetic only) and launches its own tiny length."""
    from planner import auto_features as af
    from planner.memory_model import Features, ModelShape, load_shape

    if shape is None:
        shape = ModelShape.from_config(dict(LLAMA3_8B, num_hidden_layers=LONG_LAYERS, model_type="llama",
                                            head_dim=128)) if dry else load_shape(model)
    mem = cap_gib / (1 - af.HEADROOM) + af.GPU_RESERVED / GiB
    off = Features(offload_params=True, offload_optimizer=True, lean_rmsnorm=True, lean_mlp=True)
    for n in GAP_LENGTHS["gpu"]:
        try:
            c = af.choose(shape, n, 1, af.gpu_budget(mem), sp=1, offloads=off, device="cuda", precision="bf16",
                          ranks_per_node=1, free_offloads=("offload_params", "offload_optimizer"))
        except ValueError:
            continue
        if c.peak_bytes >= GAP_NEAR * cap_gib * GiB and (dry or c.step_s * 2 + 90 < left):
            return (GAP_LENGTHS["dry"][0], 0.0) if dry else (n, round(mem, 3))
    return None
