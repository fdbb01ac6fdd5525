"""The GPU check's 1M-token section against the planner (issue 43), as pure functions of the run's records: the
planner's per-phase figures for the configuration the run chose (`planner_phases`, `backward_terms`), the probe's
records (bench/gpu_probe.py, `read_probe`), measured over predicted per phase, step and host with the flags past
FLAG (`compare`), and the step's engagement counters (`engagement`). bench/gpu.py runs the launches and calls these;
tests/e2e/test_bench_gpu.py checks them at the real 1M shape without a GPU."""

from __future__ import annotations

import json
import os

from planner.cluster import RUNTIME_HOST_GIB

GiB = 2**30
FLAG = 0.10  # measured / planner outside 1 +- this: flagged on the page as the planner's next fix


def engagement(records: list[dict]) -> dict | None:
    """The per-step engagement counters of issue 43 (model_utils/engagement.py: chunked attention, norm-output
    recompute, tiled MLP and logits, checkpoint offload), as train.py logs them in its step records
    (`engaged/<feature>`, `expected/<feature>`: the step's count and what the plan counts on): {feature: {"engaged",
    "expected"}} of the stage's last step, None where the step records carry none (a train.py before them, or a
    plan counting none). A feature that engaged fewer times than expected stops the run with one line naming it
    (training/stage.py), which the section records as its error."""
    steps = [r for r in records if "tokens_per_s" in r]
    last = steps[-1] if steps else {}
    names = sorted({k.split("/", 1)[1] for k in last if k.startswith(("engaged/", "expected/"))})
    return {n: {"engaged": last.get(f"engaged/{n}"), "expected": last.get(f"expected/{n}")} for n in names} or None


def _features_of(choice: dict):
    from planner.shapes import Features

    return Features.from_choice(choice)


def backward_terms(shape, tokens: int, b: int, f, flash: bool, checkpointed: bool = False) -> dict:
    """planner.memory_model.layer_phase_terms for one decoder layer of the run (sp = 1): what its attention's, its
    MLP's and a norm's backward hold beyond the saved sets (their gradients included), its recompute where
    `checkpointed`, the saved set and the largest phase (`transient`). `consistent`: the planner's layer_activations
    still returns that transient (it is built on the same terms)."""
    from planner import memory_model as mm

    lean, lean_mlp = mm.lean_norm_applies(shape, f), mm.lean_mlp_applies(shape, f)
    args = (shape, tokens, 1, b, f.tiled_mlp, lean, lean_mlp, 1, f.attention_head_chunks, flash)
    terms = mm.layer_phase_terms(*args, checkpointed=checkpointed)
    saved, transient = mm.layer_activations(*args, checkpointed=checkpointed)
    return {**terms, "consistent": (saved, transient) == (terms["saved"], terms["transient"])}


def planner_phases(model, length: int, choice: dict, device: str) -> dict:
    """The planner's figures for the run's own configuration (its memory_choice record), absolute bytes as
    max_memory_allocated reads them: resident R (sum of Estimate.gpu) + the phase. Per decoder layer i: one that kept
    its activations runs `mlp_backward` / `attention_backward` at R + that phase's term (layer_phase_terms); a
    checkpointed one (i % K == 0) first rebuilds its saved set in place of what the layers above it freed (base = R +
    the recompute phase less its largest term), then runs `recompute` (base + the recompute term), `mlp_backward`
    and `attention_backward` (base + theirs). `phase` is what the planner commits to for the layer (R + its phase:
    the largest term); `logits` R + the logits phase; `step` the peak. Host: the pinned blocks (ZeRO-3's parameter
    and gradient buffers with pin_memory, block by block as zero3_pinned_requests lists them, and offloaded
    checkpoints, as the host holds them) and every host term."""
    from planner.memory_model import estimate, load_shape

    shape = load_shape(model) if isinstance(model, str) else model  # a model folder or a ModelShape
    f = _features_of(choice)
    b = 2 if device == "cuda" else 4
    est = estimate(shape, length, 1, 1, f, "bf16" if b == 2 else "fp32", device=device, pinned_offloads=True)
    flash = device == "cuda"
    terms = backward_terms(shape, est.tokens_per_rank, b, f, flash=flash)
    terms_ck = backward_terms(shape, est.tokens_per_rank, b, f, flash=flash, checkpointed=True)
    R = sum(est.gpu.values())
    ph = est.gpu_phases
    every = f.every
    layers = {}
    for i in range(shape.num_layers):
        ckpt = bool(every) and i % every == 0
        t = terms_ck if ckpt else terms
        phase = ph["layer working set (recompute+backward)"] if ckpt else ph["layer working set (backward)"]
        base = R + (phase - t["transient"] if ckpt else 0)
        layers[i] = {"checkpointed": ckpt, "phase": R + phase, "mlp_backward": base + t["mlp"],
                     "attention_backward": base + t["attention"], "norm_backward": base + t["norm"]}
        if ckpt:
            layers[i]["recompute"] = base + t["recompute"]
    from planner.memory_model import HOST_ARENA

    # torch's pinned blocks (host_memory_stats) vs the host arena's exact-size registered slots (base/host_arena.py:
    # not in host_memory_stats; the offloaded checkpoints go there unless the planner's HOST_ARENA is off)
    arena_names = ("activation checkpoints",) if HOST_ARENA else ()
    pinned_names = ("params (partition)", "grads fp32 (partition)") + (() if HOST_ARENA else ("activation checkpoints",))
    return {"resident": R, "resident_terms": dict(est.gpu), "phases": dict(ph), "layers": layers,
            "logits": R + ph["logits + loss"], "step": est.gpu_peak, "peak_phase": est.peak_phase,
            "terms": terms, "terms_checkpointed": terms_ck, "host_terms": dict(est.cpu_per_rank),
            "host": sum(est.cpu_per_rank.values()),
            "pinned": sum(v for k, v in est.cpu_per_rank.items() if k in pinned_names) if device == "cuda" else 0,
            "arena": sum(v for k, v in est.cpu_per_rank.items() if k in arena_names) if device == "cuda" else 0}


