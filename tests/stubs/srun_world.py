"""Stand-in for train.py under `srun python ...` (one task per rank, no launcher): the same start as train.py
(training.job.run_job, the abort channel, the process group), one all-reduce; prints `world W rank R local L sum S`
(S = W when every task joined one world) and the folder DeepSpeed's JIT ops came from, and exits 0."""

import sys

from training.job import run_job


def main() -> int:
    import os

    from base import comm

    comm.open_channel()
    rank, world, local = comm.init(60)
    total = int(comm.all_reduce([1.0])[0].item())
    # one write of the whole line (under PYTHONUNBUFFERED print writes the text and its newline apart, and the two
    # tasks share srun's stdout: a clean-clone make test once read rank 1's line glued to rank 0's path)
    sys.stdout.write(f"world {world} rank {rank} local {local} sum {total} master {os.environ['MASTER_ADDR']} "
                     f"ops {os.environ.get('TORCH_EXTENSIONS_DIR')}\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(run_job(main))
