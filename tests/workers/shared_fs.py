"""Worker for tests/e2e/test_cluster_path.py: run the shared-output check; with argv[2] == "1", rank 1 is made
blind to the other ranks' probe files (what a node-local --output_dir looks like); with "late", rank 1 sees
them only 2 s after it first looks (a node whose NFS cache lags). Writes result<rank>.json next to the output
folder."""

import json
import os
import sys
import time

from base import comm
from base.parallel import check_shared_output, init_distributed
from tests.distributed import DIST_TIMEOUT_S

out, mode = sys.argv[1], sys.argv[2]
dims = init_distributed(1, timeout_s=DIST_TIMEOUT_S)
if mode in ("1", "late") and dims.rank == 1:
    real, first = os.path.exists, []

    def exists(p) -> bool:  # the other ranks' probes are invisible here (for 2 s after the first look: "late")
        if ".probe-" in str(p) and not str(p).endswith(f"rank{dims.rank:05d}"):
            first.append(first[0] if first else time.monotonic())
            if mode == "1" or time.monotonic() - first[0] < 2.0:
                return False
        return real(p)
    os.path.exists = exists
try:
    check_shared_output(out, settle_s=5.0)
    error = None
except ValueError as e:
    error = str(e)
with open(os.path.join(os.path.dirname(out), f"result{dims.rank}.json"), "w") as fh:
    json.dump({"error": error}, fh)
comm.barrier()
