"""Chunked attention frees each finished chunk's q, k, v before the next chunk runs, in the backward of a layer that
keeps its activations (model_utils/head_chunks.py).

Until 2026-11-27 it did not: the kernel cache (`_KeepKernel`, now `memory.KeepKernels`) answered the recomputed
kernel call with the cached kernel output itself,
which is also one of `_Chunked`'s saved tensors; autograd set that call's history on it, so ctx -> cached output ->
the kernel's backward node -> the chunk's q, k, v stayed alive until `_Chunked.backward` returned: every chunk's
projections at once (Llama-3-8B at 1M tokens, 16 chunks: 16 GiB at the step's peak on the H200,
docs/results/gpu.md). A checkpointed layer did not leak (its saved tensors are the recompute's). The per-phase bytes
of the same fix: tests/unit/planner/test_phase_bytes.py. Cost: a 2-layer h64 model, one step, well under a second.
"""

from __future__ import annotations

import types
import weakref

import pytest
import torch

from model_utils import head_chunks, memory

CHUNKS = 4


@pytest.mark.parametrize("checkpoint_every", [0, 2])
def test_finished_chunks_projections_are_freed(monkeypatch, checkpoint_every):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_attention_heads=8,
                               num_key_value_heads=2, vocab_size=128, num_hidden_layers=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float().train()
    opts = types.SimpleNamespace(tiled_mlp=False, tiled_logits=False, gradient_checkpointing=checkpoint_every > 0,
                                 checkpoint_every=checkpoint_every, offload_activations=False, lean_rmsnorm=True,
                                 keep_attention=False, lean_mlp=False, attention_head_chunks=CHUNKS)
    memory.apply_memory_features(model, opts)
    head_chunks.install(model, CHUNKS)
    loss_fn = memory.make_loss_fn(opts)

    calls: list[list[weakref.ref]] = []  # every project() call's q, k, v, in order (forward, recompute, backward)
    alive: list[tuple[int, int]] = []
    real = head_chunks._Plan.project

    def project(self, x, W, c):
        alive.extend((i, len(calls)) for i, refs in enumerate(calls) if any(r() is not None for r in refs))
        out = real(self, x, W, c)
        calls.append([weakref.ref(t) for t in out])
        return out

    monkeypatch.setattr(head_chunks._Plan, "project", project)
    ids = torch.randint(0, cfg.vocab_size, (1, 256))
    loss_fn(model, {"input_ids": ids, "position_ids": torch.arange(256)[None], "shift_labels": ids}).backward()
    # forward: 2 layers x 4 chunks; (a checkpointed layer's recompute: 4 more); backward: 2 x 4
    assert len(calls) == 4 * CHUNKS + (CHUNKS if checkpoint_every else 0)
    assert not alive, f"q/k/v of an earlier chunk alive at a later chunk's projections (call, at call): {alive}"
