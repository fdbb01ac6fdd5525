"""Shipped recipes parse, validate and plan (`--dry_run`) on this machine; bad recipes fail in one line."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
import yaml

from tests.distributed import ROOT
from training.config import parse_config
from training.curriculum import check_stages, resolve_stages


def dry_run(*args):
    """train.py --dry_run in its own process (~5-15 s a start): the path, its exit code and its last line."""
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    env.pop("RANK", None)
    return subprocess.run([sys.executable, "train.py", "--dry_run", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def dry_run_here(capsys, *args) -> types.SimpleNamespace:
    """What train.py --dry_run prints, run in this process (training.startup's load_run_config and dry_run, as
    train.py calls them): for the plan's content, where a start of its own adds nothing that dry_run() above does
    not check (test_llama3_8b_recipe_dry_run, test_bad_stage_fails_before_work)."""
    from training.startup import dry_run as plan_only
    from training.startup import load_run_config

    capsys.readouterr()
    plan_only(*load_run_config(["--dry_run", *args]))
    return types.SimpleNamespace(returncode=0, stdout=capsys.readouterr().out, stderr="")


def test_llama3_8b_recipe_dry_run():
    p = dry_run("--config", "recipes/llama3_8b_128k_to_1m.yaml")
    assert p.returncode == 0, p.stderr[-2000:]
    assert "world=32 (4 node(s))" in p.stdout
    for name, sl, sp in (("s128k", 131072, 2), ("s256k", 262144, 4), ("s512k", 524288, 8), ("s1m", 1048576, 8)):
        assert f"{name}: seq_len={sl} sp={sp} dp={32 // sp}" in p.stdout
    assert p.stdout.count("memory plan:") == 4
    # ZeRO-3 offload (issue 25, item 6): the JSON allows it, auto keeps it nowhere on 80 GB GPUs, and says why
    offload = [ln.strip() for ln in p.stdout.splitlines() if ln.strip().startswith("offload:")]
    assert len(offload) == 4 and all(ln.startswith("offload: none (fits: ") for ln in offload), offload
    # on 80 GB, 2 head chunks (their lean norm recomputed) replace checkpointing at the same or a better predicted
    # speed in the stages up to 512k (before the recompute: checkpointing with the attention kept, 0.91-0.97)
    feats = _stage_lines(p.stdout, "memory features")
    assert all("head chunks" in feats[n] and "checkpoint" not in feats[n] for n in ("s128k", "s256k", "s512k")), feats
    # the evaluation's forward passes and time per stage, so users can budget it (issue 27)
    evals = [ln.strip() for ln in p.stdout.splitlines() if ln.strip().startswith("eval:")]
    assert len(evals) == 4 and all(" on 32 x H100 at 40% MFU (" in ln for ln in evals), evals
    assert evals[0].startswith("eval: 5 trials x 5 depths x 1 length + 4 held-out = 29 forward passes of 131072 "
                               "tokens ~ "), evals
    assert evals[3].startswith("eval: 5 trials x 5 depths x 4 lengths + 4 held-out + 4 held-out at 131072 = 108 "
                               "forward passes of 131072-1048576 tokens ~ "), evals


def test_qwen25_7b_recipe_dry_run_splits_sp_past_the_heads(capsys):
    """Qwen2.5-7B has 28 query heads: SP 8 and 16 run as Ulysses 4 inside a node x context parallelism (issue 28),
    and every stage has a memory plan for its split."""
    p = dry_run_here(capsys, "--config", "recipes/qwen25_7b_128k_to_1m.yaml")
    assert p.returncode == 0, p.stderr[-2000:]
    for name, sl, sp, cp in (("s128k", 131072, 8, 2), ("s256k", 262144, 8, 2), ("s512k", 524288, 8, 2),
                             ("s1m", 1048576, 16, 4)):
        assert f"{name}: seq_len={sl} sp={sp} (ulysses 4 x cp {cp}) dp={32 // sp}" in p.stdout, p.stdout
    assert p.stdout.count("memory plan:") == 4 and "no memory plan" not in p.stdout


def test_gpt_oss_20b_recipe_dry_run(capsys):
    """A 2026 family (issue 34): GPT-OSS-20B's sinks on flex_attention, Ulysses 8 inside a node, the 1M stage split
    8 x cp 2 by `auto`, YaRN factor doubled per stage over the model's own settings; head chunks never (sinks)."""
    p = dry_run_here(capsys, "--config", "recipes/gpt_oss_20b_128k_to_1m.yaml")
    assert p.returncode == 0, p.stderr[-2000:]
    assert "model=gpt-oss-20b attn=flex_attention" in p.stdout, p.stdout
    for name, sl, split, factor in (("s128k", 131072, "sp=8", 32), ("s256k", 262144, "sp=8", 64),
                                    ("s512k", 524288, "sp=8", 128), ("s1m", 1048576, "sp=16 (ulysses 8 x cp 2)", 256)):
        line = next(ln for ln in p.stdout.splitlines() if f"{name}: seq_len={sl} " in ln)
        assert f" {split} " in line and f"'factor': {float(factor)}" in line, line
    assert p.stdout.count("memory plan:") == 4 and "no memory plan" not in p.stdout
    assert "head chunks" not in p.stdout


