"""What a stage writes down besides its checkpoints and its evaluation, and `Run`, what every stage of a run shares
(built once in train.py; training/stage.py trains a stage with it).

Each step's record (`_log_step`: metrics.jsonl, W&B, the rank log; its tokens from `step_tokens`, its model TFLOP/s per
GPU and MFU from `_flop_fields`, its pre-clip gradient norm from `_grad_norm`, this rank's page-locked host memory from
`_host_fields`), the DeepSpeed config a stage ran with (`_record_ds_config`: OUTPUT_DIR/ds_config.stageN.json, and
auto's memory choice), and a stage engine's release (`_released`: its memory handed back, `engine_released` with
what is still alive).
Cost per step: the peak-memory all-reduce (one, with the engagement counts), one metrics line; per stage: one JSON
file on rank 0, the model's FLOPs of one sequence at each length it trains (its own, its replay lengths: the first step
that trains it), one gc.collect() and one all-reduce of two numbers at its release.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import os
import time

import torch

from base import comm, host, host_arena
from base.atomic import atomic_write
from base.log import print0, rank_log
from model_utils import engagement
from planner.flops import flops_per_sequence
from planner.peaks import device_peak_tflops
from planner.shapes import ModelShape
from training.checkpoint import TrainState
from training.engine import return_cached_memory
from training.job import EXIT_PREEMPTED
from training.metrics import peak_memory_gb
from training.preemption import EXIT_MARGIN_S, said


@dataclasses.dataclass
class Run:
    """What every stage of one run shares (built once in train.py)."""

    cfg: object
    dims: object
    data: object
    ckpt: object
    metrics: object
    preempt: object
    base_config: object
    attn: str
    bf16: bool
    # a stage length -> (model FLOPs of one sequence, the device's dense bf16 peak): _sequence_cost, once per length
    costs: dict = dataclasses.field(default_factory=dict)

    def exit_preempted(self) -> int:
        print0(f"preempted ({said(self.preempt.received)}): exiting with {EXIT_PREEMPTED}")
        # in a SIGTERM window the exit has EXIT_MARGIN_S: W&B's finish gets part of it, never the rank's 75
        self.metrics.close(None if self.preempt.window_left_s is None else EXIT_MARGIN_S / 2)
        return EXIT_PREEMPTED


def _record_ds_config(run: Run, stage, engine, step: int) -> None:
    """OUTPUT_DIR/ds_config.stageN.json (rank 0) and, under memory_features auto, its choice in the metrics."""
    if run.dims.is_main:
        used = os.path.join(run.cfg.output_dir, f"ds_config.stage{stage.index}.json")
        atomic_write(used, json.dumps(engine.ds_config_used, indent=1).encode())  # a full disk: named, exit 2
        print0(f"stage {stage.index} ({stage.name}): DeepSpeed config used -> {used}")
    run.metrics.record_stage(stage, run.dims.world)  # the W&B config's resolved layout of the stage
    if stage.memory_choice:
        run.metrics.log({"event": "memory_choice", "stage": stage.index, "step": step, **stage.memory_choice})


def step_tokens(run: Run, stage, sdims) -> int:
    """The tokens one optimizer step reads: dp x accumulation x micro-batch x the stage's length."""
    cfg = run.cfg
    return sdims.dp * cfg.gradient_accumulation_steps * cfg.per_device_train_batch_size * stage.max_seq_length


def _sequence_cost(run: Run, seq_len: int) -> tuple[float | None, float | None]:
    """(model FLOPs of one sequence of `seq_len`, this device's dense bf16 peak TFLOP/s), worked out at a stage's first
    step and kept (run.costs): planner/flops.flops_per_sequence of the model's shape (ModelShape.from_config of its HF
    config, as step_cost_ratio reads it), planner/peaks.py's peak of torch's device name. None: a config the planner
    cannot read (a stand-in), a device without a known peak (a CPU run, a card not in the table, a MIG slice)."""
    costs = getattr(run, "costs", None)
    costs = {} if costs is None else costs  # a stand-in run without the field: worked out each time
    if seq_len not in costs:
        try:
            flops = flops_per_sequence(ModelShape.from_config(run.base_config.to_dict()), seq_len)
        except (AttributeError, ValueError, TypeError):  # no HF config, or one without the planner's keys
            flops = None
        costs[seq_len] = flops, device_peak_tflops(_device_name())
    return costs[seq_len]


