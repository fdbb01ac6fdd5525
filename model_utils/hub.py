"""A Hugging Face hub id (`meta-llama/Meta-Llama-3-8B`) resolved offline to its folder in the local hub cache.

Compute nodes are usually offline with a cache filled beforehand (`hf download <id>` on a login node; the pinned
huggingface_hub installs `hf` only, no `huggingface-cli`). Nothing here downloads: the id is looked up in
huggingface_hub's cache layout,

    $HF_HUB_CACHE (else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub)
        models--<org>--<name>/refs/main            the commit the cache's `main` points at
        models--<org>--<name>/snapshots/<commit>/  config.json, weights (links into ../../blobs)

and the run then reads the snapshot folder as it reads any local model folder. A model that is not there (or whose
snapshot lacks its config or a weight file: an interrupted download) is refused in one line naming the download
command. The same snapshot on every rank: each rank reads `refs/main` itself (no process group exists yet when the
config is read), and `check_same_snapshot` then compares the commits every rank resolved, after the process group
exists, and refuses the run alike on every rank when two differ (a node-local cache filled at another time).
"""

from __future__ import annotations

import hashlib
import json
import os
import re

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")  # org/name, or a bare name
WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def hub_cache() -> str:
    """The hub cache folder huggingface_hub itself would use: its environment variables in its order, `~` and `$VAR`
    expanded as it expands them (huggingface_hub/constants.py HF_HOME, HF_HUB_CACHE). Where it would fall back to a
    home directory this process has none of (HOME unset and its uid not in the passwd file: a container's `--user`),
    huggingface_hub looks in a relative `~/.cache/huggingface/hub` under the working directory: refused in one line
    naming HF_HOME / HF_HUB_CACHE instead of "not in the local cache" there."""
    env = os.environ
    home = os.path.join(env.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface")
    path = (env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")  # the older name, still read by huggingface_hub
            or os.path.join(env.get("HF_HOME") or home, "hub"))
    path = os.path.expandvars(os.path.expanduser(path))
    if path.startswith("~"):
        raise ValueError(f"the Hugging Face cache is {path}, under a home directory this process has none of (HOME unset, "
                         f"uid {os.getuid()} not in the passwd file): set HF_HOME (or HF_HUB_CACHE) to the cache the "
                         "nodes read, or HOME")
    return path


def looks_like_hub_id(name: str) -> bool:
    return bool(HUB_ID.match(name)) and not os.path.exists(name)


def _download_hint(hub_id: str, where: str) -> str:
    return (f"download it where the nodes read it: `hf download {hub_id}` "
            f"with HF_HOME / HF_HUB_CACHE as the job sets them (looked in {where}; nothing is downloaded here)")


def missing_weights(folder: str) -> list[str]:
    """The weight files a snapshot (or a local model folder) lacks (a link into blobs/ whose blob is gone counts as
    missing); [] when whole."""
    have = [w for w in WEIGHTS if os.path.isfile(os.path.join(folder, w))]
    if not have:
        return ["model.safetensors (or pytorch_model.bin)"]
    # the file transformers loads, in its order (WEIGHTS): a model.safetensors beside an index from an earlier sharded
    # save (save_pretrained keeps the index, removes the shards) is what loads, not the stale index
    index = have[0] if have[0].endswith(".index.json") else None
    if index is None:
        return []
    try:
        with open(os.path.join(folder, index)) as fh:
            shards = sorted(set(json.load(fh).get("weight_map", {}).values()))
    except (OSError, ValueError):
        return [index]
    return [s for s in shards if not os.path.isfile(os.path.join(folder, s))]


def snapshot(hub_id: str, weights: bool = True, cache: str | None = None, flag: str = "--model_name_or_path") -> str:
    """The snapshot folder of `hub_id` that the cache's `main` points at; one-line ValueError naming the download
    command when it is not there, or lacks config.json (or, with `weights`, a weight file)."""
    cache = cache or hub_cache()
    repo = os.path.join(cache, "models--" + hub_id.replace("/", "--"))
    hint = _download_hint(hub_id, repo)
    if not os.path.isdir(repo):
        raise ValueError(f"{flag} {hub_id}: not a local folder, a preset, nor in the local Hugging Face "
                         f"cache: {hint}")
    commit = None
    ref = os.path.join(repo, "refs", "main")
    if os.path.isfile(ref):
        with open(ref) as fh:
            commit = fh.read().strip()
    else:  # a cache filled with --revision <commit> has no refs/main: one snapshot is unambiguous
        found = sorted(os.listdir(os.path.join(repo, "snapshots"))) if os.path.isdir(os.path.join(repo, "snapshots")) else []
        if len(found) != 1:
            raise ValueError(f"{flag} {hub_id}: the cache has no refs/main and {len(found)} snapshots "
                             f"({', '.join(found) or 'none'}): pass the snapshot folder itself, or {hint}")
        commit = found[0]
    folder = os.path.join(repo, "snapshots", commit)
    if not os.path.isfile(os.path.join(folder, "config.json")):
        if not weights and any(os.path.isfile(os.path.join(folder, f)) for f in ("tokenizer.json", "tokenizer.model")):
            raise ValueError(f"{flag} {hub_id}: snapshot {commit} has tokenizer files and no config.json (a "
                             f"tokenizer-only repository): pass the folder itself, {folder}")
        raise ValueError(f"{flag} {hub_id}: snapshot {commit} has no config.json (an interrupted "
                         f"download?): {hint}")
    lacking = missing_weights(folder) if weights else []
    if lacking:
        raise ValueError(f"{flag} {hub_id}: snapshot {commit} lacks {', '.join(lacking[:3])}"
                         f"{' ...' if len(lacking) > 3 else ''} (an interrupted download?): {hint}")
    return folder


def resolve(name: str, presets=(), weights: bool = True, flag: str = "--model_name_or_path") -> str:
    """A local path as given, a preset name as given, a hub id as its cached snapshot folder (`snapshot`). With
    `weights`, a local model folder (one with config.json) lacking a weight file is refused in one line too (was a
    FileNotFoundError / OSError traceback at the first stage's engine, after the data was prepared)."""
    if os.path.isdir(name) and weights and os.path.isfile(os.path.join(name, "config.json")):
        lacking = missing_weights(name)
        if lacking:
            raise ValueError(f"{flag} {name}: the folder lacks {', '.join(lacking[:3])}"
                             f"{' ...' if len(lacking) > 3 else ''} (a copy or download that stopped part way?): "
                             "copy the model's weight files there, or name its complete save_pretrained folder")
        return name
    if os.path.exists(name) or name in presets or not looks_like_hub_id(name):
        return name
    return snapshot(name, weights=weights, flag=flag)


def commit_of(folder: str) -> str | None:
    """The commit of a hub-cache snapshot folder (.../models--org--name/snapshots/<commit>), None for another folder."""
    parts = os.path.normpath(os.path.abspath(folder)).split(os.sep)
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return f"{parts[-3][len('models--'):].replace('--', '/')}@{parts[-1]}"
    return None


def config_digest(folder: str) -> str | None:
    """The model's config.json as read (keys sorted: a re-saved copy is the same), hashed; None without one (a preset)."""
    try:
        with open(os.path.join(folder, "config.json"), "rb") as fh:
            return hashlib.sha256(json.dumps(json.load(fh), sort_keys=True).encode()).hexdigest()[:16]
    except (OSError, ValueError):
        return None


def check_same_snapshot(folder: str) -> None:
    """Every rank resolved the same commit of the model and reads the same config.json (a collective: every rank
    calls it at the same point); the same one-line ValueError on every rank otherwise (each rank decides from the same
    gathered list). Each rank builds its layers and RoPE from its own config read (weights are rank 0's): a node-local
    copy staged by a prolog, stale on one node, trained that node's ranks with other positions, unsaid. Cost: one read
    of a few KB a rank and one all-gather of ~100 bytes a rank."""
    import socket

    from base import comm

    got = comm.all_gather_object((commit_of(folder), config_digest(folder), socket.gethostname()))
    first = next((r for r, c in enumerate(got) if c[0] != got[0][0]), None)
    if first is not None:
        raise ValueError(f"--model_name_or_path: rank 0 reads {got[0][0]} from its Hugging Face cache but rank {first} "
                         f"reads {got[first][0]}: fill every node's cache with the same revision (`hf download "
                         f"<id> --revision <commit>`) or pass one snapshot folder every node reads")
    first = next((r for r, c in enumerate(got) if c[1] != got[0][1]), None)
    if first is not None:
        raise ValueError(f"--model_name_or_path {folder}: rank {first} (host {got[first][2]}) reads a config.json unlike "
                         f"rank 0's (host {got[0][2]}): a node's copy differs (staged stale, or edited while the job "
                         "started); give every node the same model folder")
