"""train.py on an output folder that a live run holds (OUTPUT_DIR/RUN_LOCK, base/run_lock.py): refused in one line
(exit 2) before it writes anything there, whatever launched it."""

import json
import os
import subprocess
import sys

from base import run_lock
from tests.distributed import ROOT


def test_train_py_refuses_an_output_folder_a_live_run_holds(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    data = tmp_path / "data.jsonl"
    data.write_text('{"input_ids": [5, 6, 7]}\n')
    first = subprocess.Popen(["sleep", "120"])  # the live run: another launch on this host
    try:
        (out / run_lock.LOCK).write_text(json.dumps({**run_lock.me(), "pid": first.pid, "job": "",
                                                     "start": run_lock._start_time(first.pid)}))
        env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=ROOT)
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_JOB_ID", "SLURM_STEP_NUM_TASKS"):
            env.pop(k, None)
        p = subprocess.run([sys.executable, "train.py", "--output_dir", str(out), "--report_to", "none",
                            "--dataset_path", str(data), "--max_steps", "2"], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=300)
    finally:
        first.kill()
        first.wait()
    assert p.returncode == 2, p.stderr[-3000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: output folder {out} is held by a live run: host ") and f"pid {first.pid}" in last
    assert sorted(os.listdir(out)) == [run_lock.LOCK], os.listdir(out)  # nothing written: no logs, no checkpoint
