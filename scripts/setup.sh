#!/usr/bin/env bash
# One-command set-up: .venv with the pinned requirements, DeepSpeed's ops built once (no JIT in a job), demo corpus ready.
#   bash scripts/setup.sh            # CPU (torch 2.13.0 CPU wheel where one is on disk)
#   WITH_FLASH_ATTN=1 bash scripts/setup.sh   # GPU nodes: also the optional flash-attn extra
# No arguments (-h/--help prints this); environment: PYTHON (the venv's interpreter, python3), WITH_FLASH_ATTN,
# DS_ACCELERATOR (cpu/cuda: which ops to build; found from nvidia-smi).
# Arguments are read before anything runs: `setup.sh --help` used to run the whole set-up (pip, minutes of builds).
if [ $# -gt 0 ]; then
  if [ $# -eq 1 ] && { [ "$1" = -h ] || [ "$1" = --help ]; }; then
    sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//'
    exit 0
  fi
  echo "setup.sh: takes no arguments, got: $*: run \`bash scripts/setup.sh\` (settings are environment variables: --help)" >&2
  exit 2
fi
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q -r requirements.txt
.venv/bin/pip install -q --no-deps --no-build-isolation -e .  # the project's packages, importable everywhere
if [ "${WITH_FLASH_ATTN:-0}" = 1 ]; then
  .venv/bin/pip install -q --no-build-isolation -r requirements-gpu.txt
fi
# Build DeepSpeed's JIT ops now, so that no job builds them (a build inside a job costs every rank minutes, 32 ranks
# contend for one lock, and a rank killed mid-build leaves a `lock` that makes every later load wait forever):
# on CPU the CPU Adam optimizer and the shared-memory comm op (about 1.5 min the first time); on a GPU node CPU Adam
# (optimizer offload) and FusedAdam (what the flags' AdamW becomes on a GPU without optimizer offload,
# training/ds_config.optimizer_spec). They go to this checkout's .cache/torch_extensions (importing `training` sets
# TORCH_EXTENSIONS_DIR; see base/env.py), which launch.sh passes to every node. Build where the jobs run
# (a GPU node, or set TORCH_CUDA_ARCH_LIST on a node without GPUs). A `lock` left there by a build that was killed
# would make every later load wait forever: set-up is the one builder, so it clears them first (run it while
# nothing in this checkout is starting); train.py stops at start with one line naming any lock it finds.
export DS_ACCELERATOR=${DS_ACCELERATOR:-$(command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)}
.venv/bin/python - <<'PY'
import glob
import os

from deepspeed.accelerator import get_accelerator

from base.env import configure

configure()  # TORCH_EXTENSIONS_DIR; TORCH_CUDA_ARCH_LIST in the form DeepSpeed reads

for lock in glob.glob(os.path.join(os.environ["TORCH_EXTENSIONS_DIR"], "**", "lock"), recursive=True):
    print(f"removing a stale build lock: {lock}")
    os.remove(lock)
acc = get_accelerator()
names = ["CPUAdamBuilder", "ShareMemCommBuilder"] if acc.device_name() == "cpu" else ["CPUAdamBuilder", "FusedAdamBuilder"]
for name in names:
    builder = acc.create_op_builder(name)
    if builder is None or not builder.is_compatible(verbose=False):
        print(f"not building {name}: {acc.device_name()} has no compatible build (the job will not use it)")
        continue
    builder.load(verbose=False)  # a prebuilt op (DS_BUILD_*=1 wheels) loads as is; otherwise it is built here
    print(f"DeepSpeed op ready: {builder.NAME}")
print(f"DeepSpeed ops ready ({acc.device_name()}, {os.environ['TORCH_EXTENSIONS_DIR']})")
PY
.venv/bin/python -m data.corpus >/dev/null && echo "demo corpus and tokenizer ready (.cache/demo)"
.venv/bin/python -m data.chat_demo .cache/demo/chat_demo.jsonl >/dev/null && echo "demo chat set ready (.cache/demo/chat_demo.jsonl, recipes/tiny_cpu_sft.yaml)"
echo "setup done: .venv ($(.venv/bin/python -c 'import torch, deepspeed, transformers as t; print(f"torch {torch.__version__}, deepspeed {deepspeed.__version__}, transformers {t.__version__}")'))"
