"""Stages of a context-extension curriculum as data, resolved and validated before any work.

A run without `stages:` is a one-stage curriculum made of the top-level settings. Each stage's fields
left unset inherit the run's, except `rope`: a stage without one keeps the previous stage's (the first stage: the
run's `rope`, else the model's own; `rope: {}` goes back to the model's own). `locate(stages, global_step)` is a pure function of the step.
`memory_features: auto` and a stage's `sequence_parallel_size: auto` are resolved here, once, by the planner
(planner/auto_features.py): every stage leaves with its memory features and SP degree fixed.
What a resume keeps of the stages its checkpoint ran (step counts, RoPE) is training/curriculum_resume.py.
"""

from __future__ import annotations

import dataclasses
import types
from dataclasses import dataclass, field

from base.host import job_ranks_per_node
from base.log import print0
from base.parallel import check_layout, split_sp
from data.replay import parse_replay
from model_utils.rope import short_scaling, stage_rope
from planner.shapes import ROPE_MAX_POSITIONS
from training.config import Config, StageConfig
from training.config_types import typed
from training.eval_settings import stage_eval


@dataclass(frozen=True)
class Stage:
    index: int
    name: str
    max_seq_length: int
    sp: int
    rope: dict | None  # None: the model's own
    learning_rate: float
    min_lr: float
    warmup_steps: int
    lr_scheduler: str
    max_steps: int
    reset_optimizer: bool
    deepspeed_overrides: dict = field(default_factory=dict)
    eval: dict = field(default_factory=dict)
    data: dict | list | None = None  # the stage's mixture (data/mixture.py); None: the whole stream
    # memory features of the stage (None: the run's flags); auto and stage mappings are resolved into these
    tiled_mlp: bool | None = None
    tiled_logits: bool | None = None
    checkpoint_every: int | None = None  # 0: none, K: decoder layers 0, K, 2K, ...
    offload_activations: bool | None = None
    keep_attention: bool | None = None  # checkpointed layers keep the attention output (model_utils/memory.py)
    attention_head_chunks: int | None = None  # attention in N head chunks (auto resolved here: the planner's count)
    ring_attention: bool | None = None  # cp K/V in a ring (model_utils/ring_attention.py); auto: where the gather binds
    logits_tile_mb: int | None = None  # tiled logits: MiB of fp32 logits per tile (auto: from the budget)
    memory_choice: dict | None = None  # what auto chose and why (predicted peak, budget, speed): plan and metrics
    tasks: dict = field(default_factory=dict)  # synthetic task fractions of the stage (data/tasks.py)
    replay: dict | None = None  # short-context replay token shares (data/replay.py)
    cp: int | str = 1  # context-parallel factor of sp ("auto" until check_stages splits it for the model)
    kind: str = "text"  # text | sft: how the stage packs its documents (data/pipeline.py, docs/sft.md)
    loss_weighting: str = "token"  # token | conversation: the stage's own, else the run's (data/sharding.py collate)
    steps_from: str = "steps"  # steps (max_steps given) | tokens:N (max_tokens N) | epochs:E: how max_steps was found
    rope_from: int | None = None  # the earlier stage whose own `rope` this one keeps (None: its own, the run's, the model's)
    warmup_ratio: float | None = None  # warmup_steps is this share of max_steps (--warmup_ratio: training/hf_args.py)
    full_steps: int | None = None  # the whole stage's count at today's samples per step, where a resume set max_steps


MEMORY_KEYS = ("tiled_mlp", "tiled_logits", "checkpoint_every", "gradient_checkpointing", "offload_activations",
               "keep_attention")


