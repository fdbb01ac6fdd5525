"""bench/control_plane.py's quick check: the job's store, 64 ranks' heartbeats and watchers, the start-up agreement,
a silent rank and the abort's spread, and the descriptor refusal, in one process with the channel's timings
shortened (POLL_S 0.2 s, STALL_S 1.5 s)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bench.control_plane import _numeric_names
from tests.distributed import ROOT


@pytest.mark.slow  # ~10 s (5 s of it importing torch); fast siblings: test_watcher's channel tests (suspend orders,
# never-arrived, a world the store cannot hold), which drive the same Watcher and refusal with a fake clock
def test_the_control_plane_of_64_ranks():
    env = dict(os.environ, PYTHONPATH=ROOT, TORCH_CPP_LOG_LEVEL="FATAL")
    preload = _numeric_names()  # this machine's resolver stalls concurrent connects 5 s each (see the bench)
    if preload:
        env["LD_PRELOAD"] = preload
    proc = subprocess.run([sys.executable, "-m", "bench.control_plane", "--check", "64"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    ok, no = got["raised"], got["refused"]
    assert ok["ranks_connected"] == 64 and ok["server_fds"] >= 3 * 64  # every rank's three connections held
    assert ok["agreement_spread_s"] < 5 and ok["decision_s"] < 5  # every rank agreed, every rank got the decision
    assert ok["requests_per_s"] > 64 * 1.5 / 0.2 * 0.5  # 1.5 requests per rank per POLL_S (a loaded machine: half)
    assert 1.5 <= ok["silent_declared_after_s"] < 1.5 + 5, ok  # STALL_S after it went silent, not before
    assert ok["abort_read_by"] == 62 and ok["exit_codes"] == [69], ok  # every other rank read rank 0's abort
    assert ok["abort_spread_s_max"] < 5, ok
    assert no["ranks_refused"] == 64 and no["refusal_line"].startswith("the job's store"), no
