"""Stand-in for train.py in launcher tests: no model, just train.py's signal and exit-code contract.

Each rank writes FAKE_DIR/ready<RANK> once its handlers are installed. FAKE_EXIT=N: exit N at once.
FAKE_EXIT=wait: wait for SIGUSR1/SIGUSR2/SIGTERM/SIGINT (at most 120 s), write FAKE_DIR/got<RANK> with the
signal's name, "save" for a moment and exit 75, like a preempted run. Like train.py (training/job._record), each rank
records its exit code in LAUNCH_EXIT_DIR before it exits.
"""

import os
import signal
import sys
import time

got: list[int] = []
for s in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT):  # training/preemption.SIGNALS
    signal.signal(s, lambda signum, frame: got.append(signum))
rank = os.environ.get("RANK", "0")
out = os.environ["FAKE_DIR"]
open(os.path.join(out, f"ready{rank}"), "w").close()
mode = os.environ.get("FAKE_EXIT", "0")


def leave(code: int) -> None:
    where = os.environ.get("LAUNCH_EXIT_DIR")
    if where and os.path.isdir(where):
        with open(os.path.join(where, f"rank{rank}"), "w") as fh:
            fh.write(f"{code}\n")
    sys.exit(code)


if mode != "wait":
    leave(int(mode))
deadline = time.time() + 120
while not got and time.time() < deadline:
    time.sleep(0.05)
if not got:
    leave(1)
with open(os.path.join(out, f"got{rank}"), "w") as fh:
    fh.write(signal.Signals(got[0]).name)
time.sleep(0.5)
leave(75)
