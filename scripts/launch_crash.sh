# Sourced by scripts/launch.sh: this node's crash verdict for scripts/slurm.sbatch (LAUNCH_CRASH_FILE; a crash
# confined to one node is requeued without it, scripts/slurm_requeue.sh crash_requeue). Reads launch.sh's state: rc,
# death, exit_dir, signalled, early, ranks_here, recorded, origin, node_rank, node_store.
#
# `died`: a rank here dead without an exit of its own (the host's OOM killer, a segfault), decided by died_verdict as
# soon as the launcher returns: a node TERMed by srun has KillWait (30 s by default) before Slurm's SIGKILL, while its
# ranks may take minutes to leave. The evidence, any of:
# - the OOM killer took a process of this task as a rank here went: its cgroup's `oom_kill` count grew (cgroup v2
#   memory.events, v1 memory.oom_control: any OOM killer, the host's or the cgroup's) past its count at launch.sh's
#   poll with every rank here alive 30 s before the last such poll (read_ooms: a killed rank's teardown outlasts a
#   poll; an OOM kill a rank survived longer before, a compiler's, is not this death's).
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
#
# `memlimit` in its place when a memory limit above this task did it: a level of its cgroup, from the task's up to the
# job's (job_<SLURM_JOB_ID>; without one in the path, the mount's root: a container's), that has a limit (v2
# memory.max not "max", v1 memory.limit_in_bytes under 10^18: Slurm's ConstrainRAMSpace writes `sbatch --mem` x
# AllowedRAMSpace% at the job's and the step's user processes', step_N/user, SchedMD/slurm
# src/plugins/cgroup/v2/cgroup_v2.c cgroup_p_constrain_set) counted an OOM at it since that baseline poll (read_ooms)
# (v2 memory.events `oom`, v1 memory.failcnt while the level was full: oom_counts). The kernel raises `oom` at the cgroup whose limit was hit and, v2's events
# being hierarchical, at its ancestors, never at the task's below it; a host-wide OOM raises `oom_kill` alone
# (torvalds/linux mm/memcontrol.c try_charge_memcg, include/linux/memcontrol.h memcg_memory_event;
# Documentation/admin-guide/cgroup-v2.rst). No node's fault: the next allocation has the same limit and the same
# ranks' memory, so slurm.sbatch stops, naming the level, instead of excluding a healthy node, then another (Slurm's
# own verdict is OUT_OF_MEMORY: SchedMD/slurm src/slurmd/slurmstepd/mgr.c). With Slurm's OOMKillStep
# (memory.oom.group=1 at step_N/user) the kernel kills the whole step, launch.sh too: no verdict, the node reads as
# lost (docs/launch.md). Cost: the levels found once (one or two small reads a level), then one small read a limited
# level a poll (v1: three, memory.stat's ~40 lines one of them).

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
cg_levels=() cg_limits=() cg_walked=0  # the levels from $cg up whose memory is limited, and their limits (bytes)
limit_levels() {  # once: from $cg up to the job's level (job_<SLURM_JOB_ID>), else to the mount's root (the first
  # level without the memory files: a container's own root under a cgroup namespace), at most 16. A limit above the
  # job's (a site's on slurmstepd.scope or system.slice: the node's RAM less a reserve for the OS) is the node's
  # memory, shared with other jobs: an OOM there is a node-wide shortage, `died` (requeued without the node)
  local d=${cg%/} v i
  cg_walked=1
  for ((i = 0; i < 16 && ${#d} > 1; i++)); do
    if [ -r "$d/memory.max" ]; then read -r v < "$d/memory.max" || :
    elif [ -r "$d/memory.limit_in_bytes" ]; then read -r v < "$d/memory.limit_in_bytes" || :
    else break; fi
    [[ ${v:-} =~ ^[0-9]{1,18}$ ]] && { cg_levels+=("$d"); cg_limits+=("$v"); }  # "max", v1's 2^63 - 4096: none
    [ -n "${SLURM_JOB_ID:-}" ] && [ "${d##*/}" = "job_$SLURM_JOB_ID" ] && break
    d=${d%/*} v=""
  done
}
oom_counts() {  # OOMS: this task's cgroup's OOM kills so far ('' where unreadable); LIMIT_OOMS: each limited level's
  # OOMs at its limit (v2 memory.events `oom`, v1 memory.failcnt; '-' where unreadable); LIMIT_FULL: each one's 1
  # where a growth of that count is evidence (v2: always; v1: its usage less page cache at >= 95% of its limit now).
  # v1's failcnt counts every charge that hit the limit, those reclaim then served too, and page cache is charged to
  # the job: a job that read its data or wrote a checkpoint sits at its limit and its failcnt grows at every poll
  # (cgroup-v1 memory.rst), so a host-wide OOM read as `memlimit` and the job stopped instead of requeuing. The usage
  # is memory.usage_in_bytes less memory.stat's total_inactive_file and total_active_file (what reclaim can free;
  # dirty pages count as freeable). Builtins only, no fork: launch.sh reads them every poll (one small file a limited
  # level, Slurm's job and step: two; v1 two more and memory.stat's ~40 lines), and a forked command there defers its
  # traps (two SIGINTs 1 s apart became one under load)
  local k v f d c u n j
  OOMS="" LIMIT_OOMS="" LIMIT_FULL=""
  [ -n "$cg" ] && [ "$cg_walked" = 0 ] && limit_levels
  for ((j = 0; j < ${#cg_levels[@]}; j++)); do
    d=${cg_levels[$j]} c=- f=0
    if [ -r "$d/memory.events" ]; then
      while read -r k v; do [ "$k" = oom ] && c=$v; done < "$d/memory.events"
      f=1
    elif [ -r "$d/memory.failcnt" ]; then
      read -r c < "$d/memory.failcnt" || :
      u="" n=0
      { read -r u < "$d/memory.usage_in_bytes"; } 2>/dev/null
      if [[ $u =~ ^[0-9]{1,19}$ ]] && [ -r "$d/memory.stat" ]; then
        while read -r k v; do
          case $k in total_inactive_file|total_active_file) [[ $v =~ ^[0-9]{1,19}$ ]] && u=$((u - v)) n=$((n + 1)) ;; esac
        done < "$d/memory.stat"
        [ "$n" = 2 ] && [ "$u" -ge $((cg_limits[j] / 20 * 19)) ] && f=1  # no overflow: a limit under 10^18
      fi
    fi
    LIMIT_OOMS+="${c:--} " LIMIT_FULL+="$f "
  done
  for f in "$cg/memory.events" "$cg/memory.oom_control"; do
    [ -n "$cg" ] && [ -r "$f" ] || continue
    while read -r k v; do [ "$k" = oom_kill ] && { OOMS=$v; return 0; }; done < "$f"
  done
  return 0
}
# died_verdict's baselines, `ooms` (the task's OOM kills) and `limit_base` (the limited levels' OOMs): the counts of the
# newest poll with every rank here alive at least oom_window_s before the last such poll (the oldest one kept before
# that). Not the last poll's: the kernel counts `oom` and `oom_kill` when it picks the victim (mm/oom_kill.c
# __oom_kill_process), but the SIGKILLed rank is no zombie until do_exit has torn down its CUDA context and pinned host
# memory (exit_files, exit_mm: 26 s for 243 GB pinned, sgl-project/sglang PR #32829); a poll in that teardown sees every
# rank alive, and with the last poll's counts as the baseline the kill was no growth at all: no verdict, and the healthy
# node that raised first was excluded. The trade-off: an OOM in the oom_window_s before the last poll that a rank
# survived (a compiler's, a data worker's) counts as the death's of a rank that then dies without an exit of its own:
# `memlimit` (the job stops) or `died` for a death that followed it within 30 s. LAUNCH_OOM_WINDOW_S: another window
# (a longer teardown: more pinned memory a rank; a test's shorter one). Cost: ~31 readings of a few words kept.
oom_window_s=${LAUNCH_OOM_WINDOW_S:-30}
[[ $oom_window_s =~ ^[0-9]{1,5}$ ]] || { echo "launch.sh: LAUNCH_OOM_WINDOW_S=$oom_window_s: not a number of" \
  "seconds: unset it (30) or give one, e.g. 60" >&2; exit "${EXIT_USAGE:-2}"; }
ring_t=() ring_ooms=() ring_limit=() ring_full=()  # read_ooms' readings, the oldest first: $SECONDS, OOMS,
# LIMIT_OOMS, LIMIT_FULL
ooms="" limit_base=""
read_ooms() {  # launch.sh's baselines: before the launcher starts and at each poll with every rank here alive
  oom_counts
  ring_t+=("$SECONDS") ring_ooms+=("$OOMS") ring_limit+=("$LIMIT_OOMS") ring_full+=("$LIMIT_FULL")
  while [ "${#ring_t[@]}" -gt 1 ] && [ "${ring_t[1]}" -le $((SECONDS - oom_window_s)) ]; do
    ring_t=("${ring_t[@]:1}") ring_ooms=("${ring_ooms[@]:1}") ring_limit=("${ring_limit[@]:1}")
    ring_full=("${ring_full[@]:1}")
  done
  ooms=${ring_ooms[0]} limit_base=${ring_limit[0]}
}
level_full() {  # true when limited level $1 was full (LIMIT_FULL) at a reading read_ooms keeps
  local r w
  for r in ${ring_full[@]+"${ring_full[@]}"}; do w=($r); [ "${w[$1]:-0}" = 1 ] && return 0; done
  return 1
}
at_limit() {  # true when a limited level counted an OOM since limit_base: MEM_LEVEL, MEM_LIMIT (bytes), MEM_COUNTS.
  # v1: only a level full at a poll of the window (LIMIT_FULL; after the kill its usage is down: not the death's read)
  local was=($limit_base) now=($LIMIT_OOMS) i  # the innermost first: the level whose limit was hit (v2: and above)
  for ((i = 0; i < ${#was[@]} && i < ${#now[@]}; i++)); do
    [[ ${was[$i]}${now[$i]} =~ ^[0-9]+$ ]] && [ "${now[$i]}" -gt "${was[$i]}" ] || continue
    level_full "$i" || continue
    MEM_LEVEL=${cg_levels[$i]} MEM_LIMIT=${cg_limits[$i]} MEM_COUNTS="${was[$i]} -> ${now[$i]}"
    return 0
  done
  return 1
}
alive() {  # a process that has not exited (a zombie its launcher has not reaped yet has)
  local s
  { read -r s < "/proc/$1/stat"; } 2>/dev/null || return 1
  s=${s##*) }
  [ "${s%% *}" != Z ]
}
EXIT_INTERRUPTED=130  # base/exits.py: a user's Ctrl-C at start-up (training/job.py), no crash of this node's
died=0
died_verdict() {
  local d=$death n why="" now f=""
  [ "$died" = 0 ] || return 0
  case "$rc" in 0|"$EXIT_USAGE"|"$EXIT_PEER_LOST"|"$EXIT_PREEMPTED"|"$EXIT_INTERRUPTED") return 0 ;; esac
  [ "$signalled$early" != 10 ] || return 0
  # the ranks here that said how they left: an exit record (rank<R>: their own exit) or a note of the job's abort
  # (store<R>: stopped by another rank's failure, base/watcher.py, with that failure's code, 247 where a launcher's
  # signal code was posted); a node all of whose ranks did is no origin, whatever its code
  n=$(ls "$exit_dir" 2>/dev/null | sed -n 's/^\(rank\|store\)\([0-9][0-9]*\)$/\2/p' | sort -u | grep -c .)
  [ "$n" -lt "$ranks_here" ] || return 0
  oom_counts
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
  if [ -z "$f" ] && at_limit; then  # an OOM kill or a SIGKILL, not a fault record's signal
    local gib=$((MEM_LIMIT / 1048576 * 10 / 1024))  # tenths
    gib="$((gib / 10)).$((gib % 10))"
    echo "launch.sh: $why, at a memory limit: cgroup $MEM_LEVEL (limit $gib GiB) counted it (oom: $MEM_COUNTS):" \
      "this node's crash verdict is 'memlimit' (the next run has the same limit): raise sbatch --mem (or --mem=0 for" \
      "the whole node; a container's memory limit), or lower the host plan: scripts/plan.py" >&2
    [ -z "${LAUNCH_CRASH_FILE:-}" ] || echo "memlimit $gib $MEM_LEVEL" > "$LAUNCH_CRASH_FILE"
    return 0
  fi
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
