"""The GPU check in one command, sized for one H100 or H200 and at most 9 minutes (issue 33):

    python -m bench.gpu                        # a GPU machine: bench/results/gpu.json, docs/results/gpu.md
    python -m bench.gpu --out $OUT/gpu.json    # the device tool's machine: the JSON comes back in $OUT
    python -m bench.gpu --render               # the page again from bench/results/gpu.json
    DS_ACCELERATOR=cpu python -m bench.gpu --dry   # the same script on this CPU with tiny shapes (the suite runs it)

Sections (run in the order long, gap, parity, smoke, ladder: `--sections`), each written to the JSON as soon as it ends (a run cut off by its time limit keeps what it
finished), each skipped when the time left (`--budget_s`) cannot hold it. Every launch uses ONE model, Llama-3-8B's
width and vocabulary (hidden 4096, 32 heads, 8 KV heads, MLP 14336, vocab 128256) with 2 decoder layers, saved once
(bf16, 3 GB), and caps the allocator at an H100's memory (`--cap_gib`, default 78.5 GiB of allocations: an 80 GB card
less its CUDA context), so an H200 answers as an H100 would.
0. long (issue 43, first because it matters most): one train.py step at T = 1,048,576 under `memory_features auto`
   with `--gpu_mem_gb 80` (the run's own start-up choice and headroom rule, (80 - 2) x 0.9 = 70.2 GiB usable),
   bench/gpu_probe.py in the rank: max allocated and max reserved per phase (each layer's forward, the checkpointed
   layer's recomputed forward, the MLP backward and the attention backward of each layer, logits + loss), the step's
   peak, pinned host bytes (torch.cuda.host_memory_stats) and RSS after the step, each against the planner's figure
   for the configuration the run chose (planner_phases) with the ratio, flagged past 10% (FLAG: the planner's next
   fix); the engagement counters train.py logs (the `engagement` hook); any kernel error in the log (T x h = 2^32
   elements at 1M: the index-overflow class that stopped ALST at 555K). ~3 min of step (the planner: 182 s at 40%
   MFU) + start-up.
   gap: the reserved-minus-allocated gap near the cap: the same under a budget whose usable memory is the cap itself
   (cap / 0.9 + 2 GiB), at the shortest GAP_LENGTHS entry where auto's predicted peak reaches 95% of the cap (256k:
   77.2 of 78.5 GiB, 13 s of step), when the time left holds it. (The dry run runs both as two stages of one
   launch, the shorter first: one start-up less in the suite.)
1. smoke: tests/test_gpu_smoke.py (NCCL, bf16, ZeRO-3 + CPU offload, evaluation, export, step-1 loss = the plain
   model's) through pytest.
2. parity: document masking on every attention backend installed (sdpa, flex_attention, flash_attention_2 where
   flash-attn is there): the loss and every gradient of a packed sample of 7 documents through the registered
   document-masked function equal the plain Hugging Face model run on each document alone (peaked weights,
   initializer_range 0.3); the wrong answer (attention across documents) is printed beside the tolerance.
3. ladder: the model at SP=1, bf16, ZeRO-3 + CPU offload of params and optimizer, in ONE train.py launch whose
   stages are the rungs (one model load; an out-of-memory rung ends the launch after the rungs below it were
   recorded). At one rank the per-layer working set is what binds (the layers' checkpoints are offloaded to the
   host), so 2 layers answer the length question for 32. Rungs whose predicted time does not fit are dropped (the
   first one runs whenever the ladder does).
   - 64k, 128k, 256k (3, 3, 2 steps): the features `memory_features: auto` picks for the capped card, pinned per
     stage; tokens/s (median after the first step), MFU, measured peak vs the planner's prediction.
   - then the planner's longest length under the cap with every memory feature on (tiled MLP and logits,
     checkpointing, checkpoints offloaded), rounded down to 64k, and one rung 128k above it (1 step each): fits or
     out of memory, peak vs prediction. Rungs whose predicted time does not fit the budget left are dropped.

MFU = tokens/s x flops_per_sequence(L) / L / peak bf16 FLOP/s: planner.memory_model.flops_per_sequence counts
6 FLOPs per matmul weight per token and causal attention once (6 x layers x heads x head_dim x L^2), activation
recompute excluded (so checkpointing lowers the MFU reached). Peak: 989 TFLOP/s dense bf16 (H100 SXM and H200).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time

from bench import harness as bm
from bench.gpu_compare import compare, engagement, planner_phases, read_probe
from bench.gpu_page import render

GiB = 2**30
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0}  # dense bf16, SXM
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                 vocab_size=128256, max_position_embeddings=1 << 21, rope_theta=500000.0, rms_norm_eps=1e-5)
TINY = dict(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2, vocab_size=2048,
            max_position_embeddings=1 << 16, rope_theta=10000.0)
K = 1024
# (length, steps) of the throughput rungs; the dry run's stand-ins keep the shape of the plan at CPU sizes
THROUGHPUT = {"gpu": [(64 * K, 3), (128 * K, 3), (256 * K, 2)], "dry": [(256, 2)]}
LADDER_STEP = {"gpu": 64 * K, "dry": 512}
LEANEST = {"tiled_mlp": True, "tiled_logits": True, "gradient_checkpointing": True, "offload_activations": True}
OFFLOADS = {"zero_optimization": {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}}
PAGE = os.path.join(bm.ROOT, "docs", "results", "gpu.md")


# --- the record -------------------------------------------------------------------------------------------

class Record:
    """The JSON written after every section (and every rung), so a run stopped from outside keeps its results."""

    def __init__(self, path: str, budget_s: float):
        self.path, self.t0, self.budget_s = path, time.time(), budget_s
        self.data: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "budget_s": budget_s}

    def left(self) -> float:
        return self.budget_s - (time.time() - self.t0)

    def put(self, key: str, value) -> None:
        self.data[key] = value
        self.data["elapsed_s"] = round(time.time() - self.t0, 1)
        bm.write_json(self.path, self.data)

    def say(self, line: str) -> None:
        print(f"[{time.time() - self.t0:6.1f}s] {line}", flush=True)


def environment(dry: bool) -> dict:
    import torch
    import transformers

    env = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "dry": dry, "cuda": torch.cuda.is_available()}
    try:
        import deepspeed

        env["deepspeed"] = deepspeed.__version__
    except ImportError:
        env["deepspeed"] = None
    try:
        import flash_attn

        env["flash_attn"] = flash_attn.__version__
    except ImportError:
        env["flash_attn"] = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(device=p.name, device_gib=round(p.total_memory / GiB, 1))
    else:
        env["device"] = "cpu"
    return env


def peak_tflops(device_name: str, given: float | None) -> float | None:
    if given:
        return given
    return next((v for k, v in PEAK_TFLOPS.items() if k in device_name), None)


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


def long_run(rec: Record, name: str, model: str, device: str, dry: bool, cap_gib: float, work: str,
             stages: list[tuple[str, int]], gpu_mem_gb: float, timeout: float) -> dict:
    """One train.py launch, one step per stage (name, length) under memory_features auto (the run's own start-up
    choice at gpu_mem_gb, or on the CPU stand-in DRY_PINS under an 8 GiB cap), the probe in its rank; per stage,
    the per-phase figures against the planner's for the configuration the run chose: {stage name: result}. The GPU
    run launches each stage alone (their budgets differ); the dry run puts both in one launch (one start-up less
    in the suite) and splits the probe's records at each stage's step record."""
    out = os.path.join(work, name)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    cfg = os.path.join(work, f"{name}.yaml")
    pins = f"memory_features: {json.dumps(DRY_PINS)}, " if dry else ""
    with open(cfg, "w") as fh:
        fh.write("stages:\n" + "".join(f"  - {{name: {s}, max_seq_length: {n}, max_steps: 1, {pins}"
                                       "eval: {passkey_trials: 0, heldout_samples: 0}}\n" for s, n in stages))
    probe_path = os.path.join(work, f"{name}.phases.jsonl")
    if os.path.exists(probe_path + ".rank0"):
        os.remove(probe_path + ".rank0")
    env = bm.bench_env(device)
    env.update(BENCH_GPU_PHASES=probe_path,
               PYTHONPATH=os.pathsep.join([os.path.join(bm.ROOT, "bench", "gpu_site"), env["PYTHONPATH"]]))
    if not dry:
        env["BENCH_GPU_CAP_GIB"] = str(cap_gib)
    budget = ["--mem_cap_gb", "8", "--attention_head_chunks", "2"] if dry else ["--gpu_mem_gb", str(gpu_mem_gb)]
    cmd = [*bm.launcher(), "--num_gpus", "1", "--master_port", str(bm.free_port()), "train.py", "--config", cfg,
           "--model_name_or_path", model, "--sequence_parallel_size", "1", "--output_dir", out,
           "--report_to", "none", "--no-export_hf", "--save_steps", "0", "--resume", "none", "--no-progress_bar",
           "--learning_rate", "1e-5", "--warmup_steps", "0", "--reset_position_ids", "no",
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
    results, start = {}, 0.0
    for i, (stage, length) in enumerate(stages):
        mine = [r for r in records if r.get("stage") == i]
        steps = bm.read_steps(out, mine)
        end = steps[-1]["time"] if steps and i + 1 < len(stages) else float("inf")
        part = [r for r in probe if start < r.get("time", 0) <= end]
        start = end
        choice = next((r for r in mine if r.get("event") == "memory_choice"), None)
        result = {"model": os.path.basename(model), "length": length, "cap_gib": cap_gib, "gpu_mem_gb": gpu_mem_gb,
                  "budget_args": " ".join(budget), "exit_code": code, "wall_s": round(wall, 1),
                  "steps_done": len(steps), "memory_choice": choice, "engagement": engagement(mine),
                  "probe_records": len(part), "kernel_errors": kernel_errors}
        if steps:
            result["step_s"] = round(steps[0]["seq_len"] / steps[0]["tokens_per_s"], 2)
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
                result.update(compare(part, plan, load_layers(model)))
        rec.say(f"{stage}: {length:,} tokens, {len(steps)} step, exit {code}")
        for row in result.get("rows", []):
            rec.say(f"  {row['phase']:<19} L{row['layer']:<2} allocated {row['measured_gib']} GiB (planner "
                    f"{row['planner_gib']}, x{row['ratio']}{' FLAG' if row['flag'] else ''}) reserved "
                    f"{row['reserved_gib']}")
        if "step" in result:
            rec.say(f"  step peak {result['step']['measured_gib']} GiB vs planner {result['step']['planner_gib']}; "
                    f"pinned {result['host']['pinned']['measured_gib']} vs {result['host']['pinned']['planner_gib']}; "
                    f"flags: {result['flags'] or 'none'}")
        if result.get("error"):
            rec.say(f"  {stage} failed: {result['error']}")
        results[stage] = result
    return results


def load_layers(model: str) -> int:
    from planner.memory_model import load_shape

    return load_shape(model).num_layers


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


# --- 1. smoke ---------------------------------------------------------------------------------------------

def smoke(rec: Record, timeout: float) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests/test_gpu_smoke.py"]
    t0 = time.time()
    try:
        p = subprocess.run(cmd, cwd=bm.ROOT, capture_output=True, text=True, timeout=timeout)
        out, code = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        out, code = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or ""), -9
    summary = next((ln for ln in reversed(out.splitlines()) if re.search(r"passed|failed|skipped|error", ln)), "")
    rec.say(f"smoke: exit {code}: {summary}")
    return {"exit_code": code, "summary": summary.strip("= "), "seconds": round(time.time() - t0, 1),
            "tail": out.splitlines()[-15:] if code else []}


# --- 2. document-masking parity ---------------------------------------------------------------------------

DOC_LENS = [37, 11, 29, 120, 1, 58, 44]  # 300 tokens: a 1-token document, short ones and a long one


def backends(device: str) -> list[str]:
    if device == "cpu":
        return ["sdpa"]  # torch has no flex_attention backward on CPU; flash-attn needs CUDA
    names = ["sdpa", "flex_attention"]
    try:
        import flash_attn  # noqa: F401

        names.append("flash_attention_2")
    except ImportError:
        pass
    return names


def _loss_and_grads(model, ids, pos, labels) -> tuple[float, dict]:
    import torch

    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits.float()
    total = torch.nn.functional.cross_entropy(logits[0], labels[0], ignore_index=-100, reduction="sum")
    total.backward()
    return total.item(), {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


def doc_parity(device: str) -> list[dict]:
    """Per backend: relative error of the loss and of all gradients (one vector) against the plain model on each
    document alone, and how far the wrong answer (monotonic positions, attention across documents) is."""
    import torch
    from transformers import AutoModelForCausalLM

    from model_utils import attention
    from model_utils.build import preset_config

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cfg = preset_config("tiny-llama", hidden_size=128, intermediate_size=256, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=32, initializer_range=0.3)
    torch.manual_seed(0)
    master = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).state_dict()
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(4, 2048, (n,), generator=g) for n in DOC_LENS]
    n_labels = sum(n - 1 for n in DOC_LENS)

    def build(attn: str, dtype):
        m = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attn)
        m.load_state_dict(master)
        return m.to(device).train()

    def labels_of(d):
        return torch.cat([d[1:], torch.tensor([-100])])

    ref = build("sdpa", torch.float32)  # the oracle: each document alone, plain model, fp32
    ref_loss, ref_grads = 0.0, {}
    for d in docs:
        loss, grads = _loss_and_grads(ref, d[None].to(device), torch.arange(len(d))[None].to(device),
                                      labels_of(d)[None].to(device))
        ref_loss += loss
        for k, v in grads.items():
            ref_grads[k] = ref_grads.get(k, 0) + v
    ids = torch.cat(docs)[None].to(device)
    pos = torch.cat([torch.arange(len(d)) for d in docs])[None].to(device)
    labels = torch.cat([labels_of(d) for d in docs])[None].to(device)
    wrong_loss, _ = _loss_and_grads(ref, ids, torch.arange(ids.shape[1])[None].to(device), labels)
    flat_ref = torch.cat([ref_grads[k].flatten() for k in sorted(ref_grads)])
    out = []
    for attn in backends(device):
        dtype = torch.bfloat16 if attn.startswith("flash") else torch.float32
        try:
            model = build(attn, dtype)
            attention.register(model, attn)
            try:
                loss, grads = _loss_and_grads(model, ids, pos, labels)
            finally:
                attention.restore()
        except Exception as e:  # a backend that fails here is a result, not the end of the check
            out.append({"backend": attn, "dtype": str(dtype).removeprefix("torch."), "ok": False,
                        "error": f"{type(e).__name__}: {e}"[:400]})
            continue
        flat = torch.cat([grads[k].flatten() for k in sorted(ref_grads)])
        loss_tol, grad_tol = (2e-2, 5e-2) if dtype == torch.bfloat16 else (1e-5, 1e-4)
        row = {"backend": attn, "dtype": str(dtype).removeprefix("torch."), "loss": loss / n_labels,
               "ref_loss": ref_loss / n_labels, "wrong_loss": wrong_loss / n_labels,
               "loss_rel_err": abs(loss - ref_loss) / abs(ref_loss),
               "wrong_rel_err": abs(wrong_loss - ref_loss) / abs(ref_loss),
               "grad_rel_err": ((flat - flat_ref).norm() / flat_ref.norm()).item(),
               "loss_tol": loss_tol, "grad_tol": grad_tol}
        row["ok"] = row["loss_rel_err"] <= loss_tol and row["grad_rel_err"] <= grad_tol
        out.append(row)
    return out


# --- 3. the ladder ----------------------------------------------------------------------------------------

def save_model(root: str, dry: bool, layers: int) -> str:
    """The Llama-3-8B-shaped model (bf16 on disk: 2.5 GB at 1 layer) or the dry run's tiny one, saved once."""
    import torch
    from transformers import AutoModelForCausalLM

    from model_utils.build import preset_config

    shape = TINY if dry else LLAMA3_8B
    path = os.path.join(root, f"{'tiny' if dry else 'llama3_8b_shape'}_l{layers}")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    torch.manual_seed(0)
    cfg = preset_config("tiny-llama", num_hidden_layers=layers, **shape)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32 if dry else torch.bfloat16).save_pretrained(path)
    return path


