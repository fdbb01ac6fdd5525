"""The real architectures under Ulysses SP=2 with packed documents: each matches the plain single-process model
or is refused at start-up in one line.

Tiny random configs of each family (`AutoConfig.for_model` with the family's own fields: Llama-3 RoPE, Qwen2.5
q/k/v bias, Qwen3 q/k norm, Mistral and Phi-3 windows, Gemma-3 local/global layers, Gemma-2 attention soft-capping,
OLMo-2 q/k norm over all heads, Qwen3-MoE and Mixtral routers and experts under ZeRO-3, DeepSeek-V3 latent attention
with q/k and v of different head dims, GPT-OSS learned attention sinks with alternating windows, both also at
ulysses 1 x cp 2), peaked weights
(initializer_range 0.3). Every case runs one step of the real engine (`training.engine.build_engine`: ZeRO-3 +
CPU offload, memory features' loss forward, document-masked Ulysses attention) on two packed samples whose
position ids restart at every document (tests/workers/doc_masking.py, all families in one SP=2 launch, shared with other modules' fast cases), and is
compared with the plain HF model run on each document alone: loss within 1e-5, ZeRO-3 full gradients within
1e-4 (relative). Each family also shows the document mask matters: its causal-across-documents answer is more
than 100x the loss tolerance away from the oracle.
"""

from __future__ import annotations

import os

import pytest
import torch

from planner.memory_model import LEAN_RMSNORM_MODEL_TYPES
from tests.distributed import ROOT
from tests.multiproc.doc_assets import made_once
from tests.multiproc.joint_launch import ASSETS, WORLD2, by_name
from tests.multiproc.test_doc_masking import (
    GRAD_TOL,
    LOSS_TOL,
    SEQ,
    SMALL,
    documents,
    packed,
    rel,
)

SP = 2
MLA = dict(head_dim=8, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, kv_lora_rank=32, q_lora_rank=48,
           num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
           first_k_dense_replace=1, n_group=1, topk_group=1)
OSS = dict(sliding_window=16, layer_types=["sliding_attention", "full_attention"], num_local_experts=4,
           num_experts_per_tok=2)
# name -> (model_type, config fields over SMALL, attention backend, gradients?, oracle backend)
ZOO = {
    "llama3": ("llama", dict(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 64}), "sdpa", True, "sdpa"),
    "qwen2.5": ("qwen2", dict(rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}), "sdpa", True, "sdpa"),
    "qwen3": ("qwen3", dict(), "sdpa", True, "sdpa"),
    "mistral": ("mistral", dict(sliding_window=16), "sdpa", True, "sdpa"),
    "gemma3": ("gemma3_text", dict(sliding_window=16, layer_types=["sliding_attention", "full_attention"]),
               "sdpa", True, "sdpa"),
    # attention soft-capping (Gemma-2; Gemma-3 keeps the field but its attention never applies it): transformers
    # builds Gemma-2 without sdpa, flex_attention applies the cap in its score_mod (forward only on CPU)
    "gemma2_softcap": ("gemma2", dict(sliding_window=16, attn_logit_softcapping=5.0, final_logit_softcapping=None,
                                           query_pre_attn_scalar=32),
                       "flex_attention", False, "eager"),
    "phi3": ("phi3", dict(sliding_window=16), "sdpa", True, "sdpa"),
    "olmo2": ("olmo2", dict(), "sdpa", True, "sdpa"),
    "qwen3_moe": ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                    norm_topk_prob=True), "sdpa", True, "sdpa"),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2), "sdpa", True, "sdpa"),
    # latent attention (MLA): q/k head dim 16 + 8 (RoPE part, `head_dim`), v head dim 16, q and kv latent ranks, MoE
    # after a dense first layer; at Ulysses 2 (v padded through the all-to-all) and at ulysses 1 x cp 2
    "deepseek_v3": ("deepseek_v3", MLA, "sdpa", True, "sdpa"),
    "deepseek_v3_u1cp2": ("deepseek_v3", MLA, "sdpa", True, "sdpa"),
    # learned attention sinks per head, alternating 16-token windows and full layers, MoE: transformers has no sdpa for
    # it and its flex refuses sinks on CPU, so the document-masked flex path runs the sinks through sdpa pieces there
    # (sinks.sink_sdpa, with backward); at Ulysses 2 (sinks sliced with their heads) and at ulysses 1 x cp 2
    "gpt_oss": ("gpt_oss", OSS, "flex_attention", True, "eager"),
    "gpt_oss_u1cp2": ("gpt_oss", OSS, "flex_attention", True, "eager"),
}
CASE = {"deepseek_v3_u1cp2": {"context_parallel_size": 2}, "gpt_oss_u1cp2": {"context_parallel_size": 2}}
SAMPLES = [0, 1]
def zoo_assets(tmp_path_factory) -> dict:
    """Every family's model folder and the documents, made once (also by the joint launch, before this module's
    first test asks)."""
    return made_once(ASSETS, "zoo", tmp_path_factory, ZOO, llama=False)


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return zoo_assets(tmp_path_factory)


