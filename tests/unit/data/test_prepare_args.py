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
