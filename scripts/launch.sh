#!/usr/bin/env bash
# One entry for every way to start a run; prints the exact command, then runs it (exit code passed through:
# 0 done, 2 bad input, 75 preempted -> requeue with the same command, it resumes with --resume auto).
#
#   scripts/launch.sh [--num_gpus N] -- TRAIN_ARGS...                         single node
#   scripts/launch.sh -H hostfile [--include S | --exclude S] -- TRAIN_ARGS  multi-node over pdsh/ssh
#   scripts/launch.sh --no_ssh --nnodes N --node_rank R --master_addr A [--master_port P] [--num_gpus N] -- ...
#                                                                            per node, no ssh (containers, SLURM)
#   scripts/launch.sh --torchrun --nnodes N --node_rank R --master_addr A [--num_gpus N] -- ...
#   --print-only: print the command and stop.
# Environment every node needs (NCCL_*, PYTHONPATH, WANDB_*, HF_*, DS_ACCELERATOR, OMP_NUM_THREADS) is written
# to ./.deepspeed_env, which the deepspeed launcher exports on every node it starts.
# Preemption: signal the training ranks (SLURM signals every task) or touch OUTPUT_DIR/PREEMPT; the deepspeed
# launcher itself answers SIGTERM by killing its children (30 s grace) and then exits 1, not 75.
set -euo pipefail
cd "$(dirname "$0")/.."
DS=${DEEPSPEED:-.venv/bin/deepspeed}
PY=${PYTHON:-.venv/bin/python}
num_gpus="" hostfile="" include="" exclude="" no_ssh=0 torchrun=0 nnodes=1 node_rank=0
master_addr="" master_port=29500 print_only=0
while [ $# -gt 0 ]; do
  case "$1" in
    --num_gpus) num_gpus=$2; shift 2 ;;
    -H|--hostfile) hostfile=$2; shift 2 ;;
    -i|--include) include=$2; shift 2 ;;
    -e|--exclude) exclude=$2; shift 2 ;;
    --no_ssh) no_ssh=1; shift ;;
    --torchrun) torchrun=1; shift ;;
    --nnodes) nnodes=$2; shift 2 ;;
    --node_rank) node_rank=$2; shift 2 ;;
    --master_addr) master_addr=$2; shift 2 ;;
    --master_port) master_port=$2; shift 2 ;;
    --print-only|--dry-run) print_only=1; shift ;;
    --) shift; break ;;
    *) echo "error: unknown launch option $1 (train.py arguments go after --)" >&2; exit 2 ;;
  esac
done

if [ -z "${DS_ACCELERATOR:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q GPU; then
    export DS_ACCELERATOR=cuda
  else
    export DS_ACCELERATOR=cpu
  fi
fi
if [ -z "$num_gpus" ]; then
  if [ "$DS_ACCELERATOR" = cuda ]; then num_gpus=$(nvidia-smi -L | grep -c GPU); else num_gpus=2; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
[ "$DS_ACCELERATOR" = cuda ] && export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}

# what every node must see, for the deepspeed launcher's pdsh/ssh path
: > .deepspeed_env
for v in $(env | cut -d= -f1 | grep -E '^(NCCL_|WANDB_|HF_|PYTHONPATH$|DS_ACCELERATOR$|OMP_NUM_THREADS$|PYTORCH_CUDA_ALLOC_CONF$|CUDA_HOME$)' || true); do
  printf '%s=%s\n' "$v" "${!v}" >> .deepspeed_env
done

if [ "$torchrun" = 1 ]; then
  cmd=("$PY" -m torch.distributed.run --nnodes "$nnodes" --node_rank "$node_rank" --nproc_per_node "$num_gpus"
       --master_addr "${master_addr:-127.0.0.1}" --master_port "$master_port" train.py "$@")
elif [ "$no_ssh" = 1 ]; then
  [ -n "$master_addr" ] || { echo "error: --no_ssh needs --master_addr (node 0's address)" >&2; exit 2; }
  # a hostfile naming every node lets the launcher size the world; node_rank says which one this is
  hf=$(mktemp "${TMPDIR:-/tmp}/ulysses_hosts.XXXX")
  for ((i = 0; i < nnodes; i++)); do echo "node$i slots=$num_gpus" >> "$hf"; done
  cmd=("$DS" --hostfile "$hf" --no_ssh --node_rank "$node_rank" --master_addr "$master_addr"
       --master_port "$master_port" train.py "$@")
else
  cmd=("$DS")
  if [ -n "$hostfile" ]; then
    cmd+=(--hostfile "$hostfile")
    [ -n "$include" ] && cmd+=(--include "$include")
    [ -n "$exclude" ] && cmd+=(--exclude "$exclude")
    [ -n "$master_addr" ] && cmd+=(--master_addr "$master_addr")
  else
    cmd+=(--num_gpus "$num_gpus")
  fi
  cmd+=(--master_port "$master_port" train.py "$@")
fi
echo "DS_ACCELERATOR=$DS_ACCELERATOR ${cmd[*]}"
[ "$print_only" = 1 ] && exit 0
set +e
"${cmd[@]}"
exit $?