def reference(model_dir: str, samples: list[dict], attn: str, across: bool = False):
    """Mean next-token loss and gradients of the plain HF model on one process: every document alone (the
    oracle), or with `across` the whole sample under one causal mask (attention crossing documents)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attn)
    total, count = 0.0, 0
    for s in samples:
        ids, labels, pos = s["input_ids"], s["shift_labels"], s["position_ids"]
        if across:  # an explicit causal mask: without one transformers finds the documents in the position ids
            causal = torch.ones(1, 1, len(ids), len(ids), dtype=torch.bool).tril()
            logits = model(input_ids=ids[None], position_ids=pos[None], attention_mask=causal).logits[0]
        else:
            logits = torch.cat([model(input_ids=ids[None, a:b]).logits[0] for a, b in documents(pos)])
        total = total + torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
        count += int((labels != -100).sum())
    loss = total / count
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def zoo_cases(tmp_path_factory, d) -> dict:
    zoo = zoo_assets(tmp_path_factory)
    return {name: {"model_name_or_path": zoo[name], "dataset_path": zoo["data"], "max_seq_length": SEQ,
                   "sequence_parallel_size": SP, "per_device_train_batch_size": len(SAMPLES),
                   "attn_implementation": attn, "reset_position_ids": "yes", "learning_rate": 1e-3, "max_steps": 1,
                   "report_to": "none", "seed": 0, "deepspeed": os.path.join(ROOT, "ds_configs/zero3_offload.json"),
                   "samples": SAMPLES, "grads": grads, "bypass": False, "out": str(d / f"{name}.pt"),
                   "cache": os.path.join(zoo["dir"], "cache"), **CASE.get(name, {})}
            for name, (_, _, attn, grads, _) in ZOO.items()}


# every family (one engine each) in one SP=2 launch of the doc-masking worker, which other modules' fast cases
# share (tests/multiproc/joint_launch.py)
WORLD2.join("zoo", __name__, "tests/workers/doc_masking.py", lambda assets, factory, d: list(zoo_cases(factory, d).values()),
            ("test_family_matches_plain_model_at_sp2",))


def launch(assets, tmp_path_factory) -> dict:
    return {name: rec for name, (rec, _) in by_name(WORLD2.launched("zoo", assets, tmp_path_factory)).items()}


def zoo_samples(zoo) -> list[dict]:
    return packed({"data": zoo["data"], "dir": zoo["dir"]}, SAMPLES)


@pytest.mark.dist
@pytest.mark.parametrize("name", list(ZOO))
def test_family_matches_plain_model_at_sp2(zoo, assets, tmp_path_factory, name):
    model_type, _, attn, grads, oracle = ZOO[name]
    res = launch(assets, tmp_path_factory)[name]
    assert res["error"] is None, res["error"]  # check_routed: every layer went through the registered function
    lean, norms = res["norms"]  # train.py's default lean RMSNorm (model_utils/rmsnorm.py): every norm, or none
    assert norms > 0 and lean == (norms if model_type in LEAN_RMSNORM_MODEL_TYPES else 0), (name, lean, norms)
    samples = zoo_samples(zoo)
    ref_loss, ref_grads = reference(zoo[name], samples, oracle)
    bad_loss, _ = reference(zoo[name], samples, oracle, across=True)
    loss_err = abs(res["loss"] - ref_loss) / ref_loss
    worst = max((rel(res["grads"][n], ref_grads[n]), n) for n in res["grads"]) if grads else (float("nan"), "-")
    print(f"ZOO {name} ({attn}, sp={SP}{CASE.get(name, '')}): loss rel err {loss_err:.2e}, worst grad rel err {worst[0]:.2e} ({worst[1]}), "
          f"across-documents loss gap {abs(bad_loss - ref_loss) / ref_loss:.2e}")
    assert abs(bad_loss - ref_loss) / ref_loss > 100 * LOSS_TOL, (name, bad_loss, ref_loss)  # the mask matters
    assert loss_err < LOSS_TOL, (name, res["loss"], ref_loss)
    if grads:
        assert set(res["grads"]) == set(ref_grads)
        assert worst[0] < GRAD_TOL, (name, worst)


def test_attention_softcapping_matters(zoo):
    """The Gemma-2 case above can fail: the same weights without the cap miss its oracle by > 100x."""
    from transformers import AutoConfig

    samples = zoo_samples(zoo)
    ref_loss, _ = reference(zoo["gemma2_softcap"], samples, "eager")
    path = os.path.join(zoo["dir"], "gemma2_nocap")
    import shutil

    shutil.copytree(zoo["gemma2_softcap"], path, dirs_exist_ok=True)
    cfg = AutoConfig.from_pretrained(path)
    cfg.attn_logit_softcapping = None
    cfg.save_pretrained(path)
    bad_loss, _ = reference(path, samples, "eager")
    print(f"gemma2 without its attention soft-cap: loss rel gap {abs(bad_loss - ref_loss) / ref_loss:.2e}")
    assert abs(bad_loss - ref_loss) / ref_loss > 100 * LOSS_TOL


def test_final_logit_softcapping_is_refused_at_start_up():
    """The tiled LM head / loss (evaluation always uses it) computes logits without the final soft-cap."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from model_utils import families

    for model_type, name in (("gemma2", "Gemma2ForCausalLM"), ("gemma3_text", "Gemma3ForCausalLM")):
        cfg = AutoConfig.for_model(model_type, **{**SMALL, "final_logit_softcapping": 30.0})
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        for attn in ("sdpa", "flex_attention"):
            with pytest.raises(ValueError, match=rf"^{name}: final_logit_softcapping=30.0 is not supported"):
                families.check_supported(model, attn)


def test_attention_sinks_matter(zoo):
    """The GPT-OSS cases above can fail: the same weights with the sinks switched off (logit -1e4) miss the oracle by
    > 100x the loss tolerance, and so do sinks counted twice (each query's sink logit + log 2)."""
    import math
    import shutil

    from transformers import AutoModelForCausalLM

    samples = zoo_samples(zoo)
    ref_loss, _ = reference(zoo["gpt_oss"], samples, "eager")
    for what, change in (("off", lambda s: s.fill_(-1e4)), ("twice", lambda s: s.add_(math.log(2.0)))):
        path = os.path.join(zoo["dir"], f"gpt_oss_sinks_{what}")
        shutil.copytree(zoo["gpt_oss"], path, dirs_exist_ok=True)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".sinks"):
                    change(p)
        model.save_pretrained(path)
        bad_loss, _ = reference(path, samples, "eager")
        print(f"gpt_oss with its sinks {what}: loss rel gap {abs(bad_loss - ref_loss) / ref_loss:.2e}")
        assert abs(bad_loss - ref_loss) / ref_loss > 100 * LOSS_TOL, what
