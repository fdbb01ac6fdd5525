"""Export a committed checkpoint to a Hugging Face folder (config.json + sharded safetensors).

The fp32 master weights are consolidated from the ZeRO-3 shards on disk (DeepSpeed's zero_to_fp32) and
written straight to safetensors, without building the model, so this runs in one process without a
process group and without a second copy of the weights:

    python scripts/export_hf.py checkpoints/RUN            # newest valid checkpoint -> checkpoints/RUN/hf_model
"""

from __future__ import annotations

import json
import os
import shutil


def export_hf(checkpoint: str, out_dir: str, tokenizer_path: str | None = None) -> str:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from huggingface_hub import save_torch_state_dict
    from transformers import AutoConfig

    with open(os.path.join(checkpoint, "hf_config.json")) as fh:
        fields = json.load(fh)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)  # carries the last stage's RoPE
    root, tag = os.path.split(checkpoint.rstrip("/"))
    state = get_fp32_state_dict_from_zero_checkpoint(root, tag=tag)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # tied to the input embeddings; transformers re-ties on load
    tmp = out_dir.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    config.save_pretrained(tmp)
    save_torch_state_dict({k: v.contiguous() for k, v in state.items()}, tmp, max_shard_size="5GB",
                          safe_serialization=True)
    if tokenizer_path and os.path.isfile(tokenizer_path):
        shutil.copy(tokenizer_path, os.path.join(tmp, "tokenizer.model"))
    elif tokenizer_path and os.path.isdir(tokenizer_path):
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(tokenizer_path).save_pretrained(tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    return out_dir
