"""Model folders that cannot train as they are, refused in one line before any data or weight is read
(model_utils/build.py, model_utils/hub.py): quantized weights (the fix: scripts/dequantize.py, or the unquantized
release), weights the model needs that the files lack (under ZeRO-3, in one process), a local folder with a missing
shard or no weights, custom code (auto_map), a PEFT adapter; and the tokenizer-larger-than-the-model refusal's fix.

Before: a quantized checkpoint loaded (FP8 / MXFP4 dequantized outside ZeRO-3's partitioning, bitsandbytes crashed
at the first stage's engine); missing weights trained from random init with only transformers' load report; a
missing shard was a traceback after the data was prepared; transformers asked on stdin whether to run auto_map's code.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from model_utils import build as builder
from model_utils.build import build_model, load_hf_config, resolve_model
from tests.distributed import free_port

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)


def tiny_folder(path, tie: bool = False, rename=None, keep=None, **config_edits) -> str:
    """A tiny Llama saved by save_pretrained, then its config.json edited and its tensors renamed / dropped."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(**TINY, tie_word_embeddings=tie)).save_pretrained(path)
    f = os.path.join(path, "model.safetensors")
    sd = load_file(f)
    save_file({(rename or (lambda k: k))(k): v for k, v in sd.items() if (keep or (lambda k: True))(k)}, f)
    with open(os.path.join(path, "config.json")) as fh:
        cfg = json.load(fh)
    cfg.update(config_edits)
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    return str(path)


@pytest.mark.parametrize("method", ["fp8", "mxfp4"])
def test_a_quantized_checkpoint_is_refused_naming_the_dequantize_script(tmp_path, method):
    folder = tiny_folder(tmp_path / "m", quantization_config={"quant_method": method})
    with pytest.raises(ValueError) as e:
        load_hf_config(folder)  # train.py's first read of the model (training/startup.load_run_config), evaluate's too
    msg = str(e.value)
    assert "\n" not in msg and f"quantization_config quant_method {method}" in msg, msg
    assert f"`python scripts/dequantize.py --model {folder} --output DIR`" in msg, msg
    assert builder.quant_method(load_hf_config(folder, allow_quantized=True)) == method  # what the script reads


@pytest.mark.parametrize("method", ["bitsandbytes", "gptq", "awq", "compressed-tensors"])
def test_other_quantizations_are_refused_naming_the_unquantized_release(tmp_path, method):
    folder = tiny_folder(tmp_path / "m", quantization_config={"quant_method": method, "bits": 4})
    with pytest.raises(ValueError, match=f"quant_method {method}\\) are not trained here .* train from the model's "
                                         "unquantized release"):
        load_hf_config(folder)


def test_a_quantized_text_config_counts(tmp_path):
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("llava", text_config={"model_type": "llama", **TINY,
                                                     "quantization_config": {"quant_method": "fp8"}})
    assert cfg.get_text_config() is not cfg and builder.quant_method(cfg) == "fp8"


def test_a_run_refuses_it_before_its_data(tmp_path):
    from training.startup import load_run_config

    folder = tiny_folder(tmp_path / "m", quantization_config={"quant_method": "fp8"})
    data = tmp_path / "docs.jsonl"  # prepared later (train.py: open_run_data after the process group)
    data.write_text('{"text": "hello"}\n')
    with pytest.raises(ValueError, match="scripts/dequantize.py"):
        load_run_config(["--model_name_or_path", folder, "--dataset_path", str(data), "--output_dir",
                         str(tmp_path / "out")])


@pytest.fixture(scope="module")
def zero3():
    """A one-process gloo world, as a launched rank has, and a ZeRO-3 DeepSpeed config (build_model's)."""
    import deepspeed
    import torch.distributed as dist

    mp = pytest.MonkeyPatch()
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        mp.setenv(k, v)
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    yield {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
           "zero_optimization": {"stage": 3}}
    if dist.is_initialized():
        dist.destroy_process_group()
    mp.undo()


def build(folder, ds):
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    try:
        return build_model(folder, load_hf_config(folder), dict(ds), "sdpa", torch.bfloat16)
    finally:  # the next test's tiny model is saved whole, not created under zero.Init (a refusal's traceback, which
        unset_hf_deepspeed_config()  # pytest keeps, holds the handle)


