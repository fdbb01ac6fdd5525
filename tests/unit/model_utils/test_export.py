"""model_utils/export.py's guards and what it carries, without a checkpoint to consolidate: the folder it would
replace is checked before any work (a typo in --out deleted the run folder, its checkpoints with it), and the base
model's generation_config.json is found where the run's --model_name_or_path has one. The export itself (use_cache
on, the marker): tests/e2e/test_plainest_runs.py."""

from __future__ import annotations

import json

import pytest

from model_utils.export import generation_config
from model_utils.export_target import MARKER, check_out


def test_out_refused_where_it_would_destroy_what_is_not_an_export(tmp_path):
    run = tmp_path / "run"
    ck = run / "checkpoints" / "step_000010"
    ck.mkdir(parents=True)
    base = tmp_path / "Meta-Llama-3-8B"  # a base model's folder: the names an export writes, not an export
    base.mkdir()
    (base / "config.json").write_text("{}")
    (base / "model.safetensors").write_text("")
    for out, what in ((run, "holds the checkpoint"), (run / "checkpoints", "holds the checkpoint"), (ck, "holds the "
                      "checkpoint"), (base, "not a previous export"), (base / "config.json", "a file")):
        with pytest.raises(ValueError) as e:
            check_out(str(out), str(ck))
        assert len(str(e.value).splitlines()) == 1 and what in str(e.value) and str(out) in str(e.value)
    assert (base / "model.safetensors").exists() and ck.is_dir()
    check_out(str(tmp_path / "new"), str(ck))  # a new folder
    check_out(str(run / "hf_model"), str(ck), owned=True)  # the run's own, whatever it holds
    (base / MARKER).write_text("{}")
    check_out(str(base), str(ck))  # a previous export
    with pytest.raises(ValueError, match="holds the checkpoint"):
        check_out(str(run), str(ck), owned=True)


def test_generation_config_from_the_model_the_run_started_from(tmp_path):
    model = tmp_path / "instruct"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert generation_config(str(model)) is None  # none there
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [128001, 128009]}))
    assert generation_config(str(model)) == str(model / "generation_config.json")
    assert generation_config("tiny-llama") is None and generation_config(None) is None  # a preset; not recorded
    assert generation_config(str(tmp_path / "gone")) is None  # the model folder no longer there


def test_a_stage_marker_names_its_checkpoint(tmp_path):
    """export_hf.py --checkpoint RUN/checkpoints/STAGE_1_s512 (a file naming the checkpoint that ended the stage)
    exports that checkpoint (before: 'not a complete checkpoint (no such folder)')."""
    import importlib.util
    import os

    spec = importlib.util.spec_from_file_location("export_hf", os.path.join(os.getcwd(), "scripts", "export_hf.py"))
    export = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(export)
    (tmp_path / "step_000060").mkdir()
    (tmp_path / "STAGE_1_s512").write_text("step_000060\n")
    assert export.named(str(tmp_path / "STAGE_1_s512")) == str(tmp_path / "step_000060")
    assert export.named(str(tmp_path / "step_000060")) == str(tmp_path / "step_000060")


def test_a_checkpoint_named_first_is_exported_from_its_run(tmp_path, monkeypatch):
    """export_hf.py RUN/checkpoints/step_000175 (as evaluate.py takes it) was 'no complete checkpoint under
    .../step_000175/checkpoints': the checkpoint is exported, into its run's hf_model."""
    import importlib.util
    import os

    spec = importlib.util.spec_from_file_location("export_hf", os.path.join(os.getcwd(), "scripts", "export_hf.py"))
    export = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(export)
    ck = tmp_path / "run" / "checkpoints" / "step_000175"
    ck.mkdir(parents=True)
    (ck / "MANIFEST.json").write_text("{}")
    seen = {}
    monkeypatch.setattr(export.Checkpointer, "verify", lambda self, path: None)
    monkeypatch.setattr(export.Checkpointer, "read_trainer", staticmethod(lambda path: {"tokenizer": None}))
    monkeypatch.setattr(export, "export_hf", lambda path, out, tok, source=None, owned=False, stops=None, identity=None, template=None, dtype="auto": seen.update(
        path=path, out=out, owned=owned) or out)
    assert export.main([str(ck)]) == 0
    assert seen == {"path": str(ck), "out": str(tmp_path / "run" / "hf_model"), "owned": True}
    assert export.main([str(ck), "--checkpoint", str(ck)]) == 2
    # a checkpoint outside a run's checkpoints/ folder: its parent's parent's hf_model is not the run's own (an
    # unrelated folder of that name would have been replaced): it must be new or a previous export
    loose = tmp_path / "scratch" / "ckpts" / "step_000005"
    loose.mkdir(parents=True)
    (loose / "MANIFEST.json").write_text("{}")
    seen.clear()
    assert export.main([str(loose)]) == 0 and seen["owned"] is False


