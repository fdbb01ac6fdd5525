"""model_utils/hub.py hub_cache where this process has no home directory (HOME unset and its uid not in the passwd
file: a container's `--user`): it looked in a relative '~/.cache/huggingface/hub' under the working directory and
refused the model as "not in the local Hugging Face cache", naming that relative path. Now one line saying there is
no home, naming HF_HOME / HF_HUB_CACHE; and `~` / `$VAR` in them expanded as huggingface_hub expands them."""

from __future__ import annotations

import os
import pwd

import pytest

from model_utils import hub
from model_utils.build import resolve_model
from tests.unit.model_utils.test_hub import HUB_ID, clean_env, fill_cache  # noqa: F401  (a fixture)


def test_without_a_home_the_refusal_says_so_naming_hf_home(clean_env, tmp_path):  # noqa: F811
    def unknown(uid):
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    clean_env.delenv("HOME")
    clean_env.setattr(pwd, "getpwuid", unknown)
    with pytest.raises(ValueError) as e:
        resolve_model(HUB_ID)
    line = str(e.value)
    assert "\n" not in line and "home directory this process has none of" in line and "HF_HOME" in line and "HF_HUB_CACHE" in line
    clean_env.setenv("HF_HOME", str(tmp_path / "hf"))  # the variable it names: the model is found
    snap = fill_cache(tmp_path / "hf" / "hub")
    assert resolve_model(HUB_ID) == snap


def test_a_tilde_or_variable_in_hf_home_is_expanded_as_huggingface_hub_does(clean_env, tmp_path):  # noqa: F811
    clean_env.setenv("HF_HOME", "~/hf")
    assert hub.hub_cache() == os.path.join(str(tmp_path / "home"), "hf", "hub")
    clean_env.setenv("SCRATCH", str(tmp_path / "s"))
    clean_env.setenv("HF_HUB_CACHE", "$SCRATCH/hub")
    assert hub.hub_cache() == str(tmp_path / "s" / "hub")
