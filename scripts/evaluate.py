"""Evaluate a model at long lengths outside a training run, optionally side by side with a second one.

The same tasks, depths, seeds and scoring as the evaluation at a stage's end (training/evaluation.py
`evaluate_tasks`: each trial is seeded by its task, length, depth and index (since 2026-11-30: a record from before
asked other questions), so a model scores here what the run scored), through the training path: the model under ZeRO-3, each sample sharded over a Ulysses
sequence-parallel group, the tiled loss (one logits tile at a time), so a 128k-1M evaluation needs what a
training step of that length needs. Launch it like train.py:

    DS_ACCELERATOR=cpu .venv/bin/deepspeed --num_gpus 2 scripts/evaluate.py checkpoints/tiny_cpu_extend/hf_model \
        --compare recipes/base/tiny_passkey256 --lengths 256,512,1k,2k --tasks passkey:10 \
        --depths 0.1,0.3,0.5,0.7,0.9 --sequence_parallel_size 2 --output_dir checkpoints/eval_extend
    deepspeed --num_gpus 8 scripts/evaluate.py checkpoints/RUN/checkpoints/step_004000 --lengths 128k,256k \
        --tasks passkey:4,niah_multivalue:2,common_words:2 --sequence_parallel_size 8 --output_dir eval_run

MODEL (and --compare) is one of
- a Hugging Face folder (config.json + weights; scripts/export_hf.py writes one), its tokenizer next to it
  (tokenizer.model or a tokenizer folder's files) or --tokenizer;
- a checkpoint, OUTPUT_DIR/checkpoints/step_NNNNNN (training/checkpoint.py): its weights, its stage's RoPE
  (hf_config.json) and the run's tokenizer (trainer.json);
- a run folder, OUTPUT_DIR: its newest complete checkpoint (what `--resume auto` resumes, not LATEST as written).
A chat model is asked through its template with `--chat` (auto | on | chatml | off): each trial is one user turn
(the haystack and the question) rendered by the tokenizer's chat template with its generation prompt, and it counts
when the assistant's reply, the answer and its end-of-turn token, is the model's argmax token by token (the
rendering an SFT stage trains with `tasks: {..., chat: true}`, data/tasks.py `chat_sample`). `on`: the tokenizer's
own template (a tokenizer without one is refused); `chatml`: data/chat.py's documented ChatML default (what a
template-less tokenizer, such as the demo's, is fine-tuned with); `auto` (default): through the template the run
fine-tuned with when MODEL is a checkpoint or run folder whose run had an SFT stage (trainer.json's
`trained_template`, as its export carries it and its in-run evaluation asked: `--chat_template chatml` or a named
`tool_use` over the tokenizer's own included; a checkpoint from before it was recorded: the tokenizer's own, else the
ChatML default), plain text otherwise (an HF folder is asked in plain text: pass `--chat on` for an Instruct model).
Rank 0 decides, every rank gets its answer.
`--heldout CHATS` adds the held-out conversation loss: the mean cross-entropy over the assistant's tokens only,
over every supervised token of CHATS (chat rows in data/chat.py's formats, rendered with the template a checkpoint's
run trained with unless --chat on / chatml says, an HF folder's own, or a folder scripts/prepare_data.py wrote with
the model's tokenizer), the conversations packed whole at the longest of
--lengths; `--heldout_conversations N` takes the first N. Reported as `heldout_chat_loss` (+ `_tokens`,
`_conversations`); a set with no supervised token has none, never 0.0 (training/heldout_chat.py, docs/evaluation.md).
`--rope '{rope_type: yarn, factor: 8.0, original_max_position_embeddings: 256}'` replaces MODEL's RoPE (e.g. a short
base model tried with the scaling its extension uses), `--compare_rope` the other's.

Writes OUTPUT_DIR/eval.json (each model's result in the in-run JSON's shape, `tasks`: {task: {length: {depth:
accuracy}}} and `task_mean`, then `difference` = compare - model; strict JSON: null, never NaN), OUTPUT_DIR/summary.md
(tables) and OUTPUT_DIR/heatmaps.png (per task: each model's depth x length heat map, and their difference), through
training/eval_report.py. User errors (a missing path, a bad length, an SP degree that does not divide the heads, a task
that does not fit a length, a file as --output_dir) are refused in one line before any model is built (exit code 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import sys
import time

from data.chat_template import literal
from training.eval_report import asked, difference, heatmaps, said, write_results
from training.heldout_chat import heldout_loss, heldout_set  # noqa: F401  (the --heldout concern; tests import them here)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line through run_job's input-error path, not argparse's usage block
        raise ValueError(f"{message} (python scripts/evaluate.py --help)")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = _Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("model", help="HF folder, checkpoint (.../checkpoints/step_N) or run folder")
    p.add_argument("--compare", default=None, help="a second model, evaluated the same way (side by side)")
    p.add_argument("--lengths", required=True, help="sample lengths, e.g. 256,512,2k or 128k,256k")
    p.add_argument("--tasks", default="passkey", help="tasks, e.g. passkey,common_words or passkey:10,niah_multivalue:4")
    p.add_argument("--trials", type=int, default=2, help="trials per depth of a task given without its count")
    p.add_argument("--depths", default="0.1,0.5,0.9", help="needle depths (0: start, 1: end)")
    p.add_argument("--sequence_parallel_size", type=int, default=1)
    p.add_argument("--context_parallel_size", default="auto",
                   help="cp factor of SP (ulysses = sp / cp): auto (Ulysses as large as the heads allow) or N")
    p.add_argument("--micro_batch", type=int, default=1, help="samples per SP group per forward")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--rope", default=None, help="MODEL's RoPE instead of its own (YAML/JSON: rope_parameters)")
    p.add_argument("--compare_rope", default=None, help="the --compare model's RoPE instead of its own")
    p.add_argument("--chat", default="auto", choices=["auto", "on", "chatml", "off"],
                   help="ask the tasks through a chat template: auto (a fine-tuned run's checkpoint), on (the tokenizer's "
                        "own), chatml (the ChatML default), off (plain text)")
    p.add_argument("--heldout", default=None, help="held-out chat rows (JSONL/Parquet file or folder, datasets folder) "
                   "or a prepared folder: the loss on the assistant's tokens (heldout_chat_loss)")
    p.add_argument("--heldout_conversations", type=int, default=0, help="the first N conversations of --heldout (0: all)")
    p.add_argument("--tokenizer", default=None, help="tokenizer (.model file or folder) when the model has none")
    p.add_argument("--attn_implementation", default="auto")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None, help="default: on GPU")
    p.add_argument("--tiled_mlp", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--dist_timeout_s", type=float, default=1800.0)
    # set by the deepspeed launcher (--local_rank=N) and torch.distributed.launch (--local-rank=N, torch >= 2.0)
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def check_output_dir(path: str) -> None:
    """--output_dir must be a folder or become one: a file there (or above it) is refused in one line before any
    work, as train.py's run lock does (base/run_lock.acquire), not NotADirectoryError from the rank logs."""
    if not path.strip():  # '' wrote eval.json, summary.md and heatmaps.png into the current folder
        raise ValueError("--output_dir '': name a folder (new or existing), e.g. --output_dir eval_run")
    here = os.path.abspath(path)
    while not os.path.exists(here):  # the nearest part that exists: the folder itself or the one it goes under
        here = os.path.dirname(here)
    if not os.path.isdir(here):
        where = "" if here == os.path.abspath(path) else f" ({here} is)"
        raise ValueError(f"--output_dir {path}: a file, not a folder{where}: name a folder (new or existing)")


