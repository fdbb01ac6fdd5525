"""What model_utils/export.export_hf writes, from a fake ZeRO checkpoint (the consolidation patched to return a tiny
model's state dict, as transformers 5 holds it in memory): the weights in the layout save_pretrained writes (an MoE's
experts per expert), in the run's precision with `torch_dtype` beside `dtype`, the base's output_router_logits, a
sentencepiece folder's tokenizer.model, and a symlinked output folder written where it points."""

from __future__ import annotations

import json
import os

import pytest
import torch

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)


def _checkpoint(tmp_path, monkeypatch, config, model, trainer: dict | None = None) -> str:
    """A checkpoint folder whose consolidation returns `model`'s state dict; hf_config.json is `config`, trainer.json
    `trainer` where given."""
    import deepspeed.utils.zero_to_fp32 as z

    ck = tmp_path / "run" / "checkpoints" / "step_000002"
    ck.mkdir(parents=True)
    (ck / "hf_config.json").write_text(config.to_json_string())
    if trainer is not None:
        (ck / "trainer.json").write_text(json.dumps(trainer))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    monkeypatch.setattr(z, "get_fp32_state_dict_from_zero_checkpoint", lambda root, tag: dict(state))
    return str(ck)


def _keys(folder) -> list[str]:
    from safetensors import safe_open

    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
        return sorted(f.keys())


def test_an_moe_export_is_written_as_save_pretrained_writes_it(tmp_path, monkeypatch):
    """Qwen3-MoE: the export wrote transformers 5's in-memory fused experts (`mlp.experts.gate_up_proj`, 3-D), where
    save_pretrained writes `mlp.experts.N.gate_proj.weight` ...: transformers 4.x and vLLM's per-expert loaders got
    random or skipped experts. Now the same keys as save_pretrained, and transformers 5 loads it to the same logits.
    The base's output_router_logits (on; training turned it off) is the export's again."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from model_utils.export import export_hf

    config = AutoConfig.for_model("qwen3_moe", **TINY, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                  output_router_logits=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    base = tmp_path / "base"
    model.save_pretrained(base)  # the folder the run started from
    config.output_router_logits = False  # as training records it (model_utils/families.drop_router_logits)
    ck = _checkpoint(tmp_path, monkeypatch, config, model)
    out = tmp_path / "run" / "hf_model"
    export_hf(ck, str(out), source=str(base), owned=True)
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in _keys(out)
    assert _keys(out) == _keys(base)
    assert json.loads((out / "config.json").read_text())["output_router_logits"] is True
    back = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, 128, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_a_dense_export_is_what_it_was(tmp_path, monkeypatch):
    """A dense family (no conversion in transformers): the safetensors file is byte for byte what the export wrote
    before the hub layout (the state dict saved as consolidated); base without output_router_logits: none added."""
    from huggingface_hub import save_torch_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM

    from model_utils.export import export_hf

    config = AutoConfig.for_model("llama", **TINY)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    ck = _checkpoint(tmp_path, monkeypatch, config, model)
    export_hf(ck, str(tmp_path / "out"))
    before = tmp_path / "before"
    before.mkdir()
    save_torch_state_dict({k: v.contiguous() for k, v in model.state_dict().items()}, before, max_shard_size="5GB")
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (before / "model.safetensors").read_bytes()
    assert "output_router_logits" not in json.loads((tmp_path / "out" / "config.json").read_text())


def test_a_bf16_runs_export_is_bf16_and_says_so_for_every_loader(tmp_path, monkeypatch):
    """A bf16 run's export was fp32 on disk (32 GB for 8B) with `dtype: bfloat16` and no `torch_dtype` (what
    transformers before 4.56 reads). auto: the precision the checkpoint's DeepSpeed config trained in (bf16 here,
    though hf_config.json says float32: a first stage's from_pretrained records the base's dtype), both keys; fp32 on
    request (the master weights, exactly); an unknown dtype refused in one line before any work."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    from model_utils.export import export_hf

    config = AutoConfig.for_model("llama", **TINY)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    ck = _checkpoint(tmp_path, monkeypatch, config, model)
    torch.save({"ds_config": {"bf16": {"enabled": True}}}, os.path.join(ck, "zero_pp_rank_0_mp_rank_00_model_states.pt"))
    for dtype, want, name in (("auto", torch.bfloat16, "bfloat16"), ("fp32", torch.float32, "float32")):
        out = tmp_path / dtype
        export_hf(ck, str(out), dtype=dtype)
        got = json.loads((out / "config.json").read_text())
        assert got["dtype"] == got["torch_dtype"] == name
        with safe_open(str(out / "model.safetensors"), "pt") as f:
            w = f.get_tensor("model.embed_tokens.weight")
        assert w.dtype == want and torch.equal(w, model.model.embed_tokens.weight.detach().to(want))
    torch.save({"ds_config": {"bf16": {"enabled": False}}}, os.path.join(ck, "zero_pp_rank_0_mp_rank_00_model_states.pt"))
    export_hf(ck, str(tmp_path / "fp32_run"))
    assert json.loads((tmp_path / "fp32_run" / "config.json").read_text())["torch_dtype"] == "float32"
    with pytest.raises(ValueError) as e:
        export_hf(ck, str(tmp_path / "bad"), dtype="int8")
    assert len(str(e.value).splitlines()) == 1 and "--dtype int8" in str(e.value)
    assert not (tmp_path / "bad").exists()


