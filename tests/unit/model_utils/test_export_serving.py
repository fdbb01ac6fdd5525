"""An export as users load and serve it with transformers 4.x and vLLM (model_utils/export.py, data/chat_stops.py,
scripts/export_hf.py), from a fake ZeRO checkpoint (the consolidation patched to return a tiny model's state dict):
config.json names a renamed field as 4.x reads it, the weights carry the base folder's names, a tool-call turn's
stop is a generation stop, a YaRN export reaches the length it trained at, a checkpoint is found by the name the
run gives it. Checked by hand with transformers 4.57.1 loading the exports (a Qwen3-MoE of 4 experts, a Gemma 3 whose
vision tower loads as trained); the suite checks the files, not 4.x (not installed here)."""

from __future__ import annotations

import json
import os

import torch

from tests.unit.model_utils.test_export_layout import _checkpoint, _keys

TEXT = dict(vocab_size=300, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)


def test_a_renamed_config_field_is_written_under_the_name_4x_reads(tmp_path, monkeypatch):
    """Qwen3-MoE: transformers 5 renamed num_experts to num_local_experts and wrote `num_experts: null`; 4.x (and
    vLLM) read 128 experts and failed to load a model of 4 (a size mismatch). Both names now, the same value."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from model_utils.export import export_hf

    config = AutoConfig.for_model("qwen3_moe", **TEXT, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    model = AutoModelForCausalLM.from_config(config)
    ck = _checkpoint(tmp_path, monkeypatch, config, model)
    out = tmp_path / "run" / "hf_model"
    export_hf(ck, str(out), owned=True)
    got = json.loads((out / "config.json").read_text())
    assert got["num_experts"] == got["num_local_experts"] == 4


def test_a_gemma3_export_keeps_the_bases_weight_names(tmp_path, monkeypatch):
    """A multimodal Gemma 3 base (the hub's layout: `vision_tower.vision_model.`, `language_model.model.`) exported
    its vision tower as `vision_tower.embeddings.` ...: transformers 4.x and vLLM found none of it and served a random
    vision tower. Now the base's names, and transformers 5 loads the export to the trained weights."""
    from huggingface_hub import save_torch_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM

    from model_utils.export import export_hf

    config = AutoConfig.for_model("gemma3", text_config=TEXT, mm_tokens_per_image=4, image_token_index=299,
                                  boi_token_index=297, eoi_token_index=298,
                                  vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                     num_attention_heads=2, image_size=28, patch_size=14))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    hub = (("model.language_model.", "language_model.model."), ("model.vision_tower.", "vision_tower.vision_model."),
           ("model.multi_modal_projector.", "multi_modal_projector."))
    base = tmp_path / "gemma-3-4b"  # the folder the run started from, as the hub has it
    config.save_pretrained(base)
    named = {}
    for k, v in model.state_dict().items():
        for old, new in hub:
            k = new + k.removeprefix(old) if k.startswith(old) else k
        named[k] = v.contiguous()
    named.pop("lm_head.weight")  # tied
    save_torch_state_dict(named, base)
    out = tmp_path / "run" / "hf_model"
    export_hf(_checkpoint(tmp_path, monkeypatch, config, model), str(out), source=str(base), owned=True, dtype="fp32")
    assert "vision_tower.vision_model.embeddings.patch_embedding.weight" in _keys(out)
    assert _keys(out) == _keys(base)
    back = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())


def test_a_tool_call_turns_end_is_a_stop(tmp_path):
    """gpt-oss ends a turn that is only a tool call on <|call|>, Gemma 4 on <|tool_response>: the SFT trains it there,
    and a base's generation config that lacked it ran on past the call (the model writing the tool's answer). Both
    stops now; a template whose call turn ends as a reply does (Qwen2.5's <|im_end|>) gets that one only."""
    from data.chat_stops import reply_stops
    from data.chat_sweep import build_tokenizer, families
    from data.tokenizer import Tokenizer

    for key, want in (("gpt_oss", ["<|return|>", "<|call|>"]), ("gemma4", ["<turn|>", "<|tool_response>"]),
                      ("qwen25", ["<|im_end|>"])):
        path = build_tokenizer(str(tmp_path), key, families()[key])
        assert reply_stops(path) == [Tokenizer(path).hf.convert_tokens_to_ids(n) for n in want], key


def test_a_yarn_export_short_of_the_length_it_trained_at_says_so(tmp_path, monkeypatch, capsys):
    """A YaRN stage of factor 2 over 256 trained at 1024 (a factor short of its length) exports its reach, 512, as the
    trained factor needs (transformers < 4.56 derives the factor from max_position_embeddings; vLLM serves original x
    factor whatever it says), and says the export serves shorter prompts than it trained on (it said nothing; raising
    max_position_embeddings to 1024 for a day changed 4.x's factor)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from model_utils.export import export_hf

    config = LlamaConfig(**TEXT, max_position_embeddings=1024, rope_parameters={
        "rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 256, "rope_theta": 10000.0})
    trainer = {"stage": 1, "config": {"max_seq_length": 256, "stages": [{"max_seq_length": None},
                                                                        {"max_seq_length": 1024}]}}
    ck = _checkpoint(tmp_path, monkeypatch, config, LlamaForCausalLM(config), trainer)
    export_hf(ck, str(tmp_path / "run" / "hf_model"), owned=True)
    got = json.loads((tmp_path / "run" / "hf_model" / "config.json").read_text())
    assert got["max_position_embeddings"] == 512 and got["rope_scaling"]["factor"] == 2.0
    assert "the stage trained at 1024 tokens, past its YaRN reach 512" in capsys.readouterr().out


def test_a_checkpoint_is_found_by_the_name_the_run_gives_it(tmp_path, monkeypatch):
    """export_hf.py RUN --checkpoint step_000009 / STAGE_1_s512 (as the run's log and checkpoints/ name them) was
    refused (not a complete checkpoint: no such folder); found in RUN/checkpoints/ now."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("export_hf", os.path.join(os.getcwd(), "scripts", "export_hf.py"))
    export = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(export)
    cks = tmp_path / "run" / "checkpoints"
    (cks / "step_000009").mkdir(parents=True)
    (cks / "STAGE_1_s512").write_text("step_000009\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(export, "RUN", ["run"])
    for name in ("step_000009", "STAGE_1_s512", "checkpoints/STAGE_1_s512", "run/checkpoints/step_000009"):
        assert os.path.realpath(export.named(name)) == str(cks / "step_000009"), name
    assert export.named("step_000001") == "step_000001"  # not there: refused as before, under its own name
