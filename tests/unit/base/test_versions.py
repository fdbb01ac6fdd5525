"""base/versions.py: an installed version outside the range the code needs stops the tool in one line (the packages,
the versions found, the ranges, the pip command) with exit 2; a version inside passes, local and pre-release versions
included (`2.13.0+cpu`, NGC's `2.6.0a0+git`). Each floor is at least the release of the API the code calls (FLOORS).
`importlib.metadata.version` is a stand-in; pure, < 1 s."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys

import pytest

from base import versions

FITS = {"torch": "2.13.0+cpu", "deepspeed": "0.19.8", "transformers": "5.23.0"}

# The floors' reasons: (package, the first release with what the code needs, what and where). An audit installed the
# old floors (transformers 5.0, deepspeed 0.19.5) and found each of these missing there.
FLOORS = [
    ("transformers", "5.23", "activation_checkpointing_enable(every_n_layers=) (model_utils/memory.py): 5.0-5.22 "
                             "crash building the engine of any run that checkpoints"),
    ("transformers", "5.6", "WeightConverter.was_used (model_utils/export.py as_loaded: MoE and Gemma 3 exports)"),
    ("transformers", "5.0", "config.rope_parameters (a stage's RoPE; 4.x trains it unscaled, silently)"),
    ("deepspeed", "0.19.8", "triton imported lazily: 0.19.5-0.19.7 fail `import deepspeed` on a GPU-less node with "
                            "a CUDA torch (deepspeedai/DeepSpeed#7028)"),
    ("deepspeed", "0.19.5", "UlyssesSPAttentionHF, parallel_state_sp"),
    ("torch", "2.6", "sdpa_kernel(..., set_priority=True) (model_utils/attention_pick.py)"),
]


@pytest.mark.parametrize("name, low, why", FLOORS, ids=[f"{n}>={low}" for n, low, _ in FLOORS])
def test_each_floor_is_at_least_the_release_of_the_api_it_needs(name, low, why):
    """A review: transformers>=5.0 and deepspeed>=0.19.5 were claimed, and 5.0-5.22 lack every_n_layers (every run
    with activation checkpointing crashed at the engine build), < 5.6 lacks was_used, 0.19.5-0.19.7 cannot be imported
    on a login node. A floor below what the code calls passes start-up and fails later, or trains wrong."""
    have = versions._pad(versions.release(versions.RANGES[name][0]))
    assert have >= versions._pad(versions.release(low)), f"{versions.spec(name)} is below {low}: {why}"


def test_the_installed_versions_are_inside_the_ranges():  # the pins the tests run with satisfy the claimed ranges
    assert {n: versions.problem(n) for n in versions.RANGES} == dict.fromkeys(versions.RANGES)
    assert versions.python_problem() is None


def installed(monkeypatch, **over):
    found = {**FITS, **over}

    def version(name):
        if found.get(name) is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return found[name]

    monkeypatch.setattr(importlib.metadata, "version", version)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)  # a package without metadata does not import
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("SLURM_LOCALID", raising=False)


@pytest.mark.parametrize("over", [{}, {"torch": "2.6.0a0+ecf3bae40a"}, {"torch": "2.6.0"}, {"deepspeed": "0.19.8"},
                                  {"transformers": "5.23.0"}, {"transformers": "5.24.0.dev0"}, {"torch": "3.0.0"}],
                         ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()) or "the-pins")
def test_a_version_inside_its_range_passes(monkeypatch, capsys, over):
    installed(monkeypatch, **over)
    versions.check()
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("over, says", [
    ({"transformers": "4.57.6"}, "transformers 4.57.6 is installed, outside transformers>=5.23,<6"),
    ({"transformers": "5.22.2"}, "transformers 5.22.2 is installed, outside transformers>=5.23,<6"),
    ({"transformers": "6.0.0rc1"}, "transformers 6.0.0rc1 is installed, outside transformers>=5.23,<6"),
    ({"deepspeed": "0.19.7"}, "deepspeed 0.19.7 is installed, outside deepspeed>=0.19.8,<0.20"),
    ({"deepspeed": "0.20.0"}, "deepspeed 0.20.0 is installed, outside deepspeed>=0.19.8,<0.20"),
    ({"torch": "2.5.1+cu124"}, "torch 2.5.1+cu124 is installed, outside torch>=2.6"),
    ({"deepspeed": None}, "deepspeed is not installed"),
])
def test_a_version_outside_is_one_line_naming_it_and_the_fix_and_exit_2(monkeypatch, capsys, over, says):
    installed(monkeypatch, **over)
    with pytest.raises(SystemExit) as e:
        versions.check()
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and says in err, err
    name = next(iter(over))
    assert f"-m pip install '{versions.spec(name)}'" in err
    assert ("build for this cluster's CUDA first" in err) == (name == "torch")  # a review: PyPI's torch is one CUDA's


def test_torch_is_installed_first_for_the_clusters_cuda_then_the_rest(monkeypatch, capsys):
    """A review: the line said `pip install 'torch>=2.6' 'deepspeed...'`, which on a cluster pulls PyPI's torch, built
    for one CUDA, over the cluster's (requirements.txt's header: the cluster's CUDA torch first, then the rest)."""
    installed(monkeypatch, torch="2.5.1+cu124", deepspeed="0.19.5")
    with pytest.raises(SystemExit):
        versions.check()
    err = capsys.readouterr().err
    cuda, rest = err.index("--index-url https://download.pytorch.org/whl/"), err.index("pip install 'deepspeed>=")
    assert err.count("\n") == 1 and "'torch>=2.6' 'deepspeed" not in err and cuda < rest, err


