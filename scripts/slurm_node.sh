# shellcheck shell=bash
# Sourced by scripts/slurm.sbatch (found in the repository, as scripts/slurm_requeue.sh is): node_task, the program
# srun runs as each node's one task (`bash -c "$node_task" _ STATE NNODES MASTER PORT GPUS K LAUNCH_CMD... ARGS`: the
# K words of LAUNCH_CMD, then train.py's arguments). A string, read by the batch shell and passed on srun's command
# line: a node reads no file of the repository for it (a LAUNCH_CMD of a container's may need none there). Defines
# nothing else. A job Slurm spooled before a `git pull` reads this file as it is after it: keep node_task's name and
# its positional arguments as they are (the last ones are train.py's, any number: a word added at the end would be read
# as a training argument); a new input travels in the environment (srun --export=ALL), as scripts/slurm_requeue.sh
# keeps what tests/stubs/slurm.sbatch.spooled calls.
#
# The node's bash (SLURM_NODEID is per node) records in STATE (start.N, exit.N, term.N, stop.N; its launcher's crash.N)
# and reports 75 to srun as 0. It gives the launcher its own process group (set -m: no signal ignored by inheritance)
# and gets its code through a file (no `wait` a signal can cut). A step's signal (srun's, scancel's without --batch, a
# step's end) reaches that bash alone under proctrack/cgroup with cgroup.conf's default SignalChildrenProcesses=no,
# every process of the step under =yes: it records SIGTERM and SIGUSR2 (stop.N, read after the step: `scancel
# --signal=USR2 JOB` never signals the batch shell) and passes TERM, USR1 and USR2 to the launcher group's processes
# that catch them (launch.sh: twice is one request), held until launch.sh's traps are set (it would die of one before).
# A scan of /proc per signal (~0.1 s on a node running 1000 processes; each second while one is held).
# shellcheck disable=SC2016  # expanded by the inner bash on each node
node_task='s=$1 n=$SLURM_NODEID nn=$2 m=$3 p=$4 g=$5 k=$6; shift 6
    unseen() { echo "${s%/*} (the job'\''s records, under the work dir ${s%/.cache/slurm/*}) is not visible on" \
      "${SLURMD_NODENAME:-$(hostname)}: submit from a folder every node mounts" >&2; exit 254; }  # EXIT_UNSEEN
    if [ -z "${ULYSSES_NO_RECORDS:-}" ]; then
      trap "[ -d \"\$s\" ] || unseen" TERM USR1 USR2 INT HUP  # the step ended while it waits (another node failed)
      for ((i = 0; i < ${STATE_SETTLE_S:-60}; i++)); do [ -d "$s" ] && break; sleep 1; done  # a cache showing it late
      [ -d "$s" ] || unseen
    fi
    launch=("${@:1:k}"); shift "$k"  # LAUNCH_CMD, its k words; then the training arguments
    pid="" held=""
    pass_on() {  # SIG$1 to the launcher group processes that catch it (not the subshell below), else held
      local f r m k v b=$(($(kill -l "$1") - 1)) hit=0
      [ -n "$pid" ] && for f in /proc/[0-9]*/stat; do  # "PID (NAME) STATE PPID PGRP ...": in the group, not its leader
        { read -r r < "$f"; } 2>/dev/null && r=${r##*) } && r=${r#* * } && [ "${r%% *}" = "$pid" ] || continue
        f=${f%/stat}; [ "${f#/proc/}" != "$pid" ] || continue
        m=0; { while read -r k v; do [ "$k" = SigCgt: ] && m=$v; done < "$f/status"; } 2>/dev/null
        (( 0x$m >> b & 1 )) && kill -s "$1" "${f#/proc/}" 2>/dev/null && hit=1
      done
      held=${held// $1/}; [ "$hit" = 1 ] || held+=" $1"
    }
    trap ": > \"\$s/term.\$n\" 2>/dev/null; pass_on TERM" TERM
    trap ": > \"\$s/stop.\$n\" 2>/dev/null; pass_on USR2" USR2
    trap "pass_on USR1" USR1; trap : INT HUP
    echo "${SLURMD_NODENAME:-$(hostname)}" > "$s/start.$n" 2>/dev/null  # after the traps: a start means a TERM is seen
    h=${SLURM_GPUS_ON_NODE:-$g}; [ -n "$g" ] && [ -z "${GPUS_PER_NODE:-}" ] && [ "$h" != "$g" ] && { echo "node $n:" \
      "$h GPUs, node 0 $g (SLURM_GPUS_ON_NODE), whose count every node runs$( ((h > g)) && echo " ($((h - g)) idle)"):" \
      "ask one (sbatch --gpus-per-node=N) or export GPUS_PER_NODE=$((h < g ? h : g))" >&2
      ((h > g)) || { echo 2 > "$s/exit.$n" 2>/dev/null; exit 2; }; }  # more: it runs, warned; fewer: refused
    export LAUNCH_CRASH_FILE=$s/crash.$n  # launch.sh: whether this node crashed on its own (first, own, died, memlimit), below
    code=$(mktemp "${TMPDIR:-/tmp}/ulysses_node.XXXXXX")
    set -m
    ( trap : TERM USR1 USR2 INT HUP; "${launch[@]}" --no_ssh --nnodes "$nn" --node_rank "$n" --master_addr "$m" \
        --master_port "$p" ${g:+--num_gpus "$g"} -- --resume auto "$@"; echo "$?" > "$code" ) &
    pid=$!
    set +m
    while kill -0 "$pid" 2>/dev/null; do  # a held signal: looked at again each second, for 2 minutes at most
      if [ -z "$held" ]; then tries=0; wait "$pid"
      elif [ $((tries += 1)) -gt 120 ]; then echo "node $n: no process of its launcher takes SIG${held# }" >&2; held=""
      else sleep 1; for x in $held; do pass_on "$x"; done; fi
    done
    rc=$(cat "$code" 2>/dev/null)
    rm -f "$code"
    [ -n "$rc" ] || exit 1  # its launcher killed with it: no exit of its own to record
    echo "$rc" > "$s/exit.$n" 2>/dev/null
    [ "$rc" = 75 ] && exit 0
    exit "$rc"'
