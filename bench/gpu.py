"""The GPU check, sized for one H100 or H200, in two device calls: the headline alone first (~427 s estimated, ~472 s
of device time with the machine's start; --budget_s 540 caps it, leaving its launch ~100 s over the estimate), then
kernels, arena and parity (~50 s) on the warm machine (docs/benchmarks.md gives both commands and the estimate):

    python -m bench.gpu                        # a GPU machine: bench/results/gpu.json, docs/results/gpu.md
    python -m bench.gpu --out $OUT/gpu.json    # the device tool's machine: the JSON comes back in $OUT
    python -m bench.gpu --render               # the page again from bench/results/gpu.json
    python -m bench.gpu --merge NEW.json       # a device run's sections into bench/results/gpu.json (a note), the page
    DS_ACCELERATOR=cpu python -m bench.gpu --dry   # the same script on this CPU with tiny shapes (the suite runs it)

Sections (run in the order headline, kernels, arena, parity, long, gap, smoke, ladder: `--sections`), each written
to the JSON as soon as it ends (a run cut off by its time limit keeps what it finished), each skipped when the time
left (`--budget_s`) cannot hold it. Every launch uses ONE model, Llama-3-8B's width and vocabulary (hidden 4096,
32 heads, 8 KV heads, MLP 14336, vocab 128256) with 2 decoder layers, saved once (bf16, 3 GB, initialised on the
GPU), and caps the allocator at an H100's memory (`--cap_gib`, default 78.5 GiB of allocations: an 80 GB card less
its CUDA context), so an H200 answers as an H100 would.
- kernels, arena (bench/gpu_kernels.py, issue 49, ~40 s, after the headline): the headline's attention call (one head chunk, bf16, at
  its length) timed through SDPA's default, forced flash / cuDNN / memory-efficient backends and FA2 where
  installed, with the kernels' names; then `--attn_implementation auto`'s own decision (model_utils/attention_pick.py
  measure, as settle runs it: SDPA's dispatch, SDPA forced to cuDNN, FA2 where installed; `auto_attention`: what auto
  would run here, ~2 s); the host arena's registration time per GiB and copy rate.
- headline (issue 49, first): the 1-GPU headline's configuration itself, pinned: every layer
  checkpointed with its checkpoint offloaded, tiled MLP and logits, parameters and optimizer offloaded, the
  largest head-chunk count (32), at the planner's longest length under `--gpu_mem_gb 80` (the run's own start-up
  rule: (80 - 2) x 0.9 = 70.2 GiB usable; 1,240,480 tokens since the norm term's fix, 1,109,646 in the 2026-11-28 run). Under these features the GPU peak does not depend on
  the layer count: parameters and gradients live on the host (ZeRO-3 offload, one layer gathered at a time), and
  every layer's checkpoint is copied to the host as soon as it is made, so the GPU holds one layer's working set,
  the checkpoint being fetched, the embedding / head and the logits tiles whatever the depth (plan.py prints the
  same 70.20 GiB peak for 2 and 32 layers); 2 layers show a recomputed layer below another, which is all the
  32-layer step repeats. One train.py step with bench/gpu_probe.py in the rank: every segment of the step (each
  layer's forward, recompute, MLP / attention / norm backward, the logits, the segments between), max allocated
  and reserved, against planner_phases for the run's memory_choice, past 10% flagged; any segment above the usable
  limit flagged whatever its ratio; the attention kernels the step dispatched to; host pinned / arena / RSS; the
  engagement counters; kernel errors past 2^31 elements.
- long: the same step at T = 1,048,576 under `memory_features auto` (the run's own choice: issue 43's run).
  gap: the reserved-minus-allocated gap near the cap: auto under a budget whose usable memory is the cap itself
  (cap / 0.9 + 2 GiB), at the shortest GAP_LENGTHS entry where auto's predicted peak reaches 95% of the cap. (The
  dry run runs headline, long and gap as three stages of one launch: one start-up in the suite.)
- smoke: tests/test_gpu_smoke.py (NCCL, bf16, ZeRO-3 + CPU offload, evaluation, export, step-1 loss = the plain
  model's) through pytest.
- parity (bench/gpu_parity.py): document masking on every attention backend installed against the plain Hugging
  Face model on each document alone.
- ladder (bench/gpu_ladder.py): length and tokens/s at SP=1 in one launch whose stages are the rungs.

MFU = tokens/s x flops_per_sequence(L) / L / peak bf16 FLOP/s: planner.flops.flops_per_sequence counts
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
import subprocess
import sys
import time

from bench import harness as bm
from bench.gpu_compare import compare, planner_phases  # noqa: F401  (the tests reach them through bench.gpu)
from bench.gpu_ladder import ladder
from bench.gpu_long import (  # noqa: F401  (GAP_LENGTHS, HEADLINE, K: the tests' and the page's)
    GAP_LENGTHS,
    HEADLINE,
    LLAMA3_8B,
    LONG,
    LONG_LAYERS,
    PLAN_GPU_GB,
    TINY,
    K,
    gap_length,
    long_run,
)
from bench.gpu_page import render
from bench.gpu_parity import doc_parity
from planner.peaks import device_peak_tflops

GiB = 2**30
SECTIONS = ("headline", "kernels", "arena", "parity", "long", "gap", "smoke", "ladder")  # the order they run in
HEADLINE_DRY = 1536  # the dry stand-in's length (its tiny model's planner maximum is far past a CPU step)
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
    """`--peak_tflops` where given, else the device's dense bf16 peak (planner/peaks.py, as training's `mfu`)."""
    return given or device_peak_tflops(device_name)


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


# --- the model every launch uses ---------------------------------------------------------------------

def save_model(root: str, dry: bool, layers: int) -> str:
    """The Llama-3-8B-shaped model (bf16 on disk: 3 GB at 2 layers) or the dry run's tiny one, saved once; the GPU
    one initialised on the GPU (on the CPU its init took 83 s of the H200 session's budget)."""
    import torch
    from transformers import AutoModelForCausalLM

    from model_utils.build import preset_config

    shape = TINY if dry else LLAMA3_8B
    path = os.path.join(root, f"{'tiny' if dry else 'llama3_8b_shape'}_l{layers}")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    torch.manual_seed(0)
    cfg = preset_config("tiny-llama", num_hidden_layers=layers, **shape)
    with torch.device("cuda" if torch.cuda.is_available() and not dry else "cpu"):
        m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32 if dry else torch.bfloat16)
    m.save_pretrained(path)
    del m
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return path