def test_a_python_older_than_the_pins_need_is_refused_in_the_same_line(monkeypatch, capsys):
    """A review: requires-python said >=3.10, but the pins (transformers 5.21+, numpy 2.4, pyarrow 26) need 3.11, and
    start-up never looked at the interpreter. pip cannot fix it: the line says to make the environment anew."""
    installed(monkeypatch, transformers="5.0.0")
    monkeypatch.setattr(sys, "version_info", (3, 10, 13, "final", 0))
    monkeypatch.setenv(versions.NEWER, "warn")  # never waives it
    with pytest.raises(SystemExit) as e:
        versions.check()
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("error: Python 3.10.13 is running, outside "
                                                                         "python>=3.11; transformers 5.0.0"), err
    assert "PYTHON=python3.11 scripts/setup.sh" in err and "pip install" not in err


def test_every_package_outside_is_in_the_one_line_and_only_those_checked_count(monkeypatch, capsys):
    installed(monkeypatch, transformers="4.57.6", torch="2.4.0")
    with pytest.raises(SystemExit):
        versions.check()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "torch 2.4.0 is installed" in err and "transformers 4.57.6" in err
    assert "-m pip install 'transformers>=5.23,<6'" in err and "'deepspeed" not in err
    installed(monkeypatch, deepspeed="0.18.0", torch="2.4.0")
    versions.check(["transformers"])  # scripts/prepare_data.py: the tokenizer's package alone
    assert capsys.readouterr().err == ""


def test_a_newer_release_runs_with_a_warning_only_where_asked_and_a_floor_never(monkeypatch, capsys):
    """A DeepSpeed or transformers past the tested top is untested, not known broken: ULYSSES_NEWER_PACKAGES=warn
    lets it run with one warning (the refusal names it); a version under a floor (4.x's RoPE) is never waived."""
    installed(monkeypatch, deepspeed="0.20.1")
    monkeypatch.delenv(versions.NEWER, raising=False)
    with pytest.raises(SystemExit):
        versions.check()
    assert f"or {versions.NEWER}=warn to try the newer one untested" in capsys.readouterr().err
    monkeypatch.setenv(versions.NEWER, "warn")
    versions.check()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("warning: deepspeed 0.20.1 is installed"), err
    for old in ({"transformers": "4.57.6"}, {"deepspeed": None}, {"deepspeed": "0.20.1", "torch": "2.4.0"}):
        installed(monkeypatch, **old)
        with pytest.raises(SystemExit):
            versions.check()
        assert "untested" not in capsys.readouterr().err


def test_an_importable_package_without_metadata_is_said_not_refused(monkeypatch, capsys):
    """A DeepSpeed checkout on PYTHONPATH has no dist-info: it imports, so its unknown version is a warning (a review:
    it was refused as not installed); a package that neither has metadata nor imports is refused."""
    installed(monkeypatch, deepspeed=None)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "deepspeed" else None)
    versions.check()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("warning: deepspeed import(s) but carry no package metadata"), err
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit):
        versions.check()
    assert "deepspeed is not installed" in capsys.readouterr().err


