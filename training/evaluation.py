"""Evaluation at the end of a stage, through the same sharded engine and the same tiled loss as training
(model_utils/tiled_loss.py): never the whole `[seq, vocab]` logits.

- held-out loss at the stage's length over the run's held-out documents (data/pipeline.py: the same
  documents at every stage, never trained on), overall and by position bucket (`eval.position_buckets`,
  default 8 equal slices of the sequence: with useful context, later slices have lower loss);
- retention: the held-out loss at the first stage's length after every stage (`heldout_loss_first_len`), on the
  same samples every time: the first `retention_samples` held-out samples (the smallest heldout_samples of the run's
  stages that ask for some), their count in the record (`heldout_first_len_samples`);
- synthetic retrieval tasks (data/tasks.py, needs a text tokenizer): `eval.tasks` (a list, or {task: trials};
  default [passkey]) x `eval.depths` (default 0.1, 0.5, 0.9) x `eval.passkey_trials` trials (default 2) at each
  length of `eval.lengths`: `earlier` (default: this stage's and every earlier stage's length, short-context
  retention), `all` (every stage's length: an early stage is also tried beyond its training length) or a list.
  A trial counts when every answer token is the model's argmax given the prompt and the previous answer
  tokens (teacher-forced greedy decoding, exact match). Each trial is seeded by its (task, length, depth, trial
  index) only, so every stage asks the same question at a (length, depth, trial) it shares with another, whatever
  its other depths and trial counts (a stage with more trials adds questions; the first ones are the same).

Samples are split across DP groups (group g takes samples g*mb .. g*mb+mb-1 of each round of dp*mb); every
rank runs the same number of forwards (ZeRO-3 gathers weights with collectives), a group short of samples
runs unlabelled fillers. Cost: one forward per trial without autograd, one 1 GiB logits tile at most; the
trials at length L cost (tasks x depths x trials) forwards of L tokens per stage.
Results go to metrics.jsonl, W&B, OUTPUT_DIR/eval/stage{N}.json and eval/summary.md; `task_hits` keeps each trial's
exact match (scripts/eval_summary.py compares two records over the cells both asked). Before training,
`check_passkey_fits` counts every trial a stage will ask against its length (data/tasks.py trial_need, ~1 ms each at
any length) and training/device_fit.py plans the forwards at the longer lengths (`eval_forward_lengths`).

An SFT stage (`kind: sft`) is evaluated on what it trains: its held-out samples are whole held-out conversations
packed as the stage packs them, the loss on the assistant's tokens only (`stage_heldout`, RunData.heldout with
`sft`). In a curriculum with an SFT stage every stage also reports that loss as `heldout_chat_loss` (the held-out
conversations packed at the first SFT stage's length, the same `retention_samples` after every stage, their count in
`heldout_chat_samples`: the text stages' value is the "before"; it costs that many forwards at that length per stage,
none where the stage measured just that). The tasks can be asked through a chat template (`chat`: a data/chat.py ChatEncoder; scripts/evaluate.py
`--chat`): each trial is one user turn (the haystack and the question) rendered with the template and its
generation prompt, and the trial counts when the assistant's reply, the answer and its end-of-turn token, is the
model's argmax token by token (data/tasks.py `chat_sample`, the rendering an SFT stage trains with `chat: true`), the
question the plain trial asks at the same cell (`trial`).

A non-finite held-out loss (a weight or an activation gone NaN / inf) refuses to go on in one line, the same on every
rank (the losses are all-reduced): the record goes to metrics.jsonl, not to eval/stage{N}.json, so the stage stays
unevaluated and a re-run evaluates it again instead of starting the next stage from it.
"""

from __future__ import annotations

import math
import random

import numpy as np
import torch

from base import comm, progress
from data.pipeline import heldout_samples
from data.sharding import collate, shard
from data.tasks import (  # noqa: F401  (FILLER: re-exported, older imports)
    FILLER,
    TASKS,
    TooLong,
    TooShort,
    chat_sample,
    cwe_may_run_out,
    eval_lengths,
    make_sample,
    passkey,
    trial_need,
)
from model_utils.tiled_loss import eval_stats

DEFAULT_DEPTHS = [0.1, 0.5, 0.9]
DEFAULT_BUCKETS = 8


