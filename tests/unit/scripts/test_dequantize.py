"""scripts/dequantize.py: a quantized checkpoint (fine-grained FP8, gpt-oss's MXFP4), built tiny here in the layout
the releases ship, becomes a dense bf16 folder that plain transformers loads, without quantization_config, whose
weights are the dequantized ones (computed here independently of transformers); the inputs it cannot make a copy of
are one line."""

from __future__ import annotations

import json
import os

import pytest
import torch

from scripts.dequantize import main

BLOCK = 32  # FP8 scale blocks (the releases: 128; the tiny matrices here are 64 wide)
FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _write(path, config: dict, tensors: dict) -> str:
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(config, fh)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as fh:  # copied beside the weights
        json.dump({"model_max_length": 4096}, fh)
    return str(path)


def fp8_llama(path) -> tuple[str, dict]:
    """A tiny Llama as Qwen3-*-FP8 / DeepSeek ship it: each projection e4m3 with a per-block weight_scale_inv;
    returns the folder and the weights a dequantization must give (bf16)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    tensors, want = {}, {}
    for k, v in model.state_dict().items():
        if k.endswith("proj.weight"):
            o, i = v.shape
            blocks = v.float().reshape(o // BLOCK, BLOCK, i // BLOCK, BLOCK)
            scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
            q = (blocks / scale[:, None, :, None]).reshape(o, i).to(torch.float8_e4m3fn)
            tensors[k], tensors[k.replace("weight", "weight_scale_inv")] = q, scale
            want[k] = (q.float().reshape(o // BLOCK, BLOCK, i // BLOCK, BLOCK) * scale[:, None, :, None]).reshape(o, i)
        else:
            tensors[k] = want[k] = v.contiguous()
    config = {**cfg.to_dict(), "architectures": ["LlamaForCausalLM"], "quantization_config": {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [BLOCK, BLOCK]}}
    return _write(path, config, tensors), {k: v.to(torch.bfloat16) for k, v in want.items()}


def mxfp4_gpt_oss(path) -> tuple[str, dict]:
    """A tiny gpt-oss as OpenAI ships it: the experts' matrices as MXFP4 (`*_blocks`: two e2m1 codes a byte, 32 a
    block; `*_scales`: the blocks' e8m0 exponents), the rest bf16."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("gpt_oss", vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                               num_experts_per_tok=2, sliding_window=16,
                               layer_types=["sliding_attention", "full_attention"])
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    tensors, want = {}, {}
    for k, v in model.state_dict().items():
        if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            experts, cols, rows = v.shape  # the dense [experts, in, out]; stored per output row, 32 inputs a block
            codes = torch.randint(0, 16, (experts, rows, cols // 32, 32), generator=g, dtype=torch.uint8)
            scales = torch.randint(120, 130, (experts, rows, cols // 32), generator=g, dtype=torch.uint8)
            tensors[k + "_blocks"], tensors[k + "_scales"] = codes[..., 0::2] | (codes[..., 1::2] << 4), scales
            dense = FP4[codes.long()] * torch.pow(2.0, scales.float() - 127)[..., None]
            want[k] = dense.reshape(experts, rows, cols).transpose(1, 2)
        else:
            tensors[k] = want[k] = v.contiguous()
    config = {**cfg.to_dict(), "architectures": ["GptOssForCausalLM"], "quantization_config": {
        "quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                            "model.embed_tokens", "lm_head"]}}
    return _write(path, config, tensors), {k: v.to(torch.bfloat16) for k, v in want.items()}


@pytest.mark.parametrize("make", [fp8_llama, mxfp4_gpt_oss])
def test_a_quantized_model_becomes_its_dense_bf16_copy(tmp_path, make, capsys):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from model_utils.build import load_hf_config

    src, want = make(tmp_path / "q")
    out = str(tmp_path / "bf16")
    assert main(["--model", src, "--output", out]) == 0
    with open(os.path.join(out, "config.json")) as fh:
        assert "quantization_config" not in fh.read()
    assert {"generation_config.json", "tokenizer_config.json"} <= set(os.listdir(out))
    saved = {}
    for f in os.listdir(out):
        if f.endswith(".safetensors"):
            saved.update(load_file(os.path.join(out, f)))
    assert {str(v.dtype) for v in saved.values()} == {"torch.bfloat16"}
    assert set(saved) == set(want)
    for k, v in want.items():
        assert torch.equal(saved[k], v), k
    plain = AutoModelForCausalLM.from_pretrained(out)  # plain transformers: no quantizer, nothing missing
    assert getattr(plain, "hf_quantizer", None) is None
    for k, v in plain.state_dict().items():
        assert torch.equal(v.to(torch.bfloat16), want[k]), k
    load_hf_config(out)  # and training takes it (the source itself is refused: test_model_sources.py)


def test_what_it_cannot_copy_is_one_line(tmp_path, capsys):
    src, _ = fp8_llama(tmp_path / "q")
    out = tmp_path / "out"
    os.makedirs(out)
    (out / "x").write_text("")
    assert main(["--model", src, "--output", str(out)]) == 2
    assert capsys.readouterr().err.strip() == f"error: --output {out} exists and is not empty: name a new or empty folder"
    with open(os.path.join(src, "config.json")) as fh:
        cfg = json.load(fh)
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    with open(os.path.join(src, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    assert main(["--model", src, "--output", str(tmp_path / "new")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "quant_method bitsandbytes is not dequantized here" in err
    assert "unquantized release" in err and not os.path.exists(tmp_path / "new")
    del cfg["quantization_config"]
    with open(os.path.join(src, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    assert main(["--model", src, "--output", str(tmp_path / "new")]) == 2
    assert "not quantized (its config.json has no quantization_config): nothing to do" in capsys.readouterr().err
    assert [f for f in os.listdir(tmp_path) if f.startswith(".")] == []  # no half-written folder left behind
