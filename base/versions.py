"""The package versions this code needs, checked in one line at start-up (train.py, scripts/evaluate.py), before any
data or model is read; the Python it runs under too.

Reads `importlib.metadata` only (no torch, no transformers imported: a version too old may not even import cleanly).
The ranges are what the code relies on, not the pins of requirements.txt; each floor is the first release with an API
the code calls (tests/unit/base/test_versions.py's FLOORS table names them; an audit ran the old floors' releases):
- transformers >=5.23,<6: `activation_checkpointing_enable(..., every_n_layers=)` (model_utils/memory.py) is 5.23's
  (5.0-5.22 crash building the engine of every run that checkpoints: memory_features auto picks it from 128k on);
  `WeightConverter.was_used` (model_utils/export.py: MoE and Gemma 3 exports) is 5.6's; 5.0 read a tokenizer folder
  with only tokenizer.model (Llama-2's layout) without its Metaspace, every space an <unk> (silent wrong training).
  A stage's RoPE is transformers 5's `config.rope_parameters`: 4.x trains and exports it with no rescaling, silently.
- deepspeed >=0.19.8,<0.20: `UlyssesSPAttentionHF` and `parallel_state_sp` as used here; 0.19.5-0.19.7 import triton
  eagerly, so with a CUDA torch on a node without a GPU (a login node) `import deepspeed` raises "0 active drivers"
  (deepspeedai/DeepSpeed#7028); 0.19.8 loads it lazily. 0.20 is not tested.
- torch >=2.6: `sdpa_kernel(..., set_priority=True)` (model_utils/attention_pick.py); transformers 5 itself treats an
  older torch as absent. At 2.6 CPU attention runs sdpa's math kernel (no flash on CPU: slower CPU tests and demos,
  same numbers); its GPU kernels were not checked at 2.6.
- Python >=3.11: the pins' own floor (transformers 5.21+, numpy 2.4, matplotlib 3.11, pyarrow 26 require it).
flash-attn is checked where it is used (model_utils/context_parallel.py). scripts/prepare_data.py checks nothing here
(pre-tokenized rows, --merge and --verify need no transformers).

A version's release numbers are compared, so `2.13.0+cpu` is 2.13.0 and NVIDIA's `2.6.0a0+ecf3bae` is 2.6.0 (an NGC
container's torch passes the floor its features meet).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import sys

# name -> (lowest, first refused or None, why): each bound a release as written in pip's form
RANGES = {
    "torch": ("2.6", None, "sdpa_kernel's set_priority"),
    "deepspeed": ("0.19.8", "0.20", "Ulysses SP as used here; older ones fail to import on a node without a GPU"),
    "transformers": ("5.23", "6", "activation checkpointing's every_n_layers; a stage's RoPE is rope_parameters"),
}
PYTHON = (3, 11)  # pyproject.toml's requires-python
TRAINING = ("torch", "deepspeed", "transformers")  # train.py, scripts/evaluate.py


def release(version: str) -> tuple[int, ...] | None:
    """The release numbers of a version string (`2.13.0+cpu` -> (2, 13, 0); `2.6.0a0+git` -> (2, 6, 0)); None where it
    does not start with one."""
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", version)
    return tuple(int(x) for x in m.group(1).split(".")) if m else None


def _pad(t: tuple[int, ...]) -> tuple[int, ...]:
    return t + (0,) * (4 - len(t))


def spec(name: str) -> str:
    """pip's form of a package's range: `transformers>=5.23,<6`."""
    low, high, _ = RANGES[name]
    return f"{name}>={low}" + (f",<{high}" if high else "")


def problem(name: str) -> str | None:
    """What is wrong with the installed `name` (not installed, unreadable, outside its range), None where it fits."""
    try:
        found = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        if not unlabelled(name):
            return f"{name} is not installed"
        found = source_version(name)  # a checkout on PYTHONPATH, a module system's copy: its own __version__
        if found is None:
            return None  # it imports, no version to read: said (check), not refused
    low, high, why = RANGES[name]
    have = release(found or "")
    if have is None:
        return f"{name} {found!r} is not a version this can read"
    if _pad(have) < _pad(release(low)) or high and _pad(have) >= _pad(release(high)):
        return f"{name} {found} is installed, outside {spec(name)} ({why})"
    return None


def too_new(name: str) -> bool:
    """Whether the installed `name` is past its range's top (untested, not known broken: NEWER=warn lets it run)."""
    high = RANGES[name][1]
    try:
        have = release(importlib.metadata.version(name) or "")
    except importlib.metadata.PackageNotFoundError:  # a checkout without metadata: its source's version (a review)
        have = release(source_version(name) or "") if unlabelled(name) else None
    return bool(high and have and _pad(have) >= _pad(release(high)))


