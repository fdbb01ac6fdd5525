# shellcheck shell=bash
# Sourced by scripts/launch.sh: the run's id, its default port, the GPUs a deepspeed launch would really use, the
# command that signals this launch's ranks over pdsh, what pdsh's one command line would change (quoting), the CPUs
# this launch may use and the .deepspeed_env it writes. launch_id and default_port read launch.sh's nnodes (and
# launch_id its master_port), step_refusal, over_pdsh and write_env_file its options (write_env_file also exports,
# acc_given, and calls its die).

# whole_step: true when this launch.sh is one task of an srun step that is the whole launch: the step spans the
# launch's nodes with one task each (SLURM_STEP_NUM_NODES = SLURM_STEP_NUM_TASKS = nnodes), so every node sees the same
# SLURM_STEP_ID. Not with one srun per node (`srun -N1 -w nodeK scripts/launch.sh ... --node_rank K`: each its own
# step), node 0 in the batch shell (Slurm's batch step has a SLURM_STEP_ID of its own but no SLURM_STEP_NUM_NODES:
# slurmstepd's exec_task/setup_env set the id for every task, srun's env_array_for_step the counts), nor an
# interactive `srun -N2 --pty bash` (one task).
whole_step() {
  [[ ${SLURM_JOB_ID:-} =~ ^[0-9]+$ && ${SLURM_STEP_ID:-} =~ ^[0-9]+$ ]] && [ -n "${nnodes:-}" ] &&
    [ "${SLURM_STEP_NUM_NODES:-}" = "$nnodes" ] && [ "${SLURM_STEP_NUM_TASKS:-}" = "$nnodes" ]
}

# step_refusal: one line when this launch.sh is one task a node of an srun step (--no_ssh, --torchrun; the step's tasks
# = its nodes > 1) and --nnodes or --node_rank is not the step's. `srun scripts/launch.sh --no_ssh --nnodes N
# --node_rank $SLURM_NODEID ...` in a batch script expands $SLURM_NODEID in the batch shell (0): every node ran node 0's
# ranks, RANK 0..G-1 claimed N times on node 0's store, a 300 s wait, then every rank's 69 naming the other nodes lost
# (a requeue without a healthy node). Not one srun per node (`srun -N1 -w nodeK ... --node_rank K`: one task, one node).
step_refusal() {
  local nodes=${SLURM_STEP_NUM_NODES:-} also="(or use scripts/slurm.sbatch)"
  [ "$no_ssh$torchrun" != 00 ] && [[ ${SLURM_STEP_ID:-} =~ ^[0-9]+$ && $nodes =~ ^[0-9]+$ ]] && [ "$nodes" -gt 1 ] &&
    [ "${SLURM_STEP_NUM_TASKS:-}" = "$nodes" ] || return 0
  if [ "$nnodes" != "$nodes" ]; then
    echo "--nnodes $nnodes but this srun step runs on $nodes nodes, one launch.sh each (SLURM_STEP_NUM_NODES): give" \
      "--nnodes $nodes, or srun --nodes $nnodes $also"
    return 1
  fi
  if [[ ${SLURM_NODEID:-} =~ ^[0-9]+$ ]] && [ "$node_rank" != "$SLURM_NODEID" ]; then
    echo "--node_rank $node_rank but this is node $SLURM_NODEID of the srun step (SLURM_NODEID): the batch shell" \
      "expanded \$SLURM_NODEID; write \\\$SLURM_NODEID or single-quote it $also"
    return 1
  fi
}

