"""The tiny models and packed documents the doc-masking tests share (test_doc_masking, test_model_zoo,
test_context_parallel, test_model_sweep import them from test_doc_masking, which re-exports them)."""

from __future__ import annotations

import json

import numpy as np
import torch

DOC_LENS = [37, 11, 29, 40, 50, 25, 30, 30]
SMALL = dict(vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, initializer_range=0.3, pad_token_id=0, bos_token_id=1, eos_token_id=2,
             tie_word_embeddings=False)


def save_config_model(path: str, model_type: str, **fields) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, **{**SMALL, **fields})
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    return path


def write_documents(path) -> str:
    """DOC_LENS documents of random token ids (seed 0), one JSONL line each."""
    rng = np.random.default_rng(0)
    with open(path, "w") as fh:
        for n in DOC_LENS:
            fh.write(json.dumps({"input_ids": rng.integers(4, 2048, n).tolist()}) + "\n")
    return str(path)


def made_once(store: dict, key: str, tmp_path_factory, models: dict, llama: bool = True) -> dict:
    """`store[key]`: the documents (`data`), their folder (`dir`), the tiny Llama (`llama`, unless not asked for) and
    one folder per entry of `models` (name -> (model_type, config fields, ...)), made the first time it is asked for
    (by the joint launch or by the module's first test) and shared after."""
    out = store.setdefault(key, {})
    if not out:
        from tests.conftest import save_tiny_model

        d = tmp_path_factory.mktemp(key)
        out.update(data=write_documents(d / "docs.jsonl"), dir=str(d))
        if llama:
            out["llama"] = save_tiny_model(str(d / "llama"), "tiny-llama", initializer_range=0.3)
        for name, (model_type, fields, *_) in models.items():
            out[name] = save_config_model(str(d / name), model_type, **fields)
    return out
