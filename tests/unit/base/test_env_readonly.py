"""base/env.py check_writable_defaults: a checkout this user cannot write (an Apptainer SIF, readOnlyRootFilesystem,
pyxis --container-readonly, another user's checkout) with TORCH_EXTENSIONS_DIR / ULYSSES_CACHE unset failed at the
first write into its .cache, minutes in: torch's `lock` file even to load a built op (OSError EROFS, exit 1, which
slurm.sbatch reads as a bug), then .cache/demo or .cache/prepared/<tmp>. Now one line at start naming both variables,
an input error (exit 2). os.access is faked: root writes through any mode, and a read-only mount needs privileges."""

from __future__ import annotations

import os

import pytest

from base import env as base_env
from training.job import _is_input_error


def read_only_checkout(monkeypatch, under: str = base_env.CHECKOUT) -> None:
    real = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: not str(path).startswith(under) and real(path, mode))


def test_a_read_only_checkout_is_refused_in_one_line_naming_both_variables(monkeypatch):
    read_only_checkout(monkeypatch)
    with pytest.raises(ValueError) as e:
        base_env.check_writable_defaults(env={})
    line = str(e.value)
    assert "\n" not in line and base_env.CHECKOUT in line
    assert "set TORCH_EXTENSIONS_DIR (" in line and " and ULYSSES_CACHE (" in line and "can write" in line
    assert _is_input_error(e.value)  # our own refusal: exit 2 on every rank, no traceback (training/job.py)
    with pytest.raises(ValueError, match="set TORCH_EXTENSIONS_DIR"):  # configure()'s own default: unset too
        base_env.check_writable_defaults(env={"TORCH_EXTENSIONS_DIR": base_env.EXTENSIONS_DIR})
    with pytest.raises(ValueError) as e:  # a prepared --dataset_path reads no cache: only the ops' folder
        base_env.check_writable_defaults(need_cache=False, env={})
    assert "TORCH_EXTENSIONS_DIR" in str(e.value) and "ULYSSES_CACHE" not in str(e.value)
    with pytest.raises(ValueError) as e:
        base_env.check_writable_defaults(env={"TORCH_EXTENSIONS_DIR": "/tmp/ext"})
    assert "TORCH_EXTENSIONS_DIR" not in str(e.value) and "ULYSSES_CACHE" in str(e.value)
    base_env.check_writable_defaults(env={"TORCH_EXTENSIONS_DIR": "/tmp/ext", "ULYSSES_CACHE": "/tmp/c"})  # both moved


def test_a_writable_checkout_passes_and_an_op_folder_of_another_user_does_not(monkeypatch, tmp_path):
    base_env.check_writable_defaults(env={})  # this checkout, writable here
    ext = tmp_path / "ext"
    (ext / "cpu_adam").mkdir(parents=True)  # built by another user: its `lock` goes in there at every load
    monkeypatch.setattr(base_env, "EXTENSIONS_DIR", str(ext))
    read_only_checkout(monkeypatch, str(ext / "cpu_adam"))
    with pytest.raises(ValueError, match="set TORCH_EXTENSIONS_DIR"):
        base_env.check_writable_defaults(need_cache=False, env={})


def test_a_run_start_refuses_a_read_only_checkout_before_any_work(monkeypatch, tmp_path):
    """training/startup.load_run_config calls it after the flags, before the model's config is read; a dry run plans
    only and writes nothing there: not refused."""
    from training import startup

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.delenv("ULYSSES_CACHE", raising=False)
    read_only_checkout(monkeypatch)
    read = []
    monkeypatch.setattr(startup, "load_hf_config", lambda *a, **k: read.append(a) or (_ for _ in ()).throw(KeyError))
    with pytest.raises(ValueError, match="set TORCH_EXTENSIONS_DIR .* and ULYSSES_CACHE"):
        startup.load_run_config(["--output_dir", str(tmp_path / "out")])
    assert read == []
    with pytest.raises(KeyError):  # the dry run went on to the model's config
        startup.load_run_config(["--output_dir", str(tmp_path / "out"), "--dry_run"])
