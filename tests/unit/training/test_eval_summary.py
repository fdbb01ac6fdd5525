"""scripts/eval_summary.py (what `make demo` and `make demo-sft` end with): a torn or hand-edited record under
OUTPUT_DIR/eval/ is one line naming that file and exit 2 (was `error: Expecting value: ...`, naming no file)."""

from __future__ import annotations

import importlib.util
import os

from tests.distributed import ROOT

_spec = importlib.util.spec_from_file_location("eval_summary", os.path.join(ROOT, "scripts", "eval_summary.py"))
eval_summary = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(eval_summary)


def test_a_corrupt_record_is_named_in_one_line(tmp_path, capsys):
    (tmp_path / "eval").mkdir()
    record = tmp_path / "eval" / "stage0.json"
    for body, says in (('{"stage": 0,\n', "not a readable evaluation record (Expecting property name"),
                       ("[1, 2]", "not an evaluation record (a JSON object)")):
        record.write_text(body)
        assert eval_summary.main([str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {record}: {says}") and err.count("\n") == 1, err
