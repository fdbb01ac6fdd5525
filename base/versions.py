"""The package versions this code needs, checked in one line at start-up (train.py, scripts/evaluate.py,
scripts/prepare_data.py), before any data or model is read.

Reads `importlib.metadata` only (no torch, no transformers imported: a version too old may not even import cleanly).
The ranges are what the code relies on, not the pins of requirements.txt:
- transformers >=5.0,<6: a stage's RoPE is set as transformers 5's `config.rope_parameters`; 4.x reads `rope_scaling`
  / `rope_theta` and would train and export the stage with no rescaling at all, silently. 5.0.0's YaRN equals 5.23's.
- deepspeed >=0.19.5,<0.20: `UlyssesSPAttentionHF` and `parallel_state_sp` as used here (0.19.5 trains the tiny
  model; 0.20 is not tested).
- torch >=2.6: `sdpa_kernel(..., set_priority=True)` (model_utils/attention_pick.py); transformers 5 itself treats an
  older torch as absent.
flash-attn is checked where it is used (model_utils/context_parallel.py).

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
    "deepspeed": ("0.19.5", "0.20", "Ulysses SP as used here"),
    "transformers": ("5.0", "6", "a stage's RoPE is transformers 5's rope_parameters"),
}
TRAINING = ("torch", "deepspeed", "transformers")  # train.py, scripts/evaluate.py; scripts/prepare_data.py: transformers


def release(version: str) -> tuple[int, ...] | None:
    """The release numbers of a version string (`2.13.0+cpu` -> (2, 13, 0); `2.6.0a0+git` -> (2, 6, 0)); None where it
    does not start with one."""
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", version)
    return tuple(int(x) for x in m.group(1).split(".")) if m else None


def _pad(t: tuple[int, ...]) -> tuple[int, ...]:
    return t + (0,) * (4 - len(t))


def spec(name: str) -> str:
    """pip's form of a package's range: `transformers>=5.0,<6`."""
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


def check(names=TRAINING) -> None:
    """Exit 2 with one line (the packages, the versions found, the ranges, the pip command) where an installed version
    is outside its range; nothing where all fit. The line is printed once per node (its local rank 0)."""
    bad = [name for name in names if problem(name)]
    unread = [n for n in names if unlabelled(n) and source_version(n) is None]
    if unread and os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")) == "0":
        print(f"warning: {', '.join(unread)} import(s) but carry no package metadata: the version cannot be checked "
              f"against {', '.join(spec(n) for n in unread)}", file=sys.stderr, flush=True)
    if not bad:
        return
    waived = os.environ.get(NEWER) == "warn" and all(too_new(n) for n in bad)
    if os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")) == "0":
        fix = " ".join(f"'{spec(n)}'" for n in bad)
        if waived:
            print(f"warning: {'; '.join(problem(n) for n in bad)}: untested here, going on ({NEWER}=warn)",
                  file=sys.stderr, flush=True)
        else:
            newer = f", or {NEWER}=warn to try the newer one untested" if all(too_new(n) for n in bad) else ""
            print(f"error: {'; '.join(problem(n) for n in bad)}: {sys.executable} -m pip install {fix}{newer}",
                  file=sys.stderr, flush=True)
    if not waived:
        raise SystemExit(2)
