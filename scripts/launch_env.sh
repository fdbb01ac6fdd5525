# shellcheck shell=bash
# Sourced by scripts/launch.sh: the run's id, its default port, the GPUs a deepspeed launch would really use, and the
# command that signals this launch's ranks over pdsh.
# launch_id and default_port read launch.sh's nnodes (and launch_id its master_port), step_refusal its options.

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
remote_signal() {
  local q="'" id="ULYSSES_LAUNCH_ID=$ULYSSES_LAUNCH_ID"
  echo "for p in \$(pgrep -f '$TRAIN_SCRIPT --local_rank=[0-9]'); do tr '\\0' '\\n' < /proc/\$p/environ 2>/dev/null |" \
    "grep -qxF '${id//$q/$q\\$q$q}' && kill -$1 \$p; done; true"
}