def headline_length(model: str, gpu_mem_gb: float, chunks: int) -> int:
    """The planner's longest length for the headline's pinned features (HEADLINE, both offloads, `chunks` head
    chunks) on one GPU of gpu_mem_gb, by the chooser train.py's start-up runs (so the launch accepts it): 1,240,480
    for Llama-3-8B's shape on an 80 GB card, whatever the layer count (plan.py --compare's 1-GPU row)."""
    from planner import auto_features as af
    from planner.cluster import longest_multiple
    from planner.memory_model import Features, load_shape

    shape = load_shape(model)
    off = Features(offload_params=True, offload_optimizer=True, lean_rmsnorm=True, lean_mlp=True)
    pins = {**HEADLINE, "keep_attention": False, "attention_head_chunks": chunks, "ring_attention": False}

    def fits(n: int) -> bool:
        try:
            af.choose(shape, n, 1, af.gpu_budget(gpu_mem_gb), sp=1, pinned=pins, offloads=off, device="cuda",
                      precision="bf16", ranks_per_node=1)
            return True
        except ValueError:
            return False

    return longest_multiple(fits, 1, 1 << 26)


def max_chunks(model: str) -> int:
    from planner.attention_sp import head_chunk_choices
    from planner.memory_model import load_shape

    shape = load_shape(model)
    return max(head_chunk_choices(shape.num_heads, shape.num_kv_heads, 1))


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
    p.add_argument("--merge", default=None, help="a run's JSON: its sections replace --out's (the others kept, a note "
                   "says which and when), then the page as --render")
    p.add_argument("--out", default=bm.result_path("gpu.json"))
    p.add_argument("--page", default=None, help="the results page (default docs/results/gpu.md; none in --dry)")
    p.add_argument("--budget_s", type=float, default=500.0, help="wall-clock seconds for all sections")
    p.add_argument("--cap_gib", type=float, default=78.5, help="GPU allocations allowed (an H100 80 GB)")
    p.add_argument("--layers", type=int, default=LONG_LAYERS, help="decoder layers of the model every launch uses")
    p.add_argument("--peak_tflops", type=float, default=None, help="bf16 peak (default by device name)")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help="run in this order, each when the time left can hold it (the headline first: issue 49)")
    p.add_argument("--work", default="/tmp/bench_gpu")
    return p


