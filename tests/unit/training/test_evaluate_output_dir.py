"""scripts/evaluate.py's --output_dir: a file there (or above it) is one line before any work (was NotADirectoryError
from the rank log, after the process group); a new folder, or one under a new folder, is taken."""

from __future__ import annotations

import os

import pytest

from scripts.evaluate import check_output_dir, parse_args, settings

BASE = os.path.join(os.path.dirname(__file__), "..", "..", "..", "recipes", "base", "tiny_passkey256")


def test_a_file_as_output_dir_is_one_line(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(ValueError, match=f"^--output_dir {f}: a file, not a folder: name a folder"):
        settings(parse_args([BASE, "--lengths", "256", "--output_dir", str(f)]))
    with pytest.raises(ValueError, match=f"^--output_dir {f}/sub: a file, not a folder \\({f} is\\)"):
        check_output_dir(str(f / "sub"))
    check_output_dir(str(tmp_path / "new" / "deeper"))  # folders that do not exist yet: made later
    check_output_dir(str(tmp_path))


@pytest.mark.parametrize("flags, match", [
    # '' wrote eval.json, summary.md and heatmaps.png into the current folder
    (["--lengths", "256", "--output_dir", ""], r"^--output_dir '': name a folder"),
    # nan / inf / 1e30: datetime.timedelta's traceback at the process group's start
    (["--lengths", "256", "--dist_timeout_s", "inf"], r"^--dist_timeout_s inf: use seconds > 0, at most 1e\+09"),
    (["--lengths", "256", "--dist_timeout_s", "nan"], r"^--dist_timeout_s nan: use seconds > 0"),
    (["--lengths", "256", "--dist_timeout_s", "1e30"], r"^--dist_timeout_s 1e\+30: use seconds > 0"),
    # inf: an OverflowError traceback (planner/memory_model.parse_seq_len); 1.5: evaluated at length 2
    (["--lengths", "256,inf"], r"^--lengths '256,inf': use earlier, all or a list of lengths such as 4096,8k$"),
    (["--lengths", "1.5"], r"^--lengths '1.5': use earlier, all or a list of lengths"),
    (["--lengths", "256", "--rope", "{rope_type: linear, factor: two}"], r"^--rope: factor 'two' is not a finite "
                                                                        r"number: write it as one \(e.g. factor: 4.0\)$"),
])
def test_odd_flag_values_are_one_line(tmp_path, flags, match):
    flags = flags + ["--output_dir", str(tmp_path / "out")] * ("--output_dir" not in flags)
    with pytest.raises(ValueError, match=match):
        settings(parse_args([BASE, *flags]))


def test_a_rope_number_written_as_text_is_a_number(tmp_path):
    """--rope '{rope_type: linear, factor: "2"}' (and YAML 1.1's 1e6, text): a TypeError traceback in the check."""
    s = settings(parse_args([BASE, "--lengths", "1.5k", "--output_dir", str(tmp_path), "--rope",
                             '{rope_type: dynamic, factor: "2", rope_theta: 1e6}']))
    assert s["lengths"] == [1536] and s["ropes"][0]["rope_theta"] == "1e6"  # read as 1e6 where it is applied (stage_rope)
