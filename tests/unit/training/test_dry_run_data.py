"""`train.py --dry_run` refuses what the real start refuses of a stage's `data:` and `tasks:` before it opens the data:
a mixture component's unknown key or a weight not above 0, an unknown task name. Before, the dry run passed them and
the real start, after its queue wait and the data's preparation, refused them. In this process, as train.py calls
training.startup (test_recipes.py's dry_run_here)."""

from __future__ import annotations

import pytest

from training.startup import dry_run, load_run_config

STAGES = "stages:\n  - name: base\n    max_seq_length: 128\n  - name: long\n    max_seq_length: 256\n"


@pytest.mark.parametrize("extra, match", [
    ("    tasks: {paskey: 0.1}\n", r"^stage 1 \(long\) tasks: unknown task\(s\) \['paskey'\]; valid: "),
    ("    data: [{source: books, weight: 1, min_doc_token: 5}]\n",
     r"^stage 1 \(long\) data\[0\]: unknown key\(s\) \['min_doc_token'\]; valid: "),
    ("    data: {books: -0.5}\n", r"^stage 1 \(long\) data\[0\] \(books\): weight must be > 0"),
    ("    tasks: {passkey: 1.5}\n", r"^stage 1 \(long\) tasks: fractions must be in \(0, 1\]"),
], ids=["unknown-task", "unknown-mixture-key", "negative-weight", "fraction"])
def test_dry_run_refuses_a_stages_bad_data_or_tasks_in_one_line(tmp_path, capsys, extra, match):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(STAGES + extra)
    args = ["--dry_run", "--config", str(recipe), "--nodes", "1", "--gpus_per_node", "2", "--output_dir",
            str(tmp_path / "out")]
    with pytest.raises(ValueError, match=match) as e:
        dry_run(*load_run_config(args))
    assert "\n" not in str(e.value)


def test_dry_run_passes_a_good_mixture_and_tasks(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(STAGES + "    data: [{source: books, weight: 0.6, min_doc_tokens: 200}, {source: code, weight: 0.4}]\n"
                      "    tasks: {passkey: 0.1, chat: false}\n")
    dry_run(*load_run_config(["--dry_run", "--config", str(recipe), "--nodes", "1", "--gpus_per_node", "2",
                              "--output_dir", str(tmp_path / "out")]))
    assert "dry run: world=2" in capsys.readouterr().out


def test_dry_run_refuses_a_mixture_the_run_refuses(tmp_path, capsys):
    """A component with length bounds no document meets: the run refuses the stage's mixture; the dry run printed
    "stage 1's data notes failed (...); training goes on" and passed. Now the same one line, naming min_doc_tokens."""
    from tests.unit.data.test_coverage_lengths import _prepared

    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model_name_or_path: tiny-llama\ndataset_path: {_prepared(tmp_path, [100] * 50)}\n"
                      "per_device_train_batch_size: 1\nstages:\n  - {name: base, max_seq_length: 64, max_steps: 4}\n"
                      "  - name: long\n    max_seq_length: 128\n    max_steps: 4\n"
                      "    data: [{name: long, source: '*', weight: 1, min_doc_tokens: 4096}]\n")
    with pytest.raises(ValueError, match=r"stage 1 \(long\): mixture component 'long': no document of >= 4096 tokens "
                                         r"in sources \['\*'\] \(min_doc_tokens") as e:
        dry_run(*load_run_config(["--dry_run", "--config", str(recipe), "--output_dir", str(tmp_path / "out")]))
    assert "\n" not in str(e.value)


def test_the_plan_is_printed_by_rank_0_alone_and_every_rank_refuses_alike(tmp_path, capsys, monkeypatch):
    """`deepspeed --num_gpus 2 train.py --config ... --dry_run` printed the whole plan once per rank: now rank 0's
    alone (print0), while every rank still checks the recipe and refuses it the same way."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(STAGES)
    args = ["--dry_run", "--config", str(recipe), "--nodes", "1", "--gpus_per_node", "2", "--output_dir",
            str(tmp_path / "out")]
    monkeypatch.setattr("base.log._IS_MAIN", False)  # RANK=1, as base/log.py reads it
    dry_run(*load_run_config(args))
    assert capsys.readouterr().out == ""
    recipe.write_text(STAGES + "    tasks: {paskey: 0.1}\n")
    with pytest.raises(ValueError, match=r"^stage 1 \(long\) tasks: unknown task"):
        dry_run(*load_run_config(args))
    monkeypatch.setattr("base.log._IS_MAIN", True)
    recipe.write_text(STAGES)
    dry_run(*load_run_config(args))
    assert capsys.readouterr().out.startswith("dry run: world=2")
