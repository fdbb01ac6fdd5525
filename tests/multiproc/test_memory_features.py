"""Long-sequence memory features (model_utils/memory.py) keep training equal to the plain model.

Each feature alone and all four together, selective checkpointing (`checkpoint_every: 2`, alone and
with tiled MLP + offload), and checkpointing that keeps the attention output (`keep_attention`: every layer,
and every 2nd with tiled MLP + offload), through the real ZeRO-3 engine at sp=2 (world 2; the all-feature
cases also at sp=1 x dp=2 in that launch; every case at sp=1 in a world of 1: slow): the first step's loss
(fp32) within 1e-5 relative and the full gradients within 1e-4 relative of the plain single-process Hugging
Face model. Tiles are made small so the short test sequences really split (uneven last tiles included), on
untied and tied (Qwen2) LM heads, with bs=2 and with GA=2. Unit tests cover the tile rules, the tiled loss
against a scaled backward, and the allocator setting.
"""

from __future__ import annotations

import json
import math
import os
import types

import pytest
import torch
import torch.nn.functional as F

from model_utils import memory, tiled_loss
from tests.distributed import ROOT, run
from tests.multiproc.test_parity import reference, rel

ALL = ("tiled_mlp", "tiled_logits", "gradient_checkpointing", "offload_activations")
# (name, model, seq_len, features, extra config)
CASES = [("mlp", "llama_gqa", 64, ("tiled_mlp",), {}),
         ("logits_tied_odd", "qwen2_kv1", 63, ("tiled_logits",), {}),
         ("ckpt", "llama_gqa", 64, ("gradient_checkpointing",), {}),
         ("offload", "llama_gqa", 64, ("offload_activations",), {}),
         ("ckpt_every2", "llama_gqa", 64, (), {"checkpoint_every": 2}),
         ("ckpt_keep_attention", "llama_gqa", 64, ("gradient_checkpointing",), {"keep_attention": True}),
         ("keep_attention_every2_offload_mlp", "qwen2_kv1", 63, ("tiled_mlp", "offload_activations"),
          {"checkpoint_every": 2, "keep_attention": True}),
         ("every2_offload_mlp_ga2", "qwen2_kv1", 63, ("tiled_mlp", "offload_activations"),
          {"checkpoint_every": 2, "gradient_accumulation_steps": 2}),
         ("all_bs2", "llama_mha", 64, ALL, {"per_device_train_batch_size": 2}),
         ("all_tied_ga2", "qwen2_kv1", 63, ALL, {"gradient_accumulation_steps": 2})]
VOCAB = 2048  # the tiny presets'
KNOBS = {"MLP_TILE_TOKENS": 12, "LOGITS_TILE_BYTES": 10 * VOCAB * 4}  # ~12 tokens per MLP tile, ~10 per loss tile


# --- unit tests --------------------------------------------------------------------------------------

def test_tile_rules(monkeypatch):
    assert memory.agreed_tiles(0, torch.device("cpu")) == 1  # no process group: the local count, at least 1
    assert tiled_loss._spans(10, 4) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert tiled_loss._spans(9, 4) == [(0, 3), (3, 6), (6, 9), (9, 9)]  # always `tiles` calls, the last may be empty
    assert tiled_loss.logits_tiles(1, 128_000, 128_256) == math.ceil(128_000 * 128_256 * 4 / 2**30)  # ~1 GiB fp32 each
    monkeypatch.setattr(tiled_loss, "LOGITS_TILE_BYTES", 1)
    assert tiled_loss.logits_tiles(2, 5, 100) == 5  # never more tiles than tokens
    from planner.memory_model import mlp_tiles

    assert mlp_tiles(131_072, 4096) == 32  # Llama-3-8B, 128k tokens per rank: ALST's ceil(T / hidden)
    assert mlp_tiles(4096, 256) == 4  # a tiny model's tiles are floored at 1024 tokens (not 16 of 256)
    assert mlp_tiles(100, 4096) == 1 and mlp_tiles(100, 256, tile_tokens=12) == 9  # the tests' forced tile size