@pytest.mark.parametrize("case, edits, want", [
    ("untied", dict(tie=True, tie_word_embeddings=False),
     "1 weight(s) the model needs are not in its files (lm_head.weight) and would train from random init; likely "
     "tie_word_embeddings is false"),
    ("prefix", dict(rename=lambda k: "_orig_mod." + k), "21 weight(s) the model needs are not in its files "
     "(lm_head.weight, model.embed_tokens.weight, model.layers.0.input_layernorm.weight ...) and would train from "
     "random init; likely the files name the tensors otherwise, e.g. with a prefix such as _orig_mod."),
    ("layers", dict(num_hidden_layers=3), "9 weight(s) the model needs are not in its files "
     "(model.layers.2.input_layernorm.weight, model.layers.2.mlp.down_proj.weight, "
     "model.layers.2.mlp.gate_proj.weight ...) and would train from random init; likely num_hidden_layers 3 is more "
     "than the saved layers (layer 2 missing)"),
])
def test_weights_the_files_lack_are_refused_under_zero3(tmp_path, zero3, case, edits, want):
    folder = tiny_folder(tmp_path / case, **edits)
    with pytest.raises(ValueError) as e:
        build(folder, zero3)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"--model_name_or_path {folder}: {want}"), msg


def test_whole_folders_load_under_zero3(tmp_path, zero3):
    """Tied embeddings saved once and extra tensors (an MTP head's) are no refusal."""
    from safetensors.torch import load_file, save_file

    build(tiny_folder(tmp_path / "tied", tie=True), zero3)
    folder = tiny_folder(tmp_path / "extra")
    f = os.path.join(folder, "model.safetensors")
    save_file({**load_file(f), "model.mtp.0.weight": torch.zeros(4)}, f)
    model, _ = build(folder, zero3)
    assert hasattr(model.model.layers[0].self_attn.q_proj.weight, "ds_id")  # partitioned as it was created


def test_every_rank_takes_the_decision_of_the_gathered_lists(monkeypatch):
    """A rank whose own list is empty refuses as the rank whose list is not: the same line on every rank."""
    from transformers import LlamaConfig

    from base import comm

    monkeypatch.setattr(comm, "all_gather_object", lambda mine: [mine, ["lm_head.weight"]])
    with pytest.raises(ValueError, match=r"^--model_name_or_path m: 1 weight\(s\) .* \(lm_head.weight\)"):
        builder.check_loaded("m", LlamaConfig(**TINY, tie_word_embeddings=False), [])
    monkeypatch.setattr(comm, "all_gather_object", lambda mine: [mine, []])
    builder.check_loaded("m", LlamaConfig(**TINY), [])