def settings(a: argparse.Namespace) -> dict:
    """The flags checked and parsed (lengths, tasks, depths, RoPE); one-line ValueError."""

    from model_utils.rope import check_rope, nested
    from training.config import MAX_TIMEOUT_S, cp_setting
    from training.config_types import yaml_text
    from training.eval_settings import eval_value

    lengths = eval_value("lengths", a.lengths, "--lengths")
    if not isinstance(lengths, list):
        raise ValueError(f"--lengths {a.lengths}: give the lengths, e.g. 256,512,2k (earlier/all mean a run's stages)")
    ropes = []
    for flag, text in (("--rope", a.rope), ("--compare_rope", a.compare_rope)):
        rope = yaml_text(text, f"{flag} {text!r}") if text else None
        if text and not isinstance(rope, dict):
            raise ValueError(f"{flag} {text!r}: use a mapping such as '{{rope_type: yarn, factor: 4.0}}'")
        if rope and not nested(rope):  # per layer type: checked against the model (stage_rope)
            check_rope(rope, flag, a.sequence_parallel_size)
        ropes.append(rope)
    if a.compare_rope and not a.compare:
        raise ValueError("--compare_rope without --compare: name the second model")
    if a.trials < 1 or a.micro_batch < 1 or a.sequence_parallel_size < 1:
        raise ValueError("--trials, --micro_batch and --sequence_parallel_size must be >= 1")
    if not 0 < a.dist_timeout_s <= MAX_TIMEOUT_S:  # 0 or less: the first collective times out; nan, inf: a traceback
        raise ValueError(f"--dist_timeout_s {a.dist_timeout_s}: use seconds > 0, at most {MAX_TIMEOUT_S:.0e} (default 1800)")
    if a.heldout_conversations < 0:
        raise ValueError(f"--heldout_conversations {a.heldout_conversations}: use N >= 1 (the first N), or 0 for all")
    check_output_dir(a.output_dir)
    a.context_parallel_size = cp_setting(a.context_parallel_size, "--context_parallel_size")
    from model_utils.hub import resolve

    # a hub id (org/name) as train.py takes it: its snapshot in the local cache (one line naming the download if not)
    a.model = resolve(a.model, flag="MODEL")
    a.compare = a.compare and resolve(a.compare, flag="--compare")
    for path in (a.model, a.compare, a.tokenizer, a.heldout):
        if path is not None and not os.path.exists(path):
            raise ValueError(f"{path}: no such file or folder")
    tasks = eval_value("tasks", a.tasks, "--tasks")
    if isinstance(tasks, dict) and tasks and not any(int(v) > 0 for v in tasks.values()) and not a.heldout:
        raise ValueError(f"--tasks {a.tasks}: no task has a trial (it evaluated nothing and exited 0): give a count "
                         "of at least 1, e.g. passkey:4, or --heldout")
    return {"lengths": sorted(set(lengths)), "depths": eval_value("depths", a.depths, "--depths"), "ropes": ropes,
            "eval": {"tasks": tasks, "passkey_trials": a.trials}}


