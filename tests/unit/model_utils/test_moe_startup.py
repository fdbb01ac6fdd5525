"""What the start-up says and refuses of a mixture-of-experts model (model_utils/families.py, training/startup.py):
tiled_mlp, which model_utils/memory.py cannot run on an expert block, is refused in one line before any engine (it was
refused at the stage's engine, after the earlier stages had trained, and at every restart); and every MoE start says
that the router's load-balancing loss is not trained (it was said only where the config asked for router logits)."""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from model_utils.families import check_tiled_mlp, router_note
from training import startup

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


def saved(tmp_path, model_type: str, **kw) -> str:
    path = tmp_path / model_type
    AutoConfig.for_model(model_type, **{**TINY, **kw}).save_pretrained(path)
    return str(path)


def start(tmp_path, model: str, *flags: str):
    return startup.load_run_config(["--model_name_or_path", model, "--output_dir", str(tmp_path / "out"),
                                    "--dataset_path", str(tmp_path), "--dry_run", "--max_seq_length", "256",
                                    "--sequence_parallel_size", "1", "--memory_features", "manual", *flags])


def test_tiled_mlp_on_moe_refused_before_any_engine(tmp_path):
    cfg, model = start(tmp_path, saved(tmp_path, "qwen3_moe", **MOE), "--tiled_mlp")
    with pytest.raises(ValueError, match=r"stage 0 .*tiled_mlp: qwen3_moe's MLP is a mixture-of-experts block") as err:
        startup._stages(cfg, model, 1)
    assert "\n" not in str(err.value)
    cfg, model = start(tmp_path, saved(tmp_path, "llama"), "--tiled_mlp")
    assert startup._stages(cfg, model, 1)[0].tiled_mlp is not False  # a dense model keeps it


@pytest.mark.parametrize("model_type,kw", [("gpt_oss", dict(num_local_experts=4, num_experts_per_tok=2)),
                                           ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
                                           ("ernie4_5_moe", dict(moe_num_experts=4, moe_k=2)), ("qwen3_moe", MOE)])
def test_check_tiled_mlp(model_type, kw):
    config = AutoConfig.for_model(model_type, **{**TINY, **kw})
    check_tiled_mlp(config, False, "stage 0 (s)")
    with pytest.raises(ValueError, match=f"stage 1 \\(s\\): tiled_mlp: {model_type}'s MLP is a mixture-of-experts"):
        check_tiled_mlp(config, True, "stage 1 (s)")
    check_tiled_mlp(AutoConfig.for_model("llama", **TINY), True, "stage 0 (s)")
    check_tiled_mlp(AutoConfig.for_model("qwen3_moe", **{**TINY, "num_experts": 0}), True, "dense")


def test_lfm2s_feed_forward_is_not_tiled():
    """LFM2 keeps its MLP as feed_forward, which the tiled MLP does not reach: auto offered it, and the stage's engine
    refused it after the earlier stages trained; now auto never picks it and a pinned one is refused at start-up."""
    from planner.shapes import ModelShape

    config = AutoConfig.for_model("lfm2", **TINY)
    with pytest.raises(ValueError, match="stage 1 \\(s\\): tiled_mlp: lfm2's decoder layers keep their MLP as feed_forward"):
        check_tiled_mlp(config, True, "stage 1 (s)")
    assert "feed_forward" in ModelShape.from_config(config.to_dict()).no_tiled_mlp
    assert ModelShape.from_config(AutoConfig.for_model("llama", **TINY).to_dict()).no_tiled_mlp == ""


def test_router_note_on_every_moe_start(tmp_path, capsys):
    """TRL's MoE fine-tunes default router_aux_loss_coef 0.001: a run here trains no such loss, and says so on every
    MoE start, once, whether or not the config asked for output_router_logits; a dense model gets no note."""
    start(tmp_path, saved(tmp_path, "qwen3_moe", **MOE))
    out = capsys.readouterr().out
    assert out.count("note: qwen3_moe is a mixture of experts: the router's load-balancing (aux) loss is not "
                     "trained here") == 1 and "asks for output_router_logits" not in out
    start(tmp_path, saved(tmp_path, "llama"))
    assert "load-balancing" not in capsys.readouterr().out
    assert router_note(AutoConfig.for_model("mixtral", **TINY), True).endswith(
        "the config asks for output_router_logits: turned off")
