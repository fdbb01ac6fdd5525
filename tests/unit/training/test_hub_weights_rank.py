"""Which ranks ask a hub id's cached snapshot for its weight files at the config's parse (training/hf_args.py
resolve_hub_ids): every rank on a fresh start (transformers reads the weight files on every rank under ZeRO-3), none
on a resume. A requeue landing on nodes whose node-local Hugging Face cache holds the config and tokenizer only stopped
with exit 2 ("... lacks model.safetensors ... hf download") on every rank, though a resume reads no base weights (the
checkpoint's replace them)."""

from __future__ import annotations

import os
import types

import pytest

from tests.unit.model_utils.test_hub import HUB_ID, fill_cache
from training.hf_args import resolve_hub_ids


def _cfg(tmp_path, **kw) -> types.SimpleNamespace:
    return types.SimpleNamespace(model_name_or_path=HUB_ID, tokenizer_name_or_path=None, dry_run=False,
                                 resume="auto", output_dir=str(tmp_path / "run"), **kw)


@pytest.fixture
def config_only_cache(tmp_path, monkeypatch):
    """A node's cache with the model's config and no weight file (a prolog that staged config and tokenizer)."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    return fill_cache(tmp_path / "hf" / "hub", weights=())


@pytest.mark.parametrize("rank", ["0", "3"])
def test_a_resuming_rank_needs_no_weights_in_the_cache(tmp_path, monkeypatch, config_only_cache, rank):
    monkeypatch.setenv("RANK", rank)  # a fresh start: refused before the process group, the command named
    with pytest.raises(ValueError, match=r"lacks model.safetensors .*`hf download meta-llama/Meta-Llama-3-8B`"):
        resolve_hub_ids(_cfg(tmp_path))
    os.makedirs(tmp_path / "run" / "checkpoints")  # a requeue: the run's LATEST is there
    (tmp_path / "run" / "checkpoints" / "LATEST").write_text("step_000010\n")
    cfg = _cfg(tmp_path)
    resolve_hub_ids(cfg)
    assert cfg.model_name_or_path == config_only_cache
    branch = tmp_path / "other" / "checkpoints" / "step_000004"  # --resume PATH: a branch from that checkpoint
    os.makedirs(branch)
    cfg = _cfg(tmp_path)
    cfg.output_dir, cfg.resume = str(tmp_path / "new"), str(branch)
    resolve_hub_ids(cfg)
    assert cfg.model_name_or_path == config_only_cache


def test_a_fresh_start_without_weights_is_still_refused_on_every_rank(tmp_path, monkeypatch, config_only_cache):
    """What rank 0's guess or another rank skipped is refused in one line where the weights are read: rank 0 after the
    resume decision (training/startup.check_base_weights), every rank at its build (build_model's resolve_model)."""
    from model_utils.build import resolve_model
    from training.startup import check_base_weights

    monkeypatch.setenv("RANK", "0")
    os.makedirs(tmp_path / "run" / "checkpoints")
    (tmp_path / "run" / "checkpoints" / "LATEST").write_text("step_000010\n")  # named, but not resumed after all
    cfg = _cfg(tmp_path, from_scratch=False)
    resolve_hub_ids(cfg)
    with pytest.raises(ValueError, match="the folder lacks model.safetensors"):
        check_base_weights(cfg, types.SimpleNamespace(checkpoint=None))
    with pytest.raises(ValueError, match="the folder lacks model.safetensors"):
        resolve_model(cfg.model_name_or_path, weights=True)  # build_model(pretrained=True), on each rank
