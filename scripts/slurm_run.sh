# shellcheck shell=bash
# Sourced by scripts/slurm.sbatch (found in the repository, as scripts/slurm_requeue.sh is): what the batch shell reads
# of the job and of its run, and the stop it asks of the run. job_times (the job's planned end and start), out_here and
# read_config (the run's folder; whether it is a dry run), lock_owner (the job its RUN_LOCK names), complete_stamp (its
# COMPLETE), forward (the USR1 / USR2 trap, and the TERM trap's last step). Reads the batch shell's variables (shown,
# given, out_dir, repo, cfg_read, job, srun_pid) and sets its out_dir, cfg_*, warned; defines functions only. A job
# Slurm spooled before a `git pull` sources this file as it is after it: keep the names and arguments it calls.
# shellcheck disable=SC2154  # every variable named above is the batch shell's

# Slurm < 23.02 sets no SLURM_JOB_END_TIME / SLURM_JOB_START_TIME (both came in 23.02): the planned end and start from
# scontrol's EndTime / StartTime (the controller's local time), read now: at the time limit slurmctld's _job_timed_out
# sets EndTime to that moment. Exported for launch.sh and the ranks (their stop before the limit, a universal
# conversion's bound: training/preemption.py). From the start's `scontrol show job`.
job_times() {  # export SLURM_JOB_END_TIME and SLURM_JOB_START_TIME (epoch seconds) from scontrol's EndTime, StartTime
  local k t
  for k in End Start; do
    t=$(sed -n "s/.*[[:space:]]${k}Time=\([0-9]\{4\}-[0-9-]*T[0-9:]*\).*/\1/p" <<< "$shown" | head -n 1)
    [ -n "$t" ] && t=$(date -d "$t" +%s 2>/dev/null) && export "SLURM_JOB_${k^^}_TIME=$t"
  done
  [ -n "${SLURM_JOB_END_TIME:-}" ] || log "no SLURM_JOB_END_TIME (Slurm before 23.02) and no EndTime from scontrol" \
    "(no time limit, or no answer): the ranks stop before a time limit only at its warning signal"
}
# out_dir: --output_dir where this shell sees it (or where no OUTPUT_DIR is set), else OUTPUT_DIR (why: slurm.sbatch)
out_here() { if [ -n "$given" ] && { [ -d "$given" ] || [ -z "${OUTPUT_DIR:-}" ]; }; then out_dir=$given
  else out_dir=${OUTPUT_DIR:-}; fi; }
# train.py's own parser on the job's arguments (training/config.py parse_config), once at most (a Python start and the
# config's imports, ~2 s): the recipe's output_dir, and whether it is a dry run (`--dry_run=true`, a recipe's `dry_run:
# true`: the word ` --dry_run ` alone was looked for, and such a run ended "exit 0 but no COMPLETE", failed). Not where
# this host has no .venv (a container's): cfg_dry then stays unknown
read_config() {
  [ "$cfg_read" = 1 ] && return 0
  cfg_read=1 && [ -x "$repo/.venv/bin/python" ] || return 0
  local got
  got=$("$repo/.venv/bin/python" -c 'import sys; from training.config import parse_config; out, sys.stdout = sys.stdout, sys.stderr
c = parse_config(sys.argv[1:]); print(int(c.dry_run), c.output_dir, file=out)' "$@" 2>/dev/null) || return 0  # notes: not the folder
  cfg_dry=${got%% *} cfg_out=${got#* }
}
# the job that holds the run's folder (its RUN_LOCK: base/run_lock.py), empty when none
lock_owner() { grep -oE '"job": *"[^"]*"' "$out_dir/RUN_LOCK" 2>/dev/null | head -n 1 | sed 's/.*: *"//; s/"$//'; }
# the run's COMPLETE as found now (inode and time: one written during this job differs)
complete_stamp() { stat -c '%i %y' "$out_dir/COMPLETE" 2>/dev/null || true; }
forward() {  # the warning (or a stop): ask every rank to save at its next step boundary
  warned=1
  log "got SIG$1: passing SIGUSR1 to the training (srun pid ${srun_pid:-not started})"
  # train.py also stops when this file appears (for ranks a signal cannot reach); it deletes it at start. Not when the
  # folder's run lock is another job's (this one a second job on it, refused there): cancelling it stopped the live run
  local owner
  owner=$(lock_owner)
  if [ -n "$out_dir" ] && [ -n "$owner" ] && [ "$owner" != "$job" ]; then
    log "$out_dir is the run of job $owner (its RUN_LOCK), not this job's: not asking it to stop"
  elif [ -n "$out_dir" ]; then  # no mkdir -p: a container's path made here would hide that it is not the run's folder
    { [ -d "$out_dir" ] || mkdir "$out_dir" 2>/dev/null; } && touch "$out_dir/PREEMPT"
  fi
  [ -n "$srun_pid" ] && kill -USR1 "$srun_pid" 2>/dev/null
  return 0
}
