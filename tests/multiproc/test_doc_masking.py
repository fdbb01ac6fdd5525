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

import pytest
import torch

from base.parallel import ParallelDims
from tests.distributed import ROOT, run
from tests.multiproc.doc_assets import DOC_LENS, SMALL, made_once, save_config_model, write_documents  # noqa: F401
from tests.multiproc.joint_launch import ASSETS, WORLD2, by_name

SEQ = 96  # SP=4 shards of 24 tokens: documents [0,37) [37,48) [48,77) [77,..) cross 24 and 72
LOSS_TOL, GRAD_TOL = 1e-5, 1e-4
ONE_RANK = ParallelDims(world=1, sp=1, rank=0, local_rank=0)


# sliding-window models: windows smaller (8) and larger (30) than an SP=4 shard (24), Gemma-3 and Qwen2 with
# local and global layers
WINDOWED = {"mistral8": ("mistral", dict(sliding_window=8)), "mistral30": ("mistral", dict(sliding_window=30)),
            "gemma3": ("gemma3_text", dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"])),
            "qwen2mix": ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1))}


def docs_assets_of(tmp_path_factory) -> dict:
    """The documents and models, made once (also by the joint launch, before this module's first test asks)."""
    return made_once(ASSETS, "docs", tmp_path_factory, WINDOWED)


@pytest.fixture(scope="module")
def docs_assets(tmp_path_factory):
    return docs_assets_of(tmp_path_factory)


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


# (name, model, attn, micro-batch, gradients?, bypass?) per launch; flex_attention: forward only on CPU
DOC_CASES = [("sdpa_mb1", "llama", "sdpa", 1, True, False), ("sdpa_mb2", "llama", "sdpa", 2, True, False),
             ("flex_mb2", "llama", "flex_attention", 2, False, False)]
BYPASS = ("bypass", "llama", "sdpa", 1, False, True)
CHECKPOINTED = {"sdpa_mb2", "mistral8_mb2"}  # activation checkpointing: every layer's attention runs twice
# headwise-chunked attention (model_utils/head_chunks.py; extra config as a 7th field): 4 chunks = every head alone
# at SP 1 (a chunk narrower than its GQA group: the KV head projected per chunk), 2 = every local head at SP 2
# (one KV head per chunk, replicated over the 2 ranks), with checkpointing + keep_attention, tiled MLP + logits
CKPT_KEEP = {"gradient_checkpointing": True, "keep_attention": True}
CHUNKED = {1: [("chunks4_ckpt", "llama", "sdpa", 2, True, False, {"attention_head_chunks": 4, **CKPT_KEEP}),
               ("chunks2_tiled", "llama", "sdpa", 1, True, False,
                {"attention_head_chunks": 2, "tiled_mlp": True, "tiled_logits": True})],
           2: [("chunks2_ckpt", "llama", "sdpa", 2, True, False, {"attention_head_chunks": 2, **CKPT_KEEP}),
               ("chunks2_tiled", "llama", "sdpa", 1, True, False,
                {"attention_head_chunks": 2, "tiled_mlp": True, "tiled_logits": True, "gradient_checkpointing": True})]}
WINDOW_CASES = {2: [("mistral8_mb2", "mistral8", "sdpa", 2, True, False), ("gemma3", "gemma3", "sdpa", 1, True, False),
                    ("qwen2mix", "qwen2mix", "sdpa", 1, True, False),
                    ("mistral8_chunks2", "mistral8", "sdpa", 2, True, False,
                     {"attention_head_chunks": 2, "gradient_checkpointing": True})],
                4: [("mistral30", "mistral30", "sdpa", 1, True, False),
                    ("mistral30_flex", "mistral30", "flex_attention", 1, False, False)]}


def doc_cases(assets, d, sp: int, specs: list[tuple]) -> list[dict]:
    """The worker's cases, each writing `<d>/<name>.pt` (extra config: a 7th field)."""
    return [{"model_name_or_path": assets[model], "dataset_path": assets["data"], "max_seq_length": SEQ,
             "sequence_parallel_size": sp, "per_device_train_batch_size": mb, "attn_implementation": attn,
             "reset_position_ids": "yes", "learning_rate": 1e-3, "max_steps": 1, "report_to": "none", "seed": 0,
             "deepspeed": os.path.join(ROOT, "ds_configs/zero3_offload.json"), "samples": [0, 1][:mb], "grads": grads,
             "bypass": bypass, "out": str(d / f"{name}.pt"), "cache": os.path.join(assets["dir"], "cache"),
             **({"gradient_checkpointing": True} if name in CHECKPOINTED else {}), **(extra[0] if extra else {})}
            for name, model, attn, mb, grads, bypass, *extra in specs]


