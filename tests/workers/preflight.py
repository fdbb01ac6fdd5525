"""Worker for tests/unit/training/test_preflight.py: the start-up checks (training/preflight.preflight) on a 2-rank world where
each rank plays its own host (node0, node1) and only rank 1 sees the trouble: argv[2] "lock" (a build lock in its
extensions folder), "memory" (MemAvailable too small for its ranks), "cgroup" (its job's cgroup memory limit too
small, the fake /proc/self/cgroup + /sys/fs/cgroup tree the test wrote under argv[1]/fake), "memlock" (a locked-memory limit below what a
GPU run with offload pins: a warning on rank 0's output, no stop), "ok" (nothing); several, comma-separated, run in
turn in one launch. Writes result<rank>_<mode>.json ({"error": the line or null}) into argv[1]."""

import json
import os
import sys

from base import comm, host
from base.parallel import init_distributed
from model_utils.build import load_hf_config
from tests.distributed import DIST_TIMEOUT_S
from training import preflight
from training.config import parse_config
from training.curriculum import resolve_stages

out, modes = sys.argv[1], sys.argv[2].split(",")
dims = init_distributed(1, timeout_s=DIST_TIMEOUT_S)
preflight.socket.gethostname = lambda: f"node{dims.rank}"
cfg = parse_config(["--output_dir", os.path.join(out, "run")])
stages = resolve_stages(cfg, dp_of_sp=lambda sp: dims.world // sp)
arch = load_hf_config(cfg.model_name_or_path).get_text_config()
READINGS = ("build_locks", "mem_available_bytes", "memory_limit", "no_gpu", "memlock_limit")
real = {name: getattr(preflight, name) for name in READINGS}
for mode in modes:  # every case in one launch (a 2-rank launch costs ~10 s here)
    for name, fn in real.items():
        setattr(preflight, name, fn)
    print(f"=== mode {mode}", flush=True)  # the test splits rank 0's output at these lines
    if dims.rank == 1:  # this rank's own readings; rank 0 sees a healthy host
        if mode == "lock":
            preflight.build_locks = lambda ext_dir=None: [("/ext/cpu_adam/lock", 3600.0)]
        elif mode == "memory":
            preflight.mem_available_bytes = lambda path=None: 1024  # 1 KiB: nothing fits
        elif mode == "cgroup":  # the real reading of a cgroup tree: its files say 1 MiB limit, 0.5 MiB in use
            fake = os.path.join(out, "fake")
            preflight.memory_limit = lambda f=fake: host.cgroup_memory(os.path.join(f, "proc", "cgroup"),
                                                                       os.path.join(f, "cgroup"))
    if mode == "memlock":  # a GPU run (pinned offload) as far as the plan is concerned; only node1 limits locked memory
        preflight.no_gpu = lambda: False
        preflight.memlock_limit = lambda: 64 * 1024 if dims.rank == 1 else None
    try:
        preflight.preflight(cfg, stages, dims, arch, bf16=False)
        error = None
    except ValueError as e:
        error = str(e)
    with open(os.path.join(out, f"result{dims.rank}_{mode}.json"), "w") as fh:
        json.dump({"error": error}, fh)
    comm.barrier()