def test_a_yarn_export_says_the_length_it_extends_to(tmp_path, monkeypatch):
    """A YaRN stage's export kept the base's max_position_embeddings (the demo's 131072 over an original 256):
    transformers before 4.56 (and copies of its code) derive YaRN's factor as max_position_embeddings / original, so
    it loaded as factor 512 (Qwen2.5-7B-Instruct's recipe: factor 1, no YaRN at 128k); transformers 5 warns at each
    load. The export writes original x factor, which transformers 4.51 and later read as trained; 4.46-4.50 compute
    YaRN's correction range from max_position_embeddings, not original_max_position_embeddings, so a YaRN export
    needs 4.51 or later there (docs/checkpoints.md)."""
    import deepspeed.utils.zero_to_fp32 as z
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from model_utils.export import export_hf

    config = LlamaConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=16, max_position_embeddings=131072,
                         rope_parameters={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 256,
                                          "rope_theta": 10000.0})
    ck = tmp_path / "run" / "checkpoints" / "step_000004"
    ck.mkdir(parents=True)
    (ck / "hf_config.json").write_text(config.to_json_string())
    torch.manual_seed(0)
    state = LlamaForCausalLM(config).state_dict()
    monkeypatch.setattr(z, "get_fp32_state_dict_from_zero_checkpoint", lambda root, tag: dict(state))
    out = export_hf(str(ck), str(tmp_path / "run" / "hf_model"), owned=True)
    got = json.loads((tmp_path / "run" / "hf_model" / "config.json").read_text())
    assert got["max_position_embeddings"] == 2048 and out.endswith("hf_model")
    assert (got.get("rope_parameters") or got.get("rope_scaling"))["factor"] == 8.0


