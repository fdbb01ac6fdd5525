"""Evaluation settings from flags (issue 27): a flags-only run sets or switches off the held-out loss and the task
evaluation (`--eval_heldout_samples`, `--eval_tasks`, `--eval_depths`, `--eval_lengths`, `--no-eval`), a recipe's
top-level eval_* keys are the default under each stage's `eval:` block, and the command line wins over both."""

import pytest

from training.config import parse_config
from training.curriculum import resolve_stages
from training.evaluation import eval_lengths, task_trials

TEXT = object()  # any tokenizer: task_trials only asks whether there is one


def _evals(argv):
    return [s.eval for s in resolve_stages(parse_config(argv), dp_of_sp=lambda sp: 1)]


def test_flags_only_run_sets_its_evaluation():
    (ev,) = _evals(["--max_seq_length", "4096", "--eval_heldout_samples", "3", "--eval_tasks", "passkey:5,common_words:2",
                    "--eval_depths", "0,0.5,1", "--eval_lengths", "2k,4096"])
    assert ev == {"heldout_samples": 3, "tasks": {"passkey": 5, "common_words": 2}, "depths": [0.0, 0.5, 1.0],
                  "lengths": [2048, 4096]}
    assert task_trials(ev, TEXT) == {"passkey": 5, "common_words": 2}
    (ev,) = _evals(["--eval_tasks", "passkey,niah_multikey", "--eval_passkey_trials", "4"])
    assert task_trials(ev, TEXT) == {"passkey": 4, "niah_multikey": 4}
    (ev,) = _evals(["--eval_tasks", "passkey: 3, common_words:1", "--eval_depths", "0.25 0.75"])  # as people type
    assert ev == {"tasks": {"passkey": 3, "common_words": 1}, "depths": [0.25, 0.75]}
    assert _evals([]) == [{}]  # nothing set: the evaluation's own defaults


def test_no_eval_and_no_tasks():
    (ev,) = _evals(["--no-eval"])
    assert ev["heldout_samples"] == 0 and task_trials(ev, TEXT) == {}
    (ev,) = _evals(["--eval_tasks", "none", "--eval_heldout_samples", "1"])
    assert ev == {"heldout_samples": 1, "tasks": []} and task_trials(ev, TEXT) == {}


def test_command_line_over_stage_block_over_recipe_top_level(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("eval_heldout_samples: 5\neval_depths: [0.2]\nstages:\n"
                      "  - {name: a, max_seq_length: 64, eval: {heldout_samples: 1, passkey_trials: 3}}\n"
                      "  - {name: b, max_seq_length: 128}\n")
    a, b = _evals(["--config", str(recipe)])
    assert a == {"heldout_samples": 1, "depths": [0.2], "passkey_trials": 3}  # the stage's own block wins
    assert b == {"heldout_samples": 5, "depths": [0.2]}  # the recipe's run-level default
    a, b = _evals(["--config", str(recipe), "--eval_heldout_samples", "0", "--eval_lengths", "all"])
    assert a["heldout_samples"] == b["heldout_samples"] == 0 and a["passkey_trials"] == 3  # the command line wins
    stages = resolve_stages(parse_config(["--config", str(recipe), "--eval_lengths", "all"]), dp_of_sp=lambda sp: 1)
    assert [eval_lengths(s, stages) for s in stages] == [[64, 128], [64, 128]]
    a, b = _evals(["--config", str(recipe), "--no-eval"])
    assert a["heldout_samples"] == b["heldout_samples"] == 0 and a["tasks"] == b["tasks"] == []


@pytest.mark.parametrize("argv, match", [
    (["--eval_tasks", "passkey:5,common_words"], r"give every task a count"),
    (["--eval_tasks", "passkey:x"], r"a count is an integer"),
    (["--eval_tasks", "needle"], r"--eval_tasks: unknown task\(s\) \['needle'\]; valid: \['passkey'"),
    (["--eval_depths", "0.5,1.5"], r"--eval_depths '0.5,1.5': use depths between 0 \(the start\) and 1"),
    (["--eval_lengths", "longest"], r"--eval_lengths 'longest': use earlier, all or a list of lengths"),
    (["--eval_heldout_samples", "-1"], r"--eval_heldout_samples -1: use an integer >= 0"),
    (["--no-eval", "--eval_heldout_samples", "2"], r"--no-eval turns evaluation off and --eval_heldout_samples"),
])
def test_bad_eval_flags_fail_in_one_line(argv, match):
    with pytest.raises(ValueError, match=match) as e:
        parse_config(argv)
    assert "\n" not in str(e.value)


def test_bad_stage_eval_block_fails_in_one_line(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("stages:\n  - {name: a, eval: {depths: [0.5, 2]}}\n")
    with pytest.raises(ValueError, match=r"stages\[0\]\.eval\.depths \[0\.5, 2\]: use depths between 0"):
        resolve_stages(parse_config(["--config", str(recipe)]), dp_of_sp=lambda sp: 1)
    recipe.write_text("eval: {heldout_samples: 2}\n")
    with pytest.raises(ValueError, match=r"eval: \{'heldout_samples': 2\}: use true or false at the top level"):
        parse_config(["--config", str(recipe)])
    # a misspelt key was kept unread and the stage evaluated with the defaults (a helper's audit)
    recipe.write_text("stages:\n  - {name: a, eval: {passkey_trial: 9}}\n")
    with pytest.raises(ValueError, match=r"stages\[0\]\.eval\.passkey_trial: no such eval setting \(did you mean "
                                         r"passkey_trials\?\)"):
        resolve_stages(parse_config(["--config", str(recipe)]), dp_of_sp=lambda sp: 1)
    # position_buckets, which docs/curriculum.md documents and the evaluation reads, was refused as "no such setting"
    recipe.write_text("stages:\n  - {name: a, eval: {position_buckets: 4}}\n")
    assert resolve_stages(parse_config(["--config", str(recipe)]), dp_of_sp=lambda sp: 1)[0].eval["position_buckets"] == 4
    recipe.write_text("stages:\n  - {name: a, eval: {position_buckets: -1}}\n")
    with pytest.raises(ValueError, match=r"position_buckets -1: use an integer >= 0"):
        resolve_stages(parse_config(["--config", str(recipe)]), dp_of_sp=lambda sp: 1)


def test_a_depth_given_twice_is_listed_once(tmp_path):
    """`--depths 0.5,0.5` (or 0.5,0.50): the trials were asked once (training/evaluation.unique_depths) but the
    setting kept both, so scripts/evaluate.py's start line and eval.json's `depths` listed 0.5 twice. Parsed once
    each, in the order given: the run's flag, a stage's block and evaluate.py's --depths."""
    import os

    from scripts.evaluate import parse_args, settings

    (ev,) = _evals(["--eval_depths", "0.5,0.1,0.50,0.5"])
    assert ev["depths"] == [0.5, 0.1]
    recipe = tmp_path / "r.yaml"
    recipe.write_text("stages:\n  - {name: a, eval: {depths: [0.9, 0.9, 0.2]}}\n")
    assert _evals(["--config", str(recipe)])[0]["depths"] == [0.9, 0.2]
    base = os.path.join(os.path.dirname(__file__), "..", "..", "..", "recipes", "base", "tiny_passkey256")
    s = settings(parse_args([base, "--lengths", "256", "--depths", "0.5,0.5,0.1", "--output_dir", str(tmp_path)]))
    assert s["depths"] == [0.5, 0.1]
