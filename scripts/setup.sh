#!/usr/bin/env bash
# One-command set-up: .venv with the pinned requirements, DeepSpeed's CPU ops built once, demo corpus ready.
#   bash scripts/setup.sh            # CPU (torch 2.13.0 CPU wheel where one is on disk)
#   WITH_FLASH_ATTN=1 bash scripts/setup.sh   # GPU nodes: also the optional flash-attn extra
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q -r requirements.txt
if [ "${WITH_FLASH_ATTN:-0}" = 1 ]; then
  .venv/bin/pip install -q --no-build-isolation -r requirements-gpu.txt
fi
# Build DeepSpeed's JIT ops now (about 1.5 min the first time) so the first launch and the tests do not pay
# for it; on CPU: the CPU Adam optimizer and the shared-memory comm op. They go to this checkout's
# .cache/torch_extensions (importing `training` sets TORCH_EXTENSIONS_DIR; see training/__init__.py). A `lock`
# left there by a build that was killed would make every later load wait forever: set-up is the one builder,
# so it clears them first (run it while nothing in this checkout is starting).
export DS_ACCELERATOR=${DS_ACCELERATOR:-$(command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)}
if [ "$DS_ACCELERATOR" = cpu ]; then
  .venv/bin/python - <<'PY'
import glob
import os

import training  # noqa: F401  (TORCH_EXTENSIONS_DIR)
from deepspeed.ops.op_builder import CPUAdamBuilder, ShareMemCommBuilder

for lock in glob.glob(os.path.join(os.environ["TORCH_EXTENSIONS_DIR"], "**", "lock"), recursive=True):
    print(f"removing a stale build lock: {lock}")
    os.remove(lock)
for b in (CPUAdamBuilder(), ShareMemCommBuilder()):
    b.load(verbose=False)
print(f"DeepSpeed CPU ops ready ({os.environ['TORCH_EXTENSIONS_DIR']})")
PY
fi
.venv/bin/python -m data.corpus >/dev/null && echo "demo corpus and tokenizer ready (.cache/demo)"
echo "setup done: .venv ($(.venv/bin/python -c 'import torch, deepspeed, transformers as t; print(f"torch {torch.__version__}, deepspeed {deepspeed.__version__}, transformers {t.__version__}")'))"
