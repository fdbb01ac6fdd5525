"""data/chat_demo.py's command line (`make demo-sft`, scripts/setup.sh): its plainest run writes the set and a second
run keeps it; no OUT, a bad N, a folder or an unrelated existing file are one line and exit 2 (were an IndexError or
ValueError traceback, 4000 rows in a file named ./--help, an empty file from N=-5, a folder or a README accepted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from data.chat_demo import ROW_KEYS, main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_the_plainest_run_writes_the_set_and_a_second_run_keeps_it(tmp_path):
    out = tmp_path / "demo" / "chats.jsonl"
    p = subprocess.run([sys.executable, "-m", "data.chat_demo", str(out), "5"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0 and p.stdout == f"{out}\n", p.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 5 and all(any(k in r for k in ROW_KEYS) for r in rows)
    before = out.read_text()
    assert main([str(out)]) == 0 and out.read_text() == before  # as `make demo-sft` run twice: kept


@pytest.mark.parametrize("argv, message", [
    ([], "error: the following arguments are required: OUT"),
    (["{tmp}/c.jsonl", "ten"], "error: argument N: 'ten': use a positive integer"),
    (["{tmp}/c.jsonl", "-5"], "error: argument N: '-5': use a positive integer"),
    (["{tmp}/c.jsonl", "0"], "error: argument N: '0': use a positive integer"),
    (["{tmp}"], "error: OUT {tmp}: a folder: name a .jsonl file"),
    (["{tmp}/notes.txt"], "error: OUT {tmp}/notes.txt: exists and is not a chat set"),
])
def test_refusals_are_one_line(tmp_path, capsys, argv, message):
    (tmp_path / "notes.txt").write_text("my notes\n")
    argv = [a.format(tmp=tmp_path) for a in argv]
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(message.format(tmp=tmp_path)) and err.count("\n") == 1, err
    assert (tmp_path / "notes.txt").read_text() == "my notes\n" and not (tmp_path / "c.jsonl").exists()


def test_help_is_help_not_a_file(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0 and "OUT" in capsys.readouterr().out and os.listdir(tmp_path) == []