def _memory_mode(cfg: Config, s: StageConfig, i: int) -> tuple[str, dict]:
    """(manual | auto, the settings pinned for this stage): the run's flags set on, then the stage mapping."""
    mode = s.memory_features if isinstance(s.memory_features, str) else cfg.memory_features
    if mode not in ("manual", "auto"):
        raise ValueError(f"stage {i}: memory_features {mode!r}: use auto, manual or a mapping of {list(MEMORY_KEYS)}")
    every = cfg.checkpoint_every or (1 if cfg.gradient_checkpointing or cfg.offload_activations else 0)
    run = {"tiled_mlp": cfg.tiled_mlp, "tiled_logits": cfg.tiled_logits, "checkpoint_every": every,
           "offload_activations": cfg.offload_activations, "keep_attention": cfg.keep_attention}
    pinned = dict(run) if mode == "manual" else {k: v for k, v in run.items() if v}  # auto: only what is on
    if isinstance(s.memory_features, dict):
        unknown = sorted(set(s.memory_features) - set(MEMORY_KEYS))
        if unknown:
            raise ValueError(f"stage {i}: memory_features {unknown}: use {list(MEMORY_KEYS)}")
        own = {k: typed(k, v, "int" if k == "checkpoint_every" else "bool", f"stage {i}'s memory_features")
               for k, v in s.memory_features.items()}  # "false" is not true, 2.5 layers not 2
        if own.get("checkpoint_every", 0) < 0:
            raise ValueError(f"stage {i}: memory_features checkpoint_every {own['checkpoint_every']}: use 0 (off) or K "
                             ">= 1 (layers 0, K, 2K, ... checkpointed)")
        if "gradient_checkpointing" in own:
            own.setdefault("checkpoint_every", 1 if own.pop("gradient_checkpointing") else 0)
        if own.get("offload_activations") and not own.get("checkpoint_every", pinned.get("checkpoint_every")):
            own["checkpoint_every"] = 1  # offloading the checkpoints turns checkpointing on
        pinned.update(own)
    if mode == "manual" and pinned.get("keep_attention") and not pinned.get("checkpoint_every"):
        raise ValueError(f"stage {i}: keep_attention changes what checkpointed layers recompute, and no layer is "
                         "checkpointed: add --gradient_checkpointing or --checkpoint_every K, or drop keep_attention")
    return mode, pinned


def _resolve_memory(cfg: Config, s: StageConfig, i: int, sl: int, sp, world: int, budget) -> tuple[int, dict]:
    """(SP degree, Stage memory fields) of one stage; the planner runs only for auto (features or SP). Under
    memory_features auto on a GPU it also decides the ZeRO-3 offloads the DeepSpeed JSON allows and the stage's
    deepspeed_overrides do not pin (planner/auto_features.offload_plan); the choice reaches the engine as the
    stage's `deepspeed_overrides` ({"zero_optimization": {"offload_param": {"device": "cpu" | "none"}, ...}}
    merged into the stage's own), and `memory_choice` says which offloads are on, why, and what they cost."""
    mode, pinned = _memory_mode(cfg, s, i)
    chunks = cfg.attention_head_chunks  # auto: the planner's count under memory_features auto, else 1 (all heads)
    if chunks != "auto" or mode == "manual":
        pinned["attention_head_chunks"] = 1 if chunks == "auto" else chunks
    if cfg.ring_attention or mode == "manual":  # auto: the ring only where the gathered K/V would not fit
        pinned["ring_attention"] = bool(cfg.ring_attention)
    if sp != "auto" and (isinstance(sp, bool) or not isinstance(sp, int) or sp < 1):
        raise ValueError(f"stage {i}: sequence_parallel_size {sp!r}: use an integer >= 1 or auto")
    if mode == "manual" and sp != "auto":
        return sp, {**pinned, "memory_choice": None}
    from planner import auto_features as af
    from planner.memory_model import Features, lean_mlp_applies, lean_norm_applies, load_shape
    from training.config import _load, _merge

    device, usable = budget()
    without = getattr(budget, "without_flash", None)  # agreed over ranks (agreed_budget), else this rank's own
    if device == "cuda" and "ring_attention" not in pinned and (without() if without else _gpu_without_flash(cfg)):
        pinned["ring_attention"] = False  # auto never picks the ring that context_parallel.register would refuse
    own = s.deepspeed_overrides or {}
    ds_json = _load(cfg.deepspeed)
    offloads = Features(**af.zero_offloads(_merge(ds_json, own).get("zero_optimization", {})),
                        lean_rmsnorm=cfg.lean_rmsnorm, lean_mlp=cfg.lean_mlp)
    free, fixed_why = af.offload_plan(ds_json.get("zero_optimization", {}), own, device, mode == "auto")
    bf16 = cfg.bf16 if cfg.bf16 is not None else device == "cuda" and not cfg.fp16
    try:
        shape = load_shape(cfg.model_name_or_path)
        choice = af.choose(shape, sl, world, usable,
                           sp=None if sp == "auto" else sp, sp_max=gpus_per_node(cfg) or world,
                           pinned={**pinned, "logits_tile_mb": cfg.logits_tile_mb}, offloads=offloads,
                           precision="bf16" if bf16 else "fp32", device=device, free_offloads=free,
                           ranks_per_node=gpus_per_node(cfg) or world,
                           accum=cfg.gradient_accumulation_steps * cfg.per_device_train_batch_size,
                           host_bytes_per_rank=getattr(budget, "host_bytes", lambda: None)(),
                           cp=s.context_parallel_size if s.context_parallel_size is not None else cfg.context_parallel_size)
    except ValueError as e:
        raise ValueError(f"stage {i} ({s.name or f'stage{i}'}): {e}") from None
    f = choice.features
    why = "; ".join(w for w in (choice.offload_why, fixed_why) if w)
    record = {"memory_features": mode, "sp_auto": sp == "auto", "device": device, **choice.as_dict(),
              "offload_why": why, "offload_auto": list(free),
              "lean_rmsnorm": lean_norm_applies(shape, offloads), "lean_mlp": lean_mlp_applies(shape, offloads)}
    return choice.sp, {"tiled_mlp": f.tiled_mlp, "tiled_logits": f.tiled_logits, "checkpoint_every": f.every,
                       "offload_activations": f.offload_activations, "keep_attention": f.keep_attention,
                       "logits_tile_mb": f.logits_tile_mb or None, "attention_head_chunks": f.attention_head_chunks,
                       "ring_attention": f.ring_attention, "deepspeed_overrides": _merge(own, af.offload_overrides(choice, free)),
                       "memory_choice": record}


