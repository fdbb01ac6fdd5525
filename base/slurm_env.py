"""What SLURM tells a process about its job, read without `scontrol`: the hostlist syntax, the world of ranks that
`srun python train.py` starts (one task per rank), and the job's default store port. Torch-free, no I/O but
/proc reads; training/job.py takes the world from here when no launcher set RANK.

`srun --ntasks-per-node=8 python train.py ...` (what torchtitan, Lightning, Megatron and accelerate users write):
srun starts every rank itself, and each task has SLURM_PROCID (its rank), SLURM_STEP_NUM_TASKS (the world: the
step's tasks, not SLURM_NTASKS, which a batch shell's `--ntasks` also sets), SLURM_LOCALID (its rank on the node)
and SLURM_STEP_NODELIST (the step's hosts, compressed: `gpu[01-04,07]`). The master is the step's first host (where
task 0 runs under srun's default block distribution), the port MASTER_PORT if set, else job_port(). The batch shell
itself has no SLURM_STEP_NUM_TASKS: a `python train.py` there stays a world of one.

The step's first NodeName need not resolve (cloud nodes without cloud_dns): `unresolved` is the store host's one
line for that (base/comm.py open_channel asks it before hosting the store; torch's own answer was a DistNetworkError
traceback after 10 s).
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping

PORT_BASE = 20000  # the job's store port: PORT_BASE + (job, step) % PORT_SPAN, below Linux's ephemeral range
PORT_SPAN = 10000  # (ip_local_port_range, 32768-60999 by default): a port there may be an outgoing socket's already


def split_top(text: str) -> list[str]:
    """"a[1-2],b,c[3,5]" -> ["a[1-2]", "b", "c[3,5]"]: the commas outside brackets."""
    items, item, depth = [], "", 0
    for c in text:
        depth += (c == "[") - (c == "]")
        if c == "," and depth == 0:
            items.append(item)
            item = ""
        else:
            item += c
    items.append(item)
    return [i for i in items if i]


def _expand_one(item: str) -> list[str]:
    m = re.match(r"^([^\[]*)\[([^\]]*)\](.*)$", item)
    if not m:
        return [item]
    pre, ranges, rest = m.groups()
    values = []
    for part in ranges.split(","):
        a, _, b = part.partition("-")
        values += [f"{k:0{len(a)}d}" for k in range(int(a), int(b or a) + 1)]
    return [pre + v + tail for v in values for tail in _expand_one(rest)]  # several bracket groups: rack[1-2]-n[1-4]


def expand_hostlist(text: str) -> list[str]:
    """SLURM's hostlist syntax, expanded as `scontrol show hostnames` does: "gpu[01-03,07],login" -> gpu01, gpu02,
    gpu03, gpu07, login (zero padding kept; several bracket groups in one name expand in order)."""
    return [h for item in split_top(text.strip()) for h in _expand_one(item)]


def job_port(job_id: str | int, step_id: str | int = 0) -> int:
    """The job's default store port (MASTER_PORT unset): the same on every task of a step, different for the steps of
    one job and for most jobs sharing a node, never in the default ephemeral range (a port some outgoing connection
    already holds there makes the store fail to start: the job ends FAILED, not requeued)."""
    try:
        step = int(step_id)
    except ValueError:
        step = 0
    return PORT_BASE + (int(job_id) * 7 + max(step, 0)) % PORT_SPAN


def srun_world(env: Mapping[str, str] | None = None) -> dict[str, str] | None:
    """RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT of a rank that srun started itself (one task per
    rank), from the SLURM_* variables; None outside an srun step (no SLURM_STEP_NUM_TASKS or SLURM_PROCID)."""
    env = os.environ if env is None else env
    tasks, rank = env.get("SLURM_STEP_NUM_TASKS"), env.get("SLURM_PROCID")
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not tasks or rank is None or not nodes:
        return None
    # a heterogeneous step (srun --het-group=0,1): SLURM_STEP_NODELIST is every component's nodes sorted together,
    # and task 0 runs on component 0's first node (srun.c _reorder_het_job_recs, env.c); a het job's tasks see its
    # leader's id as SLURM_JOB_ID and SLURM_JOB_ID_HET_GROUP_0: another id is a job submitted from inside a het job,
    # which inherits its _HET_GROUP_ variables (sbatch copies the environment): its master is on its own first node
    het = env.get("SLURM_HET_SIZE") and env.get("SLURM_JOB_ID_HET_GROUP_0", env.get("SLURM_JOB_ID")) == env.get(
        "SLURM_JOB_ID")
    hosts = expand_hostlist(env.get("SLURM_JOB_NODELIST_HET_GROUP_0") if het and env.get(
        "SLURM_JOB_NODELIST_HET_GROUP_0") else nodes)
    port = env.get("MASTER_PORT") or str(job_port(env.get("SLURM_JOB_ID", "0"),
                                                  env.get("SLURM_STEP_ID", env.get("SLURM_STEPID", "0"))))
    return {"RANK": rank, "LOCAL_RANK": env.get("SLURM_LOCALID", "0"), "WORLD_SIZE": tasks,
            "MASTER_ADDR": env.get("MASTER_ADDR") or hosts[0], "MASTER_PORT": port}


def master_refusal(env: Mapping[str, str] | None = None) -> str | None:
    """One line when srun started every rank (one task per rank: RANK is SLURM_PROCID, WORLD_SIZE the step's tasks) and
    MASTER_ADDR is a node of the job (SLURM_JOB_NODELIST) outside the step: a batch template's `export
    MASTER_ADDR=<the job's first node>` with a step on other nodes (`srun -N2 -r2 python train.py`) pointed every rank
    at a node where rank 0 does not run (300 s, then exit 69; with an exported port too, another step's store). Names
    compare by their short form, case aside (node01 and node01.cluster are one host). Anything else is taken as given,
    and every rank decides alike (nothing of its own host): a name that is not one of the job's node names may be one
    of the step's hosts under another name (the node's NodeHostname, which differs from its Slurm NodeName on AWS
    ParallelCluster; an interface's name: node01-ib, ib-node01, node01ib) or an IP address, and telling would take a
    resolver lookup per host (a slow or stale DNS on 512 ranks at start-up)."""
    env = os.environ if env is None else env
    addr, nodes, job = env.get("MASTER_ADDR", ""), env.get("SLURM_STEP_NODELIST"), env.get("SLURM_JOB_NODELIST")
    if not addr or not nodes or not job or env.get("RANK") != env.get("SLURM_PROCID") or \
            env.get("WORLD_SIZE") != env.get("SLURM_STEP_NUM_TASKS"):
        return None
    hosts = expand_hostlist(nodes)
    a = addr.split(".")[0].lower() if not re.fullmatch(r"[0-9.]+", addr) else ""  # 10.1.2.3 is no node "10"
    if a in {h.split(".")[0].lower() for h in hosts} or a not in {h.split(".")[0].lower() for h in expand_hostlist(job)}:
        return None
    shown = ",".join(hosts[:4]) + (",..." if len(hosts) > 4 else "")
    return (f"MASTER_ADDR={addr} is a node of this job but not of this srun step ({shown}): rank 0 runs on {hosts[0]}; "
            "unset MASTER_ADDR (the step's first host is then used), or set it to a host of the step")


def unresolved(addr: str, port: str | int) -> str | None:
    """One line when `addr` (MASTER_ADDR) does not resolve on this host, None when it does. One resolver lookup (the
    system's own timeouts bound it: a few seconds on a slow DNS)."""
    try:
        socket.getaddrinfo(addr, int(port), type=socket.SOCK_STREAM)
        return None
    except (socket.gaierror, UnicodeError, ValueError):
        return (f"MASTER_ADDR {addr} does not resolve on {socket.gethostname()}: set MASTER_ADDR to an address the "
                "nodes reach (e.g. `scontrol getaddrs`)")