def test_the_export_has_a_model_card_without_local_paths(tmp_path, monkeypatch):
    """The export had no README.md (no model card: the Hub showed an empty page, base model unlinked). It writes one:
    the base model (a hub id in the front matter; a local folder by its name only), each stage's length, steps and
    RoPE, ulysses-longtrain; no absolute path of the run (export.json keeps those: how exports are recognised)."""
    import deepspeed.utils.zero_to_fp32 as z
    from transformers import LlamaConfig, LlamaForCausalLM

    from model_utils.export import base_named, export_hf, model_card

    yarn = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 256, "rope_theta": 10000.0}
    config = LlamaConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=16, rope_parameters=yarn)
    base = tmp_path / "models" / "My-Base"
    base.mkdir(parents=True)
    (base / "config.json").write_text(config.to_json_string())
    ck = tmp_path / "run" / "checkpoints" / "step_000006"
    ck.mkdir(parents=True)
    (ck / "hf_config.json").write_text(config.to_json_string())
    stages = [{"name": "s256", "max_seq_length": 256, "rope": None}, {"name": "s2k", "max_seq_length": 2048, "rope": yarn}]
    (ck / "trainer.json").write_text(json.dumps({"step": 6, "stage": 1, "tokens": 3072, "stage_names": ["s256", "s2k"],
                                                 "stage_steps": [3, 4], "config": {"max_seq_length": 256, "stages": stages}}))
    state = LlamaForCausalLM(config).state_dict()
    monkeypatch.setattr(z, "get_fp32_state_dict_from_zero_checkpoint", lambda root, tag: dict(state))
    export_hf(str(ck), str(tmp_path / "run" / "hf_model"), source=str(base), owned=True)
    card = (tmp_path / "run" / "hf_model" / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers\n---\n") and "`My-Base`" in card
    assert "| 0 | s256 | 256 | 3 | the base model's |" in card and "| 1 | s2k | 2048 | 3 | `{" in card  # 3 of 4 steps
    assert "ulysses-longtrain" in card and "float32" in card and str(tmp_path) not in card
    assert json.loads((tmp_path / "run" / "hf_model" / "export.json").read_text())["checkpoint"] == str(ck)
    hub = model_card(str(ck), "meta-llama/Llama-3.1-8B", config, "bfloat16", True, False)
    assert hub.startswith("---\nbase_model: meta-llama/Llama-3.1-8B\nlibrary_name: transformers\n---\n")
    cached = tmp_path / "hub" / "models--Qwen--Qwen2.5-7B" / "snapshots" / "abc"
    assert base_named(str(cached))[0] == "Qwen/Qwen2.5-7B" and base_named("tiny-llama")[0] is None


def test_a_chat_sfts_end_of_turn_is_added_to_the_stops(tmp_path):
    """add_stops: Qwen2.5-7B base's generation_config.json (eos 151643, <|endoftext|>) gets the <|im_end|> its SFT
    trained (151645), as Qwen's Instruct release lists both; a config without one is written from the model's ids;
    a stop already there is not repeated."""
    import types

    from model_utils.export import add_stops

    gen = tmp_path / "generation_config.json"
    gen.write_text(json.dumps({"bos_token_id": 151643, "eos_token_id": 151643, "do_sample": False}))
    assert add_stops(str(gen), None, [151645]) == [151645]
    assert json.loads(gen.read_text()) == {"bos_token_id": 151643, "eos_token_id": [151643, 151645], "do_sample": False}
    assert add_stops(str(gen), None, [151645]) == []
    fresh = tmp_path / "new" / "generation_config.json"
    fresh.parent.mkdir()
    assert add_stops(str(fresh), types.SimpleNamespace(bos_token_id=1, eos_token_id=2), [7]) == [7]
    assert json.loads(fresh.read_text())["eos_token_id"] == [2, 7]


def test_an_older_checkpoint_is_exported_beside_the_runs_hf_model(tmp_path, monkeypatch):
    """export_hf.py RUN/checkpoints/step_000175 when the run's newest is step_000200: it replaced RUN/hf_model (the
    run's final export), and evaluate.py RUN/hf_model then scored the older model. It goes to hf_model_step_000175;
    --out still says where."""
    import importlib.util
    import os

    spec = importlib.util.spec_from_file_location("export_hf", os.path.join(os.getcwd(), "scripts", "export_hf.py"))
    export = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(export)
    run = tmp_path / "run"
    for tag in ("step_000175", "step_000200"):
        (run / "checkpoints" / tag).mkdir(parents=True)
        (run / "checkpoints" / tag / "MANIFEST.json").write_text("{}")
    (run / "checkpoints" / "LATEST").write_text("step_000200\n")
    seen = {}
    monkeypatch.setattr(export.Checkpointer, "verify", lambda self, path: None)
    monkeypatch.setattr(export.Checkpointer, "read_trainer", staticmethod(lambda path: {
        "tokenizer": None, "reply_stops": [5], "trained_template": "{{ 'ChatML' }}"}))
    monkeypatch.setattr(export, "export_hf", lambda path, out, tok, source=None, owned=False, stops=None, identity=None, template=None, dtype="auto": seen.update(
        out=out, stops=stops, template=template, dtype=dtype) or out)
    assert export.main([str(run / "checkpoints" / "step_000175")]) == 0
    assert seen["out"] == str(run / "hf_model_step_000175")
    assert seen["stops"] == [5]  # the stops the run recorded in its checkpoint, as train.py's own export adds them
    assert seen["template"] == "{{ 'ChatML' }}"  # the template its rows were rendered with (the ChatML default)
    assert seen["dtype"] == "auto"  # the run's training precision, as train.py's own export writes
    assert export.main([str(run / "checkpoints" / "step_000175"), "--dtype", "fp32"]) == 0 and seen["dtype"] == "fp32"
    assert export.main([str(run / "checkpoints" / "step_000200")]) == 0 and seen["out"] == str(run / "hf_model")
    # `--checkpoint checkpoints/STAGE_0_s512` as docs/checkpoints.md writes it: the run's, from any folder (it was
    # read against the working directory: "not a complete checkpoint (no such folder)")
    (run / "checkpoints" / "STAGE_0_s512").write_text("step_000175\n")
    monkeypatch.chdir(tmp_path)
    assert export.main([str(run), "--checkpoint", "checkpoints/STAGE_0_s512"]) == 0
    assert seen["out"] == str(run / "hf_model_step_000175")


def test_the_export_writes_rope_also_as_transformers_4_reads_it(tmp_path):
    """transformers 5 writes rope_parameters only: a loader on 4.x (vLLM releases pinned to it) read rope_theta 10000
    and no scaling, serving an ABF stage's theta 8e6 model at 10000. The export adds rope_theta / rope_scaling (Gemma
    3: rope_local_base_freq and the global layers' scaling); transformers 5 reads the same RoPE back."""
    from transformers import AutoConfig

    from model_utils.export_config import legacy_rope

    tiny = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=64, vocab_size=128, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    cases = [(AutoConfig.for_model("llama", **tiny, rope_parameters={"rope_type": "default", "rope_theta": 8e6}),
              8e6, None, None),
             (AutoConfig.for_model("qwen2", **tiny, rope_parameters={**yarn, "rope_theta": 1e6}), 1e6, yarn, None),
             (AutoConfig.for_model("gemma3_text", **tiny, head_dim=16, rope_parameters={
                 "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                 "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
              1e6, {"rope_type": "linear", "factor": 8.0}, 1e4),
             (AutoConfig.for_model("phi3", **tiny, max_position_embeddings=131072, original_max_position_embeddings=4096,
                                   rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 8,
                                                 "long_factor": [4.0] * 8}),  # 4.x's Phi3Config takes these three only
              1e4, {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [4.0] * 8}, None)]
    for i, (config, theta, scaling, local) in enumerate(cases):
        out = tmp_path / str(i)
        config.save_pretrained(out)
        legacy_rope(str(out / "config.json"))
        raw = json.loads((out / "config.json").read_text())
        assert (raw["rope_theta"], raw["rope_scaling"], raw.get("rope_local_base_freq")) == (theta, scaling, local)
        back = AutoConfig.from_pretrained(out).rope_parameters  # (4.x's `type` key kept beside rope_type: unread)
        assert {k: v for k, v in back.items() if k != "type"} == config.rope_parameters


def test_a_checkpoint_rotated_away_while_it_is_exported_is_said_in_one_line(tmp_path, monkeypatch, capsys):
    """export_hf.py of the second-newest checkpoint of a running job: its rotation (--save_total_limit 2) moved
    step_N into checkpoints/.trash between the verification and DeepSpeed's consolidation: a FileNotFoundError
    traceback. One line now; an OSError while the checkpoint is still there is not hidden."""
    import importlib.util
    import os

    spec = importlib.util.spec_from_file_location("export_hf", os.path.join(os.getcwd(), "scripts", "export_hf.py"))
    export = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(export)
    run = tmp_path / "run"
    ck = run / "checkpoints" / "step_000010"
    ck.mkdir(parents=True)
    (ck / "MANIFEST.json").write_text("{}")
    monkeypatch.setattr(export.Checkpointer, "verify", lambda self, path: None)
    monkeypatch.setattr(export.Checkpointer, "read_trainer", staticmethod(lambda path: {"tokenizer": None}))

    def full_disk(path, out, *args, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export, "export_hf", full_disk)
    with pytest.raises(OSError):
        export.main([str(ck)])

    def rotated(path, out, *args, **kw):  # what training/rotation.Trash.discard does, then zero_to_fp32 reads
        (run / "checkpoints" / ".trash").mkdir()
        os.replace(ck, run / "checkpoints" / ".trash" / "step_000010.1")
        raise FileNotFoundError(2, "No such file or directory", str(ck / "global_step10"))

    monkeypatch.setattr(export, "export_hf", rotated)
    assert export.main([str(ck)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: step_000010 was rotated away by the running job while it was read "
                          "(--save_total_limit)") and err.count("\n") == 1
    # gone during the verification (verify read "missing FILE"): the same line, not "not a complete checkpoint"
    os.replace(run / "checkpoints" / ".trash" / "step_000010.1", ck)

    def verify_then_rotated(self, path):
        os.replace(ck, run / "checkpoints" / ".trash" / "step_000010.2")
        return "missing zero_pp_rank_0_mp_rank_00_optim_states.pt"

    monkeypatch.setattr(export.Checkpointer, "verify", verify_then_rotated)
    assert export.main([str(ck)]) == 2 and "was rotated away" in capsys.readouterr().err
    assert export.main([str(run), "--checkpoint", str(ck)]) == 2  # gone before it started: as before
    assert "not a complete checkpoint (no such folder)" in capsys.readouterr().err
