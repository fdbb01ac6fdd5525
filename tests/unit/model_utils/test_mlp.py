"""The lean gated MLP (model_utils/mlp.py) against Hugging Face's own, module by module.

Under the real engine (ZeRO-3 + offload, SP=2) every family's loss and gradients are compared with the plain
model in tests/multiproc/test_model_zoo.py and tests/multiproc/test_parity.py, which run train.py's default (lean on); this file
checks the function itself: the same forward bit for bit, the same gradients (elementwise kernels run on chunks
of rows), what it keeps for backward, and that only MLPs computing Llama's formula are replaced.
"""

from __future__ import annotations

import importlib
import types

import pytest
import torch

import planner.memory_model as mm
from model_utils.mlp import LEAN_MLP_CLASSES, GatedProductFunction, use_lean_mlp
from tests.conftest import forwards_unlike_llama


def _hf_mlp(model_type: str, dtype, h: int = 64, inter: int = 176):
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(model_type, hidden_size=h, intermediate_size=inter, hidden_act="silu",
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=64)
    mod = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    torch.manual_seed(0)
    mlp = getattr(mod, LEAN_MLP_CLASSES[model_type])(cfg).to(dtype)
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0.0, 0.3)  # peaked: act'(gate) far from its value at 0, so a wrong d(gate) shows
    return mlp


def _grads(mlp, x, dy):
    x = x.clone().requires_grad_()
    y = mlp(x)
    y.backward(dy)
    return y.detach(), x.grad, [p.grad.clone() for p in mlp.parameters()]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-3)])
@pytest.mark.parametrize("model_type", ["llama", "gemma"])  # silu, and gemma's gelu_pytorch_tanh
def test_same_forward_and_gradients_as_hf(monkeypatch, dtype, tol, model_type):
    monkeypatch.setattr("planner.layer_terms.NORM_MIN_CHUNK_ROWS", 128)  # several chunks of rows, the last one short
    ref, lean = _hf_mlp(model_type, dtype), _hf_mlp(model_type, dtype)
    assert use_lean_mlp(lean) == 1
    torch.manual_seed(1)
    x, dy = torch.randn(2, 700, 64).to(dtype), torch.randn(2, 700, 64).to(dtype)
    y0, dx0, g0 = _grads(ref, x, dy)
    y1, dx1, g1 = _grads(lean, x, dy)
    assert torch.equal(y0, y1)  # the same two ops on the same tensors
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
    errs = [rel(dx1, dx0)] + [rel(a, b) for a, b in zip(g1, g0)]
    print(f"{model_type} {dtype}: dx, d(gate/up/down) rel errs {[f'{e:.1e}' for e in errs]}")
    assert max(errs) < tol
    # the oracle can see a wrong backward: dx with act'(gate) taken as 1 is far off
    with torch.no_grad():
        xf, dyf = x.float(), dy.float()
        wg, wu, wd = (m.weight.float() for m in (ref.gate_proj, ref.up_proj, ref.down_proj))
        gate, up, dprod = xf @ wg.T, xf @ wu.T, dyf @ wd
        wrong = (dprod * up) @ wg + (dprod * ref.act_fn(gate)) @ wu
    assert rel(wrong, dx0) > 10 * tol, rel(wrong, dx0)


def test_keeps_gate_and_up_only():
    """What autograd keeps for backward: HF's MLP 4 [T, I] tensors (+ x), the lean one 3 (+ x)."""
    inter, T = 176, 300
    kept = {}
    for lean in (False, True):
        mlp = _hf_mlp("llama", torch.float32)
        if lean:
            use_lean_mlp(mlp)
        seen = {}

        def pack(t, seen=seen):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        x = torch.randn(1, T, 64, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = mlp(x)
        params = {p.untyped_storage().data_ptr() for p in mlp.parameters()}
        kept[lean] = sum(n for ptr, n in seen.items() if ptr not in params and ptr != x.untyped_storage().data_ptr())
        y.sum().backward()
    assert kept[False] == 4 * T * inter * 4 and kept[True] == 3 * T * inter * 4, kept


def test_gradcheck_in_float64(monkeypatch):
    monkeypatch.setattr("planner.layer_terms.NORM_MIN_CHUNK_ROWS", 3)
    torch.manual_seed(0)
    gate = torch.randn(2, 5, 6, dtype=torch.float64, requires_grad=True)
    up = torch.randn(2, 5, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: GatedProductFunction.apply(a, b, torch.nn.functional.silu), (gate, up))


def test_every_listed_class_computes_llamas_formula():
    """A family is listed only while its MLP.forward is LlamaMLP.forward character for character."""
    assert set(LEAN_MLP_CLASSES) == mm.LEAN_MLP_MODEL_TYPES
    assert forwards_unlike_llama(LEAN_MLP_CLASSES, "LlamaMLP") == []


def test_other_mlps_are_left_alone():
    """Phi-3's MLP (one fused gate_up_proj) is not Llama's formula: not replaced, HF's runs, the planner knows."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("phi3", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=1, pad_token_id=0, bos_token_id=1,
                               eos_token_id=2)
    model = AutoModelForCausalLM.from_config(cfg)
    assert use_lean_mlp(model) == 0
    assert not mm.lean_mlp_applies(mm.ModelShape.from_config(cfg.to_dict()), mm.Features(lean_mlp=True))


@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("on", [True, False])
def test_the_flag_decides(monkeypatch, on, tiled):
    """apply_memory_features follows --lean_mlp (train.py's default: on), with and without --tiled_mlp (whose
    tiles then run the lean forward); the planner follows the same flag: one [T, I] per layer."""
    from transformers import AutoModelForCausalLM

    from model_utils import memory, mlp
    from model_utils.build import preset_config
    from training.config import Config

    monkeypatch.setattr(memory, "MLP_TILE_TOKENS", 16)
    model = AutoModelForCausalLM.from_config(preset_config("tiny-llama"))
    memory.apply_memory_features(model, types.SimpleNamespace(
        tiled_mlp=tiled, tiled_logits=False, gradient_checkpointing=False, checkpoint_every=0,
        offload_activations=False, lean_rmsnorm=False, lean_mlp=on))
    mlps = [m for m in model.modules() if type(m).__name__ == "LlamaMLP"]
    calls = []
    monkeypatch.setattr(mlp.GatedProductFunction, "apply", lambda *a: calls.append(1) or a[2](a[0]) * a[1])
    model(input_ids=torch.randint(0, 64, (1, 40))).logits.sum()
    assert len(calls) == (len(mlps) * (3 if tiled else 1) if on else 0), len(calls)  # tiled: 40 tokens in 3 tiles
    shape = mm.load_shape("tiny-llama")
    assert mm.lean_mlp_applies(shape, mm.Features(lean_mlp=on)) == on
    off = mm.layer_activations(shape, 1000, 1, 2, tiled_mlp=False)[0]
    assert off - mm.layer_activations(shape, 1000, 1, 2, tiled_mlp=False, lean_mlp=True)[0] == 1000 * shape.intermediate_size * 2
    assert Config().lean_mlp  # the default
