# Sourced by scripts/launch.sh: this node's crash verdict for scripts/slurm.sbatch (LAUNCH_CRASH_FILE; a crash
# confined to one node is requeued without it, scripts/slurm_requeue.sh crash_requeue). Reads launch.sh's state: rc,
# death, exit_dir, signalled, early, ranks_here, recorded, origin, node_rank, node_store.
#
# `died`: a rank here dead without an exit of its own (the host's OOM killer, a segfault), decided by died_verdict as
# soon as the launcher returns: a node TERMed by srun has KillWait (30 s by default) before Slurm's SIGKILL, while its
# ranks may take minutes to leave. The evidence, any of:
# - the OOM killer took a process of this task as a rank here went: its cgroup's `oom_kill` count grew (cgroup v2
#   memory.events, v1 memory.oom_control: any OOM killer, the host's or the cgroup's) past its count at launch.sh's
#   last poll with every rank here alive (an earlier OOM kill a rank survived, a compiler's, is not this death's).
#   The only evidence that survives the usual race: a healthy node's rank, its peer gone, raises at once and its node
#   exits first; srun then TERMs this node's task, and the deepspeed runner, which has no TERM handler under --no_ssh,
#   dies of it (143) while launch.py still gives the other ranks 30 s: the dead rank's signal is never reported.
# - a rank's fault record (LAUNCH_EXIT_DIR/fault<R>, Python's faulthandler: training/job.py) says SIGSEGV, SIGBUS,
#   SIGILL or SIGFPE, which Slurm never sends. Not SIGABRT: NCCL's watchdog tears down a healthy rank whose peer
#   vanished with it, and so does a shutdown after a monitor's exit.
# - the launcher's code: deepspeed's launch.py exits with its first failed rank's -N (256 - N), a launcher killed
#   itself 128 + N, torchrun's summary (read from its output once the ranks are gone: a second call); counted ILL, BUS,
#   FPE, KILL, SEGV.
# Never when this script was signalled (Slurm ending the step) before a rank here was gone (`early`: a rank killed on
# its way out after the step's TERM is no death of this node's own), never when every rank here recorded its own exit
# or a note of the job's abort.

