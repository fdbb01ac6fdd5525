# shellcheck shell=bash
# Sourced by scripts/launch.sh: how a signal to launch.sh reaches the training ranks as a "save and exit" request
# (on_signal, its trap for TERM INT USR1 USR2 HUP; forward; hard_stop at a second and third SIGINT) and how the ranks
# are found (children, rank_pids). Reads and sets launch.sh's state: launcher_pid, mode, pending, interrupts, killed,
# known_ranks, EXIT_PREEMPTED; over_pdsh and signal_nodes are scripts/launch_env.sh's.
# shellcheck disable=SC2154  # every variable named above is launch.sh's

children() {  # pids whose parent is $1 (from /proc, so no procps needed)
  local f line rest state ppid
  for f in /proc/[0-9]*/stat; do
    { read -r line < "$f"; } 2>/dev/null || continue
    rest=${line##*) }  # the command name in (...) may contain spaces
    read -r state ppid _ <<< "$rest"
    [ "$ppid" = "$1" ] && { f=${f#/proc/}; echo "${f%/stat}"; }
  done
  return 0
}
rank_pids() {  # deepspeed: runner -> deepspeed.launcher.launch -> ranks; torchrun: torchrun -> ranks
  local p
  [ -n "$launcher_pid" ] || return 0
  if [ "$mode" = torchrun ]; then children "$launcher_pid"; return; fi
  for p in $(children "$launcher_pid"); do children "$p"; done
}
catches_usr1() {  # has the rank installed its SIGUSR1 handler yet? (bit 10-1 of SigCgt)
  local mask
  mask=$(awk '/^SigCgt:/ {print $2}' "/proc/$1/status" 2>/dev/null) && [ -n "$mask" ] && (( 0x$mask & 0x200 ))
}
forward() {  # SIGUSR1 to every local rank that listens for it; stays pending until all of them do
  local p ranks="" waiting=0
  for p in $(rank_pids); do
    if catches_usr1 "$p"; then ranks+=" $p"; else waiting=1; fi
  done
  # shellcheck disable=SC2086  # one pid per word
  [ -n "$ranks" ] && kill -USR1 $ranks 2>/dev/null && echo "launch.sh: SIGUSR1 sent to ranks$ranks" >&2
  if over_pdsh && [ "$pending" = 1 ]; then
    signal_nodes USR1  # this launch's ranks
  fi
  if over_pdsh || { [ -n "$ranks" ] && [ "$waiting" = 0 ]; }; then pending=0; fi
}
# A second SIGINT: SIGTERM to the launcher's process group, ranks included (deepspeed's runner handles it only for pdsh
# on several nodes: on one node or --no_ssh it died alone, launch.py and the ranks got nothing, and this script waited
# RANK_EXIT_WAIT_S a rank); launch.py then TERMs its ranks and SIGKILLs them 30 s later. pdsh: the ranks of this launch
# on every node (the runner's handler would pkill every deepspeed launch there); launch.py ends the rest 30 s after the
# first exits. A third: SIGKILL to all of them (torchrun's workers have sessions of their own), and no wait for a rank.
hard_stop() {
  local sig=TERM after=" (SIGKILL after 30 s)"
  [ "$interrupts" -ge 3 ] && sig=KILL killed=1 after=""
  echo "launch.sh: SIGINT $interrupts: SIG$sig to the launcher and every rank$after" >&2
  over_pdsh && signal_nodes "$sig"
  # shellcheck disable=SC2046,SC2086  # one pid per word
  [ "$killed" = 1 ] && kill -KILL $(rank_pids) $known_ranks 2>/dev/null
  over_pdsh && [ "$killed" = 0 ] || kill -"$sig" -- -"$launcher_pid" 2>/dev/null  # (a hostfile of this host alone: local)
  return 0
}
on_signal() {
  signalled=1
  if [ "$1" = INT ] && [ $((interrupts += 1)) -ge 2 ]; then hard_stop; return 0; fi
  echo "launch.sh: got SIG$1: asking the training to save and exit $EXIT_PREEMPTED" >&2
  pending=1
  forward
}
