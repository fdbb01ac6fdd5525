"""A run's start, before any heavy work: the config and the model's shape (every user error surfaces here, in one
line), the dry run, the process group and the layout of every stage, the start-up checks, the plan, and the stop
flag. train.py calls these in order; each returns what the story needs next.
"""

from __future__ import annotations

import dataclasses
import os
import time

import torch

from base import comm
from base.host import check_cpu_placement, job_node_line
from base.log import open_rank_log, print0, set_main
from base.parallel import ParallelDims, check_shared_output, init_distributed
from base.run_lock import file_age, hold
from model_utils import linear_attention
from model_utils.build import load_hf_config, pick_attn_implementation
from model_utils.families import check_config, drop_router_logits
from model_utils.hub import check_same_snapshot
from training.config import Config, parse_config
from training.curriculum import Stage, check_stages, gpus_per_node, resolve_stages
from training.preemption import Deadline, PreemptionFlag
from training.preflight import check_network, check_stage_configs, preflight
from training.summary import plan_lines


@dataclasses.dataclass(frozen=True)
class Model:
    """The model a run trains, as far as it is known before any weight is read."""

    config: object  # the Hugging Face config (RoPE as saved; each stage applies its own)
    attn: str  # the attention backend that runs
    bf16: bool

    @property
    def arch(self):
        return self.config.get_text_config()

    @property
    def precision(self) -> str:
        return "bf16" if self.bf16 else "fp32"


def load_run_config(argv: list[str] | None) -> tuple[Config, Model]:
    """The validated config and the model's shape, attention and precision; one-line ValueError on bad input."""
    cfg = parse_config(argv)
    config = load_hf_config(cfg.model_name_or_path)
    attn = pick_attn_implementation(cfg.attn_implementation, planning=cfg.dry_run)
    if drop_router_logits(config):
        print0(f"note: {cfg.model_name_or_path}'s config asks for output_router_logits: the router's load-balancing loss "
               "is not trained here (the loss is the logits' cross-entropy); turned off")
    # the architecture has this attention, it can be document-masked, and in this many head chunks
    check_config(config, attn, cfg.attention_head_chunks)
    bf16 = (torch.cuda.is_available() and not cfg.fp16) if cfg.bf16 is None else cfg.bf16
    return cfg, Model(config, attn, bf16)


def _precision(cfg: Config, model: Model) -> str:
    return "fp16" if cfg.fp16 else model.precision