@pytest.mark.parametrize("tied", [False, True])
def test_tiled_cross_entropy_honours_the_incoming_gradient(tied):
    """Sum of CE equals F.cross_entropy's, and both gradients follow a factor applied after the loss
    (train_step scales the local sum), including the -100 labels and an uneven, partly empty tiling."""
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    hidden = torch.randn(2, 9, 16, requires_grad=True)
    labels = torch.randint(0, 50, (2, 9))
    labels[0, :4] = -100
    ref = F.cross_entropy(head(hidden).reshape(-1, 50), labels.reshape(-1), ignore_index=-100, reduction="sum")
    (ref * 0.37).backward()
    want_w, want_h = head.weight.grad.clone(), hidden.grad.clone()
    head.weight.grad, hidden.grad = None, None
    got = tiled_loss.TiledCrossEntropySum.apply(hidden, labels, head, 4, tied)
    (got * 0.37).backward()
    assert abs(got.item() - ref.item()) / ref.item() < 1e-6
    assert rel(head.weight.grad, want_w) < 1e-6 and rel(hidden.grad, want_h) < 1e-6
    assert head.weight.ds_grad_is_ready  # left ready for ZeRO-3 (tied: for the embedding's hook)


def test_features_on_the_plain_model(assets, monkeypatch):
    """All four features on a plain (no DeepSpeed) model give the plain model's loss and gradients."""
    from transformers import AutoModelForCausalLM

    for name, value in KNOBS.items():
        monkeypatch.setattr(memory if hasattr(memory, name) else tiled_loss, name, value)
    ids = torch.randint(4, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))
    mb = {"input_ids": ids, "position_ids": torch.arange(40).expand(2, 40),
          "shift_labels": torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)}
    results = []
    for features in ((), ALL):
        model = AutoModelForCausalLM.from_pretrained(assets["qwen2_kv1"], dtype=torch.float32, attn_implementation="sdpa")
        model.train()
        cfg = types.SimpleNamespace(**{f: f in features for f in ALL})
        memory.apply_memory_features(model, cfg)
        loss = memory.make_loss_fn(cfg)(model, mb)
        (loss * 0.5).backward()
        results.append((loss.item(), {n: p.grad for n, p in model.named_parameters()}))
    (ref_loss, ref_grads), (loss, grads) = results
    assert abs(loss - ref_loss) / ref_loss < 1e-6
    assert max(rel(grads[n], g) for n, g in ref_grads.items()) < 1e-5


def test_unsupported_model_is_a_user_error():
    from transformers import AutoConfig, AutoModelForCausalLM

    gpt2 = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match="tiled_mlp"):
        memory.apply_memory_features(gpt2, types.SimpleNamespace(tiled_mlp=True, tiled_logits=False,
                                                                 gradient_checkpointing=False, offload_activations=False))


def test_configure_allocator_keeps_the_users_setting(monkeypatch):
    for var in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:512")
    assert memory.configure_allocator() is None and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
    monkeypatch.delenv("PYTORCH_ALLOC_CONF")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "garbage_collection_threshold:0.6")
    assert memory.configure_allocator() is None
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "garbage_collection_threshold:0.6"
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    assert memory.configure_allocator() == "expandable_segments:True"
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert "expandable_segments:True" in torch._C._accelerator_getAllocatorSettings()  # torch was imported already


# --- through the engine, against the plain model -------------------------------------------------------

