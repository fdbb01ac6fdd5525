#!/usr/bin/env bash
# Sourced by scripts/slurm.sbatch (found in the repository, not beside the copy Slurm runs): how the job requeues
# itself, its SIGTERM trap (on_term) and EXIT trap (at_exit) included. Reads the batch shell's variables (ref, out_dir,
# nnodes, hosts, shown: the start's `scontrol show job`, the flags its traps set, the book's files: progress, intent,
# crashes; the nodes' records) and exits the shell where a decision ends the job.
# shellcheck shell=bash disable=SC2154  # every variable named above is the batch shell's
# Every requeue goes through here. Never after a cancel: the batch shell's `scontrol requeue` of a CANCELLED job
# (still COMPLETING) is accepted by slurmctld (_job_requeue_op) and would undo the user's scancel; the state is read
# again just before each requeue call (its base state, base/slurm_state.py), as a TERM's reading can have failed.
# Bounded by progress: a requeue that brings no newer checkpoint than the last one counts,
# ULYSSES_MAX_STALLED_REQUEUES in a row end the job (.cache/slurm/<job>.progress: "count checkpoint").
latest_step() {  # the run's newest committed checkpoint's step, "-" when none
  local c=""
  [ -n "$out_dir" ] && c=$(grep -oE '[0-9]+$' "$out_dir/checkpoints/LATEST" 2>/dev/null | sed 's/^0*\(.\)/\1/')
  echo "${c:--}"
}
may_requeue() {  # $1: the code to exit with when not; returns when a requeue may go ahead (records its progress)
  local count=0 last=- now max=${ULYSSES_MAX_STALLED_REQUEUES:-${MAX_REQUEUES:-3}}
  [ "$stopped" = 1 ] && { log "stopped as asked (SIGUSR2), exit $1: not requeueing"; exit "$1"; }
  [ "$cancelled" = 1 ] && cancel_ends "$1"  # the TERM trap read a cancel; else the state is read at requeue_cmd
  [ -n "$out_dir" ] || return 0  # no output dir known: progress cannot be read, nothing to bound by
  [ -f "$progress" ] && read -r count last < "$progress"
  [[ $count =~ ^[0-9]+$ ]] || count=0
  now=$(latest_step)
  if [ "$now" != - ] && { [ "$last" = - ] || [ "$now" -gt "$last" ]; }; then count=0; else count=$((count + 1)); fi
  if [ "$count" -gt "$max" ]; then
    log "$count requeues in a row without a newer checkpoint (newest: step $now) > ULYSSES_MAX_STALLED_REQUEUES=$max:" \
      "not requeueing (a failure that repeats, not progress)"
    exit "$1"
  fi
  mkdir -p "$(dirname "$progress")" && echo "$count $now" > "$progress"
}
# --output_dir as the ranks name it may be a container's path (apptainer -B /scratch/me/runs:/data, pyxis
# --container-mounts): not here, where checkpoints/LATEST and COMPLETE were read as missing (a healthy run stopped as
# "no progress" after 4 allocations, a finished one failed). Judged once the run has used it (it saved: 75; the step
# ran up to a time limit's or a preemption's TERM; an exit 0 once an earlier allocation of the job was so judged,
# $book.unseen: a first exit 0 without the folder is a killed launcher's too), never at the start (a fresh run's folder
# comes with its ranks): then unknown, as when none is given (no progress bound, no COMPLETE check), said in one line
out_unseen() {
  local what="--output_dir $out_dir"
  [ -n "$out_dir" ] && [ ! -d "$out_dir" ] || return 0
  [ -n "${OUTPUT_DIR:-}" ] && what="OUTPUT_DIR=$out_dir"
  log "this shell does not see $what (a path inside a container?): set OUTPUT_DIR to its path on this host"
  out_dir=""
  : 2>/dev/null > "$book.unseen"
}
# After the step: a node's task that could not see the records folder exited 254, above any launcher's code, so srun's
# (the largest) is 254 while no record holds it (a task dead of a signal outranks it: then read as a node that never
# started). Bad input, not a crash of the nodes that did record: the job ends (2).
records_unseen() {
  local n who=""
  [ "$srun_rc" = 254 ] && ! grep -qsx 254 "$state"/exit.* || return 0
  for ((n = 0; n < nnodes; n++)); do [ -f "$state/start.$n" ] || who+="${who:+, }$n (${hosts[$n]:-?})"; done
  [ -n "$who" ] || return 0
  log "node(s) $who could not see ${state%/*} (the job's records, under the work dir $PWD; their lines above):" \
    "submit from a folder every node mounts"
  rm -rf "$state"
  log "bad input (exit 2): not requeueing"
  exit 2
}
# The nodes' records ($state: start.N, exit.N, term.N, stop.N), read by the batch shell (slurm.sbatch, after the step):
unrecorded() {
  local n
  for ((n = 0; n < nnodes; n++)); do
    [ -f "$state/start.$n" ] && [ ! -f "$state/exit.$n" ] && [ ! -f "$state/term.$n" ] && echo "$n"
  done
  return 0
}
unstarted() {  # the nodes without a start record, once some node has one (none: srun itself failed)
  local n started=0
  for ((n = 0; n < nnodes; n++)); do [ -f "$state/start.$n" ] && started=1; done
  [ "$started" = 1 ] || return 0
  for ((n = 0; n < nnodes; n++)); do [ -f "$state/start.$n" ] || echo "$n"; done
  return 0
}
stop_asked() {  # a node's task got SIGUSR2 (scancel --signal=USR2 without --batch: the steps only): a stop, as this
  # shell's own SIGUSR2 is (its trap: slurm.sbatch); also read at a SIGTERM
  local n
  [ "$stopped" = 1 ] && return 0
  for ((n = 0; n < nnodes; n++)); do
    [ -f "$state/stop.$n" ] && { stopped=1; log "node $n's task got SIGUSR2 (scancel --signal=USR2 reaches the steps" \
      "only): a stop, as asked; the job ends after the save, never requeued"; return 0; }
  done
  return 0
}
cancel_ends() {  # $1: the code to exit with; exits when the job was cancelled: the trap's word or the state read now
  # (left in read_st: requeue_cmd takes a PENDING one for its requeue)
  local st
  st=$(job_state "$(call_s)")  # before `cancelled` is looked at: a TERM arriving during this read runs its trap first
  st=${st%% *} read_st=${st%% *}
  if [ "$cancelled" = 1 ] || [ "$st" = CANCELLED ] || [ "$st" = COMPLETING ]; then
    cancelled=1
    log "the job was cancelled (JobState=${st:-unknown}): not requeueing"
    exit "$1"
  fi
}
# The state is read here, at the last moment before each try, not when the requeue was decided: requeue_without's
# scontrol calls (an exclusion: up to 4, each up to MessageTimeout on a busy controller) left seconds in which a
# `scancel` came, its trap ran between two of them, and the requeue then undid it (slurmctld requeues a CANCELLED,
# still COMPLETING job). One state read per try, as before (~50 ms, one scontrol call). Not after the TERM trap read
# TIMEOUT or PREEMPTED (`finished`): a finished job stays so, scancel cannot make it CANCELLED (job_signal returns
# ESLURM_ALREADY_DONE, src/slurmctld/job_mgr.c), and on a busy controller that second read and the trap's own outlasted
# KillWait: SIGKILL before the requeue. Left: a cancel landing during the requeue call itself.
# A try whose answer is lost (a busy controller: cut at its bound, "Socket timed out") may have landed: the job is then
# PENDING, which the next try's state read (or the TERM trap's, between two tries) shows: requeued, the book kept (the
# retries' errors had set Requeue=0 on the pending job at the exit: its next allocation was not requeued, the chain
# ended). A requeue that fails for any reason but "disabled" leaves `requeue_wanted`: the EXIT trap then keeps the book
# and leaves Requeue alone (a site's RequeueExit may still requeue the job). A Requeue=0 read at the start still gets
# one call (refused at once): `scontrol update JobId=J Requeue=1` may have turned it back on since.
requeue_cmd() {  # $1: the code to exit with when cancelled; `scontrol requeue`, retried (a busy controller answers
  # with an error), immune to its own SIGTERM; returns 1 when it failed, 2 when the job's requeue is disabled
  local i err s
  for i in 1 2 3; do
    [ "$requeued" = 1 ] && { log "the job is pending already (its state read by the TERM trap): requeued"; return 0; }
    if [ -z "$finished" ]; then
      read_st="" && cancel_ends "$1"
      [ "$read_st" = PENDING ] && { requeued=1
        log "the job is pending already (Slurm requeued it, or an earlier try landed unanswered): requeued"; return 0; }
    fi
    requeued=1  # from here the TERM trap takes a TERM for the requeue's own
    requeue_tried=1 s=$(call_s)
    # scontrol itself in the substitution, TERM ignored: a shell between them died of the requeue's own TERM (143)
    # after a requeue that worked, which then counted as failed and lost the job's records
    err=$(trap '' TERM INT; exec_within "$s" scontrol requeue "$ref" 2>&1) &&
      { log "requeued: scontrol requeue $ref accepted"; return 0; }
    # ESLURM_JOB_PENDING (job_mgr.c _job_requeue_op): Slurm requeued the job meanwhile (PreemptMode=REQUEUE, its
    # GraceTime ending during this call), or an earlier try landed unanswered (cut at its bound): requeued either way
    if [[ $err == *"is pending execution"* ]]; then
      log "the job is pending already (Slurm requeued it, or an earlier try landed): requeued"; return 0; fi
    requeued=0  # (the trap, which returns at once while it is 1, may set it again between the tries: kept)
    if [[ $err == *"presently disabled"* ]]; then  # ESLURM_DISABLED: --no-requeue, or the site's job_submit policy
      no_requeue=1; requeue_disabled; return 2; fi
    echo "${err:-scontrol requeue $ref: no answer within ${s:-?} s}" >&2  # cut at its bound: nothing printed
    [ "$i" = 3 ] || sleep 2
  done
  [ "$requeued" = 1 ] && { log "the job is pending already (its state read by the TERM trap): requeued"; return 0; }
  requeue_wanted=1
  return 1
}
requeue_disabled() {  # said once, at the first requeue this job would have made
  [ "${disabled_said:-0}" = 1 ] || log "requeue is disabled for this job (Requeue=0): not requeued; resubmit the" \
    "same command to resume from the run's newest checkpoint"
  disabled_said=1
}
requeue_now() {  # from the TERM trap (time limit, preemption): plain requeue while this shell still runs
  [ "$stopped" = 1 ] && { log "a stop was asked (SIGUSR2): not requeueing"; return 0; }  # the ranks' end decides
  may_requeue 0
  requeue_cmd 0 || [ $? = 2 ] || log "requeue failed (JobState=$1)"
}
# A SIGTERM to this shell is Slurm ending the job (slurmd: SIGCONT + SIGTERM to every process of the job, SIGKILL
# KillWait later) or someone's kill. slurmctld sets the job's state before it signals (job_mgr.c): read it, within half
# of KillWait (KILL_WAIT_S). A state that ends the job (or no answer) starts the KillWait clock (kill_at: each scontrol
# call after it within a third of KillWait, call_s); RUNNING or SUSPENDED does not (a TERM that is no end: `scancel
# --batch --signal=TERM`, `sbatch --signal=B:TERM@N`, a person's kill; no SIGKILL follows): the calls stay unbounded
# (a save that outlasted KillWait left every later call 1 s: a busy controller's requeue cut, the job not requeued),
# and the next TERM (the time limit's, say) is read again. Not after the EXIT trap began (`exiting`: a scancel during
# its update found training over: a stop file touched, the ranks told to save).
on_term() {
  [ "$requeued" = 1 ] || [ "$exiting" = 1 ] && return 0  # our own requeue ends the batch step: nothing left to decide
  stop_asked
  term_at=${term_at:-$SECONDS}  # this shell got a TERM (steps_termed)
  if [ -z "$kill_at" ]; then
    local st reason at=$SECONDS
    read -r st reason <<< "$(job_state $((${KILL_WAIT_S:-30} / 2)))"
    case "$st" in RUNNING|SUSPENDED) ;; *) kill_at=$at ;; esac
    case "$st" in
      CANCELLED) cancelled=1
        log "JobState=CANCELLED (scancel): the ranks save if they can before Slurm's kill; the job ends, never requeued" ;;
      TIMEOUT|PREEMPTED) finished=$st
        log "JobState=$st: requeueing now, inside KillWait (the ranks' save goes on meanwhile)"
        compgen -G "$state/start.*" > /dev/null && { out_here; out_unseen; }  # the step ran: unseen, a container's
        requeue_now "$st" ;;
      PENDING) requeued=1; log "JobState=PENDING ($reason): Slurm requeued the job itself (a preemption)$([ \
        "$requeue_tried" = 1 ] && echo ", or a requeue of this shell's landed unanswered")" ;;
      COMPLETING) cancelled=1; log "JobState=COMPLETING, its base state unreadable ($state_how): taken as a cancel," \
        "never requeued (a preemption is then not requeued either: resubmit to resume)" ;;
      *) log "SIGTERM with JobState=${st:-unknown}: a stop (preemption grace time or a kill): save and requeue" ;;
    esac
  fi
  forward TERM
}
call_s() {  # how long one scontrol call may take now: unbounded (nothing) until a SIGTERM showed the job ending
  # (kill_at); then a third of KillWait, within what is left of it (at least 1 s)
  [ -n "${kill_at:-}" ] || return 0
  local kw=${KILL_WAIT_S:-30} left
  left=$((kw - (SECONDS - kill_at) - 1))
  ((left > kw / 3)) && left=$((kw / 3))
  echo $((left > 1 ? left : 1))
}
# exec_within: $1 seconds (nothing: no bound), then a command: exec'd (in a subshell), SIGKILLed past them (coreutils
# timeout; without it, unbounded). TERM and INT ignored in the command when bounded: timeout sets its own handlers, so
# its child no longer inherits the caller's SIG_IGN (timeout.c install_cleanup; `trap '' TERM` before it was lost) and
# it forwards a TERM it gets (SignalChildrenProcesses=yes: every process of the job) to the command: a requeue killed
# by its own TERM counted as failed. A bash between them restores the ignore (~3 ms); KILL, which none can ignore, cuts.
exec_within() {
  local s=$1
  shift
  # shellcheck disable=SC2016  # the inner bash expands "$@"
  [ -n "$s" ] && command -v timeout > /dev/null &&
    exec timeout -s KILL "$((s > 1 ? s : 1))" bash -c 'trap "" TERM INT; exec "$@"' _ "$@"  # (timeout 0: none)
  exec "$@"
}
# The job's base state is read by base/slurm_state.py (`python -m base.slurm_state`); the Python that can run it is
# found once, now: the venv's, else python3 (a venv built in a container is a dangling link on the host; python3 3.6
# cannot parse the module). Without one this shell reads `scontrol --json show job` itself (json_state), else the text
# as printed: COMPLETING while the job ends, which the TERM trap takes as a cancel (a time limit or preemption is then
# never requeued). state_how says which, for that log line. The probe: ~50 ms a Python, once per job start.
state_python() {  # sets state_py (empty: none runs) and state_how; logs one line when no Python runs
  local p why tried=""
  state_py=""
  for p in "$repo/.venv/bin/python" python3; do
    why=$(PYTHONPATH=$repo${PYTHONPATH:+:$PYTHONPATH} "$p" -c 'import base.slurm_state' 2>&1 >/dev/null) &&
      { state_py=$p; state_how="$p -m base.slurm_state: no scontrol --json, no sacct"; return 0; }
    tried+="${tried:+; }$p: $(tail -n 1 <<< "${why:-failed}" | sed 's/^.*: line [0-9]*: [^:]*: //')"
  done
  state_how="no Python runs base/slurm_state.py ($tried); scontrol --json, read by this shell, gave none"
  log "no Python runs base/slurm_state.py ($tried): the job's state at a SIGTERM is read from scontrol --json by" \
    "this shell (without it a time limit or preemption is taken as a cancel, not requeued)"
}
state_python
# What the start's `scontrol show job` ($shown) says of requeues (src/scontrol/info_job.c: "Requeue=%u Restarts=%u").
# Requeue=0: sbatch --no-requeue, SBATCH_NO_REQUEUE=1 in the submitting environment (it beats #SBATCH --requeue:
# src/sbatch/opt.c), a job_submit policy: no requeue of ours is accepted; said now, in one line, and once at the end.
# Restarts=N is this job's restart: before Slurm 36b31fae4d (2026-07-30) SLURM_RESTART_COUNT is set only when > 0, so a
# job submitted from inside a requeued one inherited that job's (sbatch copies the environment): restart 1 at its real
# 0, whose ranks waited for a LATEST and whose run lock took the real restart for a second writer.
no_requeue=0  # 1: Requeue=0, read at the start or answered by a requeue
# A flag the batch shell's traps set, given its default here too: Slurm runs the slurm.sbatch it spooled at
# submission, which a `git pull` before a requeue pairs with this library (that script never set it: set -u ended
# its preemption 'finished: unbound variable', exit 1, unrequeued; tests/stubs/slurm.sbatch.spooled).
finished=${finished:-} kill_at=${kill_at:-}
requeue_tried=0 requeue_wanted=0 exiting=0 read_st=""  # this file's own: a requeue called, one that failed, at_exit on
job_facts() {
  [[ ${ULYSSES_TERM_WARN_S:-900} =~ ^[0-9]+$ ]] || { log "ULYSSES_TERM_WARN_S=$ULYSSES_TERM_WARN_S is no number of" \
    "seconds: give how long before the job's end a TERM to the steps is the time limit's warning (default 900)"; exit 2; }
  [[ $shown =~ (^|[[:space:]])Requeue=0([[:space:]]|$) ]] && { no_requeue=1; log "requeue is disabled for this job" \
    "(Requeue=0: sbatch --no-requeue, SBATCH_NO_REQUEUE set where it was submitted, or the cluster's policy): a" \
    "preemption or the time limit will end it; resubmit the same command to resume from the run's newest checkpoint"; }
  [[ $shown =~ (^|[[:space:]])Restarts=([0-9]+) ]] || return 0
  [ "${SLURM_RESTART_COUNT:-${BASH_REMATCH[2]}}" = "${BASH_REMATCH[2]}" ] || log "SLURM_RESTART_COUNT=$SLURM_RESTART_COUNT" \
    "is another job's (inherited: this one was submitted from inside it); this job's restart: ${BASH_REMATCH[2]}"
  export SLURM_RESTART_COUNT=${BASH_REMATCH[2]}
}
# The EXIT trap. Not requeued by this shell: the job's book goes, and Slurm is told not to requeue it either
# (Requeue=0, allowed on a running job: job_mgr.c _update_job): a site's RequeueExit / RequeueExitHold (slurm.conf)
# requeues a job whose exit code it lists (1, 2, 69, 75, 130: _set_job_requeue_exit_value, unless the job's requeue is
# off) whatever this shell decided, and the book gone, no bound would trip: a loop. Not on an exit 0 (RequeueExit lists
# failures), a cancel (never requeued: job_hold_requeue) nor a TIMEOUT or PREEMPTED job (finished: the update is
# refused, ESLURM_JOB_FINISHED). One scontrol call; its failure is a note (none for "already finished": a cancel
# meanwhile).
# Nor when this shell wanted a requeue that failed (requeue_wanted): its answer may have been lost with the requeue
# applied (the job PENDING), or a RequeueExit is the site's fallback; the book is kept for the next allocation.
at_exit() {  # $1: the exit status
  local err
  exiting=1  # the TERM trap does nothing from here (a scancel during the update below)
  [ "${requeued:-0}" = 1 ] || [ "$requeue_wanted" = 1 ] && { rm -rf "${state:-/nonexistent}"; return 0; }
  if [ "$1" != 0 ] && [ "${cancelled:-0}${no_requeue:-0}" = 00 ] && [ -z "${finished:-}" ]; then
    err=$(trap '' TERM INT; exec_within "$(call_s)" scontrol update JobId="$ref" Requeue=0 2>&1) ||
      [[ $err == *"already finished"* ]] ||
      log "note: Requeue=0 not set (${err:-no answer}): a RequeueExit of the cluster's listing $1 would requeue the job"
  fi
  rm -f "$book".{progress,crashes,starts,exclude,unseen}
  rm -rf "${state:-/nonexistent}"
}
# job_state flags listed beside the base state (base/slurm_state.py FLAGS; tests/e2e/test_sbatch_state.py: the same)
STATE_FLAGS="COMPLETING STAGE_OUT CONFIGURING EXPEDITING RESIZING REQUEUED REQUEUE_FED REQUEUE_HOLD SPECIAL_EXIT STOPPED
  REVOKED RESV_DEL_HOLD SIGNALING UPDATE_DB POWER_UP_NODE LAUNCH_FAILED RECONFIG_FAIL"