NEWER = "ULYSSES_NEWER_PACKAGES"  # =warn: a version past a range's top runs with a warning (a floor is never waived)


def unlabelled(name: str) -> bool:
    """Whether `name` imports but has no package metadata (its version cannot be read)."""
    try:
        importlib.metadata.version(name)
        return False
    except importlib.metadata.PackageNotFoundError:
        return importlib.util.find_spec(name) is not None


def source_version(name: str) -> str | None:
    """The `__version__ = "..."` (or a version.py's) a package without metadata writes in its source, read as text
    (not imported: a too-old one may not import cleanly); None where none is written."""
    spec = importlib.util.find_spec(name)
    origin = getattr(spec, "origin", None)
    folder = os.path.dirname(origin) if origin else None
    for f in ("__init__.py", "version.py", "git_version_info.py"):
        try:
            with open(os.path.join(folder, f)) as fh:
                m = re.search(r"""^(?:__version__|version)\s*=\s*["']([^"']+)["']""", fh.read(), re.M)
        except (OSError, TypeError):
            continue
        if m:
            return m.group(1)
    return None


def python_problem() -> str | None:
    """What is wrong with the running Python (older than PYTHON), None where it fits."""
    if sys.version_info[:2] >= PYTHON:
        return None
    running = ".".join(map(str, sys.version_info[:3]))
    return f"Python {running} is running, outside python>={'.'.join(map(str, PYTHON))}"


def fix_line(bad: list[str]) -> str:
    """The command(s) that put `bad` (package names, or "python") in range. torch first and by hand: PyPI's plain
    torch (or one pulled in by deepspeed's requirement) is built for one CUDA, maybe not the cluster's driver
    (requirements.txt's header: install the cluster's CUDA torch first, then the rest keeps it)."""
    want = ".".join(map(str, PYTHON))
    if "python" in bad:  # pip cannot change the interpreter: a new environment
        return f"make the environment with Python {want}+ (PYTHON=python{want} scripts/setup.sh, in a new .venv)"
    rest = " ".join(f"'{spec(n)}'" for n in bad if n != "torch")
    steps = []
    if "torch" in bad:
        steps.append(f"install the '{spec('torch')}' build for this cluster's CUDA first ({sys.executable} -m pip "
                     f"install '{spec('torch')}' --index-url https://download.pytorch.org/whl/cu128, the cluster's CUDA "
                     "in place of cu128)")
    if rest:
        steps.append(f"{sys.executable} -m pip install {rest}")
    return ", then ".join(steps)


def check(names=TRAINING) -> None:
    """Exit 2 with one line (the Python or packages, the versions found, the ranges, the fix) where the running Python
    or an installed version is outside its range; nothing where all fit. The line is printed once per node (its local
    rank 0)."""
    bad = ["python"] * bool(python_problem()) + [name for name in names if problem(name)]
    unread = [n for n in names if unlabelled(n) and source_version(n) is None]
    if unread and os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")) == "0":
        print(f"warning: {', '.join(unread)} import(s) but carry no package metadata: the version cannot be checked "
              f"against {', '.join(spec(n) for n in unread)}", file=sys.stderr, flush=True)
    if not bad:
        return
    said = "; ".join(python_problem() if n == "python" else problem(n) for n in bad)
    newest = all(n != "python" and too_new(n) for n in bad)  # past a top only: waivable (a floor never is)
    waived = newest and os.environ.get(NEWER) == "warn"
    if os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")) == "0":
        if waived:
            print(f"warning: {said}: untested here, going on ({NEWER}=warn)", file=sys.stderr, flush=True)
        else:
            newer = f", or {NEWER}=warn to try the newer one untested" if newest else ""
            print(f"error: {said}: {fix_line(bad)}{newer}", file=sys.stderr, flush=True)
    if not waived:
        raise SystemExit(2)
