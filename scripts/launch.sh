#!/usr/bin/env bash
# One entry for every way to start a run. Prints the exact command, runs it, and exits with train.py's
# code (base/exits.py): 0 done, 75 preempted after a save (requeue the same command; it resumes with --resume auto),
# 69 a peer was lost (a node, a rank, the job's store: requeue, without the lost node), 2 bad input, anything else
# failed. docs/launch.md has the details.
#   scripts/launch.sh [--num_gpus N | --include/--exclude localhost:IDS] -- TRAIN_ARGS...          one node
#   scripts/launch.sh -H HOSTFILE [--include S | --exclude S] [--num_nodes N] -- TRAIN_ARGS...
#                                                                  several nodes over pdsh (ssh), from node 0
#   scripts/launch.sh --no_ssh --nnodes N --node_rank R --master_addr A [--master_port P] [--num_gpus G] -- ...
#                                                                  run once on every node (SLURM, containers;
#                                                                  under srun R may be the word '$SLURM_NODEID')
#   scripts/launch.sh --torchrun [--nnodes N --node_rank R --master_addr A] [--num_gpus G] -- ...
#   --print-only (or --dry-run): print the command, write .deepspeed_env, start nothing.
#
# Signals: the first SIGTERM/SIGUSR1/SIGUSR2/SIGINT/SIGHUP (a closed terminal or ssh session) is passed to the training
# ranks as SIGUSR1 (save at the next step boundary, exit 75); a second SIGINT sends SIGTERM to the launcher and its
# ranks (SIGKILL 30 s later), a third SIGKILL. The launchers themselves run
# in their own process group with SIGUSR1 and SIGUSR2 ignored, because the deepspeed launcher has no handler for
# them (it would die of one and lose the exit code: `scancel --signal=USR2` without --batch sends it to every process
# of the job's steps under cgroup.conf SignalChildrenProcesses=yes) and answers SIGTERM/SIGINT by killing its children.
# Threads and cores: each rank gets OMP_NUM_THREADS = this node's CPUs (within a cgroup CPU quota) / its ranks (a value
# you set wins; pdsh nodes get node 0's number); on one node and with --no_ssh, where numactl is installed and no CPU
# quota applies, the deepspeed launcher also binds each rank to its own cores (--bind_cores_to_rank; it then sets
# OMP_NUM_THREADS per rank). BIND_CORES=0: off, 1: must.
# Environment overrides: DEEPSPEED, TORCHRUN (launcher executables), TRAIN_SCRIPT (default train.py),
# LAUNCH_EXPORT (extra variable names to write to .deepspeed_env), DS_ENV_FILE (that file; by default ./.deepspeed_env,
# under TMPDIR where this folder is read-only), BIND_CORES (auto | 0 | 1), STORE_START_S (node 0's
# store must answer within this, default 60), LAUNCH_LOST_FILE (node 0, after a lost node: its index is written here),
# LAUNCH_CRASH_FILE (after a crash: `first` if it began on this node, `own` if this node's ranks raised too, `died` if a
# rank here died of a signal without an exit of its own, `memlimit GIB LEVEL` if that was the OOM killer at a
# cgroup's memory limit: scripts/launch_crash.sh).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
EXIT_FAILED=1 EXIT_USAGE=2 EXIT_PEER_LOST=69 EXIT_PREEMPTED=75 EXIT_INTERRUPTED=130  # base/exits.py
TRAIN_SCRIPT=${TRAIN_SCRIPT:-$ROOT/train.py}
bin() { if [ -x "$ROOT/.venv/bin/$1" ]; then echo "$ROOT/.venv/bin/$1"; else echo "$1"; fi; }
DEEPSPEED=${DEEPSPEED:-$(bin deepspeed)}
TORCHRUN=${TORCHRUN:-$(bin torchrun)}
die() { echo "launch.sh: error: $*" >&2; exit "$EXIT_USAGE"; }
. "$ROOT/scripts/launch_crash.sh"  # this node's crash verdict (died_verdict, crash_verdict)
. "$ROOT/scripts/launch_env.sh"  # launch_id, default_port, *_refusal, remote_signal, shell_words, export_names
. "$ROOT/scripts/launch_hosts.sh"  # a hostfile's hosts and ranks after the filters (host_lines, active)
. "$ROOT/scripts/launch_signals.sh"  # a signal passed on to the ranks as a save request (on_signal)