def describe(path: str, tokenizer: str | None) -> dict:
    """What `path` is (rank 0 reads it): kind, the checkpoint to load, the HF config (dict) and the tokenizer."""
    from training.checkpoint import MANIFEST

    if os.path.isfile(os.path.join(path, MANIFEST)) and os.path.isfile(os.path.join(path, "hf_config.json")):
        with open(os.path.join(path, "hf_config.json")) as fh:
            config = json.load(fh)
        with open(os.path.join(path, "trainer.json")) as fh:
            trainer = json.load(fh)
        tok = tokenizer or trainer.get("tokenizer")
        from data.run_tokenizer import check_trained_vocab

        try:  # the vocabulary it trained on (another revision at the recorded path scored it through other tokens)
            check_trained_vocab(tok, trainer, path, tokenizer is not None)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
        return {"kind": "checkpoint", "path": path, "step": trainer.get("step"), "stage": trainer.get("stage_name"),
                "config": config, "tokenizer": tok, "sft_run": sft_run(trainer.get("config") or {}),
                "run_config": trainer.get("config") or {},  # its forward's settings (lean_rmsnorm, lean_mlp)
                # the chat template its conversations were rendered with (absent: a checkpoint from before 2026-11-30)
                **{k: trainer[k] for k in ("trained_template",) if k in trainer},
                "optimizer_groups": trainer.get("optimizer_groups")}  # its optimizer's shape: the state loads so
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"{path}: not a Hugging Face folder (no config.json), a checkpoint (no {MANIFEST}) nor a run "
                         "folder (no checkpoints/ holding one)")
    config = _json(os.path.join(path, "config.json"))
    # the folder's Hugging Face tokenizer (its added tokens, its chat template) before a sentencepiece file beside it
    # (Mistral, Llama 2 and Gemma snapshots ship both: the .model alone refused --chat on, tokenized without the
    # control tokens); a .model alone (the demo's export) as it is
    own = [path] * any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")) + [
        os.path.join(path, "tokenizer.model")]
    tok = tokenizer or next((t for t in own if os.path.exists(t)), None)
    return {"kind": "hf", "path": path, "config": config, "tokenizer": tok}


def _json(path: str):
    """A model folder's config.json; one line where it is not UTF-8 text (an editor's UTF-16) or not JSON."""
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        why = "not UTF-8 text: save it as UTF-8" if isinstance(e, UnicodeDecodeError) else f"not valid JSON ({e})"
        raise ValueError(f"{path}: {why}") from None


def sft_run(run_config: dict) -> bool:
    """Whether a run (its trainer.json config) fine-tuned on chat data: --data_kind sft or a stage of kind sft."""
    return run_config.get("data_kind") == "sft" or any(
        isinstance(st, dict) and st.get("kind") == "sft" for st in run_config.get("stages") or [])


