"""W&B in a container without a home directory (a `--user 12345` with no passwd entry, HOME unset): wandb.init read
~/.config/wandb/settings through pathlib's expanduser and raised "Could not determine home directory" (seen with the
installed wandb, /tmp/containers' wb.py), re-raised by MetricsLogger: exit 1 minutes into the start. Now W&B's own
folders go under WANDB_DIR (or the output folder) and it works; and any wandb.init failure with nothing left to fall
back to turns W&B off in one line, never the run. On the stand-in `wandb` of test_metrics_wandb.py. < 1 s."""

from __future__ import annotations

import os
import pathlib
import pwd
import sys

from tests.unit.training.test_metrics_wandb import STEP, fake_wandb, wandb_env  # noqa: F401  (a fixture)
from training.metrics import MetricsLogger


def no_home(monkeypatch) -> None:
    def unknown(uid):
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.delenv("HOME", raising=False)
    monkeypatch.setattr(pwd, "getpwuid", unknown)
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.delenv(var, raising=False)


def test_without_a_home_wandb_keeps_its_folders_under_the_output_folder(tmp_path, wandb_env, capsys):  # noqa: F811
    no_home(wandb_env)
    assert os.path.expanduser("~") == "~"  # as in the container
    inits = fake_wandb(wandb_env)
    init = sys.modules["wandb"].init

    def like_wandb(**kw):  # wandb/sdk/wandb_setup.py _load_settings: its settings file, then the run
        if not os.environ.get("WANDB_CONFIG_DIR"):
            pathlib.Path("~", ".config", "wandb", "settings").expanduser()  # raises without a home
        return init(**kw)

    wandb_env.setattr(sys.modules["wandb"], "init", like_wandb)
    m = MetricsLogger(str(tmp_path), True, "wandb", None, None, {}, 10, False)
    assert m.wandb is not None and len(inits) == 1
    assert os.environ["WANDB_CONFIG_DIR"] == str(tmp_path / "wandb" / "home" / "config")
    assert os.environ["WANDB_CACHE_DIR"].startswith(str(tmp_path / "wandb" / "home"))
    said = [ln for ln in capsys.readouterr().out.splitlines() if "no home directory" in ln]
    assert len(said) == 1 and "WANDB_CONFIG_DIR" in said[0]
    m.log({"step": 1, **STEP})
    assert m.wandb.history[1]["loss"] == 1.0
    m.close()


def test_a_wandb_that_cannot_start_offline_is_turned_off_and_the_run_goes_on(tmp_path, wandb_env, capsys):  # noqa: F811
    fake_wandb(wandb_env)

    def broken(**kw):
        raise RuntimeError("wandb-core failed to start\nmore")

    wandb_env.setattr(sys.modules["wandb"], "init", broken)
    m = MetricsLogger(str(tmp_path), True, "wandb", None, None, {}, 10, False)  # offline (no key): no fallback left
    assert m.wandb is None
    said = [ln for ln in capsys.readouterr().out.splitlines() if "W&B could not start" in ln]
    assert len(said) == 1 and "RuntimeError: wandb-core failed to start" in said[0] and "metrics.jsonl" in said[0]
    m.log({"step": 1, **STEP})
    assert (tmp_path / "metrics.jsonl").read_text().count('"step": 1') == 1
    m.close()
