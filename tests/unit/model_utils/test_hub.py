"""A Hugging Face hub id resolved offline from a local hub cache (a fake one in tmp, huggingface_hub's layout): the
snapshot `refs/main` points at, every environment variable in huggingface_hub's order, and one line naming the
download command when the model is not there (model_utils/hub.py)."""

from __future__ import annotations

import json
import os

import pytest

from model_utils import hub
from model_utils.build import load_hf_config, preset_config, resolve_model

HUB_ID = "meta-llama/Meta-Llama-3-8B"


def fill_cache(cache, hub_id: str = HUB_ID, commit: str = "8cde5ca8380496c9a6cc7ef3a8b46a0372a1d920",
               weights=("model.safetensors",), main: bool = True, preset: str = "tiny-llama") -> str:
    """huggingface_hub's layout: models--org--name/{refs/main, snapshots/<commit>/...}; returns the snapshot."""
    repo = os.path.join(str(cache), "models--" + hub_id.replace("/", "--"))
    snap = os.path.join(repo, "snapshots", commit)
    os.makedirs(snap)
    if main:
        os.makedirs(os.path.join(repo, "refs"))
        with open(os.path.join(repo, "refs", "main"), "w") as fh:
            fh.write(commit)  # no newline, as huggingface_hub writes it
    preset_config(preset).save_pretrained(snap)
    for w in weights:
        with open(os.path.join(snap, w), "w") as fh:
            fh.write("{}" if w.endswith(".json") else "")
    return snap


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    for k in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return monkeypatch


def test_a_hub_id_in_the_cache_is_its_snapshot(clean_env, tmp_path):
    """The seed guide's `--model_name_or_path meta-llama/Meta-Llama-3-8B` on an offline node whose cache holds it
    (HF_HOME): the snapshot folder refs/main names; its config loads. (Before: refused, 'hub downloads are not
    used'.)"""
    clean_env.setenv("HF_HOME", str(tmp_path / "hf"))
    snap = fill_cache(tmp_path / "hf" / "hub")
    assert resolve_model(HUB_ID) == snap
    assert load_hf_config(HUB_ID).model_type == "llama"
    assert hub.commit_of(snap) == f"{HUB_ID}@8cde5ca8380496c9a6cc7ef3a8b46a0372a1d920"


@pytest.mark.parametrize("var, sub", [("HF_HUB_CACHE", ""), ("HUGGINGFACE_HUB_CACHE", ""), ("HF_HOME", "hub"),
                                      ("XDG_CACHE_HOME", "huggingface/hub"), (None, ".cache/huggingface/hub")])
def test_the_cache_is_where_huggingface_hub_looks(clean_env, tmp_path, var, sub):
    root = tmp_path / "home" if var is None else tmp_path / "c"
    if var:
        clean_env.setenv(var, str(root))
    assert hub.hub_cache() == (os.path.join(str(root), sub) if sub else str(root))


def test_a_model_not_in_the_cache_is_refused_naming_the_download(clean_env, tmp_path):
    clean_env.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ValueError) as e:
        resolve_model(HUB_ID)
    line = str(e.value)
    assert "\n" not in line and f"`hf download {HUB_ID}`" in line  # the pinned hub installs `hf` only
    assert "huggingface-cli" not in line
    assert str(tmp_path / "hub") in line  # where it looked


