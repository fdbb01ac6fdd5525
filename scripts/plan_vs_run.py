"""The planner NOW against a measured GPU run (issue 49: the planner's figures say what is fitted and what is
predicted out of sample, and the docs quote only current figures).

    python scripts/plan_vs_run.py bench/results/gpu.json                  # the `headline` section
    python scripts/plan_vs_run.py my_gpu.json --section long --model path/to/config.json

For the run a bench.gpu section recorded (its model, length and `memory_choice`: the features and offloads it ran
with), it prints each probed segment's measured peak (GiB, max_memory_allocated, as the JSON holds it) beside what
this checkout's planner predicts for that configuration and length, recomputed here through planner/ (the same
arithmetic as bench/gpu_compare.planner_phases, which tests/unit/planner/test_plan_vs_run.py holds it to), the
ratio, the planner's figure as recorded with the run, and for each of the two figures whether it is FITTED to this
run or predicted OUT OF SAMPLE: the figure recorded with the run predates its measurement; the planner now may hold
terms re-derived since, so it is out of sample only where it still gives the run's figure ("revised after the run"
otherwise); then the host (pinned blocks, arena, peak RSS) and the step time the same way.
docs/memory_model_checks.md's out-of-sample table is this output (scripts/doc_figures.py regenerates it). A file without
the section, or a section with nothing measured, is refused in one line (exit 2).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import NoReturn

from planner.auto_features import usable_bytes
from planner.cluster import RUNTIME_HOST_GIB
from planner.memory_model import (
    HOST_ARENA,
    ModelShape,
    estimate,
    layer_phase_terms,
    lean_mlp_applies,
    lean_norm_applies,
    load_shape,
)
from planner.presets import PRESETS
from planner.shapes import Features
from planner.step_time import MEASURED, measured_mfu, step_time

GiB = 2**30
# The run the planner's per-phase GPU terms (and ZeRO-3's pinned requests) were fitted to: the H200 run of
# 2026-11-27 (docs/memory_model_checks.md: 1,048,576 tokens, 2 layers, one checkpointed, 16 head chunks, only the optimizer
# offloaded). A memory row is "fitted" only against that configuration; any other run tests them out of sample.
MEMORY_FIT = {"length": 1_048_576, "checkpoint_every": 2, "attention_head_chunks": 16, "offload_params": False}
# bench/gpu.py's saved model (save_model: Llama-3-8B's width and vocabulary, N decoder layers); the JSON names the
# folder, not its config, so the shape is read from the name
BENCH_MODEL = re.compile(r"llama3_8b_shape_l(\d+)$")
LABELS = {"recompute": "recomputed forward", "mlp_backward": "MLP backward", "attention_backward": "attention backward",
          "norm_backward post-attention": "norm backward, post-attention", "norm_backward input": "norm backward, input",
          "logits": "logits + loss"}


def refuse(msg: str) -> NoReturn:
    raise ValueError(msg)


def read_section(path: str, section: str) -> dict:
    """The section of a bench.gpu JSON that holds a probed run (rows, memory_choice, length); ValueError (one line)."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError) as err:  # ValueError: JSONDecodeError, or UnicodeDecodeError (not UTF-8)
        refuse(f"{path}: not a readable JSON file ({type(err).__name__}): give bench/results/gpu.json or a "
               "`python -m bench.gpu --out` file")
    if not isinstance(data, dict) or not isinstance(data.get(section), dict):
        have = sorted(k for k, v in data.items() if isinstance(v, dict) and "rows" in v) if isinstance(data, dict) else []
        refuse(f"{path}: no {section!r} section (sections with a probed run: {', '.join(have) or 'none'}): give a "
               f"bench.gpu JSON run with --sections {section}, or --section one of those")
    sec = data[section]
    missing = [k for k in ("rows", "memory_choice", "length", "model") if not sec.get(k)]
    if missing:
        refuse(f"{path}: section {section!r} has no {', '.join(missing)} (error: {sec.get('error', 'none recorded')}): "
               "nothing measured to set against the planner")
    if not (isinstance(sec["length"], int) and isinstance(sec["rows"], list) and isinstance(sec["memory_choice"], dict)
            and all(isinstance(r, dict) for r in sec["rows"])):
        refuse(f"{path}: section {section!r} is not as bench.gpu writes it (length an integer, rows a list of records, "
               "memory_choice a record): give the file bench.gpu wrote")
    sec["device"] = "cpu" if (data.get("environment") or {}).get("dry") else "cuda"
    return sec


def run_shape(sec: dict, model: str | None) -> ModelShape:
    if model:
        return load_shape(model)
    m = BENCH_MODEL.match(str(sec["model"]))
    if not m:
        refuse(f"model {sec['model']!r}: not a model bench/gpu.py saves (llama3_8b_shape_l<N>): pass --model (a "
               "preset or a config.json path) with the run's shape")
    return ModelShape.from_config(dict(PRESETS["llama3-8b"], num_hidden_layers=int(m.group(1))))