# --- options ---
num_gpus="" hostfile="" include="" exclude="" num_nodes="" launcher="" no_ssh=0 torchrun=0
nnodes="" node_rank=0 master_addr="" master_port="" print_only=0 act="" force=""  # act: the hosts that run ranks
while [ $# -gt 0 ]; do
  case "$1" in --*=*) set -- "${1%%=*}" "${1#*=}" "${@:2}" ;; esac  # --num_gpus=2 as deepspeed takes it
  case "$1" in
    --num_gpus|--nproc_per_node) num_gpus=${2:?}; shift 2 ;;
    -H|--hostfile) hostfile=${2:?}; shift 2 ;;
    -i|--include) include=${2:?}; shift 2 ;;
    -e|--exclude) exclude=${2:?}; shift 2 ;;
    --num_nodes) num_nodes=${2:?}; shift 2 ;;
    --launcher) launcher=${2:?}; shift 2 ;;
    --no_ssh) no_ssh=1; shift ;;
    --torchrun) torchrun=1; shift ;;
    --nnodes) nnodes=${2:?}; shift 2 ;;
    --node_rank) node_rank=${2:?}; shift 2 ;;
    --master_addr) master_addr=${2:?}; shift 2 ;;
    --master_port) master_port=${2:?}; shift 2 ;;
    --print-only|--dry-run) print_only=1; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    --) shift; break ;;
    --ssh_port|--bind_cores_to_rank|--bind_core_list|--enable_each_rank_log|--no_local_rank|--force_multi|--save_pid)
      case "$1" in --ssh_port) eq="a Port line for the hosts in ~/.ssh/config" ;; --save_pid) eq="launch.sh's own pid" ;;
        --bind_core*) eq="BIND_CORES=1 (binds over this launch's CPUs: taskset -c LIST scripts/launch.sh ... picks them)" ;;
        --enable_each*) eq="each rank's OUTPUT_DIR/logs/rankN.log" ;; *) eq="nothing: launch.sh passes what it needs" ;; esac
      die "$1 is deepspeed's own option, not launch.sh's; instead: $eq" ;;
    *) die "unknown launch option $1 (train.py arguments go after --)" ;;
  esac
done
[ $# -gt 0 ] || die "no train.py arguments: scripts/launch.sh [OPTIONS] -- TRAIN_ARGS (see --help)"
# shellcheck disable=SC2016  # the word itself: `srun launch.sh --node_rank '$SLURM_NODEID'` (srun runs no shell)
[ "$node_rank" = '$SLURM_NODEID' ] && { node_rank=${SLURM_NODEID:-}; [ -n "$node_rank" ] ||
  die "--node_rank \$SLURM_NODEID outside an srun task (no SLURM_NODEID here): give this node's number"; }
[ -n "$include" ] && [ -n "$exclude" ] && die "--include and --exclude are mutually exclusive"
[ "$no_ssh" = 1 ] && [ "$torchrun" = 1 ] && die "--no_ssh is a deepspeed launcher mode; --torchrun is the other launcher"
[ -n "$hostfile" ] && [ ! -f "$hostfile" ] && die "hostfile $hostfile not found"
fix="use pdsh (the default), launch.sh --no_ssh on every node, or scripts/slurm.sbatch under SLURM"
case "${launcher,,}" in ""|pdsh) ;;
  mpich) die "--launcher mpich: deepspeed's launcher_helper.py drops each rank's exit code (75, 1, 2 all become 0): $fix" ;;
  impi|slurm) die "--launcher $launcher starts the ranks without --local_rank= on their command line, so a save" \
    "request (launch.sh's pkill -USR1 over pdsh) never reaches them: $fix" ;;
  openmpi|mvapich) die "--launcher $launcher starts the ranks without RANK, which train.py refuses: $fix" ;;
  *) die "--launcher $launcher is not a deepspeed launcher: $fix" ;;
esac
[ -n "$launcher" ] && { [ -z "$hostfile" ] || [ "$no_ssh" = 1 ] || [ "$torchrun" = 1 ]; } &&
  die "--launcher $launcher is deepspeed's multi-node runner, used with --hostfile only (it was dropped here: one" \
    "node, --no_ssh and --torchrun start the ranks themselves)"
[ "$torchrun" = 1 ] && [ -n "$hostfile$include$exclude$num_nodes" ] && die "torchrun takes no hostfile, --include," \
  "--exclude or --num_nodes: pick GPUs with CUDA_VISIBLE_DEVICES, nodes with --nnodes/--node_rank/--master_addr on each"