def test_a_checkout_without_metadata_is_held_to_its_floor_by_its_source_version(tmp_path, monkeypatch, capsys):
    """A review: a transformers 4.x checkout on PYTHONPATH (no dist-info) ran with a warning, the case the floor is
    for. Its __init__.py's __version__ is read as text and checked; a checkout writing none is said, not refused."""
    import types

    pkg = tmp_path / "transformers"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('"""A checkout."""\n__version__ = "4.57.6"\n')
    installed(monkeypatch, transformers=None)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: types.SimpleNamespace(
        origin=str(pkg / "__init__.py")) if name == "transformers" else None)
    with pytest.raises(SystemExit):
        versions.check()
    assert "transformers 4.57.6 is installed, outside transformers>=5.23,<6" in capsys.readouterr().err
    (pkg / "__init__.py").write_text('__version__ = "5.24.0.dev0"\n')
    versions.check()
    assert capsys.readouterr().err == ""
    (pkg / "__init__.py").write_text('__version__ = "6.0.0.dev0"\n')  # main past the top: waivable, as installed
    with pytest.raises(SystemExit):
        versions.check()
    assert f"or {versions.NEWER}=warn" in capsys.readouterr().err
    monkeypatch.setenv(versions.NEWER, "warn")
    versions.check()
    assert capsys.readouterr().err.startswith("warning: transformers 6.0.0.dev0")


def test_other_local_ranks_exit_without_repeating_the_line(monkeypatch, capsys):
    installed(monkeypatch, transformers="4.57.6")
    monkeypatch.setenv("LOCAL_RANK", "3")
    with pytest.raises(SystemExit):
        versions.check()
    assert capsys.readouterr().err == ""


def test_release_numbers_of_the_forms_pip_installs():
    assert versions.release("2.13.0+cpu") == (2, 13, 0)
    assert versions.release("2.6.0a0+ecf3bae40a") == (2, 6, 0)
    assert versions.release("5.24.0.dev0") == (5, 24, 0)
    assert versions.release("0.19.8") == (0, 19, 8)
    assert versions.release("unknown") is None


def test_this_environment_fits():  # the .venv the tests run from: the check never stops them
    versions.check()


def test_pyprojects_dependencies_are_these_ranges():  # one set of ranges: what pip resolves is what start-up checks
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(os.path.join(os.path.dirname(os.path.dirname(versions.__file__)), "pyproject.toml"), "rb") as fh:
        declared = tomllib.load(fh)["project"]["dependencies"]
    assert declared == [versions.spec(n) for n in versions.RANGES]


def test_pyprojects_python_and_ruffs_target_are_the_checked_python():  # a review: requires-python said >=3.10
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(os.path.dirname(os.path.dirname(versions.__file__)), "pyproject.toml"), "rb") as fh:
        project = tomllib.load(fh)
    want = ".".join(map(str, versions.PYTHON))
    assert project["project"]["requires-python"] == f">={want}"
    assert project["tool"]["ruff"]["target-version"] == "py" + want.replace(".", "")


def _fake_dist(root, name: str, version: str) -> None:
    """A package's metadata that `importlib.metadata` finds first on PYTHONPATH (its code stays the installed one)."""
    info = root / f"{name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


@pytest.mark.parametrize("script", ["train.py", "scripts/evaluate.py", "scripts/prepare_data.py"])
def test_the_tools_check_first(tmp_path, script):
    """Each training entry point stops with the line before anything else runs; prepare_data checks nothing (a
    review: pre-tokenized rows, --merge and --verify need no transformers at all, and the RoPE reason is not its)."""
    import subprocess

    root = os.path.dirname(os.path.dirname(versions.__file__))
    _fake_dist(tmp_path, "deepspeed", "0.18.0")
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "SLURM_LOCALID")}
    run = lambda: subprocess.run([sys.executable, script, "--help"], cwd=root, capture_output=True, text=True,  # noqa: E731
                                 env={**env, "PYTHONPATH": f"{tmp_path}{os.pathsep}{root}"}, timeout=120)
    p = run()
    if script.endswith("prepare_data.py"):
        _fake_dist(tmp_path, "transformers", "4.57.6")
        assert run().returncode == 0 and p.returncode == 0, p.stderr[-2000:]
        return
    assert p.returncode == 2 and p.stdout == "" and p.stderr.count("\n") == 1, p.stderr[-2000:]
    assert p.stderr.startswith("error: ") and "-m pip install '" in p.stderr