def auto_features(model: str, length: int, device: str, cap_gib: float) -> dict:
    """What memory_features auto picks for one rank at `length` on a card of cap_gib (the planner's chooser with
    both ZeRO-3 offloads held on), as a stage's memory_features mapping; {} when nothing fits."""
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
            "offload_activations": f.offload_activations}


def predicted_gib(model: str, length: int, feats: dict, device: str) -> float:
    from planner.memory_model import load_shape, predict_peak_bytes

    spec = {"lean_rmsnorm": True, "lean_mlp": True, "offload_params": True, "offload_optimizer": True, **feats}
    return predict_peak_bytes(load_shape(model), length, 1, spec, precision="bf16" if device == "cuda" else "fp32",
                              device=device) / GiB


def planner_longest(model: str, feats: dict, device: str, cap_gib: float, step: int) -> int:
    """Longest multiple of `step` whose predicted peak fits cap_gib (the peak grows with the length)."""
    lo, hi = 0, (1 << 26) // step
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if predicted_gib(model, mid * step, feats, device) <= cap_gib else (lo, mid - 1)
    return lo * step


def stage_yaml(name: str, length: int, steps: int, feats: dict) -> str:
    mf = ", ".join(f"{k}: {json.dumps(v)}" for k, v in feats.items())
    return (f"  - {{name: {name}, max_seq_length: {length}, max_steps: {steps}, memory_features: {{{mf}}},\n"
            f"     deepspeed_overrides: {json.dumps(OFFLOADS)}, eval: {{passkey_trials: 0, heldout_samples: 0}}}}\n")