cgroup_dir() {  # this task's cgroup folder (its memory controller's under v1). LAUNCH_CGROUP: a folder standing in for
  # it (a test's; `%n` is this node's rank)
  local line v2="" v1=""
  if [ -n "${LAUNCH_CGROUP:-}" ]; then echo "${LAUNCH_CGROUP//%n/$node_rank}"; return 0; fi
  { while IFS= read -r line; do
      case $line in 0::*) v2=${line#0::} ;; *:*memory*:*) v1=${line#*:*:} ;; esac
    done < /proc/self/cgroup; } 2>/dev/null
  if [ -r "/sys/fs/cgroup$v2/memory.events" ]; then echo "/sys/fs/cgroup$v2"; else echo "/sys/fs/cgroup/memory$v1"; fi
}
cg=""  # cgroup_dir, once (launch.sh, before the launcher starts)
read_ooms() {  # OOMS: this task's cgroup's OOM kills so far ('' where unreadable). Builtins only, no fork: launch.sh
  # reads it every poll, and a forked command there defers its traps (two SIGINTs 1 s apart became one under load)
  local k v f
  OOMS=""
  for f in "$cg/memory.events" "$cg/memory.oom_control"; do
    [ -n "$cg" ] && [ -r "$f" ] || continue
    while read -r k v; do [ "$k" = oom_kill ] && { OOMS=$v; return 0; }; done < "$f"
  done
  return 0
}
ooms=""  # the count while every rank here was alive: read before the launcher starts and at each poll until one goes
alive() {  # a process that has not exited (a zombie its launcher has not reaped yet has)
  local s
  { read -r s < "/proc/$1/stat"; } 2>/dev/null || return 1
  s=${s##*) }
  [ "${s%% *}" != Z ]
}
EXIT_INTERRUPTED=130  # base/exits.py: a user's Ctrl-C at start-up (training/job.py), no crash of this node's
died=0
died_verdict() {
  local d=$death n why="" now f
  [ "$died" = 0 ] || return 0
  case "$rc" in 0|"$EXIT_USAGE"|"$EXIT_PEER_LOST"|"$EXIT_PREEMPTED"|"$EXIT_INTERRUPTED") return 0 ;; esac
  [ "$signalled$early" != 10 ] || return 0
  # the ranks here that said how they left: an exit record (rank<R>: their own exit) or a note of the job's abort
  # (store<R>: stopped by another rank's failure, base/watcher.py, with that failure's code, 247 where a launcher's
  # signal code was posted); a node all of whose ranks did is no origin, whatever its code
  n=$(ls "$exit_dir" 2>/dev/null | sed -n 's/^\(rank\|store\)\([0-9][0-9]*\)$/\2/p' | sort -u | grep -c .)
  [ "$n" -lt "$ranks_here" ] || return 0
  read_ooms
  now=$OOMS
  if [ -n "$ooms" ] && [ -n "$now" ] && [ "$now" -gt "$ooms" ]; then
    why="the OOM killer took a process here (its cgroup's oom_kill: $ooms -> $now)"
  elif f=$(grep -lsE '^Fatal Python error: (Segmentation fault|Bus error|Illegal instruction|Floating.point exception)' \
      "$exit_dir"/fault* | head -n 1) && [ -n "$f" ]; then
    why="a rank here died of $(grep -m1 -oE 'Segmentation fault|Bus error|Illegal instruction|Floating.point exception' "$f")"
    head -n 60 "$f" >&2  # its traceback (faulthandler's), for the job's log
  else
    if [ -z "$d" ] && [ "$rc" -ge 129 ] 2>/dev/null && [ "$rc" -le 255 ]; then
      if [ "$rc" -ge 193 ]; then d=$((256 - rc)); else d=$((rc - 128)); fi
    fi
    case " 4 7 8 9 11 " in *" ${d:-x} "*) why="a rank here died of signal $d" ;; *) return 0 ;; esac
  fi
  died=1
  echo "launch.sh: $why without an exit of its own (the host's OOM killer, a segfault): this node's crash verdict" \
    "is 'died'" >&2
  [ -z "${LAUNCH_CRASH_FILE:-}" ] || echo died > "$LAUNCH_CRASH_FILE"
}

# The others, at the end: `first` when the job's first failure on record is this node's (a rank here raised first, or
# this launcher's post came first; with one node or no job store: a rank here raised), `own` when a rank here raised
# too (its record a failure code) after another node's first failure, nothing when the ranks here were stopped by it
# (the abort channel: a watcher's exit records nothing) or by Slurm. A silent death (the host's OOM killer, a
# segfault) posts nothing in time: a healthy node's rank, its peer gone ("Connection reset by peer"), raises and posts
# first, and that node would be the one excluded: `died` stands over a `first` (this death's consequence).
crash_verdict() {
  local raised=0 c
  [ -n "${LAUNCH_CRASH_FILE:-}" ] && [ "$died" = 0 ] || return 0
  # signalled before any rank here was gone (a GraceTime preemption, the step's end): what the ranks raised since is
  # the stop's teardown (launch.py SIGKILLs a rank still in a long step, its peers' collective breaks), no crash
  [ "$signalled$early" != 10 ] || return 0
  case "$rc" in 0|"$EXIT_USAGE"|"$EXIT_PEER_LOST"|"$EXIT_PREEMPTED"|"$EXIT_INTERRUPTED") return 0 ;; esac
  for c in $recorded; do
    case "$c" in 0|"$EXIT_USAGE"|"$EXIT_PEER_LOST"|"$EXIT_PREEMPTED"|"$EXIT_INTERRUPTED") ;; *) raised=1 ;; esac
  done
  if [ "$origin" = "$node_rank" ] || { [ "$node_store" = 0 ] && [ "$raised" = 1 ]; }; then
    echo first > "$LAUNCH_CRASH_FILE"
  elif [ "$raised" = 1 ] && [ "$(cat "$LAUNCH_CRASH_FILE" 2>/dev/null)" != first ]; then
    echo own > "$LAUNCH_CRASH_FILE"  # never over `first`, which a failing rank here wrote itself (training/job.py)
  fi
}
