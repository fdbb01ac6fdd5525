"""Stages of a context-extension curriculum as data, resolved and validated before any work.

A run without `stages:` is a one-stage curriculum made of the top-level settings. Each stage's fields
left unset inherit the run's. `locate(stages, global_step)` is a pure function of the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from model_utils.rope import check_rope
from training.config import Config, StageConfig
from training.parallel import check_layout


@dataclass(frozen=True)
class Stage:
    index: int
    name: str
    max_seq_length: int
    sp: int
    rope: dict | None
    learning_rate: float
    min_lr: float
    warmup_steps: int
    lr_scheduler: str
    max_steps: int
    reset_optimizer: bool
    deepspeed_overrides: dict = field(default_factory=dict)
    eval: dict = field(default_factory=dict)
    data: dict | list | None = None  # the stage's mixture (data/mixture.py); None: the whole stream
    tasks: dict = field(default_factory=dict)  # synthetic task fractions of the stage (data/tasks.py)


def resolve_stages(cfg: Config, dp_of_sp) -> list[Stage]:
    """Fill every stage from the run's defaults; `dp_of_sp(sp)` gives the DP degree for a SP degree
    (to turn `max_tokens` into steps). Raises a one-line ValueError on an inconsistent recipe."""
    raw = cfg.stages or [StageConfig(name="main")]
    stages = []
    for i, s in enumerate(raw):
        sl = s.max_seq_length or cfg.max_seq_length
        sp = s.sequence_parallel_size or cfg.sequence_parallel_size
        if s.max_steps and s.max_tokens:
            raise ValueError(f"stage {i}: set max_steps or max_tokens, not both")
        if s.max_tokens:
            per_step = sl * cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * dp_of_sp(sp)
            steps = -(-s.max_tokens // per_step)
        else:
            steps = s.max_steps or cfg.max_steps
        lr = s.learning_rate if s.learning_rate is not None else cfg.learning_rate
        min_lr = s.min_lr if s.min_lr is not None else cfg.min_lr
        st = Stage(index=i, name=s.name or f"stage{i}", max_seq_length=sl, sp=sp,
                   rope=s.rope if s.rope is not None else cfg.rope, learning_rate=lr, min_lr=min_lr,
                   warmup_steps=s.warmup_steps if s.warmup_steps is not None else cfg.warmup_steps,
                   lr_scheduler=s.lr_scheduler or cfg.lr_scheduler, max_steps=steps,
                   reset_optimizer=s.reset_optimizer, deepspeed_overrides=s.deepspeed_overrides or {},
                   eval=s.eval or {}, data=s.data, tasks=s.tasks or {})
        if st.max_steps < 1 or st.sp < 1 or st.max_seq_length < 1:
            raise ValueError(f"stage {i} ({st.name}): max_steps, sequence_parallel_size and max_seq_length must "
                             f"be >= 1, got {st.max_steps}, {st.sp}, {st.max_seq_length}")
        if not (0 <= st.min_lr <= st.learning_rate) or st.learning_rate <= 0:
            raise ValueError(f"stage {i} ({st.name}): need 0 <= min_lr ({st.min_lr}) <= learning_rate "
                             f"({st.learning_rate}), learning_rate > 0")
        if st.lr_scheduler not in ("cosine", "linear", "constant"):
            raise ValueError(f"stage {i} ({st.name}): lr_scheduler {st.lr_scheduler!r}: use cosine, linear or constant")
        if stages and st.max_seq_length < stages[-1].max_seq_length:
            raise ValueError(f"stage {i} ({st.name}): max_seq_length {st.max_seq_length} is shorter than the "
                             f"previous stage's {stages[-1].max_seq_length}; lengths must not decrease")
        stages.append(st)
    return stages


def check_stages(stages: list[Stage], world: int, num_heads: int, num_kv_heads: int,
                 model_rope: dict | None = None) -> None:
    """Every stage's layout and RoPE are possible on `world` ranks (one-line ValueError otherwise). A stage without
    its own `rope` keeps the model's (`model_rope`, the config's rope_parameters), which must suit its SP degree."""
    for s in stages:
        try:
            check_layout(world, s.sp, num_heads, num_kv_heads, s.max_seq_length)
            if s.rope:
                check_rope(s.rope, "rope", s.sp)
            elif (model_rope or {}).get("rope_type") == "dynamic":
                check_rope(model_rope, "the model's rope_parameters", s.sp)
        except ValueError as e:
            raise ValueError(f"stage {s.index} ({s.name}): {e}") from None


def stage_start(stages: list[Stage], index: int) -> int:
    """Global step at which stage `index` begins."""
    return sum(s.max_steps for s in stages[:index])


def locate(stages: list[Stage], global_step: int) -> tuple[int, int]:
    """(stage index, step within that stage) after `global_step` completed steps (pure)."""
    for s in stages:
        start = stage_start(stages, s.index)
        if global_step < start + s.max_steps:
            return s.index, global_step - start
    return len(stages) - 1, stages[-1].max_steps


def total_steps(stages: list[Stage]) -> int:
    return stage_start(stages, len(stages))