# launch_id SEPARATE: ULYSSES_LAUNCH_ID, which every rank of this launch shares and no other launch has
# (base/run_identity.py: another run's rank on this run's store refuses it). One launcher for the whole run (one node,
# pdsh: .deepspeed_env carries it): its own host, pid and clock. Several nodes each running launch.sh (--no_ssh,
# --torchrun; SEPARATE=1): what they share, alike on every node, however each was started: the node count, and the
# srun step (job.step) when one step is the whole launch (whole_step), else the store's port (every node of one launch
# dials the same one; the default is the job's own, default_port). Not the job id then: a node started over ssh has no
# Slurm variables, and node 0 in the batch shell would differ from the others. Not the master address: one host has
# several spellings (node01, node01.cluster, an IP) that nodes may be given. Not the train.py arguments: a node may be
# given a path of its own (tests/e2e/test_failure.py gives one node a missing tokenizer). A value you export (the same
# on every node) is kept in front. So two such launches on one port with one node count, not each one srun step (two
# jobs given one --master_port on a shared node 0, or outside Slurm), look alike: export a distinct ULYSSES_LAUNCH_ID.
launch_id() {
  if [ "$1" = 1 ]; then
    local shared
    if whole_step; then shared="step $SLURM_JOB_ID.$SLURM_STEP_ID"; else shared="port ${master_port:-}"; fi
    echo "${ULYSSES_LAUNCH_ID:+$ULYSSES_LAUNCH_ID, }$nnodes nodes $shared"
  else
    echo "${ULYSSES_LAUNCH_ID:+$ULYSSES_LAUNCH_ID, }$(hostname -s 2>/dev/null) $$ $(date +%s%N)"
  fi
}

# default_port ONE_NODE PYTHON: --master_port when none is given. One node (the store is here): a port free now,
# found by binding (deepspeed's 29500 had two runs on a shared node join one store), from a random start in
# 10000-19999: below the node's ephemeral range (ip_local_port_range, 32768-60999 by default: an outgoing connection
# can take a port there between this probe and rank 0's bind; the kernel's pick when the range starts below 10000),
# below srun steps' ports (20000-29999, base/slurm_env.job_port) and Kubernetes' NodePorts (30000-32767: kube-proxy
# redirects a local connection to one, hostNetwork pods). Several nodes must agree without
# talking: the srun step's port (base/slurm_env.job_port) when one step is the whole launch (whole_step), else the
# job's (step 0's formula, slurm.sbatch's too), else deepspeed's 29500 (outside Slurm, or nodes started over ssh).
default_port() {
  if [ "$1" = 1 ]; then
    "$2" - <<'PY'
import random, socket
try:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
except (OSError, ValueError, IndexError):
    low = 32768
ports = list(range(10000, min(20000, low)))
start = random.randrange(len(ports)) if ports else 0
for p in ports[start:] + ports[:start] + [0]:  # 0: the kernel's pick, when none is free below the range
    with socket.socket() as s:
        try:
            s.bind(("", p))
        except OSError:
            continue
        print(s.getsockname()[1])
        break
PY
  elif [[ ${SLURM_JOB_ID:-} =~ ^[0-9]+$ ]]; then
    local step=0
    whole_step && step=$SLURM_STEP_ID
    echo $((20000 + (7 * SLURM_JOB_ID + step) % 10000))
  else
    echo 29500
  fi
}

# visible_refusal FIXED RANKS WHY: one line when CUDA_VISIBLE_DEVICES is not what a deepspeed launch runs on (nothing
# when it is, or unset). deepspeed's runner parses it as indices (a GPU-/MIG- UUID, as Slurm writes MIG devices and
# gres.conf Flags=env_uuid full GPUs, was its ValueError traceback). FIXED=1 (--num_gpus on one node, --no_ssh): the
# runner drops it and launch.py sets CUDA_VISIBLE_DEVICES=0..RANKS-1, so the selection must begin with 0..RANKS-1 (a
# --gres job given GPUs 4-7 without ConstrainDevices trained on another job's 0-3); WHY names the option. Nothing on a
# launch that is not on CUDA GPUs (launch.sh's DS_ACCELERATOR: yours, or cpu when nvidia-smi lists no GPU), and
# unset, empty or -1 ("no device", as CPU runs set it) is no selection: `CUDA_VISIBLE_DEVICES=-1 DS_ACCELERATOR=cpu
# launch.sh --num_gpus 2` runs 2 CPU ranks (deepspeed's runner drops the variable under --num_gpus).
visible_refusal() {
  local cvd=${CUDA_VISIBLE_DEVICES:-} i ids
  [ "${DS_ACCELERATOR:-cuda}" = cuda ] || return 0
  [ -n "$cvd" ] && [ "$cvd" != -1 ] || return 0
  IFS=, read -ra ids <<< "$cvd"
  for i in "${ids[@]}"; do
    [[ $i =~ ^[0-9]+$ ]] || { echo "CUDA_VISIBLE_DEVICES=$cvd names a device by UUID ($i): the deepspeed launcher" \
      "takes indices only: give indices, or use scripts/launch.sh --torchrun or srun python train.py (they keep it)"
      return 1; }
  done
  [ "$1" = 1 ] || return 0
  for ((i = 0; i < $2; i++)); do
    [ "${ids[i]:-}" = "$i" ] || { echo "CUDA_VISIBLE_DEVICES=$cvd but $3 runs this node's $2 ranks on devices" \
      "0-$(($2 - 1)) (deepspeed's launcher sets CUDA_VISIBLE_DEVICES itself): $([ "$3" = --no_ssh ] &&
      echo "unset it, or use --torchrun or srun python train.py (they keep it)" ||
      echo "drop --num_gpus (launch.sh then runs on the GPUs selected) or unset it")"; return 1; }
  done
}

