"""Odd command-line inputs of the user tools and the benchmarks' render / report modes (audit 68): each is one line
naming the value and the fix (a ValueError, or exit 2 where main prints), and nothing is written. Before, each was a
traceback (OverflowError, ZeroDivisionError, UnicodeDecodeError, KeyError), a NaN table with exit 0, or a docs page
rewritten empty / truncated. Everything here is in-process and points every output into tmp_path: never docs/."""

from __future__ import annotations

import importlib.util
import json
import os
import stat
import subprocess
import sys

import pytest

from planner.auto_features import gpu_budget
from planner.memory_model import parse_seq_len
from tests.distributed import ROOT
from training.eval_settings import eval_value


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"odd_{name}", os.path.join(ROOT, "scripts", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


plan, mfu_bound, plot_metrics, eval_summary, plan_vs_run = (
    _script(n) for n in ("plan", "mfu_bound", "plot_metrics", "eval_summary", "plan_vs_run"))
GPU_JSON = os.path.join(ROOT, "bench", "results", "gpu.json")


def one_line(err: pytest.ExceptionInfo, *needles: str) -> str:
    text = str(err.value)
    assert "\n" not in text and all(n in text for n in needles), text
    return text


# --- item 8: lengths and numeric flags ---------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["inf", "-inf", "nan", "1.5", "1e400"])
def test_a_length_that_is_no_whole_number_of_tokens_is_refused(text):
    """inf was an OverflowError traceback (plan.py --seq_len, train.py --eval_lengths, evaluate.py --lengths); 1.5 was
    rounded to 2 tokens and planned."""
    with pytest.raises(ValueError) as err:
        parse_seq_len(text)
    one_line(err, repr(text), "whole number of tokens", "128k")
    with pytest.raises(ValueError) as err:  # train.py --eval_lengths, evaluate.py --lengths: the same parser
        eval_value("lengths", text, "--lengths")
    one_line(err, "--lengths", text)


def test_lengths_that_are_whole_numbers_still_parse():
    assert [parse_seq_len(s) for s in ("1.5k", "131072", "128K", "1M", "2_048", 4096)] == \
        [1536, 131072, 131072, 2**20, 2048, 4096]
    # a fraction of k / M rounds, as it always did (0.1M was refused for a day: a review of the change)
    assert [parse_seq_len(s) for s in ("0.1M", "1.2M", "0.3k")] == [104858, 1258291, 307]
    assert parse_seq_len("9007199254740993") == 9007199254740993  # digits exactly, past float's 2**53


@pytest.mark.parametrize("flag, value", [
    ("--seq_len", "inf"), ("--seq_len", "1.5"),
    ("--gpu_mem_gb", "inf"), ("--gpu_mem_gb", "nan"), ("--cpu_mem_gb", "nan"), ("--cpu_overhead_gb", "nan"),
    ("--cpu_overhead_gb", "inf"), ("--mfu", "nan"), ("--gpu_tflops", "nan"), ("--gpu_tflops", "inf"),
])
def test_plan_refuses_non_finite_flags_naming_them(flag, value):
    """Were: OverflowError / ZeroDivisionError tracebacks, 'cannot convert float NaN to integer' naming no flag, or
    NaN tables with exit 0."""
    with pytest.raises(ValueError) as err:
        plan.plan(["--model", "llama3-8b", "--seq_len", "128k", flag, value])
    one_line(err, value)
    if flag != "--seq_len":
        assert str(err.value).startswith(f"{flag} {value}: use a ")


def test_gpu_budget_refuses_an_infinite_memory_naming_the_flag():
    """train.py --dry_run --memory_features auto --gpu_mem_gb inf reached int(inf * GiB): an OverflowError."""
    for v in (float("inf"), float("nan")):
        with pytest.raises(ValueError) as err:
            gpu_budget(v)
        one_line(err, "--gpu_mem_gb", "finite")
    assert gpu_budget(80.0) == 78 * 2**30


@pytest.mark.parametrize("value", ["inf", "nan"])
def test_mfu_bound_refuses_a_non_finite_peak(value, capsys):
    """--peak_tflops inf divided by a zero bound (ZeroDivisionError); nan passed `not > 0` only by luck."""
    with pytest.raises(ValueError) as err:
        mfu_bound.main([GPU_JSON, "--peak_tflops", value])
    one_line(err, f"--peak_tflops {value}", "finite and > 0")
    assert capsys.readouterr().out == ""


# --- item 9: plot_metrics / eval_summary ---------------------------------------------------------------------------

def _rows(path, *extra) -> None:
    rows = [{"step": s, "loss": 2.0, "tokens_per_s": 10.0, "peak_mem_gb": 1.0, "stage": 0, "seq_len": 64}
            for s in (1, 2, 3)]
    path.write_text("".join(json.dumps(r) + "\n" for r in [*rows, *extra]))


@pytest.mark.parametrize("kind", ["not utf-8", "unreadable"])
def test_plot_metrics_refuses_a_file_it_cannot_read_in_one_line(tmp_path, capsys, monkeypatch, kind):
    m = tmp_path / "metrics.jsonl"
    if kind == "not utf-8":
        m.write_bytes(b"\xff\xfe" + json.dumps({"step": 1, "loss": 1.0}).encode() + b"\n")
    else:
        _rows(m)
        m.chmod(0)
        if os.access(m, os.R_OK):  # root reads anything: the open of a file without read permission, as it fails

            def refused(path, *a, **k):
                raise PermissionError(13, "Permission denied", str(path))

            monkeypatch.setattr(plot_metrics, "open", refused, raising=False)
    try:
        assert plot_metrics.main([str(m), "-o", str(tmp_path / "m.png")]) == 2
    finally:
        m.chmod(stat.S_IRUSR | stat.S_IWUSR)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {m}: cannot be read (") and "metrics.jsonl" in err[0], err
    assert not list(tmp_path.glob("*.png"))


def test_plot_metrics_skips_records_whose_step_or_stage_is_no_integer(tmp_path, capsys):
    """"step": null / "abc" and an eval line's "stage": "a" were TypeError / ValueError tracebacks."""
    m = tmp_path / "metrics.jsonl"
    _rows(m, {"step": None, "loss": 1.0}, {"step": "abc", "loss": 1.0}, {"step": "4", "loss": 1.5},
          {"event": "eval", "stage": "a", "seq_len": 64}, {"event": "eval", "stage": 0, "seq_len": 64,
                                                         "heldout_loss_by_position": [2.0, 1.0]})
    assert plot_metrics.main([str(m), "-o", str(tmp_path / "m.png")]) == 0
    out, err = capsys.readouterr()
    assert "4 steps" in out and "evaluations of stages [0]" in out, out
    assert err.count("note:") == 1 and "3 record(s) whose step / stage is not an integer skipped" in err, err
    assert [r["step"] for r in plot_metrics.read_steps(str(m))] == [1, 2, 3, 4]


def test_eval_summary_without_a_stage_name_shows_the_stage_number(tmp_path, capsys):
    """A record without stage_name was a KeyError traceback; one without its step is refused naming the file."""
    (tmp_path / "eval").mkdir()
    for k in (0, 1):
        (tmp_path / "eval" / f"stage{k}.json").write_text(json.dumps(
            {"stage": k, "step": k + 1, "seq_len": 64, "heldout_loss": 2.0 - k, "task_mean": {"passkey": {"64": 1.0}}}))
    assert eval_summary.main([str(tmp_path)]) == 0
    assert "stage 0 (0) -> stage 1 (1): " in capsys.readouterr().out
    (tmp_path / "eval" / "stage1.json").write_text(json.dumps({"stage": 1, "seq_len": "x", "task_mean": "no"}))
    assert eval_summary.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {tmp_path}/eval/stage1.json: not an evaluation record "
                                                   "(step, task_mean missing"), err


# --- item 13: plan_vs_run ------------------------------------------------------------------------------------------

def test_plan_vs_run_names_a_file_that_is_not_utf8(tmp_path):
    bad = tmp_path / "gpu.json"
    bad.write_bytes(b"\xff{}")
    with pytest.raises(ValueError) as err:
        plan_vs_run.main([str(bad)])
    assert one_line(err).startswith(f"{bad}: not a readable JSON file (UnicodeDecodeError)")


# --- item 12: the benchmarks' render / report modes ----------------------------------------------------------------

def _odd_files(tmp_path) -> dict:
    files = {"missing": tmp_path / "missing.json", "list": tmp_path / "list.json", "empty": tmp_path / "empty.json",
             "nonutf8": tmp_path / "nonutf8.json"}
    files["list"].write_text("[1, 2]")
    files["empty"].write_text("{}")
    files["nonutf8"].write_bytes(b"\xff\xfe{}")
    return files


def test_model_sweep_render_refuses_odd_input_and_keeps_the_page(tmp_path):
    """--render {} rewrote docs/models.md as an empty table (exit 0); a list or a bad file was a traceback."""
    from bench import model_sweep

    page = tmp_path / "models.md"
    page.write_text("the page before\n")
    for name, path in _odd_files(tmp_path).items():
        with pytest.raises(ValueError) as err:
            model_sweep.main(["--render", str(path), "--out", str(page)])
        one_line(err, f"--render {path}", "bench/results/model_sweep.json")
        assert page.read_text() == "the page before\n", name
    good = tmp_path / "sweep.json"
    good.write_text(json.dumps({"llama": {"status": "parity", "attn": "sdpa", "detail": "ok"}}))
    assert model_sweep.main(["--render", str(good), "--out", str(page)]) == 0
    assert "| `llama` | parity | sdpa | ok |" in page.read_text()
    assert not [p for p in os.listdir(tmp_path) if ".tmp." in p]


def test_model_sweep_render_exits_2_with_one_line(tmp_path):
    page = tmp_path / "models.md"
    proc = subprocess.run([sys.executable, "-m", "bench.model_sweep", "--render", str(tmp_path / "none.json"), "--out",
                           str(page)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == "" and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("error: --render ") and not page.exists()


def test_context_parallel_render_refuses_odd_input_before_touching_the_page(tmp_path):
    """--render list.json truncated docs/results/context_parallel.md, then crashed."""
    from bench import context_parallel as bcp

    page = tmp_path / "cp.md"
    page.write_text("the page before\n")
    torn = tmp_path / "torn.json"
    saved = json.load(open(os.path.join(ROOT, "bench", "results", "context_parallel.json")))
    torn.write_text(json.dumps({**saved, "load": []}))  # every key, one of another kind
    for path in [*_odd_files(tmp_path).values(), torn]:
        with pytest.raises(ValueError) as err:
            bcp.main(["--render", str(path), "--doc", str(page)])
        one_line(err, f"--render {path}", "bench/results/context_parallel.json")
        assert page.read_text() == "the page before\n", path
    assert bcp.main(["--render", os.path.join(ROOT, "bench", "results", "context_parallel.json"),
                     "--doc", str(page)]) == 0
    assert page.read_text().startswith("# Results: context parallelism")


@pytest.mark.parametrize("module, flag", [("calibration", "--report"), ("head_chunks", "--report"),
                                          ("peers", "--resummarize")])
def test_bench_reports_refuse_odd_input_in_one_line(tmp_path, capsys, module, flag):
    """Were FileNotFoundError / AttributeError / KeyError / UnicodeDecodeError tracebacks."""
    mod = importlib.import_module(f"bench.{module}")
    extra = ["--same_memory"] if module == "peers" else []
    for path in _odd_files(tmp_path).values():
        before = path.read_bytes() if path.exists() else None
        with pytest.raises(ValueError) as err:
            mod.main([*extra, flag, str(path)])
        one_line(err, f"{flag} {path}", "bench/results/")
        assert (path.read_bytes() if path.exists() else None) == before  # --resummarize rewrites in place: not these
    assert capsys.readouterr().out == ""


def test_bench_gpu_merge_refuses_odd_input_and_writes_nothing(tmp_path, capsys):
    from bench import gpu

    out, page = tmp_path / "gpu.json", tmp_path / "gpu.md"
    for path in [*_odd_files(tmp_path).values()]:
        assert gpu.main(["--merge", str(path), "--out", str(out), "--page", str(page)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"error: --merge {path}: "), err
        assert not out.exists() and not page.exists()