def read_probe(path: str) -> list[dict]:
    """The rank's records of bench/gpu_probe.py (the process that recorded a layer's forward; the subprocesses a
    rank starts inherit the hooks and leave a record or two), in the order written."""
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        recs = [json.loads(ln) for ln in fh if ln.strip()]
    ranks = [r.get("pid") for r in recs if r["phase"] == "forward"]
    return [r for r in recs if r.get("pid") == ranks[0]] if ranks else []


def _ratio(measured, predicted) -> dict:
    if not measured or not predicted:
        return {"measured_gib": round(measured / GiB, 3) if measured else None,
                "planner_gib": round(predicted / GiB, 3) if predicted else None, "ratio": None, "flag": False}
    r = measured / predicted
    return {"measured_gib": round(measured / GiB, 3), "planner_gib": round(predicted / GiB, 3), "ratio": round(r, 3),
            "flag": abs(r - 1) > FLAG}


def split_by_time(probe: list[dict], stage_steps: list[list[dict]]) -> list[list[dict]]:
    """One launch's probe records split per stage at each stage's last step record's time; the segment
    after a stage's last backward (its input norm, the optimizer step) closes at the next stage's first event: it
    belongs to the stage it started in."""
    parts, start = [], 0.0
    for i, steps in enumerate(stage_steps):
        end = steps[-1]["time"] if steps and i + 1 < len(stage_steps) else float("inf")
        part = [r for r in probe if start < r.get("time", 0) <= end]
        while parts and part and part[0]["phase"] == "between" and "backward" in part[0].get("after", ""):
            parts[-1].append(part.pop(0))
        parts.append(part)
        start = end
    return parts


def segment_phase(rec: dict, n_layers: int) -> tuple[str, int]:
    """(phase, layer) of a `between` record (a segment while no probed phase was open), from the events around it:
    after a layer's MLP backward closes, its post-attention norm's backward (and the residual add) runs until its
    attention backward opens; after the attention backward closes, its input norm's backward, until the layer below
    opens (both `norm_backward`, which the planner's norm term bounds); after the last layer's forward, the logits
    and loss, forward and backward (`logits`); anything else (the embedding, the optimizer step, the exit) keeps
    `between`, with no planner figure."""
    after = rec.get("after", "")
    for closed in ("close mlp_backward L", "close attention_backward L"):
        if after.startswith(closed):
            return "norm_backward", int(after[len(closed):])
    if after == f"close forward L{n_layers - 1}":
        return "logits", -1
    return "between", -1