json_state() {  # stdin: `scontrol --json show job $ref`; "STATE REASON" of $ref's record as base/slurm_state.py
  # reads it (an array task A_T: the record with those array ids; else job_id's, else the first), nothing when none.
  # grep cuts the JSON into tokens, one a line (any layout); awk follows the nesting: ~1 s for a 1000-task array's 4 MB.
  LC_ALL=C grep -oE '"([^"\\]|\\.)*"|[][{}:,]|[^][{}:,[:space:]"]+' |
    LC_ALL=C awk -v ref="$ref" -v flags="$STATE_FLAGS" '
    BEGIN { split(flags, f, /[ \t\n]+/); for (k in f) flag[f[k]] = 1; at = index(ref, "_") }
    function bare(t) { return substr(t, 1, 1) == "\"" ? substr(t, 2, length(t) - 2) : t }
    function base(s,   k, n, w) {  # the first word of s that is no flag
      n = split(s, w, " "); for (k = 1; k <= n; k++) if (!(w[k] in flag)) return w[k]; return "" }
    $0 == "{" || $0 == "[" { open[++d] = $0; key[d] = ""; want[d] = ($0 == "{")
      if (d == 2 && $0 == "[" && key[1] == "jobs") jobs = 1
      if (jobs && d == 3) { id = ""; aid = ""; tid = ""; st = ""; rs = "" }
      next }
    $0 == "}" || $0 == "]" {
      if (jobs && d == 3) {  # a record ends
        hit = at ? aid == substr(ref, 1, at - 1) && tid == substr(ref, at + 1) : id == ref
        if (hit && !found) { found = 1; out = base(st); why = rs }
        if (++n == 1) { first = base(st); why1 = rs }
      }
      if (--d < 2) jobs = 0
      next }
    $0 == ":" { want[d] = 0; next }
    $0 == "," { want[d] = (open[d] == "{"); next }
    want[d] { key[d] = bare($0); next }
    jobs && d == 3 && key[3] == "job_id" { id = $0 }
    jobs && d == 3 && key[3] == "array_job_id" { aid = $0 }
    jobs && d == 3 && key[3] == "array_task_id" { tid = $0 }
    jobs && d == 4 && key[4] == "number" && open[4] == "{" {  # data_parser v0.0.40: {"set": true, "number": N}
      if (key[3] == "job_id") id = $0; else if (key[3] == "array_job_id") aid = $0
      else if (key[3] == "array_task_id") tid = $0 }
    jobs && key[3] == "job_state" && (d == 3 || (d == 4 && open[4] == "[")) { st = st " " bare($0) }
    jobs && d == 3 && key[3] == "state_reason" { rs = bare($0) }
    END {
      if (!found && !at && n) { found = 1; out = first; why = why1 }
      if (found && out != "") print out, (why == "" ? "None" : why)
    }'
}
job_state() {  # "STATE REASON": the job's base state (scontrol prints COMPLETING over it while the job ends; retried);
  # $1: the seconds it may take in all (nothing: no bound)
  local out i end=$((SECONDS + ${1:-86400}))
  if [ -n "$state_py" ]; then
    out=$("$state_py" -m base.slurm_state "$ref" ${1:+"$1"} 2>/dev/null) && [ -n "${out// /}" ] &&
      { echo "$out"; return 0; }
  else  # no Python: the JSON's base state (Slurm >= 23.11), else the text below
    for i in 1 2; do  # retried once (a busy controller)
      out=$(exec_within "${1:+$((end - SECONDS))}" scontrol --json show job "$ref" 2>/dev/null) && break
      [ "$i" = 2 ] || [ "$SECONDS" -ge "$end" ] || sleep 1
    done
    out=$(json_state <<< "$out") && [ -n "$out" ] && { echo "$out"; return 0; }
  fi
  [ "$SECONDS" -lt "$end" ] || return 0
  out=$(exec_within "${1:+$((end - SECONDS))}" scontrol show job "$ref" 2>/dev/null) &&
    [[ $out =~ JobState=([A-Z_]+) ]] &&  # as printed
    echo "${BASH_REMATCH[1]} $(grep -oE 'Reason=[^ ]+' <<< "$out" | head -n 1 | cut -d= -f2)"
}
pool_size() {  # the nodes this job can run on (its reservation's or partition's), less $1's hosts; empty: unknown
  local what=partition name=${SLURM_JOB_PARTITION:-} nodes
  [ -n "${SLURM_JOB_RESERVATION:-}" ] && what=reservation name=$SLURM_JOB_RESERVATION
  [ -n "$name" ] || return 0
  nodes=$(scontrol show "$what" "$name" 2>/dev/null | grep -oE '(^| )Nodes=[^ ]+' | head -n 1 | cut -d= -f2)
  [ -n "$nodes" ] || return 0
  comm -23 <(scontrol show hostnames "$nodes" | sort -u) <(scontrol show hostnames "$1" | sort -u) | grep -c .
}
requeue_without() {  # $1: hosts to exclude (none: plain requeue), $2: the code to exit with if the requeue fails
  local old exclude="" left pool narrow
  [ "$requeued" = 1 ] && { log "already requeued"; exit 0; }
  may_requeue "$2"
  if [ -n "$1" ]; then
    old=$(scontrol show job "$ref" 2>/dev/null | grep -oE 'ExcNodeList=[^ ]+' | head -n 1 | cut -d= -f2)
    case "$old" in ""|"(null)") exclude=$1 ;; *) exclude=$old,$1 ;; esac
    [ -f "$intent" ] && exclude=$exclude,$(cat "$intent")  # an earlier exclusion whose update did not land
    exclude=$(scontrol show hostnames "$exclude" | awk 'NF && !seen[$0]++' | paste -sd,)
    left=$(pool_size "$exclude")
    # nodes asked by name (sbatch -w: ReqNodeList): an exclusion of one leaves the job pending forever (ReqNodeNotAvail)
    narrow=$(scontrol show job "$ref" 2>/dev/null | grep -oE '(^| )ReqNodeList=[^ ]+' | grep -v '(null)' | tr -d ' ')
    if [ -n "$narrow" ]; then
      log "not excluding $1: the job asks for its nodes ($narrow), which an exclusion could leave too few of (it" \
        "would pend forever): requeued with them"
      exclude="" && rm -f "$intent"
    elif [ -n "$left" ] && [ "$left" -lt "$nnodes" ]; then
      pool="partition ${SLURM_JOB_PARTITION:-}"
      [ -n "${SLURM_JOB_RESERVATION:-}" ] && pool="reservation $SLURM_JOB_RESERVATION"
      log "not excluding $1: ExcNodeList=$exclude would leave $left node(s) of $pool for a job of $nnodes (it would" \
        "pend forever): requeued with them"
      exclude="" && rm -f "$intent"
    fi
  fi
  # ExcNodeList can only be set on a pending job (slurmctld _update_job: "Job is no longer pending execution"). After
  # `scontrol requeue` the job is PENDING (COMPLETING while its processes end, then held back by BeginTime, the
  # requeue delay: ~2 min), so the update that follows is accepted and nothing starts the job before it. The requeue
  # also ends this shell (SIGTERM, SIGKILL KillWait later): the update runs with SIGTERM ignored and takes
  # milliseconds. No requeuehold: a hold whose `release` a SIGKILL cut would leave the job held forever.
  # the exclusion is recorded first (.cache/slurm/<job>.exclude): should its update not land before the SIGKILL (a busy
  # controller: each try can take MessageTimeout), the next run finds itself on an excluded node and requeues again
  [ -n "$exclude" ] && { mkdir -p "$(dirname "$intent")" && echo "$exclude" > "$intent"; }
  requeue_cmd "$2" || { [ $? = 2 ] || log "requeue failed"; exit "$2"; }
  [ -n "$exclude" ] || exit 0
  log "scontrol requeue $ref, then update ExcNodeList=$exclude"
  for _ in 1 2 3; do
    ( trap '' TERM INT; exec scontrol update JobId="$ref" ExcNodeList="$exclude" ) && { rm -f "$intent"; exit 0; }
    sleep 1
  done
  log "could not exclude $1: requeued with them"
  exit 0
}