def planner_now(shape: ModelShape, length: int, f: Features, device: str) -> dict:
    """The planner's figures (bytes) for the run's configuration, as bench/gpu_compare.planner_phases computes them:
    per layer the recompute / MLP / attention / norm backward (a checkpointed layer's on the base its recompute
    rebuilds), the logits, the step's peak and its phase, and the host (pinned blocks, arena, every host term)."""
    b = 2 if device == "cuda" else 4
    est = estimate(shape, length, 1, 1, f, "bf16" if b == 2 else "fp32", device=device, pinned_offloads=True)
    args = (shape, est.tokens_per_rank, 1, b, f.tiled_mlp, lean_norm_applies(shape, f), lean_mlp_applies(shape, f), 1,
            f.attention_head_chunks, device == "cuda")
    resident, ph = sum(est.gpu.values()), est.gpu_phases
    layers = {}
    for i in range(shape.num_layers):
        ckpt = bool(f.every) and i % f.every == 0
        t = layer_phase_terms(*args, checkpointed=ckpt)
        phase = ph["layer working set (recompute+backward)" if ckpt else "layer working set (backward)"]
        base = resident + (phase - t["transient"] if ckpt else 0)
        layers[i] = {k: base + t[term] for k, term in (("mlp_backward", "mlp"), ("attention_backward", "attention"),
                                                      ("norm_backward", "norm"))}
        if ckpt:
            layers[i]["recompute"] = base + t["recompute"]
    host = est.cpu_per_rank
    arena = ("activation checkpoints",) if HOST_ARENA else ()
    pinned = ("params (partition)", "grads fp32 (partition)") + (() if HOST_ARENA else ("activation checkpoints",))
    gpu = device == "cuda"
    return {"layers": layers, "logits": resident + ph["logits + loss"], "step": est.gpu_peak,
            "peak_phase": est.peak_phase, "host": sum(host.values()),
            "pinned": sum(v for k, v in host.items() if k in pinned) if gpu else 0,
            "arena": sum(v for k, v in host.items() if k in arena) if gpu else 0}


def segment_rows(sec: dict, now: dict) -> list[dict]:
    """One row per kind of segment the planner predicts, in the step's order, the layers whose figures agree (to the
    hundredth of a GiB) in one row; the forward and the other between-phase segments have no planner figure."""
    groups: dict[str, list] = {}
    for r in sec["rows"]:
        phase, layer = r.get("phase"), r.get("layer")
        if phase in ("recompute", "mlp_backward", "attention_backward", "norm_backward"):
            pred = now["layers"].get(layer, {}).get(phase)
            key = f"{phase} {r['norm']}" if phase == "norm_backward" and r.get("norm") else phase
        elif phase == "logits":
            pred, key = now["logits"], "logits"
        else:
            continue
        if pred is not None and r.get("measured_gib") is not None:
            groups.setdefault(key, []).append((layer, r["measured_gib"], pred / GiB, r.get("planner_gib")))
    out = []
    for key, items in groups.items():
        same = len({(round(m, 2), round(p, 2)) for _, m, p, _ in items}) == 1
        for part in [items] if same else [[it] for it in items]:
            where = "" if key == "logits" else " (" + ", ".join(f"L{it[0]}" for it in part) + ")"
            _, m, p, then = part[0]
            out.append({"segment": LABELS.get(key, key) + where, "measured": m, "now": p, "then": then})
    return out


def fitted(sec: dict, f: Features) -> bool:
    """Whether the run is the one the per-phase GPU terms were fitted to (MEMORY_FIT)."""
    return sec["length"] == MEMORY_FIT["length"] and all(getattr(f, k) == v for k, v in MEMORY_FIT.items() if k != "length")


def table(path: str, section: str = "headline", model: str | None = None) -> str:
    """The markdown the docs quote: a line naming the run, then the table; ValueError (one line) for a bad file."""
    sec = read_section(path, section)
    try:
        return _table(path, section, sec, model)
    except (KeyError, TypeError, AttributeError) as err:  # a field of another type or missing, in a hand-edited file
        refuse(f"{path}: section {section!r} is not as bench.gpu writes it ({type(err).__name__}: {err}): give the "
               "file bench.gpu wrote")