DOC_SPECS = {sp: DOC_CASES + ([BYPASS] if sp == 2 else []) + CHUNKED.get(sp, []) for sp in (1, 2, 4)}
# the SP=2 documents launch is shared with other modules' fast cases (one start-up: tests/multiproc/joint_launch.py)
WORLD2.join("docs", __name__, "tests/workers/doc_masking.py",
            lambda assets, factory, d: doc_cases(docs_assets_of(factory), d, 2, DOC_SPECS[2]),
            ("test_documents_match_plain_model_alone",))


def launch(assets, tmp_path_factory, key: str, sp: int, specs: list[tuple], session_assets=None) -> dict:
    """One multi-process run per (kind, SP degree), every case of it in one launch (each read by one test)."""
    if (key, sp) == ("docs", 2):
        return by_name(WORLD2.launched("docs", session_assets, tmp_path_factory))
    d = tmp_path_factory.mktemp(f"{key}_sp{sp}")
    cases = doc_cases(assets, d, sp, specs)
    run(os.path.join(ROOT, "tests/workers/doc_masking.py"), [json.dumps(cases)], sp, str(d / "logs"))
    return by_name(cases)


def check_against_oracle(assets, sp: int, got: dict) -> None:
    for name, (res, case) in got.items():
        if case["bypass"]:
            continue
        model = next(k for k, v in assets.items() if v == case["model_name_or_path"])
        ref_loss, ref_grads = reference(case["model_name_or_path"], packed(assets, case["samples"]))
        assert res["error"] is None, (name, res["error"])
        # one micro-batch: its documents built once, not in every layer (2) nor again in the recompute; head chunks:
        # one call per chunk, and once more per chunk in backward (it recomputes the chunk from its projections)
        n = case.get("attention_head_chunks", 1)
        calls = 2 * (1 + bool(case.get("gradient_checkpointing"))) * n + (2 * n if n > 1 and case["grads"] else 0)
        assert res["builds"] == 1 and res["calls"] == calls, (name, res, calls)
        worst = max((rel(res["grads"][n], ref_grads[n]), n) for n in res["grads"]) if res["grads"] else (0.0, "")
        print(f"sp={sp} {name} ({model}, {case['attn_implementation']}, mb={len(case['samples'])}): loss rel err "
              f"{abs(res['loss'] - ref_loss) / ref_loss:.2e}, worst grad rel err {worst[0]:.2e}")
        assert abs(res["loss"] - ref_loss) / ref_loss < LOSS_TOL, (name, res["loss"], ref_loss)
        if case["grads"]:
            assert set(res["grads"]) == set(ref_grads)
            assert worst[0] < GRAD_TOL, (name, worst)


@pytest.mark.dist
@pytest.mark.parametrize("sp", [pytest.param(1, marks=pytest.mark.slow), 2,  # SP=1: ~100 s
                                pytest.param(4, marks=pytest.mark.slow)])  # 4 ranks on 2 cores: 70 s
def test_documents_match_plain_model_alone(docs_assets, tmp_path_factory, assets, sp):
    got = launch(docs_assets, tmp_path_factory, "docs", sp, DOC_SPECS[sp], assets)
    check_against_oracle(docs_assets, sp, got)
    if sp == 2:  # a layer whose attention skips ALL_ATTENTION_FUNCTIONS is refused after the first forward
        error = got["bypass"][0]["error"]
        assert error and "LlamaForCausalLM: 1 of its 2 attention layers" in error, error


@pytest.mark.dist
@pytest.mark.slow  # ~100-200 s; windows under SP stay fast in test_model_zoo (gpt_oss: windows 16 / full, sinks)
@pytest.mark.parametrize("sp", [2, 4])
def test_sliding_windows_match_plain_model_alone(docs_assets, tmp_path_factory, sp):
    check_against_oracle(docs_assets, sp, launch(docs_assets, tmp_path_factory, "windows", sp, WINDOW_CASES[sp]))


