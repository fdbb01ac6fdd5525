"""Evaluation at the end of a stage, at the stage's length, through the same sharded engine and the same tiled
loss as training (model_utils/tiled_loss.py): never the whole `[seq, vocab]` logits.

- held-out loss: token-weighted loss over the run's held-out documents (data/pipeline.py: the same documents
  at every stage, never trained on), packed to the stage's length;
- passkey retrieval (needs a text tokenizer): a 5-digit key hidden at several depths of filler text,
  answered after "What is the pass key? The pass key is"; a trial counts when every answer token is the
  model's argmax given the prompt and the previous answer tokens (teacher-forced greedy decoding).

Samples are split across DP groups (group g takes samples g*mb .. g*mb+mb-1 of each round of dp*mb); every
rank runs the same number of forwards (ZeRO-3 gathers weights with collectives), a group short of samples
runs unlabelled fillers. Cost: one forward per round without autograd plus one 1 GiB logits tile.
Results go to metrics.jsonl, W&B and OUTPUT_DIR/eval/stage{N}.json.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from data.sharding import collate, shard
from model_utils.tiled_loss import eval_stats
from training import comm

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def sample_stats(engine, samples: list[dict], dims, micro_batch: int, pad_id: int) -> torch.Tensor:
    """[len(samples), 3] on every rank: per sample [sum CE, labelled tokens, wrong argmax] over the whole
    sequence, each sample evaluated by one DP group (its SP ranks each take their shard)."""
    out = torch.zeros(len(samples), 3, dtype=torch.float64)
    if not samples:
        return out
    per_round = dims.dp * micro_batch
    filler = {**samples[0], "shift_labels": np.full_like(samples[0]["shift_labels"], -100)}
    for lo in range(0, len(samples), per_round):
        mine = list(range(lo + dims.dp_rank * micro_batch, lo + (dims.dp_rank + 1) * micro_batch))
        batch = [samples[i] if i < len(samples) else filler for i in mine]
        mb = {k: v.to(engine.device) for k, v in shard(collate(batch, dims.sp, pad_id), dims.sp, dims.sp_rank).items()}
        stats = eval_stats(engine, mb).cpu()
        for row, i in zip(stats, mine):
            if i < len(samples):
                out[i] += row
    return comm.all_reduce(out)  # SP ranks hold disjoint shards, DP groups disjoint samples: the sum is each once


def passkey_trials(eval_cfg: dict, tokenizer) -> int:
    """Passkey trials per depth a stage runs: its eval.passkey_trials, default 2 with a text tokenizer."""
    return int(eval_cfg.get("passkey_trials", 2 if tokenizer else 0)) if tokenizer is not None else 0


def check_passkey_fits(stages, tokenizer) -> None:
    """Before any training: every stage that runs passkey trials is long enough to hold one (one-line error)."""
    for stage in stages:
        if passkey_trials(stage.eval, tokenizer):
            try:
                passkey_sample(tokenizer, stage.max_seq_length, 0.5, random.Random(0))
            except ValueError as err:
                raise ValueError(f"stage {stage.name!r}: {err}: raise max_seq_length or set eval.passkey_trials: 0 "
                                 "for this stage") from None


def passkey_sample(tokenizer, seq_len: int, depth: float, rng: random.Random) -> dict[str, np.ndarray]:
    key = str(rng.randint(10000, 99999))
    needle = tokenizer.encode(f" The pass key is {key}. Remember it. {key} is the pass key. ")
    question = tokenizer.encode(" What is the pass key? The pass key is")
    answer = tokenizer.encode(f" {key}")
    filler = tokenizer.encode(FILLER)
    n_fill = seq_len - len(needle) - len(question) - len(answer)
    if n_fill < len(filler):
        need = len(needle) + len(question) + len(answer) + len(filler)
        raise ValueError(f"max_seq_length={seq_len} is too short for a passkey trial (needs {need} tokens)")
    body = (filler * (n_fill // len(filler) + 1))[:n_fill]
    at = int(depth * n_fill)
    ids = np.asarray(body[:at] + needle + body[at:] + question + answer, dtype=np.int64)
    labels = np.full_like(ids, -100)
    first = len(ids) - len(answer)
    labels[first - 1: len(ids) - 1] = ids[first:]  # predict each answer token from the position before it
    return {"input_ids": ids, "shift_labels": labels, "position_ids": np.arange(len(ids))}


def evaluate_stage(engine, stage, dims, heldout: list[dict], tokenizer, metrics, step: int, micro_batch: int,
                   pad_id: int) -> dict:
    """Run the stage's evaluation on every rank; rank 0 records it. Returns the result."""
    cfg = stage.eval
    engine.eval()
    result = {"stage": stage.index, "stage_name": stage.name, "step": step, "seq_len": stage.max_seq_length}
    if heldout:
        stats = sample_stats(engine, heldout, dims, micro_batch, pad_id).sum(0)
        result["heldout_loss"] = (stats[0] / stats[1].clamp_min(1)).item()
        result["heldout_tokens"] = int(stats[1].item())
    trials = passkey_trials(cfg, tokenizer)
    if trials:
        rng = random.Random(1234 + stage.index)
        depths = cfg.get("depths", [0.1, 0.5, 0.9])
        samples = [passkey_sample(tokenizer, stage.max_seq_length, d, rng) for d in depths for _ in range(trials)]
        wrong = sample_stats(engine, samples, dims, micro_batch, pad_id)[:, 2].reshape(len(depths), trials)
        per_depth = {f"{d:g}": float((w == 0).double().mean()) for d, w in zip(depths, wrong)}
        result["passkey_accuracy"] = per_depth
        result["passkey_mean"] = sum(per_depth.values()) / len(per_depth)
    engine.train()
    metrics.log_eval(stage.index, result)
    metrics.log_table(f"eval/stage{stage.index}", ["depth", "accuracy"],
                      [[d, a] for d, a in result.get("passkey_accuracy", {}).items()])
    return result