def test_an_interrupted_download_is_refused(clean_env, tmp_path):
    """The config there but a weight shard missing (its blob gone): refused for training, enough for a dry run."""
    clean_env.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    snap = fill_cache(tmp_path / "hub", weights=())
    with open(os.path.join(snap, "model.safetensors.index.json"), "w") as fh:
        json.dump({"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}, fh)
    open(os.path.join(snap, "model-00001-of-00002.safetensors"), "w").close()
    with pytest.raises(ValueError, match=r"lacks model-00002-of-00002.safetensors .*`hf download "):
        resolve_model(HUB_ID)
    assert resolve_model(HUB_ID, weights=False) == snap


def test_a_tokenizer_only_repository_is_refused_naming_its_folder(clean_env, tmp_path):
    """`--tokenizer_name_or_path org/tokenizer` whose cached snapshot holds a tokenizer and no config.json was refused
    as "an interrupted download?" with the download command (it was whole). The line names the folder to pass."""
    clean_env.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    snap = fill_cache(tmp_path / "hub", weights=("tokenizer.json",))
    os.remove(os.path.join(snap, "config.json"))
    with pytest.raises(ValueError) as e:
        hub.resolve(HUB_ID, weights=False, flag="--tokenizer_name_or_path")
    assert "\n" not in str(e.value) and "tokenizer-only" in str(e.value) and str(e.value).endswith(snap)
    assert hub.resolve(snap, weights=False, flag="--tokenizer_name_or_path") == snap  # as it says
    os.remove(os.path.join(snap, "tokenizer.json"))
    with pytest.raises(ValueError, match="no config.json .*interrupted download"):
        hub.resolve(HUB_ID, weights=False, flag="--tokenizer_name_or_path")


def test_without_refs_main_one_snapshot_is_taken_several_are_refused(clean_env, tmp_path):
    clean_env.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    snap = fill_cache(tmp_path / "hub", commit="aaa", main=False)
    assert resolve_model(HUB_ID) == snap
    os.makedirs(os.path.join(os.path.dirname(snap), "bbb"))
    with pytest.raises(ValueError, match="no refs/main and 2 snapshots"):
        resolve_model(HUB_ID)


def test_local_folders_and_presets_are_not_looked_up(clean_env, tmp_path):
    assert resolve_model("tiny-llama") == "tiny-llama"
    assert resolve_model(str(tmp_path)) == str(tmp_path)


def test_every_rank_must_read_the_same_commit(monkeypatch):
    """Node-local caches filled at different times: the commits every rank resolved are gathered and every rank
    refuses alike (the same gathered list, the same line)."""
    from base import comm

    a = "/c/models--org--m/snapshots/aaa"
    monkeypatch.setattr(comm, "all_gather_object", lambda mine: [mine, mine])
    hub.check_same_snapshot(a)
    monkeypatch.setattr(comm, "all_gather_object", lambda mine: [mine, ("org/m@bbb", *mine[1:])])
    with pytest.raises(ValueError, match=r"rank 0 reads org/m@aaa .* rank 1 reads org/m@bbb"):
        hub.check_same_snapshot(a)


def test_every_rank_must_read_the_same_config(monkeypatch, tmp_path):
    """A local folder (a node-local copy staged by a prolog) has no commit: two ranks reading different config.json
    (rope_theta 500000 on one node, 10000 on another) passed, and that node's ranks trained other positions. Now the
    same one-line refusal on every rank, naming the host; a re-saved copy (other key order, spacing) passes."""
    import json

    from base import comm

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    (a / "config.json").write_text(json.dumps({"model_type": "llama", "rope_theta": 500000.0}))
    (b / "config.json").write_text(json.dumps({"rope_theta": 500000.0, "model_type": "llama"}, indent=2))
    other = ("None", hub.config_digest(str(b)), "node7")
    monkeypatch.setattr(comm, "all_gather_object", lambda mine: [mine, (mine[0], *other[1:])])
    hub.check_same_snapshot(str(a))  # the same config, saved otherwise
    (b / "config.json").write_text(json.dumps({"model_type": "llama", "rope_theta": 10000.0}))
    other = (None, hub.config_digest(str(b)), "node7")
    with pytest.raises(ValueError, match=r"rank 1 \(host node7\) reads a config.json unlike rank 0's"):
        hub.check_same_snapshot(str(a))


@pytest.mark.parametrize("text, shown", [
    ("{bad", "is not a valid JSON file"),  # transformers' OSError traceback before
    ('{"model_type": "foo_bar_lm", "hidden_size": 8}', "model type `foo_bar_lm`"),  # its multi-line ValueError before
])
def test_a_model_folder_whose_config_does_not_load_is_one_line(tmp_path, text, shown):
    from model_utils.build import load_hf_config

    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match=rf"^--model_name_or_path {tmp_path}: its config.json does not load") as e:
        load_hf_config(str(tmp_path))
    assert shown in str(e.value) and "\n" not in str(e.value)
