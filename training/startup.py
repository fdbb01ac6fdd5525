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
from model_utils.attention import resets_positions
from model_utils.build import TINY_PRESETS, is_tiny, load_hf_config, pick_attn_implementation, weights_source
from model_utils.families import check_config, check_tiled_mlp, drop_router_logits, router_note
from model_utils.hub import check_same_snapshot
from planner.presets import PRESETS
from training.config import Config, parse_config
from training.curriculum import Stage, check_stages, gpus_per_node, resolve_stages
from training.device_fit import check_device_fit, gpu_fit_budget
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
    if not cfg.dry_run:  # a read-only checkout (a container image): one line naming the variables, before any work
        from base.env import check_writable_defaults
        from data.store import is_prepared

        # the cache is written by rank 0 alone (launch.sh carries no ULYSSES_CACHE to other nodes' ranks)
        check_writable_defaults(need_cache=os.environ.get("RANK", "0") == "0" and not is_prepared(cfg.dataset_path))
    config = load_hf_config(cfg.model_name_or_path)
    if not cfg.dry_run:  # (the dry run says where weights and data come from instead: source_lines)
        check_sources(cfg, config)  # before any weight is read: random weights or the demo corpus only when meant
    attn = pick_attn_implementation(cfg.attn_implementation, planning=cfg.dry_run)
    note = router_note(config, drop_router_logits(config))  # every MoE start: no load-balancing loss is trained
    if note:
        print0(note)
    # the architecture has this attention, it can be document-masked, and in this many head chunks
    check_config(config, attn, cfg.attention_head_chunks)
    check_chat_data(cfg)  # an SFT stage on a prepared folder without chats (a run: on the demo corpus too)
    bf16 = (plans_gpu(cfg) and not cfg.fp16) if cfg.bf16 is None else cfg.bf16
    from data.corpus import CACHE
    from training import job

    job.USER_DIRS[:] = [cfg.output_dir, CACHE, os.environ.get("WANDB_DIR", "")]  # whose full disk is the user's
    return cfg, Model(config, attn, bf16)


def plans_gpu(cfg: Config) -> bool:
    """Whether the run trains on a GPU: this machine has one, or a dry run plans for one (--gpu_mem_gb, the budget
    training/curriculum.device_budget plans as "cuda"). Its precision defaults to bf16 then, as the GPU run's will: a
    dry run on a machine without a GPU planned fp32 (172.7 GiB per rank for Llama-3-8B at 128k, refused) beside the
    planner's bf16 choice, where the GPU run plans 98.1 GiB. --bf16 / --no-bf16 / --fp16 or the DeepSpeed JSON's
    explicit bf16 still decide (training/config.settle_from_file)."""
    return torch.cuda.is_available() or (cfg.dry_run and cfg.gpu_mem_gb > 0)


DEMO = "the built-in demo corpus (the Python standard library's sources, its 2000-token tokenizer)"
# An embedding this small was made for a small tokenizer like the demo's 2000 tokens (the benchmarks' random models
# of 200M parameters have 2048): the demo corpus trains it as meant. Released models have 32000 tokens and more.
SMALL_VOCAB = 4096


def check_sources(cfg: Config, config) -> None:
    """One line before the model loads where the run would train what no one asked for: a preset past the tiny ones
    (model_utils/build.py: its shape with random weights, never a released model's), or the demo corpus (dataset_path
    null: its tokenizer's ids are not a pretrained model's tokens) with a model past tiny (model_utils/build.is_tiny)
    and a vocabulary past SMALL_VOCAB. `from_scratch: true` says random weights are meant (the GPU benchmarks' saved
    random Llama-3-8B-shaped models train on the demo corpus). The recipes for 7-20B models name presets so that they
    plan anywhere: launched as shipped, one trained a random 8B on the demo corpus for hours, silently. The same
    inputs on every rank: every rank refuses alike."""
    if cfg.from_scratch:
        return
    name, wrong = cfg.model_name_or_path, []
    if name in PRESETS and name not in TINY_PRESETS:
        wrong.append(f"model_name_or_path {name} is a preset: its shape with random weights, not the trained model "
                     "(point model_name_or_path at its save_pretrained folder or hub id)")
    if cfg.dataset_path is None and not is_tiny(name, config) and config.get_text_config().vocab_size > SMALL_VOCAB:
        wrong.append(f"dataset_path null is {DEMO}, not data for {name} (set dataset_path to your JSONL or "
                     "prepared folder)")
    if wrong:
        raise ValueError("; ".join(wrong) + ": or set from_scratch: true (--from_scratch) to train random weights "
                         "on purpose")


def _sft_stages(cfg: Config) -> list[str]:
    return [st.name or f"stage{i}" for i, st in enumerate(cfg.stages) if (st.kind or cfg.data_kind) == "sft"] \
        if cfg.stages else (["main"] if cfg.data_kind == "sft" else [])


