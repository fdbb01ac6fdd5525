"""The GPU check's results page (docs/results/gpu.md) from its JSON (bench/results/gpu.json): `render(data)`.
bench/gpu.py writes it after a run and again with `python -m bench.gpu --render`.
"""

from __future__ import annotations


def _feat(f: dict) -> str:
    names = [k.replace("_", " ") for k, v in f.items() if v and k not in ("checkpoint_every", "attention_head_chunks")]
    if (f.get("attention_head_chunks") or 1) > 1:
        names.append(f"{f['attention_head_chunks']} head chunks")
    if f.get("checkpoint_every"):
        names.append("ckpt" if f["checkpoint_every"] == 1 else f"ckpt 1/{f['checkpoint_every']}")
    return ", ".join(names) or "none"


PHASE_NAMES = {"forward": "forward", "recompute": "recomputed forward", "mlp_backward": "MLP backward",
               "attention_backward": "attention backward", "logits": "logits + loss (fwd and bwd)",
               "norm_backward": "norm backward", "between": "between phases"}


def _phase(x: dict) -> str:
    name = PHASE_NAMES.get(x["phase"], x["phase"])
    if x.get("norm"):
        name += f" ({x['norm']})"
    if x["phase"] == "between" and x.get("segment"):
        name += f" (`{x['segment']}`)"
    return name