# layout -> (world, cases): the SP=2 launch also runs the all-feature cases at SP=1 over DP=2 (sp1dp2, one world);
# every case at SP=1 in a world of 1 is its own launch, slow (its rules: sp2 and sp1dp2 in the fast launch, and
# test_features_on_the_plain_model in this process)
FAST_SP1 = ("all_bs2", "all_tied_ga2")
# sp1dp2 before sp2 in its launch: a DeepSpeed engine at SP 1 after one at SP 2 finds DeepSpeed's groups still
# pointing at the SP 2 mpu ("sequence data parallel group is not initialized")
LAYOUTS = {"sp1dp2": (2, list(FAST_SP1)), "sp2": (2, [c[0] for c in CASES]), "sp1": (1, [c[0] for c in CASES])}
PARAMS = [pytest.param(lay, c, id=f"{c[0]}-{lay}", marks=[pytest.mark.slow] if lay == "sp1" else [])
          for c in CASES for lay in ("sp2", "sp1dp2", "sp1") if c[0] in LAYOUTS[lay][1]]


class _Launches(dict):
    """results[(layout, case name)] -> (record, stats); one launch per world, run when a case of it is first asked for."""

    def __init__(self, assets, tmp_path_factory):
        super().__init__()
        self.assets, self.tmp = assets, tmp_path_factory

    def __missing__(self, key):
        world = LAYOUTS[key[0]][0]
        d = self.tmp.mktemp(f"memory_world{world}")
        assets, cases, keys = self.assets, [], []
        for lay, (w, names) in LAYOUTS.items():
            for name, model, sl, features, extra in CASES if w == world else []:
                if name not in names:
                    continue
                cases.append({"model_name_or_path": assets[model], "dataset_path": assets["data"],
                              "max_seq_length": sl, "sequence_parallel_size": 2 if lay == "sp2" else 1,
                              "learning_rate": 1e-3, "max_steps": 1, "report_to": "none", "seed": 0,
                              "deepspeed": os.path.join(ROOT, "ds_configs/zero3_offload.json"),
                              **{f: True for f in features}, **extra, "knobs": KNOBS,
                              "out": str(d / f"{lay}_{name}.pt"), "cache": os.path.join(assets["dir"], "cache")})
                keys.append((lay, name))
        run(os.path.join(ROOT, "tests/workers/memory.py"), [json.dumps(cases)], world, str(d / "logs"))
        for k, case in zip(keys, cases):
            self[k] = (torch.load(case["out"]), torch.load(case["out"] + ".stats.pt"))
        return self[key]


@pytest.fixture(scope="module")
def results(assets, tmp_path_factory):
    return _Launches(assets, tmp_path_factory)