@pytest.mark.slow  # ~45 s: the far-from-oracle check of the slow windows test
def test_window_dropped_is_far_from_the_oracle(docs_assets):
    """Losing the window (what Ulysses on sdpa did) misses the windowed oracle by > 100x the tolerance."""
    from transformers import AutoConfig

    samples = packed(docs_assets, [0, 1])
    for name in ("mistral8", "mistral30"):
        ref_loss, _ = reference(docs_assets[name], samples)
        path = docs_assets[name] + "_nowindow"
        if not os.path.isdir(path):
            import shutil

            shutil.copytree(docs_assets[name], path)
            cfg = AutoConfig.from_pretrained(path)
            cfg.sliding_window = None
            cfg.save_pretrained(path)
        bad_loss, _ = reference(path, samples)
        print(f"{name} without its window: loss rel gap {abs(bad_loss - ref_loss) / ref_loss:.2e}")
        assert abs(bad_loss - ref_loss) / ref_loss > 100 * LOSS_TOL, (name, bad_loss, ref_loss)


# ---- the pieces, in one process ---------------------------------------------------------------------------

def dense_reference(q, k, v, doc, window):
    """Causal attention within each document (and window) through one dense [sl, sl] mask: [bs, sl, hq, hd]."""
    sl = q.shape[2]
    i = torch.arange(sl)
    mask = (doc[:, :, None] == doc[:, None, :]) & (i[None, :, None] >= i[None, None, :])
    if window:
        mask &= (i[None, :, None] - i[None, None, :]) < window
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None]).transpose(1, 2)


BOUNDS = [[0, 3, 40, 41, 150, 300], [0, 300]]  # a 1-token document, short ones grouped, long ones alone


class _Attn(torch.nn.Module):
    num_key_value_groups, is_causal, training = 2, True, True


@pytest.mark.parametrize("window", [None, 7, 50, 400])
def test_sdpa_pieces_equal_dense_mask(monkeypatch, window):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from model_utils import attention

    monkeypatch.setattr(attention, "BLOCK", 32)  # short documents grouped, long ones chunked by the window
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 300, 16), torch.randn(2, 2, 300, 16), torch.randn(2, 2, 300, 16)
    pos = torch.stack([torch.cat([torch.arange(e - s) for s, e in zip(b[:-1], b[1:])]) for b in BOUNDS])
    fn = attention.document_masked("sdpa", sdpa_attention_forward)
    out, _ = fn(_Attn(), q, k, v, None, position_ids=pos, sliding_window=window)
    want = dense_reference(q, k, v, attention._doc_ids(BOUNDS, 2, 300, "cpu"), window)
    assert (out - want).abs().max() < 1e-5
    for b in BOUNDS:  # the pieces cover every query once, in order, and never cross a document without a mask
        pieces = attention.sdpa_pieces(b, window, 32)
        assert [p[0] for p in pieces[1:]] == [p[1] for p in pieces[:-1]] and pieces[-1][1] == 300


def test_monotonic_positions_are_one_plain_causal_call():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from model_utils import attention

    calls = []

    def spy(module, q, k, v, mask, **kw):
        calls.append(mask)
        return sdpa_attention_forward(module, q, k, v, mask, **kw)

    q, k, v = torch.randn(2, 4, 64, 16), torch.randn(2, 2, 64, 16), torch.randn(2, 2, 64, 16)
    out, _ = attention.document_masked("sdpa", spy)(_Attn(), q, k, v, None, position_ids=torch.arange(64)[None])
    assert calls == [None]
    assert (out - sdpa_attention_forward(_Attn(), q, k, v, None)[0]).abs().max() == 0


@pytest.mark.parametrize("window", [None, 50, 255, 300, 383])  # 255, 383: farthest pair at `window`: partial
def test_flex_block_mask_equals_create_block_mask(window):
    from torch.nn.attention.flex_attention import create_block_mask

    from model_utils import attention

    bounds = [[0, 3, 300, 301, 700], [0, 130, 700]]
    doc = attention._doc_ids(bounds, 2, 700, "cpu")

    def mask_mod(b, h, q, k):
        keep = (doc[b, q] == doc[b, k]) & (q >= k)
        return keep & (q - k < window) if window else keep

    ours = attention.doc_block_mask(doc, window)
    theirs = create_block_mask(mask_mod, 2, None, 700, 700, device="cpu")
    assert torch.equal(ours.to_dense(), theirs.to_dense())  # the same blocks visited
    full = lambda m: m.full_kv_num_blocks.sum().item()  # noqa: E731
    assert full(ours) <= full(theirs)  # whole blocks skip the mask_mod; the padded tail stays partial
    assert full(ours) > 0 or window < 2 * 128  # a whole block lies under the diagonal: its farthest pair 255+ apart


