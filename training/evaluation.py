"""Evaluation at the end of a stage, at the stage's length, through the same sharded engine.

- held-out loss: token-weighted loss over the last `heldout_samples` packed samples (never trained on);
- passkey retrieval (needs a text tokenizer): a 5-digit key hidden at several depths of filler text,
  answered after "What is the pass key? The pass key is"; a trial counts when every answer token is the
  model's argmax given the prompt and the previous answer tokens (teacher-forced greedy decoding).
Results go to metrics.jsonl, W&B and OUTPUT_DIR/eval/stage{N}.json.
"""

from __future__ import annotations

import random

import numpy as np
import torch
import torch.distributed as dist

from data.sharding import collate, shard

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def heldout_count(eval_cfg: dict, num_samples: int) -> int:
    return min(int(eval_cfg.get("heldout_samples", 2)), max(0, num_samples - 1))


@torch.no_grad()
def _sharded_logits_check(engine, sample: dict, sp: int, sp_rank: int, pad_id: int, batch: int):
    """(sum CE, n tokens, wrong argmax count) over this rank's shard of one sample.

    Ulysses attention is registered for a fixed micro-batch size, so the batch is filled with unlabelled
    copies of the sample."""
    filler = {**sample, "shift_labels": np.full_like(sample["shift_labels"], -100)}
    mb = {k: v.to(engine.device) for k, v in shard(collate([sample] + [filler] * (batch - 1), sp, pad_id), sp,
                                                    sp_rank).items()}
    logits = engine(input_ids=mb["input_ids"], position_ids=mb["position_ids"], use_cache=False).logits.float()
    labels = mb["shift_labels"]
    mask = labels != -100
    ce = torch.nn.functional.cross_entropy(logits[mask], labels[mask], reduction="sum") if mask.any() else logits.sum() * 0
    wrong = ((logits.argmax(-1) != labels) & mask).sum()
    return ce.double().cpu(), mask.sum().cpu(), wrong.cpu()


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


def evaluate_stage(engine, stage, dims, dataset, tokenizer, metrics, step: int, micro_batch: int) -> dict:
    """Run the stage's evaluation on every rank; rank 0 records it. Returns the result."""
    cfg = stage.eval
    engine.eval()
    pad_id = tokenizer.pad_id if tokenizer else 0
    result = {"stage": stage.index, "stage_name": stage.name, "step": step, "seq_len": stage.max_seq_length}
    n_held = heldout_count(cfg, len(dataset))
    if n_held:
        ce, n = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.int64)
        for i in range(len(dataset) - n_held, len(dataset)):
            c, k, _ = _sharded_logits_check(engine, dataset[i], dims.sp, dims.sp_rank, pad_id, micro_batch)
            ce, n = ce + c, n + k
        t = torch.stack([ce, n.double()])
        dist.all_reduce(t)  # every rank of an SP group holds part of the same samples; DP groups repeat them
        result["heldout_loss"] = (t[0] / t[1].clamp_min(1)).item()
    trials = passkey_trials(cfg, tokenizer)
    if trials:
        rng = random.Random(1234 + stage.index)
        per_depth = {}
        for depth in cfg.get("depths", [0.1, 0.5, 0.9]):
            ok = 0
            for _ in range(trials):
                sample = passkey_sample(tokenizer, stage.max_seq_length, depth, rng)
                _, _, wrong = _sharded_logits_check(engine, sample, dims.sp, dims.sp_rank, pad_id, micro_batch)
                dist.all_reduce(wrong)
                ok += int(wrong.item() == 0)
            per_depth[f"{depth:g}"] = ok / trials
        result["passkey_accuracy"] = per_depth
        result["passkey_mean"] = sum(per_depth.values()) / len(per_depth)
    engine.train()
    metrics.log_eval(stage.index, result)
    metrics.log_table(f"eval/stage{stage.index}", ["depth", "accuracy"],
                      [[d, a] for d, a in result.get("passkey_accuracy", {}).items()])
    return result