@pytest.mark.dist
@pytest.mark.parametrize("layout, case", PARAMS)
def test_features_match_plain_model(results, assets, layout, case):
    name, model, sl, features, extra = case
    got, stats = results[(layout, name)]
    sp = 2 if layout == "sp2" else 1
    samples = [i for r in got["indices"] for mb in r["indices"] for i in mb]
    samples = sorted(set(samples), key=samples.index)  # the SP ranks report the same samples
    ref_loss, ref_grads = reference(assets[model], assets["data"], sl, samples)
    assert abs(got["loss"] - ref_loss) / ref_loss < 1e-5, (got["loss"], ref_loss)
    assert set(got["grads"]) == set(ref_grads)
    worst = max((rel(got["grads"][n], ref_grads[n]), n) for n in ref_grads)
    assert worst[0] < 1e-4, worst

    # the features really ran, with more than one tile
    sl_local, bs = -(-sl // sp) * sp // sp, extra.get("per_device_train_batch_size", 1)
    want_mlp = {math.ceil(sl_local / KNOBS["MLP_TILE_TOKENS"])} if "tiled_mlp" in features else set()
    assert stats["mlp_tiles"] == want_mlp and all(t > 1 for t in want_mlp)
    # under ZeRO-3 the tiled MLP finds its input is the lean norm's output (through DeepSpeed's aliases) and keeps the
    # norm's input instead (model_utils/rmsnorm.norm_source), at micro-batch 1 and 2 (bs 2 used to keep its input)
    assert (stats["mlp_renorm"] > 0) == ("tiled_mlp" in features), stats["mlp_renorm"]
    tied = model == "qwen2_kv1"
    want_ce = ({(math.ceil(bs * sl_local * VOCAB * 4 / KNOBS["LOGITS_TILE_BYTES"]), tied)}
               if "tiled_logits" in features else set())
    assert stats["logits_tiles"] == want_ce and all(t > 1 for t, _ in want_ce)
    layers, ga = 2, extra.get("gradient_accumulation_steps", 1)
    every = extra.get("checkpoint_every") or (1 if {"gradient_checkpointing", "offload_activations"} & set(features) else 0)
    checkpointed = -(-layers // every) * ga if every else 0  # layers 0, K, 2K, ... per micro-step
    assert stats["checkpointed"] == checkpointed
    assert stats["offloaded"] == (checkpointed if "offload_activations" in features else 0)
    # keep_attention: each checkpointed layer's attention kernel ran once, in the forward; the recompute asked
    # for it as often and got the cached output (one sdpa call per layer here: one document per sample)
    kept = checkpointed if extra.get("keep_attention") else 0
    assert (stats["attention_saved"], stats["attention_reused"]) == (kept, kept), stats
    # a tiled MLP is one ZeRO-3 leaf: its weights are gathered per MLP forward and backward, never per tile
    # (each tile's projections re-gathered them: from the CPU with offload_param, 0.36 of the tokens/s on an H200)
    if "tiled_mlp" in features:
        assert stats["projection_fetches"] == 0 and stats["mlp_fetches"] > 0, stats
    # every saving the plan counts engaged once per layer (or loss, or checkpointed layer) and micro-batch under the
    # real ZeRO-3 engine: the step's counters equal the expectation (model_utils/engagement.py), none left out
    want = {"tiled_mlp": layers, "norm_recompute": layers, "tiled_logits": 1,
            "offload_activations": -(-layers // every) if every else 0}
    want = {k: v for k, v in want.items() if v and (k in features or k == "norm_recompute" and "tiled_mlp" in features)}
    assert stats["expected"] == want, stats["expected"]
    assert {k: stats["engaged"][k] for k in want} == {k: v * ga for k, v in want.items()}, stats["engaged"]


def test_checkpoint_every_picks_layers(assets):
    """K=2 on a 5-layer model: layers 0, 2, 4 checkpointed; --gradient_checkpointing alone is K=1."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(assets["llama_gqa"], num_hidden_layers=5))
    flags = dict(tiled_mlp=False, tiled_logits=False, gradient_checkpointing=False, offload_activations=False)
    memory.apply_memory_features(model, types.SimpleNamespace(**flags, checkpoint_every=2))
    assert [layer.gradient_checkpointing for layer in model.model.layers] == [True, False, True, False, True]
    assert memory.checkpoint_every(types.SimpleNamespace(**{**flags, "gradient_checkpointing": True})) == 1
    assert memory.checkpoint_every(types.SimpleNamespace(**flags, checkpoint_every=0)) == 0
    with pytest.raises(ValueError, match="checkpoint_every"):
        memory.checkpoint_every(types.SimpleNamespace(**flags, checkpoint_every=-1))


def test_keep_attention_runs_the_attention_kernel_once(assets):
    """--keep_attention on a plain model: the attention kernel runs once per layer (plain checkpointing runs it
    twice: forward and recompute), and loss and gradients are the plain model's, bitwise (the same ops run on
    the same inputs; only the kernel's output comes from the cache)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import AutoModelForCausalLM

    class Count(TorchDispatchMode):
        runs = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.runs += func in memory.attention_ops()
            return func(*args, **(kwargs or {}))

    ids = torch.randint(4, VOCAB, (1, 48), generator=torch.Generator().manual_seed(0))
    out = {}
    for name, ckpt, keep in (("plain", False, False), ("checkpointed", True, False), ("kept", True, True)):
        model = AutoModelForCausalLM.from_pretrained(assets["llama_gqa"], dtype=torch.float32, attn_implementation="sdpa")
        model.train()
        memory.apply_memory_features(model, types.SimpleNamespace(
            tiled_mlp=False, tiled_logits=False, gradient_checkpointing=ckpt, offload_activations=False,
            keep_attention=keep))
        Count.runs, kept = 0, dict(memory.KEPT)
        with Count():
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        out[name] = (loss.item(), grads, Count.runs, *(memory.KEPT[k] - kept[k] for k in ("saved", "reused")))
    layers = model.config.num_hidden_layers
    assert [out[n][2:] for n in out] == [(layers, 0, 0), (2 * layers, 0, 0), (layers, layers, layers)]
    assert out["kept"][0] == out["plain"][0] and torch.equal(out["kept"][1], out["plain"][1])


def test_keep_attention_needs_checkpointing():
    from planner.memory_model import Features

    with pytest.raises(ValueError, match="keep_attention"):
        Features.of({"keep_attention": True})
    assert Features.of({"keep_attention": True, "checkpoint_every": 2}).keep_attention


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_keep_attention_says_whether_the_kernel_was_kept(assets, monkeypatch, attn):
    """train.py's line after the first step: the outputs kept, or, for a backend without a known kernel (eager
    attention here; flex_attention on a GPU), that the layers recompute attention as plain checkpointing does."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setitem(memory.KEPT, "saved", 0)
    model = AutoModelForCausalLM.from_pretrained(assets["llama_gqa"], dtype=torch.float32, attn_implementation=attn)
    cfg = types.SimpleNamespace(tiled_mlp=False, tiled_logits=False, gradient_checkpointing=True,
                                offload_activations=False, keep_attention=True)
    memory.apply_memory_features(model.train(), cfg)
    ids = torch.randint(4, VOCAB, (1, 32), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    line = memory.kept_attention_line(cfg, attn)
    layers = model.config.num_hidden_layers
    if attn == "sdpa":
        assert line == f"keep_attention: {layers} attention outputs kept so far (sdpa); backward does not rerun them"
    else:
        assert line.startswith("keep_attention: no attention kernel of eager was kept")
    assert memory.kept_attention_line(types.SimpleNamespace(**{**vars(cfg), "keep_attention": False}), attn) is None


def test_keep_attention_tolerates_ops_the_forward_did_not_issue():
    """ZeRO-3 may gather (or prefetch) parameters inside a layer's recompute that the forward had already: ops the
    forward never issued. torch's own selective checkpoint indexes every op of the region and fails on them; ours
    matches only the attention kernels, so the step goes on, with the plain gradients."""
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    calls = {"n": 0}
    q, k, v = (torch.randn(1, 2, 16, 8, requires_grad=True, generator=torch.Generator().manual_seed(i)) for i in range(3))

    def layer(q, k, v):
        calls["n"] += 1
        if calls["n"] % 2 == 0:  # the recompute: one more op than the forward ran (a gather, say)
            torch.zeros(4).add_(1)
        return F.scaled_dot_product_attention(q.sin(), k, v, is_causal=True).cos().sum()

    layer(q, k, v).backward()
    want = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    kept, calls["n"] = dict(memory.KEPT), 0
    checkpoint(layer, q, k, v, use_reentrant=False, context_fn=memory.keep_attention_contexts).backward()
    assert all(torch.equal(t.grad, w) for t, w in zip((q, k, v), want))
    assert (memory.KEPT["saved"] - kept["saved"], memory.KEPT["reused"] - kept["reused"]) == (1, 1)

    def torch_policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in memory.attention_ops() else CheckpointPolicy.PREFER_RECOMPUTE

    calls["n"] = 0
    with pytest.raises(RuntimeError, match="not found in storage"):
        checkpoint(layer, q, k, v, use_reentrant=False,
                   context_fn=lambda: create_selective_checkpoint_contexts(torch_policy)).backward()