def _gpu_without_flash(cfg: Config) -> bool:
    """A real GPU run whose attention is not flash_attention_2 (flash-attn not installed, or another backend asked):
    the context-parallel ring runs flash only there (model_utils/context_parallel.register). A dry run plans as asked."""
    import torch

    if not torch.cuda.is_available():
        return False
    from model_utils.build import pick_attn_implementation

    return pick_attn_implementation(cfg.attn_implementation) != "flash_attention_2"


def device_budget(gpu_mem_gb: float, mem_cap_gb: float) -> tuple[str, int]:
    """(device, bytes per rank the tensors may use): the GPU's memory (given, or detected) less GPU_RESERVED;
    on a CPU run, the --mem_cap_gb cap less this process' peak RSS so far (interpreter and libraries) and
    CPU_ENGINE_OVERHEAD. CPU peak RSS follows the tensors only with MALLOC_MMAP_THRESHOLD_=65536 (glibc otherwise
    keeps freed blocks: +0.2 GiB measured at 8192 tokens), as bench/memory.py runs."""
    import torch

    from base.host import peak_rss_bytes
    from planner.auto_features import CPU_ENGINE_OVERHEAD, gpu_budget
    from planner.memory_model import GiB

    if gpu_mem_gb > 0:
        return "cuda", gpu_budget(gpu_mem_gb)
    if torch.cuda.is_available():
        return "cuda", gpu_budget(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / GiB)
    if mem_cap_gb > 0:
        rss = peak_rss_bytes()
        return "cpu", int(mem_cap_gb * GiB) - rss - CPU_ENGINE_OVERHEAD
    raise ValueError("memory_features auto / sequence_parallel_size auto need the memory per rank: --gpu_mem_gb "
                     "(detected on a GPU) or --mem_cap_gb on a CPU run")


def gpus_per_node(cfg) -> int:
    """Ranks per node: the recipe's cluster, else the node size the job agreed at its process group
    (base.host.job_ranks_per_node: the launchers' sizes gathered from every rank, their gcd on uneven nodes; a
    dry run without a group: this process' launcher); 0 when unknown. The same on every rank, so every rank
    splits SP (and the planner chooses) alike."""
    return cfg.gpus_per_node or job_ranks_per_node()


