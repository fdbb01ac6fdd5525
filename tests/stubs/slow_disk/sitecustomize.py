"""Slow storage for the ranks of a test run, as a loaded shared file system: every fsync takes SLOW_DISK_S seconds
more (fsync returns only once the bytes are on the storage). Python imports this at start-up when tests/stubs/slow_disk
is on PYTHONPATH; only processes with RANK set (the training ranks) are slowed. A checkpoint write then spans several
steps, so a signal or a kill lands during it (tests/e2e/test_resume.py)."""

import os
import time

if os.environ.get("RANK") is not None and float(os.environ.get("SLOW_DISK_S", "0")) > 0:
    _delay, _fsync = float(os.environ["SLOW_DISK_S"]), os.fsync

    def _slow_fsync(fd) -> None:
        time.sleep(_delay)
        _fsync(fd)

    os.fsync = _slow_fsync