# After the step, a node's TERM record (term.N), none to this shell, no rank's own crash (--kill-on-bad-exit TERMs
# every node after one): a preemption with GraceTime when PreemptTime is set (slurmctld TERMs the steps only,
# preempt.c KILL_STEPS_ONLY, and requeues the job at the grace's end unless it ended first: a launcher SIGKILLs its
# ranks 30 s after TERM, exit 1): requeued. Unset, the job RUNNING (not being ended) and the ranks saved (75): a
# user's `scancel --signal=TERM JOB` without --batch (the steps only; the time limit and a cancel TERM this shell too):
# a stop, as USR2's, never requeued; within ULYSSES_TERM_WARN_S (900 s) of the end, a time-limit warning sent as TERM
# to the steps (`sbatch --signal=TERM@300`, which overrides this script's B:USR1): requeued. Slurm does not show
# --signal in `scontrol show job`, so a warning sent earlier than the bound (--signal=TERM@1200) reads as a user's TERM:
# that line names the fix (B:USR1, or the bound raised). One `scontrol show job`, only then.
steps_termed() {
  local shown
  [ "$termed" -gt 0 ] && [ -z "$term_at" ] && [ "$complete$stopped" = 00 ] && [ "$rc" != 2 ] &&
    [ "${#crash_first[@]}${#crash_own[@]}" = 00 ] || return 0
  shown=$(scontrol show job "$ref" 2>/dev/null)  # read whole: no grep -q under pipefail
  # set: any value but None (SLURM_TIME_FORMAT=relative prints `Ystday 23:59`; slurm.sbatch exports `standard`)
  local pre="" end="" left=""
  [[ $shown =~ PreemptTime=([^[:space:]]+) ]] && pre=${BASH_REMATCH[1]}
  [[ $shown =~ EndTime=([0-9T:-]+) ]] && end=${BASH_REMATCH[1]}
  [ -n "$end" ] && left=$(( $(date -d "$end" +%s 2>/dev/null || echo 0) - $(date +%s) ))
  if [ -n "$pre" ] && [ "$pre" != None ]; then
    log "the steps got SIGTERM, this shell none, PreemptTime set: a preemption (GraceTime), exit $rc: scontrol" \
      "requeue $ref"
    requeue_without "" "$rc"
  elif [ "$rc" = "$EXIT_PREEMPTED" ] && [[ $shown =~ JobState=RUNNING ]] &&
      { [ -z "$left" ] || [ "$left" -gt "${ULYSSES_TERM_WARN_S:-900}" ]; }; then
    log "the steps got SIGTERM, this shell none, no PreemptTime, the job RUNNING${left:+ ${left} s before its end}:" \
      "a user's scancel --signal=TERM (the steps only), no preemption nor time limit: saved and stopped, not" \
      "requeueing (a time-limit warning sent as TERM more than ULYSSES_TERM_WARN_S=${ULYSSES_TERM_WARN_S:-900} s" \
      "before the end reads so: submit with --signal=B:USR1@N, or raise ULYSSES_TERM_WARN_S above N)"
    exit 0
  fi
  return 0
}

