# shellcheck shell=bash
# Sourced by scripts/launch.sh: the run's id, its default port, and the GPUs a deepspeed launch would really use.

# launch_id SEPARATE: ULYSSES_LAUNCH_ID, which every rank of this launch shares and no other launch has
# (base/run_identity.py: another run's rank on this run's store refuses it). One launcher for the whole run (one node,
# pdsh: .deepspeed_env carries it): its own host, pid and clock. Several nodes each running launch.sh (--no_ssh,
# --torchrun; SEPARATE=1): what they share, alike on every node: the node count and the srun step (SLURM_JOB_ID and
# SLURM_STEP_ID, set together only inside a step); a value you export (the same on every node) is kept in front. Not
# the train.py arguments: a node may be given a path of its own (tests/e2e/test_failure.py gives one node a missing
# tokenizer), and two such launches outside Slurm on one port and node count stay alike (export ULYSSES_LAUNCH_ID).
launch_id() {
  local step=""
  if [ "$1" = 1 ]; then
    [ -n "${SLURM_JOB_ID:-}" ] && [ -n "${SLURM_STEP_ID:-}" ] && step=" step $SLURM_JOB_ID.$SLURM_STEP_ID"
    echo "${ULYSSES_LAUNCH_ID:+$ULYSSES_LAUNCH_ID, }$nnodes nodes$step"
  else
    echo "${ULYSSES_LAUNCH_ID:+$ULYSSES_LAUNCH_ID, }$(hostname -s 2>/dev/null) $$ $(date +%s%N)"
  fi
}

# default_port ONE_NODE PYTHON: --master_port when none is given. One node (the store is here): a port free now,
# found by binding (deepspeed's 29500 had two runs on a shared node join one store). Several nodes must agree
# without talking: inside an srun step the step's own port (base/slurm_env.job_port), else deepspeed's 29500.
default_port() {
  if [ "$1" = 1 ]; then
    "$2" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'
  elif [[ ${SLURM_JOB_ID:-} =~ ^[0-9]+$ && ${SLURM_STEP_ID:-} =~ ^[0-9]+$ ]]; then
    echo $((20000 + (7 * SLURM_JOB_ID + SLURM_STEP_ID) % 10000))
  else
    echo 29500
  fi
}

# visible_refusal FIXED RANKS WHY: one line when CUDA_VISIBLE_DEVICES is not what a deepspeed launch runs on (nothing
# when it is, or unset). deepspeed's runner parses it as indices (a GPU-/MIG- UUID, as Slurm writes MIG devices and
# gres.conf Flags=env_uuid full GPUs, was its ValueError traceback). FIXED=1 (--num_gpus on one node, --no_ssh): the
# runner drops it and launch.py sets CUDA_VISIBLE_DEVICES=0..RANKS-1, so the selection must begin with 0..RANKS-1 (a
# --gres job given GPUs 4-7 without ConstrainDevices trained on another job's 0-3); WHY names the option.
visible_refusal() {
  local cvd=${CUDA_VISIBLE_DEVICES:-} i ids
  [ -n "$cvd" ] || return 0
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
