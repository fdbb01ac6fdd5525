"""scripts/evaluate.py's reading of what a user names, before any model is built: a hub id as train.py takes it (its
snapshot in the local cache), and a Hugging Face folder's own tokenizer before a sentencepiece file beside it."""

from __future__ import annotations

import os

import pytest

from scripts.evaluate import describe, parse_args, settings
from tests.unit.model_utils.test_hub import HUB_ID, clean_env, fill_cache  # noqa: F401 (clean_env: a fixture)

BASE = os.path.join(os.path.dirname(__file__), "..", "..", "..", "recipes", "base", "tiny_passkey256")


def test_a_hub_id_is_its_snapshot_in_the_local_cache(clean_env, tmp_path):  # noqa: F811
    """`evaluate.py meta-llama/Meta-Llama-3-8B --compare RUN` (the base a run started from, by the id train.py took):
    was 'no such file or folder'."""
    clean_env.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    snap = fill_cache(tmp_path / "hub")
    a = parse_args([HUB_ID, "--compare", HUB_ID, "--lengths", "256", "--output_dir", str(tmp_path / "out")])
    settings(a)
    assert a.model == snap and a.compare == snap
    a = parse_args(["acme/absent", "--lengths", "256", "--output_dir", str(tmp_path / "out")])
    with pytest.raises(ValueError, match="MODEL acme/absent: not a local folder, a preset, nor in the local Hugging "
                                         "Face cache"):
        settings(a)


def test_a_folders_own_tokenizer_before_a_sentencepiece_file_beside_it(tmp_path):
    """Mistral, Llama 2 and Gemma snapshots ship tokenizer.json (its chat template, its control tokens) and
    tokenizer.model: the .model was taken (--chat on refused, the control tokens split as text)."""
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer.model").write_text("")
    assert describe(str(tmp_path), None)["tokenizer"] == str(tmp_path / "tokenizer.model")  # alone: taken
    (tmp_path / "tokenizer.json").write_text("{}")
    assert describe(str(tmp_path), None)["tokenizer"] == str(tmp_path)
    assert describe(str(tmp_path), "given")["tokenizer"] == "given"


def test_a_config_that_is_not_utf8_is_one_line(tmp_path):
    """A model folder whose config.json an editor saved as UTF-16: a UnicodeDecodeError traceback from rank 0."""
    (tmp_path / "config.json").write_bytes('{"model_type": "llama"}'.encode("utf-16"))
    with pytest.raises(ValueError, match=f"^{tmp_path}/config.json: not UTF-8 text: save it as UTF-8$"):
        describe(str(tmp_path), None)
    (tmp_path / "config.json").write_text('{"model_type": ')
    with pytest.raises(ValueError, match=f"^{tmp_path}/config.json: not valid JSON"):
        describe(str(tmp_path), None)


def test_a_run_folders_latest_that_is_not_text_is_one_line(tmp_path):
    """A run folder whose checkpoints/LATEST is not UTF-8: a UnicodeDecodeError traceback from rank 0."""
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "LATEST").write_bytes(b"\xff\xfes\x00")
    with pytest.raises(ValueError, match=r"not a Hugging Face folder \(no config.json\), a checkpoint") as e:
        describe(str(tmp_path), None)
    assert "\n" not in str(e.value)
