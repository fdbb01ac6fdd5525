"""Bad input stops train.py with one clear line (exit 2) before any heavy work, touching nothing saved; a failure
that is not our input validation (a library's ValueError included) exits 1 with its traceback and one summary line."""

import os
import subprocess
import sys

import pytest

from tests.conftest import save_tiny_model
from tests.distributed import ROOT


def run_train(args, tmp_path):
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    (out / "keep.txt").write_text("saved before")
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=ROOT)
    env.pop("RANK", None)
    p = subprocess.run([sys.executable, "train.py", "--output_dir", str(out), "--report_to", "none", *args],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    # nothing saved is touched; the only thing added is the rank log folder (opened first, so a failure's traceback
    # always has a home)
    assert sorted(set(os.listdir(out)) - {"logs"}) == ["keep.txt"] and (out / "keep.txt").read_text() == "saved before"
    return p


# Each case is a train.py start (~14 s). The path (one line, exit 2, nothing saved touched, no traceback) stays fast
# through the `--context_parallel_size two` case, whose rule has no unit test; the others are slow, each naming the
# one-process test of its rule.
@pytest.mark.parametrize("make, args, match", [
    pytest.param(None, ["--dataset_path", "/no/such.jsonl"], "--dataset_path /no/such.jsonl: no such file or folder",
                 marks=pytest.mark.slow),  # fast sibling: tests/unit/training/test_config.py::test_bad_values_one_line
    pytest.param("", [], "no documents",
                 marks=pytest.mark.slow),  # fast sibling: tests/unit/data/test_data.py::test_bad_dataset_errors
    pytest.param('{"input_ids": [5, 6, 7]}\n{"input_ids": [5, "x"]}\n', [], "data.jsonl:2: expected",
                 marks=pytest.mark.slow),  # the reader's rule: test_data
    pytest.param('{"input_ids": [5, 6, 7]}\n', ["--learning_rat", "1"], "unknown command-line argument",
                 marks=pytest.mark.slow),  # fast sibling: tests/unit/training/test_config.py::test_bad_values_one_line
    pytest.param('{"input_ids": [5, 6, 7]}\n', ["--sequence_parallel_size", "2"], "does not divide world size 1",
                 marks=pytest.mark.slow),  # fast sibling: tests/unit/training/test_config.py::test_layout_errors
    pytest.param('{"input_ids": [5, 6, 7]}\n', ["--context_parallel_size", "3"],
                 "context_parallel_size=3 does not divide sequence_parallel_size=1: use one of [1] or auto",
                 marks=pytest.mark.slow),
    ('{"input_ids": [5, 6, 7]}\n', ["--context_parallel_size", "two"], "use auto or an integer"),
    pytest.param('{"input_ids": [5, 6, 7]}\n', ["--async_save", "maybe"], "--async_save 'maybe': use auto",
                 marks=pytest.mark.slow),  # the save defaults (issue 35): test_save_defaults
])
def test_one_line_errors(tmp_path, make, args, match):
    data = tmp_path / "data.jsonl"
    if make is not None:
        data.write_text(make)
        args = ["--dataset_path", str(data), *args]
    p = run_train(args, tmp_path)
    assert p.returncode == 2, p.stderr[-2000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and match in last, p.stderr[-2000:]
    assert "Traceback" not in p.stderr


def test_tokenizer_larger_than_model_vocab(tmp_path):
    from data.corpus import build_demo_corpus

    _, spm_model = build_demo_corpus()
    model = save_tiny_model(str(tmp_path / "small_vocab"), "tiny-llama", vocab_size=1000)
    data = tmp_path / "t.jsonl"
    data.write_text('{"text": "import os\\nprint(os.getcwd())\\n"}\n')
    p = run_train(["--model_name_or_path", model, "--dataset_path", str(data),
                   "--tokenizer_name_or_path", spm_model], tmp_path)
    assert p.returncode == 2
    assert "has 2000 tokens but the model's vocab_size is 1000" in p.stderr.strip().splitlines()[-1]


@pytest.mark.slow  # ~12 s each: a train.py start
def test_stage_too_short_for_passkey_is_refused_before_training(tmp_path):
    """The demo corpus has a text tokenizer, so every stage ends with passkey trials; 64 tokens cannot hold one.
    This used to surface after the step had run and its checkpoint was written."""
    p = run_train(["--max_seq_length", "64", "--max_steps", "1"], tmp_path)
    assert p.returncode == 2, p.stderr[-2000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("error: stage ") and "too short for a passkey trial (needs" in last, last
    assert "eval.passkey_trials: 0" in last and "Traceback" not in p.stderr


@pytest.mark.slow
def test_dynamic_rope_under_sp_is_refused_by_dry_run(tmp_path):
    recipe = tmp_path / "dynamic_sp2.yaml"
    recipe.write_text("sequence_parallel_size: 2\nstages:\n  - name: base\n    max_seq_length: 128\n"
                      "  - name: long\n    max_seq_length: 256\n    rope: {rope_type: dynamic, factor: 2.0}\n")
    p = run_train(["--config", str(recipe), "--dry_run", "--nodes", "1", "--gpus_per_node", "2"], tmp_path)
    assert p.returncode == 2, p.stderr[-2000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("error: stage 1 (long): rope: rope_type dynamic") and "use yarn or linear, or " \
        "sequence_parallel_size 1" in last, last
    assert "Traceback" not in p.stderr


@pytest.mark.slow  # a train.py start; fast sibling: tests/unit/training/test_ds_config.py::test_fp16_auto_is_off_and_fp16_is_refused_on_cpu
def test_fp16_on_cpu_is_refused(tmp_path):
    p = run_train(["--fp16", "--max_steps", "1"], tmp_path)
    assert p.returncode == 2, p.stderr[-2000:]
    assert p.stderr.strip().splitlines()[-1] == "error: fp16 needs a GPU with loss scaling: use --bf16 or fp32 on CPU"


def test_library_error_is_a_failure_not_bad_input(tmp_path):
    """A ValueError raised inside a library (here: numpy, from a corrupt cached token file) is exit 1 with the
    traceback, not exit 2: SLURM must not treat a crash as the user's typo."""
    from training import job

    def boom():
        import numpy as np

        np.zeros(3).reshape(7)  # ValueError raised inside numpy

    try:
        boom()
    except ValueError as e:
        assert not job._is_input_error(e)
    try:
        from training.config import parse_config

        parse_config(["--learning_rate", "-1"])
    except ValueError as e:
        assert job._is_input_error(e)
    # the same refusal through a checkout reached by a symlink (a linked home, an absolute script path): it was a
    # traceback with exit 1, the path compared as text with the real one
    link = tmp_path / "link"
    link.symlink_to(job.ROOT)
    src = os.path.join(job.ROOT, "training", "config.py")
    line = next(i for i, t in enumerate(open(src), 1) if t.lstrip().startswith("raise ValueError("))
    try:
        exec(compile("\n" * (line - 1) + "raise ValueError('x')", str(link / "training" / "config.py"), "exec"))
    except ValueError as e:
        assert job._is_input_error(e)


def test_architecture_without_the_attention_backend_is_one_line(tmp_path):
    """Gemma-2 has no sdpa path in transformers: refused from its config before any heavy work (was the
    library's traceback when the engine built the model), naming the backends it has."""
    from transformers import AutoConfig

    from model_utils.families import check_config

    folder = tmp_path / "gemma2"
    AutoConfig.for_model("gemma2", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         final_logit_softcapping=None).save_pretrained(folder)
    (folder / "model.safetensors").touch()  # a weight file (a folder without one is refused first)
    # train.py's config step in this process (training.startup.load_run_config, the first thing train.py does after
    # opening its channel; a start of its own was ~20 s): how train.py makes a refusal exit 2 with it as its last line
    # is test_one_line_errors' fast case
    from training.startup import load_run_config

    with pytest.raises(ValueError) as e:
        load_run_config(["--model_name_or_path", str(folder), "--attn_implementation", "sdpa",
                         "--output_dir", str(tmp_path / "out"), "--report_to", "none"])
    assert f"error: {e.value}" == ("error: Gemma2ForCausalLM: transformers has no sdpa attention for this "
                                   "architecture; use --attn_implementation flex_attention or "
                                   "flash_attention_2 or flash_attention_3")
    check_config(AutoConfig.from_pretrained(folder), "flex_attention")  # the backend it has passes
    check_config(AutoConfig.for_model("llama"), "sdpa")


@pytest.mark.slow  # fast sibling: tests/unit/model_utils/test_export_targets.py (check_out's rule, the start-up form)
def test_a_linked_export_folder_holding_other_work_is_refused_before_training(tmp_path):
    """RUN/hf_model a link to a folder of other work: the final export replaced that folder after the whole run (or
    failed there). train.py refuses it at start-up, in one line, on rank 0's reading."""
    other = tmp_path / "scratch"
    other.mkdir()
    (other / "results.csv").write_text("mine")
    out = tmp_path / "out"
    out.mkdir()
    (out / "hf_model").symlink_to(other)
    data = tmp_path / "data.jsonl"
    data.write_text('{"input_ids": [5, 6, 7]}\n')
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=ROOT)
    env.pop("RANK", None)
    p = subprocess.run([sys.executable, "train.py", "--output_dir", str(out), "--report_to", "none", "--dataset_path",
                        str(data)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "which the export would replace" in p.stderr.strip().splitlines()[-1], p.stderr[-2000:]
    assert (other / "results.csv").read_text() == "mine" and "Traceback" not in p.stderr
    assert not (out / "checkpoints").exists()  # before any training (the export's own check comes after it)
