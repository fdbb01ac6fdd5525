"""Does each stage's GPU memory plan fit the GPU, before the model loads: one line, decided once.

A stage under `memory_features: manual` (the default) runs the flags' features as they are; memory_features auto
chose against the budget already. Before this check, the README's Llama-3-8B at 128k on 8 GPUs of 80 GB printed its
plan (98.1 GiB per rank) and went on: minutes of loading on every rank, then an out-of-memory error at the first step.
- `device_fit` (pure): each manual stage's predicted peak per rank (planner/memory_model.estimate, the plan's figure)
  against the budget: a warning line past the usable limit (the budget less auto_features' headroom), a refusal past
  OVER_PREDICTION x the budget for the families the planner reads exactly. Each line names the peak, the budget and
  what fits (`_what_fits`: memory_features auto at the stage's SP, else at the smallest SP a node allows).
- every stage's evaluation (manual or auto: auto chose for the training step at the stage's length) at the lengths
  it asks beyond its own (`_eval_fit`): eval.lengths `all` or a list, the held-out conversations at a later SFT
  stage's length (training/evaluation.py eval_forward_lengths), each at the stage's own SP degree and features. A 32k
  stage at sp 1 asked at 1M holds ~102 GiB per rank there (Llama-3-8B): it trained, saved its stage-end checkpoint,
  ran out of memory at its evaluation, and again at every requeue (a stage without its eval record runs again).
  The same rule as a step's (warned past the usable limit, refused past OVER_PREDICTION x the budget); the line
  names the lengths that fit, the eval.heldout_samples that asks the others, and the smallest SP degree that fits.
- `gpu_fit_budget`: the budget, --gpu_mem_gb, else the smallest GPU among the ranks' reports (training/preflight.py
  gathers `gpu_bytes` from every rank and rank 0 decides: one decider, never a rank's own reading), else this
  machine's on a dry run; none on a CPU run.
- `check_device_fit`: the two together, as `--dry_run` (training/startup.py) and a launched run's preflight call it.
Cost: one planner estimate per stage and per longer length its evaluation asks (milliseconds), and a chooser run for
each manual stage that does not fit.
"""

from __future__ import annotations

from training.config import Config, no_gpu
from training.curriculum import Stage

GiB = 2**30


def gpu_bytes() -> int | None:
    """This rank's GPU memory (bytes), None on a CPU run."""
    import torch

    if no_gpu() or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory


# How far the planner's peak may sit above what a step holds (docs/memory_model.md): predicted / measured tensor
# bytes 0.978-1.11 over 11 exact cases, 1.25 for a Qwen3 whose q/k norms are checkpointed (its largest documented
# over-prediction); 0.979-0.997 of 7 H200 peaks. A manual stage predicted above the GPU's whole budget by more than
# that runs out of memory even where the planner errs most: refused before the model loads (Llama-3-8B: minutes of
# loading on every rank, then an out-of-memory error at the first step). Above the usable limit only (the budget
# less the 10% headroom kept for fragmentation and the planner's error) it may fit: said, not refused.
OVER_PREDICTION = 1.25
# refused only for the dense decoders whose blocks the planner models as they are (GQA attention, a gated MLP, RMSNorm:
# the checks in docs/memory_model_checks.md ran Llama shapes): a family it reads less exactly (MoE experts, hybrid or
# linear-attention layers) may be over-predicted by more, and a run that fits must not be refused on that; it warns
PLANNED_EXACTLY = ("llama", "mistral", "qwen2", "qwen3")