[ -n "$hostfile" ] && [ "$no_ssh" = 0 ] && [ -n "$nnodes" ] && [ -z "$num_nodes" ] && num_nodes=$nnodes  # pdsh's word
{ [ -n "$include" ] || [ -n "$exclude" ]; } && [ -n "$num_gpus$num_nodes" ] &&
  die "--num_gpus/--num_nodes cannot be combined with --include/--exclude (the deepspeed launcher refuses)"
[[ -z $num_gpus || $num_gpus =~ ^[1-9][0-9]*$ ]] || die "--num_gpus $num_gpus: a number of ranks >= 1 on this node"  # 0: all GPUs
if [ -n "$hostfile" ]; then
  act=$(host_lines | active "hostfile $hostfile") || die "$act"
  lines=$(wc -l <<< "$act")
  [ "$no_ssh" = 0 ] || [ -z "$nnodes" ] || [ "$nnodes" = "$lines" ] || die "--nnodes $nnodes but hostfile $hostfile has" \
    "$lines hosts${include:+ after --include}${exclude:+ after --exclude} (deepspeed starts one node per line): drop --nnodes"
  [ "$no_ssh" = 0 ] || nnodes=$lines  # --no_ssh with your hostfile: the lines left are the nodes
  # deepspeed runs ONE host's ranks on this machine whatever its name (a login node): one other host goes over pdsh
  [ "$lines" != 1 ] || { hostname; hostname -s; hostname -f; hostname -I | tr ' ' '\n'; echo localhost; echo 127.0.0.1; } \
    2>/dev/null | grep -qixF -f - <(echo "${act%% *}") || force=1  # by any of its names or addresses: this one
elif [ -n "$include$exclude" ] && [ "$no_ssh" = 1 ]; then
  die "--include/--exclude with --no_ssh name the hosts of your hostfile: give -H HOSTFILE"
elif [ "${num_nodes:-1}" != 1 ]; then
  die "--num_nodes $num_nodes needs -H HOSTFILE (its first N hosts; --no_ssh and --torchrun take --nnodes)"
elif [ "$no_ssh" = 0 ] && [ "$torchrun" = 0 ] && [ "${nnodes:-1}" != 1 ]; then
  die "--nnodes $nnodes needs -H HOSTFILE, --no_ssh or --torchrun"
fi
nnodes=${nnodes:-1}; [ -n "$hostfile" ] || num_nodes=""  # --num_nodes 1 on one node: what it runs anyway
# under an srun step of several tasks every task runs this script: one launcher per node, one world of them
# (--no_ssh or --torchrun with --nnodes the step's tasks), else N separate runs would write one output folder
tasks=${SLURM_STEP_NUM_TASKS:-1}
why=$(step_refusal) || die "$why"  # scripts/launch_env.sh: --nnodes and --node_rank against the srun step's
if [ "$tasks" -gt 1 ] 2>/dev/null && { [ "$no_ssh$torchrun" = 00 ] || [ "$nnodes" != "$tasks" ]; }; then
  die "this srun step runs $tasks copies of launch.sh: each would start a run of its own into one output folder; run one per node as one world (srun --ntasks-per-node=1 scripts/launch.sh --no_ssh --nnodes $tasks --node_rank \$SLURM_NODEID --master_addr NODE0 ...), or use scripts/slurm.sbatch"
fi
if [ "$no_ssh" = 1 ] || [ "$torchrun" = 1 ]; then
  [ "$node_rank" -ge 0 ] && [ "$node_rank" -lt "$nnodes" ] || die "--node_rank $node_rank is not in [0, $nnodes)${act:+ (the nodes: $(cut -d' ' -f1 <<< "$act" | paste -sd' '))}"
  [ "$nnodes" = 1 ] || [ -n "$master_addr" ] || die "--nnodes $nnodes needs --master_addr (node 0's address)"
  master_addr=${master_addr:-127.0.0.1}  # one node (deepspeed would ssh to the hostfile's first host to find it)
fi
one_node=0; [ -z "$hostfile" ] && [ "$nnodes" = 1 ] && one_node=1
[ -n "$master_port" ] || master_port=$(default_port "$one_node" "$(bin python)")  # scripts/launch_env.sh
separate=0; [ "$one_node$no_ssh$torchrun" != 000 ] && [ "$nnodes" -gt 1 ] && separate=1  # a launch.sh on every node
ULYSSES_LAUNCH_ID=$(launch_id "$separate"); export ULYSSES_LAUNCH_ID  # whose store (base/run_identity.py)

