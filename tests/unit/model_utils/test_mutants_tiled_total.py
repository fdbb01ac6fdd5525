"""The tiled loss's forward (model_utils/tiled_loss.TiledCrossEntropySum) adds its tiles' CE sums in fp32 under bf16:
a bf16 running total of 64 tiles (~26,000 here) keeps 8 bits of mantissa, a step of 128, and each addition rounds.
test_tile_grad_sum.py pins the backward's fp32 sums; nothing pinned the forward's (mutation audit mutA: M26)."""

from __future__ import annotations

import torch

from model_utils.tiled_loss import TiledCrossEntropySum


def test_the_loss_sum_over_64_bf16_tiles_is_fp32_and_as_good_as_fp64():
    torch.manual_seed(0)
    h, vocab, tokens = 64, 512, 4096
    head = torch.nn.Linear(h, vocab, bias=False).bfloat16()
    x = torch.randn(1, tokens, h).bfloat16()
    y = torch.randint(0, vocab, (1, tokens))
    exact = torch.nn.functional.cross_entropy(head.double()(x.double())[0], y[0], reduction="sum").item()
    head.bfloat16()
    got = TiledCrossEntropySum.apply(x, y, head, 64, False)
    assert got.dtype == torch.float32
    assert abs(got.item() - exact) / exact < 1e-4  # an fp32 total: 2.6e-6; a bf16 one: 3.9e-2