def flops(model: str, length: int) -> float:
    from planner.memory_model import flops_per_sequence, load_shape

    return flops_per_sequence(load_shape(model), length)


def ladder(rec: Record, model: str, device: str, dry: bool, cap_gib: float, work: str, peak: float | None,
           timeout: float) -> dict:
    kind = "dry" if dry else "gpu"
    if dry:  # a cap that the tiny model reaches at ~2k tokens, so the dry ladder ends where the GPU one would
        cap_gib = round(predicted_gib(model, 2304, LEANEST, device), 4)
    rungs = [dict(length=n, steps=s, kind="throughput", features=auto_features(model, n, device, cap_gib))
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
        fh.write("stages:\n" + "".join(stage_yaml(f"L{r['length']}", r["length"], r["steps"], r["features"])
                                       for r in rungs))
    env = bm.bench_env(device)
    if not dry:  # the allocator cap (bench/gpu_site/sitecustomize.py) in the ranks
        env.update(BENCH_GPU_CAP_GIB=str(cap_gib),
                   PYTHONPATH=os.pathsep.join([os.path.join(bm.ROOT, "bench", "gpu_site"), env["PYTHONPATH"]]))
    cmd = [*bm.launcher(), "--num_gpus", "1", "--master_port", str(bm.free_port()), "train.py", "--config", cfg,
           "--model_name_or_path", model, "--sequence_parallel_size", "1", "--output_dir", out,
           "--report_to", "none", "--no-export_hf", "--save_steps", "0", "--resume", "none", "--no-progress_bar",
           "--learning_rate", "1e-5", "--warmup_steps", "0", "--reset_position_ids", "no", "--memory_features",
           "manual", "--dist_timeout_s", "600"]
    log = os.path.join(work, "ladder.log")
    code, wall = bm.launch(cmd, env, log, max(timeout, 60))
    steps = bm.read_steps(out)
    with open(log, errors="replace") as fh:
        text = fh.read()
    oom = bool(re.search(r"OutOfMemoryError|CUDA out of memory|out of memory", text))
    result = {"model": os.path.basename(model), "layers": load_layers(model), "cap_gib": cap_gib, "planner_longest_leanest": longest,
              "exit_code": code, "wall_s": round(wall, 1), "dropped_for_time": dropped, "rungs": []}
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
    for row in result["rungs"]:
        rec.say(f"  {row['length']:>8} {row['kind']:<10} fits={row['fits']} tok/s={row.get('tokens_per_s')} "
                f"mfu={row.get('mfu')} peak={row.get('peak_gib')} predicted={row.get('predicted_gib')}")
    return result


def guarded(rec: Record, name: str, fn):
    """A section that raises is recorded as failed ({name}_error) and the next section still runs."""
    try:
        return fn()
    except Exception as e:
        rec.say(f"{name} FAILED: {type(e).__name__}: {e}")
        rec.put(f"{name}_error", f"{type(e).__name__}: {e}"[:1000])
        return None


# --- main -------------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry", action="store_true", help="CPU, tiny shapes: the script's own test")
    p.add_argument("--render", action="store_true", help="only regenerate the page from --out")
    p.add_argument("--out", default=bm.result_path("gpu.json"))
    p.add_argument("--page", default=None, help="the results page (default docs/results/gpu.md; none in --dry)")
    p.add_argument("--budget_s", type=float, default=500.0, help="wall-clock seconds for all sections")
    p.add_argument("--cap_gib", type=float, default=78.5, help="GPU allocations allowed (an H100 80 GB)")
    p.add_argument("--layers", type=int, default=LONG_LAYERS, help="decoder layers of the model every launch uses")
    p.add_argument("--peak_tflops", type=float, default=None, help="bf16 peak (default by device name)")
    p.add_argument("--sections", default="long,gap,parity,smoke,ladder", help="run in this order, each when the "
                   "time left can hold it (the 1M step first: issue 43)")
    p.add_argument("--work", default="/tmp/bench_gpu")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    page = args.page if args.page is not None else (None if args.dry else PAGE)
    if args.render:
        with open(args.out) as fh:
            text = render(json.load(fh))
        with open(page or PAGE, "w") as fh:
            fh.write(text)
        print(text)
        return 0
    from base.env import configure

    configure()  # TORCH_EXTENSIONS_DIR (the JIT ops are built once, by the first launch, and reused)
    import torch

    device = "cuda" if torch.cuda.is_available() and not args.dry else "cpu"
    if not args.dry and device != "cuda":
        raise SystemExit("error: no CUDA GPU here: run with --dry for the CPU stand-in")
    rec = Record(args.out, args.budget_s)
    env = environment(args.dry)
    rec.put("environment", env)
    rec.say(f"device {env['device']}, torch {env['torch']}, transformers {env['transformers']}, "
            f"deepspeed {env['deepspeed']}, flash-attn {env['flash_attn']}")
    sections = args.sections.split(",")
    os.makedirs(args.work, exist_ok=True)
    kind = "dry" if args.dry else "gpu"
    skipped = []

    def model() -> str:  # one model for the long runs and the ladder: saved once (bf16, 3 GB at 2 layers)
        return save_model(os.path.join(args.work, "models"), args.dry, args.layers)

    def page_now():  # the page after every section too: a run cut off from outside keeps a readable page
        if page:
            with open(page, "w") as fh:
                fh.write(render(rec.data))

    if args.dry and "long" in sections and "gap" in sections:  # one launch, two stages (the suite's time)
        at = guarded(rec, "gap", lambda: gap_length(model(), True, args.cap_gib, rec.left()))
        both = guarded(rec, "long", lambda: long_run(rec, "long", model(), device, True, args.cap_gib, args.work,
                                                     sorted([("long", LONG[kind]), ("gap", at[0])], key=lambda x: x[1]),  # lengths grow
                                                     0.0, rec.left() - 15))
        for name in ("long", "gap"):
            rec.put(name, (both or {}).get(name))
        page_now()
        sections = [s for s in sections if s not in ("long", "gap")]
    if "long" in sections:
        rec.put("long", (guarded(rec, "long", lambda: long_run(
            rec, "long", model(), device, args.dry, args.cap_gib, args.work, [("long", LONG[kind])], PLAN_GPU_GB,
            rec.left() - 15)) or {}).get("long"))
        page_now()
    if "gap" in sections:
        at = guarded(rec, "gap", lambda: gap_length(model(), args.dry, args.cap_gib, rec.left()))
        if at:
            rec.put("gap", (guarded(rec, "gap", lambda: long_run(
                rec, "gap", model(), device, args.dry, args.cap_gib, args.work, [("gap", at[0])], at[1],
                rec.left() - 15)) or {}).get("gap"))
        else:
            skipped.append("gap")
        page_now()
    if "parity" in sections and rec.left() > (0 if args.dry else 45):
        t0 = time.time()
        rows = guarded(rec, "parity", lambda: doc_parity(device)) or []
        for r in rows:
            rec.say(f"parity {r['backend']:<18} " + (f"loss {r['loss_rel_err']:.1e} grads {r['grad_rel_err']:.1e} "
                    f"(wrong answer {r['wrong_rel_err']:.1e}) {'ok' if r['ok'] else 'FAILED'}" if "error" not in r
                    else f"FAILED {r['error']}"))
        rec.put("parity", rows)
        rec.put("parity_s", round(time.time() - t0, 1))
        page_now()
    elif "parity" in sections:
        skipped.append("parity")
    if "smoke" in sections and device == "cuda" and rec.left() > 150:  # 117 s on an H200 (2026-11-26)
        rec.put("smoke", smoke(rec, timeout=min(200.0, rec.left() - 20)))
        page_now()
    elif "smoke" in sections and device == "cuda":
        skipped.append("smoke")
    if "ladder" in sections and rec.left() > (0 if args.dry else 120):  # an engine build and a few steps
        def run_ladder():
            peak = peak_tflops(env["device"], args.peak_tflops) if device == "cuda" else args.peak_tflops
            return ladder(rec, model(), device, args.dry, args.cap_gib, args.work, peak, rec.left() - 10)

        rec.put("ladder", guarded(rec, "ladder", run_ladder))
    elif "ladder" in sections:
        skipped.append("ladder")
    rec.put("skipped_for_time", skipped)
    page_now()
    bad = [k for k in ("parity",) if any(not r["ok"] for r in rec.data.get(k) or [])]
    bad += [k.removesuffix("_error") for k in rec.data if k.endswith("_error")]
    bad += ["smoke"] if rec.data.get("smoke", {}).get("exit_code", 0) != 0 else []
    for name in ("long", "gap"):  # the step must run (an out-of-memory step is a result: flagged, not a failure)
        r = rec.data.get(name)
        if r is not None and not r["steps_done"] and not r.get("oom"):
            bad.append(name)
    lad = rec.data.get("ladder")
    if lad is not None and not (lad["rungs"] and lad["rungs"][0]["fits"] and all(r["fits"] or r["why"] == "out of memory"
                                                                      for r in lad["rungs"])):
        bad.append("ladder")  # the first rung must run, and a launch may only end by running out of memory
    rec.say(f"done: {args.out}{', page ' + page if page else ''}; {'FAILED: ' + ', '.join(bad) if bad else 'ok'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
