"""flex_attention's document BlockMask grows with (length / 128)^2 (model_utils/attention.doc_block_mask: measured
41-48 B per block pair while built, 16 B kept; 2.8 + 1.07 GB at 1M tokens, ~44 GB at 4M) and the memory plan does not
count it: past FLEX_MASK_MAX_BYTES a rank (1,048,576 tokens a sample, more under cp) --attn_implementation flex_attention is refused at
start-up (training/preflight.check_stage_configs, dry runs included), and only the newest micro-batch keeps its masks
(four were kept: 4.3 GB at 1M). Before: accepted at any length, four micro-batches' masks held."""

from __future__ import annotations

import pytest
import torch

from model_utils import attention
from model_utils.attention import check_flex_length, documents_for, flex_mask_bytes


def test_flex_past_its_mask_bound_is_refused_in_one_line():
    check_flex_length("flex_attention", 1 << 20)  # 4 GiB: the longest it takes without cp
    check_flex_length("flex_attention", 1 << 21, cp=4)  # cp 4: each rank builds its quarter
    check_flex_length("sdpa", 1 << 24)  # other backends build no BlockMask
    with pytest.raises(ValueError, match=r"^stage 1 \(long\): --attn_implementation flex_attention at max_seq_length "
                                         r"2,097,152 \(micro-batch 1, cp 1\): its document BlockMask takes 16\.0 GiB "
                                         r"a rank.*at most 1,048,576 tokens: use flash_attention_2 or sdpa, or a larger "
                                         r"context_parallel_size$"):
        check_flex_length("flex_attention", 1 << 21, 1, "stage 1 (long)")
    with pytest.raises(ValueError, match="at most 741,376 tokens"):  # two samples a micro-batch: 1/sqrt(2) the length
        check_flex_length("flex_attention", 1 << 20, 2)
    with pytest.raises(ValueError, match="at most 1,482,880 tokens"):  # cp 2 and `auto` (counted as 1 until split)
        check_flex_length("flex_attention", 1 << 21, cp=2)
    with pytest.raises(ValueError, match="cp 1"):
        check_flex_length("flex_attention", 1 << 21, cp="auto")
    assert flex_mask_bytes(1 << 20) == 64 * 8192**2


def test_start_up_refuses_it(monkeypatch):
    from training.config import parse_config
    from training.curriculum import resolve_stages
    from training.preflight import check_stage_configs

    cfg = parse_config(["--output_dir", "/tmp/unused", "--max_seq_length", str(1 << 21), "--attn_implementation",
                        "flex_attention"])
    stages = resolve_stages(cfg, dp_of_sp=lambda sp: 1)
    with pytest.raises(ValueError, match=r"^stage 0 \(.*\): --attn_implementation flex_attention at max_seq_length "
                                         r"2,097,152"):
        check_stage_configs(cfg, stages, 1, bf16=False, hidden_size=64)


def test_only_the_newest_micro_batch_keeps_its_block_masks():
    attention._DOCS.clear()
    try:
        first = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
        docs = documents_for(first, 1)
        docs.block_mask(None)
        assert ("flex", None) in docs._cache
        newer = documents_for(torch.tensor([[0, 1, 0, 1, 2, 3, 4, 5]]), 1)
        assert ("flex", None) not in docs._cache and newer is not docs  # dropped: 16 B per block pair not held
        assert documents_for(first, 1) is docs  # the older micro-batch's Documents is still found (its sdpa pieces)
        assert docs.block_mask(None) is not None  # and its mask rebuilt when a recompute asks for it
    finally:
        attention._DOCS.clear()
