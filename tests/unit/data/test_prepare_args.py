"""data/prepare_args.py: scripts/prepare_data.py's default worker count follows the CPUs this process may use, its
cgroup's CPU quota included (a fake /proc/self/cgroup and /sys/fs/cgroup tree)."""

from __future__ import annotations

import os

import pytest

from base import host
from data.prepare_args import MAX_WORKERS, default_workers, parser
from tests.unit.base.test_host import cpu_tree


@pytest.mark.parametrize("version, quota, workers", [
    (2, (800000, 100000), 7),  # a pod limited to 8 CPUs on a 128-core node: 7, not 32 (~15 GB of tokenizers)
    (1, (50000, 100000), 1),  # docker --cpus 0.5 (cgroup v1)
    (2, ("max", 100000), MAX_WORKERS),  # no quota: the affinity's 128 - 1, at most 32
    (1, (-1, 100000), MAX_WORKERS),
])
def test_default_workers_follow_the_cpu_quota(tmp_path, monkeypatch, version, quota, workers):
    proc, root = cpu_tree(tmp_path, "/", {"/": quota}, version)
    monkeypatch.setattr(host, "PROC_CGROUP", proc)
    monkeypatch.setattr(host, "CGROUP_ROOT", root)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(128)), raising=False)
    assert default_workers() == workers
    assert parser("x").parse_args(["--output", "o"]).workers == workers


def test_an_unquoted_pattern_the_shell_expanded_is_one_line(tmp_path, capsys):
    """`--input dir/*.jsonl` unquoted: the shell gives `--input dir/a.jsonl dir/b.jsonl ...`, --input takes one, and
    argparse ended with its usage block and "unrecognized arguments". One line saying to quote the pattern (or give
    --input once per file), naming the pattern; a leftover that is no path stays argparse's message."""
    from data.prepare_data import main

    for name in ("a.jsonl", "b.jsonl", "c.jsonl"):
        (tmp_path / name).write_text('{"input_ids": [1, 2]}\n')
    files = [str(tmp_path / n) for n in ("a.jsonl", "b.jsonl", "c.jsonl")]
    assert main(["--input", *files, "--output", str(tmp_path / "out"), "--vocab_size", "10"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"error: --input {' '.join(files)}: 3 paths after one --input"), err
    assert f"quote the pattern (--input '{tmp_path}/*.jsonl'" in err and "--input once per file" in err, err
    assert main(["--output", str(tmp_path / "out"), *files[1:]]) == 2  # paths without any --input
    assert "2 path(s) without --input" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # refused before any work
    with pytest.raises(SystemExit):  # a mistyped flag: argparse's own message
        main(["--inptu", files[0], "--output", str(tmp_path / "out")])
    assert "unrecognized arguments: --inptu" in capsys.readouterr().err
