"""Stand-in for train.py in launcher tests: writes FAKE_DIR/env<RANK>.json, the variables a rank got from its
launcher (interface variables, threads, rank layout), and the CPUs it may run on; exits 0."""

import json
import os

keys = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "FI_PROVIDER", "UCX_TLS", "OMP_NUM_THREADS",
        "RANK", "LOCAL_RANK", "WORLD_SIZE")
seen = {k: os.environ.get(k) for k in keys}
seen["cpus"] = sorted(os.sched_getaffinity(0))
with open(os.path.join(os.environ["FAKE_DIR"], f"env{os.environ.get('RANK', '0')}.json"), "w") as fh:
    json.dump(seen, fh)
