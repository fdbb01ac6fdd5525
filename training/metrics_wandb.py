"""Weights & Biases for training/metrics.py's MetricsLogger (rank 0): whether it logs there, its start, and what
W&B lost at the run's end (training/metrics.py's docstring says how records reach it).

W&B runs offline unless the user configured it (WANDB_MODE or WANDB_API_KEY set): there is no network
on the machines this was built on. An online start that cannot reach the server (a compute node without
network, WANDB_API_KEY exported in ~/.bashrc) gives up after INIT_TIMEOUT_S and logs offline, said in one line.
The run id comes from the checkpoint so a resumed job continues the same W&B run; WANDB_RUN_ID, WANDB_PROJECT,
WANDB_NAME and WANDB_DIR are honoured where no checkpoint or flag says otherwise; offline runs in a WANDB_DIR a Slurm
job loses at its end (/tmp, /dev/shm, $TMPDIR: job_container/tmpfs) are said in one line (base/slurm_state.job_local).
Without a home directory (a container's uid with no passwd entry, HOME unset) W&B's own folders go under WANDB_DIR
(`homeless`); a wandb.init that fails with nothing left to fall back to turns W&B off in one line, never the run.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import uuid

from base.slurm_state import job_local


def wandb_enabled(report_to: str) -> bool:
    if report_to == "none":
        return False
    try:
        import wandb  # noqa: F401
    except ImportError:
        if report_to == "wandb":
            raise ValueError("--report_to wandb but wandb is not installed: pip install wandb or use --report_to none") from None
        return False
    return True


WANDB_HOME_DIRS = (("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data"))


def homeless(env, where: str) -> None:
    """No home directory (HOME unset, the uid not in the passwd file: a container's `--user`): W&B's config, cache and
    data folders those variables leave unset go under `where`/wandb/home, said once. wandb.init raised "Could not
    determine home directory" (pathlib's expanduser of ~/.config/wandb/settings: wandb/sdk/wandb_setup.py), exit 1."""
    moved = [(var, sub) for var, sub in WANDB_HOME_DIRS if not env.get(var)]
    if os.path.expanduser("~") == "~" and moved:
        env.update({var: os.path.join(where, "wandb", "home", sub) for var, sub in moved})
        print(f"W&B: no home directory here (HOME unset, uid {os.getuid()} not in the passwd file): "
              f"{' / '.join(v for v, _ in moved)} set under {where}/wandb/home", flush=True)


def _wandb_off(wandb, e: Exception) -> None:
    """A wandb.init failed with no fallback left: W&B off for this run in one line (as `_wb`), never the run's end."""
    print(f"warning: W&B could not start ({type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}): "
          "W&B off for this run; metrics.jsonl keeps every record", flush=True)
    with contextlib.suppress(Exception):  # its service may hold the failed run
        wandb.teardown()


DEFAULT_PROJECT = "ulysses-longtrain"  # --wandb_project left unset and no WANDB_PROJECT
INIT_TIMEOUT_S = 30  # an online W&B start that has not reached the server by then logs offline: every rank waits for
# rank 0 meanwhile (each start, each requeue), so short; W&B's own default, 90 s, with its retries, took ~2 min.
# WANDB_INIT_TIMEOUT set: W&B's reading of it wins


def start_wandb(m, output_dir: str, project: str | None, run_id: str | None, config: dict, logged: int,
                resume_step: int, branch: bool):
    """wandb.init for `m` (training/metrics.py's MetricsLogger, rank 0's; sets m.run_id) with the environment's
    WANDB_PROJECT / WANDB_RUN_ID / WANDB_NAME / WANDB_DIR where this run's flags and checkpoint leave them open; an
    online start that fails (no network: CommError after the timeout) goes offline, said in one line, instead of
    ending the run."""
    env = os.environ
    where = env.get("WANDB_DIR") or output_dir
    if not (env.get("WANDB_MODE") or env.get("WANDB_API_KEY")):
        env["WANDB_MODE"] = "offline"  # `wandb login`'s netrc alone does not sync: said once
        print(f"W&B offline (runs under {where}/wandb; `wandb sync` them): set WANDB_MODE=online or "
              "WANDB_API_KEY to sync as the run goes", flush=True)
    for flag, value, var in (("--wandb_project", project, "WANDB_PROJECT"),
                             ("--run_name", config.get("run_name"), "WANDB_NAME")):
        if value and env.get(var) and env[var] != value:
            print(f"W&B: {flag} {value} wins over {var}={env[var]}", flush=True)
    asked = env.get("WANDB_RUN_ID")
    if run_id and m._other_home:  # a copy of a run (cp -a run run2) or a branch from another folder's
        # checkpoint: both logged into the original's run, its steps drawn over theirs (the copy named the run)
        mine = asked or f"{run_id}-{hashlib.sha256(m.home.encode()).hexdigest()[:6]}"
        print(f"W&B: run {run_id} is {m._other_home}'s (still there): this folder logs to run {mine} (group "
              f"{run_id}){'' if asked else '; WANDB_RUN_ID names another'}", flush=True)
        m.run_id = mine
        return _init_wandb(m, env, where, output_dir, project, config, group=run_id)
    if run_id and asked and asked != run_id:
        print(f"W&B: WANDB_RUN_ID={asked} not used: this run's checkpoint logs to run {run_id} (a new "
              "--output_dir starts a new run)", flush=True)
    m.run_id, group = run_id or asked or uuid.uuid4().hex[:8], None
    if run_id and branch and logged > resume_step:  # the branch's steps up to the old run's last would be drawn
        group, m.run_id = run_id, f"{run_id}-from{resume_step}"  # over the abandoned curve's (same x)
        print(f"W&B: this branch from step {resume_step} logs to run {m.run_id} (group {group}): run {run_id} "
              f"logged steps up to {logged}, which W&B would draw beside the branch's", flush=True)
    return _init_wandb(m, env, where, output_dir, project, config, group)


def _init_wandb(m, env, where: str, output_dir: str, project: str | None, config: dict, group: str | None):
    """wandb.init of m.run_id, offline where the online start fails (said)."""
    import wandb

    name = (config.get("run_name") or env.get("WANDB_NAME")
            or os.path.basename(os.path.normpath(os.path.abspath(output_dir))))
    args = dict(project=project or env.get("WANDB_PROJECT") or DEFAULT_PROJECT, id=m.run_id, name=name,
                resume="allow", config=config, group=group, dir=where)
    timeout = {} if env.get("WANDB_INIT_TIMEOUT") else {"init_timeout": INIT_TIMEOUT_S}
    homeless(env, where)
    try:
        run = wandb.init(**args, settings=wandb.Settings(console="off", silent=True, **timeout))
    except Exception as e:  # noqa: BLE001  CommError, a timeout, an auth error: any of them, the run goes on
        if env.get("WANDB_MODE") in ("offline", "disabled", "dryrun"):
            return _wandb_off(wandb, e)  # offline already: nothing to fall back to
        why = (str(e).strip().splitlines() or [""])[0][:200]
        print(f"W&B: online start failed ({type(e).__name__}: {why}): logging offline to {where}/wandb/offline-run-*"
              f"; `wandb sync` them from a machine with network (WANDB_MODE=offline skips the "
              f"{env.get('WANDB_INIT_TIMEOUT') or INIT_TIMEOUT_S} s wait)", flush=True)
        env["WANDB_MODE"] = "offline"
        wandb.teardown()  # W&B's service still holds the failed run's id ("run ID ... is in use")
        try:
            run = wandb.init(**args, mode="offline", settings=wandb.Settings(console="off", silent=True))
        except Exception as e:  # noqa: BLE001
            return _wandb_off(wandb, e)
    if env.get("WANDB_MODE") in ("offline", "dryrun") and env.get("WANDB_DIR") and (lost := job_local(where)):
        print(f"W&B offline under {where}, {lost}: its runs are lost at the job's end, before any `wandb sync` "
              f"(metrics.jsonl in {output_dir} keeps every record); set WANDB_DIR to a shared folder", flush=True)
    return run


def said_lost_records(run_dir: str | None) -> None:
    """W&B's writer drops records it cannot save (a full WANDB_DIR, a quota) and says so only in its own
    logs/debug-internal.log, while wandb.log returns as usual: a later `wandb sync` uploads a curve that stops early.
    Said in one line at the run's end (metrics.jsonl holds every record). One read of that log, once."""
    log = os.path.join(run_dir, "logs", "debug-internal.log") if run_dir else ""
    with contextlib.suppress(OSError), open(log, "rb") as fh:
        if b"failed to save record" in fh.read():
            print(f"warning: W&B could not save some records of this run ({log}: 'failed to save record': a full or quota-"
                  "limited WANDB_DIR?): its curves stop early; metrics.jsonl in the output folder holds them all", flush=True)
