"""The tiled MLP (model_utils/memory._tile_mlps) on dense MLPs that are not Llama's gate/up/down_proj: Phi-3's fused
gate_up_proj (through the lean-RMSNorm path, NormTiledMLP), Starcoder2's c_fc/c_proj, Phi's fc1/fc2, Nemotron's
up/down_proj (through DeepSpeed's TiledMLP). `memory_features: auto` offers tiled_mlp to every dense family, and these
were refused at the stage's engine, after the earlier stages had trained. Oracle: the loss and every gradient of the
untiled model (fp32, peaked weights, several tiles, micro-batch 2). An MLP's own dropout (Starcoder2's
residual_dropout) is replayed in backward's recompute; MoE blocks and tuple-returning MLPs are refused in one line."""

from __future__ import annotations

import types

import pytest
import torch

from model_utils import engagement, memory
from planner.memory_model import mlp_tiles

T, H = 40, 64


def _opts(tiled: bool, checkpointed: bool = False):
    return types.SimpleNamespace(tiled_mlp=tiled, tiled_logits=False, gradient_checkpointing=checkpointed,
                                 checkpoint_every=0,
                                 offload_activations=False, lean_rmsnorm=True, lean_mlp=True)


def _model(model_type: str, tiled: bool, checkpointed: bool = False, **kw):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, hidden_size=H, intermediate_size=176, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=96, pad_token_id=0,
                               bos_token_id=1, eos_token_id=2, **kw)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float().train()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)  # peaked: activations far from linear, a wrong tile's gradient shows
    memory.apply_memory_features(model, _opts(tiled, checkpointed))
    return model


def _loss_and_grads(model, seed: int = 0):
    ids = torch.randint(3, 96, (2, T), generator=torch.Generator().manual_seed(1))
    mb = {"input_ids": ids, "position_ids": torch.arange(T).expand(2, T), "shift_labels": ids.roll(-1, 1)}
    torch.manual_seed(seed)  # the same draws for both models' dropout
    loss = memory.make_loss_fn(_opts(False))(model, mb)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _rel(a, b) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("model_type,norm_path", [("phi3", True), ("starcoder2", False), ("phi", False),
                                                  ("nemotron", False)])
def test_dense_layouts_tile_with_the_untiled_gradients(monkeypatch, model_type, norm_path):
    monkeypatch.setattr(memory, "MLP_TILE_TOKENS", 16)  # 80 rows (bs 2 x 40) in 3 tiles, the last short
    norm_calls = []
    monkeypatch.setattr(memory.NormTiledMLP, "apply", lambda *a, _f=memory.NormTiledMLP.apply: norm_calls.append(1)
                        or _f(*a))
    loss0, g0 = _loss_and_grads(_model(model_type, tiled=False))
    engagement.reset()
    tiled = _model(model_type, tiled=True)
    assert all(hasattr(layer.mlp, "_untiled_forward") for layer in tiled.get_decoder().layers)
    loss1, g1 = _loss_and_grads(tiled)
    assert engagement._ENGAGED["tiled_mlp"] == 2  # both layers' MLPs ran tiled
    assert bool(norm_calls) == norm_path  # Phi-3's RMSNorm is lean: the tiled MLP keeps the norm's input instead
    assert g0.keys() == g1.keys() and len(g0) == len(list(tiled.parameters()))
    errs = {n: _rel(g1[n], g0[n]) for n in g0}
    print(f"{model_type}: loss rel err {_rel(loss1, loss0):.1e}, worst grad {max(errs.values()):.1e}")
    assert _rel(loss1, loss0) < 1e-6
    assert max(errs.values()) < 1e-5, sorted(errs.items(), key=lambda kv: -kv[1])[:3]


def _tiled_in_plain_autograd(mlp, x):
    """The reference for an MLP with dropout: the same row tiles in the same order, no recompute (the draws the
    tiled forward makes, kept by autograd)."""
    rows = x.reshape(-1, x.shape[-1])
    tiles = mlp_tiles(x.shape[-2], x.shape[-1], memory.MLP_TILE_TOKENS)
    return torch.cat([mlp._plain(t) for t in torch.chunk(rows, tiles, dim=0)]).view(x.shape)


@pytest.mark.parametrize("checkpointed", [False, True])
def test_mlp_dropout_is_replayed_in_backward(monkeypatch, checkpointed):
    """Starcoder2 checkpoints train with residual_dropout (0.1) inside the MLP: backward's recompute of each tile must
    draw the forward's mask, or the gradients are those of another output than the loss's (also with the layer
    checkpointed: its recompute runs the tiles' forward again, under the RNG state torch's checkpoint restored)."""
    monkeypatch.setattr(memory, "MLP_TILE_TOKENS", 16)
    ref = _model("starcoder2", tiled=False, residual_dropout=0.1)
    for layer in ref.get_decoder().layers:
        layer.mlp._plain = layer.mlp.forward
        layer.mlp.forward = types.MethodType(_tiled_in_plain_autograd, layer.mlp)
    loss0, g0 = _loss_and_grads(ref)
    loss1, g1 = _loss_and_grads(_model("starcoder2", tiled=True, checkpointed=checkpointed, residual_dropout=0.1))
    assert _rel(loss1, loss0) < 1e-6  # the same draws in the forward
    assert max(_rel(g1[n], g0[n]) for n in g0) < 1e-5
    # the oracle sees a backward that draws anew (no replay): the MLP weights' gradients are far off
    monkeypatch.setattr(memory, "_set_rng_state", lambda state, device: None)
    _, g2 = _loss_and_grads(_model("starcoder2", tiled=True, checkpointed=checkpointed, residual_dropout=0.1))
    assert max(_rel(g2[n], g0[n]) for n in g0 if ".mlp." in n) > 1e-2


def test_moe_and_tuple_mlps_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^--tiled_mlp: Qwen3MoeForCausalLM: qwen3_moe's MLP is a mixture-of-experts "
                                         r"block .*; drop tiled_mlp") as err:
        _model("qwen3_moe", tiled=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    assert "\n" not in str(err.value)

    class PairMLP(torch.nn.Module):
        def forward(self, x) -> tuple[torch.Tensor, torch.Tensor]:
            return x, x

    model = _model("llama", tiled=False)
    model.get_decoder().layers[1].mlp = PairMLP()
    with pytest.raises(ValueError, match=r"PairMLP's forward returns a tuple .*drop tiled_mlp"):
        memory._tile_mlps(model)


def test_an_mlp_returning_no_tensor_of_its_input_shape_stops_in_the_first_forward():
    class Unannotated(torch.nn.Module):
        def forward(self, x):
            return x, None

    model = _model("llama", tiled=False)
    for layer in model.get_decoder().layers:
        layer.mlp = Unannotated()
    memory._tile_mlps(model)
    with pytest.raises(ValueError, match=r"^--tiled_mlp: Unannotated returned tuple .*not a tensor of the same shape"):
        model(input_ids=torch.randint(3, 96, (1, 8)))