# --- environment: the accelerator, and what every node must see ---
# CUDA_VISIBLE_DEVICES hiding every GPU (-1, empty, Slurm's NoDevFiles): a CPU run whatever nvidia-smi lists, no ids
hidden=""; [ -n "${CUDA_VISIBLE_DEVICES+x}" ] && [[ $CUDA_VISIBLE_DEVICES =~ ^(-1|NoDevFiles)?$ ]] && hidden=1
visible=${CUDA_VISIBLE_DEVICES:-}; [ -z "$hidden" ] || visible=""
acc_given=${DS_ACCELERATOR:+1}; [ -n "$acc_given" ] || if [ -z "$hidden" ] && command -v nvidia-smi >/dev/null 2>&1 &&
  [[ $(nvidia-smi -L 2>/dev/null) == GPU* ]]; then export DS_ACCELERATOR=cuda; else export DS_ACCELERATOR=cpu; fi  # yours wins
num_gpus_given=${num_gpus:+1}
if [ -z "$num_gpus" ] && [ -z "$hostfile" ]; then
  if [ -n "$visible" ]; then
    num_gpus=$(tr ',' '\n' <<< "$visible" | grep -c .)
  elif [ "$DS_ACCELERATOR" = cuda ]; then
    num_gpus=$(nvidia-smi -L | grep -c '^GPU')
  else
    num_gpus=2  # on CPU each "GPU" is a process; the CPU recipes use SP=2
  fi
fi
if [ -z "$hostfile" ] && [ "$no_ssh$torchrun" = 00 ] && [ -n "$include$exclude" ]; then  # GPUs picked by id, one node
  [ "$DS_ACCELERATOR" = cuda ] || die "--include/--exclude pick GPUs (localhost:ID,...); on CPU a rank is a process: give --num_gpus N"
  [ -z "${CUDA_VISIBLE_DEVICES:-}" ] || die "CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES and --include/--exclude: the" \
    "deepspeed runner then drops CUDA_VISIBLE_DEVICES (the ids are the machine's): use one of the two"
  act=$(echo "localhost slots=$num_gpus" | active "this node (no -H)") || die "$act"
  num_gpus=""  # the runner gets the filter instead, and applies it to its pool: this node's devices
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# --- threads and cores per rank ---
# Ranks on this node: --num_gpus, else its ranks after your filters (--no_ssh: host node_rank of those left; pdsh
# nodes are alike: the first; one node: the GPUs picked), else 1.
ranks_here=${num_gpus:-$(sed -n "$((no_ssh ? node_rank + 1 : 1))p" <<< "$act" | cut -d' ' -f2)}
ranks_here=${ranks_here:-1}
if [ "$torchrun" = 0 ] && { [ -z "$hostfile" ] || [ "$no_ssh" = 1 ]; }; then  # pdsh nodes: their own variables
  fixed=0; [ "$DS_ACCELERATOR" = cuda ] && { [ -n "$num_gpus_given" ] || [ "$no_ssh" = 1 ]; } && fixed=1
  why=$(visible_refusal "$fixed" "$ranks_here" "$([ "$no_ssh" = 1 ] && echo --no_ssh || echo --num_gpus)") || die "$why"
fi
# the CPUs this launch may use (cpuset and CPU quota aware), those it may run on, the first as a list (launch_env.sh)
read -r cores affinity usable <<< "$(cpu_counts "$(bin python)")"
[ -n "${OMP_NUM_THREADS:-}" ] || export OMP_NUM_THREADS=$(( cores / ranks_here > 0 ? cores / ranks_here : 1 ))
bind=0
case "${BIND_CORES:-auto}" in
  0) ;;
  1|auto)
    # numactl -C per rank (the launcher's cores_per_rank = cores / ranks) where the ranks start from this launcher's
    # launch.py: torchrun has no such option, and deepspeed 0.19.8's pdsh runner does not pass the flag to the nodes
    if [ "$torchrun" = 1 ] || { [ -n "$hostfile" ] && [ "$no_ssh" = 0 ]; }; then
      [ "${BIND_CORES:-auto}" = 1 ] && die "BIND_CORES=1: only the local deepspeed launcher binds cores (one node, --no_ssh)"
    elif ! command -v numactl >/dev/null 2>&1; then
      [ "${BIND_CORES:-auto}" = 1 ] && die "BIND_CORES=1 needs numactl on every node (apt-get install numactl)"
    elif [ -n "${KMP_AFFINITY:-}" ]; then
      [ "${BIND_CORES:-auto}" = 1 ] && die "BIND_CORES=1: unset KMP_AFFINITY (it conflicts with numactl binding)"
    elif [ "$cores" -lt "$affinity" ] && [ "${BIND_CORES:-auto}" = auto ]; then  # a quota: time on any CPU, not cores
      echo "launch.sh: a CPU quota of $cores of $affinity CPUs: ranks not bound (BIND_CORES=1 binds them to $usable)" >&2
    elif [ "$cores" -ge "$ranks_here" ]; then
      bind=1
    elif [ "${BIND_CORES:-auto}" = 1 ]; then
      die "BIND_CORES=1: $ranks_here ranks but $cores CPUs here (one core per rank at least)"
    fi ;;
  *) die "BIND_CORES=$BIND_CORES: use auto, 0 or 1" ;;
