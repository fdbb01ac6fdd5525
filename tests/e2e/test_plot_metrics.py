"""scripts/plot_metrics.py: stage boundaries marked on the loss plot, and their edge cases."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess

from tests.e2e.launchers import ROOT, clean_env


def load_plot_metrics():
    spec = importlib.util.spec_from_file_location("plot_metrics", os.path.join(ROOT, "scripts", "plot_metrics.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def write_metrics(path, stage_of, n: int = 10) -> None:
    rows = [{"step": s, "stage": stage_of(s), "loss": 5 - 0.1 * s, "lr": 1e-3, "tokens": 64 * s,
             "tokens_per_s": 100.0 + s, "seq_len": 64 * 2 ** stage_of(s), "sp": 2, "dp": 1, "peak_mem_gb": 1.0 + 0.1 * s}
            for s in range(1, n + 1)]
    rows.insert(5, {"event": "eval", "stage": 0, "step": 5, "heldout_loss": 4.0})  # not a step
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 11, "lo')  # torn last line


def test_plot_marks_stage_boundaries(tmp_path):
    mod = load_plot_metrics()
    m = tmp_path / "metrics.jsonl"
    write_metrics(m, lambda s: 0 if s <= 5 else 1)
    steps = mod.read_steps(str(m))
    assert [r["step"] for r in steps] == list(range(1, 11))
    assert mod.stage_boundaries(steps) == [6]
    png = tmp_path / "plots" / "m.png"
    png.parent.mkdir()
    p = subprocess.run([os.path.join(ROOT, ".venv", "bin", "python"), os.path.join(ROOT, "scripts", "plot_metrics.py"),
                        str(m), "-o", str(png)], capture_output=True, text=True, timeout=120,
                       env=clean_env(MPLBACKEND="TkAgg"))  # the script must pick Agg itself
    assert p.returncode == 0, p.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert "stage boundaries at [6]" in p.stdout


def test_stage_boundaries_edge_cases(tmp_path):
    mod = load_plot_metrics()
    m = tmp_path / "metrics.jsonl"
    write_metrics(m, lambda s: 0 if s <= 3 else 1 if s <= 7 else 2)
    assert mod.stage_boundaries(mod.read_steps(str(m))) == [4, 8]
    # old files have no "stage": one stage; a step logged twice after a resume keeps its last record
    m.write_text("".join(json.dumps({"step": s, "loss": float(s)}) + "\n" for s in (1, 2, 3, 2, 3, 4)))
    steps = mod.read_steps(str(m))
    assert [r["step"] for r in steps] == [1, 2, 3, 4] and mod.stage_boundaries(steps) == []
    m.write_text(json.dumps({"event": "eval", "step": 1}) + "\n")
    assert mod.main([str(m), "-o", str(tmp_path / "x.png")]) == 2


def test_a_skipped_step_is_a_gap_in_the_curves(tmp_path):
    """A step without a supervised token (optimizer_skipped) trained nothing: files before its loss was logged as null
    say 0.0 and ~5e8 tokens/s (its ~1 ms), drawn and averaged into the smoothed loss; read as gaps now."""
    mod = load_plot_metrics()
    m = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "loss": 2.0, "tokens_per_s": 100.0, "peak_mem_gb": 1.0} for s in range(1, 5)]
    rows[1].update(loss=0.0, tokens_per_s=5e8, optimizer_skipped=True)  # as written before
    rows[2].update(loss=None, tokens_per_s=None, optimizer_skipped=True)  # as written now
    rows[3].update(optimizer_skipped="overflow")  # fp16's overflow: the step ran, its loss stands
    m.write_text("".join(json.dumps(r) + "\n" for r in rows))
    steps = mod.read_steps(str(m))
    assert [r["step"] for r in steps] == [1, 2, 3, 4] and steps[1]["peak_mem_gb"] == 1.0
    loss = [mod._value(r, "loss") for r in steps]
    assert loss[0] == loss[3] == 2.0 and all(v != v for v in loss[1:3]), loss  # NaN: a gap
    assert all(v != v for v in (mod._value(r, "tokens_per_s") for r in steps[1:3]))
    assert mod.smooth(loss, 4)[-1] == 2.0
    assert mod.main([str(m), "-o", str(tmp_path / "m.png")]) == 0


def test_a_run_folder_is_read_and_a_missing_file_is_one_line(tmp_path, capsys):
    """`plot_metrics.py RUN` (eval_summary.py's form) plots RUN/metrics.jsonl; a missing file, or an --out in a
    missing folder, a folder or not an image's name, is one line (before: a run folder or a missing file was an
    IsADirectoryError / FileNotFoundError traceback)."""
    mod = load_plot_metrics()
    write_metrics(tmp_path / "metrics.jsonl", lambda s: 0)
    assert mod.main([str(tmp_path)]) == 0 and (tmp_path / "metrics.png").stat().st_size > 0
    for argv, line in (([str(tmp_path / "nope.jsonl")], "nope.jsonl: no such file"),
                       ([str(tmp_path), "-o", str(tmp_path / "no" / "m.png")], "its folder does not exist"),
                       # were matplotlib's ValueError traceback, and a folder.png written while the folder was printed
                       ([str(tmp_path), "-o", str(tmp_path / "x.txt")], ".txt is not an image format: end it in .png"),
                       ([str(tmp_path), "-o", str(tmp_path / "x")], "no extension: end it in .png"),
                       ([str(tmp_path), "-o", str(tmp_path)], f"a folder: name the image file, e.g. {tmp_path}/metrics")):
        capsys.readouterr()
        assert mod.main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and line in err[0], err
    assert not (tmp_path / "x.txt").exists() and not (tmp_path / "x.png").exists()
    assert not any(tmp_path.parent.glob(f"{tmp_path.name}.png"))


def test_resumes_are_read_and_drawn(tmp_path, capsys):
    """A resume (training/metrics_starts.py's `"event": "resume"` record: a later start continued after that step,
    its steps after dropped and trained again where `dropped_through` says so) was invisible on the plot. It is a thin
    grey line after the resumed step, named in the summary line; the record is no step."""
    mod = load_plot_metrics()
    m = tmp_path / "metrics.jsonl"
    write_metrics(m, lambda s: 0)
    recs = [json.loads(x) for x in m.read_text().splitlines()[:-1]]
    recs.insert(7, {"event": "resume", "step": 6, "dropped_through": 8})
    recs.insert(10, {"event": "resume", "step": 9})
    m.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert mod.resumes(recs) == [6, 9] and [r["step"] for r in mod.read_steps(str(m))] == list(range(1, 11))
    drawn = []
    real = mod.plot
    mod.plot = lambda steps, out, title="", resumed=(): drawn.append(list(resumed)) or real(steps, out, title, resumed)
    assert mod.main([str(m), "-o", str(tmp_path / "m.png")]) == 0
    assert drawn == [[6, 9]] and "resumed after steps [6, 9]" in capsys.readouterr().out
