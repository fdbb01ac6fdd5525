"""Each stage's time and saves in the plan (the dry run and the start-up plan; issue 49: every length comes with
its time): steps x the planner's step, how often the run saves and how much each save writes, and the whole run.

Every figure is the planner's PREDICTION at 40% MFU of an H100's dense bf16 peak, never a measurement:
- the step: memory_features auto's `predicted_step_s` (planner/auto_features.step_seconds: FLOPs with the features'
  recompute, head chunks, checkpoint copies and ZeRO-3 offloads), else (a manual stage) the stage's tokens per step
  at planner.flops' tokens/s/GPU, with no recompute or offload counted;
- the saves: training/preemption.py's own rule (PreemptionFlag.due_after_s on a Deadline fed the step and the
  checkpoint's bytes per rank, so the write is Deadline.guess_save_s's guess at its slowest measured rate), the
  checkpoint's size from training/checkpoint_room.CKPT_BYTES_PER_PARAM (12 B per parameter, bench/checkpoint.py's).
At Llama-3-8B on 64 GPUs the 1M stage's step is ~296 s: a save every 2 steps (~10 min) of ~96 GB, 30 in the stage.
"""

from __future__ import annotations

import math

from base.stopped import StopCounter
from planner.auto_features import MFU, PEAK_TFLOPS
from planner.flops import tokens_per_sec_per_gpu
from planner.step_time import HOUR_S
from training.checkpoint_room import CKPT_BYTES_PER_PARAM
from training.config import Config
from training.curriculum import Stage
from training.preemption import Deadline, PreemptionFlag

ASSUMED = f"at {MFU:.0%} MFU of an H100, not measured"
GUESS_BYTES_PER_PARAM = 14.0  # what training/stage._rank_bytes guesses a save's write from (a bf16 copy counted: 2 B
# over the 12 saved), so the dry run's cadence is the one the run starts with


def duration(seconds: float) -> str:
    """'52 s', '14 min', '10.8 h' (the plan's other times: training/summary.py)."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 2 * HOUR_S else f"{seconds / HOUR_S:.1f} h"


def step_text(seconds: float) -> str:
    """A step's seconds as the time line writes them (the figure its stage time is multiplied from)."""
    return f"{seconds:.1f} s" if seconds < 100 else f"{seconds:.0f} s"


def predicted_step(shape, s: Stage, micro_batch: int, accum: int) -> tuple[float, str]:
    """(seconds of one optimizer step, which figure it is)."""
    c = s.memory_choice or {}
    if c.get("predicted_step_s"):
        return float(c["predicted_step_s"]), "memory_features auto's predicted step"
    tps = tokens_per_sec_per_gpu(shape, s.max_seq_length, mfu=MFU, peak_tflops=PEAK_TFLOPS)
    # an SP group of sp GPUs shares each sequence: micro_batch x accum sequences per group and step
    return (micro_batch * accum * s.max_seq_length / (s.sp * tps),
            f"the step at ~{tps:.0f} tokens/s/GPU, no recompute or offload counted")


def save_steps_apart(cfg: Config, step_s: float, rank_bytes: float, saved: bool = False) -> tuple[int, int, str]:
    """(steps to the stage's first save, steps between the later ones, why; 0, 0: no save but the stage's end and a
    stop) by training/preemption.py's rule, the write guessed from `rank_bytes` (Deadline.guess_save_s). With `auto`
    and synchronous saves (`async_save: false`) the first periodic save stretches the interval to 100 x its blocked
    write, for the rest of the run (`saved`: an earlier stage made one; a stage's end keeps the measurement)."""
    auto = cfg.save_interval_minutes == "auto"
    if not auto and not cfg.save_interval_minutes:
        n = cfg.save_steps
        return (n, n, f"save_steps {n}") if n else (0, 0, "no timed saves")
    deadline = Deadline(counter=StopCounter(autostart=False))  # no thread: only the rule's arithmetic
    deadline.record_rank_bytes(rank_bytes)
    deadline.record_step(step_s)
    flag = PreemptionFlag(deadline=deadline, save_every_s="auto" if auto else 60.0 * cfg.save_interval_minutes)
    write = deadline.guess_save_s()
    why = (f"save_interval_minutes {'auto' if auto else f'{cfg.save_interval_minutes:g}'}, a write guessed at "
           f"~{write:.0f} s")
    first = then = max(1, math.ceil(flag.due_after_s() / step_s))
    if auto and cfg.async_save is False:  # a synchronous save blocks the steps for its whole write
        flag.saved(blocked_s=write)
        flag.committed(write)
        then = max(1, math.ceil(flag.due_after_s() / step_s))
        first = then if saved else first
        why += f", synchronous: {flag.save_every_s / 60:.0f} min after the run's first"
    if cfg.save_steps:  # a save_steps save resets the timed interval too
        first, then = min(first, cfg.save_steps), min(then, cfg.save_steps)
    return first, then, why


def _steps(n: int, step_s: float) -> str:
    return f"{n} step{'s' * (n != 1)} ~ {duration(n * step_s)}"


def time_line(cfg: Config, shape, s: Stage, world: int, saved: bool = False) -> tuple[str, float, bool]:
    """The stage's `time:` line, its predicted step's seconds, and whether a periodic save came by its end (`saved`:
    one came in an earlier stage: save_steps_apart)."""
    step, which = predicted_step(shape, s, cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps)
    ckpt = shape.num_params() * CKPT_BYTES_PER_PARAM  # every rank's files together
    guess = shape.num_params() * GUESS_BYTES_PER_PARAM / world  # the live run's first guess (training/stage._rank_bytes)
    first, then, why = save_steps_apart(cfg, step, guess, saved)
    if not first or first >= s.max_steps:
        saves, cadence = 1, f"saves at the stage's end ({why})"
    else:  # the periodic saves before the last step, and the stage's end
        saves = 2 + (s.max_steps - 1 - first) // then
        cadence = (f"saves every {_steps(first, step)}" if first == then
                   else f"saves after {_steps(first, step)}" + (f", then every {_steps(then, step)}"
                                                                if first + then < s.max_steps else ""))
        cadence += f" ({why}) and at the stage's end"
    long = " !! a step over an hour" if step > HOUR_S else ""
    return (f"time: {s.max_steps} steps x ~{step_text(step)} ~ {duration(s.max_steps * step)} ({which} {ASSUMED})"
            f"{long}; {cadence}: {saves} of ~{ckpt / 1e9:.0f} GB each"), step, saved or saves > 1


def run_line(step_s: float, eval_s: float, over_an_hour: list[int], unplanned: list[int]) -> str:
    """The whole run's line after the stages: steps and evaluations, the stages whose step is over an hour."""
    line = (f"run: ~{duration(step_s)} of steps + ~{duration(eval_s)} of evaluations (predicted {ASSUMED}; engine "
            "builds, restores and the saves' pauses not counted)")
    if over_an_hour:
        line += f"; a step over an hour in stage {', '.join(map(str, over_an_hour))}"
    if unplanned:
        line += f"; stage {', '.join(map(str, unplanned))} not counted (no plan)"
    return line
