"""Every stage of the plan comes with its time (issue 49): the dry run's / start-up plan's `time:` line per stage
(steps x the planner's predicted step = the stage's time, the save cadence by training/preemption.py's rule, the
checkpoint's size) and the `run:` line after the stages (training/summary.plan_lines, training/run_time.py).
Pure unit tests: the Llama-3-8B preset's shape, no weights, no data."""

from __future__ import annotations

import dataclasses
import math
import re

from planner.flops import tokens_per_sec_per_gpu
from planner.memory_model import load_shape
from training.config import Config, StageConfig
from training.curriculum import resolve_stages
from training.preemption import GUESS_FIXED_S, GUESS_RANK_BPS, SAVE_GAP_STEPS

WORLD = 32
SHAPE = load_shape("llama3-8b")
TIME = re.compile(r"time: (\d+) steps x ~([\d.]+) s ~ ([\d.]+) (s|min|h) \((.*?)\)")
RUN = re.compile(r"run: ~([\d.]+) (s|min|h) of steps \+ ~([\d.]+) (s|min|h) of evaluations \(predicted at 40% MFU")
UNIT = {"s": 1.0, "min": 60.0, "h": 3600.0}


def _cfg(**kw) -> Config:
    return Config(model_name_or_path="llama3-8b", deepspeed="ds_configs/zero3_offload.json", bf16=True,
                  max_seq_length=131072, sequence_parallel_size=2, nodes=4, gpus_per_node=8, **kw)


def _plan(cfg: Config) -> tuple[list, str]:
    from training.summary import plan_lines

    stages = resolve_stages(cfg, lambda sp: WORLD // sp)
    return stages, "\n".join(plan_lines(cfg, stages, WORLD, 8, True))


def _seconds(number: str, unit: str) -> float:
    return float(number) * UNIT[unit]


def _close(a: float, b: float, rel: float) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b))


def test_each_stage_time_is_steps_times_the_predicted_step_and_the_run_sums_them():
    """auto's stages: STEPS x ~S s ~ T with STEPS the stage's steps, S its memory_choice.predicted_step_s, T their
    product (within the printed rounding); the run line sums the stages' T and their evaluations' times."""
    cfg = _cfg(memory_features="auto", gpu_mem_gb=80.0,
               stages=[StageConfig(name="a", max_steps=200),
                       StageConfig(name="b", max_steps=30, max_seq_length=262144, sequence_parallel_size=4)])
    stages, text = _plan(cfg)
    times = TIME.findall(text)
    assert len(times) == 2 and text.count("      time: ") == 2
    total = 0.0
    for s, (steps, step, number, unit, which) in zip(stages, times, strict=True):
        predicted = s.memory_choice["predicted_step_s"]
        assert int(steps) == s.max_steps and _close(float(step), predicted, 0.01)
        assert _close(_seconds(number, unit), s.max_steps * predicted, 0.03)  # "107 min", "2.6 h": printed rounding
        assert which == "memory_features auto's predicted step at 40% MFU of an H100, not measured"
        total += s.max_steps * predicted
    evals = [_seconds(n, u) for n, u in re.findall(r"forward passes of .*? ~ ([\d.]+) (s|min|h) on ", text)]
    assert len(evals) == 2
    (run,) = RUN.findall(text)
    assert _close(_seconds(run[0], run[1]), total, 0.03)
    assert _close(_seconds(run[2], run[3]), sum(evals), 0.05)
    assert "not measured" in text.splitlines()[-1] and "over an hour" not in text


def test_the_save_cadence_follows_the_preemption_rule():
    """save_interval_minutes auto: the next save is due max(9 min - write - step, 4.5 min, 1.5 steps) after the last,
    the write guessed from the rank's bytes as the live run guesses them (14 B per parameter over the world:
    training/stage._rank_bytes) at Deadline's rate, so the saves come ceil(due / step) steps apart; each writes the
    checkpoint's 12 B per parameter."""
    cfg = _cfg(memory_features="auto", gpu_mem_gb=80.0, stages=[StageConfig(name="a", max_steps=200)])
    (s,), text = _plan(cfg)
    step = s.memory_choice["predicted_step_s"]
    ckpt = 12 * SHAPE.num_params()
    write = GUESS_FIXED_S + 14 * SHAPE.num_params() / WORLD / GUESS_RANK_BPS
    n = math.ceil(max(540 - write - step, 270, SAVE_GAP_STEPS * step) / step)
    assert 1 < n < 200
    assert f"saves every {n} steps ~ " in text and f"a write guessed at ~{write:.0f} s" in text
    assert f"and at the stage's end: {math.ceil(200 / n)} of ~{ckpt / 1e9:.0f} GB each" in text
    # save_steps sooner than the timed saves wins; no timed save and no save_steps: the stage's end only
    assert "saves every 3 steps ~ " in _plan(dataclasses.replace(cfg, save_steps=3))[1]
    off = _plan(dataclasses.replace(cfg, save_interval_minutes=0))[1]
    assert "saves at the stage's end (no timed saves): 1 of ~" in off
    # synchronous saves under auto: after the first, the interval is 100 x the blocked write (auto_save_every_s);
    # 2000 steps: the first save, ~1 every 278 min, the stage's end
    sync = _plan(dataclasses.replace(cfg, async_save=False, stages=[StageConfig(name="a", max_steps=2000)]))[1]
    m = re.search(r"saves after (\d+) steps ~ .*, then every (\d+) steps ~ .*synchronous: (\d+) min after the run's "
                  r"first\) and at the stage's end: (\d+) of", sync)
    assert m and int(m.group(1)) == n and int(m.group(3)) == round(100 * write / 60)
    then = int(m.group(2))
    assert _close(then * step, 100 * write - write - step, 0.02) and int(m.group(4)) == 2 + (1999 - n) // then


def test_a_manual_stage_uses_tokens_per_second_and_a_step_over_an_hour_is_marked():
    """Without memory_choice the step is the stage's tokens per step at the plan's tokens/s/GPU (sp GPUs share a
    sequence); Llama-3-8B at 1M on sp=1 with 4 micro-steps is ~2.3 h a step: marked in the stage and the run line."""
    cfg = _cfg(gradient_accumulation_steps=4, stages=[StageConfig(name="long", max_steps=3, max_seq_length=1048576,
                                                                  sequence_parallel_size=1)])
    (s,), text = _plan(cfg)
    assert s.memory_choice is None
    tps = tokens_per_sec_per_gpu(SHAPE, 1048576, mfu=0.4, peak_tflops=989.0)
    step = 4 * 1048576 / tps
    assert step > 3600
    (steps, printed, number, unit, which) = TIME.findall(text)[0]
    assert (int(steps), printed) == (3, f"{step:.0f}") and _close(_seconds(number, unit), 3 * step, 0.03)
    assert which.startswith(f"the step at ~{tps:.0f} tokens/s/GPU, no recompute or offload counted")
    assert "not measured) !! a step over an hour;" in text
    assert text.splitlines()[-1].endswith("; a step over an hour in stage 0")


def test_a_cpu_plan_has_no_time(monkeypatch):
    """A CPU run's plan quotes no H100 time (issue 27), so neither a time line nor a run line."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    cfg = dataclasses.replace(_cfg(stages=[StageConfig(name="a", max_steps=2)]), nodes=0)
    text = _plan(cfg)[1]
    assert "memory plan:" in text and "time: " not in text and "run: " not in text
