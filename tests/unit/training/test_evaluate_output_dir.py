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
