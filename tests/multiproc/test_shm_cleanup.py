"""DeepSpeed's CPU shared-memory all-reduce leaves a 66 MB /dev/shm segment per rank after every launch
(RAM, until reboot); base.parallel.init_distributed unlinks the names once all ranks have mapped them."""

from __future__ import annotations

import glob
import json
import os
import subprocess

import pytest

from tests.distributed import ROOT, run

pytestmark = pytest.mark.dist


def test_shm_segment_released_and_allreduce_still_works(tmp_path):
    log_dir = str(tmp_path / "logs")
    # LOCAL_SIZE == world is how the deepspeed launcher tells the op that all ranks share this machine
    run(os.path.join(ROOT, "tests", "workers", "shm.py"), [], 2, log_dir, timeout=180, extra_env={"LOCAL_SIZE": "2"})
    recs = []
    for r in range(2):
        with open(os.path.join(log_dir, f"rank{r}.log")) as fh:
            recs += [json.loads(line) for line in fh if line.startswith("{")]
    assert len(recs) == 2, recs
    for rec in recs:
        assert rec["created"], f"rank {rec['rank']}: no SHM segment at {rec['path']}: the ShareMemComm op did not run"
        assert rec["released"] == rec["path"] and not rec["exists_after"] and rec["again"] is None, rec
        assert rec["sum_ok"], f"rank {rec['rank']}: all-reduce wrong after the name was unlinked"
        assert not os.path.exists(rec["path"])


@pytest.mark.slow  # ~35 s; the segment release itself is the fast test above
def test_train_py_under_the_deepspeed_launcher_leaves_no_segment(tmp_path):
    port = "29733"
    pattern = f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"
    for stale in glob.glob(pattern):  # this port is this test's own
        os.unlink(stale)
    cmd = [os.path.join(ROOT, ".venv", "bin", "deepspeed"), "--num_gpus", "2", "--master_port", port, "train.py",
           "--model_name_or_path", "tiny-llama", "--max_seq_length", "256", "--sequence_parallel_size", "2",
           "--max_steps", "1", "--output_dir", str(tmp_path / "run"), "--report_to", "none", "--no-export_hf",
           "--resume", "none", "--no-progress_bar"]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert glob.glob(pattern) == []
