"""Which run a store belongs to: a rank that reaches another run's store leaves it untouched.

Two runs on one MASTER_PORT (two one-node runs on a shared node, both on deepspeed's 29500; a batch template's
exported port reused by two steps; base/slurm_env.py's job_port for jobs 10000 ids apart): the second run's rank 0
cannot host its store (EADDRINUSE, one line in base/comm.py), but its other ranks connected to the first run's store
and wrote into its keys: a failing rank's exception became the first run's abort, a clean leave marked the first
run's rank R done, and its rank R then lost its connection (exit 69). Now the store's host publishes the run's
identity (KEY) before any rank can read anything else: rank 0 right after it creates the server, node 0's launcher
(base/node_store.py serve) before any rank starts, rank 0 under torchrun's agent store as soon as it arrives. Every
other rank reads it (a bounded wait: START_WAIT_S from its start) before it writes anything, and refuses in one line
(exit 2) when it is not its own. The watcher's keys are also under the identity (base/watcher.py `use_run`), so
two runs' ranks can never write each other's keys, even on a store that publishes nothing.

The identity is what every rank of one launch shares and two launches do not:
- ULYSSES_LAUNCH_ID, when set (scripts/launch.sh sets it for every launch: one launcher's own id on one node and
  over pdsh, where .deepspeed_env carries it to every node; with --no_ssh / --torchrun on several nodes, each node's
  launch.sh derives it alike from the node count and either the srun step, when one step is the whole launch, or the
  store's port (scripts/launch_env.sh launch_id), not the train.py arguments: nodes may be given differing ones, and
  a node refusing them must end the others), so two such launches with one node count on one port, not each one
  srun step, look alike: give each its own ULYSSES_LAUNCH_ID; else
- SLURM_JOB_ID + SLURM_STEP_ID only when srun started every rank (`srun python train.py`: the step's tasks are the
  world, SLURM_STEP_NUM_TASKS == WORLD_SIZE, and every rank sees the same step). Not otherwise, nor the job id
  alone: torchrun / deepspeed --no_ssh started by one srun per node see one step each ("123.0", "123.1"), node 0 in
  the batch shell sees the batch step's id (slurmstepd sets SLURM_STEP_ID for the batch script's task too, but no
  SLURM_STEP_NUM_TASKS: src/slurmd/slurmstepd/task.c exec_task, src/common/env.c setup_env), and nodes reached over
  ssh / pdsh have no Slurm variables at all: a part only some nodes have would make them refuse each other.
  Then TORCHELASTIC_RUN_ID (torchrun's --rdzv_id, the same on every node), WORLD_SIZE, and the command line's
  arguments without the rank-specific `--local_rank=N` that deepspeed's launch.py appends (launch.py sets LOCAL_RANK
  too). So two plain torchrun / deepspeed launches with one world and the same arguments on one port (the rendezvous
  id left at its default) look alike.
What differs per node or rank (RANK, LOCAL_RANK, SLURM_PROCID/NODEID/LOCALID, the host, CUDA_VISIBLE_DEVICES,
OMP_NUM_THREADS) is never part of it. Cost: one hash per process; one `get` per rank (one `compare_set` by the host).
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from dataclasses import dataclass

KEY = "ulysses_run"  # outside every run's key prefix: the one key a rank reads before it knows whose store it is


@dataclass(frozen=True)
class Identity:
    digest: str  # 16 hex digits: the watcher's key prefix and the comparison
    said: str  # what it was made of, for the refusal line

    def value(self) -> str:
        return f"{self.digest} {self.said}"


def shared_args(argv: list[str]) -> list[str]:
    """`argv` without what a launcher adds per rank: `--local_rank=N` (deepspeed's launch.py), `--local-rank=N`
    (torch.distributed.launch), and either as two words."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.partition("=")[0]
        if name in ("--local_rank", "--local-rank"):
            skip = "=" not in a
            continue
        out.append(a)
    return out


def srun_started_every_rank(env) -> bool:
    """True when this rank is a task of an srun step whose tasks are the whole world (one task per rank): then every
    rank has the same SLURM_JOB_ID and SLURM_STEP_ID. False under a launcher started per node, in the batch shell, and
    outside Slurm."""
    return bool(env.get("SLURM_JOB_ID") and env.get("SLURM_STEP_ID") and env.get("SLURM_STEP_NUM_TASKS")) and \
        env.get("SLURM_STEP_NUM_TASKS") == env.get("WORLD_SIZE", "1")


def identity(env=None, argv: list[str] | None = None) -> Identity:
    """This process's run identity, from `env` (os.environ) and `argv` (sys.argv[1:]): see the module docstring."""
    env = os.environ if env is None else env
    argv = sys.argv[1:] if argv is None else argv
    if env.get("ULYSSES_LAUNCH_ID"):
        parts = [f"launch {env['ULYSSES_LAUNCH_ID']}"]
        said = parts[0]
    else:
        step = f"Slurm step {env['SLURM_JOB_ID']}.{env['SLURM_STEP_ID']}" if srun_started_every_rank(env) else ""
        rdzv = f"torchrun run {env['TORCHELASTIC_RUN_ID']}" if env.get("TORCHELASTIC_RUN_ID") else ""
        args = "\0".join(shared_args(list(argv)))
        args_hash = hashlib.sha256(args.encode()).hexdigest()[:8]
        parts = [step, rdzv, f"world {env.get('WORLD_SIZE', '1')}", args]
        said = ", ".join(p for p in (step, rdzv, f"world {env.get('WORLD_SIZE', '1')}", f"arguments {args_hash}") if p)
    return Identity(hashlib.sha256("\x01".join(parts).encode()).hexdigest()[:16], said)


def publish(store, mine: Identity) -> str:
    """The store's host (or rank 0 under an agent's store, which publishes nothing) records `mine` unless an identity
    is there already; returns the one on record."""
    got = store.compare_set(KEY, "", mine.value())
    return got.decode() if isinstance(got, bytes) else str(got)


def read(store, deadline: float, tick: float = 0.2) -> str | None:
    """The identity on record, waiting for it until `deadline` (monotonic); None if none came. Reads only."""
    while True:
        if store.check([KEY]):
            got = store.get(KEY)
            return got.decode() if isinstance(got, bytes) else str(got)
        if time.monotonic() >= deadline:
            return None
        time.sleep(max(0.0, min(tick, deadline - time.monotonic())))


def refusal(on_record: str, mine: Identity, addr: str, port, rank: int) -> str | None:
    """The one-line refusal when the store at addr:port belongs to another run; None when it is this rank's run."""
    if on_record.partition(" ")[0] == mine.digest:
        return None
    theirs = on_record.partition(" ")[2] or "unnamed"
    return (f"rank {rank}: the job's store at {addr}:{port} belongs to another run ({theirs}; this rank's: {mine.said}): "
            "two runs on one port; give this run its own --master_port (deepspeed, launch.sh, torchrun) or "
            "MASTER_PORT; nothing was written into the other run's store")
