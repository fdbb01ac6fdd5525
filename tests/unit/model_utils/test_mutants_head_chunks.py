"""Head-chunked attention (model_utils/head_chunks.py) on a Qwen2, whose q/k/v projections have biases, with those
biases NOT zero: loss and every gradient of 2 chunks equal the unchunked model's, in one process.

`from_config` zero-initialises every nn.Linear bias, so every tiny Qwen2 elsewhere in the suite has zero q/k/v
biases, and a chunk that dropped its slice of the bias passed them all (mutation audit mutA: M12). Real checkpoints
(Qwen2.5) carry non-zero ones. Cost: a 1-layer h64 model, two steps, about a second."""

from __future__ import annotations

import types

import torch

from model_utils import head_chunks, memory


def test_chunks_with_nonzero_qkv_biases_equal_the_unchunked_layer():
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("qwen2", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=128, num_hidden_layers=1, tie_word_embeddings=False)
    opts = types.SimpleNamespace(tiled_mlp=False, tiled_logits=False, gradient_checkpointing=False, checkpoint_every=0,
                                 offload_activations=False, lean_rmsnorm=True, keep_attention=False, lean_mlp=False,
                                 attention_head_chunks=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float().train()
    biases = [p for n, p in model.named_parameters() if n.endswith("proj.bias")]
    assert len(biases) == 3  # q, k, v
    with torch.no_grad():
        for p in biases:
            p.copy_(torch.randn_like(p) * 0.5)
    memory.apply_memory_features(model, opts)
    ids = torch.randint(0, cfg.vocab_size, (1, 32), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "position_ids": torch.arange(32)[None],
             "shift_labels": torch.cat([ids[:, 1:], torch.full((1, 1), -100)], 1)}
    loss_fn = memory.make_loss_fn(opts)

    def step():
        model.zero_grad(set_to_none=True)
        loss = loss_fn(model, batch)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    want, want_grads = step()
    head_chunks.install(model, 2)
    got, grads = step()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    for n, g in grads.items():
        torch.testing.assert_close(g, want_grads[n], rtol=1e-4, atol=1e-6, msg=n)