def trained_as(tok, text: str | None) -> str:
    """The --chat_template a checkpoint's conversations were rendered with, as data/chat.py's ChatEncoder names it,
    from its trainer.json `trained_template` (`text`: data/chat_stops.trained_template, the template where the
    tokenizer's own default is another, None where it is that one): `auto` (its own), `chatml` (the ChatML default),
    the name of one of its named templates (`tool_use`), else the text itself (a run prepared with `--chat_template
    FILE`, or another revision of the tokenizer at the recorded path whose template is not the one trained: the model
    is asked in what it trained on either way; its ids are checked apart: data/run_tokenizer.check_trained_vocab)."""
    from data.chat_template import chatml_template, served_template

    hf = getattr(tok, "hf", None)
    own = getattr(hf, "chat_template", None)
    if text is None:
        return "auto"
    if hf is not None and text == served_template(own, "chatml", chatml_template(hf), True):
        return "chatml"
    return next((n for n, t in (own if isinstance(own, dict) else {"auto": own}).items() if t == text), text)


def chat_mode(flag: str, tok, sft: bool, where: str, trained: str | None = None) -> str:
    """How the tasks are asked (rank 0 decides: main broadcasts it): `template` (the tokenizer's own chat template),
    `chatml` (data/chat.py's default), a named template's name or `plain`. `flag` is --chat; `sft`: the model's run
    fine-tuned on chat data; `trained`: trained_as's answer for a checkpoint (None: an HF folder, or a checkpoint from
    before it was recorded). One-line ValueError for --chat on with a tokenizer that has no template."""
    own = bool(getattr(getattr(tok, "hf", None), "chat_template", None))
    if flag == "off" or (flag == "auto" and not sft):
        return "plain"
    if flag == "chatml":
        return "chatml"
    if flag == "on" and not own:
        raise ValueError(f"{where}: --chat on: tokenizer {tok.path} has no chat template: pass --chat chatml (the ChatML "
                         "default data/chat.py fine-tunes a template-less tokenizer with) or --chat off")
    if flag == "auto" and trained not in (None, "auto"):  # the ChatML default or a named one over the tokenizer's own
        return trained
    return "template" if own else "chatml"  # auto on a fine-tuned run: the template its conversations were rendered in


def chat_encoder(tok, mode: str, now: str | None = None):
    """The ChatEncoder that renders the trials for `mode` (chat_mode's answer), None for plain text; `now`: the instant
    a template writing today's date renders (rank 0's: each rank's own clock rendered other trials across a midnight)."""
    from data.chat import ChatEncoder

    return None if mode == "plain" else ChatEncoder(tok, "assistant", "none" if mode == "template" else mode, now)


def chat_modes(a: argparse.Namespace, tok, src: dict, where: str) -> tuple[str, str]:
    """(how the trials are asked: chat_mode's answer, the --chat_template --heldout's chat rows are rendered with) for
    one model (rank 0). A checkpoint's trained template (trained_as) where --chat is auto or off and it is used: the
    in-run evaluation and the export render with it (data/pipeline.py, scripts/export_hf.py); the tokenizer's own
    asked a run prepared with `--chat_template chatml` on a Llama 3 tokenizer in Llama 3's headers, which it never
    trained on. --chat chatml: the ChatML default for both; on: the tokenizer's own."""
    sft = bool(src.get("sft_run"))
    used = a.chat in ("auto", "off") and (a.heldout or a.chat == "auto" and sft)
    trained = trained_as(tok, src["trained_template"]) if used and "trained_template" in src else None
    mode = chat_mode(a.chat, tok, sft, where, trained)
    return mode, "chatml" if mode == "chatml" else trained or "auto"


