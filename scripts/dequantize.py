"""Write a dense bf16 copy of a quantized Hugging Face model, which train.py and scripts/evaluate.py then take (they
refuse quantized weights: model_utils/build.check_not_quantized).

    python scripts/dequantize.py --model openai/gpt-oss-20b --output models/gpt-oss-20b-bf16
    python scripts/dequantize.py --model /models/Qwen3-8B-FP8 --output /models/Qwen3-8B-bf16

Two formats, read with transformers' own dequantizing config: fine-grained FP8 (`quant_method: fp8`: Qwen3-*-FP8,
DeepSeek-V3/R1; FineGrainedFP8Config(dequantize=True)) and MXFP4 (`quant_method: mxfp4`: gpt-oss as OpenAI ships it,
which has no bf16 release; Mxfp4Config(dequantize=True)). Any other method (bitsandbytes, gptq, awq,
compressed-tensors, ...) is refused: train from the model's unquantized release. --model is a folder or a hub id
in the local Hugging Face cache (read offline, as train.py reads it).

One process on the CPU, once, no GPU needed. Cost: the whole model in bf16 in host memory (2 bytes a parameter,
plus one shard being written): gpt-oss-20b ~42 GB, gpt-oss-120b ~234 GB, Qwen3-8B-FP8 ~16 GB; the same again on disk.

--output gets safetensors shards of every weight in bf16 (in the layout transformers saves the model class in),
config.json without quantization_config, generation_config.json, and the folder's other top-level files (the
tokenizer, chat template, license, README). It is written in a hidden folder beside it and moved there at the end:
a run that stops part way leaves no half-written --output. A new or empty folder only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

from model_utils.build import DEQUANTIZABLE, load_hf_config, quant_method, resolve_model

# files save_pretrained writes, or weights in the source's quantized format: never copied from the source
SKIP = ("config.json", "generation_config.json")
WEIGHT_ENDINGS = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".index.json")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="the quantized model: a folder or a hub id in the local cache")
    p.add_argument("--output", required=True, help="a new (or empty) folder for the bf16 copy")
    return p.parse_args(argv)


def check_output(output: str) -> None:
    if os.path.isfile(output):
        raise ValueError(f"--output {output}: a file, not a folder: name a new or empty folder")
    if os.path.isdir(output) and os.listdir(output):
        raise ValueError(f"--output {output} exists and is not empty: name a new or empty folder")


def dequantize(model: str, output: str) -> str:
    """The bf16 copy of `model` written to `output`; one-line ValueError for an input it cannot make one of."""
    check_output(output)
    config = load_hf_config(model, allow_quantized=True)  # no config.json, a PEFT adapter, custom code: one line
    method = quant_method(config)
    if method is None:
        raise ValueError(f"--model {model}: not quantized (its config.json has no quantization_config): nothing to "
                         "do, train from it as it is")
    if method not in DEQUANTIZABLE:
        raise ValueError(f"--model {model}: quant_method {method} is not dequantized here (only "
                         f"{', '.join(DEQUANTIZABLE)}): train from the model's unquantized release (its bf16 / fp16 "
                         "weights)")
    folder = resolve_model(model)  # with its weights: a missing shard is one line, not a traceback after minutes

    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.bfloat16, trust_remote_code=False,
        quantization_config=getattr(transformers, DEQUANTIZABLE[method])(dequantize=True))
    loaded.to(torch.bfloat16)  # every weight dense bf16 (tensors the checkpoint kept in fp32 too)
    # Saved in the class' own layout: the loaded model remembers the quantizer's load ops, and save_pretrained
    # reverts them (transformers 5.23 re-quantized every matrix, the embeddings included, to FP8 on save).
    loaded._weight_conversions = None
    for c in {id(c): c for c in (loaded.config, loaded.config.get_text_config())}.values():
        if hasattr(c, "quantization_config"):
            delattr(c, "quantization_config")
    loaded.config.dtype = torch.bfloat16
    parent = os.path.dirname(os.path.abspath(output))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(output))}.", dir=parent)
    try:
        loaded.save_pretrained(tmp, max_shard_size="5GB")
        strip_quantization(os.path.join(tmp, "config.json"))
        for name in sorted(os.listdir(folder)):
            src = os.path.join(folder, name)
            if (os.path.isfile(src) and not name.startswith(".") and name not in SKIP and not name.endswith(WEIGHT_ENDINGS)
                    and not os.path.exists(os.path.join(tmp, name))):
                shutil.copy(src, os.path.join(tmp, name))  # a hub snapshot's links: the blob's contents
        if os.path.isdir(output):
            os.rmdir(output)  # empty (check_output)
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o777 & ~mask)  # mkdtemp's 0700 would hide the model from the job's other users
        os.rename(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return output


def strip_quantization(config_json: str) -> None:
    """config.json without quantization_config (top level and text_config), should save_pretrained have kept it:
    a loader reading it would take the dense weights for packed ones."""
    with open(config_json) as fh:
        d = json.load(fh)
    subs = [d] + [v for v in d.values() if isinstance(v, dict) and "model_type" in v]
    if any("quantization_config" in s for s in subs):
        for s in subs:
            s.pop("quantization_config", None)
        with open(config_json, "w") as fh:
            json.dump(d, fh, indent=2, sort_keys=True)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    try:
        out = dequantize(a.model, a.output)
    except ValueError as e:  # a user's input: one line, exit 2 (the project's convention)
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}: a dense bf16 copy of {a.model}; train from it (--model_name_or_path {out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
