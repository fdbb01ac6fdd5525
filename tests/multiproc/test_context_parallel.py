"""SP = ulysses x cp equals the plain model on one process, for head counts no total SP degree divides.

The oracle and the samples are test_doc_masking's: the plain Hugging Face model run on each packed document
alone (peaked weights, initializer_range 0.3; `test_wrong_mask_is_far_from_the_oracle` shows attention across
documents misses it by > 100x the tolerances), loss within 1e-5 relative and ZeRO-3 full gradients within 1e-4,
for (ulysses, cp) in (1,2), (2,2), (1,3), (3,2): packed documents crossing every shard and zigzag chunk
boundary, micro-batch 1 and 2, GQA with KV replication (u = 2 > 1 KV head), sliding windows, head-chunked attention
(attention_head_chunks 2, 3 and every head), activation
checkpointing (every layer, and selective: layer 0 of 2) with keep_attention, tiled MLP and logits, flex_attention (loss only: torch has no flex backward
on CPU), and the evaluation's per-sample statistics (loss by position bucket) through the same split.
Heads: 9 (SP 2 and 6 do not divide it), 6 (SP 4 does not), 4 (SP 3 does not). With ring_attention (K/V passed
around the cp group, model_utils/ring_attention.py) at (1,2), (2,2) and (1,4), in the same launches (RING_CASES):
the same tolerances, every rank's shifts matching in shape and dtype, and the ring's peak bytes = the planner's.
At (1,2) also a window (60) between the local length (48) and the sample's (96) on documents longer than it (LONG):
the window still binds (a rule on the local length dropped it: loss 6e-3 off), gathered and on the ring.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.distributed import ROOT, run
from tests.multiproc.doc_assets import made_once, save_config_model
from tests.multiproc.joint_launch import ASSETS, WORLD2, by_name
from tests.multiproc.test_doc_masking import (
    GRAD_TOL,
    LOSS_TOL,
    SEQ,
    packed,
    reference,
    rel,
)

pytestmark = pytest.mark.dist

MODELS = {"h9": ("llama", dict(num_attention_heads=9, num_key_value_heads=3, hidden_size=144, head_dim=16)),
          "h6": ("llama", dict(num_attention_heads=6, num_key_value_heads=2, hidden_size=96, head_dim=16)),
          "kv1": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=1)),
          "mistral8": ("mistral", dict(sliding_window=8)),
          "mistral_h9": ("mistral", dict(sliding_window=8, num_attention_heads=9, num_key_value_heads=3, hidden_size=144,
                                         head_dim=16)),
          "gemma3": ("gemma3_text", dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"]))}

# (name, model, attn, micro-batch, gradients?, extra config) per (ulysses, cp)
CKPT = {"gradient_checkpointing": True, "keep_attention": True}
CASES = {
    (1, 2): [("h9_mb1", "h9", "sdpa", 1, True, {"eval": True}), ("h9_mb2_ckpt", "h9", "sdpa", 2, True, CKPT),
             ("window_mb2", "mistral8", "sdpa", 2, True, {"tiled_logits": True, "tiled_mlp": True}),
             # head chunks (model_utils/head_chunks.py): 3 of 3 heads (one GQA group each), 9 = every head alone
             ("h9_chunks3_ckpt", "h9", "sdpa", 2, True, {"attention_head_chunks": 3, **CKPT}),
             ("h9_chunks9_tiled", "h9", "sdpa", 1, True, {"attention_head_chunks": 9, "tiled_logits": True,
                                                           "tiled_mlp": True, "gradient_checkpointing": True})],
    (2, 2): [("h6_mb2_selective", "h6", "sdpa", 2, True, {"eval": True, "checkpoint_every": 2, "keep_attention": True}), ("kv1_replicated", "kv1", "sdpa", 1, True, CKPT),
             ("gemma3_flex", "gemma3", "flex_attention", 1, False, {}),
             # head chunks: every local head alone, its one KV head replicated over u = 2; a window
             ("kv1_chunks2_ckpt", "kv1", "sdpa", 1, True, {"attention_head_chunks": 2, **CKPT}),
             ("window_chunks2", "mistral8", "sdpa", 2, True, {"attention_head_chunks": 2, "gradient_checkpointing": True})],
    (1, 3): [("llama_mb2", "llama", "sdpa", 2, True, {}), ("gemma3_mb1", "gemma3", "sdpa", 1, True, {})],
    (3, 2): [("h9_mb2", "h9", "sdpa", 2, True, CKPT), ("window_mb1", "mistral_h9", "sdpa", 1, True, {})],
    (1, 4): [],
}
# ring_attention (model_utils/ring_attention.py): K/V passed around the cp group block by block; packed documents, a
# window, micro-batch 2, checkpointing, GQA replicated over u = 2. Joined to each layout's launch; the (1, 2) case is
# the fast sibling of the slow layouts' ones. "ring_bytes": the exact-bytes check (check_ring_bytes).
RING = {"ring_attention": True}
RING_CASES = {
    (1, 2): [("ring_window_mb2", "mistral8", "sdpa", 2, True, {**RING, "ring_bytes": True})],
    (2, 2): [("ring_h6_mb2", "h6", "sdpa", 2, True, {**RING, "ring_bytes": True}),
             ("ring_window_mb2_ckpt", "mistral8", "sdpa", 2, True, {**RING, **CKPT}),
             ("ring_kv1_replicated", "kv1", "sdpa", 1, True, RING),
             ("ring_kv1_chunks2", "kv1", "sdpa", 1, True, {**RING, "attention_head_chunks": 2, "ring_bytes": True})],
    (1, 4): [("ring_window_mb2", "mistral8", "sdpa", 2, True, {**RING, "ring_bytes": True}),
             ("ring_h9_mb2_ckpt", "h9", "sdpa", 2, True, {**RING, **CKPT}), ("ring_llama_mb1", "llama", "sdpa", 1, True, RING)],
}
for _layout, _ring in RING_CASES.items():
    CASES[_layout] = CASES[_layout] + _ring
# a window wider than a rank's SEQ / cp = 48 tokens but narrower than the sample's 96, on documents (LONG_DOCS) longer
# than it: the mask model_utils/context_parallel.py builds over the gathered keys keeps it (dropped only at >= 96).
# Their own documents and model (long_assets_of); joined to the (1, 2) launch (a few seconds a case)
LONG_DOCS = [90, 6, 80, 16, 96]  # samples [90 | 6] [80 | 16] [96]
LONG_MODELS = {"mistral60": ("mistral", dict(sliding_window=60))}
LONG = [("window60_mb2", "mistral60", "sdpa", 2, True, {}), ("ring_window60_mb2", "mistral60", "sdpa", 2, True, RING)]
SLOW = {(1, 3), (3, 2), (2, 2), (1, 4)}  # (2, 2): 4 ranks on 2 cores, 150 s; u1cp2 and the zoo's u1cp2 cases stay in make test
# flex_attention on CPU under cp, micro-batch 2: loss NaN or 2.8e-3 off, varying from run to run (seen at d3113da,
# before this session's changes, and after them; a fresh inductor cache changes NaN into 2.8e-3). A torch 2.13 CPU
# inductor flex kernel over the rectangular chunk BlockMask is the suspect, not isolated: test_flex_under_cp_on_cpu
FLEX_CP = [("h9_flex_mb2", "h9", "flex_attention", 2, False, {})]  # 3 and 6 processes on 2 cores: ~1-2 min each (make test-slow)


def cp_assets_of(tmp_path_factory) -> dict:
    """The documents and models, made once (also by the joint launch, before this module's first test asks)."""
    return made_once(ASSETS, "cp", tmp_path_factory, MODELS)


def long_assets_of(tmp_path_factory) -> dict:
    """LONG's documents (LONG_DOCS tokens, random ids, seed 0) and model, made once."""
    import numpy as np

    out = ASSETS.setdefault("cp_long", {})
    if not out:
        d = tmp_path_factory.mktemp("cp_long")
        rng = np.random.default_rng(0)
        with open(d / "docs.jsonl", "w") as fh:
            fh.writelines(json.dumps({"input_ids": rng.integers(4, 2048, n).tolist()}) + "\n" for n in LONG_DOCS)
        out.update(data=str(d / "docs.jsonl"), dir=str(d))
        out.update({name: save_config_model(str(d / name), kind, **fields)
                    for name, (kind, fields) in LONG_MODELS.items()})
    return out


@pytest.fixture(scope="module")
def cp_assets(tmp_path_factory):
    return cp_assets_of(tmp_path_factory)


def cp_cases(assets, d, u: int, cp: int, which: list | None = None) -> dict:
    return {name: {"model_name_or_path": assets[model], "dataset_path": assets["data"], "max_seq_length": SEQ,
                   "sequence_parallel_size": u * cp, "context_parallel_size": cp,
                   "per_device_train_batch_size": mb, "attn_implementation": attn, "reset_position_ids": "yes",
                   "learning_rate": 1e-3, "max_steps": 1, "report_to": "none", "seed": 0,
                   "deepspeed": os.path.join(ROOT, "ds_configs/zero3_offload.json"), "samples": [0, 1][:mb],
                   "grads": grads, "bypass": False, "out": str(d / f"{name}.pt"),
                   "cache": os.path.join(assets["dir"], "cache"), **extra}
            for name, model, attn, mb, grads, extra in which or CASES[(u, cp)]}


# u1cp2 (world 2) joins the fast modules' shared 2-rank launch (tests/multiproc/joint_launch.py)
WORLD2.join("cp_u1cp2", __name__, "tests/workers/doc_masking.py",
            lambda assets, factory, d: [*cp_cases(cp_assets_of(factory), d, 1, 2).values(),
                                        *cp_cases(long_assets_of(factory), d, 1, 2, LONG).values()],
            ("test_hybrid_sp_matches_plain_model",))


def launch(assets, tmp_path, u: int, cp: int, which: list | None = None, shared=None) -> dict:
    if (u, cp) == (1, 2) and which is None:
        return by_name(WORLD2.launched("cp_u1cp2", *shared))
    cases = cp_cases(assets, tmp_path, u, cp, which)
    run(os.path.join(ROOT, "tests/workers/doc_masking.py"), [json.dumps(list(cases.values()))], u * cp,
        str(tmp_path / "logs"))
    return {name: (torch.load(c["out"]), c) for name, c in cases.items()}


@pytest.mark.parametrize("layout", [pytest.param(k, marks=[pytest.mark.slow] if k in SLOW else [])
                                    for k in CASES], ids=lambda k: f"u{k[0]}cp{k[1]}")
def test_hybrid_sp_matches_plain_model(cp_assets, tmp_path, assets, tmp_path_factory, layout):
    check_layout(cp_assets, tmp_path, *layout, shared=(assets, tmp_path_factory))


@pytest.mark.slow
@pytest.mark.xfail(reason="flex_attention under cp on CPU: NaN or 2.8e-3 off, run to run (see FLEX_CP)", strict=False)
def test_flex_under_cp_on_cpu(cp_assets, tmp_path):
    check_layout(cp_assets, tmp_path, 1, 2, FLEX_CP)


def check_layout(cp_assets, tmp_path, u: int, cp: int, which: list | None = None, shared=None) -> None:
    for name, (res, case) in launch(cp_assets, tmp_path, u, cp, which, shared).items():
        docs = next(a for a in (cp_assets, *ASSETS.values()) if a.get("data") == case["dataset_path"])  # LONG's too
        model = next(k for k, v in docs.items() if v == case["model_name_or_path"])
        heads = MODELS.get(model, (None, {}))[1].get("num_attention_heads", 4)
        ref_loss, ref_grads = reference(case["model_name_or_path"], packed(docs, case["samples"]))
        assert res["error"] is None, (name, res["error"])
        assert res["builds"] == 1, (name, res["builds"])  # documents built once per micro-batch, not per layer
        worst = max((rel(res["grads"][n], ref_grads[n]), n) for n in res["grads"]) if res["grads"] else (0.0, "")
        print(f"u={u} cp={cp} {name} (heads {heads}, {case['attn_implementation']}, mb={len(case['samples'])}): "
              f"loss rel err {abs(res['loss'] - ref_loss) / ref_loss:.2e}, worst grad rel err {worst[0]:.2e}")
        assert abs(res["loss"] - ref_loss) / ref_loss < LOSS_TOL, (name, res["loss"], ref_loss)
        if case.get("eval"):  # the evaluation's statistics (training/evaluation.py) through the same split
            ev = res["eval"]
            assert abs(ev[:, 0].sum().item() / ev[:, 1].sum().item() - ref_loss) / ref_loss < LOSS_TOL, (name, ev)
            assert torch.allclose(ev[:, 3:7].sum(1), ev[:, 0]) and torch.equal(ev[:, 7:].sum(1), ev[:, 1])
        if case["grads"]:
            assert set(res["grads"]) == set(ref_grads)
            assert worst[0] < GRAD_TOL, (name, worst)
        check_ring(name, res["ring"], case, u, cp)


def check_ring(name: str, rings: list, case: dict, u: int, cp: int) -> None:
    """A ring case ran the ring on every rank (and a gather case never did); every rank of a cp group shifted the
    same shapes and dtypes in the same order (its sends are what its next rank's receives expect: NCCL would not
    check); with "ring_bytes", the most the ring held on each rank is the planner's cp_kv_buffer_bytes, to the byte."""
    if not case.get("ring_attention"):
        assert all(r["calls"] == 0 for r in rings), (name, rings)
        return
    assert all(r["calls"] > 0 and r["log"] for r in rings), (name, [r["calls"] for r in rings])
    for rank, r in enumerate(rings):  # cp group of rank: the ranks at stride u (base.parallel: u consecutive)
        assert r["log"] == rings[rank % u]["log"], (name, rank)
    if case.get("ring_bytes"):
        from planner.attention_sp import chunk_split, cp_kv_buffer_bytes
        from planner.shapes import load_shape

        shape, mb, sp = load_shape(case["model_name_or_path"]), case["per_device_train_batch_size"], u * cp
        n = case.get("attention_head_chunks", 1)  # the ring runs per head chunk
        heads = chunk_split(shape, sp, cp, n)[2:] if n > 1 else None
        want = mb * cp_kv_buffer_bytes(shape, SEQ // sp, sp, 4, cp, ring=True, heads=heads)  # fp32 on CPU
        assert [r["peak_bytes"] for r in rings] == [want] * sp, (name, want, [r["peak_bytes"] for r in rings])


def test_ring_in_bf16_matches_dense_attention_and_holds_the_planned_bytes(tmp_path):
    """The ring alone on 2 ranks in bf16, the dtype the planner counts for a GPU run (tests/workers/ring_kernel.py):
    output and gradients within bf16 tolerance of one dense document / window mask in fp32; each rank's most bytes
    held = cp_kv_buffer_bytes(ring=True) in bf16 (K / V travel in the compute dtype; dK / dV accumulate and travel in
    fp32, as ring-flash-attention's do: in bf16 each hop rounded them; dQ in fp32); the same shifts on both ranks.
    Cheap: no model, no DeepSpeed."""
    import dataclasses

    from planner.attention_sp import cp_kv_buffer_bytes
    from planner.shapes import load_shape
    from tests.unit.model_utils.test_ring_attention import _dense

    case = {"sl": 48, "d": 16, "hq": 4, "hkv": 2, "bounds": [0, 1, 20, 33, 48], "window": 9}
    run(os.path.join(ROOT, "tests/workers/ring_kernel.py"), [str(tmp_path), json.dumps(case)], 2,
        str(tmp_path / "logs"))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(1, h, 48, 16).to(torch.bfloat16).float().requires_grad_() for h in (4, 2, 2, 4))
    pos = torch.cat([torch.arange(e - s) for s, e in zip(case["bounds"][:-1], case["bounds"][1:])])[None]
    doc = (pos[:, 1:] - pos[:, :-1] != 1).cumsum(1)
    doc = torch.cat([torch.zeros(1, 1, dtype=doc.dtype), doc], 1)
    want, _ = _dense(q, k, v, doc, case["window"], 16 ** -0.5)
    want.backward(do.detach())
    wrong = _dense(q.detach(), k.detach(), v.detach(), torch.zeros_like(doc), case["window"], 16 ** -0.5)[0]
    assert (wrong - want).abs().max() > 0.1  # a mask across documents is far outside the tolerance below
    for r in ranks:
        i = r["idx"]
        assert (r["out"].float().transpose(1, 2) - want[:, :, i]).abs().max() < 2e-2
        for got, ref in ((r["dq"], q.grad), (r["dk"], k.grad), (r["dv"], v.grad)):
            assert (got.float() - ref[:, :, i]).abs().max() < 3e-2 * max(1.0, ref.abs().max().item())
    shape = dataclasses.replace(load_shape("llama3-8b"), num_heads=4, num_kv_heads=2, head_dim=16)
    assert [r["peak"] for r in ranks] == [cp_kv_buffer_bytes(shape, 24, 2, 2, 2, ring=True)] * 2
    log = ranks[0]["log"]  # K, V blocks [1, hkv, T, d]; dK / dV stacked [2, 1, hkv, T, d]
    assert ranks[1]["log"] == log and {dt for shape, dt in log if len(shape) == 4} == {"torch.bfloat16"}
    assert {dt for shape, dt in log if len(shape) == 5} == {"torch.float32"}