def check_source(src: dict, a: argparse.Namespace, s: dict, world: int, rope: dict | None) -> None:
    """Everything about one model that can be refused before it is built (one-line ValueError)."""
    from base import comm
    from base.host import job_ranks_per_node
    from base.parallel import check_layout, split_sp
    from data.tokenizer import Tokenizer
    from model_utils.families import check_config
    from model_utils.rope import stage_rope
    from training.evaluation import check_trials_fit, task_trials

    where = f"{src['path']}"
    if src["tokenizer"] is None:
        raise ValueError(f"{where}: no tokenizer found next to the model: pass --tokenizer (a .model file or folder)")
    if not os.path.exists(src["tokenizer"]):  # a checkpoint names its run's tokenizer: moved since?
        raise ValueError(f"{where}: its tokenizer {src['tokenizer']} is not there: pass --tokenizer")
    tok, config, arch = Tokenizer(src["tokenizer"]), src["hf_config"], src["hf_config"].get_text_config()
    try:
        node = job_ranks_per_node() or None  # the node size every rank agreed in init_distributed
        src["cp"] = split_sp(a.sequence_parallel_size, arch.num_attention_heads, arch.num_key_value_heads, node,
                             a.context_parallel_size)[1]
        check_layout(world, a.sequence_parallel_size, arch.num_attention_heads, arch.num_key_value_heads,
                     min(s["lengths"]), src["cp"], node)
        check_config(config, src["attn"])
        stage_rope(arch, rope or None, "--rope" if rope else "rope", a.sequence_parallel_size)  # as it will run
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    if tok.vocab_size > arch.vocab_size:
        raise ValueError(f"{where}: tokenizer {src['tokenizer']} has {tok.vocab_size} tokens, the model {arch.vocab_size}: "
                         "pass the model's own --tokenizer")
    src["tok"], src["trials"] = tok, task_trials(s["eval"], tok)
    src["chat"], template = comm.run_on_main(lambda: chat_modes(a, tok, src, where))  # rank 0's
    src["chat_enc"] = chat_encoder(tok, src["chat"], comm.run_on_main(lambda: datetime.datetime.now().isoformat()))
    if a.heldout:  # rendered as the model's conversations were (chat_modes)
        src["heldout"] = comm.run_on_main(lambda: heldout_set(a.heldout, tok, template, a.heldout_conversations))
    for task in src["trials"]:  # every trial evaluate_tasks asks (its seeds), ~1 ms each: its need, not the trial
        for n in s["lengths"]:
            try:
                check_trials_fit({task: src["trials"][task]}, s["depths"], [n], tok, src["chat_enc"])
            except ValueError as e:
                raise ValueError(f"--lengths {n}: {e}: drop the length or the task") from None


