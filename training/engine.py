"""Model + DeepSpeed engine assembly for one stage: ds config -> partitioned model -> Ulysses -> engine."""

from __future__ import annotations

import dataclasses
import weakref

import deepspeed
import torch

from base import progress
from base.env import ask_cpu_once
from base.parallel import ParallelDims
from model_utils import engagement, ulysses
from model_utils.build import build_model
from model_utils.memory import apply_memory_features
from planner.memory_model import Features
from training.config import Config
from training.curriculum import Stage
from training.ds_config import build_ds_config, make_optimizer
from training.schedule import lambda_scheduler


def stage_config(cfg: Config, stage: Stage) -> Config:
    """The run config as seen by one stage (its length, SP degree, LR schedule and memory features: the ones
    resolve_stages fixed, e.g. by memory_features auto; None keeps the run's flags)."""
    memory = {k: getattr(stage, k) for k in ("tiled_mlp", "tiled_logits", "offload_activations", "keep_attention",
                                             "logits_tile_mb", "attention_head_chunks", "ring_attention")
              if getattr(stage, k, None) is not None}
    if getattr(stage, "checkpoint_every", None) is not None:
        memory.update(checkpoint_every=stage.checkpoint_every, gradient_checkpointing=stage.checkpoint_every > 0)
    return dataclasses.replace(cfg, max_seq_length=stage.max_seq_length, sequence_parallel_size=stage.sp,
                               learning_rate=stage.learning_rate, min_lr=stage.min_lr, warmup_steps=stage.warmup_steps,
                               lr_scheduler=stage.lr_scheduler, max_steps=stage.max_steps, rope=stage.rope, **memory)


def features_of(cfg: Config) -> Features:
    """The memory features a (stage's) config asks for, as the value the model patches take: model_utils reads
    features, never the run's config."""
    names = {f.name for f in dataclasses.fields(Features)} - {"offload_params", "offload_optimizer"}
    return Features(**{n: getattr(cfg, n) for n in names})


# the Hugging Face Trainer's (Trainer.get_decay_parameter_names): no weight decay on biases and norm gains
NO_DECAY = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]


