"""A run's evaluation settings (training/config.py's eval_* keys and flags) merged into every stage's `eval:` block,
each value checked in one line: held-out samples, tasks and their trials, depths, lengths (training/evaluation.py
runs them at each stage's end).
"""

from __future__ import annotations

import difflib

EVAL_KEYS = {"eval_heldout_samples": "heldout_samples", "eval_tasks": "tasks", "eval_passkey_trials": "passkey_trials",
             "eval_depths": "depths", "eval_lengths": "lengths"}  # run key / flag -> a stage's eval block key


STAGE_ONLY = ("position_buckets",)  # a stage's eval block only (no run flag): the held-out loss by context position


def _listed(value) -> list:
    """A flag's "a,b" or "a b" (or YAML's list) as a list."""
    return value.replace(",", " ").split() if isinstance(value, str) else list(value)


def eval_value(key: str, value, where: str):
    """A stage eval block's `key` checked and in its block form (a flag's text parsed); one-line ValueError."""
    if key in ("heldout_samples", "passkey_trials", "position_buckets"):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{where} {value!r}: use an integer >= 0 (0: none)")
        return value
    if key == "tasks":
        from data.tasks import TASKS

        if isinstance(value, str):
            items = _listed(":".join(p.strip() for p in value.split(":")))  # "passkey: 5" too
            if items == ["none"]:
                return []
            counted = [":" in t for t in items]
            if any(counted) and not all(counted):
                raise ValueError(f"{where} {value!r}: give every task a count (passkey:5,niah_multikey:2) or none "
                                 "(passkey,niah_multikey: each with eval passkey_trials)")
            try:
                value = {t.split(":")[0].strip(): int(t.split(":")[1]) for t in items} if any(counted) else items
            except ValueError:
                raise ValueError(f"{where} {value!r}: a count is an integer, as in passkey:5") from None
        if not isinstance(value, (list, dict)):
            raise ValueError(f"{where} {value!r}: use a list of tasks or {{task: trials per depth}}")
        unknown = [t for t in value if t not in TASKS]
        if unknown:
            raise ValueError(f"{where}: unknown task(s) {unknown}; valid: {list(TASKS)} (or none)")
        if isinstance(value, dict) and any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in value.values()):
            raise ValueError(f"{where} {value!r}: trials per depth are integers >= 0")
        return value
    if key == "depths":
        try:
            depths = [float(d) for d in _listed(value)]
        except (TypeError, ValueError):
            depths = []
        if not depths or not all(0.0 <= d <= 1.0 for d in depths):
            raise ValueError(f"{where} {value!r}: use depths between 0 (the start) and 1 (the end), as in 0.1,0.5,0.9")
        from training.evaluation import unique_depths  # (torch: imported only where depths are given)

        return unique_depths(depths)  # `0.5,0.5`: once, as asked (its record key once; evaluate.py's line and JSON)
    if key == "lengths":
        if value in ("earlier", "all"):
            return value
        from planner.memory_model import parse_seq_len

        try:
            lengths = [parse_seq_len(n) for n in _listed(value)] if isinstance(value, (str, list)) else []
        except ValueError:
            lengths = []
        if not lengths:
            raise ValueError(f"{where} {value!r}: use earlier, all or a list of lengths such as 4096,8k")
        return lengths
    return value


def run_eval(cfg) -> dict:
    """The eval block the run's eval_* settings (cfg: training/config.py's Config) give every stage (parsed, checked)."""
    return {key: eval_value(key, getattr(cfg, name), f"--{name}") for name, key in EVAL_KEYS.items()
            if getattr(cfg, name) is not None}


def stage_eval(cfg, own: dict | None, where: str) -> dict:
    """A stage's evaluation settings: the run's eval_* under the stage's own `eval:` block (both checked); with
    --no-eval neither held-out loss nor tasks."""
    if not isinstance(own or {}, dict):
        raise ValueError(f"{where}: eval must be a mapping like {{heldout_samples: 2, depths: [0.1, 0.5, 0.9]}}")
    keys = [*EVAL_KEYS.values(), *STAGE_ONLY]
    for k in own or {}:  # a typo (passkey_trial, depth) was kept unread: the stage evaluated with the defaults
        if k not in keys:
            near = difflib.get_close_matches(k, keys, n=1)
            raise ValueError(f"{where}.{k}: no such eval setting" + (f" (did you mean {near[0]}?)" if near else "")
                             + f"; the keys are {keys}")
    block = {**run_eval(cfg), **{k: eval_value(k, v, f"{where}.{k}") for k, v in (own or {}).items()}}
    return {**block, "heldout_samples": 0, "tasks": []} if cfg.eval is False else block
