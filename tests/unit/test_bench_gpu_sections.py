"""bench.gpu's --sections: an unknown name is refused in one line naming the known ones, before anything starts (a
misspelt name used to run nothing and end "ok", after a GPU machine's start)."""

from __future__ import annotations

import pytest

from bench import gpu


def test_an_unknown_section_is_refused_before_anything_starts(tmp_path, monkeypatch):
    def started(*a, **k):
        raise AssertionError("the run started")

    monkeypatch.setattr(gpu, "environment", started)
    monkeypatch.setattr(gpu, "Record", started)
    out = tmp_path / "gpu.json"
    with pytest.raises(SystemExit) as e:
        gpu.main(["--sections", "headline,kernal", "--out", str(out), "--work", str(tmp_path)])
    msg = str(e.value)
    assert "\n" not in msg and "'kernal'" in msg and "headline,kernels,arena,parity,long,gap,smoke,ladder" in msg, msg
    assert not out.exists()


def test_the_known_sections_pass_in_their_order():
    assert gpu.check_sections("kernels,headline") == ["kernels", "headline"]
    assert gpu.build_parser().parse_args([]).sections.split(",") == list(gpu.SECTIONS)


def test_the_docs_device_calls_fit_their_limit_and_say_there_are_two():
    """docs/benchmarks.md: the GPU check is two device calls (it said "one command, <= 8 min"); the headline's
    --budget_s leaves the call's timeout_s 590 at least 50 s for the unpack, the wheels' install and the imports
    before the budget's clock starts (the 2026-11-28 call spent 13 s there)."""
    import os
    import re

    text = " ".join(open(os.path.join(os.path.dirname(gpu.__file__), os.pardir, "docs", "benchmarks.md")).read().split())
    assert "one command, <= 8 min" not in text and "two device calls" in text
    budget = float(re.search(r"--budget_s (\d+) --sections headline`", text).group(1))
    assert "`timeout_s` 590" in text and budget + 50 <= 590
