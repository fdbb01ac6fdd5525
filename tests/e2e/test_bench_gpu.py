"""The GPU check's CPU dry mode (`python -m bench.gpu --dry`): the same script as on a GPU, tiny shapes. The
document-masking parity passes against the plain model on each document alone, the ladder's one train.py launch
records every rung (throughput rungs with auto's features, then the planner's longest length under the cap and one
above it), and the page renders from the JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.distributed import ROOT


def test_gpu_check_dry_run(tmp_path):
    out, page = tmp_path / "gpu.json", tmp_path / "gpu.md"
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-m", "bench.gpu", "--dry", "--out", str(out), "--page", str(page),
                        "--work", str(tmp_path / "work")], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    data = json.loads(out.read_text())
    assert [r["backend"] for r in data["parity"]] == ["sdpa"] and data["parity"][0]["ok"]
    # the check can see a bug: attention across documents is far outside the tolerance
    assert data["parity"][0]["wrong_rel_err"] > 100 * data["parity"][0]["loss_tol"]
    rungs = data["ladder"]["rungs"]
    assert [r["kind"] for r in rungs] == ["throughput"] * 3 + ["ladder"] * 2
    assert all(r["fits"] and r["tokens_per_s"] > 0 and r["predicted_gib"] > 0 for r in rungs)
    assert rungs[3]["length"] == data["ladder"]["planner_longest_leanest"] // 512 * 512
    assert "| 1,024 | throughput |" in page.read_text()
