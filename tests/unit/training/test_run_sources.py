"""Where a run's weights and data come from (training/startup.check_sources, check_chat_data, source_lines).

Before, the shipped 7-20B recipes (`model_name_or_path: llama3-8b`, a preset: model_utils/build.py builds its shape
with random weights; `dataset_path: null`, the built-in demo corpus and its 2000-token tokenizer), launched as the
docs show, trained a random 8B on the demo corpus for hours, silently, and --dry_run said nothing of it; the SFT
recipe passed --dry_run and refused only once its engine was built. Now a run refuses both in one line before the
model loads unless `from_scratch: true` says random weights are meant; the dry run prints `weights:` and `data:`
and still plans the recipes anywhere. In-process (training.startup.load_run_config / dry_run), no launch."""

from __future__ import annotations

import json

import pytest

from tests.distributed import ROOT
from training.startup import dry_run, load_run_config

LARGE = ["llama3_8b_128k_to_1m", "qwen25_7b_128k_to_1m", "gpt_oss_20b_128k_to_1m", "qwen25_7b_instruct_sft_128k"]


def start(tmp_path, *args):
    """What a launched run decides before its process group and any weight (train.py: load_run_config)."""
    return load_run_config([*args, "--output_dir", str(tmp_path / "out")])


@pytest.fixture
def text(tmp_path):
    p = tmp_path / "docs.jsonl"
    p.write_text('{"text": "hello"}\n')
    return str(p)


@pytest.mark.parametrize("recipe", LARGE)
def test_a_shipped_large_recipe_launched_as_is_is_refused_in_one_line(tmp_path, recipe):
    with pytest.raises(ValueError) as e:
        start(tmp_path, "--config", f"{ROOT}/recipes/{recipe}.yaml")
    msg = str(e.value)
    assert "\n" not in msg and "is a preset: its shape with random weights" in msg, msg
    assert "dataset_path null is the built-in demo corpus" in msg and "from_scratch: true" in msg, msg


@pytest.mark.parametrize("recipe", LARGE)
def test_a_shipped_large_recipe_plans_and_says_where_weights_and_data_come_from(capsys, recipe):
    capsys.readouterr()
    dry_run(*load_run_config(["--dry_run", "--config", f"{ROOT}/recipes/{recipe}.yaml"]))
    out = capsys.readouterr().out
    assert "\nweights: random init (preset " in out and "\ndata: the built-in demo corpus" in out, out
    assert out.count("memory plan:") >= 1
    if "sft" in recipe:  # the demo corpus has no chats: said here, refused by a run
        assert "it has no chat documents for stage(s) ['sft128k'] kind sft, a run refuses it" in out, out


def test_a_large_preset_trains_only_from_scratch(tmp_path, text):
    with pytest.raises(ValueError, match=r"^model_name_or_path llama3-8b is a preset: .* or set from_scratch: true "
                                         r"\(--from_scratch\) to train random weights on purpose$"):
        start(tmp_path, "--model_name_or_path", "llama3-8b", "--dataset_path", text)
    cfg, _ = start(tmp_path, "--model_name_or_path", "llama3-8b", "--dataset_path", text, "--from_scratch")
    assert cfg.from_scratch


def test_the_demo_corpus_needs_a_tiny_model_or_from_scratch(tmp_path, text):
    from model_utils.build import preset_config

    big = tmp_path / "qwen7b"
    preset_config("qwen2.5-7b").save_pretrained(big)  # a folder (its config: the run reads no weight here)
    (big / "model.safetensors").touch()  # a weight file is there (a folder without one is refused at start-up)
    with pytest.raises(ValueError, match=r"^dataset_path null is the built-in demo corpus .* not data for "):
        start(tmp_path, "--model_name_or_path", str(big))
    start(tmp_path, "--model_name_or_path", str(big), "--dataset_path", text)
    start(tmp_path, "--model_name_or_path", str(big), "--from_scratch")  # the GPU benchmarks' saved random models
    # the demos and tests: tiny presets and tiny folders on the demo corpus, as before; and bench/checkpoint.py's and
    # bench/preempt.py's 200M-parameter random models, whose 2048-entry embedding was made for the demo tokenizer
    bench = tmp_path / "bench"
    preset_config("tiny-llama", hidden_size=1024, intermediate_size=2752, num_hidden_layers=16, num_attention_heads=8,
                  num_key_value_heads=8, vocab_size=2048).save_pretrained(bench)
    (bench / "model.safetensors").touch()
    for model in ("tiny-llama", "tiny-qwen2", f"{ROOT}/recipes/base/tiny_passkey256", str(bench)):
        start(tmp_path, "--model_name_or_path", model)


def test_an_sft_stage_needs_chat_data(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"^stage\(s\) \['main'\] kind sft train on chat documents, and dataset_path "
                                         r"null is the built-in demo corpus"):
        start(tmp_path, "--data_kind", "sft")
    prepared = tmp_path / "prep"  # a prepared folder of text only: its manifest lists no loss mask
    prepared.mkdir()
    (prepared / "manifest.json").write_text(json.dumps({"chunks": [{"tokens": "tokens-s00000-c000000.bin"}]}))
    for args in ([], ["--dry_run"]):
        with pytest.raises(ValueError, match=r"kind sft: the dataset has no chat documents \(no loss mask in "):
            start(tmp_path, "--data_kind", "sft", "--dataset_path", str(prepared), *args)
    (prepared / "manifest.json").write_text(json.dumps({"chunks": [{"mask": "mask-s00000-c000000.bin"}]}))
    cfg, model = start(tmp_path, "--data_kind", "sft", "--dataset_path", str(prepared), "--dry_run",
                       "--max_seq_length", "256", "--max_steps", "1")
    capsys.readouterr()
    dry_run(cfg, model)
    assert f"\ndata: {prepared} (a prepared folder: chat documents with a loss mask); document masking on " \
           "(--reset_position_ids auto)\n" in capsys.readouterr().out