esac
bind_args=()
if [ "$bind" = 1 ]; then
  bind_args=(--bind_cores_to_rank)
  # the CPUs `cores` counted (SLURM's cgroup, taskset): without a list the launcher deals out the machine's cores 0..N-1
  [ -n "$usable" ] && bind_args+=(--bind_core_list "$usable")
fi

why=$(pdsh_refusal "$(command -v "$(bin python)")" "$@") || die "$why"  # what pdsh's command line would change
exports=$(export_names) || die "$exports"  # LAUNCH_EXPORT's names (scripts/launch_env.sh)
write_env_file  # .deepspeed_env for deepspeed's runner; under TMPDIR where this folder is read-only (launch_env.sh)

# --- the command ---
mode=ds
if [ "$torchrun" = 1 ]; then
  mode=torchrun
  cmd=("$TORCHRUN" --nnodes "$nnodes" --nproc_per_node "$num_gpus" --node_rank "$node_rank"
       --master_addr "${master_addr:-127.0.0.1}" --master_port "$master_port" "$TRAIN_SCRIPT" "$@")
elif [ "$no_ssh" = 1 ]; then
  # The launcher sizes the world from a hostfile and takes this node's slice by --node_rank; without one
  # it ignores --master_addr (single-node path). The names are only keys, so write N identical nodes.
  if [ -z "$hostfile" ]; then
    hostfile=${TMPDIR:-/tmp}/ulysses_hostfile.$(id -u).${nnodes}x${num_gpus}
    tmp=$(mktemp "$hostfile.XXXXXX")
    for ((i = 0; i < nnodes; i++)); do echo "node$i slots=$num_gpus" >> "$tmp"; done
    mv -f "$tmp" "$hostfile"
  fi
  # with your hostfile's filters, which deepspeed applies before it takes this node's line
  cmd=("$DEEPSPEED" --hostfile "$hostfile" --no_ssh --node_rank "$node_rank" --master_addr "$master_addr"
       --master_port "$master_port" ${include:+--include "$include"} ${exclude:+--exclude "$exclude"}
       ${num_nodes:+--num_nodes "$num_nodes"} ${num_gpus_given:+--num_gpus "$num_gpus"} ${bind_args[@]+"${bind_args[@]}"} "$TRAIN_SCRIPT" "$@")
elif [ -n "$hostfile" ]; then
  mode=pdsh
  cmd=("$DEEPSPEED" --hostfile "$hostfile" ${include:+--include "$include"} ${exclude:+--exclude "$exclude"}
       ${num_nodes:+--num_nodes "$num_nodes"} ${num_gpus:+--num_gpus "$num_gpus"} ${launcher:+--launcher "$launcher"}
       ${force:+--force_multi} ${master_addr:+--master_addr "$master_addr"} --master_port "$master_port" "$TRAIN_SCRIPT" "$@")
elif [ -z "$num_gpus_given" ] && [ -n "$visible$include$exclude" ]; then
  # your GPUs: --include/--exclude as given; without --num_gpus the runner turns CUDA_VISIBLE_DEVICES into --include
  # localhost:<those ids> (with it, it would use devices 0..N-1 whatever was selected)
  cmd=("$DEEPSPEED" ${include:+--include "$include"} ${exclude:+--exclude "$exclude"} --master_port "$master_port"
       ${bind_args[@]+"${bind_args[@]}"} "$TRAIN_SCRIPT" "$@")
else
  cmd=("$DEEPSPEED" --num_gpus "$num_gpus" --master_port "$master_port" ${bind_args[@]+"${bind_args[@]}"} "$TRAIN_SCRIPT" "$@")
fi
shell_words "DS_ACCELERATOR=$DS_ACCELERATOR" "PYTHONPATH=$PYTHONPATH" "OMP_NUM_THREADS=$OMP_NUM_THREADS" \
  ${env_moved:+"DS_ENV_FILE=$DS_ENV_FILE"} "${cmd[@]}"