def evaluate_model(src: dict, a: argparse.Namespace, s: dict, dims) -> dict:
    """One model's result ({tasks, task_mean} as in a stage's eval JSON, plus what was evaluated): the model
    built under ZeRO-3 with Ulysses SP (training/engine.py), a checkpoint's weights loaded, evaluate_tasks."""
    from base.log import print0
    from training.checkpoint import Checkpointer
    from training.config import config_from_dict
    from training.engine import build_engine, release_engine, return_cached_memory
    from training.evaluation import evaluate_tasks

    t0 = time.perf_counter()
    dims = dataclasses.replace(dims, cp=src["cp"])  # this model's (ulysses, cp) split of the SP degree
    run = src.get("run_config") or {}
    cfg = config_from_dict({"model_name_or_path": src["path"], "max_seq_length": max(s["lengths"]),
                            "sequence_parallel_size": a.sequence_parallel_size,
                            "per_device_train_batch_size": a.micro_batch, "tiled_mlp": a.tiled_mlp,
                            "deepspeed": os.path.join(ROOT, "ds_configs", "zero3_offload.json"),
                            "attn_implementation": src["attn"], "bf16": src["bf16"], "report_to": "none",
                            "output_dir": a.output_dir,
                            **{k: run[k] for k in ("lean_rmsnorm", "lean_mlp") if k in run}})  # the run's forward
    engine = build_engine(cfg, dims, src["hf_config"], src["attn"], src["bf16"], seed=0,
                          pretrained=src["kind"] == "hf", split_decay=src.get("optimizer_groups") == 2)
    if src["kind"] == "checkpoint":
        # this evaluation's own folder: a conversion at another world size goes under --output_dir/universal/, never
        # into the run that wrote the checkpoint (another team's, or read-only: training/universal.py)
        Checkpointer(a.output_dir, keep=2).load(engine, src["path"], load_scheduler=False)
    engine.eval()
    out = evaluate_tasks(engine, dims, a.micro_batch, src["tok"].pad_id, src["tok"], src["trials"], s["depths"],
                         s["lengths"], src["chat_enc"])
    if src.get("heldout") is not None:
        out.update(heldout_loss(engine, dims, a.micro_batch, src["tok"].pad_id, src["heldout"], max(s["lengths"])))
    # released as a stage's engine is (training/stage.py): destroy() alone left the model on DeepSpeed's module stack
    # and in its coordinator's class-level cache, so --compare built the second model next to the first one's
    # partitions, CPU Adam state and offload buffers: +0.9 GB RSS at 56M parameters (~16 bytes each), ~125 GB at 8B
    release_engine(engine)
    del engine
    gc.collect()  # the engine, its model and optimizer reference each other: the cycle is freed now
    return_cached_memory()
    rope = src["hf_config"].rope_parameters
    chat = "trained" if literal(src["chat"]) else src["chat"]  # a --chat_template FILE's text: named, not quoted
    print0(f"evaluated {src['path']} in {time.perf_counter() - t0:.1f}s: {said(out)} (asked as {asked(chat)})")
    return {"model": src["path"], "kind": src["kind"], **{k: src[k] for k in ("step", "stage") if src.get(k) is not None},
            "rope": rope, "tokenizer": src["tokenizer"], "chat": chat, "lengths": s["lengths"], "depths": s["depths"],
            "trials": src["trials"], "sp": dims.sp, "cp": dims.cp, "world": dims.world, "time_s": round(time.perf_counter() - t0, 1),
            **out}


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)  # the same argv on every rank: a refusal here is every rank's

    from base import comm

    comm.open_channel()  # before the checks a node may fail alone (a path it lacks): base/comm.py
    s = settings(a)  # the flags: refused in one line before the model or the process group

    import torch

    from base.env import configure
    from base.log import open_rank_log, print0, set_main
    from base.parallel import init_distributed
    from model_utils.build import load_hf_config, pick_attn_implementation
    from model_utils.families import drop_router_logits
    from model_utils.rope import apply_rope
    from training.checkpoint import Checkpointer
    from training.preflight import check_network

    configure()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    attn = pick_attn_implementation(a.attn_implementation)
    bf16 = torch.cuda.is_available() if a.bf16 is None else a.bf16
    check_network()  # gloo can bind this host's interface (GLOO_SOCKET_IFNAME): one line, not gloo's enforce
    dims = init_distributed(a.sequence_parallel_size, a.dist_timeout_s)
    set_main(dims.is_main)
    open_rank_log(a.output_dir, dims.rank)
    settle = a.attn_implementation == "auto" and torch.cuda.is_available()  # the kernel measured fastest here
    sources = []
    for path, rope in zip(filter(None, (a.model, a.compare)), s["ropes"]):
        # a run folder: the checkpoint its resume takes, verified (a checkpoint: verified); never LATEST as written
        path = Checkpointer(path, keep=2).evaluated()
        src = comm.run_on_main(lambda p=path: describe(p, a.tokenizer))  # rank 0 reads; every rank the same answer
        if src["kind"] == "checkpoint":
            from transformers import AutoConfig

            fields = dict(src["config"])
            config = AutoConfig.for_model(fields.pop("model_type"), **fields)  # the stage's RoPE included
            src["run_config"] = Checkpointer.read_trainer(src["path"]).get("config")
        else:
            config = load_hf_config(src["path"])
        drop_router_logits(config)  # the load-balancing loss is training's; router logits only cost memory here
        apply_rope(config, rope, max(s["lengths"]))  # and the position table holds the longest length
        if settle:  # once, at the first model's call (train.py's start-up does the same: model_utils/attention_pick)
            from model_utils import attention_pick
            from model_utils.families import check_config

            attn = attention_pick.settle(attn, config, chunks=1, ring=False, sp=dims.sp, cp=1, seq_len=max(s["lengths"]),
                                         half="bf16" if bf16 else None, check=check_config)
            settle = False
        src.update(hf_config=config, attn=attn, bf16=bf16)
        check_source(src, a, s, world, rope)
        sources.append(src)
    print0(f"evaluating {len(sources)} model(s) at lengths {s['lengths']}, depths {s['depths']}, world={dims.world} "
           f"sp={dims.sp} attn={attn}")
    results = [evaluate_model(src, a, s, dims) for src in sources]
    comm.barrier()
    if dims.is_main:
        diff = difference(*results) if len(results) == 2 else None
        write_results(a.output_dir, results, diff)
        if any(r["tasks"] for r in results):  # --tasks none with --heldout: no heat map to draw
            heatmaps(results, diff, os.path.join(a.output_dir, "heatmaps.png"))
        print0(f"wrote {a.output_dir}/eval.json, summary.md" + ", heatmaps.png" * any(r["tasks"] for r in results))
    comm.shutdown()
    return 0


if __name__ == "__main__":
    from base import versions
    from training.job import run_job

    versions.check()  # torch, deepspeed, transformers in the ranges the code needs, or one line and exit 2
    sys.exit(run_job(main, saves=False))  # nothing to save: a USR1/USR2 ends it (was recorded, never taken)
