"""The exit codes of a rank, a node's launcher and the SLURM job: which kind of end it was, and what follows.

| code | name | kind of end | what scripts/slurm.sbatch does |
|---|---|---|---|
| 0 | EXIT_OK | run complete (`OUTPUT_DIR/COMPLETE` written) | done |
| 1 | EXIT_FAILED | a crash: this rank's own exception (traceback in its rank log) | confined to one node of several (the job's first failure on record began there, no other node crashed on its own): requeue without that node, at most ULYSSES_MAX_CRASH_REQUEUES (2) per job, never for the same failure (checkpoint step, last step) twice; otherwise fail, no requeue |
| 2 | EXIT_USAGE | bad input: one line, before any work, nothing saved touched; or a full disk / quota (one line) | fail, no requeue |
| 69 | EXIT_PEER_LOST | a peer was lost: a rank's heartbeat stalled, the job's store vanished, a node's launcher died or a rank never arrived at start-up (EX_UNAVAILABLE) | requeue, excluding the lost node where known; resume from the newest complete checkpoint |
| 75 | EXIT_PREEMPTED | stopped after an agreed save: a signal, the stop file or the time limit (EX_TEMPFAIL) | requeue; resume from that save |
| 130 | EXIT_INTERRUPTED | a user's Ctrl-C (SIGINT: 128 + 2) before train.py's stop flag handles it (the start-up: one line, nothing to save, no crash record; training/job.py) | fail, no requeue (never the crash requeue) |

A lost node is a requeue, not a failure: its last complete checkpoint is intact, and Slurm's own node-failure requeue
comes too late (SlurmdTimeout, 300 s by default, after the job has already ended with the code its survivors gave).
A crash confined to one node (a GPU Xid, an ECC error) is too, bounded so that a bug never loops (docs/launch.md,
"A crash on one node").
"""

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_PEER_LOST = 69  # sysexits EX_UNAVAILABLE: a peer (rank, node, the job's store) is unavailable
EXIT_PREEMPTED = 75  # sysexits EX_TEMPFAIL: "temporary failure, retry later"
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a program a Ctrl-C ended: a user's stop, no crash