def _device_name() -> str:
    """torch's name of this rank's device ("NVIDIA H100 80GB HBM3", "AMD Instinct MI300X"); "cpu" without one."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def sample_length(batch: list, seq_len: int) -> int:
    """The length of the samples one micro-batch (one `sampler.next_batch()`) trains: a replay micro-batch's shorter one
    (its indices are `(l, (i_1, ..., i_k))`, k = seq_len / l samples of length l packed into one: data/replay.py
    ReplaySampler), else the stage's. A micro-batch is all replay at one length or all the stage's own, and every DP
    rank draws the same kind (ReplaySampler's counters), so this rank's batch says the whole job's micro-step."""
    first = batch[0] if batch else None
    return int(first[0]) if isinstance(first, tuple) else seq_len


def _flop_fields(run: Run, stage, sdims, n: int, step_time: float, skipped: bool,
                 lengths: list[int] | None = None) -> dict:
    """`model_tflops_per_gpu`: the model FLOPs the step trained over its time and the world (sp x dp), in TFLOP/s:
    planner/flops.flops_per_sequence (matmuls and causal attention, x3 for the backward, a windowed layer as its
    window's share) x the sequences of the whole job's step (n / seq_len: dp x accumulation x micro-batch). That is
    the GPU page's count (docs/results/gpu.md) and Megatron-LM's convention (megatron/training/training.py
    num_floating_point_operations: per sequence of seq_length): a sequence counts as one causal document, so one
    packed from documents under document masking computes less attention than counted (where the kernel skips the
    masked blocks: documents of d tokens in a sample of s, about d/s of it), and recompute (checkpointed layers, tiled
    MLP and logits) is not counted, so a run with it does more work than its figure says.

    A replay micro-step (`lengths`: each micro-step's sample length, `sample_length`) counts what it trained: its
    tokens as seq_len / l sequences of length l (data/replay.py: short samples side by side, attention masked between
    them, each one causal sequence of l, documents packed into it as above); a `tasks:` sample and the stage's own are
    full length. Counted as one sequence of seq_len, a replay micro-step of Llama-3-8B at 1M of 8k samples was 16.9x
    its work, and a stage with 30% of it 1.39x its MFU. `mfu`: that over the device's dense bf16 peak
    (planner/peaks.py), only where the peak is known (no key on a CPU run, an unknown card). Both null on a skipped
    step, as tokens_per_s; the TFLOP/s null too where the planner cannot read the model's config."""
    seq_len = stage.max_seq_length
    per_sequence, peak = _sequence_cost(run, seq_len)
    tflops = None
    if not skipped and per_sequence is not None:  # each micro-step's tokens (n / their count) as sequences of its length
        lengths = lengths or [seq_len]
        flops = sum(_sequence_cost(run, length)[0] * n / len(lengths) / length for length in lengths)
        tflops = flops / (step_time * sdims.sp * sdims.dp) / 1e12
    return {"model_tflops_per_gpu": tflops,
            **({"mfu": None if tflops is None else tflops / peak} if peak else {})}


def _grad_norm(engine, out: dict) -> float | None:
    """The step's global gradient norm before clipping: DeepSpeed's, computed (all-reduced) in its optimizer step and
    cached there, the same on every rank; reading it is no collective (one device-to-host copy of a scalar, after the
    loss's all-reduce has synchronized). None where no update happened (no supervised token; an invalid norm, any
    precision, where DeepSpeed skipped the update) or the engine keeps none (ZeRO-1/2 with its norm computation off)."""
    get = getattr(engine, "get_global_grad_norm", None)
    if get is None or out.get("skipped") or out.get("overflow"):
        return None
    norm = get()
    norm = None if norm is None else float(norm)
    return norm if norm is not None and math.isfinite(norm) else None


def _log_step(run: Run, stage, sdims, state: TrainState, out: dict, lr: float, sampler, engine=None) -> None:
    eng = out.get("engagement")  # minimum over ranks after the peak's all-reduce (one collective for both)
    peak = peak_memory_gb(eng) if eng else peak_memory_gb()
    skipped = bool(out.get("skipped"))
    if not skipped:  # a skipped step ran nothing: its time says nothing of the next one's
        run.preempt.deadline.record_step(out["step_time"])
    rank_log(f"step {state.step} stage {stage.index} loss {out['loss']:.6f} step_time {out['step_time']:.3f}s"
             + " (no supervised token: skipped)" * skipped)
    # A skipped step (no supervised token in the global batch: training/step.py returns after one all-reduce, ~1 ms)
    # trained nothing: loss and tokens/s null, 0 tokens, total_tokens unchanged. It logged loss 0.0 and n / 1 ms
    # (5e8 tokens/s at 128k x 4), which the charts drew and averaged in. It still counts as a step: a stage's budget
    # is its steps (max_tokens and epochs are turned into steps when the stage resolves, training/curriculum.py).
    n = 0 if skipped else step_tokens(run, stage, sdims)
    state.tokens += 0 if out.get("overflow") else n  # an update DeepSpeed skipped trained nothing (its step ran: `tokens`)
    run.metrics.log({"step": state.step, "stage": stage.index, "loss": None if skipped else out["loss"], "lr": lr,
                     "tokens": n,
                     "grad_norm": _grad_norm(engine, out),  # pre-clip global norm; null: no update this step
                     "label_tokens": out["label_tokens"],  # supervised tokens of the step (global; the loss's count)
                     **({"label_weight": out["label_weight"]} if "label_weight" in out else {}),
                     **({"optimizer_skipped": True} if skipped else {}),  # no supervised token: no step
                     **({"optimizer_skipped": "overflow"} if out.get("overflow") else {}),  # DeepSpeed's skip: an
                     # invalid gradient norm, in any precision (deepspeed/runtime/utils.py is_invalid_grad_norm)
                     "tokens_per_s": None if skipped else n / out["step_time"],
                     **_flop_fields(run, stage, sdims, n, out["step_time"], skipped, out.get("micro_lengths")),
                     "seq_len": stage.max_seq_length,
                     "sp": sdims.sp, "cp": sdims.cp,
                     "dp": sdims.dp, "peak_mem_gb": peak, "total_tokens": state.tokens,
                     "time": time.time(), **{f"share_{k}": v for k, v in sampler.source_shares().items()},
                     **(engagement.fields(eng) if eng else {}), **_host_fields()})
    if eng:  # a saving the plan counts that did not engage: one line naming it, exit 2 (the same on every rank)
        engagement.check(eng)


def _host_fields() -> dict:
    """This rank's page-locked host memory by path (base/host_arena.STATS), where a CUDA run locked any: the exact-size
    registered slots the plan counts, and what a failed registration pinned instead (rounded: up to 2x)."""
    s = host_arena.STATS
    if not (s["registered_bytes"] or s["fallback_pinned_bytes"]):
        return {}
    return {"host_registered_gb": round(s["registered_bytes"] / 2**30, 3),
            "host_fallback_pinned_gb": round(s["fallback_pinned_bytes"] / 2**30, 3), "host_fallbacks": s["fallbacks"]}


def _released(run: Run, stage, watch, step: int) -> None:
    """After a stage's engine is released and the caller's reference dropped: collect it, hand its cached device and
    page-locked host blocks back (training/engine.return_cached_memory), give back the async save's staging buffers
    (no save is in flight at a stage's end: its last save is synchronous), and record in metrics.jsonl how many of the
    engine, its model and its optimizer are still alive on any rank (`alive`, 0 expected) and the largest RSS left.

    The next stage builds its engine and loads the checkpoint on top of what is left here: one engine's host state at
    most (a stage's engine kept alive by DeepSpeed's caches once made it one more engine per stage: training/engine.py
    release_engine). Costs: one gc.collect(), the staging's re-allocation at the next stage's first background save
    (first touch, ~0.1-0.5 s per GiB: Llama-3-8B on 32 ranks ~3 GB per rank, ~1 s once per stage) and one all-reduce
    of two numbers."""
    gc.collect()  # the engine, its model and optimizer reference each other: the cycle is freed now
    return_cached_memory()
    run.ckpt.release_staging()
    alive = [name for name, ref in watch or () if ref() is not None]
    if alive:
        rank_log(f"warning: stage {stage.index}'s {', '.join(alive)} still referenced after its release: its host "
                 "memory stays held next to the next stage's engine")
    top = comm.all_reduce([float(len(alive)), host.rss_bytes() / 2**30], op="max")
    if top[0].item():
        print0(f"warning: stage {stage.index}'s engine is still alive after its release on some rank (see the rank "
               "logs): the next stage holds its host memory on top of its own engine's")
    run.metrics.log({"event": "engine_released", "stage": stage.index, "step": step, "alive": int(top[0].item()),
                     "host_rss_gb": round(top[1].item(), 3)})