def check_chat_data(cfg: Config) -> None:
    """An SFT stage needs chat documents (a loss mask): the demo corpus has none, nor has a prepared folder whose
    manifest lists no mask. Refused at once (the run found it only at the stage's start, its engine built); a JSONL
    to prepare is known when the run prepares it (data/pipeline.py RunData.check_sft). A dry run of a recipe whose
    dataset_path is still null (a placeholder: the shipped SFT recipe plans anywhere) says so (source_lines)."""
    sft = _sft_stages(cfg)
    if not sft:
        return
    if cfg.dataset_path is None and not cfg.dry_run:
        raise ValueError(f"stage(s) {sft} kind sft train on chat documents, and dataset_path null is {DEMO}, which has "
                         "none: set dataset_path to chat rows (messages, conversations, prompt/completion) or a folder "
                         "scripts/prepare_data.py made from them")
    if _chat_folder(cfg.dataset_path) is False:
        raise ValueError(f"stage(s) {sft} kind sft: the dataset has no chat documents (no loss mask in "
                         f"{cfg.dataset_path}): prepare chat rows (messages, conversations, prompt/completion) with "
                         "scripts/prepare_data.py, or make it a text stage")


def _chat_folder(path: str) -> bool | None:
    """Whether a prepared folder holds chat documents (a chunk with a loss mask); None: not a prepared folder (the
    run prepares it) or a manifest that does not read (the run's own check says why)."""
    import json

    from data.store import MANIFEST, is_prepared

    if not is_prepared(path):
        return None
    try:
        with open(os.path.join(path, MANIFEST)) as fh:
            return any(c.get("mask") for c in json.load(fh).get("chunks", []))
    except (OSError, ValueError, AttributeError):
        return None


def source_lines(cfg: Config, masked: bool | None = None) -> list[str]:
    """The dry run's `weights:` and `data:` lines: where the run's starting weights and its documents come from, and
    whether documents are masked apart (`masked`: model_utils/attention.resets_positions; None: not said)."""
    sft = _sft_stages(cfg)
    if cfg.dataset_path is None:
        data = DEMO + (f": it has no chat documents for stage(s) {sft} kind sft, a run refuses it (set dataset_path)"
                       if sft else "")
    else:
        chat = _chat_folder(cfg.dataset_path)
        data = cfg.dataset_path + (
            " (a prepared folder: " + ("chat documents with a loss mask" if chat else "text only") + ")"
            if chat is not None else ", prepared when the run starts" + (
                " (whether it holds the chat documents kind sft needs is known then)" if sft else ""))
    if masked is not None:
        data += f"; document masking {'on' if masked else 'off'} (--reset_position_ids {cfg.reset_position_ids})"
    return [f"weights: {weights_source(cfg.model_name_or_path)}", f"data: {data}"]


def _precision(cfg: Config, model: Model) -> str:
    return "fp16" if cfg.fp16 else model.precision


