"""Worker for tests/test_cluster_path.py: run the shared-output check; with argv[2] == "1", rank 1 is made
blind to the other ranks' probe files (what a node-local --output_dir looks like). Writes result<rank>.json
next to the output folder."""

import json
import os
import sys

from tests.distributed import DIST_TIMEOUT_S
from training import comm
from training.parallel import check_shared_output, init_distributed

out, blind = sys.argv[1], sys.argv[2] == "1"
dims = init_distributed(1, timeout_s=DIST_TIMEOUT_S)
if blind and dims.rank == 1:
    real = os.listdir
    os.listdir = lambda p: [n for n in real(p) if n == f"rank{dims.rank:05d}"] if ".probe-" in str(p) else real(p)
try:
    check_shared_output(out)
    error = None
except ValueError as e:
    error = str(e)
with open(os.path.join(os.path.dirname(out), f"result{dims.rank}.json"), "w") as fh:
    json.dump({"error": error}, fh)
comm.barrier()