def device_fit(cfg: Config, stages: list[Stage], world: int, bf16: bool, configs: list[dict], arch,
               budget_bytes: int, source: str, ranks_per_node: int) -> tuple[str | None, list[str]]:
    """(the refusal or None, warning lines) for the stages whose memory features the flags set (memory_features
    manual; auto chose against this budget already): each one's predicted peak per rank (planner/memory_model.estimate,
    the plan's figure) against `budget_bytes` (a GPU's memory less GPU_RESERVED; `source` says where it came from).
    Each line names the peak, the budget and what fits: memory_features auto's choice at the stage's SP, else at the
    smallest SP that fits. Then every stage's evaluation at the longer lengths it asks (`_eval_fit`), by the same rule.
    Pure given its inputs: a launched run decides it on rank 0 (preflight), every rank gets that decision."""
    from planner import auto_features as af
    from planner.memory_model import ModelShape, estimate, grad_accum_dtype
    from training.summary import run_features

    usable, warnings = af.usable_bytes(budget_bytes), []
    budget = f"the GPU has {budget_bytes / GiB:.1f} GiB ({source}; {usable / GiB:.1f} usable)"
    exact = getattr(arch, "model_type", None) in PLANNED_EXACTLY
    for s, ds in zip(stages, configs):
        feats = run_features(cfg, ds, s)
        prec = "bf16" if bf16 else "fp32"
        at = dict(gpus_per_node=ranks_per_node, cp=s.cp if isinstance(s.cp, int) else 1,
                  grad_accum=grad_accum_dtype(ds))
        try:
            shape = ModelShape.from_config(arch.to_dict())
            peak = estimate(shape, s.max_seq_length, s.sp, world, feats, prec, **at).gpu_peak
        except ValueError:  # a shape the planner cannot read: no plan to check against (the plan lines say so)
            continue
        if peak > usable and not s.memory_choice:
            line = (f"stage {s.index} ({s.name}): memory_features manual (features: {af.describe(feats)}) needs "
                    f"{peak / GiB:.1f} GiB per rank by the plan, and {budget}")
            fix = _what_fits(shape, s, world, budget_bytes, feats, prec, ranks_per_node)
            if peak > OVER_PREDICTION * budget_bytes and exact:
                return f"{line}: its first step runs out of memory; {fix}", warnings
            warnings.append(f"warning: {line}: it may run out of memory; {fix}")
        # manual or auto alike: auto chose for the training step at the stage's length, not its evaluation's lengths
        verdict = _eval_fit(shape, s, stages, world, feats, prec, at, budget_bytes)
        if verdict is None:
            continue
        line, eval_peak = f"{verdict[0]}, and {budget}", verdict[1]
        if eval_peak > OVER_PREDICTION * budget_bytes and exact:
            return (f"{line}: it runs out of memory after the stage's training and end checkpoint, and again at every "
                    f"restart; {verdict[2]}"), warnings
        warnings.append(f"warning: {line}: it may run out of memory after the stage's training; {verdict[2]}")
    return None, warnings


def _eval_fit(shape, s: Stage, stages: list[Stage], world: int, feats, prec: str, at: dict,
              budget_bytes: int) -> tuple[str, int, str] | None:
    """(what, peak, fix) where the stage's evaluation forward at a length longer than its own (a later stage's under
    eval.lengths `all`, a list's, the held-out conversations at a later SFT stage's; training/evaluation.py
    eval_forward_lengths) is planned past the usable limit at the stage's own SP degree and features
    (Estimate.eval_gpu_peak: the model states plus one layer's forward or one logits tile, no activations); None where
    it fits. The fix: the asked lengths that fit, or the smallest sequence_parallel_size where the longest does.
    Cost: one planner estimate per longer length, and one per SP degree tried (milliseconds)."""
    from planner import auto_features as af
    from planner.memory_model import estimate
    from training.evaluation import eval_forward_lengths

    try:
        asked = eval_forward_lengths(s, stages)
        peaks = {n: estimate(shape, n, s.sp, world, feats, prec, **at).eval_gpu_peak
                 for n in asked if n > s.max_seq_length}
    except ValueError:  # a bad eval.lengths: refused in one line where the run checks its tasks (check_passkey_fits)
        return None
    usable = af.usable_bytes(budget_bytes)
    over = sorted(n for n, p in peaks.items() if p > usable)
    if not over:
        return None
    n = over[-1]
    what = (f"stage {s.index} ({s.name}): its evaluation at {n} tokens ({'; '.join(asked[n])}) needs "
            f"{peaks[n] / GiB:.1f} GiB per rank by the plan at sequence_parallel_size {s.sp} (features: "
            f"{af.describe(feats)})")
    fixes = []
    if any(w.startswith("eval.lengths") for m in over for w in asked[m]):
        ok = sorted(m for m in asked if m not in over and (m == s.max_seq_length or any(
            w.startswith("eval.lengths") for w in asked[m])))
        fixes.append(f"set the stage's eval.lengths to {ok} (the lengths that fit at sequence_parallel_size {s.sp})")
    if any(not w.startswith("eval.lengths") for m in over for w in asked[m]):
        fixes.append("set its eval.heldout_samples: 0 (no held-out loss: the retention and conversation losses go)")
    for sp in (d for d in range(s.sp + 1, world + 1) if world % d == 0):
        try:
            p = estimate(shape, n, sp, world, feats, prec, **{**at, "cp": 1}).eval_gpu_peak
        except ValueError:  # a degree the heads do not take as pure Ulysses
            continue
        if p <= usable:
            fixes.append(f"a larger sequence_parallel_size: {sp} fits it ({p / GiB:.1f} GiB)")
            break
    else:
        fixes.append(f"no sequence_parallel_size up to {world} fits it with these features")
    return what, peaks[n], ", or ".join(fixes)