def test_flex_forward_equals_dense_mask():
    """Compiled flex_attention over the BlockMask (forward only: no flex backward on CPU in torch 2.13)."""
    from transformers.integrations.flex_attention import flex_attention_forward

    from model_utils import attention

    torch.manual_seed(0)
    bounds = [[0, 3, 300, 301, 700], [0, 130, 700]]
    pos = torch.stack([torch.cat([torch.arange(e - s) for s, e in zip(b[:-1], b[1:])]) for b in bounds])
    q, k, v = torch.randn(2, 4, 700, 16), torch.randn(2, 2, 700, 16), torch.randn(2, 2, 700, 16)
    out, _ = attention.document_masked("flex_attention", flex_attention_forward)(
        _Attn().eval(), q, k, v, None, position_ids=pos, sliding_window=200)
    want = dense_reference(q, k, v, attention._doc_ids(bounds, 2, 700, "cpu"), 200)
    assert (out - want).abs().max() < 1e-5


def bypass_attention(attn_module) -> None:
    """Make one attention module call torch's sdpa through transformers' function directly, never through
    ALL_ATTENTION_FUNCTIONS (as a model with its own attention code would)."""
    import sys
    from types import SimpleNamespace
    from unittest import mock

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    modeling = sys.modules[type(attn_module).__module__]
    forward = type(attn_module).forward
    direct = SimpleNamespace(get_interface=lambda name, default: sdpa_attention_forward)

    def bypass(self, *args, **kwargs):
        with mock.patch.object(modeling, "ALL_ATTENTION_FUNCTIONS", direct):
            return forward(self, *args, **kwargs)

    attn_module.forward = bypass.__get__(attn_module)


def test_bypassing_attention_is_refused():
    """SP=1 in one process (the SP=2 case is in test_documents_match_plain_model_alone)."""
    from transformers import AutoModelForCausalLM

    from model_utils import attention, ulysses
    from model_utils.build import preset_config

    model = AutoModelForCausalLM.from_config(preset_config("tiny-llama"), dtype=torch.float32,
                                             attn_implementation="sdpa")
    ids = torch.randint(0, 2048, (1, 32))
    try:
        ulysses.register(model, ONE_RANK, "sdpa", 1)
        model(input_ids=ids, position_ids=torch.arange(32)[None])
        ulysses.check_routed(model)  # every layer went through it
        attention.track(model, "sdpa")
        bypass_attention(model.model.layers[1].self_attn)
        model(input_ids=ids, position_ids=torch.arange(32)[None])
        with pytest.raises(ValueError, match="LlamaForCausalLM: 1 of its 2 attention layers"):
            ulysses.check_routed(model)
    finally:
        attention.restore()


def test_unsupported_layer_types_are_refused():
    from transformers import AutoModelForCausalLM

    from model_utils import families
    from model_utils.build import preset_config

    model = AutoModelForCausalLM.from_config(preset_config("tiny-llama"), dtype=torch.float32)
    model.config.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(ValueError, match=r"LlamaForCausalLM: layer types \['linear_attention'\]"):
        families.check_supported(model, "sdpa")
    model.config.layer_types = None
    with pytest.raises(ValueError, match="attention 'eager' cannot be document-masked"):
        families.check_supported(model, "eager")


# ---- documents built once per micro-batch (model_utils/attention.Documents) -------------------------------

def _count_builds(monkeypatch) -> dict:
    """Count Documents builds and their host syncs (the one `.nonzero().tolist()` of each) from now on."""
    from model_utils import attention

    counts = {"builds": 0, "syncs": 0}

    class Counted(attention.Documents):
        def __init__(self, *args, **kwargs):
            counts["builds"] += 1
            super().__init__(*args, **kwargs)

        def host_starts(self):
            counts["syncs"] += self._flat is None
            return super().host_starts()

    monkeypatch.setattr(attention, "Documents", Counted)
    return counts


