"""A stage's RoPE as the model's config brings it (model_utils/rope.stage_rope / apply_rope), checked through
transformers' own rotary computation on tiny configs of the real families, no launch: the legacy `type` key, a
partial rotary share kept across a change of type, RoPE per layer type (Gemma 3), a composite config's text config,
yarn's pretraining length, longrope's and dynamic's per-forward frequencies. Each case was wrong or a crash before
(a helper's audit, reproduced): the comment names what the old code did."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from model_utils.rope import apply_rope, stage_rope
from training.config import Config, StageConfig
from training.curriculum import check_stages, resolve_stages

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
            vocab_size=128, pad_token_id=0, eos_token_id=1, bos_token_id=2)


def inv_freq(config, layer_type=None) -> torch.Tensor:
    """What the model's rotary embedding computes from the config (transformers' init functions)."""
    params = config.rope_parameters if layer_type is None else config.rope_parameters[layer_type]
    kind = params.get("rope_type", "default")
    if kind == "default":
        head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        base, dim = params["rope_theta"], int(head * params.get("partial_rotary_factor", 1.0))
        return 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    return ROPE_INIT_FUNCTIONS[kind](config, "cpu", layer_type=layer_type)[0].double()


def qwen25(**kw):
    return AutoConfig.for_model("qwen2", **TINY, rope_theta=1e6, max_position_embeddings=131072, **kw)


def test_the_legacy_type_key_is_read():
    """{type: yarn} (Qwen2.5's own YaRN block): merged as an unknown key, no scaling at all."""
    c = qwen25()
    apply_rope(c, {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 131072)
    ref = qwen25()
    apply_rope(ref, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 131072)
    assert c.rope_parameters == ref.rope_parameters and "type" not in c.rope_parameters
    assert not torch.allclose(inv_freq(c), inv_freq(qwen25()))
    with pytest.raises(ValueError, match="type 'yarn' and rope_type 'linear' disagree"):
        apply_rope(qwen25(), {"type": "yarn", "rope_type": "linear", "factor": 4.0}, 131072)


def test_a_key_no_rope_type_reads_is_refused_naming_the_nearest():
    """`theta` for rope_theta (or `factr`, `betafast`) was carried along unused: the stage trained at the model's own
    frequencies, the dry run showing the typo as if it applied (a helper's audit, reproduced)."""
    with pytest.raises(ValueError, match=r"^rope: 'theta' is no setting of rope_type default \(did you mean 'rope_theta'"):
        apply_rope(qwen25(), {"rope_type": "default", "theta": 1e6}, 131072)
    with pytest.raises(ValueError, match=r"'betafast' is no setting of rope_type yarn \(did you mean 'beta_fast'"):
        stage_rope(qwen25(), {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
                              "betafast": 16})


def test_a_change_of_type_keeps_the_share_of_the_head_that_rotates():
    """Phi-4-mini rotates 3/4 of each head (partial_rotary_factor 0.75): an ABF stage dropped it, every dimension
    rotated from the first step."""
    c = AutoConfig.for_model("phi3", **TINY, partial_rotary_factor=0.75, max_position_embeddings=131072,
                             original_max_position_embeddings=4096,
                             rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 6, "long_factor": [4.0] * 6})
    rotated = len(inv_freq(c))
    apply_rope(c, {"rope_type": "default", "rope_theta": 8e6}, 262144)
    assert c.rope_parameters["partial_rotary_factor"] == 0.75 and len(inv_freq(c)) == rotated == 6


def test_rope_per_layer_type_takes_the_stage_per_type():
    """Gemma 3: {full_attention, sliding_attention}. A flat stage was merged where no layer reads it (the full layers
    kept 1e6 while hf_config.json said 8e6); now refused in one line, and a stage per type reaches its layers."""
    c = AutoConfig.for_model("gemma3_text", **TINY, head_dim=16)
    local = inv_freq(c, "sliding_attention")
    with pytest.raises(ValueError, match=r"^rope: the model sets RoPE per layer type .*give the stage's per type"):
        apply_rope(c, {"rope_type": "default", "rope_theta": 8e6}, 4096)
    apply_rope(c, {"full_attention": {"rope_type": "default", "rope_theta": 8e6}}, 4096)
    assert c.rope_parameters["full_attention"]["rope_theta"] == 8e6
    assert torch.equal(inv_freq(c, "sliding_attention"), local)
    assert torch.allclose(inv_freq(c, "full_attention")[-1], torch.tensor(8e6 ** (-14 / 16), dtype=torch.float64))


def test_a_composite_config_sets_its_text_configs_rope():
    """Gemma 3 (4B+) and Qwen3.5 are composite: apply_rope read rope_parameters on the outer config, an
    AttributeError at the first stage's engine build (after --dry_run passed)."""
    c = AutoConfig.for_model("gemma3", text_config=dict(TINY, head_dim=16))
    apply_rope(c, {"full_attention": {"rope_type": "linear", "factor": 8.0}}, 8192)
    text = c.get_text_config()
    assert text.rope_parameters["full_attention"]["rope_type"] == "linear" and text.max_position_embeddings >= 8192


def test_yarn_needs_the_length_the_model_was_pretrained_at():
    """Qwen2.5 base says max_position_embeddings 131072 for a native 32768: yarn over it rotated 23 of 64 frequencies
    up to 3.9x too fast. Without the model's own original length the stage must give it; Llama 3.1's 8192 is kept
    across a change of type, and the replaced llama3 scaling is said."""
    with pytest.raises(ValueError, match="rope_type yarn needs original_max_position_embeddings"):
        stage_rope(qwen25(), {"rope_type": "yarn", "factor": 8.0})
    llama31 = AutoConfig.for_model("llama", **TINY, max_position_embeddings=131072, rope_theta=5e5, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192})
    params, notes = stage_rope(llama31, {"rope_type": "yarn", "factor": 32.0})
    assert params["original_max_position_embeddings"] == 8192 and params["rope_theta"] == 5e5
    assert len(notes) == 1 and "rope_type llama3" in notes[0] and "replaced by yarn" in notes[0]
    # the same type takes the model's other fields (a llama3 stage giving its factor alone was refused: "needs ...")
    params, notes = stage_rope(llama31, {"rope_type": "llama3", "factor": 16.0})
    assert params["factor"] == 16.0 and params["low_freq_factor"] == 1.0 and not notes
    # a stage without rope_type is default, said so (transformers' rotary raised KeyError 'rope_type' at the build)
    params, _ = stage_rope(llama31, {"rope_theta": 8e6})
    assert params == {"rope_type": "default", "rope_theta": 8e6}


