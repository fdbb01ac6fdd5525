"""Packed documents attend only to themselves, at every SP degree (model_utils/attention.py).

The oracle is the plain Hugging Face model on ONE process, run on each document of a packed sample alone:
the sample's loss (token sums and counts combined as training does) within 1e-5 relative and the ZeRO-3
full gradients within 1e-4 relative, at SP 1/2/4, micro-batch 1 and 2, sdpa (loss + gradients) and
flex_attention (loss only: torch 2.13 has no flex_attention backward on CPU). The samples hold 3+ documents
of uneven lengths that cross the SP shard boundaries. The weights are peaked (initializer_range 0.3) and
the test asserts that the wrong answer (causal attention across documents, what Ulysses did before) is
more than 100x the tolerance away from the oracle, so a regression cannot pass.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from tests.conftest import save_tiny_model
from tests.distributed import ROOT, run

SEQ = 96  # SP=4 shards of 24 tokens: documents [0,37) [37,48) [48,77) [77,..) cross 24 and 72
DOC_LENS = [37, 11, 29, 40, 50, 25, 30, 30]
LOSS_TOL, GRAD_TOL = 1e-5, 1e-4


@pytest.fixture(scope="module")
def docs_assets(tmp_path_factory):
    d = tmp_path_factory.mktemp("docmask")
    rng = np.random.default_rng(0)
    with open(d / "docs.jsonl", "w") as fh:
        for n in DOC_LENS:
            fh.write(json.dumps({"input_ids": rng.integers(4, 2048, n).tolist()}) + "\n")
    return {"llama": save_tiny_model(str(d / "llama"), "tiny-llama", initializer_range=0.3),
            "data": str(d / "docs.jsonl"), "dir": str(d)}


def packed(assets, samples: list[int]) -> list[dict]:
    from data.packing import PackedDataset, build_token_stream

    tokens, starts = build_token_stream(assets["data"], None, 2048, os.path.join(assets["dir"], "cache"))
    ds = PackedDataset(tokens, starts, SEQ, reset_position_ids=True)
    return [{k: torch.from_numpy(v) for k, v in ds[i].items()} for i in samples]


def documents(pos: torch.Tensor) -> list[tuple[int, int]]:
    cut = [0] + [i for i in range(1, len(pos)) if pos[i] != pos[i - 1] + 1] + [len(pos)]
    return list(zip(cut[:-1], cut[1:]))


def reference(model_dir: str, samples: list[dict], mode: str = "docs"):
    """Mean next-token loss and gradients of the plain HF model (one process, sdpa, no registration).

    mode "docs": every document run alone (the oracle); "across": the whole sample at once with reset
    position ids and a plain causal mask, i.e. attention crossing documents (the wrong answer)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    total, count = 0.0, 0
    for s in samples:
        ids, labels, pos = s["input_ids"], s["shift_labels"], s["position_ids"]
        if mode == "docs":
            logits = torch.cat([model(input_ids=ids[None, a:b]).logits[0] for a, b in documents(pos)])
        else:
            causal = torch.ones(1, 1, len(ids), len(ids), dtype=torch.bool).tril()
            logits = model(input_ids=ids[None], position_ids=pos[None], attention_mask=causal).logits[0]
        total = total + torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
        count += int((labels != -100).sum())
    loss = total / count
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def test_packed_samples_cross_shard_boundaries(docs_assets):
    for s in packed(docs_assets, [0, 1]):
        docs = documents(s["position_ids"])
        assert len(docs) >= 3 and len({b - a for a, b in docs}) >= 3
        assert any(a < SEQ // 4 * k < b for a, b in docs for k in (1, 2, 3))


def test_wrong_mask_is_far_from_the_oracle(docs_assets):
    """Causal attention across documents misses the oracle by > 100x the tolerances (the tests below can fail)."""
    samples = packed(docs_assets, [0, 1])
    ref_loss, ref_grads = reference(docs_assets["llama"], samples)
    bad_loss, bad_grads = reference(docs_assets["llama"], samples, mode="across")
    gap_loss = abs(bad_loss - ref_loss) / ref_loss
    gap_grad = max(rel(bad_grads[n], ref_grads[n]) for n in ref_grads)
    print(f"wrong mask: loss rel gap {gap_loss:.2e}, worst grad rel gap {gap_grad:.2e}")
    assert gap_loss > 100 * LOSS_TOL, (bad_loss, ref_loss)
    assert gap_grad > 100 * GRAD_TOL


_LAUNCHED: dict = {}


def launch(assets, tmp_path_factory, sp: int) -> dict:
    """One multi-process run per SP degree (every case of that degree), cached for the module."""
    if sp in _LAUNCHED:
        return _LAUNCHED[sp]
    d = tmp_path_factory.mktemp(f"docmask_sp{sp}")
    cases = {}
    for attn, mb, grads in (("sdpa", 1, True), ("sdpa", 2, True), ("flex_attention", 2, False)):
        name = f"{attn}_mb{mb}"
        cases[name] = {"model_name_or_path": assets["llama"], "dataset_path": assets["data"], "max_seq_length": SEQ,
                       "sequence_parallel_size": sp, "per_device_train_batch_size": mb, "attn_implementation": attn,
                       "reset_position_ids": "yes", "learning_rate": 1e-3, "max_steps": 1, "report_to": "none",
                       "seed": 0, "deepspeed": os.path.join(ROOT, "ds_configs/zero3_offload.json"),
                       "samples": [0, 1][:mb], "grads": grads, "out": str(d / f"{name}.pt"),
                       "cache": os.path.join(assets["dir"], "cache")}
    run(os.path.join(ROOT, "tests/workers/doc_masking.py"), [json.dumps(list(cases.values()))], sp, str(d / "logs"))
    _LAUNCHED[sp] = {name: torch.load(c["out"]) for name, c in cases.items()}
    return _LAUNCHED[sp]


@pytest.mark.dist
@pytest.mark.parametrize("sp", [1, 2, 4])
def test_documents_match_plain_model_alone(docs_assets, tmp_path_factory, sp):
    got = launch(docs_assets, tmp_path_factory, sp)
    for name, res in got.items():
        mb = int(name[-1])
        ref_loss, ref_grads = reference(docs_assets["llama"], packed(docs_assets, [0, 1][:mb]))
        assert res["error"] is None, (name, res["error"])
        worst = max((rel(res["grads"][n], ref_grads[n]), n) for n in res["grads"]) if res["grads"] else (0.0, "")
        print(f"sp={sp} {name}: loss rel err {abs(res['loss'] - ref_loss) / ref_loss:.2e}, grad rel err {worst[0]:.2e}")
        assert abs(res["loss"] - ref_loss) / ref_loss < LOSS_TOL, (name, res["loss"], ref_loss)
        if res["grads"]:
            assert set(res["grads"]) == set(ref_grads)
            assert worst[0] < GRAD_TOL, (name, worst)