[ "$print_only" = 1 ] && exit 0

# --- run it, pass signals on as "save and exit" requests, return train.py's exit code ---
# (children, rank_pids, forward, hard_stop, on_signal: scripts/launch_signals.sh)
set +e  # from here on the exit code is train.py's, not the first failing helper's
launcher_pid="" pending=0 interrupts=0 signalled=0 killed=0
for s in TERM INT USR1 USR2 HUP; do trap "on_signal $s" "$s"; done
trap : PIPE  # after a hang-up a `| tee` is gone too: this script's own lines are lost, not the script (the default)

tee_pid="" death=""
if [ "$mode" = torchrun ]; then  # torchrun reports every failing worker as 1: keep its summary to read the codes
  stderr_copy=$(mktemp "${TMPDIR:-/tmp}/launch_torchrun.XXXXXX")
  exec 3> >(trap '' INT TERM USR1 USR2 HUP; exec tee -a "$stderr_copy" >&2)
  tee_pid=$!
else
  exec 3>&2
fi
# The launcher gets its own process group (a terminal's Ctrl-C reaches only this script) and ignores SIGUSR1 and
# SIGUSR2; the ranks inherit the "ignore" until train.py's first line records them (training/job.py; it stays pending
# here until then), and ranks started without it (ssh, slurmstepd) record them from that line too.
# several nodes started one by one (--no_ssh, as slurm.sbatch does): node 0's launcher hosts the job's store, so a
# node whose ranks die before they can speak (an import error) still ends every node: base/node_store.py
store_pid="" node_store=0
if [ "$no_ssh" = 1 ] && [ "$nnodes" -gt 1 ]; then
  node_store=1
  export TORCHELASTIC_USE_AGENT_STORE=True  # torch's rule: every rank a client of the store at MASTER_ADDR:PORT
  if [ "$node_rank" = 0 ]; then
    # The store must answer before this node's ranks start: a broken venv, torch or mount here (its Python exits at
    # once) or a port another job's store holds would otherwise leave every node waiting for a store that never
    # comes (or joined to a stranger's). Cost: node 0's ranks start after one torch import (seconds); every other
    # node's ranks wait for the store anyway.
    ready=$(mktemp -u "${TMPDIR:-/tmp}/launch_store.XXXXXX")
    ( trap '' INT TERM USR1 USR2 HUP; exec "$(bin python)" -m base.node_store serve "$master_addr" "$master_port" --ready "$ready" ) &
    store_pid=$!
    for ((i = 0; i < ${STORE_START_S:-60} * 5; i++)); do
      [ -f "$ready" ] && break
      kill -0 "$store_pid" 2>/dev/null || break
      sleep 0.2
    done
    if [ ! -f "$ready" ]; then
      kill -9 "$store_pid" 2>/dev/null
      wait "$store_pid" 2>/dev/null
      echo "launch.sh: error: node 0 ($(hostname)): the job's store did not start on $master_addr:$master_port within" \
        "${STORE_START_S:-60} s ($(bin python) -m base.node_store serve: its error is above; a broken venv, torch or" \
        "mount on this node, or the port taken): no rank started; every node ends (srun ends the step under SLURM)" >&2
      exit "$EXIT_FAILED"
    fi
    rm -f "$ready"
  fi
fi
# Every local rank records its exit code in $LAUNCH_EXIT_DIR (train.py): when SLURM signals every process of the
# job, the deepspeed launcher answers its own SIGTERM by killing the ranks' tree and exits 1 or 143 while
# the ranks, which saved and exited 75, report what really happened.
exit_dir=$(mktemp -d "${TMPDIR:-/tmp}/launch_exit.XXXXXX")
export LAUNCH_EXIT_DIR=$exit_dir
# The job's store may live in a launcher started here (torchrun's agent on node 0; node 0's base/node_store.py raises
# its own): 3 descriptors per rank, past a soft `ulimit -n` of 1024 near 330 ranks. Every process started from here
# gets the hard limit as its soft one before any rank connects (rank 0 also raises the agent's, base/comm.py, for a
# torchrun started another way, but only once it has arrived).
ulimit -Sn "$(ulimit -Hn)" 2>/dev/null || true
cg=$(cgroup_dir); read_ooms  # died_verdict's baselines (scripts/launch_crash.sh)
set -m
( trap - TERM INT; trap '' USR1 USR2; exec "${cmd[@]}" 2>&3 ) &
launcher_pid=$!
set +m

