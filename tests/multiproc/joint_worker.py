"""Several test workers, one after the other, in one multi-process launch (one start-up: ~15 s on 2 cores).

argv[1]: JSON list of [worker script, its argv list]; each runs as its own `__main__` would, on the same ranks (the
workers call base.parallel.init_distributed per case, which keeps the process group). Run by
tests/multiproc/joint_launch.py under tests.distributed.run.
"""

import json
import os
import runpy
import sys
import time

if __name__ == "__main__":
    for worker, args in json.loads(sys.argv[1]):
        sys.argv = [worker, *args]
        t0 = time.monotonic()
        runpy.run_path(worker, run_name="__main__")
        # each worker's share of the launch, in the rank logs (what to cut when the joint launch grows)
        print(f"joint_worker: {os.path.basename(worker)} {args[0][:80]}... took {time.monotonic() - t0:.1f} s",
              file=sys.stderr, flush=True)