@pytest.mark.parametrize("attn", ["sdpa", pytest.param("flex_attention", marks=pytest.mark.slow)])  # flex: ~65 s
def test_documents_built_once_per_micro_batch(monkeypatch, attn):
    """A 4-layer model with activation checkpointing: per micro-batch ONE Documents build and at most one host
    sync (none for flex), although attention runs 8 times (4 layers + their recompute); a second micro-batch of
    another layout builds its own, and both match the plain model run on each document alone."""
    from transformers import AutoModelForCausalLM

    from model_utils import attention, ulysses
    from model_utils.build import preset_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(preset_config("tiny-llama", num_hidden_layers=4, initializer_range=0.3),
                                             dtype=torch.float32, attn_implementation=attn)
    layouts = [[0, 37, 48, 77, 96], [0, 5, 60, 96]]
    batches = []
    for cuts in layouts:
        ids = torch.randint(4, 2048, (1, 96))
        pos = torch.cat([torch.arange(e - s) for s, e in zip(cuts[:-1], cuts[1:])])[None]
        with torch.no_grad():
            want = torch.cat([model(input_ids=ids[:, s:e]).logits for s, e in zip(cuts[:-1], cuts[1:])], dim=1)
        batches.append((ids, pos, want))
    counts = _count_builds(monkeypatch)
    try:
        ulysses.register(model, ONE_RANK, attn, 1)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        for k, (ids, pos, want) in enumerate(batches, 1):
            calls = attention._STATE["calls"]
            if attn == "flex_attention":  # no flex backward on CPU: a forward (its recompute is a backward's)
                with torch.no_grad():
                    logits = model(input_ids=ids, position_ids=pos).logits
            else:
                logits = model(input_ids=ids, position_ids=pos).logits
                logits.float().pow(2).mean().backward()
                assert attention._STATE["calls"] - calls == 8  # 4 layers, each recomputed in backward
            assert counts["builds"] == k, counts
            assert counts["syncs"] == (0 if attn == "flex_attention" else k), counts
            assert (logits - want).abs().max() < 1e-4
    finally:
        attention.restore()


def test_documents_follow_the_position_ids_tensor(monkeypatch):
    """The cache key is the position-ids tensor object and its version: the same tensor reuses, an in-place edit
    or another tensor of equal content rebuilds; under Ulysses the outermost call's (local) tensor is the key."""
    from model_utils import attention

    counts = _count_builds(monkeypatch)
    pos = torch.cat([torch.arange(10), torch.arange(6)])[None]
    a = attention.documents_for(pos, 1)
    assert attention.documents_for(pos, 1) is a and counts["builds"] == 1
    assert a.bounds == [[0, 10, 16]] and a.doc.tolist() == [[0] * 10 + [1] * 6]
    assert attention.documents_for(pos.clone(), 1) is not a and counts["builds"] == 2
    assert attention.documents_for(pos, 2).bounds == [[0, 10, 16]] * 2  # another micro-batch size
    pos[0, 12:] = torch.arange(4)  # in place: a third document
    assert attention.documents_for(pos, 1).bounds == [[0, 10, 12, 16]]
    local = pos[:, :8].clone()  # under SP: the gathered tensor is new in every layer, the local one is not
    attention._OUTER.append(local)
    try:
        first = attention.documents_for(pos.clone(), 1)
        assert attention.documents_for(pos.clone(), 1) is first
    finally:
        attention._OUTER.pop()
        attention._DOCS.clear()
    cu, longest = first.varlen()
    assert cu.tolist() == [0, 10, 12, 16] and longest == 10
    assert attention.Documents(torch.arange(16)[None], 2).bounds is None
    assert attention.Documents(torch.arange(16)[None], 2).varlen()[0].tolist() == [0, 16, 32]


def test_auto_resets_positions_wherever_documents_are_masked():
    """`reset_position_ids: auto` is yes for exactly the backends check_config accepts (all of them mask documents),
    not flash-attention only; yes / no win; anything else is refused."""
    from model_utils import attention, families
    from model_utils.build import preset_config

    config = preset_config("tiny-llama")
    for attn in ("sdpa", "flex_attention", "flash_attention_2", "flash_attention_3", "eager"):
        try:
            families.check_config(config, attn)
            masked = True
        except ValueError:
            masked = False
        assert attention.resets_positions("auto", attn) is masked, attn
        assert attention.resets_positions("yes", attn) is True and attention.resets_positions("no", attn) is False
    assert attention.resets_positions("auto", "sdpa") and attention.resets_positions("auto", "flex_attention")
    with pytest.raises(ValueError, match="--reset_position_ids 'maybe': use auto, yes or no"):
        attention.resets_positions("maybe", "sdpa")