# early: a rank here was gone (reaped by its launcher) before any signal reached this script, for the crash verdict
# (scripts/launch_crash.sh). A node whose rank the OOM killer took is usually TERMed by srun before its launcher returns: the launcher
# waits for the other ranks there (deepspeed's launch.py gives them 30 s), while a healthy node's rank, its peer gone,
# raises and its node exits first. Slurm's own SIGKILL comes KillWait after its TERM, never before. One `kill -0` a
# rank a second; the process table is read only until every rank here has been seen.
known_ranks="" early=0 rc=""
while kill -0 "$launcher_pid" 2>/dev/null; do
  [ "$pending" = 1 ] && forward
  # a rank here gone before the signal, the OOM killer's count up (or a fault): the verdict now. Under Slurm's default
  # delivery the step's TERM reaches this script alone, the launcher goes on waiting 30 s for the rest here, and
  # Slurm's SIGKILL (KillWait after its TERM) came first: the healthy node that exited first was excluded
  [ "$signalled$early$died" = 110 ] && died_verdict
  if [ "$signalled" = 0 ]; then
    gone=0
    for p in $known_ranks; do alive "$p" || gone=1; done
    [ "$signalled$gone" = 01 ] && early=1  # a signal that came meanwhile may have ended it: not counted
    [ "$early" = 1 ] || read_ooms  # died_verdict's OOM baselines, every rank here alive
    [ "$(wc -w <<< "$known_ranks")" -ge "$ranks_here" ] ||
      known_ranks=$(printf '%s\n' $known_ranks $(rank_pids) | sort -un | paste -sd' ')
  fi
  sleep 1 &
  wait $!  # a trapped signal interrupts this; the loop then checks again
done
wait "$launcher_pid"  # bash kept the status of the reaped launcher
rc=$?
died_verdict  # before this node waits for its ranks: Slurm's SIGKILL, KillWait after its TERM, may end this script
case "$rc" in
  0|"$EXIT_USAGE"|"$EXIT_PREEMPTED") ;;
  *) # the launcher died of a signal before its ranks (SLURM signals every process): let them finish their save
    for p in $known_ranks; do  # not after a third SIGINT's SIGKILL
      for ((i = 0; i < ${RANK_EXIT_WAIT_S:-900}; i++)); do [ "$killed" = 0 ] && kill -0 "$p" 2>/dev/null || break; sleep 1; done
    done ;;
esac
exec 3>&-

if [ -n "$tee_pid" ]; then
  wait "$tee_pid"
  if [ "$rc" = 1 ]; then
    # a rank dead of SIGTERM (-15) had no handler yet: torchrun stopping the others after the first exit (a rank still
    # starting, seen under load), or Slurm's TERM at its start; it failed on nobody's account: the others' code stands
    codes=$(grep -oE 'exitcode +: -?[0-9]+' "$stderr_copy" | grep -oE -- '-?[0-9]+$' | grep -vx -- -15 | sort -u |
            paste -sd' ')
    # a rank dead of a signal (torchrun's "exitcode : -N"): its N, for the crash verdict below
    death=$(grep -oE 'exitcode +: -[0-9]+' "$stderr_copy" | grep -oE '[0-9]+$' | grep -vx 15 | head -n 1)
    if [ "$codes" = "$EXIT_PREEMPTED" ] || [ "$codes" = "$EXIT_PEER_LOST" ] || [ "$codes" = "$EXIT_INTERRUPTED" ]; then
      echo "launch.sh: torchrun exited 1 but every failed rank exited $codes (or died of SIGTERM): passing on $codes" >&2
      rc=$codes
    fi
  fi
  rm -f "$stderr_copy"
  died_verdict  # torchrun's summary named the signal