# A crash confined to one node (a GPU Xid, an ECC error: that node's ranks fail, the others are stopped by the abort
# channel or srun) is requeued without that node, as a lost node is, but bounded so that a bug never loops: not when
# more than one node crashed on its own (or the job has one node: nothing tells a bad node from a bug), not past
# ULYSSES_MAX_CRASH_REQUEUES (default 2) per job, and not when the same failure comes back: each crash requeue records
# (in .cache/slurm/<job>.crashes, kept across restarts) the step of the newest committed checkpoint (OUTPUT_DIR/
# checkpoints/LATEST) and the last step the run logged (metrics.jsonl); a crash after the same step from the same
# checkpoint again is deterministic, a bug. docs/launch.md says why these rules. Decided once, here, from the records:
# crash_first is the node(s) where the crash began (a `died` node, a rank dead of a signal, ahead of any `first`).
run_steps() {  # "CHECKPOINT STEP" of the run now ("-" where unknown)
  local c="" s=""
  if [ -n "$out_dir" ]; then
    c=$(grep -oE '[0-9]+$' "$out_dir/checkpoints/LATEST" 2>/dev/null | sed 's/^0*\(.\)/\1/')
    s=$(tail -n 64 "$out_dir/metrics.jsonl" 2>/dev/null | grep -oE '"step": ?[0-9]+' | tail -n 1 | grep -oE '[0-9]+$')
  fi
  echo "${c:--} ${s:--}"
}
same_failure() {  # $1: run_steps, $2: the node(s) now; says so and succeeds when a crash requeue recorded that step
  local same  # at the same step, a save between or not (a timed save moves the checkpoint, not a data-dependent crash's)
  same=$(awk -v s="${1#* }" 's != "-" && $5 == s' "$crashes" 2>/dev/null | tail -n 1)
  [ -n "$same" ] || return 1
  log "the same failure twice: a crash after step ${1#* } again, now from the checkpoint of step ${1% *} (node" \
    "$(cut -d' ' -f2 <<< "$same") at restart $(cut -d' ' -f1 <<< "$same"), now $2): a bug, not a node: not requeueing"
}
crash_requeue() {  # $1: the job's code; requeues (and exits) when the rules above allow it, else returns
  local crashed=(${crash_first[@]+"${crash_first[@]}"} ${crash_own[@]+"${crash_own[@]}"}) n host steps count same
  [ "${#crashed[@]}" -gt 0 ] || return 0
  if [ "${#crash_first[@]}" != 1 ] || [ "${#crashed[@]}" != 1 ] || [ "$nnodes" -lt 2 ]; then
    suspended_crash "$1" "${crashed[*]}"
    log "crashed on node(s) ${crashed[*]} (exit $1), each on its own, $nnodes node(s) in the job: not a node's fault, not requeueing"
    return 0
  fi
  n=${crash_first[0]} host=${hosts[$n]:-}
  steps=$(run_steps)
  count=$(cat "$crashes" 2>/dev/null | grep -c .)
  same_failure "$steps" "node $n" && return 0
  if [ "$count" -ge "${ULYSSES_MAX_CRASH_REQUEUES:-2}" ]; then
    log "node $n (${host:-?}) crashed (exit $1), but this job was already requeued $count time(s) for a crash" \
      "(ULYSSES_MAX_CRASH_REQUEUES=${ULYSSES_MAX_CRASH_REQUEUES:-2}): not requeueing"
    return 0
  fi
  echo "${SLURM_RESTART_COUNT:-0} $n ${host:-?} $steps" >> "$crashes"
  log "node $n (${host:-?}) crashed (exit $1), no other node on its own (checkpoint step ${steps% *}, last step" \
    "${steps#* }): crash requeue $((count + 1)) of ${ULYSSES_MAX_CRASH_REQUEUES:-2}, without that node"
  requeue_without "$host" "$1"
}
# A suspend (`scontrol suspend`, PreemptMode=SUSPEND or GANG: SIGSTOP to every process of the job) longer than the ranks'
# --dist_timeout_s (30 min) fails every rank at the resume: NCCL's watchdog times a collective on steady_clock, which
# counts the stopped time. Every node then records a crash of its own, which the rule above refuses (not one node's).
# Slurm's SuspendTime is the job's last suspend or resume (SchedMD/slurm src/slurmctld/job_mgr.c _job_suspend_op sets
# it to now after either; _job_requeue_op clears it): the crash is the suspend's when it began (crash_at, the oldest
# crash record: slurm.sbatch) within 5 min of that resume (the watchdog fires at once; ABORT_WAIT_S and the launchers'
# exits follow in seconds) and the allocation (SLURM_JOB_START_TIME) began before it: requeued, nothing excluded, no
# crash counted, bounded by progress as every requeue. A crash of every node hours after a suspend (a gang scheduler's
# at minute 1, a bug at hour 10), or after the same step as a crash requeue's record (same_failure), is a bug: refused
# as above. One `scontrol show job`, only then.
suspended_crash() {  # $1: the job's code, $2: the crashed nodes; requeues (and exits) when a resume explains the crash
  local shown at when
  shown=$(scontrol show job "$ref" 2>/dev/null)
  [[ $shown =~ SuspendTime=([0-9]{4}-[0-9-]+T[0-9:]+) ]] || return 0
  when=${BASH_REMATCH[1]}
  at=$(date -d "$when" +%s 2>/dev/null) && [ "$at" -ge "${SLURM_JOB_START_TIME:-0}" ] || return 0
  # 60 s before it: the records' file server and slurmctld keep their own clocks
  if [ -z "$crash_at" ] || [ "$crash_at" -lt $((at - 60)) ] || [ "$crash_at" -gt $((at + 300)) ]; then
    log "the job was suspended or resumed last at $when (SuspendTime), its crash began" \
      "$([ -n "$crash_at" ] && echo "$((crash_at - at)) s after" || echo "at an unknown time"): not at the resume," \
      "not the suspend's"
    return 0
  fi
  same_failure "$(run_steps)" "node(s) $2" && return 0
  log "crashed on node(s) $2 (exit $1) at the resume of a suspend (SuspendTime=$when): a suspend longer than" \
    "--dist_timeout_s fails every rank at the resume, no node's fault: scontrol requeue $ref (raise --dist_timeout_s" \
    "above the longest suspend on this partition)"
  requeue_without "" "$1"
}