# remote_signal SIG: the command pdsh runs on the nodes to send SIG to this launch's ranks only: a process whose command
# line is a rank's ('[0-9]' keeps the remote shell that runs it from matching its own) AND whose environment holds
# this launch's ULYSSES_LAUNCH_ID (.deepspeed_env exports it to them). A bare `pkill -f '<train.py> --local_rank=...'`
# signalled every run of the same checkout on those hosts, and deepspeed's own kill command (its runner's SIGTERM/
# SIGINT handler) every deepspeed launch of the venv there. Cost: one read of /proc/PID/environ per matching process.
# pgrep -f reads an extended regex: the script's path with the metacharacters that would miss it escaped (a checkout
# in c++/ matched no rank, and no save request reached one; a `.` also matches itself), then in '...' for the nodes'
# shell (a ' in the path broke the command).
remote_signal() {
  local q="'" id="ULYSSES_LAUNCH_ID=$ULYSSES_LAUNCH_ID" re
  re=$(printf '%s\n' "$TRAIN_SCRIPT" | sed 's/[][\^$*+?(){}|]/\\&/g')
  echo "for p in \$(pgrep -f '${re//$q/$q\\$q$q} --local_rank=[0-9]'); do tr '\\0' '\\n' < /proc/\$p/environ 2>/dev/null |" \
    "grep -qxF '${id//$q/$q\\$q$q}' && kill -$1 \$p; done; true"
}
signal_nodes() {  # SIG to this launch's ranks on the hosts pdsh runs them on ($act: "HOST RANKS" a line)
  pdsh -w "$(cut -d' ' -f1 <<< "$act" | paste -sd,)" "$(remote_signal "$1")" >&2 || true
}

shell_words() {  # the arguments as one line a shell reads back the same (quotes only where needed)
  local a words=() safe='^[A-Za-z0-9_@%+=:,./-]+$' q="'"
  for a in "$@"; do
    if [[ $a =~ $safe ]]; then words+=("$a"); else words+=("'${a//$q/$q\\$q$q}'"); fi
  done
  echo "${words[*]}"
}