fi
recorded=$(cat "$exit_dir"/rank* 2>/dev/null | sort -u | paste -sd' ')
# Their code stands for the launcher's only when every rank here recorded one and none died: rank 1 done (0) and rank 0
# SIGKILLed in its final export or W&B close was a 0 without COMPLETE (slurm.sbatch: failed, not requeued; on several
# nodes the 'died' verdict's requeue without this node lost). The RANKs here follow the nodes before this one (their
# slots after your filters under --no_ssh with a hostfile, else ranks_here each).
first=0 silent="" wrote=0; for f in "$exit_dir"/rank*; do [[ ${f##*/} =~ ^rank[0-9]+$ ]] && wrote=$((wrote + 1)); done
if [ "$no_ssh" = 1 ] && [ -n "$act" ]; then first=$(head -n "$node_rank" <<< "$act" | awk '{s += $2} END {print s + 0}')
elif [ "$no_ssh$torchrun" != 00 ]; then first=$((node_rank * ranks_here)); fi
for ((r = first; r < first + ranks_here; r++)); do [ -f "$exit_dir/rank$r" ] || silent+=" $r"; done
# what the ranks here learned of the job's store as they left (base/watch_io.py tell_launcher): the reason on record
# (node 0 may have ended since, once every rank had read it), or that it was unreachable
known=$(sed -n 's/^abort //p' "$exit_dir"/store* 2>/dev/null | head -n 1)
store_gone=0; grep -qx gone "$exit_dir"/store* 2>/dev/null && store_gone=1
rm -rf "$exit_dir" ${env_moved:+"$env_file"}
case "$rc" in
  0|"$EXIT_USAGE"|"$EXIT_PREEMPTED"|"$EXIT_PEER_LOST"|"$EXIT_INTERRUPTED") ;;  # 69: a watcher lost a peer (no record)
  *) if [ "$recorded" != "$EXIT_PREEMPTED" ] && [ "$recorded" != 0 ] && [ "$recorded" != "$EXIT_INTERRUPTED" ]; then :
     elif [ "$wrote" -lt "$ranks_here" ] || [ "$died" = 1 ]; then
       echo "launch.sh: the launcher exited $rc and rank${silent:-s ?} here recorded no exit (killed before its own;" \
         "the others exited $recorded): passing on $rc" >&2
     else
       echo "launch.sh: the launcher exited $rc but every rank here exited $recorded: passing on $recorded" >&2
       rc=$recorded
     fi ;;
esac
origin=""  # the node where the job's first failure on record (in its store) happened
if [ "$node_store" = 1 ]; then
  case "$rc" in
    0|"$EXIT_PREEMPTED") ;;
    *) # a rank's own reason, posted earlier, stays the job's reason; this one reaches the ranks that had none
      wait_arg=()
      # node 0 holds the store: keep it until the live nodes' ranks have read the reason (a rank whose heartbeat has
      # stopped has left), and name the nodes found lost where slurm.sbatch reads them
      [ "$node_rank" = 0 ] && wait_arg=(--wait ${LAUNCH_LOST_FILE:+--lost-file "$LAUNCH_LOST_FILE"})
      said=$(mktemp "${TMPDIR:-/tmp}/launch_post.XXXXXX")
      post_rc=0
      if [ "$node_rank" != 0 ] && [ -z "$known" ] && [ "$store_gone" = 1 ]; then
        echo "node_store: not posted: the job's store is gone (a rank here found it unreachable)" > "$said"
      else
        # signals ignored from its start (Slurm's SIGTERM to the step would otherwise end it while it imports torch)
        ( trap '' TERM INT USR1 USR2 HUP; exec "$(bin python)" -m base.node_store post "$master_addr" "$master_port" \
          "$rc" "node $node_rank: its ranks exited $rc (that node's log has the cause)" --node "$node_rank" \
          --nnodes "$nnodes" --ranks-per-node "$ranks_here" ${known:+--known="$known"} \
          ${wait_arg[@]+"${wait_arg[@]}"} ) 2> "$said"
        post_rc=$?
      fi
      cat "$said" >&2
      # "rank R failed: ..." (a rank's own exception, training/job.py) or "node K: its ranks exited C" (a launcher's)
      first=$(sed -n 's/^node_store: abort on record: //p' "$said" | head -n 1)
      rm -f "$said"
      if [[ $first =~ ^rank\ ([0-9]+)\ failed: ]]; then origin=$((BASH_REMATCH[1] / ranks_here))
      elif [[ $first =~ ^node\ ([0-9]+):\ its\ ranks\ exited ]]; then origin=${BASH_REMATCH[1]}
      fi
      if [ "$post_rc" = "$EXIT_PEER_LOST" ] && [ "$rc" != "$EXIT_PEER_LOST" ]; then  # node 0 found a node lost: its cause
        echo "launch.sh: the ranks here exited $rc after a node was lost: passing on $EXIT_PEER_LOST" >&2
        rc=$EXIT_PEER_LOST
      fi ;;
  esac
  if [ -n "$store_pid" ]; then kill -9 "$store_pid" 2>/dev/null; wait "$store_pid" 2>/dev/null; fi
fi
crash_verdict  # scripts/launch_crash.sh
echo "launch.sh: training exited with $rc" >&2
exit "$rc"
