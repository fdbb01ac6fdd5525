"""One rank of a job with nothing but the abort channel (base/comm.py open_channel, the real one: its store, its
forked heartbeat, its watcher), the channel's timings shortened: POLL_S 0.2, STALL_S 5, LOST_STORE_S 4,
STORE_OP_TIMEOUT_S 1, SUSPENDED_S 1. Prints "joined", lives argv[1] seconds, leaves cleanly (exit 0); its watcher
ends it earlier with the job's exit code (69 for a lost peer). For test_watcher's SIGSTOP/SIGCONT test."""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from base import comm, watcher  # noqa: E402

for name, value in (("POLL_S", 0.2), ("STALL_S", 5.0), ("LOST_STORE_S", 4.0), ("STORE_OP_TIMEOUT_S", 1.0),
                    ("SUSPENDED_S", 1.0)):
    setattr(watcher, name, value)
comm.open_channel()
print("joined", flush=True)
time.sleep(float(sys.argv[1]))
comm.leave()
sys.exit(0)
