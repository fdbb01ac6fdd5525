"""Every user-facing tool run the plainest way a user would, no optional flag (issue 47): so that an addition to one
path cannot break the default again. train.py with nothing but an output folder (the built-in model and corpus, 100
steps at 2048 tokens, one process, ~45 s), then scripts/export_hf.py RUN, scripts/eval_summary.py RUN and
scripts/plot_metrics.py RUN/metrics.jsonl on that run; scripts/prepare_data.py and scripts/plan.py with their
required arguments only. scripts/evaluate.py's plainest run:
tests/e2e/test_evaluate.py::test_the_plainest_run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.distributed import ROOT

pytestmark = pytest.mark.dist
ENV = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", WANDB_MODE="offline")
TOK = os.path.join(ROOT, "recipes/base/tiny_passkey256/tokenizer.model")


def tool(script: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, os.path.join(ROOT, script), *args], cwd=ROOT, env=ENV, capture_output=True,
                       text=True, timeout=timeout)
    assert p.returncode == 0, f"{script}: {p.stdout[-2000:]}{p.stderr[-3000:]}"
    return p


def test_train_then_export_then_eval_summary(tmp_path):
    run = tmp_path / "run"
    tool("train.py", "--output_dir", str(run))  # the output folder only: every other setting is the default
    steps = [json.loads(x)["step"] for x in open(run / "metrics.jsonl") if '"loss"' in x]
    assert steps[-1] == 100 and (run / "COMPLETE").exists() and (run / "eval" / "stage0.json").is_file()
    # DeepSpeed's tools as its docs call them, with no tag: they read checkpoints/latest (raised "Unable to find
    # 'latest' file" without it); the weights are the tagged call's, the newest checkpoint's
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint as fp32

    ck = str(run / "checkpoints")
    plain, tagged = fp32(ck), fp32(ck, tag=(run / "checkpoints" / "LATEST").read_text().strip())
    assert plain.keys() == tagged.keys() and all(torch.equal(plain[k], tagged[k]) for k in plain)
    assert (run / "checkpoints" / "latest").read_text() == "step_000100"
    os.rename(run / "hf_model", tmp_path / "hf_by_train")
    assert tool("scripts/export_hf.py", str(run)).stdout.strip().endswith("hf_model")
    cfg = json.loads((run / "hf_model" / "config.json").read_text())
    assert cfg["use_cache"] is True and (run / "hf_model" / "export.json").is_file()  # training's off is not exported
    assert cfg["architectures"] == ["LlamaForCausalLM"]  # a preset-built model had none
    card = (run / "hf_model" / "README.md").read_text()  # a model card: the base, the length; no local path
    assert "tiny-llama" in card and "| 0 | main | 2048 | 100 |" in card and str(tmp_path) not in card
    if (run / "hf_model" / "tokenizer.model").is_file():  # the run's sentencepiece ids, not the preset's (1, 2)
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor(model_file=str(run / "hf_model" / "tokenizer.model"))
        assert (cfg["eos_token_id"], cfg.get("bos_token_id")) == (sp.eos_id(), sp.bos_id() if sp.bos_id() >= 0 else None)
    # an --out that holds the run (a typo) is refused in one line before any work; the run is untouched
    bad = subprocess.run([sys.executable, os.path.join(ROOT, "scripts/export_hf.py"), str(run), "--out", str(run)],
                         cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "holds the checkpoint" in bad.stderr
    assert (run / "checkpoints").is_dir() and (run / "metrics.jsonl").is_file()
    out = tool("scripts/eval_summary.py", str(run)).stdout
    assert f"Evaluation of {run}" in out and "passkey" in out
    tool("scripts/plot_metrics.py", str(run / "metrics.jsonl"))  # the PNG next to the metrics (its default)
    assert (run / "metrics.png").stat().st_size > 0
    # the finished run started again (a dependency chain's next link): nothing trained, the export it has is kept
    # (it was written again: minutes and 32 GB of host memory at 8B, on the whole allocation, at every link)
    again = tool("train.py", "--output_dir", str(run)).stdout
    assert f"{run / 'hf_model'} is already the export of" in again and "exported" not in again


def test_prepare_data(tmp_path):
    src = tmp_path / "corpus.jsonl"
    src.write_text("".join(json.dumps({"text": f"document {i}: " + "words and more words " * 20}) + "\n"
                           for i in range(50)))
    tool("scripts/prepare_data.py", "--input", str(src), "--output", str(tmp_path / "prepared"),
         "--tokenizer_name_or_path", TOK)
    from data.store import Prepared

    assert len(Prepared(str(tmp_path / "prepared")).lens) == 50


def test_plan():
    out = tool("scripts/plan.py", "--model", "llama3-8b", "--seq_len", "128k", timeout=120).stdout
    assert "131072" in out or "128k" in out
