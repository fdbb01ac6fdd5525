"""The benchmark scripts' own bookkeeping: what a failed launch's record says, and the paired-ratio summary
the README's tokens/s claim against the HF integration rests on."""

from __future__ import annotations

import importlib.util
import math
import os
import sys

from tests.distributed import ROOT


def _load(name: str):
    sys.path.insert(0, os.path.join(ROOT, "scripts"))  # bench_peers imports bench_memory by name
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "scripts", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


bm = _load("bench_memory")
bp = _load("bench_peers")

LAUNCHER_EXIT = ("[2026-11-23 15:34:27,800] [ERROR] [launch.py:259:sigkill_handler] ['/venv/bin/python3', '-u', "
                 "'x.py', '--local_rank=1'] exits with return code = {}\n")


def _error(tmp_path, text: str) -> str:
    log = tmp_path / "launch.log"
    log.write_text(text)
    return bm.launch_failure(str(log))["error"]


def test_error_line_names_the_rank_exception_behind_torch_prefix(tmp_path):
    text = ("[rank1]: Traceback (most recent call last):\n[rank1]:   File \"x.py\", line 3, in <module>\n"
            "[rank1]: RuntimeError: Connection reset by peer\n" + LAUNCHER_EXIT.format(1))
    assert _error(tmp_path, text) == "RuntimeError: Connection reset by peer"


def test_error_line_prefers_train_py_one_line_error(tmp_path):
    text = "[0]: error: --max_seq_length 3 must be a multiple of 2\n" + LAUNCHER_EXIT.format(2)
    assert _error(tmp_path, text) == "error: --max_seq_length 3 must be a multiple of 2"


def test_error_line_without_exception_gives_exit_code_and_last_output(tmp_path):
    text = "step 1 tok/s 4000\n[2026-11-23] [INFO] [launch.py:253:sigkill_handler] Killing subprocess 7\n" + \
        LAUNCHER_EXIT.format(-9)
    assert _error(tmp_path, text) == "a rank exited with return code -9; its last output: step 1 tok/s 4000"


def test_log_tail_keeps_the_last_lines(tmp_path):
    log = tmp_path / "launch.log"
    log.write_text("".join(f"line {i}\n" for i in range(50)))
    assert bm.launch_failure(str(log), tail=3)["log_tail"] == ["line 47", "line 48", "line 49"]


def test_ratio_summary_geomean_interval_and_count():
    r = bp.ratio_summary([2.0, 0.5, 1.0, 1.0])
    assert r["n"] == 4 and r["geomean_ratio"] == 1.0 and r["rounds_ours_at_least_as_fast"] == 3
    lo, hi = r["ci95"]
    assert 0.5 <= lo < 1.0 < hi <= 2.0
    same = bp.ratio_summary([1.02] * 5)  # no spread: the interval collapses onto the value
    assert same["ci95"] == [1.02, 1.02] and same["rounds_ours_at_least_as_fast"] == 5
    faster = bp.ratio_summary([1.03, 1.01, 1.05, 1.02, 1.04, 1.02])
    assert faster["ci95"][0] > 1.0 and math.isclose(faster["geomean_ratio"], 1.028, abs_tol=1e-3)