# export_names: LAUNCH_EXPORT's names, blanks or commas between them, one space between them on output; one line when
# one is not a variable name (`A,B` was bash's "invalid variable name" after .deepspeed_env.XXXXXX was made, `*` a glob)
export_names() {
  local n names=() out=()
  IFS=$' \t\n,' read -r -d '' -a names <<< "${LAUNCH_EXPORT:-}" || true  # read -a: words, never globbed
  for n in ${names[@]+"${names[@]}"}; do
    [[ $n =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] || { echo "LAUNCH_EXPORT ${LAUNCH_EXPORT@Q}: ${n@Q}" \
      "is not a variable name: list the names of exported variables, blanks or commas between them (export FOO=bar;" \
      "LAUNCH_EXPORT=FOO)"; return 1; }
    out+=("$n")
  done
  echo "${out[*]}"
}

# --- what deepspeed's pdsh runner changes ---
# deepspeed 0.19.8's pdsh runner (multinode_runner.py) gives the nodes ONE shell command line: `export K=V; ...` from
# .deepspeed_env (add_export, lines 37-41: V in "..." when it has a character outside [\w@%+=:,./-], nothing escaped),
# then `cd <this directory>; <python> -u -m deepspeed.launcher.launch ... <TRAIN_SCRIPT> <train.py arguments>` with the
# directory, the python and the script as they are (lines 109, 129), each argument as it is or, when it has a space, in
# "..." with its " escaped (parse_user_args, lines 73-83); pdsh replaces %h %u %n %% in it (src/common/pipecmd.c). What
# that shell reads otherwise reached the ranks changed without a word: `/data/R&D/x.jsonl` put the ranks in the
# background with `--dataset_path /data/R` (the flags after it lost), "$HOME/`id`" ran `id`, `a\b` became `ab`, a
# `{"a":1}` lost its quotes, `cd /tmp/My Project` failed and every rank ran in $HOME. What it keeps is let through:
# "..." holds quotes, blanks, braces, globs and ;&|<>(); letters of any script (UTF-8) and ! ^ ] } # ~ hold bare (a
# leading ~ is the node's $HOME, as train.py's own expanduser reads it). No .deepspeed_env value is shown (a key).

pdsh_fix="or run launch.sh --no_ssh on each node, or use scripts/slurm.sbatch (neither goes through pdsh)"
# over_pdsh: true when this launch's ranks start over pdsh (a hostfile without --no_ssh/--torchrun, and several hosts
# or another host alone: deepspeed's multi_node_exec; one host that is this machine runs locally, runner.py line 537)
over_pdsh() {
  [ -n "${hostfile:-}" ] && [ "${no_ssh:-0}${torchrun:-0}" = 00 ] && { [ "${lines:-1}" != 1 ] || [ -n "${force:-}" ]; }
}

# pdsh_bare WORD: why WORD, placed bare in that command line, does not reach the nodes as it is (nothing when it does)
pdsh_bare() {
  local LC_ALL=C
  case $1 in
    "") echo "an empty argument vanishes there" ;;
    *%[hun%]*) echo "pdsh replaces %h, %u, %n and %% in it" ;;
    *[[:space:][:cntrl:]]*) echo "a blank, tab or line break splits it there" ;;
    *[\'\"\$\`\\\;\&\|\<\>\(\)\*\?\[]* | \#* | *\{*,*\}* | *\{*..*\}*)
      echo "the shell there reads its quote, \$, \`, \\, ;&|<>(), glob, brace or leading # characters" ;;
  esac
}