def _table(path: str, section: str, sec: dict, model: str | None) -> str:
    shape = run_shape(sec, model)
    choice = sec["memory_choice"]
    try:
        f = Features.from_choice(choice)
    except ValueError as err:
        refuse(f"{path}: section {section!r}'s memory_choice: {err}")
    now = planner_now(shape, sec["length"], f, sec["device"])
    memory = "fitted to this run" if fitted(sec, f) else None
    rows = segment_rows(sec, now)
    step = sec.get("step") or {}
    rows.append({"segment": f"the step (planner: {now['peak_phase']})", "measured": step.get("measured_gib"),
                 "now": now["step"] / GiB, "then": step.get("planner_gib")})
    lines = ["| segment, GiB allocated | measured | planner now | ratio | planner now is | planner at the run | "
             "planner at the run is |", "|---|---|---|---|---|---|---|"]

    def line(name: str, measured, pred, then, basis: str | None, fmt: str = ".2f") -> None:
        """basis: what the planner's figures are fitted to (None: to no run of this configuration). The figure
        recorded with the run predates its measurement: out of sample unless fitted; the planner now may hold terms
        re-derived since (the norm's of 2026-11-28), so only a figure unchanged since the run is out of sample."""
        ratio = f"{measured / pred:.3f}" if measured and pred else "-"
        show = [format(x, fmt) if x is not None else "-" for x in (measured, pred, then)]
        if basis:
            now_is = basis
        elif then is None:
            now_is = "unknown (no figure at the run)"
        else:
            now_is = "out of sample (as at the run)" if show[1] == show[2] else "revised after the run"
        then_is = "-" if then is None else ("fitted to this run" if basis == "fitted to this run" else "out of sample")
        lines.append(f"| {name} | " + " | ".join([*show[:2], ratio, now_is, show[2], then_is]) + " |")

    for r in rows:
        line(r["segment"], r["measured"], r["now"], r["then"], memory)
    host = sec.get("host") or {}
    for key, name in (("pinned", "host: pinned blocks"), ("arena", "host: arena (registered)")):
        if (host.get(key) or {}).get("measured_gib") is not None:
            line(name, host[key]["measured_gib"], now[key] / GiB, host[key].get("planner_gib"), memory)
    rss = host.get("rss") or {}
    if rss.get("measured_gib") is not None:
        # the runtime (RUNTIME_HOST_GIB) is fitted to the run whose peak RSS less its host terms (as the planner then
        # counted them) it equals
        recorded = sum(((sec.get("planner") or {}).get("host_terms_gib") or {}).values())
        own = recorded and round(rss["measured_gib"] - recorded, 2) == RUNTIME_HOST_GIB
        line(f"host: peak RSS (host terms + {RUNTIME_HOST_GIB} GiB of runtime)", rss["measured_gib"],
             now["host"] / GiB + RUNTIME_HOST_GIB, rss.get("planner_gib"),
             "runtime fitted to this run" if own else memory)
    if sec.get("step_s"):
        # planner/step_time.MEASURED names the run its MFU is fitted to: this one where the model, length and time agree
        same = MEASURED["seq_len"] == sec["length"] and abs(MEASURED["step_s"] - sec["step_s"]) < 0.01 and \
            ModelShape.from_config(MEASURED["model"]) == shape
        pred = step_time(shape, sec["length"], 1, f, world=1, ranks_per_node=1)
        line(f"step time, s (MFU {measured_mfu()})", sec["step_s"], pred, choice.get("predicted_step_s"),
             "MFU fitted to this run" if same else None, ".1f")
    usable = usable_bytes(int(choice["budget_gb"] * GiB)) / GiB if choice.get("budget_gb") else None
    feats = ", ".join(k for k in ("tiled_mlp", "tiled_logits", "offload_activations", "offload_params",
                                  "offload_optimizer") if getattr(f, k))
    head = (f"{path} `{section}`: {sec['model']} ({shape.num_layers} layers), {sec['length']:,} "
            f"tokens, {sec['device']}, checkpoint_every {f.checkpoint_every}, {f.attention_head_chunks} head chunks, "
            f"{feats}; usable {f'{usable:.2f} GiB' if usable else 'not recorded'}")
    kernels = ", ".join(sec.get("attention_kernels") or {}) or "not recorded"
    return "\n".join([head + f"; attention {kernels}.", "", *lines]) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", help="a bench.gpu JSON (bench/results/gpu.json)")
    p.add_argument("--section", default="headline", help="its section that holds the probed run (default headline)")
    p.add_argument("--model", help="the run's shape (a preset or a config.json path), where the JSON's model is not "
                                   "bench/gpu.py's llama3_8b_shape_l<N>")
    args = p.parse_args(argv)
    sys.stdout.write(table(args.results, args.section, args.model))
    return 0


if __name__ == "__main__":
    from base.exits import EXIT_USAGE

    try:
        sys.exit(main())
    except ValueError as err:  # the user's input: one line, exit 2 as every script (base/exits.py)
        print(f"error: {err}", file=sys.stderr)
        sys.exit(EXIT_USAGE)
