"""The lean RMSNorm (model_utils/rmsnorm.py) against Hugging Face's own, module by module.

Under the real engine (ZeRO-3 + offload, SP=2) every family's loss and gradients are compared with the plain
model in tests/multiproc/test_model_zoo.py and tests/multiproc/test_parity.py, which run train.py's default (lean on); this file
checks the function itself: the same forward bit for bit, gradients of input and weight within rounding, with
several chunks of rows, and that only norms computing Llama's formula are replaced.
"""

from __future__ import annotations

import pytest
import torch

import planner.memory_model as mm
from model_utils.rmsnorm import LEAN_RMSNORM_CLASSES, LeanRMSNormFunction, use_lean_rmsnorm
from tests.conftest import forwards_unlike_llama


def _hf_norm(h: int, dtype, seed: int = 0):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(seed)
    norm = LlamaRMSNorm(h, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.5)  # peaked: a wrong weight gradient or a missing term shows
    return norm


def _grads(norm, x, dy):
    x = x.clone().requires_grad_()
    y = norm(x)
    y.backward(dy)
    return y.detach(), x.grad, norm.weight.grad


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-3)])
@pytest.mark.parametrize("shape", [(2, 700, 64), (1, 300, 4, 16)])  # [bs, T, h]; Qwen3's q/k norm: [bs, T, heads, d]
def test_same_forward_and_gradients_as_hf(monkeypatch, dtype, tol, shape):
    monkeypatch.setattr("planner.layer_terms.NORM_MIN_CHUNK_ROWS", 128)  # several chunks, the last one short
    assert mm.norm_chunk_rows(shape[0] * shape[1] * (shape[2] if len(shape) == 4 else 1), shape[-1]) < 1200
    h = shape[-1]
    ref, lean = _hf_norm(h, dtype), _hf_norm(h, dtype)
    assert use_lean_rmsnorm(lean) == 1
    torch.manual_seed(1)
    x = (torch.randn(shape) * torch.rand(shape[:-1] + (1,)) * 4).to(dtype)  # rows of different scales
    dy = torch.randn(shape).to(dtype)
    y0, dx0, dw0 = _grads(ref, x, dy)
    y1, dx1, dw1 = _grads(lean, x, dy)
    assert torch.equal(y0, y1)  # the same ops in the same order, row by row
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
    print(f"{dtype} {shape}: dx rel err {rel(dx1, dx0):.1e}, dw rel err {rel(dw1, dw0):.1e}")
    assert rel(dx1, dx0) < tol and rel(dw1, dw0) < tol
    # the oracle can see a wrong backward: without the mean term (d rstd / dx) dx is far off
    wrong = (dy.float() * ref.weight.float()) * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)
    assert rel(wrong, dx0) > 10 * tol, rel(wrong, dx0)


def test_gradcheck_in_float64(monkeypatch):
    monkeypatch.setattr("planner.layer_terms.NORM_MIN_CHUNK_ROWS", 3)
    torch.manual_seed(0)
    x = torch.randn(2, 5, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, dtype=torch.float64, requires_grad=True)
    # forward upcasts to fp32 inside (as HF does), so check against the fp32 formula with loose tolerances
    assert torch.autograd.gradcheck(lambda a, b: LeanRMSNormFunction.apply(a, b, 1e-5), (x, w), eps=1e-3, atol=1e-3,
                                    rtol=1e-2)


def test_every_listed_class_computes_llamas_formula():
    """A family is listed only while its RMSNorm.forward is LlamaRMSNorm.forward character for character."""
    assert set(LEAN_RMSNORM_CLASSES) == mm.LEAN_RMSNORM_MODEL_TYPES
    assert forwards_unlike_llama(LEAN_RMSNORM_CLASSES, "LlamaRMSNorm") == []


@pytest.mark.parametrize("model_type", ["gemma", "olmo2"])
def test_other_formulas_are_left_alone(model_type):
    """Gemma's norm scales by 1 + w in fp32, OLMo-2's casts after the weight: not replaced, HF's runs."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    model = AutoModelForCausalLM.from_config(cfg)
    assert use_lean_rmsnorm(model) == 0
    shape = mm.ModelShape.from_config(cfg.to_dict())
    assert not mm.lean_norm_applies(shape, mm.Features(lean_rmsnorm=True))


def test_chunk_rule():
    assert mm.norm_chunk_rows(131072, 4096) == 4096  # Llama-3-8B at 128k per rank: 64 MiB fp32 per temporary
    assert mm.norm_chunk_rows(16384, 256) == 2048  # tiny models: 8 chunks
    assert mm.norm_chunk_rows(500, 256) == 500  # one chunk
    assert mm.norm_chunk_rows(0, 256) == 1


@pytest.mark.parametrize("on", [True, False])
def test_the_flag_decides(on):
    """apply_memory_features follows --lean_rmsnorm (train.py's default: on); the planner follows the same flag."""
    import types

    from transformers import AutoModelForCausalLM

    from model_utils import rmsnorm
    from model_utils.build import preset_config
    from model_utils.memory import apply_memory_features

    model = AutoModelForCausalLM.from_config(preset_config("tiny-llama"))
    apply_memory_features(model, types.SimpleNamespace(tiled_mlp=False, tiled_logits=False, gradient_checkpointing=False,
                                                       checkpoint_every=0, offload_activations=False, lean_rmsnorm=on))
    norms = [m for m in model.modules() if type(m).__name__ == "LlamaRMSNorm"]
    lean = [m for m in norms if getattr(m.forward, "__func__", None) is rmsnorm._lean_forward]
    assert len(norms) == 5 and len(lean) == (5 if on else 0)  # 2 per layer + the final norm
    shape = mm.load_shape("tiny-llama")
    assert mm.lean_norm_applies(shape, mm.Features(lean_rmsnorm=on)) == on
    from training.config import Config

    assert Config().lean_rmsnorm  # the default
