"""The launcher above this rank, read from the environment and /proc (Linux; elsewhere nothing is read and nothing
refused), at a rank's first line (training/job.py run_job), before any process group: a launcher that would run the job
otherwise than it says is refused in one line (`launcher_refusal`), a launcher's setting train.py does not take is
noted (`launcher_note`), torchrun's options are read as torch reads them (`torchrun_options`: preemption's kill window
too), and a plain deepspeed launch.py and its runner are noted (`watch_launcher`): their death is a stop with a full
save (`launcher_gone`, training/preemption.PreemptionFlag). Cost: a few small /proc reads, once; one per step after.
"""

from __future__ import annotations

import os

MPI_SIZES = ("OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "PMI_SIZE")  # Open MPI's, MVAPICH's, MPICH / Intel MPI's
LAUNCH_FIX = "use pdsh (the default), scripts/launch.sh --no_ssh on every node, or scripts/slurm.sbatch under SLURM"


def launcher_refusal(env, parent: list[str] | None = None) -> str | None:
    """One line where the launcher would run this job otherwise than it says, None where it runs as launched.
    `parent`: this rank's parent's command line (its launcher; default /proc/<ppid>/cmdline, read once):
    - accelerate's DeepSpeed plugin (`accelerate launch --use_deepspeed`): its settings come to the ranks as
      ACCELERATE_* variables, which nothing here reads (its config file, accumulation and precision were ignored);
      likewise its FSDP and Megatron-LM modes (ZeRO-3 shards here) and fp8 (ACCELERATE_MIXED_PRECISION);
    - torchrun's in-place restarts (`--max_restarts N`, or an elastic `--nnodes MIN:MAX`, which restarts the workers
      when a node joins or leaves whatever --max_restarts says): a stop's exit 75 is restarted (the requested stop
      undone, its PREEMPT deleted as honoured) and the store the last attempt left breaks the abort channel's first
      beat (base/run_identity.publish found the old run's identity);
    - MPI (`mpirun -np N python train.py`, `deepspeed --launcher openmpi`) without RANK / MASTER_ADDR: N worlds of
      one on one output folder (the second refused as 'held by a live run'), every rank on device 0;
    - `deepspeed --launcher mpich`: deepspeed/launcher/launcher_helper.py, each rank's parent, waits for the rank
      and returns nothing (every exit code, 75 / 1 / 2, becomes 0) and a signal that ends it leaves the rank running.
      `--launcher impi` starts the ranks from mpirun itself (multinode_runner.py IMPIRunner, RANK set): it passes."""
    if str(env.get("ACCELERATE_USE_DEEPSPEED", "")).lower() == "true":
        return ("accelerate launch --use_deepspeed: its DeepSpeed plugin settings (ACCELERATE_DEEPSPEED_*) are not "
                "read here: launch without --use_deepspeed (or with deepspeed / torchrun / scripts/launch.sh) and give "
                "--deepspeed FILE, --gradient_accumulation_steps, --bf16 to train.py")
    for key, flag in (("ACCELERATE_USE_FSDP", "--use_fsdp"), ("ACCELERATE_USE_MEGATRON_LM", "--use_megatron_lm")):
        if str(env.get(key, "")).lower() == "true":
            return (f"accelerate launch {flag}: this trains with DeepSpeed ZeRO-3 (ds_configs/*.json), and "
                    f"{key.removeprefix('ACCELERATE_USE_')} settings are not read here: launch without {flag} and "
                    "give train.py --deepspeed FILE")
    if str(env.get("ACCELERATE_MIXED_PRECISION", "")).lower() == "fp8":
        return ("accelerate launch --mixed_precision fp8: fp8 training is not supported here (bf16, fp16 or fp32): "
                "launch with --mixed_precision no and give train.py --bf16 or --fp16")
    if int(env.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0:
        return (f"torchrun --max_restarts {env['TORCHELASTIC_MAX_RESTARTS']}: it restarts the workers in place, which "
                "undoes a preemption's save-and-exit (75) and reuses the last attempt's store: use --max_restarts 0 "
                "and requeue the job (scripts/launch.sh --torchrun, slurm.sbatch), which resumes from the checkpoint")
    mpi = next((k for k in MPI_SIZES if (env.get(k) or "1").isdigit() and int(env.get(k) or 1) > 1), None)
    if mpi and "RANK" not in env and env.get("SLURM_STEP_NUM_TASKS") != env[mpi]:  # srun --mpi=pmi2 is one task a
        # rank (the sizes agree); mpirun under Slurm starts one daemon a node (the step's tasks: the node count)
        return (f"started by MPI ({mpi}={env[mpi]}) without RANK / MASTER_ADDR: each process would be a world of one "
                "on one GPU; launch with deepspeed (its pdsh launcher), torchrun, srun or scripts/launch.sh")
    parent = parent_cmdline() if parent is None else parent
    if helper_launcher(parent) == "mpich":
        return ("deepspeed --launcher mpich: its launcher_helper.py (each rank's parent) drops the rank's exit code "
                f"(75, 1, 2 all become 0) and leaves the rank running when it is signalled: {LAUNCH_FIX}")
    nnodes = str(getattr(torchrun_options(parent), "nnodes", "") or "") if env.get("TORCHELASTIC_RUN_ID") else ""
    low, _, high = nnodes.partition(":")
    if high and low != high:
        return (f"torchrun --nnodes {nnodes}: an elastic range restarts the workers in place when a node joins or "
                "leaves (even with --max_restarts 0), which undoes a preemption's save-and-exit (75) and reuses the "
                "last attempt's store: give a fixed --nnodes N and requeue the job (scripts/launch.sh --torchrun, "
                "slurm.sbatch), which resumes from the checkpoint")
    return None


def launcher_note(env) -> str | None:
    """A launcher's setting that train.py does not take, said in one warning line (rank 0): accelerate's mixed
    precision (fp16 / bf16; `no`, its default, says nothing), where train.py's own flags decide the precision, resolved
    only later (--bf16 / --fp16 / --no-bf16, the DeepSpeed JSON, the GPU): the start-up line's `precision=` says which."""
    mixed = str(env.get("ACCELERATE_MIXED_PRECISION", "no")).lower()
    if mixed in ("fp16", "bf16"):
        return (f"warning: accelerate launch --mixed_precision {mixed} is not read here: train.py trains in its own "
                "precision (--bf16 / --fp16 / --no-bf16 or the DeepSpeed config; by default bf16 on a GPU, fp32 on "
                "CPU), the precision= of its start-up line; give train.py the flag to be sure")
    return None


# --- the launcher above this rank, from /proc (Linux; elsewhere nothing is read and nothing refused) ---

_PARENT: list[list[str]] = []  # this process' parent's command line, read once


def parent_cmdline() -> list[str]:
    """This process' parent's command line (its launcher: deepspeed's launch.py, torchrun, launcher_helper.py), read
    once per process."""
    if not _PARENT:
        from base.host import cmdline

        _PARENT.append(cmdline(os.getppid()))
    return _PARENT[0]


def helper_launcher(words: list[str]) -> str | None:
    """The --launcher of deepspeed's launcher_helper.py where `words` run it (its default: mpich), else None."""
    at = next((i for i, w in enumerate(words) if w.replace(os.sep, "/").endswith("deepspeed/launcher/launcher_helper.py")),
              None)
    if at is None:
        return None
    rest = words[at + 1:]
    for i, w in enumerate(rest):  # its options (--launcher X, --module, --no_python) come before the user's script
        if w.startswith("--launcher="):
            return w.partition("=")[2].lower()
        if w == "--launcher" and i + 1 < len(rest):
            return rest[i + 1].lower()
        if not w.startswith("-"):
            break
    return "mpich"


def torchrun_options(words: list[str]):
    """The options of the torchrun agent that `words` run (`torchrun ...`, `python -m torch.distributed.run|launch
    ...`) as torch itself reads them (torch/distributed/run.py get_args_parser: a flag, else its PET_<NAME> variable,
    else the default), an argparse Namespace; None where `words` are no such command (accelerate launch runs its
    agent inside its own process, with a fixed node count). Imports torch.distributed.run: under torchrun only."""
    start = next((i + 1 for i, w in enumerate(words) if os.path.basename(w) == "torchrun"), None)
    if start is None:
        start = next((i + 2 for i, w in enumerate(words[:-1]) if w == "-m" and words[i + 1] in
                      ("torch.distributed.run", "torch.distributed.launch")), None)
    if start is None:
        return None
    import contextlib
    import io

    from torch.distributed.run import get_args_parser

    try:
        with contextlib.redirect_stderr(io.StringIO()):  # a command line it cannot read is not ours to judge
            return get_args_parser().parse_known_args(words[start:])[0]
    except SystemExit:
        return None


DS_LAUNCH = "deepspeed.launcher.launch"
_WATCH: list[tuple[int, int]] = []  # (launch.py's pid, its parent's) at this rank's first line: watch_launcher


def watch_launcher(env, ppid: int, proc: str = "/proc") -> tuple[int, int] | None:
    """(launch.py's pid, its parent's pid) where deepspeed's launch.py started this rank without scripts/launch.sh
    (LAUNCH_EXIT_DIR unset), else None. A plain `deepspeed --num_gpus N train.py` (README's "running your own"): the
    runner (deepspeed/launcher/runner.py) installs its SIGTERM/SIGINT handlers only for pdsh on several nodes, so a
    `kill -TERM <runner>` ends it alone; launch.py is reparented and the ranks trained on, unsaved, with nobody left
    to stop them. Noted at the rank's first line; launcher_gone compares. Cost: two small /proc reads, once."""
    from base.host import cmdline, parent_of

    if env.get("LAUNCH_EXIT_DIR"):  # launch.sh waits for the ranks and stops them itself
        return None
    words = cmdline(ppid, proc)
    if not any(w == DS_LAUNCH or w.replace(os.sep, "/").endswith("deepspeed/launcher/launch.py") for w in words):
        return None
    above = parent_of(ppid, proc)
    return None if above is None else (ppid, above)


def launcher_gone(ppid: int | None = None, proc: str = "/proc") -> str | None:
    """Why this rank must stop with a save because what started it is gone (training/preemption.PreemptionFlag
    takes it as a stop request at its next check, a full save: no launcher is left to SIGKILL after it), else None:
    deepspeed's launch.py ended (this rank reparented), or the runner that started launch.py did (launch.py
    reparented). One /proc read per call (PreemptionFlag.agreed: once per step)."""
    from base.host import parent_of

    if not _WATCH:
        return None
    launch, runner = _WATCH[0]
    if (os.getppid() if ppid is None else ppid) != launch:
        return f"deepspeed's launch.py (pid {launch}) ended: nothing would stop this rank"
    if parent_of(launch, proc) != runner:
        return (f"the deepspeed runner (pid {runner}) that started launch.py ended alone, as `kill <runner pid>` ends it "
                "(a plain deepspeed run stops through its process group: `kill -TERM -- -PGID`)")
    return None