def agreed_budget(cfg: Config):
    """budget() for auto: device_budget measured once, then the minimum over ranks (a
    collective on the first call, made by every rank at the same point of resolve_stages). Each rank's own
    reading differs (peak RSS, a GPU another process holds memory on): from its own number two ranks could pick
    different features, hence different collectives, and hang. The smallest budget fits every rank."""
    agreed: list = []

    def budget() -> tuple[str, int]:
        if not agreed:
            from base import comm
            from base.host import job_memory_available

            device, own = device_budget(cfg.gpu_mem_gb, cfg.mem_cap_gb)
            # the host memory a rank's offloads may take (issue 43): what the job may still use on this node over its
            # ranks, less the runtime a rank holds beyond the planner's terms (planner/cluster.RUNTIME_HOST_GIB,
            # measured; plan.py's --cpu_overhead_gb); agreed as the minimum too.
            # memory_features auto bounds the ZeRO and checkpoint offloads by it, as plan.py does (GPU runs only)
            # (a real GPU run only: a dry run, or one planned for GPUs on a machine without any, is not on the node it
            # plans for, and this machine's memory would bound the target's offloads)
            import torch

            on_node = device == "cuda" and torch.cuda.is_available() and not getattr(cfg, "dry_run", False)
            avail = job_memory_available() if on_node else None
            from planner.cluster import RUNTIME_HOST_GIB

            host = avail // max(1, gpus_per_node(cfg) or 1) - int(RUNTIME_HOST_GIB * 2**30) if avail else 2.0**62
            # whether every rank runs flash_attention_2 (the ring's kernel): a node without flash-attn (another
            # container or venv) planned no ring while the others planned one, other cp groups: a hang, or a refusal
            # at context_parallel.register on the nodes that have it
            flash = 0.0 if device == "cuda" and _gpu_without_flash(cfg) else 1.0
            got = comm.all_reduce([float(own), float(host), flash], op="min").tolist()
            agreed.append((device, int(got[0]), None if got[1] >= 2.0**62 else max(0, int(got[1])), got[2] < 1))
        return agreed[0][:2]
    budget.host_bytes = lambda: (budget(), agreed[0][2])[1]  # type: ignore[attr-defined]
    budget.without_flash = lambda: (budget(), agreed[0][3])[1]  # type: ignore[attr-defined]
    return budget


def resolve_stages(cfg: Config, dp_of_sp, budget=None) -> list[Stage]:
    """Fill every stage from the run's defaults; `dp_of_sp(sp)` gives the DP degree for a SP degree
    (to turn `max_tokens` into steps; dp_of_sp(1) is the world). `budget()` -> (device, bytes per rank) for
    memory_features / sequence_parallel_size auto (default: device_budget from
    --gpu_mem_gb / the GPU / --mem_cap_gb). Raises a one-line ValueError on an inconsistent recipe."""
    raw = cfg.stages or [StageConfig(name="main")]
    if budget is None:
        budget = agreed_budget(cfg)
    stages = []
    rope, rope_from = cfg.rope or None, None  # what a stage without `rope:` runs: the last one given ({}: the model's)
    for i, s in enumerate(raw):
        if s.rope is not None:
            rope, rope_from = s.rope or None, i
        zero = [k for k in ("max_seq_length", "sequence_parallel_size", "max_steps", "max_tokens") if getattr(s, k) == 0]
        if zero:  # `x or cfg.x` took 0 for unset: the stage silently ran the run's value
            raise ValueError(f"stage {i}: {zero[0]} 0: give a positive value, or leave it out for the run's")
        sl = s.max_seq_length or cfg.max_seq_length
        sp, memory = _resolve_memory(cfg, s, i, sl, s.sequence_parallel_size or cfg.sequence_parallel_size,
                                     dp_of_sp(1), budget)
        overrides = memory.pop("deepspeed_overrides", s.deepspeed_overrides or {})  # with auto's offload choice
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
                   rope=rope, rope_from=None if s.rope is not None else rope_from, learning_rate=lr, min_lr=min_lr,
                   warmup_steps=s.warmup_steps if s.warmup_steps is not None else cfg.warmup_steps,
                   lr_scheduler=s.lr_scheduler or cfg.lr_scheduler, max_steps=steps,
                   steps_from=f"tokens:{s.max_tokens}" if s.max_tokens else "steps",
                   reset_optimizer=s.reset_optimizer, deepspeed_overrides=overrides,
                   eval=stage_eval(cfg, s.eval, f"stages[{i}].eval"), data=s.data, tasks=s.tasks or {}, replay=s.replay,
                   kind=s.kind or getattr(cfg, "data_kind", "text"),
                   loss_weighting=s.loss_weighting or getattr(cfg, "loss_weighting", "token"),
                   cp=s.context_parallel_size if s.context_parallel_size is not None else cfg.context_parallel_size,
                   **memory)
        parse_replay(st.replay, st.max_seq_length, f"stage {i} ({st.name}) replay")  # a bad replay: one line, now
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
        if (st.warmup_steps >= st.max_steps and st.learning_rate != st.min_lr  # lr == min_lr: constant by design
                and not _steps_from_epochs(cfg, s)):  # epochs: sized later (hf_args)
            print0(f"note: stage {i} ({st.name}): warmup_steps {st.warmup_steps} >= its {st.max_steps} steps: its LR "
                   f"rises to {min(1.0, st.max_steps / max(1, st.warmup_steps)):.0%} of {st.learning_rate:g} and never "
                   "decays (give the stage its own warmup_steps, or more steps)")
        stages.append(st)
    return stages