def check_sections(names: str) -> list[str]:
    """--sections as a list; an unknown name refused in one line before anything starts (a GPU machine's start is
    minutes of device time, and a misspelt section would otherwise end "ok" having run nothing)."""
    got = names.split(",")
    unknown = [s for s in got if s not in SECTIONS]
    if unknown:
        raise SystemExit(f"error: --sections {names}: unknown {', '.join(map(repr, unknown))}; the sections are "
                         f"{','.join(SECTIONS)}")
    return got


RUN_KEYS = ("started", "budget_s", "environment", "elapsed_s", "notes", "skipped_for_time")  # a run's, not a section


def merge(new_path: str, out: str) -> list[str]:
    """Write into `out` the sections of the run in `new_path` (each replacing the one there), keeping the others,
    with a note naming what came from which run; a missing `out` is the new run itself. The merged section names.
    ValueError (one line) where `new_path` is not a run's JSON: nothing is written."""
    new = bm.read_json(new_path, "--merge", "give a bench.gpu run's --out JSON")
    if not isinstance(new, dict) or "started" not in new or all(k in RUN_KEYS for k in new):
        raise ValueError(f"--merge {new_path}: not a bench.gpu run (a JSON object with 'started' and a section): give "
                         "a bench.gpu run's --out JSON")
    if not os.path.exists(out):
        shutil.copy(new_path, out)
        return [k for k in new if k not in RUN_KEYS]
    with open(out) as fh:
        data = json.load(fh)
    sections = [k for k in new if k not in RUN_KEYS]
    data.update({k: new[k] for k in sections})
    data["notes"] = list(data.get("notes") or []) + [
        f"Merged from a later run (started {new.get('started')}, --budget_s {new.get('budget_s')}, {new.get('elapsed_s')}"
        f" s; skipped for time: {new.get('skipped_for_time') or 'none'}; environment {json.dumps(new.get('environment'))}"
        f"): {', '.join(sections)}, replacing those of the run above."]
    with open(out + ".tmp", "w") as fh:
        json.dump(data, fh, indent=1)
    os.replace(out + ".tmp", out)
    return sections


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    sections = check_sections(args.sections)
    page = args.page if args.page is not None else (None if args.dry else PAGE)
    if args.merge:
        try:
            merge(args.merge, args.out)
        except ValueError as e:  # the user's input: one line, exit 2 as every script (base/exits.py)
            print(f"error: {e}", file=sys.stderr)
            return 2
    if args.render or args.merge:
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
    os.makedirs(args.work, exist_ok=True)
    kind = "dry" if args.dry else "gpu"
    skipped = []

    def model() -> str:  # one model for the long runs and the ladder: saved once (bf16, 3 GB at 2 layers)
        return save_model(os.path.join(args.work, "models"), args.dry, args.layers)

    def page_now():  # the page after every section too: a run cut off from outside keeps a readable page
        if page:
            with open(page, "w") as fh:
                fh.write(render(rec.data))

    def chunks() -> int:
        return 2 if args.dry else max_chunks(model())  # the dry launch shares its --attention_head_chunks 2

    if args.dry and {"headline", "long", "gap"} <= set(sections):  # one launch, three stages (the suite's time)
        at = guarded(rec, "gap", lambda: gap_length(model(), True, args.cap_gib, rec.left()))
        runs = [("long", LONG[kind]), ("gap", at[0]), ("headline", HEADLINE_DRY)]
        got = guarded(rec, "long", lambda: long_run(rec, "long", model(), device, True, args.cap_gib, args.work,
                                                    sorted(runs, key=lambda x: x[1]), 0.0, rec.left() - 15))
        for name in ("headline", "long", "gap"):
            rec.put(name, (got or {}).get(name))
        page_now()
        sections = [s for s in sections if s not in ("headline", "long", "gap")]
    if "headline" in sections:  # issue 49: the headline's own configuration at the planner's longest length
        def run_headline():
            n = HEADLINE_DRY if args.dry else headline_length(model(), PLAN_GPU_GB, chunks())
            rec.say(f"headline: planner's longest with its features at {PLAN_GPU_GB} GB: {n:,} tokens")
            return long_run(rec, "headline", model(), device, args.dry, args.cap_gib, args.work, [("headline", n)],
                            PLAN_GPU_GB, rec.left() - 15, chunks=chunks())

        rec.put("headline", (guarded(rec, "headline", run_headline) or {}).get("headline"))
        page_now()
    if "kernels" in sections and rec.left() > (0 if args.dry else 45):
        def run_kernels():
            from bench.gpu_kernels import time_backends
            from planner.attention_sp import chunk_heads
            from planner.memory_model import load_shape

            shape = load_shape(model())
            hq, hkv = chunk_heads(shape.num_heads, shape.num_kv_heads, chunks())
            n = (rec.data.get("headline") or {}).get("length") or (HEADLINE_DRY if args.dry else LONG[kind])
            rows = time_backends(n, hq, hkv, shape.head_dim, device)
            for r in rows:
                rec.say(f"kernels: {r['backend']:<15} " + (f"fwd {r['forward_s']} s ({r['forward_tflops']} TF/s) "
                        f"bwd {r['backward_s']} s ({r['backward_tflops']} TF/s) {r.get('kernels')}"
                        f"{' dispatch ' + r['dispatch_at_length'] if 'dispatch_at_length' in r else ''}"
                        if r["ok"] else f"FAILED {r['error']}"))
            return rows

        rec.put("kernels", guarded(rec, "kernels", run_kernels))

        def run_auto_pick():  # what `--attn_implementation auto` would run at the headline's call: its own decision
            from model_utils import attention_pick as ap
            from model_utils.build import load_hf_config, pick_attn_implementation
            from model_utils.families import check_config

            if device != "cuda":
                return {"skipped": "no CUDA: the probe times GPU kernels"}
            n = (rec.data.get("headline") or {}).get("length") or LONG[kind]
            choice, times, call = ap.measure(pick_attn_implementation("auto"), load_hf_config(model()), chunks=chunks(),
                                             ring=False, sp=1, cp=1, seq_len=n, half="bf16", check=check_config)
            rec.say(ap.line(choice, times, call))
            return {"choice": choice, "seconds": times, "call": call}

        rec.put("auto_attention", guarded(rec, "auto_attention", run_auto_pick))
        page_now()
    elif "kernels" in sections:
        skipped.append("kernels")
    if "arena" in sections and rec.left() > (0 if args.dry else 20):
        from bench.gpu_kernels import arena_probe

        rec.put("arena", guarded(rec, "arena", lambda: arena_probe([0.01] if args.dry else [1.0, 4.0], device)))
        rec.say(f"arena: {rec.data.get('arena')}")
        page_now()
    elif "arena" in sections:
        skipped.append("arena")
    if "parity" in sections and rec.left() > (0 if args.dry else 30):
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
    if "long" in sections and rec.left() > (0 if args.dry else 330):  # 322 s on the H200 (2026-11-27)
        rec.put("long", (guarded(rec, "long", lambda: long_run(
            rec, "long", model(), device, args.dry, args.cap_gib, args.work, [("long", LONG[kind])], PLAN_GPU_GB,
            rec.left() - 15)) or {}).get("long"))
        page_now()
    elif "long" in sections:
        skipped.append("long")
    if "gap" in sections:
        at = guarded(rec, "gap", lambda: gap_length(model(), args.dry, args.cap_gib, rec.left()))
        if at:
            rec.put("gap", (guarded(rec, "gap", lambda: long_run(
                rec, "gap", model(), device, args.dry, args.cap_gib, args.work, [("gap", at[0])], at[1],
                rec.left() - 15)) or {}).get("gap"))
        else:
            skipped.append("gap")
        page_now()
    if "smoke" in sections and device == "cuda" and rec.left() > 150:  # 117 s on an H200 (2026-11-26)
        rec.put("smoke", smoke(rec, timeout=min(200.0, rec.left() - 20)))
        page_now()
    elif "smoke" in sections and device == "cuda":
        skipped.append("smoke")
    if "ladder" in sections and rec.left() > (0 if args.dry else 120):  # an engine build and a few steps
        def run_ladder():
            peak = peak_tflops(env["device"], args.peak_tflops) if device == "cuda" else args.peak_tflops
            return ladder(rec, model(), device, args.dry, args.cap_gib, args.work, peak, rec.left() - 10,
                          PLAN_GPU_GB)

        rec.put("ladder", guarded(rec, "ladder", run_ladder))
    elif "ladder" in sections:
        skipped.append("ladder")
    rec.put("skipped_for_time", skipped)
    page_now()
    bad = [k for k in ("parity",) if any(not r["ok"] for r in rec.data.get(k) or [])]
    bad += [k.removesuffix("_error") for k in rec.data if k.endswith("_error")]
    bad += ["smoke"] if rec.data.get("smoke", {}).get("exit_code", 0) != 0 else []
    for name in ("headline", "long", "gap"):  # the step must run (an out-of-memory step is a result: flagged, not a failure)
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