def test_per_forward_frequencies_are_refused_under_sp_and_keep_their_own_scale():
    """longrope (Phi-3 / 4-mini) picks short or long factors from each forward's largest position: under Ulysses each
    rank decides on its own shard (was accepted at SP 2). Its attention scaling followed the raised
    max_position_embeddings (1.19 at 128k, 1.29 at 1M), now its factor is pinned; dynamic's threshold is not raised
    (it never scaled)."""
    phi3 = AutoConfig.for_model("phi3", **TINY, max_position_embeddings=131072, original_max_position_embeddings=4096,
                                rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [4.0] * 8})
    stages = resolve_stages(Config(stages=[StageConfig(name="s", max_seq_length=262144, sequence_parallel_size=2)]),
                            dp_of_sp=lambda sp: 2 // sp)
    with pytest.raises(ValueError, match=r"^stage 0 \(s\): the model's rope_parameters: rope_type longrope"):
        check_stages(stages, world=2, num_heads=4, num_kv_heads=2, model=phi3)
    scale = ROPE_INIT_FUNCTIONS["longrope"](phi3, "cpu")[1]
    apply_rope(phi3, None, 1 << 20)
    assert phi3.max_position_embeddings == 1 << 20 and ROPE_INIT_FUNCTIONS["longrope"](phi3, "cpu")[1] == scale
    dyn = qwen25()
    dyn.max_position_embeddings = 32768
    apply_rope(dyn, {"rope_type": "dynamic", "factor": 4.0}, 131072)
    assert dyn.max_position_embeddings == 32768  # its threshold: raised to the stage's length, it never scaled


def test_a_rope_the_models_config_class_refuses_or_rewrites_is_refused_at_start():
    """Phi-3 / 3.5 / 4-mini with a yarn or linear stage trained the whole curriculum (the build sets the RoPE without
    the class), then the export failed: Phi3Config turns yarn into longrope and wants its factors, refuses linear.
    An ABF stage (default, rope_theta) builds."""
    phi3 = AutoConfig.for_model("phi3", **TINY, max_position_embeddings=131072, original_max_position_embeddings=4096,
                                rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [4.0] * 8})
    for kind in ("yarn", "linear"):
        with pytest.raises(ValueError, match=rf"^rope: Phi3Config (refuses|turns) rope_type {kind}"):
            stage_rope(phi3, {"rope_type": kind, "factor": 64.0})
    params, _ = stage_rope(phi3, {"rope_type": "default", "rope_theta": 1e6})
    assert params["rope_type"] == "default"