def test_a_local_folder_missing_a_shard_or_its_weights_is_one_line(tmp_path):
    folder = tiny_folder(tmp_path / "shard")
    os.rename(os.path.join(folder, "model.safetensors"), os.path.join(folder, "model-00001-of-00002.safetensors"))
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as fh:
        json.dump({"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}, fh)
    with pytest.raises(ValueError, match=f"^--model_name_or_path {folder}: the folder lacks "
                                         "model-00002-of-00002.safetensors \\(a copy or download that stopped"):
        resolve_model(folder)  # training/startup.check_base_weights at a fresh start; build_model again
    os.remove(os.path.join(folder, "model.safetensors.index.json"))
    os.remove(os.path.join(folder, "model-00001-of-00002.safetensors"))
    with pytest.raises(ValueError, match=r"the folder lacks model.safetensors \(or pytorch_model.bin\)"):
        resolve_model(folder)
    assert resolve_model(folder, weights=False) == folder  # a dry run reads the config only
    load_hf_config(folder)


def test_a_stale_index_beside_the_whole_file_is_what_transformers_ignores(tmp_path):
    """save_pretrained keeps model.safetensors.index.json when a sharded folder is saved again whole: transformers
    loads model.safetensors; the index's missing shards were refused (a review of the day's check)."""
    folder = tiny_folder(tmp_path / "resaved")
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as fh:
        json.dump({"weight_map": {"a": "model-00001-of-00012.safetensors"}}, fh)
    assert resolve_model(folder) == folder


def test_a_resume_reads_no_weights_of_the_base_folder(tmp_path):
    """The config's parse no longer asks a local folder for weights (a resume, a later stage build from config only:
    a base folder whose weights were deleted to save room ran yesterday); build_model asks when it reads them."""
    import types

    from training.hf_args import resolve_hub_ids

    folder = tiny_folder(tmp_path / "config_only")
    os.remove(os.path.join(folder, "model.safetensors"))
    cfg = types.SimpleNamespace(model_name_or_path=folder, tokenizer_name_or_path=None, dry_run=False)
    resolve_hub_ids(cfg)
    assert cfg.model_name_or_path == os.path.abspath(folder)
    with pytest.raises(ValueError, match="the folder lacks model.safetensors"):
        resolve_model(folder, weights=True)  # build_model(pretrained=True)'s call
    from training.startup import check_base_weights

    run = types.SimpleNamespace(model_name_or_path=folder, from_scratch=False)
    check_base_weights(run, types.SimpleNamespace(checkpoint=str(tmp_path / "step_000010")))  # a resume: none read
    with pytest.raises(ValueError, match="the folder lacks model.safetensors"):  # a fresh start: before the data
        check_base_weights(run, types.SimpleNamespace(checkpoint=None))


def test_custom_code_is_never_run_nor_asked_about(tmp_path, monkeypatch):
    def ask(*_):
        raise AssertionError("asked on stdin")

    monkeypatch.setattr("builtins.input", ask)
    custom = tiny_folder(tmp_path / "custom", model_type="internlm2", auto_map={
        "AutoConfig": "configuration_internlm2.InternLM2Config",
        "AutoModelForCausalLM": "modeling_internlm2.InternLM2ForCausalLM"})
    marker = tmp_path / "ran"
    code = f"open({str(marker)!r}, 'w').close()\nfrom transformers import LlamaConfig as InternLM2Config\n"
    (tmp_path / "custom" / "configuration_internlm2.py").write_text(code)
    with pytest.raises(ValueError) as e:
        load_hf_config(custom)
    msg = str(e.value)
    assert "\n" not in msg and "model_type 'internlm2' is custom code (config.json auto_map: " \
        "modeling_internlm2.InternLM2ForCausalLM), which is not run here (trust_remote_code is off)" in msg, msg
    assert "docs/models.md" in msg
    # a type transformers implements, with an auto_map beside it: transformers' own class, the code never run
    known = tiny_folder(tmp_path / "known", auto_map={"AutoConfig": "configuration_internlm2.InternLM2Config"})
    (tmp_path / "known" / "configuration_internlm2.py").write_text(code)
    assert type(load_hf_config(known)).__name__ == "LlamaConfig" and not marker.exists()


def test_a_peft_adapter_says_how_to_merge_it(tmp_path):
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8,
                                                              "base_model_name_or_path": "meta-llama/Llama-3.2-1B"}))
    with pytest.raises(ValueError, match=f"^--model_name_or_path {tmp_path}: a PEFT adapter \\(adapter_config.json\\), "
                                         "not a model: merge it into meta-llama/Llama-3.2-1B first .*merge_and_unload"
                                         "\\(\\).save_pretrained\\(DIR\\)"):
        load_hf_config(str(tmp_path))


def test_a_tokenizer_larger_than_the_model_says_how_to_resize(tmp_path):
    from data.corpus import build_demo_corpus
    from data.packing import build_token_stream
    from data.tokenizer import Tokenizer

    data = tmp_path / "t.jsonl"
    data.write_text('{"text": "import os"}\n')
    tok = Tokenizer(build_demo_corpus()[1])
    with pytest.raises(ValueError) as e:
        build_token_stream(str(data), tok, 1000, str(tmp_path / "cache"))
    msg = str(e.value)  # data/pipeline.py's refusal of a prepared folder is the same line (data.packing.vocab_refusal)
    assert "\n" not in msg and msg.startswith(f"tokenizer {tok.path} has 2000 tokens but the model's vocab_size is "
                                              "1000: "), msg
    assert "model.resize_token_embeddings(len(tokenizer)); model.save_pretrained(DIR)" in msg, msg