def _stage_lines(stdout: str, prefix: str) -> dict:
    lines = stdout.splitlines()
    return {lines[i].split()[2].rstrip(":"): next(ln.strip() for ln in lines[i:] if ln.strip().startswith(prefix))
            for i, ln in enumerate(lines) if ln.startswith("  stage ")}


def test_llama3_8b_recipe_offloads_where_needed(capsys):
    """The same recipe on smaller GPUs. 24 GB: every stage fits without ZeRO offload, attention head chunks taking
    its place where they are the cheapest way to fit (with the lean norms' outputs recomputed, 2026-11-27; before,
    the 1M stage needed the optimizer offloaded there). 20 GB: the 1M stage fits only with ZeRO offload, and the
    plan says so per stage, with what it costs."""
    p = dry_run_here(capsys, "--config", "recipes/llama3_8b_128k_to_1m.yaml", "--gpu_mem_gb", "24")
    assert p.returncode == 0, p.stderr[-2000:]
    offload, feats = _stage_lines(p.stdout, "offload:"), _stage_lines(p.stdout, "memory features")
    assert list(offload) == ["s128k", "s256k", "s512k", "s1m"]
    assert all(ln.startswith("offload: none") for ln in offload.values()), offload
    # attention head chunks (issue 33): where they are the cheapest way to fit, auto takes them before an offload
    assert "head chunks" in feats["s1m"], feats
    p = dry_run_here(capsys, "--config", "recipes/llama3_8b_128k_to_1m.yaml", "--gpu_mem_gb", "20")
    assert p.returncode == 0, p.stderr[-2000:]
    offload = _stage_lines(p.stdout, "offload:")
    assert "(needed: " in offload["s1m"] and not offload["s1m"].startswith("offload: none"), offload
    assert all(" s of a " in ln for ln in offload.values() if not ln.startswith("offload: none")), offload


@pytest.mark.parametrize("recipe", sorted(f for f in os.listdir(os.path.join(ROOT, "recipes")) if f.endswith(".yaml")))
def test_every_recipe_validates(recipe):
    cfg = parse_config(["--config", os.path.join(ROOT, "recipes", recipe)])
    world = cfg.nodes * cfg.gpus_per_node or 2
    stages = resolve_stages(cfg, dp_of_sp=lambda sp: world // sp)
    check_stages(stages, world, 32, 8)
    assert all(b.max_seq_length >= a.max_seq_length for a, b in zip(stages, stages[1:]))


def test_bad_stage_fails_before_work(tmp_path):
    with open(os.path.join(ROOT, "recipes/llama3_8b_128k_to_1m.yaml")) as fh:
        recipe = yaml.safe_load(fh)
    recipe["stages"][2]["sequence_parallel_size"] = 3
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(recipe))
    out = dry_run("--config", str(p))
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith("error: stage 2 (s512k): sequence_parallel_size=3 does not "
                                                          "divide world size 32")