def _stages(cfg: Config, model: Model, world: int) -> list[Stage]:
    stages = resolve_stages(cfg, dp_of_sp=lambda sp: max(1, world // sp))
    a = model.arch
    if linear_attention.is_hybrid(a):  # gated delta-net layers: `cp: auto` is pure Ulysses, an explicit cp > 1 refused
        stages = [dataclasses.replace(s, cp=1) if s.cp in ("auto", None) else s for s in stages]
        for s in stages:
            linear_attention.check_layout(a, s.sp, int(s.cp))
    return check_stages(stages, world, a.num_attention_heads, a.num_key_value_heads, a, gpus_per_node(cfg))


def dry_run(cfg: Config, model: Model) -> None:
    """Validate the whole recipe for the cluster it names (every stage's DeepSpeed config too) and print the plan."""
    world = cfg.nodes * cfg.gpus_per_node or int(os.environ.get("WORLD_SIZE", "1"))
    stages = _stages(cfg, model, world)
    check_stage_configs(cfg, stages, world, model.bf16, model.arch.hidden_size, planning=True)
    check_stage_data(stages)
    print(f"dry run: world={world} ({cfg.nodes or 1} node(s)) model={cfg.model_name_or_path} attn={model.attn} "
          f"precision={_precision(cfg, model)} deepspeed={cfg.deepspeed}")
    print("\n".join(plan_lines(cfg, stages, world, cfg.gpus_per_node or world, model.bf16)))
    if cfg.num_train_epochs is not None:  # counted from the data when a run opens it (training/hf_args.py)
        print(f"steps: {cfg.num_train_epochs:g} epoch(s) of the data in each stage without its own max_steps or "
              "max_tokens (counted when the run opens its data; steps= above stands in until then)")


def check_stage_data(stages: list[Stage]) -> None:
    """What a real start refuses of each stage's `data:` and `tasks:` when it opens the data (data/pipeline.py), checked
    without it: a mixture component's keys and weights, the tasks' names and fractions. Whether a component matches
    any document and a task fits the stage's length need the data and the tokenizer: the real start checks those."""
    from data.mixture import parse_mixture
    from data.tasks import parse_tasks

    for s in stages:
        parse_mixture(s.data, f"stage {s.index} ({s.name}) data")
        parse_tasks(s.tasks, f"stage {s.index} ({s.name}) tasks")


def settle_attention(cfg: Config, model: Model, stages: list[Stage]) -> Model:
    """`--attn_implementation auto` on a GPU: the backend rank 0 measures fastest at the first stage's call, FA2 where a
    stage runs the ring or a layer has a window, one decision for every rank (model_utils/attention_pick.settle).
    Anything else: `model` as load_run_config chose it."""
    if cfg.attn_implementation != "auto" or not torch.cuda.is_available():
        return model
    from model_utils import attention_pick as ap

    first = stages[0]
    chunks = int(first.attention_head_chunks or 1)
    choice = ap.settle(model.attn, model.config, chunks=chunks, ring=any(s.ring_attention for s in stages),
                       sp=first.sp, cp=int(first.cp or 1), seq_len=first.max_seq_length, check=check_config,
                       half="fp16" if cfg.fp16 else "bf16" if model.bf16 else None)
    return model if choice == model.attn else dataclasses.replace(model, attn=choice)


def start_distributed(cfg: Config, model: Model) -> tuple[ParallelDims, list[Stage], Model]:
    """The process group (device first), every rank's log, every stage's layout, the attention kernel (auto: the
    fastest measured here), the shared-folder and start-up checks (one decision for all ranks), and the plan printed
    once. Returns the model too: its attention backend is settled here."""
    check_network()  # gloo can bind this host's interface (GLOO_SOCKET_IFNAME), before it tries
    dims = init_distributed(cfg.sequence_parallel_size, cfg.dist_timeout_s)
    set_main(dims.is_main)
    print0(hold(cfg.output_dir))  # one output folder, one live run (base/run_lock.py): before anything is written there
    open_rank_log(cfg.output_dir, dims.rank)
    check_same_snapshot(cfg.model_name_or_path)  # a hub id: every rank read the same commit from its cache
    line = job_node_line()  # the node size every rank agreed in init_distributed, before any layout below
    if line:
        print0(line if not cfg.gpus_per_node else
               f"node size: {cfg.gpus_per_node} (gpus_per_node of the recipe; the launchers': {line[len('node size: '):]})")
    stages = _stages(cfg, model, dims.world)
    model = settle_attention(cfg, model, stages)  # auto on a GPU: the kernel measured fastest here (one decision)
    check_shared_output(cfg.output_dir)  # every rank sees every other rank's files, or one line naming the hosts
    preflight(cfg, stages, dims, model.arch, model.bf16)  # build locks, host memory per node, DeepSpeed configs
    print0(check_cpu_placement(torch.cuda.is_available()))  # each node's ranks have cores (one verdict)
    if cfg.nodes and cfg.nodes * cfg.gpus_per_node != dims.world:
        print0(f"warning: the recipe is written for {cfg.nodes} x {cfg.gpus_per_node} ranks, launched with {dims.world}")
    print0(f"world={dims.world} model={cfg.model_name_or_path} attn={model.attn} precision={_precision(cfg, model)} "
           f"mb={cfg.per_device_train_batch_size} ga={cfg.gradient_accumulation_steps} deepspeed={cfg.deepspeed}")
    print0("\n".join(plan_lines(cfg, stages, dims.world, gpus_per_node(cfg) or dims.world, model.bf16)))
    return dims, stages, model


def stop_flag(cfg: Config, dims: ParallelDims, started: float) -> PreemptionFlag:
    """The preemption flag, installed: signals, OUTPUT_DIR/PREEMPT (rank 0 removes the one that stopped the
    previous job), the time limit counted from `started`, and saves every `save_interval_minutes`."""
    stop_file = os.path.join(cfg.output_dir, "PREEMPT")
    if dims.is_main:
        clear_honoured_stop(stop_file, started)
    comm.barrier()
    return PreemptionFlag(stop_file, Deadline(cfg.time_limit_s, now=started), save_every_s(cfg)).install()


def clear_honoured_stop(stop_file: str, started: float) -> bool:
    """Remove `stop_file` when it is the request that stopped the previous job (honoured: that job saved); one made
    since this process started (during the resume, a universal conversion: minutes) is this job's and stays for the
    flag (it was deleted unseen, and the job trained on to its time limit). Its age on the file server's clock
    against this process' time since start: two durations, no clock skew. Returns whether it was removed."""
    if not os.path.exists(stop_file):
        return False
    if os.environ.get("ULYSSES_STOP_CLEARED") == "1":  # slurm.sbatch removed the previous job's before its traps:
        print0(f"{stop_file}: asked during this job: it stops at its first step boundary")  # this one is this job's
        return False
    age = file_age(stop_file, os.path.dirname(stop_file))
    if age is not None and age <= time.time() - started + 1.0:
        print0(f"{stop_file}: asked while this job started: it stops at its first step boundary")
        return False
    os.remove(stop_file)
    return True


def save_every_s(cfg: Config) -> float | str:
    """`save_interval_minutes` in seconds for the flag (0: off), or `auto` (training/preemption.py)."""
    return cfg.save_interval_minutes if cfg.save_interval_minutes == "auto" else 60 * cfg.save_interval_minutes