def sample_stats(engine, samples: list[dict], dims, micro_batch: int, pad_id: int, buckets: int = 0) -> torch.Tensor:
    """[len(samples), 3] on every rank: per sample [sum CE, labelled tokens, wrong argmax] over the whole
    sequence, each sample evaluated by one DP group (its SP ranks each take their shard). With `buckets` = n,
    n CE sums and n labelled-token counts by context position (a token's position in its document, in n equal
    slices of the sample's length) follow: [.., 3 + 2n]."""
    out = torch.zeros(len(samples), 3 + 2 * buckets, dtype=torch.float64)
    if not samples:
        return out
    per_round = dims.dp * micro_batch
    filler = {**samples[0], "shift_labels": np.full_like(samples[0]["shift_labels"], -100)}
    sl = len(samples[0]["input_ids"])
    for lo in range(0, len(samples), per_round):
        mine = list(range(lo + dims.dp_rank * micro_batch, lo + (dims.dp_rank + 1) * micro_batch))
        batch = collate([samples[i] if i < len(samples) else filler for i in mine], dims.seq_multiple, pad_id)
        if buckets:  # by a token's context: its position in its document (held-out samples pack many at 1M, their
            # positions restarted; by offset in the sample every slice held ~1-3k tokens of context, the last too)
            at = torch.arange(batch["input_ids"].shape[1]).expand_as(batch["input_ids"])
            pos = batch["position_ids"].to(at.dtype) if "position_ids" in batch else at
            batch["bucket_ids"] = torch.where(at < sl, pos * buckets // sl, -1)
        mb = {k: v.to(engine.device) for k, v in shard(batch, dims.sp, dims.sp_rank, dims.cp).items()}
        stats = eval_stats(engine, mb, buckets).cpu()
        for row, i in zip(stats, mine):
            if i < len(samples):
                out[i] += row
    return comm.all_reduce(out)  # SP ranks hold disjoint shards, DP groups disjoint samples: the sum is each once


def passkey_trials(eval_cfg: dict, tokenizer) -> int:
    """Trials per depth a stage runs (every task): its eval.passkey_trials, default 2 with a text tokenizer."""
    return int(eval_cfg.get("passkey_trials", 2)) if tokenizer is not None else 0


def task_trials(eval_cfg: dict, tokenizer) -> dict[str, int]:
    """{task: trials per depth} of a stage's evaluation: eval.tasks as a list (each with passkey_trials) or a
    mapping {task: trials}; default {passkey: passkey_trials}. Empty without a text tokenizer."""
    n = passkey_trials(eval_cfg, tokenizer)
    if tokenizer is None:
        return {}
    spec = eval_cfg.get("tasks", ["passkey"])
    tasks = {t: int(spec[t]) for t in spec} if isinstance(spec, dict) else {t: n for t in spec}
    unknown = sorted(set(tasks) - set(TASKS))
    if unknown:
        raise ValueError(f"eval.tasks: unknown task(s) {unknown}; valid: {list(TASKS)}")
    return {t: k for t, k in tasks.items() if k > 0}


def eval_forward_lengths(stage, stages) -> dict[int, list[str]]:
    """{length: the settings that ask it} of every forward a stage's evaluation runs (evaluate_stage): its held-out
    samples at its own length, the tasks at eval_lengths (counted as a run with a text tokenizer asks them), and with
    held-out samples the retention loss at the first stage's length and the held-out conversations at the first SFT
    stage's. A stage evaluates with its own SP degree and memory features at each: a 32k stage at sp 1 with eval.lengths
    all before a 1M stage evaluates at 1M with sp 1, ~102 GiB per rank for Llama-3-8B (training/device_fit.py)."""
    asked: dict[int, list[str]] = {stage.max_seq_length: []}
    if task_trials(stage.eval, tokenizer=True):
        for n in eval_lengths(stage, stages):
            asked.setdefault(n, []).append(f"eval.lengths {stage.eval.get('lengths', 'earlier')}")
    if heldout_samples(stage.eval) > 0 and stages:
        asked.setdefault(stages[0].max_seq_length, []).append("the retention loss at the first stage's length")
        chat = next((s.max_seq_length for s in stages if getattr(s, "kind", None) == "sft"), None)
        if chat is not None:
            asked.setdefault(chat, []).append("the held-out conversation loss at the first SFT stage's length")
    return asked


def task_seed(task: str, length: int, depth: float, i: int) -> random.Random:
    """The rng of trial `i` of `task` at (length, depth): the same question wherever that cell is asked."""
    return random.Random(f"eval:{task}:{length}:{depth:g}:{i}")


def unique_depths(depths) -> list[float]:
    """The depths once each, in the order given, one per record key (`f"{d:g}"`, which seeds the trials too): a depth
    given twice (`--depths 0.5,0.5`) asked its trials twice, twice the forwards, its hits string twice as long."""
    once: dict[str, float] = {}
    for d in depths:
        once.setdefault(f"{float(d):g}", float(d))
    return list(once.values())


def stage_depths(eval_cfg: dict) -> list[float]:
    return unique_depths(eval_cfg.get("depths", DEFAULT_DEPTHS))


def check_trials_fit(trials: dict[str, int], depths: list[float], lengths: list[int], tokenizer, chat=None) -> None:
    """The trials an evaluation asks ({task: n} x depths x lengths, seeded by task_seed) fit their lengths: TooShort
    naming the first that does not (and the most any of that task and length needs), TooLong where common_words
    runs out of words. Each trial's need without building it (data/tasks.py trial_need, ~1 ms whatever the length; a
    1M trial costs 0.1-0.3 s to build, common_words' seconds): 5 tasks x 3 depths x 10 trials x 4 lengths, ~1 s. Before,
    one trial of Random(0) at depth 0.5 was tried: variable_tracking's trials need 285-319 tokens, and a run whose
    length held that one trained, saved and stopped at its evaluation."""
    for task, n in trials.items():
        for length in lengths:
            needs = {(d, i): trial_need(task, tokenizer, d, task_seed(task, length, d, i), chat, reseed=False)
                     for d in depths for i in range(n)}
            (d, i), most = max(needs.items(), key=lambda kv: kv[1])
            if most > length:
                raise TooShort(f"max_seq_length={length} is too short for a {task} trial (needs {most} tokens: trial "
                               f"{i} at depth {d:g})", most)
            if task == "common_words" and cwe_may_run_out(length):
                trial(task, tokenizer, length, 0.5, random.Random(0), chat)


def check_passkey_fits(stages, tokenizer) -> None:
    """Before any training: every stage's evaluation trials (each task, length, depth and trial, as evaluate_stage
    seeds them) fit the lengths they are asked at (one-line error)."""
    for stage in stages:
        try:
            tasks, lengths = task_trials(stage.eval, tokenizer), eval_lengths(stage, stages)
            depths = stage_depths(stage.eval)
        except ValueError as err:
            raise ValueError(f"stage {stage.name!r}: {err}") from None
        try:
            check_trials_fit(tasks, depths, lengths, tokenizer)
        except TooLong as err:  # common_words past its made-up words (~49M tokens)
            raise ValueError(f"stage {stage.name!r}: {err}: lower eval.lengths or drop common_words from eval.tasks "
                             "for this stage") from None
        except ValueError as err:
            raise ValueError(f"stage {stage.name!r}: {err}: raise max_seq_length (or eval.lengths) or set "
                             "eval.passkey_trials: 0 (or drop the task from eval.tasks) for this stage") from None


def passkey_sample(tokenizer, seq_len: int, depth: float, rng: random.Random) -> dict[str, np.ndarray]:
    """A passkey trial (data/tasks.py `passkey`; kept under its old name)."""
    return passkey(tokenizer, seq_len, depth, rng)


def stage_heldout(data, stage, n: int) -> list[dict]:
    """A stage's held-out samples at its length (data/pipeline.py RunData.heldout): an SFT stage's are the held-out
    conversations packed whole, as it trains (ConvPack: positions restarted, the loss on the assistant's tokens),
    a text stage's documents packed as text. Same cost either way: `n` samples of the stage's length."""
    if getattr(stage, "kind", None) == "sft":
        return data.heldout(stage.max_seq_length, n, sft=True)
    return data.heldout(stage.max_seq_length, n)


def trial(task: str, tokenizer, length: int, depth: float, rng: random.Random, chat=None) -> dict:
    """One trial of `task` at `length`: plain text (the answer ends the sample, loss on it), or with `chat` (a
    ChatEncoder) one user turn through the template and its generation prompt, the reply (answer + end-of-turn)
    scored. The same question either way: the plain trial of `rng`'s draws, built shorter by the template's tokens
    (`chat_sample` without `reseed`; seeded by a draw of `rng`, as training's samples are, an SFT checkpoint asked
    through its template was compared with its base asked plainly over other questions)."""
    if chat is None:
        return make_sample(task, tokenizer, length, depth, rng)
    return chat_sample(task, tokenizer, chat, length, depth, rng, reseed=False)


def task_accuracy(engine, dims, micro_batch: int, pad_id: int, tokenizer, trials: dict[str, int], depths: list[float],
                  length: int, chat=None) -> dict[str, dict[str, float]]:
    """{task: {depth: exact-match accuracy}} at `length`: one batch of trials for all tasks and depths."""
    return task_scores(engine, dims, micro_batch, pad_id, tokenizer, trials, depths, length, chat)[0]


def task_scores(engine, dims, micro_batch: int, pad_id: int, tokenizer, trials: dict[str, int], depths: list[float],
                length: int, chat=None, hits: dict | None = None) -> tuple[dict, dict]:
    """({task: {depth: exact-match accuracy}}, {task: {depth: mean CE per answer token}}) at `length`; with `chat`
    the trials asked through that template (`trial`); `hits` (a dict) gets {task: {depth: "1101"}}, trial i's exact
    match at character i (two records are compared over the cells both asked: scripts/eval_summary.py). Rendering
    through a template costs one decode and one tokenization of each trial's haystack on every rank (the template
    rendered around a placeholder, the haystack's tokens spliced in: data/chat.py `encode_long`), linear in the length:
    ~0.13 s at 128k and ~2 s at 1M per trial on one loaded core (tests/unit/data/chat_render_bench.py; a whole render
    was ~3x that), small next to the trial's forward."""
    samples, where, depths = [], [], unique_depths(depths)
    for task, n in trials.items():
        for d in depths:  # one seed per question: a stage with other depths or trial counts asks the same ones
            for i in range(n):
                samples.append(trial(task, tokenizer, length, d, task_seed(task, length, d, i), chat))
                # every trial is built before the first forward (at 1M, common_words' took ~17 s, now a few): the
                # progress monitor (base/progress.py) saw no tick for all of them, and 25 such trials passed the eval
                # bound (300 s): a healthy evaluation was aborted as "hung together" and requeued. A tick per trial
                # (a dict update; nothing outside a run's marks) keeps the bound on the longest single trial
                progress.tick()
            where += [(task, d)] * n
    stats = sample_stats(engine, samples, dims, micro_batch, pad_id).tolist()
    acc: dict[str, dict[str, float]] = {t: {} for t in trials}
    loss: dict[str, dict[str, float]] = {t: {} for t in trials}
    for task in trials:
        for d in depths:
            rows = [r for r, k in zip(stats, where) if k == (task, d)]
            acc[task][f"{d:g}"] = sum(float(r[2] == 0) for r in rows) / len(rows)
            if hits is not None:
                hits.setdefault(task, {})[f"{d:g}"] = "".join("1" if r[2] == 0 else "0" for r in rows)
            loss[task][f"{d:g}"] = sum(r[0] for r in rows) / max(1.0, sum(r[1] for r in rows))
    return acc, loss


# how trials are seeded, in every record: one seed per (task, length, depth, trial) since 2026-11-30 (before, per
# (task, length): another record's trials asked other questions; scripts/eval_summary.py says so)
TASK_SEEDS = "task:length:depth:trial"


def evaluate_tasks(engine, dims, micro_batch: int, pad_id: int, tokenizer, trials: dict[str, int],
                   depths: list[float], lengths: list[int], chat=None) -> dict:
    """The tasks' part of an evaluation, the same for a stage's end (evaluate_stage) and scripts/evaluate.py:
    {"tasks": {task: {length: {depth: accuracy}}}, "task_mean": {task: {length: mean over depths}},
    "task_loss": {task: {length: {depth: mean cross-entropy per answer token}}} (a graded view of the same trials:
    it moves before the exact match does), "task_hits": {task: {length: {depth: "1101"}}} (each trial's exact match,
    in trial order: a string, so W&B's scalars skip it). With `chat`, the trials are asked through that template."""
    hits: dict[int, dict] = {n: {} for n in lengths}
    by_len = {n: task_scores(engine, dims, micro_batch, pad_id, tokenizer, trials, depths, n, chat, hits[n])
              for n in lengths}
    tasks = {t: {str(n): by_len[n][0][t] for n in by_len} for t in trials}
    return {"tasks": tasks, "task_mean": {t: {n: sum(a.values()) / len(a) for n, a in lens.items()}
                                          for t, lens in tasks.items()},
            "task_loss": {t: {str(n): by_len[n][1][t] for n in by_len} for t in trials},
            "task_hits": {t: {str(n): hits[n][t] for n in by_len} for t in trials}, "task_seeds": TASK_SEEDS}


def retention_samples(stages, own: int) -> int:
    """How many held-out samples the retention loss and the held-out conversation loss are scored on after every
    stage: the smallest `heldout_samples` of the run's stages that ask for some (known at start-up), so that a stage
    asking for more (or fewer: a costly 1M stage) scores the same samples as the others; `own` without stages. A stage
    asking for more than that at the first length scores those samples again (that many forwards at that length)."""
    asked = [k for k in (heldout_samples(getattr(s, "eval", None) or {}) for s in stages or []) if k > 0]
    return min(asked) if asked else own


def position_by(samples: list[dict], restarts: bool | None = None) -> str:
    """What the held-out loss's position buckets measured: "document" where the run restarts positions at documents
    (`restarts`: RunData.reset_position_ids; a token's context in its document) or, that unknown, where a sample's
    positions restart; "sample" otherwise (--reset_position_ids no: positions run on across documents, the buckets are
    offsets in the sample). Samples of one document each read the same either way: read from the samples alone, a
    run that restarts positions, its held-out documents each longer than a sample (a 1M stage), recorded "sample"
    and the table's * blamed --reset_position_ids no on it. Evaluations before 2026-11-29 bucketed by offset and
    recorded nothing. One pass over the samples' positions."""
    restart = restarts or any(np.any(np.asarray(s["position_ids"])[1:] == 0) for s in samples if "position_ids" in s)
    return "document" if restart else "sample"


def _put(result: dict, key: str, stats: torch.Tensor) -> bool:
    """result[key] = the mean loss of summed `sample_stats` rows (sum CE / supervised tokens), only where some token
    was scored: an empty held-out set is absent from the result, never a 0.0 that reads as a perfect model."""
    if stats[1] > 0:
        result[key] = (stats[0] / stats[1]).item()
    return key in result


def _copy(result: dict, key: str, source: str) -> None:
    if source in result:
        result[key] = result[source]


def evaluate_stage(engine, stage, dims, heldout: list[dict], tokenizer, metrics, step: int, micro_batch: int,
                   pad_id: int, stages=None, heldout_at=None, before: str | None = None,
                   restarts: bool | None = None) -> dict:
    """Run the stage's evaluation on every rank; rank 0 records it. Returns the result. `stages` (the whole
    curriculum) gives the other lengths to try the tasks at, `heldout_at(seq_len, n)` (RunData.heldout) the
    held-out samples at the first stage's length (packed as the first stage packs them: text or conversations);
    without them only this stage's length is evaluated. A non-finite held-out loss: ValueError (module docstring),
    naming `before` (the checkpoint before the weights evaluated) to resume from. `restarts`: whether the run
    restarts positions at documents (`position_by`); by default read from the RunData `heldout_at` is bound to
    (training/stage.py passes `run.data.heldout`), and an SFT stage's conversations always restart."""
    cfg = stage.eval
    engine.eval()
    result = {"stage": stage.index, "stage_name": stage.name, "step": step, "seq_len": stage.max_seq_length}
    buckets = int(cfg.get("position_buckets", DEFAULT_BUCKETS))
    if heldout:
        stats = sample_stats(engine, heldout, dims, micro_batch, pad_id, buckets).sum(0)
        if _put(result, "heldout_loss", stats):
            result["heldout_tokens"] = int(stats[1].item())
            if buckets:
                ce, n = stats[3:3 + buckets], stats[3 + buckets:]
                result["heldout_loss_by_position"] = [(c / k).item() if k > 0 else float("nan") for c, k in zip(ce, n)]
                if restarts is None:
                    restarts = getattr(stage, "kind", None) == "sft" or getattr(  # the bound RunData's setting
                        getattr(heldout_at, "__self__", None), "reset_position_ids", None)
                result["position_by"] = position_by(heldout, restarts)
    first = stages[0].max_seq_length if stages else stage.max_seq_length
    sft = getattr(stage, "kind", None) == "sft"
    first_sft = getattr(stages[0] if stages else stage, "kind", None) == "sft"  # retention: as the first stage measured
    keep = retention_samples(stages, heldout_samples(cfg))  # the same count (so the same samples) after every stage
    mine = heldout_samples(cfg) == keep or heldout_at is None  # this stage's own held-out samples are those
    counts = {"heldout_loss_first_len": len(heldout)}
    if heldout and first == stage.max_seq_length and first_sft == sft and mine:
        _copy(result, "heldout_loss_first_len", "heldout_loss")
    elif heldout and heldout_at is not None:
        again = heldout_at(first, keep, sft=True) if first_sft else heldout_at(first, keep)
        _put(result, "heldout_loss_first_len", sample_stats(engine, again, dims, micro_batch, pad_id).sum(0))
        counts["heldout_loss_first_len"] = len(again)
    if heldout:
        result["first_len"] = first
    if "heldout_loss_first_len" in result:
        result["heldout_first_len_samples"] = counts["heldout_loss_first_len"]
    # the held-out conversation loss after every stage of a curriculum with an SFT stage (the text stages before it
    # too: the "before" of the fine-tuning): the held-out conversations packed whole at the first SFT stage's length,
    # loss on the assistant's tokens, the same samples at every stage (reused where this stage measured just that:
    # its own held-out loss, or the retention number of a curriculum that starts with the SFT stage). Conversations
    # only (RunData.heldout with `sft`: a mixed folder's text documents are not); none held out: absent, never 0.0.
    chat_len = next((s.max_seq_length for s in stages or [] if getattr(s, "kind", None) == "sft"), None)
    if heldout and chat_len is not None and sft and chat_len == stage.max_seq_length and mine:
        _copy(result, "heldout_chat_loss", "heldout_loss")
        counts["heldout_chat_loss"] = len(heldout)
    elif heldout and chat_len is not None and first_sft and first == chat_len:
        _copy(result, "heldout_chat_loss", "heldout_loss_first_len")
        counts["heldout_chat_loss"] = counts["heldout_loss_first_len"]
    elif heldout and chat_len is not None and heldout_at is not None:
        chats = heldout_at(chat_len, keep, sft=True)
        _put(result, "heldout_chat_loss", sample_stats(engine, chats, dims, micro_batch, pad_id).sum(0))
        counts["heldout_chat_loss"] = len(chats)
    if "heldout_chat_loss" in result:
        result["heldout_chat_len"], result["heldout_chat_samples"] = chat_len, counts["heldout_chat_loss"]
    trials = task_trials(cfg, tokenizer)
    if trials:
        depths = stage_depths(cfg)
        result.update(evaluate_tasks(engine, dims, micro_batch, pad_id, tokenizer, trials, depths,
                                     eval_lengths(stage, stages)))
        if "passkey" in trials and str(stage.max_seq_length) in result["tasks"]["passkey"]:
            result["passkey_accuracy"] = result["tasks"]["passkey"][str(stage.max_seq_length)]
            result["passkey_mean"] = result["task_mean"]["passkey"][str(stage.max_seq_length)]
    engine.train()
    _refuse_nonfinite(result, stage, stages, metrics, before)
    metrics.log_eval(stage.index, result)
    metrics.log_table(f"eval/stage{stage.index}", ["task", "length", "depth", "accuracy"],
                      [[t, int(n), float(d), a] for t, lens in result.get("tasks", {}).items()
                       for n, acc in lens.items() for d, a in acc.items()], step=result.get("step"))
    return result


def _refuse_nonfinite(result: dict, stage, stages, metrics, before: str | None) -> None:
    """One line where a held-out loss of `result` is not finite (after its record in metrics.jsonl only)."""
    bad = [f"{k} {result[k]}" for k in ("heldout_loss", "heldout_loss_first_len", "heldout_chat_loss")
           if not math.isfinite(result.get(k, 0.0))]
    if not bad:
        return
    metrics.log({"event": "eval", **result})
    nxt = stages[stage.index + 1] if stages and stage.index + 1 < len(stages) else None
    then = f"stage {nxt.index} ({nxt.name}) is not started from them" if nxt else "they are not exported"
    raise ValueError(f"stage {stage.index} ({stage.name}) at step {result['step']}: held-out loss not finite "
                     f"({', '.join(bad)}): its weights produce non-finite values, {then}; " + (
                         f"resume from the checkpoint before, {before} (--resume {before}), with a lower "
                         "--learning_rate" if before else "resume from an earlier checkpoint of checkpoints/ "
                         "(--resume PATH) with a lower --learning_rate"))
