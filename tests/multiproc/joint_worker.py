"""Several test workers, one after the other, in one multi-process launch (one start-up: ~15 s on 2 cores).

argv[1]: JSON list of [worker script, its argv list]; each runs as its own `__main__` would, on the same ranks (the
workers call base.parallel.init_distributed per case, which keeps the process group). Run by
tests/multiproc/joint_launch.py under tests.distributed.run.
"""

import json
import runpy
import sys

if __name__ == "__main__":
    for worker, args in json.loads(sys.argv[1]):
        sys.argv = [worker, *args]
        runpy.run_path(worker, run_name="__main__")
