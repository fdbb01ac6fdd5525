"""The command line's eval_* flags over a recipe's evaluation settings (training/config.parse_config): a flag wins over
the recipe's top-level eval_* key and over every stage's own `eval:` block, and --eval_passkey_trials over the passkey
count of a tasks mapping too; --no-eval beside an eval flag is refused in one line. Reads the recipe's dict in place,
before it is typed (training/eval_settings.py checks each value).
"""

from __future__ import annotations

from training.eval_settings import EVAL_KEYS, eval_value


def eval_flags_over_recipe(merged: dict, args: dict) -> None:
    """Apply the eval flags given on the command line (`args`) to the recipe `merged`, in place: each stage's own
    eval.X that a flag sets is dropped (the run's value, the flag's, reaches every stage: eval_settings.stage_eval)."""
    given = sorted(k for k in args if k in EVAL_KEYS)
    if args.get("eval") is False and given:
        raise ValueError(f"--no-eval turns evaluation off and --{given[0]} sets it: drop one of them")
    for st in merged.get("stages") or []:  # the command line's eval_X wins over a stage's own eval.X as well
        if isinstance(st, dict) and isinstance(st.get("eval"), dict):
            st["eval"] = {k: v for k, v in st["eval"].items() if k not in {EVAL_KEYS[g] for g in given}}
    if "eval_passkey_trials" in given:
        _passkey_over_counts(merged, args)


def _passkey_over_counts(merged: dict, args: dict) -> None:
    """--eval_passkey_trials N sets passkey's trials per depth in a tasks mapping too ({passkey: 5, niah_multikey: 1}:
    the recipe's eval_tasks, a stage's eval.tasks): it counted only the tasks named without a count, so a recipe that
    counts them (recipes/tiny_cpu.yaml) ran its 5 and 10 passkey trials whatever the flag said. The other tasks keep
    their counts. Beside --eval_tasks giving passkey a count of its own: refused in one line."""
    n = eval_value("passkey_trials", args["eval_passkey_trials"], "--eval_passkey_trials")
    if "eval_tasks" in args:  # the flag's tasks replace the recipe's
        tasks = eval_value("tasks", args["eval_tasks"], "--eval_tasks")
        if isinstance(tasks, dict) and "passkey" in tasks:
            raise ValueError(f"--eval_tasks gives passkey {tasks['passkey']} trials per depth and --eval_passkey_trials "
                             f"{n}: drop one of them")
        return
    blocks = [(merged, "eval_tasks", "eval_tasks")] + [
        (st["eval"], "tasks", f"stages[{i}].eval.tasks") for i, st in enumerate(merged.get("stages") or [])
        if isinstance(st, dict) and isinstance(st.get("eval"), dict)]
    for block, key, where in blocks:
        if block.get(key) is not None:
            tasks = eval_value("tasks", block[key], where)
            if isinstance(tasks, dict) and "passkey" in tasks:
                block[key] = {**tasks, "passkey": n}