def _gib(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def _long(r: dict, title: str, what: str) -> list[str]:
    """One long-length section (bench.gpu.long_run's record): the run, per-phase peaks against the planner, the
    host memory, the engagement counters, the errors."""
    lines = [f"## {title}", ""]
    ch = r.get("memory_choice") or {}
    feats = _feat({k: ch.get(k) for k in ("tiled_mlp", "tiled_logits", "checkpoint_every", "offload_activations",
                                          "keep_attention")}) if ch else "?"
    lines += [f"{what} Model `{r['model']}`, {r['length']:,} tokens, SP=1, bf16, `memory_features auto`"
              + (" with the stage's features pinned," if r.get("pinned") else "") + " with "
              f"`{r.get('budget_args') or '--gpu_mem_gb ' + str(r['gpu_mem_gb'])}`"
              + (" (the start-up's check of the pinned features)" if r.get("pinned") else " (the run's own start-up choice)")
              + ", allocations capped at "
              f"{r['cap_gib']} GiB. Launch exit {r['exit_code']}, {r['wall_s']} s"
              + (f"; the step {r['step_s']} s" + (f" (MFU {100 * r['mfu']:.1f}%, counted as the ladder counts it)"
                                                  if r.get("mfu") else "") + "."
                 if r.get("step_s") else "; **no step finished**.")
              + (f" Features: {feats}, {ch.get('attention_head_chunks')} head chunks, offload params "
                 f"{ch.get('offload_params')}, optimizer {ch.get('offload_optimizer')}; predicted peak "
                 f"{ch.get('predicted_peak_gb')} of {ch.get('budget_gb')} GiB budget." if ch else ""), ""]
    if r.get("error"):
        lines += [f"**Failed**: `{r['error']}`" + (" (out of memory)" if r.get("oom") else "")
                  + (" (time limit)" if r.get("time_limit") else ""), ""]
    lines += ["Kernel errors past 2^31 elements (T x h = 2^32 at 1M; the index-overflow class): "
              + ("; ".join(f"`{e}`" for e in r["kernel_errors"]) if r.get("kernel_errors") else "none in the log."), ""]
    if r.get("rows"):
        lines += ["| phase | layer | max allocated GiB | planner GiB | measured / planner | max reserved GiB | "
                  "reserved - allocated | planner's phase (the layer's largest term) |", "|---|---|---|---|---|---|---|---|"]
        for x in r["rows"]:
            ratio = "-" if x["ratio"] is None else (f"**{x['ratio']}** (the planner's next fix)" if x["flag"]
                                                    else str(x["ratio"]))
            over = " **above the usable limit**" if x.get("over_usable") else ""
            lines.append(f"| {_phase(x)} | {'-' if x['layer'] < 0 else x['layer']} | "
                         f"{_gib(x['measured_gib'])}{over} | {_gib(x['planner_gib'])} | {ratio} | {_gib(x['reserved_gib'])} | "
                         f"{_gib(x['gap_gib'])} | {_gib(x.get('planner_phase_gib'))} |")
        st = r["step"]
        ratio = "-" if st["ratio"] is None else (f"**{st['ratio']}** (the planner's next fix)" if st["flag"]
                                                 else str(st["ratio"]))
        lines.append(f"| **the step** | | {_gib(st['measured_gib'])} | {_gib(st['planner_gib'])} | {ratio} | "
                     f"{_gib(st['reserved_gib'])} | {_gib(st['gap_gib'])} | |")
        lines += ["", "Planner: resident {res} GiB + its phase; checkpointed layers' MLP backward includes their "
                  "recompute (it runs at the first saved tensor the MLP's backward unpacks): the row's figure counts the "
                  "segments where no inner phase was open. Terms (GiB): {terms}.".format(
                      res=r["planner"]["resident_gib"],
                      terms=", ".join(f"{k} {v}" for k, v in r["planner"]["terms_gib"].items())), ""]
        h = r["host"]
        stats = h["pinned"].get("stats") or {}
        lines += ["Host memory by the end of the step: pinned (torch.cuda.host_memory_stats allocated_bytes.current at "
                  f"most, the blocks as the caching host allocator rounds and keeps them) {_gib(h['pinned']['measured_gib'])} "
                  "GiB "
                  f"against the planner's {_gib(h['pinned']['planner_gib'])} (x{h['pinned']['ratio']}"
                  f"{', **the planner' + chr(39) + 's next fix**' if h['pinned']['flag'] else ''}); "
                  f"{_rss_note(h['rss']['note'])}: {_gib(h['rss']['measured_gib'])} GiB against "
                  f"{_gib(h['rss']['planner_gib'])} "
                  f"(x{h['rss']['ratio']})."
                  + (f" Pinned stats: {', '.join(f'{k} {v:,}' for k, v in stats.items())}." if stats else ""), ""]
        if h.get("arena"):  # the offloaded checkpoints' exact-size registered slots (base/host_arena.py)
            a = h["arena"]
            lines += [f"Host arena (exact-size registered slots, outside the pinned stats): {_gib(a['measured_gib'])} GiB "
                      f"against the planner's {_gib(a['planner_gib'])} (x{a['ratio']}), path {a['path']}, "
                      f"{a['fallbacks']} fallbacks{' (**a saving that did not engage**)' if a['flag'] else ''}.", ""]
        if r.get("flags"):
            lines += [f"**Outside 10% of the planner**: {', '.join(r['flags'])}.", ""]
        if r.get("usable_gib"):
            lines += [f"The run's usable limit (its budget less the 10% headroom): {r['usable_gib']} GiB; "
                      + (f"**above it**: {', '.join(r['over_usable'])}." if r.get("over_usable")
                         else "no segment above it."), ""]
        if r.get("attention_kernels"):
            lines += ["Attention calls of the step by the kernel SDPA's dispatch chose (torch._fused_sdp_choice on "
                      "each call's arguments; flash-attn's calls where installed): "
                      + "; ".join(f"`{k}` {v['calls']} calls (first: q {v['first'][0]}, k {v['first'][1]}, "
                                  f"{v['first'][-1]})" for k, v in r["attention_kernels"].items()) + ".", ""]
        if r.get("probe_errors"):
            lines += [f"Probe errors: {'; '.join(r['probe_errors'])}", ""]
    elif r.get("memory_choice"):
        lines += ["No per-phase records (the probe wrote none).", ""]
    eng = r.get("engagement")
    lines += ["Engagement counters of the step (metrics.jsonl, engaged / expected by the plan): "
              + (", ".join(f"{k} {v['engaged']} / {v['expected']}" + (" **NOT ENGAGED**" if (v["engaged"] or 0) <
                                                                       (v["expected"] or 0) else "")
                           for k, v in eng.items()) + "." if eng else "none in the step records."), ""]
    return lines


def _short(kernel: str) -> str:
    """A kernel's name without its parameter list (the page's table stays readable; the JSON keeps it whole)."""
    name = kernel.split("(")[0].removeprefix("void ")
    return name if len(name) <= 90 else name[:87] + "..."


def _kernels(data: dict) -> list[str]:
    """The attention-kernel probe and the host-arena probe (bench/gpu_kernels.py)."""
    lines = []
    ks = data.get("kernels")
    if ks:
        r0 = ks[0]
        lines += ["## Attention kernels at the headline's call (issue 49)", "",
                  f"One head chunk's call ({r0['heads']} query head(s), head dim {r0['head_dim']}, {r0['dtype']}, causal, "
                  f"one document) at {r0['length']:,} tokens, forward then backward, one timed call each after a "
                  "warm-up at 8,192 tokens (kernel names from torch.profiler there). TFLOP/s count causal attention "
                  "once (forward 2 T^2 d per head, backward 2.5x).", "",
                  "| backend | dispatch | forward s | TFLOP/s | backward s | TFLOP/s | kernels | |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in ks:
            if r.get("ok"):
                lines.append(f"| {r['backend']} | {r.get('dispatch_at_length', '-')} | {r['forward_s']} | "
                             f"{r['forward_tflops']} | {r['backward_s']} | {r['backward_tflops']} | "
                             f"{', '.join(f'`{_short(k)}`' for k in r.get('kernels', [])) or '-'} | "
                             f"{'**fastest**' if r.get('fastest') else ''} |")
            else:
                lines.append(f"| {r['backend']} | - | failed: {r['error']} | | | | | |")
        lines.append("")
    auto = data.get("auto_attention")
    if auto and auto.get("choice"):
        c = auto["call"]
        lines += [f"`--attn_implementation auto`'s own probe (model_utils/attention_pick.py: one causal call forward + "
                  f"backward at {c['tokens']:,} tokens, {c['heads']} head(s), median of 3): "
                  + ", ".join(f"{b} {t * 1e3:.1f} ms" for b, t in sorted(auto["seconds"].items(), key=lambda x: x[1]))
                  + f"; it runs **{auto['choice']}**.", ""]
    ar = data.get("arena")
    if ar:
        lines += ["## Host arena on this machine (base/host_arena.py)", "",
                  f"Path: {ar['path']}. Registration = mmap + first touch + cudaHostRegister of exactly the bytes; "
                  "torch's pinned allocation of the same bytes (rounded to a power of two, cached) for comparison.", "",
                  "| GiB | register s | s / GiB | device -> host GB/s | unregister s | torch pinned s |",
                  "|---|---|---|---|---|---|"]
        for r in ar["rows"]:
            lines.append(f"| {r['gib']} | " + (f"failed: {r['error']} | | | | |" if "error" in r else
                         f"{r.get('register_s')} | {r.get('register_s_per_gib')} | {r.get('d2h_gb_s', '-')} | "
                         f"{r.get('unregister_s')} | {r.get('torch_pinned_s', '-')} |"))
        lines.append("")
    return lines


# the RSS note of a run recorded before plan.py took its runtime host memory from the measurement (2 GiB assumed)
_OLD_RSS_NOTE = "the 2 GiB runtime plan.py assumes (--cpu_overhead_gb)"


def _rss_note(note: str) -> str:
    """A run's RSS note as the page says it now: an older run's "the 2 GiB plan.py assumes" is what plan.py assumed
    then; it has since used the runtime this run measured (planner/cluster.RUNTIME_HOST_GIB)."""
    from planner.cluster import RUNTIME_HOST_GIB

    return note.replace(_OLD_RSS_NOTE, "the 2 GiB of runtime plan.py assumed at the run (--cpu_overhead_gb; since "
                        f"then the {RUNTIME_HOST_GIB} GiB this run measured, planner/cluster.RUNTIME_HOST_GIB)")


def render(data: dict) -> str:
    env = data.get("environment", {})
    lines = [f"# GPU check: {env.get('device', '?')}, {data.get('started', '?')}", "",
             "Generated by `python -m bench.gpu --render` from `bench/results/gpu.json` (the run: `python -m bench.gpu`;"
             " what each section does is in the script's docstring).", "",
             f"Software: torch {env.get('torch')}, transformers {env.get('transformers')}, DeepSpeed "
             f"{env.get('deepspeed')}, flash-attn {env.get('flash_attn') or 'not installed'}; "
             f"{data.get('elapsed_s', '?')} s of a {data.get('budget_s', '?')} s budget."
             + (" **Dry run on CPU (tiny shapes): the page shows the script works, not GPU figures.**"
                if env.get("dry") else ""), ""]
    lines += [f"- {n}" for n in data.get("notes", [])] + ([""] if data.get("notes") else [])
    if data.get("headline"):
        lines += _long(data["headline"], "The 1-GPU headline's configuration at its planned maximum (issue 49)",
                       "Llama-3-8B's width and vocabulary, 2 decoder layers, the headline's per-layer features "
                       "pinned (every layer checkpointed and its checkpoint offloaded, tiled MLP and logits, "
                       "parameters and optimizer offloaded, the largest head-chunk count) at the planner's longest "
                       "length for them on an 80 GB card. Under these features the GPU peak does not depend on the "
                       "layer count (parameters, gradients and every checkpoint live on the host; the GPU holds one "
                       "layer's working set, the checkpoint being fetched and the logits tiles), so this is the "
                       "32-layer run's peak; its step time is 2 of 32 layers'.")
    elif data.get("headline_error"):
        lines += ["## The 1-GPU headline's configuration (issue 49)", "", f"Failed: {data['headline_error']}", ""]
    lines += _kernels(data)
    if data.get("long"):
        lines += _long(data["long"], "One step at 1M tokens per phase, against the planner (issue 43)",
                       "Llama-3-8B's width and vocabulary (hidden 4096, 32 heads, 8 KV, MLP 14336, vocab 128256), 2 "
                       "decoder layers: one checkpointed (its recompute), one keeping its activations.")
    elif data.get("long_error"):
        lines += ["## One step at 1M tokens per phase (issue 43)", "", f"Failed: {data['long_error']}", ""]
    if data.get("gap"):
        lines += _long(data["gap"], "The reserved-minus-allocated gap near the cap",
                       "The same model under a budget whose usable memory is the cap itself (cap / 0.9 + 2 GiB), at "
                       "the shortest length where auto's predicted peak reaches 95% of the cap.")
    if data.get("skipped_for_time"):
        lines += [f"Sections skipped for time: {', '.join(data['skipped_for_time'])}.", ""]
    s = data.get("smoke")
    lines += ["## Smoke test", "", "`pytest -m gpu tests/test_gpu_smoke.py`: " +
              (f"exit {s['exit_code']}, {s['summary']} ({s['seconds']} s)" if s else "not run"), ""]
    par = data.get("parity")
    lines += ["## Document masking: each backend against the plain model on each document alone", ""]
    if par:
        lines += ["| backend | dtype | loss rel. err | grad rel. err | tolerance (loss / grad) | wrong answer's loss "
                  "rel. err | ok |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['backend']} | {r['dtype']} | {r['loss_rel_err']:.1e} | {r['grad_rel_err']:.1e} | "
                  f"{r['loss_tol']:.0e} / {r['grad_tol']:.0e} | {r['wrong_rel_err']:.1e} | {'yes' if r['ok'] else 'NO'} |"
                  if "error" not in r else f"| {r['backend']} | {r['dtype']} | failed: {r['error']} | | | | NO |"
                  for r in par]
    else:
        lines.append("not run")
    lines += ["", "## Length and speed at SP=1", ""] + _ladder(data.get("ladder"))
    if data.get("ladder_recheck"):  # a later session's short ladder, merged beside the first (notes say which)
        lines += ["", "### A later ladder (the stage change checked)", ""] + _ladder(data["ladder_recheck"])
    return "\n".join(lines) + "\n"


def _ladder(lad: dict | None) -> list[str]:
    """One ladder launch: its rungs, the rungs dropped for time, and each stage end's release record."""
    if not lad:
        return ["not run"]
    lines = [f"Model `{lad['model']}` (Llama-3-8B's layer, embedding and head; {lad.get('layers', 1)} decoder "
             f"layer{'s' if lad.get('layers', 1) != 1 else ''}), bf16, ZeRO-3 with "
             f"params and optimizer offloaded, allocations capped at {lad['cap_gib']} GiB (an 80 GB card). "
             f"The planner's longest length with every memory feature on: {lad['planner_longest_leanest']:,} "
             f"tokens. Launch exit {lad['exit_code']}, {lad['wall_s']} s.", "",
             "| tokens | rung | features | fits | tokens/s | MFU | step s | peak GiB | planner GiB | measured / "
             "planner |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in lad["rungs"]:
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-"
        lines.append(f"| {r['length']:,} | {r['kind']} | {_feat(r['features'])} | "
                     f"{'yes' if r['fits'] else 'no: ' + r.get('why', '')} | {r.get('tokens_per_s', '-')} | {mfu} | "
                     f"{', '.join(map(str, r.get('step_s', []))) or '-'} | {r.get('peak_gib', '-')} | "
                     f"{r.get('predicted_gib') or '-'} | {r.get('measured_over_predicted', '-')} |")
    if lad.get("dropped_for_time"):
        lines += ["", f"Rungs dropped for time: {lad['dropped_for_time']}."]
    if "attention_kernels" in lad:  # (ladders before 2026-11-29 did not record them)
        k = lad["attention_kernels"]
        lines += ["", "Attention kernels of the launch (rank 0, every rung; SDPA's dispatch on each call's arguments): "
                  + ("; ".join(f"`{n}` {v['calls']} calls" for n, v in k.items()) if k else "not recorded (no exit "
                                                                                           "of its own)") + "."]
    if "engine_released" in lad:
        lines += ["", "Stage ends (training/stage_records.py's `engine_released` record: engines left alive, 0 expected; the "
                  "largest host RSS after the release): " + ("; ".join(
                      f"stage {e['stage']}: alive {e['alive']}, {e['host_rss_gb']} GiB" for e in lad["engine_released"])
                      or "none reached") + "."]
    return lines
