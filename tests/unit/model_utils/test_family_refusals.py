"""Start-up refusals of configs the trainer would run wrong or crash on late (model_utils/families.check_config):
head chunks for families model_utils/head_chunks.py cannot slice, GPT-BigCode under Ulysses, MoE router logits
whose load-balancing loss is not trained here, and bidirectional attention. Each is one line before any weight
is read; the families that do run stay accepted."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from bench.model_sweep import classify
from model_utils import head_chunks
from model_utils.families import check_config
from planner.shapes import head_chunks_refusal

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)


def tiny(model_type: str, **kw):
    return AutoConfig.for_model(model_type, **{**TINY, **kw})


def one_line_refusal(config, head_chunks=1, match: str | None = None) -> str:
    with pytest.raises(ValueError, match=match) as err:
        check_config(config, "sdpa", head_chunks)
    assert "\n" not in str(err.value)
    return str(err.value)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "mistral", "gemma3_text", "olmo"])
def test_chunkable_families_stay_chunkable(model_type):
    assert head_chunks_refusal(tiny(model_type)) == ""
    check_config(tiny(model_type), "sdpa", 2)


@pytest.mark.parametrize("model_type,why", [
    ("olmo2", "over all heads"), ("olmo3", "over all heads"), ("olmoe", "over all heads"),
    ("minimax_m2", "over all heads"), ("phi3", "q/k/v/o_proj"), ("qwen3_next", "linear-attention"),
    ("bitnet", "attn_sub_norm"), ("stablelm", "head counts")])
def test_unchunkable_families_refuse_explicit_chunks(model_type, why):
    """These used to be accepted: the first chunked forward crashed (a size mismatch traceback), or install raised
    late telling the user to set a count they never set (auto had picked it)."""
    config = tiny(model_type)
    assert why in head_chunks_refusal(config)
    msg = one_line_refusal(config, 2, match="attention_head_chunks 2")
    assert model_type in msg and "use attention_head_chunks 1" in msg
    check_config(config, "sdpa", 1)  # unchunked: accepted as before
    check_config(config, "sdpa", "auto")


def test_cohere_qk_norm_over_all_heads_refuses_chunks():
    assert head_chunks_refusal(tiny("cohere")) == ""
    assert "use_qk_norm" in one_line_refusal(tiny("cohere", use_qk_norm=True), 4)


def test_install_refuses_olmo2_before_any_forward():
    """head_chunks.install itself (reachable without the start-up check) refuses OLMo-2 in one line; it used to
    install, and the forward crashed on q_norm over all heads."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny("olmo2"), dtype=torch.float32, attn_implementation="sdpa")
    with pytest.raises(ValueError, match="olmo2.*over all heads") as err:
        head_chunks.install(model, 2)
    assert "\n" not in str(err.value)
    assert not any(hasattr(m, "_head_chunks") for m in head_chunks.attention_modules(model))


def test_gpt_bigcode_refused_under_sequence_parallelism():
    """GPTBigCodeBlock never passes position_ids to its attention: DeepSpeed's Ulysses asserted in the first SP
    step. It was also skipped by the model sweep as a "BERT-style encoder"."""
    config = AutoConfig.for_model("gpt_bigcode", vocab_size=256, n_embd=64, n_layer=2, n_head=4)
    assert "position_ids" in one_line_refusal(config, match="gpt_bigcode")
    assert classify("gpt_bigcode") is None and classify("gpt2") is None
    assert classify("bert").startswith("encoder (bidirectional")


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
def test_router_logits_turned_off_and_said(model_type, tmp_path, capsys):
    """output_router_logits: true asks for the load-balancing loss, which the tiled loss (logits only) never adds: it
    trained nothing, cost every layer's router logits in memory, and was never said. Some configs ship it on
    (tencent/Hy3): turned off at start-up with a note (refused, it would stop plain fine-tuning of such a model)."""
    from model_utils.families import drop_router_logits
    from training.startup import load_run_config

    moe = dict(num_local_experts=4, num_experts=4, num_experts_per_tok=2)
    config = tiny(model_type, **moe, output_router_logits=True)
    assert drop_router_logits(config) and not config.get_text_config().output_router_logits
    assert not drop_router_logits(config)
    config.output_router_logits = True
    config.save_pretrained(tmp_path / "m")
    _, model = load_run_config(["--model_name_or_path", str(tmp_path / "m"), "--output_dir", str(tmp_path / "o"),
                                "--dataset_path", str(tmp_path), "--dry_run"])
    assert not model.config.output_router_logits
    assert "asks for output_router_logits" in capsys.readouterr().out


def test_bidirectional_attention_refused():
    """Gemma-3 / EmbeddingGemma's bidirectional mode (and is_causal false) were accepted: our document pieces are
    causal, while an unmasked sample ran fully bidirectional: the masking depended on the sample's shape."""
    layers = dict(sliding_window=16, layer_types=["sliding_attention", "full_attention"])
    check_config(tiny("gemma3_text", **layers), "sdpa")
    assert "bidirectional" in one_line_refusal(tiny("gemma3_text", **layers, use_bidirectional_attention=True))
    assert "bidirectional" in one_line_refusal(tiny("gemma", use_bidirectional_attention=True))
    config = tiny("llama")
    config.is_causal = False
    assert "is_causal" in one_line_refusal(config)


def test_sink_model_without_sdpa_suggests_flex_only():
    """gpt-oss has no sdpa path: the refusal used to suggest flash_attention_2/3 too, which the sink check refuses
    next (the flash kernels drop the sinks); it names flex_attention alone."""
    config = tiny("gpt_oss", num_local_experts=4, num_experts_per_tok=2)
    msg = one_line_refusal(config, match="no sdpa attention")
    assert msg.endswith("use --attn_implementation flex_attention"), msg