def param_groups(model, split: bool) -> list:
    """The optimizer's parameters: with `split`, two groups as the Hugging Face Trainer builds them (the decayed ones,
    then biases and norm gains with weight_decay 0; --weight_decay 0.1 pulled every RMSNorm gain toward 0 and decayed
    Qwen's q/k/v biases), always both whatever --weight_decay (a resume that changes it keeps the optimizer's shape);
    without, one group of all (what checkpoints written before the split hold: their state loads only so)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not split:
        return [p for _, p in named]
    from transformers.trainer_pt_utils import get_parameter_names

    decay = set(get_parameter_names(model, [torch.nn.LayerNorm], NO_DECAY))
    groups = [{"params": [p for n, p in named if n in decay]},
              {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_engine(cfg: Config, dims: ParallelDims, hf_config, attn: str, bf16: bool, seed: int,
                 ds_overrides: dict | None = None, pretrained: bool = True, split_decay: bool = True):
    """A DeepSpeed engine over the HF model (ZeRO-3, Ulysses x context-parallel SP when dims.sp > 1, our LR schedule).
    `pretrained=False`: a checkpoint is loaded next and replaces every weight; the HF weights are not read."""
    ask_cpu_once()  # DeepSpeed's CPU Adam and op loads ask py-cpuinfo: ~1.1 CPU-s each, once per process (base/env.py)
    text_cfg = hf_config.get_text_config()
    ds_config = build_ds_config(cfg, dims, bf16, text_cfg.hidden_size, ds_overrides)
    torch.manual_seed(seed)  # same init on every rank (and the same as a plain from_config with this seed)
    model, handle = build_model(cfg.model_name_or_path, hf_config, ds_config, attn,
                                torch.bfloat16 if bf16 else torch.float16 if cfg.fp16 else torch.float32, pretrained)
    features = features_of(cfg)
    apply_memory_features(model, features)
    ulysses.unregister()  # a previous stage may have registered another SP degree
    mpu = ulysses.register(model, dims, attn, cfg.per_device_train_batch_size, features.attention_head_chunks,
                           ring=features.ring_attention)
    engagement.arm(model, features)  # what each step's counters must reach (model_utils/engagement.py)
    progress.watch_layers(getattr(model.get_decoder(), "layers", None) or [])  # a hang judged per layer, not per phase
    params = param_groups(model, split_decay)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=params, config=ds_config, mpu=mpu,
        optimizer=make_optimizer(ds_config, cfg, params),  # AdamW from the flags when the JSON names none
        lr_scheduler=lambda_scheduler(cfg.learning_rate, cfg.min_lr, cfg.warmup_steps, cfg.max_steps,
                                      cfg.lr_scheduler))
    # ZeRO-3 partitions over the whole world whatever the SP degree, but DeepSpeed names checkpoint files
    # after the "model-parallel" rank, which the SP mpu aliases to the SP rank. Name them by world rank only,
    # so a checkpoint loads under another SP degree at the same world size (e.g. the next stage's).
    engine.checkpoint_mp_rank = 0
    engine._hf_ds_config_handle = handle
    engine.ds_config_used = ds_config  # transformers reads ZeRO-3 settings through it while the engine lives
    engine.train()
    return engine


def release_engine(engine) -> list[tuple[str, weakref.ref]]:
    """End a stage's engine so that its memory goes back; returns weak references to the engine, its model and its
    optimizer, which must all be dead once the caller has dropped its own reference and run gc.collect()
    (training/stage_records.py checks and records it: `engine_released` in metrics.jsonl).

    What kept a stage's engine alive after its stage, each found on this CPU by following the referrers of the old
    engine at the next stage's build (gc.get_referrers from a weakref):
    - ZeRO-3's parameter offload pushes the top module on a module-level list (deepspeed.runtime.zero.
      parameter_offload.FWD_MODULE_STACK) when it sets up and never pops it; under activation checkpointing the
      recomputed submodules are pushed again at every step and not popped either (4 LlamaMLP / Linear entries a step
      on a 4-layer model with checkpoint_every 1 or 2): every module of the released model comes off the list.
    - PartitionedParameterCoordinator.__params_to_release is memoized with a class-level functools.lru_cache(maxsize=
      None) (deepspeed 0.19.8, runtime/zero/partitioned_param_coordinator.py), filled from an engine's second step on
      (once its trace is complete): its keys hold the coordinator and every submodule of the model, whose forward hooks
      hold the engine, so the model, the optimizer, CPU Adam's fp32 master and moments and the offload buffers stayed
      alive until the process ended (an engine built but never stepped twice, as tests/workers/rope.py's, was freed).
    Measured on this CPU (75M parameters, fp32, both offloads, 2 ranks, 2 steps a stage): +0.87 GiB RSS per rank per
    stage, all four engines of a 4-stage run alive at its end. On the H200 ladder (one rank, 1.49B parameters in bf16,
    both offloads: 35.5 GiB of host state per engine, the planner's host terms in bench/results/gpu.json's headline,
    pinned blocks as held) the three earlier stages' engines, ~106 GiB, were then still alive when the fourth built
    its own (+35.5) and loaded its checkpoint: the rank was SIGKILLed there on the 125 GiB host (no swap). At
    Llama-3-8B on 32 ranks with both offloads each leaked engine holds ~4.7 GiB per rank, ~37 GiB per 8-rank node:
    ~110 GiB more by the fourth stage of 128k -> 1M. Clearing the cache costs nothing that matters: the next engine's
    coordinator fills its own keys at its second step (a set of parameter ids per submodule and step, computed
    once)."""
    from deepspeed.runtime.zero import parameter_offload

    module = engine.module
    watch = []
    for name, obj in (("engine", engine), ("model", module), ("optimizer", getattr(engine, "optimizer", None))):
        try:
            watch.append((name, weakref.ref(obj)))
        except TypeError:  # None, or a stand-in without weak references (the tests')
            pass
    engine.destroy()
    arena = module.__dict__.get("_host_arena")  # the offloaded checkpoints' page-locked slots (base/host_arena.py):
    if arena is not None:  # unregistered now, not when the model's cycle is collected (5M on 8 GPUs: 153 GiB a rank)
        arena.release()
    mine = {id(m) for m in module.modules()}  # the top module, and a submodule whose post-forward hook never ran
    parameter_offload.FWD_MODULE_STACK[:] = [m for m in parameter_offload.FWD_MODULE_STACK if id(m) not in mine]
    _clear_method_caches(_coordinator_class())
    # the model, the optimizer and the engine reference each other: the caller drops its reference and runs
    # gc.collect() so that the cycle is freed before the next engine is built, not at some later collection
    return watch


def _coordinator_class():
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    return PartitionedParameterCoordinator


def _clear_method_caches(cls) -> int:
    """Clear every functools cache on `cls`'s methods, found on the method itself or in its decorators' closures
    (DeepSpeed wraps the lru_cache in instrument_w_nvtx, whose wrapper keeps no __wrapped__). Returns how many."""
    n = 0
    for attr in vars(cls).values():
        seen = [attr]
        for cell in getattr(attr, "__closure__", None) or ():
            try:
                seen.append(cell.cell_contents)
            except ValueError:  # an empty cell
                pass
        for f in seen:
            if callable(getattr(f, "cache_clear", None)):
                f.cache_clear()
                n += 1
    return n


def return_cached_memory() -> None:
    """After the old engine is collected (gc.collect): the device's cached blocks and torch's cached page-locked host
    blocks go back, so the next stage starts from one engine's host memory whatever its own buffers' sizes.

    ZeRO-3's offload buffers are pinned through torch's caching host allocator (DeepSpeed's `pin_memory`), which keeps
    a freed block cached for the run: the next engine reuses those of the same (rounded) size, but a stage whose
    buffers differ (another offload choice under memory_features auto, other sub-group sizes) left the old ones cached
    on top of its own. Cost: the next engine pins its buffers afresh (cudaHostAlloc, the kernel zeroing each page):
    ~0.1-0.5 s per GiB once per stage; Llama-3-8B on 32 ranks, both offloads: ~2-3 GiB pinned per rank, ~1 s."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return
    torch.cuda.empty_cache()
    host_empty = getattr(torch._C, "_host_emptyCache", None)  # torch's own call (torch/cuda/graphs.py), torch 2.13
    if host_empty is not None:
        host_empty()