# pdsh_quoted TEXT [ESCAPED [PERCENT]]: why TEXT, placed in "..." there, does not reach the nodes as it is; ESCAPED=1:
# its " are escaped (an argument), else they end the quotes (a .deepspeed_env value); PERCENT=1: pdsh's %h %u %n %% are
# meant (a value's NCCL_DEBUG_FILE=/tmp/nccl.%h.%p.log: the node's host, as NCCL's own %h)
pdsh_quoted() {
  local LC_ALL=C nl=$'\n'
  [[ ${3:-0} = 1 || $1 != *%[hun%]* ]] || { echo "pdsh replaces %h, %u, %n and %% in it"; return; }
  case $1 in
    *[\$\`]* | *\\ | *\\[\$\`\"\\$nl]*) echo "\$, \` and \\ expand inside the \"...\" the runner puts around it" ;;
    *\"*) [ "${2:-0}" = 1 ] || echo "the runner puts it in \"...\" without escaping its \"" ;;
    *$'\r'*) echo "a carriage return ends its line in .deepspeed_env" ;;
  esac
}

# pdsh_refusal PYTHON ARGS: one line when the ranks start over pdsh (over_pdsh) and the working directory, TRAIN_SCRIPT,
# PYTHON (the runner's, bare in the command) or a train.py argument would not reach the nodes as it is
pdsh_refusal() {
  local a why i names=("the working directory" TRAIN_SCRIPT "the python")
  over_pdsh || return 0
  set -- "$(pwd -P)" "$TRAIN_SCRIPT" "$@"
  for i in 0 1 2; do
    a=$1; shift; why=""
    [ -n "$a" ] && why=$(pdsh_bare "$a")  # (no python found: the runner's own, not judged)
    [ -z "$why" ] && continue
    echo "${names[i]} ${a@Q} goes bare into the nodes' command line over pdsh (deepspeed's runner: \`cd <dir>;" \
      "<python> ... <TRAIN_SCRIPT>\`) and $why$([ "$i" = 0 ] && echo " (every rank ran in \$HOME)"): use a path of" \
      "letters, digits and _@%+=:,./~- only, $pdsh_fix"
    return 1
  done
  for a in "$@"; do
    if [[ $a == *" "* ]]; then why=$(pdsh_quoted "$a" 1); else why=$(pdsh_bare "$a"); fi
    [ -z "$why" ] && continue
    echo "train.py argument ${a@Q} does not reach the nodes as it is over pdsh (deepspeed's runner passes it to their" \
      "shell bare, or in \"...\" when it has a space): $why: put the value in the --config YAML, $pdsh_fix"
    return 1
  done
}

# env_refusal NAMES: one line when the ranks start over pdsh (over_pdsh) and the value launch.sh writes to .deepspeed_env
# for one of these variables of this environment would not reach them as it is (the value not shown: it may be a key;
# a multi-line one is not written). Lines of your own in the file are passed as written: a $X there expands on the
# node, as you may mean it.
env_refusal() {
  local v why
  over_pdsh || return 0
  for v in "$@"; do
    why=$(pdsh_quoted "${!v-}" 0 1)
    [ -z "$why" ] || [[ ${!v-} == *$'\n'* ]] && continue
    echo "$v (this environment's, for .deepspeed_env) does not reach the nodes as it is over pdsh (deepspeed's runner" \
      "exports it as $v=\"<value>\"): $why: drop those characters from it, or unset it, $pdsh_fix"
    return 1
  done
}

# cpu_counts PYTHON: "USABLE AFFINITY LIST": the CPUs this launch may use (base/host.py usable_cpus: its affinity capped
# at its cgroup's CPU quota, `docker --cpus` / Kubernetes' CPU limit: `nproc` (coreutils 9.1) counts the affinity
# alone, and a 128-core node's pod limited to 8 CPUs gave 8 ranks 16 OpenMP threads each), its affinity's count, and the
# usable ones as a list (0-7: the first of the affinity stand for a quota). Where that python cannot run: nproc's count
# twice and Cpus_allowed_list. One python start (~0.1 s).
cpu_counts() {
  "$1" -c 'import os; from base.host import cpu_ranges, usable_cpus; u = usable_cpus()
print(len(u), len(os.sched_getaffinity(0)), cpu_ranges(u))' 2>/dev/null && return 0
  local n
  n=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
  echo "$n $n $(awk '/^Cpus_allowed_list:/ {print $2}' /proc/self/status 2>/dev/null)"
}

# write_env_file: the file deepspeed's runner reads where it starts the ranks over pdsh (runner.py
# DEEPSPEED_ENVIRONMENT_PATHS: ~ then the working folder, each joined with DS_ENV_FILE, default .deepspeed_env) and
# exports every KEY=VALUE line of on each node (lines 604-611: into one dict, a later file's key wins). Written
# atomically: --no_ssh launchers may share this directory. A file of your own keeps its other lines
# (LD_LIBRARY_PATH=...): the names in `ours` (and LAUNCH_EXPORT's) are this environment's, set or unset (a value there
# may be an earlier launch's); deepspeed reads every line as KEY=VALUE, so lines without one are dropped. A working
# folder that cannot be written (a read-only image or checkout: mktemp's bare error, exit 1, before): a file of this
# launch's under TMPDIR, given to the runner as an absolute DS_ENV_FILE (os.path.join(~, an absolute path) is that
# path, so it is then the only file read), said in one line and removed at the end (env_moved). Your lines are carried
# into it as the runner would have merged them from a writable folder: ~/.deepspeed_env's whole but the names this
# launch writes (it never writes that file: a home NCCL_SOCKET_IFNAME=ib0 with none set here was dropped, a remote
# node's NCCL on the wrong interface), then ./.deepspeed_env's as its rewrite would keep them, then this launch's.
# Sets env_file; dies (launch.sh's die) where nothing can be written.
write_env_file() {
  local tmp line key v val names f home="" own=() mine=() written=" "
  env_file=${DS_ENV_FILE:-.deepspeed_env} env_moved=""
  if tmp=$(mktemp "$env_file.XXXXXX" 2>/dev/null); then
    own=("$env_file")
  else
    [ -z "${DS_ENV_FILE:-}" ] || die "DS_ENV_FILE=$DS_ENV_FILE: cannot write beside it (mktemp $env_file.XXXXXX):" \
      "name a file in a writable folder"
    tmp=$(mktemp "${TMPDIR:-/tmp}/deepspeed_env.XXXXXX" 2>/dev/null) || die "cannot write .deepspeed_env in $(pwd)" \
      "nor in ${TMPDIR:-/tmp}: cd to a writable folder, or set TMPDIR or DS_ENV_FILE to a path in one"
    home=${HOME:-/nonexistent}/.deepspeed_env
    [ .deepspeed_env -ef "$home" ] && home=""  # the working folder is ~: the file a writable one would rewrite
    own=(${home:+"$home"} .deepspeed_env)  # the runner's two, in its order
    env_file=$tmp env_moved=1
    export DS_ENV_FILE=$tmp
    echo "launch.sh: $(pwd) is not writable: .deepspeed_env written to $tmp (DS_ENV_FILE for deepspeed's runner)" >&2
  fi
  # The interface variables ride along (GLOO_/NCCL_SOCKET_IFNAME, NCCL_IB_HCA, FI_* of libfabric/EFA, UCX_*): without
  # them a remote node's gloo group binds what its hostname resolves to
  ours='^(NCCL_|GLOO_|FI_|UCX_|WANDB_|HF_|TRANSFORMERS_|TORCH_NCCL_)|^(PYTHONPATH|DS_ACCELERATOR|OMP_NUM_THREADS|PYTORCH_CUDA_ALLOC_CONF|CUDA_HOME|SLURM_JOB_END_TIME|SLURM_JOB_START_TIME|TORCH_EXTENSIONS_DIR|ULYSSES_LAUNCH_ID)$'
  names=$(compgen -e | grep -E "$ours" || true)
  for v in $names $exports; do
    # deepspeed over pdsh from a login node without GPUs: its `cpu` would make every GPU node train on CPU
    [ "$v" = DS_ACCELERATOR ] && [ -z "$acc_given" ] && [ -n "$hostfile" ] && [ "$no_ssh$torchrun" = 00 ] && continue
    [ "$v" = ULYSSES_LAUNCH_ID ] && { [ -z "$hostfile" ] || [ "$no_ssh$torchrun" != 00 ]; } && continue  # pdsh's only
    val=${!v-}
    case "$val" in *$'\n'*) echo "launch.sh: not exporting $v (multi-line value)" >&2; continue ;; esac
    mine+=("$v=$val") written+="$v "
  done
  for f in "${own[@]}"; do
    [ -f "$f" ] || continue
    while IFS= read -r line || [ -n "$line" ]; do
      key=${line%%=*}
      [ "$key" != "$line" ] && [ -n "$key" ] || continue
      case "$written" in *" $key "*) continue ;; esac
      [ "$f" != "$home" ] && { grep -qE "$ours" <<< "$key" || [[ " $exports " == *" $key "* ]]; } && continue
      printf '%s\n' "$line" >> "$tmp"
    done < "$f"
  done
  [ "${#mine[@]}" = 0 ] || printf '%s\n' "${mine[@]}" >> "$tmp"
  # shellcheck disable=SC2086  # one name per word
  why=$(env_refusal $names $exports) || { rm -f "$tmp"; die "$why"; }  # values pdsh's command line would change
  [ -n "$env_moved" ] || mv -f "$tmp" "$env_file"
}
