"""Reading a DeepSpeed JSON (`--deepspeed FILE`, a stage's `deepspeed_overrides`) into a dict of sections.

One line naming the file for what would otherwise fail later or inside DeepSpeed: text that is not JSON, a key
given twice, a section that is not an object. DeepSpeed's older spellings are renamed here, before anything reads
them: `"bfloat16"` becomes `"bf16"` (DeepSpeed reads `bf16` first and `bfloat16` only without it, so the fill of
training/ds_config.py must see one key: `{"bfloat16": {"enabled": false}}` trained in bf16, and
`{"bfloat16": {"enabled": "auto"}}` (transformers' tests/deepspeed/ds_config_zero3_bf16.json) was left unfilled).
No import of training.config here: it re-exports these names for its older importers.
"""

from __future__ import annotations

import copy
import json

SP_BLOCK_KEYS = ("enabled", "degree", "size", "sequence_parallel_type")
SECTIONS = {"zero_optimization": ("offload_param", "offload_optimizer"), "bf16": (), "fp16": (),
            "optimizer": ("params",), "scheduler": ("params",)}  # the objects (and objects in them) the code reads


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def _no_repeats(pairs: list) -> dict:
    keys = [k for k, _ in pairs]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:  # json.load kept the last silently ("gradient_accumulation_steps": "auto", then 4 further down)
        raise ValueError(f"key(s) {twice} given twice in one object: keep one")
    return dict(pairs)


def renamed(ds, where: str):
    """`ds` with DeepSpeed's legacy `bfloat16` section under its name `bf16` (in place); both given and different:
    one line. Anything not a dict passes unchanged (check_sections names it)."""
    if isinstance(ds, dict) and "bfloat16" in ds:
        old = ds.pop("bfloat16")
        if "bf16" in ds and ds["bf16"] != old:
            raise ValueError(f"{where}: both bf16 {json.dumps(ds['bf16'])} and its older name bfloat16 "
                             f"{json.dumps(old)}: keep one (bf16)")
        ds["bf16"] = old
    return ds


def _load(path: str) -> dict:
    """A DeepSpeed JSON (--deepspeed): an object of sections, or one line naming the file and what is wrong."""
    with open(path) as fh:
        try:
            ds = json.load(fh, object_pairs_hook=_no_repeats)  # DeepSpeed's own loader refuses a key given twice
        except ValueError as e:  # JSONDecodeError: its words name no file
            raise ValueError(f"--deepspeed {path}: not valid JSON ({e})") from None
    renamed(ds, f"--deepspeed {path}")
    check_sections(ds, f"--deepspeed {path}")
    return ds


def check_sections(ds, where: str) -> None:
    """A DeepSpeed config (a file, or one merged with a stage's deepspeed_overrides) is an object of sections, each an
    object: one line naming the value, not an AttributeError inside the fill (`bf16: true` in an override was one)."""
    bad = "" if isinstance(ds, dict) else f"a {type(ds).__name__}, not an object of sections"
    for k, inner in SECTIONS.items():
        if bad or k not in ds:
            continue
        v = ds[k]
        bad = f"{k} is a {type(v).__name__}, not an object" if not isinstance(v, dict) else next(
            (f"{k}.{i} is a {type(v[i]).__name__}, not an object" for i in inner if i in v and not isinstance(v[i], dict)),
            "")
    if bad:
        raise ValueError(f"{where}: {bad} (ds_configs/ holds examples)")


def sp_from_block(block, where: str) -> int:
    """The SP degree a `sequence_parallelism` block asks for (1 when `"enabled": false`)."""
    if not isinstance(block, dict):
        raise ValueError(f"{where}: sequence_parallelism must be a mapping like {{\"enabled\": true, \"degree\": 2}}")
    unknown = sorted(set(block) - set(SP_BLOCK_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown} in sequence_parallelism: valid keys are {list(SP_BLOCK_KEYS)}")
    kind = block.get("sequence_parallel_type", "ulysses")
    if kind != "ulysses":
        raise ValueError(f"{where}: sequence_parallelism.sequence_parallel_type {kind!r}: only \"ulysses\" is implemented")
    if block.get("enabled", True) is False:
        return 1
    sizes = {block[k] for k in ("degree", "size") if k in block}
    if len(sizes) != 1:
        raise ValueError(f"{where}: sequence_parallelism needs one \"degree\" (got {sorted(map(str, sizes)) or 'none'})")
    n = sizes.pop()
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"{where}: sequence_parallelism.degree must be an integer >= 1, got {n!r}")
    return n


def sp_sizes(ds: dict, where: str) -> list[tuple[int, str]]:
    """The SP degrees the JSON names, each with the words that name its key: the project's `sequence_parallelism`
    block and DeepSpeed's own top-level `sequence_parallel_size` (the ALST tutorial's; "auto" names none); both,
    differing: one line."""
    out = []
    if "sequence_parallelism" in ds:
        out.append((sp_from_block(ds["sequence_parallelism"], where), "sequence_parallelism degree"))
    n = ds.get("sequence_parallel_size", "auto")
    if n != "auto":
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"{where}: sequence_parallel_size must be an integer >= 1 or \"auto\", got {n!r}")
        out.append((n, "sequence_parallel_size"))
    if len({n for n, _ in out}) > 1:  # settle_from_file took the first one silently
        raise ValueError(f"{where}: sequence_parallelism degree {out[0][0]} and sequence_parallel_size {out[1][0]} name "
                         "two SP degrees: keep one of the keys (or make them agree)")
    return out