def _what_fits(shape, s: Stage, world: int, budget_bytes: int, feats, prec: str, ranks_per_node: int) -> str:
    """The fix a memory refusal names: what memory_features auto picks at the stage's SP degree, else the smallest
    degree a node allows where anything fits, else that nothing does."""
    from planner import auto_features as af
    from planner.memory_model import Features

    offloads = Features(offload_params=feats.offload_params, offload_optimizer=feats.offload_optimizer,
                        lean_rmsnorm=feats.lean_rmsnorm, lean_mlp=feats.lean_mlp)
    for sp in (s.sp, None):
        try:
            c = af.choose(shape, s.max_seq_length, world, budget_bytes, sp=sp, sp_max=ranks_per_node or world,
                          offloads=offloads, precision=prec, ranks_per_node=ranks_per_node or world,
                          cp=s.cp if sp == s.sp and isinstance(s.cp, int) else "auto")
        except ValueError:
            continue
        at = "" if sp else f" at sequence_parallel_size {c.sp}"
        return (f"--memory_features auto fits it{at} (with these offloads, {_flags(c.features)} does: "
                f"{c.peak_bytes / GiB:.1f} GiB)")
    return (f"nothing fits {s.max_seq_length} tokens on {world} GPU(s) of this size: more GPUs (a larger "
            "sequence_parallel_size) or a shorter max_seq_length")


def _flags(f) -> str:
    """The flags that set memory features `f` (planner Features) in manual mode."""
    on = [f"--{n}" for n in ("tiled_logits", "tiled_mlp") if getattr(f, n)]
    on += [f"--checkpoint_every {f.every}"] if f.every else []
    on += [f"--{n}" for n in ("keep_attention", "offload_activations", "ring_attention") if f.every and getattr(f, n)]
    on += [f"--attention_head_chunks {f.attention_head_chunks}"] if f.attention_head_chunks > 1 else []
    return " ".join(on) or "no feature"


def gpu_fit_budget(cfg: Config, reports: list[dict] | None = None) -> tuple[int, str] | None:
    """(bytes, where from) the manual stages are checked against: --gpu_mem_gb, else the smallest GPU among the
    ranks' reports (a launched run) or this machine's (a dry run on a GPU); None without either (a CPU run, or a
    dry run on a machine without a GPU and no --gpu_mem_gb)."""
    from planner.auto_features import gpu_budget

    if cfg.gpu_mem_gb > 0:
        return gpu_budget(cfg.gpu_mem_gb), f"--gpu_mem_gb {cfg.gpu_mem_gb:g} less 2 GiB reserved"
    got = [r.get("gpu_bytes") for r in reports] if reports is not None else [gpu_bytes()]
    if not got or any(g is None for g in got):
        return None
    return gpu_budget(min(got) / GiB), f"{min(got) / GiB:.1f} GiB detected less 2 GiB reserved"


def check_device_fit(cfg: Config, stages: list[Stage], world: int, bf16: bool, configs: list[dict], arch,
                     ranks_per_node: int, reports: list[dict] | None = None, say=print) -> None:
    """device_fit against gpu_fit_budget: says the warnings, raises the refusal (one-line ValueError)."""
    got = gpu_fit_budget(cfg, reports)
    if got is None:
        return
    problem, warnings = device_fit(cfg, stages, world, bf16, configs, arch, got[0], got[1], ranks_per_node)
    for line in warnings:
        say(line)
    if problem:
        raise ValueError(problem)