def _stages(cfg: Config, model: Model, world: int) -> list[Stage]:
    stages = resolve_stages(cfg, dp_of_sp=lambda sp: max(1, world // sp))
    for s in stages:  # an MoE's expert blocks cannot be tiled: refused here, not at the stage's engine
        check_tiled_mlp(model.config, cfg.tiled_mlp if s.tiled_mlp is None else s.tiled_mlp, f"stage {s.index} ({s.name})")
    a = model.arch
    if linear_attention.is_hybrid(a):  # gated delta-net layers: `cp: auto` is pure Ulysses, an explicit cp > 1 refused
        stages = [dataclasses.replace(s, cp=1) if s.cp in ("auto", None) else s for s in stages]
        for s in stages:
            linear_attention.check_layout(a, s.sp, int(s.cp))
    return check_stages(stages, world, a.num_attention_heads, a.num_key_value_heads, a, gpus_per_node(cfg))


def dry_run(cfg: Config, model: Model) -> None:
    """Validate the whole recipe for the cluster it names (every stage's DeepSpeed config too) and print the plan, on
    rank 0 only (print0: under a launcher every rank ran it, and the plan came once per rank); every rank checks
    the same and refuses alike."""
    world = cfg.nodes * cfg.gpus_per_node or int(os.environ.get("WORLD_SIZE", "1"))
    stages = _stages(cfg, model, world)
    configs = check_stage_configs(cfg, stages, world, model.bf16, model.arch.hidden_size, planning=True)
    check_stage_data(stages)
    print0(f"dry run: world={world} ({cfg.nodes or 1} node(s)) model={cfg.model_name_or_path} attn={model.attn} "
           f"precision={_precision(cfg, model)} deepspeed={cfg.deepspeed}")
    print0("\n".join(source_lines(cfg, resets_positions(cfg.reset_position_ids, model.attn))))
    print0("\n".join(plan_lines(cfg, stages, world, cfg.gpus_per_node or world, model.bf16)))
    for line in data_lines(cfg, stages, world, resets_positions(cfg.reset_position_ids, model.attn)):
        print0(line)  # a prepared folder's: each stage's longer context, repeats, unread sources (data/coverage.py)
    # after the plan, so a refusal comes with it: what a launched run refuses (or warns of) before its model loads
    check_device_fit(cfg, stages, world, model.bf16, configs, model.arch, cfg.gpus_per_node or world, say=print0)
    manual = any(not s.memory_choice for s in stages)
    if manual and cfg.nodes and gpu_fit_budget(cfg) is None and not is_tiny(cfg.model_name_or_path, model.config):
        print0("note: the memory plan of the stages under memory_features manual is not checked against a GPU: give "
               "--gpu_mem_gb N (a launched run checks it against its GPUs)")
    if cfg.num_train_epochs is not None:  # counted from the data when a run opens it (training/hf_args.py)
        print0(f"steps: {cfg.num_train_epochs:g} epoch(s) of the data in each stage without its own max_steps or "
               "max_tokens (counted when the run opens its data; steps= above stands in until then)")


def data_lines(cfg: Config, stages: list[Stage], world: int, masked: bool) -> list[str]:
    """What a run's start says of each stage's data (data/coverage.py: the share of longer context than the stage
    before, repeats, unread sources, untrained tails), from a prepared folder's document lengths and sources: cheap
    (~20 bytes a document read, O(documents) passes; no token). [] for data the run prepares itself (a JSONL, the demo
    corpus: its lengths are known once tokenized)."""
    from data.coverage import length_lines, start_notes
    from data.pipeline import lengths_view
    from data.store import is_prepared

    if not is_prepared(cfg.dataset_path):
        return []
    try:
        data = lengths_view(cfg.dataset_path, stages, masked)
    except (OSError, ValueError) as e:  # a run refuses it at its start, in this line
        return [f"note: the stages' data notes need {cfg.dataset_path} readable: {e}"]
    mb, ga = cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps  # epochs: steps known at the run's start
    return length_lines(data, stages, header=False) + (
        start_notes(data, stages, world, mb, ga) if cfg.num_train_epochs is None else [])


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
    if cfg.export_hf:  # the final export's folder: a link to another folder's work is refused now, not after training
        from model_utils.export_target import check_out

        comm.run_on_main(lambda: check_out(os.path.join(cfg.output_dir, "hf_model"), None, owned=True))
    preflight(cfg, stages, dims, model.arch, model.bf16)  # build locks, host memory per node, DeepSpeed configs
    print0(check_cpu_placement(torch.cuda.is_available()))  # each node's ranks have cores (one verdict)
    if cfg.nodes and cfg.nodes * cfg.gpus_per_node != dims.world:
        print0(f"warning: the recipe is written for {cfg.nodes} x {cfg.gpus_per_node} ranks, launched with {dims.world}")
    print0(f"world={dims.world} model={cfg.model_name_or_path} attn={model.attn} precision={_precision(cfg, model)} "
           f"mb={cfg.per_device_train_batch_size} ga={cfg.gradient_accumulation_steps} deepspeed={cfg.deepspeed}")
    print0("\n".join(plan_lines(cfg, stages, dims.world, gpus_per_node(cfg) or dims.world, model.bf16)))
    return dims, stages, model


def check_base_weights(cfg: Config, state) -> None:
    """A fresh start (no checkpoint to load) reads the base folder's weights at its first stage's build: a missing
    shard or weight file is one line here, before the data is prepared (model_utils/hub.py; a resume reads none, so
    a base folder whose weights were deleted since resumes). Rank 0 looks (a node's cached view must not decide
    alone); every rank raises its line. Collective."""
    from model_utils.build import resolve_model

    if state.checkpoint is None and not cfg.from_scratch and os.path.isdir(cfg.model_name_or_path or ""):
        comm.run_on_main(lambda: resolve_model(cfg.model_name_or_path, weights=True))


def check_room(ckpt, state, stages: list[Stage], model: Model, cfg: Config | None = None) -> None:
    """After the resume decision, before any engine: a fresh start's base weights (check_base_weights), the first
    save's room on the output folder's file system, and what the curriculum will hold
    (training/checkpoint_room.CheckpointRoom.check_room). Before this the first check came at the first save, after a whole
    save interval of training. Collective."""
    if cfg is not None:
        check_base_weights(cfg, state)
    from planner.shapes import ModelShape

    arch = model.arch
    try:
        n = ModelShape.from_config(arch.to_dict()).num_params()
    except (ValueError, KeyError, TypeError):  # a shape the planner cannot read: its embeddings and 12 h^2 per layer
        n = arch.vocab_size * arch.hidden_size + 12 * arch.hidden_size ** 2 * arch.num_hidden_layers
    ckpt.check_room(state.checkpoint, n, len(stages))


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