def test_a_yarn_stage_of_another_factor_derives_its_attention_scaling_again():
    """OLMo 3 ships yarn factor 8 with attention_factor 1.2079 (0.1 ln 8 + 1): a factor-32 stage kept it, YaRN's own
    for 32 is 1.3466. A stage giving its attention_factor keeps it."""
    olmo = AutoConfig.for_model("llama", **TINY, max_position_embeddings=65536, rope_theta=5e5, rope_scaling={
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192,
        "attention_factor": 1.2079441541679836})
    apply_rope(olmo, {"rope_type": "yarn", "factor": 32.0}, 262144)
    assert ROPE_INIT_FUNCTIONS["yarn"](olmo, "cpu")[1] == pytest.approx(0.1 * torch.log(torch.tensor(32.0)).item() + 1)
    params, _ = stage_rope(olmo, {"rope_type": "yarn", "factor": 32.0, "attention_factor": 1.5})
    assert params["attention_factor"] == 1.5


def test_a_scaling_that_reaches_fewer_positions_than_the_stage_is_said(capsys):
    """gpt-oss's yarn x32 over 4096 with a stage of 'factor 2' (to double it) reached 8192 positions at 262144."""
    gpt = AutoConfig.for_model("llama", **TINY, max_position_embeddings=131072, rope_theta=15e4, rope_scaling={
        "rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096})
    for rope, said in (({"rope_type": "yarn", "factor": 2.0}, True), ({"rope_type": "yarn", "factor": 64.0}, False)):
        stages = resolve_stages(Config(stages=[StageConfig(name="s", max_seq_length=262144, rope=rope)]),
                                dp_of_sp=lambda sp: 1)
        check_stages(stages, world=1, num_heads=4, num_kv_heads=2, model=gpt)
        out = capsys.readouterr().out
        assert ("rope_type yarn factor 2.0 over 4096 reaches 8192 positions, fewer than its max_seq_length 262144"
                in out) is said and ("factor 64 reaches it" in out) is said


def test_a_stage_rope_that_cuts_an_extended_model_back_is_said():
    """The 128k SFT recipe's rope (yarn x4 over 32768, theta 1e6) copied after one's own ABF extension to 1M (default
    type, theta 1.6e8, max_position_embeddings 1M) trained and shipped a 128k model without a word (the note fired only
    for a model whose own type was not default): now the lowered theta and the shorter reach are named, once."""
    ext = AutoConfig.for_model("qwen2", **TINY, max_position_embeddings=1048576,
                               rope_parameters={"rope_type": "default", "rope_theta": 1.6e8})
    sft = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "rope_theta": 1e6}
    _, notes = stage_rope(ext, sft, "rope")
    assert len(notes) == 1 and "rope_theta 1000000.0 is below the model's 160000000.0" in notes[0], notes
    assert "reaches 131072 positions, fewer than the model's max_position_embeddings 1048576" in notes[0]
    assert "a stage without rope keeps the previous stage's" in notes[0]
    _, notes = stage_rope(ext, {"rope_type": "default", "rope_theta": 1e7})  # theta alone, lowered
    assert len(notes) == 1 and "rope_theta 10000000.0 is below the model's 160000000.0" in notes[0], notes
    # what extends says nothing: a raised theta, a yarn reaching the model's length, no rope at all
    assert stage_rope(ext, {"rope_type": "default", "rope_theta": 5e8})[1] == []
    assert stage_rope(qwen25(), {**sft, "rope_theta": 1e6})[1] == []  # Qwen2.5: x4 over 32768 = its 131072
    llama31 = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192, "rope_theta": 5e5,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0}  # x8 over 8192 = 65536 < its declared 131072 (a review)
    meta = AutoConfig.for_model("llama", **TINY, max_position_embeddings=131072, rope_parameters=llama31)
    assert stage_rope(meta, llama31)[1] == [] and stage_rope(meta, {**llama31, "rope_theta": 4e6})[1] == []
    assert stage_rope(ext, None)[1] == []