def test_a_symlinked_output_is_written_where_it_points(tmp_path, monkeypatch):
    """RUN/hf_model a link to another disk: rmtree left the link, and replacing it with the new folder raised
    ENOTDIR after the whole run (and at every restart). The export lands in the link's target; the link stays."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from model_utils.export import export_hf
    from model_utils.export_target import MARKER

    config = AutoConfig.for_model("llama", **TINY)
    model = AutoModelForCausalLM.from_config(config)
    ck = _checkpoint(tmp_path, monkeypatch, config, model)
    target = tmp_path / "big_disk" / "hf_model"
    target.mkdir(parents=True)
    (target / MARKER).write_text(json.dumps({"checkpoint": ck}))  # a previous export of this run's (check_out)
    (target / "stale.safetensors").write_text("")
    link = tmp_path / "run" / "hf_model"
    link.symlink_to(target)
    assert export_hf(ck, str(link), owned=True) == str(link)
    assert link.is_symlink() and (target / "model.safetensors").is_file() and not (target / "stale.safetensors").exists()
    assert not os.path.exists(str(target) + ".export-tmp")


def test_a_sentencepiece_tokenizer_folder_keeps_its_model_file(tmp_path, monkeypatch):
    """A tokenizer folder of tokenizer.model + tokenizer_config.json (Llama 2 style): AutoTokenizer.save_pretrained
    writes tokenizer.json only, and the export dropped tokenizer.model. It is copied verbatim."""
    import sentencepiece as spm
    from transformers import AutoConfig, AutoModelForCausalLM

    from model_utils.export import export_hf

    tok = tmp_path / "tok"
    tok.mkdir()
    spm.SentencePieceTrainer.train(sentence_iterator=iter([f"the quick brown fox jumps {i}" for i in range(100)]),
                                   model_prefix=str(tok / "tokenizer"), vocab_size=40, model_type="bpe",
                                   minloglevel=2)
    (tok / "tokenizer.vocab").unlink()
    (tok / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>",
                                                            "eos_token": "</s>", "unk_token": "<unk>"}))
    (tok / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    config = AutoConfig.for_model("llama", **TINY)
    ck = _checkpoint(tmp_path, monkeypatch, config, AutoModelForCausalLM.from_config(config))
    out = tmp_path / "out"
    export_hf(ck, str(out), tokenizer_path=str(tok))
    assert (out / "tokenizer.model").read_bytes() == (tok / "tokenizer.model").read_bytes()
    assert (out / "special_tokens_map.json").is_file() and (out / "tokenizer.json").is_file()