def test_the_sft_recipes_retrieval_samples_carry_a_share_of_the_loss():
    """recipes/qwen25_7b_instruct_sft_128k.yaml mixes 2% retrieval micro-steps into chat SFT to keep long-context
    retrieval. Weighted by token, a retrieval sample's few answer tokens against the chat samples' supervised tokens
    of the same step carried ~2.5e-5 of its loss (nothing retained); the recipe's weighting gives it about one
    conversation's share. Measured on one step as the recipe accumulates it (scaled down: 8k tokens, chats of 100-500)."""
    import random

    import numpy as np

    from data.packing import ConvPack
    from data.sharding import collate
    from data.tasks import make_sample
    from data.tokenizer import Tokenizer
    from training.step import label_totals

    cfg = parse_config(["--config", "recipes/qwen25_7b_instruct_sft_128k.yaml"])
    stage = cfg.stages[0]
    weighting = stage.loss_weighting or cfg.loss_weighting
    n, rng = 8192, np.random.default_rng(0)
    lens = rng.integers(100, 500, 400)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    mask = np.zeros(int(lens.sum()), np.uint8)
    for s, ln in zip(starts, lens):
        mask[s + int(0.4 * ln): s + ln] = 1  # the replies: the last 60% of each conversation
    chats = ConvPack(rng.integers(10, 1000, int(lens.sum())).astype(np.uint32), mask, starts, lens, n, 0)
    task = make_sample("passkey", Tokenizer(os.path.join(ROOT, "recipes/base/tiny_passkey256/tokenizer.model")), n, 0.5,
                       random.Random(0))
    step = [collate([chats[i]], 8, 0, weighting) for i in range(cfg.gradient_accumulation_steps - 1)]
    step.append(collate([task], 8, 0, weighting))
    share = label_totals(step[-1:])[1] / label_totals(step)[1]
    assert share > 0.01, (weighting, share)  # by token here: ~5e-4 (~6 answer tokens against ~10k)


def test_the_shipped_bases_special_ids_are_its_tokenizers():
    """recipes/base/tiny_passkey256/config.json carried the preset's bos/eos (1, 2) beside a tokenizer.model whose are
    2, 3: a plain Hugging Face generate() on the base stopped on `<s>` (a recipes audit)."""
    import json

    from model_utils.export import sentencepiece_ids

    base = os.path.join(ROOT, "recipes", "base", "tiny_passkey256")
    with open(os.path.join(base, "config.json")) as fh:
        config = json.load(fh)
    bos, eos, _ = sentencepiece_ids(os.path.join(base, "tokenizer.model"))
    assert (config["bos_token_id"], config["eos_token_id"]) == (bos, eos)


@pytest.mark.parametrize("recipe", ["llama3_8b_128k_to_1m_long_mix"])
def test_the_1m_mixture_recipe_trains_longer_context_at_every_stage(recipe):
    """The stage-data audit: the 128k -> 1M recipes packed the whole stream in order, so on a books-heavy corpus (web
    pages of ~700 tokens, books of ~120k, half the tokens each) 6.6% of the 1M stage's tokens were in document pieces
    longer than 512k, 9.5% of its samples held one. Its _long_mix variant (opt-in: it needs long documents; the plain
    recipes stay as they were for corpora without them and for runs requeued after a pull) mixes a long component (documents of the previous
    stage's length and more: ProLong's 60%) with a short one (40%) and replays 10% at 128k: over a third of its tokens,
    more than half its samples (data/coverage.length_lines, lengths only: the figures the run's start says)."""
    import numpy as np

    from data.coverage import length_lines
    from data.pipeline import RunData

    rng = np.random.default_rng(0)
    web = np.maximum(50, rng.lognormal(np.log(700), 1.0, 300_000)).astype(np.int64)
    books = np.maximum(20000, rng.lognormal(np.log(120_000), 0.9, 1500)).astype(np.int64)
    order = rng.permutation(len(web) + len(books))
    lens, source = np.concatenate([web, books])[order], np.repeat([0, 1], [len(web), len(books)])[order]
    prepared = types.SimpleNamespace(lens=lens, starts=np.concatenate([[0], np.cumsum(lens)[:-1]]), source=source,
                                     sources=["web", "books"], mask=None)
    data = RunData(prepared, lens.copy(), np.zeros(0, np.int64), None, reset_position_ids=True)
    cfg = parse_config(["--config", os.path.join(ROOT, "recipes", f"{recipe}.yaml")])
    stages = resolve_stages(cfg, dp_of_sp=lambda sp: 32 // sp)
    for prev, s in zip(stages, stages[1:]):
        long = next(c for c in s.data if c["name"] == "long")
        assert long["min_doc_tokens"] == prev.max_seq_length and long["weight"] == 0.6, s.data
    lines = length_lines(data, stages, header=False)
    assert len(lines) == 3 and not any(ln.startswith("warning") for ln in lines), lines
    share = float(lines[-1].split("tokens: ")[1].split("%")[0])
    assert lines[-1].startswith("stage 3 (s1m)") and share > 30 and "54.0% of its samples hold one" in lines[-1], lines
