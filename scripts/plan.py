"""Memory planner: will this model train at this sequence length on this cluster, and with which settings?

Prints the per-GPU memory breakdown (ZeRO-3 model states, activation checkpoints, one layer's working set,
logits, communication buffers), per-node CPU memory, which sequence-parallel degrees fit, the DeepSpeed
config and recipe stage to use, a FLOPs-based tokens/s/GPU, and the SP communication per layer against the
attention compute. SP = ulysses x cp: `--cp auto` (the default, as train.py's context_parallel_size) takes
Ulysses as large as the heads and a node allow, and shows pure Ulysses (cp 1) next to it where that exists;
`--cp N` or `--ulysses N` fix the split. One length's plan is planner/length_plan.py's; the formulas live in
planner/memory_model.py and planner/comm_model.py and are derived in docs/memory_model.md.

    python scripts/plan.py --model llama3-8b --seq_len 128k,1M --nodes 4 --gpus_per_node 8 --alst
    python scripts/plan.py --model qwen2.5-7b --seq_len 1M --nodes 4 --sp 8 --alst      # 8 = 4 x 2
    python scripts/plan.py --model path/to/config.json --seq_len 262144 --sp 8 --cp 1 --no-offload_params --json
    python scripts/plan.py --compare     # Llama-3-8B's longest on 1/8/32 GPUs next to ALST's and UPipe's (Markdown)
    python scripts/plan.py --alst_check  # ALST's published runs against the planner with their features (Markdown)

Memory flags are GiB (2**30). A GPU fits where its peak is within the run's own rule
(planner.auto_features.usable_bytes): --gpu_mem_gb less 2 GiB (CUDA context, NCCL, kernel workspaces) less 10%
headroom (allocator fragmentation, planner error); 80 GiB -> 70.2 GiB. The same rule `memory_features: auto` applies
at every run's start-up, so a length shown here is one a run accepts. (A device that reports 79.6 GiB, as an
"80GB" H100 may, gets 0.4 GiB less: give --gpu_mem_gb what torch.cuda.get_device_properties reports.)
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

import yaml

from planner.auto_features import GPU_RESERVED, HEADROOM, gpu_budget
from planner.cluster import RUNTIME_HOST_GIB, Planner, split_label
from planner.flops import tokens_per_sec_per_gpu
from planner.length_plan import (  # noqa: F401  (ds_recommendation: the tests read it here)
    auto_plan,
    ds_recommendation,
    page_locked_gib,
    plan_one,
)
from planner.memory_model import Estimate, Features, GiB, load_shape, parse_seq_len, positive_flag
from planner.shapes import ROPE_MAX_POSITIONS
from planner.step_time import HOUR_S, KERNEL_TFLOPS, MEASURED, TRAINABLE_S, duration, measured_mfu, step_time
from planner.trainable import ALST, AutoRun, longest_trainable

FEATURES = ("offload_params", "offload_optimizer", "tiled_mlp", "tiled_logits", "gradient_checkpointing",
            "offload_activations", "lean_rmsnorm", "lean_mlp", "keep_attention", "ring_attention")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="plan.py --compare [options]: the longest "
                                "Llama-3-8B length on 1 / 8 / 32 GPUs with its step time, and per GPU count the "
                                "longest whose step stays within 15 min; plan.py --alst_check: ALST's published runs")
    p.add_argument("--model", required=True, help="preset name (planner/presets.py) or config.json path")
    p.add_argument("--seq_len", required=True, help="tokens per sample: 131072, 128k, 1M; a comma list plans each")
    p.add_argument("--gpus_per_node", type=int, default=8)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpu_mem_gb", type=float, default=80.0)
    p.add_argument("--cpu_mem_gb", type=float, default=1024.0, help="CPU memory per node")
    p.add_argument("--cpu_overhead_gb", type=float, default=RUNTIME_HOST_GIB,
                   help="runtime CPU memory per rank beyond the planner's host terms (default: the GPU run's measured "
                        "1.98 GiB, planner/cluster.RUNTIME_HOST_GIB)")
    p.add_argument("--alloc_conf", default="",
                   help="the run's PYTORCH_ALLOC_CONF: its pinned_max_cached_size_mb / pinned_max_round_threshold_mb set "
                        "where pinned host blocks stop being rounded up to a power of two (default: torch's, all are)")
    p.add_argument("--sp", default="auto", help="sequence-parallel degree, or auto: every valid degree")
    split = p.add_mutually_exclusive_group()
    split.add_argument("--cp", default="auto",
                       help="context-parallel factor of sp (sp = ulysses x cp); auto (default): Ulysses as large as "
                            "the heads and --gpus_per_node allow, pure Ulysses shown next to it where it exists")
    split.add_argument("--ulysses", type=int, default=None, help="Ulysses factor of --sp instead of --cp (needs --sp N)")
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--offload_params", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--offload_optimizer", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--async_save", action=argparse.BooleanOptionalAction, default=False,
                   help="train.py --async_save: a host copy of each rank's checkpoint (12 B/param / world) for its "
                        "background saves")
    p.add_argument("--lean_rmsnorm", action=argparse.BooleanOptionalAction, default=True,
                   help="train.py's lean RMSNorm (its default; --no-lean_rmsnorm: Hugging Face's)")
    p.add_argument("--lean_mlp", action=argparse.BooleanOptionalAction, default=True,
                   help="train.py's lean gated MLP (its default; --no-lean_mlp: Hugging Face's)")
    for name in ALST:
        p.add_argument(f"--{name}", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--keep_attention", action=argparse.BooleanOptionalAction, default=None,
                   help="checkpointed layers keep the attention output (needs checkpointing); with --auto, "
                        "--no-keep_attention keeps auto from choosing it")
    p.add_argument("--ring_attention", action=argparse.BooleanOptionalAction, default=False,
                   help="train.py --ring_attention: under cp > 1 K/V pass around the cp group block by block instead "
                        "of being gathered whole (model_utils/ring_attention.py; on a GPU flash-attn's FA2, sdpa on CPU)")
    p.add_argument("--attention_head_chunks", default="1",
                   help="attention N chunks of heads at a time (model_utils/head_chunks.py); per SP split the largest "
                        "valid count <= N; max: every head per rank alone")
    p.add_argument("--alst", action="store_true", help="turn on " + ", ".join(ALST))
    p.add_argument("--auto", action="store_true",
                   help="also show what train.py's memory_features auto picks per length (features on the command "
                        "line stay on; --sp auto: the smallest SP that fits) and its tokens/s vs all features")
    p.add_argument("--margin", type=float, default=0.15,
                   help="recommend the smallest SP whose GPU peak leaves this fraction of usable memory free")
    p.add_argument("--mfu", type=float, default=0.4)
    p.add_argument("--gpu_tflops", type=float, default=989.0, help="peak dense TFLOPs (H100 SXM bf16: 989)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    return p


def plan(argv: list[str] | None = None) -> dict:
    """The whole plan as a JSON-able dict; ValueError (one line) on bad input."""
    return make_plan(build_parser().parse_args(argv))


def make_plan(args: argparse.Namespace) -> dict:
    for name in ("gpus_per_node", "nodes", "gpu_mem_gb", "cpu_mem_gb", "mfu", "gpu_tflops"):  # nan / inf too
        positive_flag(name, getattr(args, name), "use a finite number > 0 (--help: its meaning and default)")
    positive_flag("cpu_overhead_gb", args.cpu_overhead_gb, "use a size >= 0 (GiB per rank)", zero_ok=True)
    if not 0 <= args.margin < 1:
        raise ValueError(f"--margin {args.margin}: use a fraction in [0, 1)")
    if args.mfu > 1:
        raise ValueError(f"--mfu {args.mfu}: use a fraction in (0, 1]")
    chunks = str(args.attention_head_chunks)
    if chunks != "max" and (not chunks.isdigit() or int(chunks) < 1):
        raise ValueError(f"--attention_head_chunks {chunks!r}: use an integer >= 1 or max")
    if not any(s.strip() for s in args.seq_len.split(",")):
        raise ValueError(f"--seq_len {args.seq_len!r}: give a length (131072, 128k, 1M) or a comma list")
    if gpu_budget(args.gpu_mem_gb) <= 0:
        raise ValueError(f"--gpu_mem_gb {args.gpu_mem_gb}: at least {GPU_RESERVED / GiB:g} GiB are the runtime's")
    shape = load_shape(args.model)
    feats = Features.of({k: getattr(args, k) or (args.alst and k in ALST) for k in FEATURES})
    pl = Planner(args, shape, feats)
    seqs = [parse_seq_len(s) for s in args.seq_len.split(",") if s.strip()]
    plans = [plan_one(pl, s, max(seqs)) for s in seqs]
    if args.auto:
        for p, seq_len in zip(plans, seqs):
            p["auto"] = auto_plan(args, shape, pl.world, seq_len)
    return dict(model=args.model, shape=vars(shape) | dict(params=shape.num_params()), precision=args.precision,
                cluster=dict(nodes=args.nodes, gpus_per_node=args.gpus_per_node, world=pl.world,
                             gpu_mem_gib=args.gpu_mem_gb, gpu_usable_gib=pl.gpu_limit / GiB,
                             gpu_budget_gib=gpu_budget(args.gpu_mem_gb) / GiB, headroom=HEADROOM,
                             cpu_mem_gib_per_node=args.cpu_mem_gb, gpu_tflops=args.gpu_tflops),
                features=vars(feats), margin=args.margin, plans=plans)


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _gib(x: float) -> str:
    return f"{x / GiB:8.2f}"


def render(rep: dict) -> str:
    s, c = rep["shape"], rep["cluster"]
    on = [k for k, v in rep["features"].items() if v] or ["none"]
    lines = [f"model {rep['model']}: {_count(s['params'])} params, {s['num_layers']} layers, h={s['hidden_size']}, "
             f"{s['num_heads']}/{s['num_kv_heads']} q/kv heads, vocab {s['vocab_size']}; {rep['precision']}",
             f"cluster: {c['nodes']} node(s) x {c['gpus_per_node']} GPUs = {c['world']} ranks; GPU {c['gpu_mem_gib']:g} "
             f"GiB ({c['gpu_usable_gib']:.1f} usable), CPU {c['cpu_mem_gib_per_node']:g} GiB/node",
             f"features: {' '.join(on)}",
             "attention: flash/SDPA-flash, no seq^2 term; sp = u x cp: after the all-to-all q,o hold seq/cp tokens with "
             "heads/u, k,v the full seq (gathered over cp) with kv_heads/u (at least 1)"]
    for p in rep["plans"]:
        lines += ["", f"== seq_len {p['seq_len']:,} ==",
                  f"{'sp=uxcp':>9} {'tokens/rank':>12} {'GPU peak GiB':>13} {'GPU':>4} {'CPU/node GiB':>13} {'CPU':>4}"
                  f" {'longest that fits':>18} {'comm/layer fwd+bwd':>19} {'step':>10} {'tok/s/GPU':>10}"
                  f" {'page-locked/node':>17}"]
        for r in p["candidates"]:
            e, m = r["estimate"], r["comm_per_layer"]
            lines.append(f"{split_label(r['sp'], r['cp']):>9} {e['tokens_per_rank']:>12,} {_gib(e['gpu_peak']):>13} "
                         f"{'yes' if r['fits_gpu'] else 'NO':>4} {_gib(e['cpu_per_node']):>13} "
                         f"{'yes' if r['fits_cpu'] else 'NO':>4} {r['longest_fitting_seq_len']:>18,} "
                         f"{(m['fwd_s'] + m['bwd_s']) * 1e3:>10.1f} ms {m['exposed_share']:>5.1%} "
                         f"{duration(r['step_s']) + ('!' if r['step_s'] > HOUR_S else ''):>10} "
                         f"{r['measured_tokens_per_sec_per_gpu']:>10,.0f} "
                         f"{r['page_locked_gib_per_node']:>13,.0f} GiB")
        if any(r["longest_fitting_seq_len"] == ROPE_MAX_POSITIONS for r in p["candidates"]):
            lines.append(_CAP)
        lines.append(f"step, tok/s/GPU: at the measured FLOP rate (MFU {measured_mfu()}, fitted to the one GPU run: "
                     f"planner/step_time.py, reused at --gpu_tflops {c['gpu_tflops']:g}; the ring's attention at "
                     "FlashAttention-2's rate, the rest's at cuDNN's), one sequence per SP group; ! marks a step over "
                     "an hour")
        lines.append(_within_line(p))
        lines.append(f"SP degrees that fit: {p['fitting_sp'] or 'none'}; recommended: {p['recommended_sp']} (smallest "
                     f"that fits with {rep['margin']:.0%} of usable GPU memory to spare, else smallest that fits)")
        if "fits_with_all_features_at_sp" in p:
            lines.append(f"with --alst and both offloads it would fit at sp: {p['fits_with_all_features_at_sp']}")
        sp = p["recommended_sp"] or p["throughput"]["at_sp"]
        cp = p["recommended_split"][2] if p["recommended_split"] else None
        row = next(r for r in p["candidates"] if r["sp"] == sp and cp in (None, r["cp"]))
        e = row["estimate"]
        lines.append(f"per-GPU breakdown at sp={split_label(sp, row['cp'])} (GiB):")
        lines += [f"  {k:<42}{_gib(v)}" for k, v in e["gpu"].items()]
        lines.append("  + the largest of these phases:")
        lines += [f"  {k:<42}{_gib(v)}{'  <- peak' if k == e['peak_phase'] else ''}"
                  for k, v in e["gpu_phases"].items()]
        lines.append(f"  {'= peak':<42}{_gib(e['gpu_peak'])}  of {c['gpu_usable_gib']:.1f} usable")
        if e.get("eval_gpu_peak"):
            ev = max(e["eval_phases"], key=e["eval_phases"].get)
            fits = "fits" if e["eval_gpu_peak"] <= c["gpu_usable_gib"] * GiB else "does NOT fit"
            lines.append(f"  {'evaluation peak (' + ev[6:] + ')':<42}{_gib(e['eval_gpu_peak'])}  {fits}, no autograd")
        if "eval_at_longest" in row:  # a stage evaluates with its own split at every length it asks (eval.lengths)
            a = row["eval_at_longest"]
            lines.append(f"  {'evaluation at ' + format(a['seq_len'], ',') + ' tokens':<42}{_gib(a['eval_gpu_peak'])}  "
                         f"{'fits' if a['fits'] else 'does NOT fit'} (eval.lengths all, or a list naming it, asks it)")
        lines.append("per-node CPU (GiB, per rank x GPUs per node):")
        lines += [f"  {k:<42}{_gib(v * c['gpus_per_node'])}" for k, v in e["cpu_per_rank"].items()]
        lines.append(f"  {'= per node':<42}{_gib(e['cpu_per_node'])}  of {c['cpu_mem_gib_per_node']:g}")
        lines += _comm_lines(row)
        t = p["throughput"]
        lines.append(f"throughput: {t['formula']} = {t['flops_per_sequence']:.3g} ({t['attention_share']:.0%} "
                     f"attention); these FLOPs alone at --mfu {t['mfu']} of {t['gpu_tflops']:g} TFLOPs: "
                     f"{t['tokens_per_sec_per_gpu']:,.0f} tokens/s/GPU, {t['seconds_per_sequence']:.1f} s/sequence (an "
                     "assumption without the recompute and offloads; the step column is the estimate)")
        lines.append(f"DeepSpeed config: {p['deepspeed_config']}"
                     + (f" with overrides {json.dumps(p['deepspeed_overrides'])}" if p["deepspeed_overrides"] else ""))
        lines.append("recipe:" if p["recommended_sp"] else "recipe (does NOT fit; for reference):")
        lines += ["  " + ln for ln in yaml.safe_dump(p["recipe"], sort_keys=False).splitlines()]
        if "auto" in p:
            lines.append(_auto_line(p["auto"]))
    return "\n".join(lines)


_CAP = (f"longest lengths stop at {ROPE_MAX_POSITIONS:,} (2**24): float32 RoPE positions collapse past it (HF, vLLM, "
        "Meta's reference), and a run refuses a longer stage (planner/shapes.ROPE_MAX_POSITIONS)")


def _within_line(p: dict) -> str:
    """The longest length a run would train at: its step within TRAINABLE_S (planner/trainable.py)."""
    w, where = p["within_15_min_at"], "the recommended split" if p["recommended_sp"] else "the largest split"
    if not w:
        return f"longest length whose step takes at most {duration(TRAINABLE_S)}: none (nothing fits at {where})"
    return (f"longest length whose step takes at most {duration(TRAINABLE_S)} (what a run would train at; --compare: per "
            f"GPU count): {w['seq_len']:,} at {where}, sp={split_label(w['sp'], w['cp'])}, {duration(w['step_s'])} a "
            f"step, with memory_features auto's choice there (the features on the command line pinned): {w['features']}"
            + ("" if p["recommended_sp"] else f"; at {p['seq_len']:,} these features fit no split"))


def _comm_lines(row: dict) -> list[str]:
    """The SP collectives of one layer at a row's split, against the layer's compute (planner/comm_model.py)."""
    m = row["comm_per_layer"]
    if not m["collectives"]:
        return ["SP communication per layer: none (sp=1)"]
    out = [f"SP communication per layer and rank at sp={split_label(row['sp'], row['cp'])} (ulysses {m['ulysses']} x "
           f"cp {m['cp']}), forward (backward the same; a recomputed layer repeats the forward):"]
    out += [f"  {c['name']:<42}{c['group']:>3} ranks over {c['link']:<9} {c['fwd_bytes'] / 1e9:8.3f} GB "
            f"{c['fwd_s'] * 1e3:8.2f} ms" for c in m["collectives"]]
    out.append(f"  vs attention {m['attention_fwd_s'] * 1e3:,.1f} ms forward, {m['attention_bwd_s'] * 1e3:,.1f} ms "
               f"backward; the whole layer {m['compute_s'] * 1e3:,.1f} ms: "
               + ("hidden if overlapped (shorter than the attention of each pass)" if m["hidden"]
                  else "NOT hidden (longer than the attention of a pass)")
               + f"; {m['exposed_share']:.1%} of the layer's time if not overlapped")
    return out


def _auto_line(a: dict) -> str:
    if "error" in a:
        return f"memory_features auto: {a['error']}"
    return (f"memory_features auto: {a['features']} at sp={split_label(a['sp'], a['cp'])}; predicted peak {a['predicted_peak_gb']:.1f} of "
            f"{a['budget_gb']:.1f} GiB; ~{a['tokens_per_sec_per_gpu']:,.0f} tokens/s/GPU (recompute included) vs "
            f"~{a['all_features_tokens_per_sec_per_gpu']:,.0f} with all features "
            f"(x{a['tokens_per_sec_per_gpu'] / a['all_features_tokens_per_sec_per_gpu']:.2f})")


# Published figures for Llama-3-8B, bf16, 80 GB H100s: ALST (Bekman et al., 2025: 500K on 1 GPU, 3.7M on 8, 15M on
# 32) and UPipe ("Untied Ulysses", 2026: 5M on one node of 8). Quoted, not computed.
PUBLISHED = {1: {"ALST": 500_000}, 8: {"ALST": 3_700_000, "UPipe": 5_000_000}, 32: {"ALST": 15_000_000}}
COMPARE_SETUPS = ((1, 1, 1024.0), (8, 1, 2048.0), (32, 4, 2048.0))  # (GPUs, nodes, host GiB per node)


def compare(model: str = "llama3-8b", extra: list[str] | None = None) -> list[dict]:
    """This project's longest Llama-3-8B sequence on 1 / 8 / 32 80 GB GPUs (ALST features, every head per rank in
    its own chunk, context-parallel K/V in a ring where cp > 1 as memory_features auto takes it where the gather
    does not fit, the host budget of COMPARE_SETUPS), with the cost model's throughput there and its step time at
    the measured FLOP rate (planner/step_time.py: fitted to the one GPU run), next to the PUBLISHED figures; and
    the longest length whose step takes at most TRAINABLE_S at the same split with memory_features auto's choice at
    that length (planner/trainable.py; --alst's features pinned). One row per setup."""
    from planner.auto_features import relative_speed

    rows = []
    for gpus, nodes, host in COMPARE_SETUPS:
        argv = ["--model", model, "--seq_len", "1M", "--alst", "--attention_head_chunks", "max", "--ring_attention",
                "--gpus_per_node", str(gpus // nodes), "--nodes", str(nodes), "--cpu_mem_gb", str(host)] + (extra or [])
        args = build_parser().parse_args(argv)
        rep = make_plan(args)
        best = max(rep["plans"][0]["candidates"], key=lambda r: r["longest_fitting_seq_len"])
        longest, sp, cp = best["longest_fitting_seq_len"], best["sp"], best["cp"]
        shape = load_shape(model)
        pl = Planner(args, shape, Features.of(rep["features"]))
        feats = replace(pl.feats, attention_head_chunks=pl.chunks(sp, cp))
        speed = relative_speed(shape, longest, sp, feats, mfu=args.mfu, peak_tflops=args.gpu_tflops,
                               world=gpus, ranks_per_node=gpus // nodes, cp=cp)
        tps = tokens_per_sec_per_gpu(shape, longest, args.mfu, args.gpu_tflops) * speed
        est = pl.evaluate(longest, sp, feats, cp)[0]
        timing = dict(world=gpus, ranks_per_node=gpus // nodes, cp=cp, peak_tflops=args.gpu_tflops)
        step_s = step_time(shape, longest, sp, feats, **timing)
        within = longest_trainable(TRAINABLE_S, shape, sp, cp, AutoRun.of_args(args)) or {}
        rows.append(dict(gpus=gpus, nodes=nodes, host_gib_per_node=host, longest=longest, split=split_label(sp, cp),
                         head_chunks=feats.attention_head_chunks, relative_speed=speed, tokens_per_sec_per_gpu=tps,
                         features=vars(feats), cp=cp, sp=sp, step_s=step_s, measured_tokens_per_sec_per_gpu=longest / step_s / sp,
                         over_an_hour=step_s > HOUR_S, mfu=measured_mfu(),
                         within_15_min=within.get("seq_len", 0), within_15_min_at=within,
                         page_locked_gib_per_node=page_locked_gib(est, gpus // nodes),
                         published=PUBLISHED.get(gpus, {}), **margins(pl, est)))
    return rows


def margins(pl: Planner, est: Estimate) -> dict:
    """What a plan leaves free: the GPU peak against the budget (the GPU less GPU_RESERVED; the run's rule keeps
    HEADROOM of it free) and the host memory a node's ranks hold (pinned blocks as the allocator rounds them)."""
    budget = gpu_budget(pl.args.gpu_mem_gb)
    return dict(gpu_peak_gib=est.gpu_peak / GiB, gpu_budget_gib=budget / GiB, gpu_room_gib=(budget - est.gpu_peak) / GiB,
                host_used_gib=est.cpu_per_node / GiB, host_room_gib=(pl.cpu_limit - est.cpu_per_node) / GiB)


def _rates(kernel: str) -> str:
    fwd, bwd = KERNEL_TFLOPS[kernel]
    return f"{fwd:g} / {bwd:g} TFLOP/s forward / backward"


def render_compare(rows: list[dict]) -> str:
    """The compare rows as two Markdown tables (docs/results/memory.md quotes them): the longest length per setup
    with its step time, then the longest length each setup trains within TRAINABLE_S a step."""
    lines = ["| GPUs (80 GiB) | host / node | this project, longest | split, head chunks | GPU peak / budget, room "
             "(GiB) | host held / node (GiB) | of it page-locked | step (measured rate) | tokens/s/GPU | ALST | UPipe |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pub = [f"{r['published'][k]:,}" if k in r["published"] else "-" for k in ("ALST", "UPipe")]
        step = duration(r["step_s"]) + (" (**over an hour**)" if r["over_an_hour"] else "")
        cap = " (RoPE cap)" if r["longest"] == ROPE_MAX_POSITIONS else ""
        lines.append(f"| {r['gpus']} | {r['host_gib_per_node']:.0f} GiB | {r['longest']:,}{cap} | {r['split']}, "
                     f"{r['head_chunks']} | {r['gpu_peak_gib']:.2f} / {r['gpu_budget_gib']:.0f}, "
                     f"{r['gpu_room_gib']:.2f} | {r['host_used_gib']:,.0f} | {r['page_locked_gib_per_node']:,.0f} | "
                     f"{step} | {r['measured_tokens_per_sec_per_gpu']:.0f} | {pub[0]} | {pub[1]} |")
    lines += ["", f"| GPUs (80 GiB) | split | longest length whose step takes at most {duration(TRAINABLE_S)} | step | "
              "memory_features auto's choice there |", "|---|---|---|---|---|"]
    lines += [f"| {r['gpus']} | {r['split']} | {r['within_15_min']:,} | {duration(w['step_s'])} | {w['features']} |"
              if (w := r["within_15_min_at"]) else f"| {r['gpus']} | {r['split']} | none | - | - |" for r in rows]
    lines += ["", f"Step times: the cost model (planner.auto_features.step_seconds) at MFU {rows[0]['mfu']}, the "
              f"rate that reproduces the measured {MEASURED['seq_len']:,}-token step ({MEASURED['step_s']:.1f} s for "
              f"{MEASURED['model']['num_hidden_layers']} layers, {MEASURED['run']}): fitted to that one run, extrapolated "
              "to the other lengths and splits. Each row's attention at the rate of the kernel it runs (the measured run's "
              f"was cuDNN's, {_rates('cudnn')}); the ring (cp > 1) runs flash-attn's FlashAttention-2, charged at the "
              f"kernel probe's SDPA-flash rate ({_rates('flash')}: planner/step_time.KERNEL_TFLOPS) until FA2 itself is "
              "measured. One sequence per SP group per step. The second table keeps each row's split and "
              "times, at each length, the features memory_features auto chooses there (planner/trainable.py; the "
              "ALST features pinned, as `plan.py --auto --alst`): it keeps the attention where that fits and gathers "
              "K/V where the gather fits, faster than the longest length's features. RoPE cap: " + _CAP + "."]
    return "\n".join(lines)


# ALST's runs (ArcticTraining's projects/sequence-parallelism recipes: FlashAttention-2, Liger, optimizer offload, the
# 1-GPU run also parameter offload; H100 80GB, 1.9 TB host per node) against the planner's longest with the same
# features, pure Ulysses, no head chunks, this project's lean RMSNorm and MLP. 16 GPUs: the recipe's 8.0M ("close to
# oom"; the paper's abstract names 1, 8 and 32 GPUs only).
ALST_RUNS = ((1, 1, 500_000, ["--sp", "1"]), (8, 1, 3_700_000, ["--sp", "8", "--no-offload_params"]),
             (16, 2, 8_000_000, ["--sp", "16", "--no-offload_params"]),
             (32, 4, 15_000_000, ["--sp", "32", "--no-offload_params"]))
ALST_HOST_GIB = 1769.0  # 1.9e12 bytes per node


def alst_check(model: str = "llama3-8b", extra: list[str] | None = None) -> list[dict]:
    """The planner's longest Llama-3-8B length for each of ALST_RUNS, under the run's headroom rule: one row each."""
    rows = []
    for gpus, nodes, published, flags in ALST_RUNS:
        argv = ["--model", model, "--seq_len", str(published), "--alst", "--cp", "1", "--gpus_per_node",
                str(gpus // nodes), "--nodes", str(nodes), "--cpu_mem_gb", str(ALST_HOST_GIB), *flags] + (extra or [])
        args = build_parser().parse_args(argv)
        rep = make_plan(args)
        (row,) = rep["plans"][0]["candidates"]
        longest = row["longest_fitting_seq_len"]
        pl = Planner(args, load_shape(model), Features.of(rep["features"]))
        rows.append(dict(gpus=gpus, sp=row["sp"], published=published, longest=longest, ratio=longest / published,
                         **margins(pl, pl.evaluate(longest, row["sp"])[0])))
    return rows


def render_alst_check(rows: list[dict]) -> str:
    lines = ["| GPUs (80 GiB), sp | ALST published | planner's longest (same features) | / published | GPU peak / "
             "budget (GiB) | host held / node (GiB) |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['gpus']}, {r['sp']} | {r['published']:,} | {r['longest']:,} | {r['ratio']:.2f} | "
              f"{r['gpu_peak_gib']:.2f} / {r['gpu_budget_gib']:.0f} | {r['host_used_gib']:,.0f} |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--compare"]:  # `plan.py --compare [plan options]`: the table of docs/results/memory.md
        print(render_compare(compare(extra=argv[1:])))
        return 0
    if argv[:1] == ["--alst_check"]:  # `plan.py --alst_check [plan options]`: docs/memory_model.md's cross-check
        print(render_alst_check(alst_check(extra=argv[1:])))
        return 0
    args = build_parser().parse_args(argv)
    rep = make_plan(args)
    print(json.dumps(rep, indent=1) if args.json else render(rep))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ValueError as err:  # a user's input: one line, exit 2 (the project's convention)
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