def compare(probe: list[dict], plan: dict, n_layers: int, usable_bytes: float | None = None) -> dict:
    """Measured per phase (the probe's records, every segment of the step: the probed phases, the norms' backward
    and the other between-phase segments) against planner_phases: rows for the page, flags past FLAG, and any
    segment whose peak exceeds `usable_bytes` (the run's own usable limit: the budget less its headroom) flagged
    whatever its ratio."""
    rows = []

    def row(rec: dict, phase: str, layer: int, predicted) -> dict:
        r = {"phase": phase, "layer": layer, "reserved_gib": round(rec["reserved"] / GiB, 3),
             "gap_gib": round((rec["reserved"] - rec["peak"]) / GiB, 3),
             "incl_gib": round(rec["peak_incl"] / GiB, 3), **_ratio(rec["peak"], predicted)}
        if rec["phase"] == "between":  # the events around it (the last layer's input norm runs up to the step's end)
            r["segment"] = f"{rec.get('after')} -> {rec.get('before')}"
            if phase == "norm_backward":
                r["norm"] = "post-attention" if "mlp_backward" in rec.get("after", "") else "input"
        if usable_bytes and rec["peak"] > usable_bytes:
            r["over_usable"] = True
        return r

    for rec in probe:
        if rec["phase"] in ("recompute", "mlp_backward", "attention_backward") and rec["layer"] in plan["layers"]:
            lay = plan["layers"][rec["layer"]]
            rows.append({**row(rec, rec["phase"], rec["layer"], lay.get(rec["phase"])),
                         "planner_phase_gib": round(lay["phase"] / GiB, 3)})
        elif rec["phase"] == "forward":
            rows.append(row(rec, "forward", rec["layer"], None))
        elif rec["phase"] == "between":
            phase, layer = segment_phase(rec, n_layers)
            predicted = plan["logits"] if phase == "logits" else \
                plan["layers"].get(layer, {}).get("norm_backward") if phase == "norm_backward" else None
            rows.append(row(rec, phase, layer, predicted))
    last = probe[-1] if probe else {}
    # the step: every segment is in some record (a phase's, or "between" when none was open)
    top = max([r["peak_incl"] for r in probe] or [0])
    top_reserved = max([r["reserved_incl"] for r in probe] or [0])
    step = {**_ratio(top, plan["step"]), "reserved_gib": round(top_reserved / GiB, 3),
            "gap_gib": round((top_reserved - top) / GiB, 3)}
    # host: the most the caching host allocator held (active + cached, rounded blocks: it never gives them back)
    # and the process' peak RSS (VmHWM on a GPU run; the CPU stand-in resets it, so there the largest RSS read)
    held = max([(r.get("pinned") or {}).get("allocated_bytes.current", 0) for r in probe] or [0]) or None
    rss = max([r.get("rss_hwm") or r.get("rss") or 0 for r in probe] or [0]) or None
    host = {"pinned": _ratio(held, plan["pinned"]) | {"stats": last.get("pinned") or {}},
            "rss": _ratio(rss, plan["host"] + RUNTIME_HOST_GIB * GiB) | {
                "note": f"peak RSS against the planner's host terms + the {RUNTIME_HOST_GIB} GiB of runtime measured on "
                        "the GPU run of 2026-11-28 (planner/cluster.RUNTIME_HOST_GIB, plan.py's --cpu_overhead_gb)"}}
    # the host arena (bench/gpu_probe.py records base/host_arena.STATS and its path): the most it registered against
    # the plan's exact bytes; a fallback to torch's rounded pinned blocks is a saving that did not engage
    registered = max([(r.get("arena") or {}).get("registered_bytes", 0) for r in probe] or [0]) or None
    arena_path = (last.get("arena") or {}).get("path")
    fallbacks = max([(r.get("arena") or {}).get("fallbacks", 0) for r in probe] or [0])
    if plan.get("arena") or registered:
        host["arena"] = _ratio(registered, plan.get("arena")) | {"path": arena_path, "fallbacks": fallbacks}
        host["arena"]["flag"] = host["arena"]["flag"] or bool(fallbacks) or arena_path not in (None, "registered")
    errors = sorted({e for r in probe for e in r.get("errors", [])})
    over = [f"{r['phase']} L{r['layer']}" for r in rows if r.get("over_usable")]
    if usable_bytes and top > usable_bytes:
        step["over_usable"] = True
        over.append("step")
    flags = [f"{r['phase']} L{r['layer']}" for r in rows if r["flag"]] + (["step"] if step["flag"] else []) + \
        (["pinned"] if host["pinned"]["flag"] else []) + (["arena"] if host.get("arena", {}).get("flag") else [])
    kernels = last.get("attention_kernels") or {}
    return {"rows": rows, "step": step, "host": host, "probe_errors": errors, "flags": flags,
            "over_usable": over, "usable_gib": round(usable_bytes / GiB, 3) if usable_bytes else None,
            "attention_kernels": kernels}