def _steps_from_epochs(cfg: Config, s: StageConfig) -> bool:
    """The stage's steps (and a --warmup_ratio warmup) come from --num_train_epochs, counted once the data is open."""
    return getattr(cfg, "num_train_epochs", None) is not None and not (s.max_steps or s.max_tokens)


def check_stages(stages: list[Stage], world: int, num_heads: int, num_kv_heads: int,
                 model=None, ranks_per_node: int = 0) -> list[Stage]:
    """Every stage's layout and RoPE are possible on `world` ranks (one-line ValueError otherwise); returns the
    stages with their SP split into ulysses x cp (`cp: auto`: Ulysses as large as the heads and a node of
    `ranks_per_node` allow, base.parallel.split_sp). Each stage's RoPE is computed from the model's (`model`: its
    text config, or its rope_parameters as a dict) as the stage will run it (model_utils/rope.stage_rope: a stage whose
    `rope` resolved to None runs the model's, which must suit its SP degree); what it replaces is said once, and a
    stage that keeps an earlier stage's `rope` (resolve_stages) says whose."""
    if model is None or isinstance(model, dict):
        model = types.SimpleNamespace(rope_parameters=model or {}, max_position_embeddings=0)
    out, notes = [], []
    for s in stages:
        try:
            _, cp = split_sp(s.sp, num_heads, num_kv_heads, ranks_per_node or None, s.cp)
            s = dataclasses.replace(s, cp=cp)
            check_layout(world, s.sp, num_heads, num_kv_heads, s.max_seq_length, s.cp, ranks_per_node or None)
            params, said = stage_rope(model, s.rope or None, "rope", s.sp)
            notes += [f"stage {s.index} ({s.name}): {n}" for n in said + short_scaling(params, s.max_seq_length)]
            _eval_positions(s, stages, params)
            if s.rope_from is not None:
                notes.append(f"stage {s.index} ({s.name}) has no rope of its own: it keeps stage {s.rope_from} "
                             f"({stages[s.rope_from].name})'s {s.rope} (rope: {{}} for the model's own)")
        except ValueError as e:
            raise ValueError(f"stage {s.index} ({s.name}): {e}") from None
        out.append(s)
    for line in dict.fromkeys(notes):
        print0(f"note: {line}")
    return out


def _eval_positions(s: Stage, stages: list[Stage], params: dict) -> None:
    """One-line ValueError where a stage evaluates (eval.lengths / --eval_lengths, its held-out lengths) a RoPE model
    past float32 positions (model_utils/rope.check_positions): a 32M passkey length after a 16M stage scored positions
    the model cannot tell apart (20,000,000 and 20,000,001 have one cos/sin row), into eval/summary.md unsaid."""
    # torch and the data pipeline: imported only where stages are checked
    from training.evaluation import eval_forward_lengths

    longest = max(eval_forward_lengths(s, stages))
    if params and longest > ROPE_MAX_POSITIONS:
        raise ValueError(f"evaluates at {longest:,} tokens (eval.lengths / --eval_lengths): positions >= "
                         f"{ROPE_MAX_POSITIONS:,} collapse in float32 RoPE (HF, vLLM, Meta's reference); give lengths "
                         f"up to {ROPE_MAX_POSITIONS:,}")


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
