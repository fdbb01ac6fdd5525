#!/usr/bin/env bash
# The wheels the device tool's GPU machine lacks, in .whl/ (ignored by git), for `make gpu-check` there.
#
# That machine's image holds a CUDA torch, tokenizers, safetensors, accelerate, numpy, psutil, ninja, einops,
# msgpack, py-cpuinfo, nvidia-ml-py (/work/.library/device/KINDS.md lists them) but not DeepSpeed, our pinned
# transformers, or their pure dependencies; nothing can be fetched there. This script takes the versions this
# checkout's .venv runs (scripts/setup.sh installs them from requirements.txt) and downloads Python 3.12 x86-64
# wheels of each; DeepSpeed publishes a source tarball only, so its wheel is built here (pure Python: its ops are
# JIT-built on the GPU machine, where nvcc and ninja are). ~19 MB in all (the tool carries at most 64 MiB).
#
# Then, on the device tool (docs/benchmarks.md): carry [".cache/demo", ".whl"] and start the command with
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site || exit;
# (bench.gpu puts bench/gpu_site before that PYTHONPATH in the ranks it launches).
#
# huggingface_hub is left to the image (1.33 there, transformers asks >= 1.31): 2.x needs httpx2, absent there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
[ -x "$PY" ] || { echo "no .venv: run scripts/setup.sh first" >&2; exit 2; }
PKGS="deepspeed transformers hjson pydantic pydantic_core annotated-types typing-inspection typing_extensions regex"
pins=$($PY - $PKGS <<'EOF'
import sys
from importlib.metadata import version
print(" ".join(f"{n}=={version(n)}" for n in sys.argv[1:]))
EOF
)
rm -rf .whl && mkdir -p .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
binary=()
for p in $pins; do
    case $p in deepspeed==*) ds=$p ;; *) binary+=("$p") ;; esac
done
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "${binary[@]}"
DS_BUILD_OPS=0 $PY -m pip wheel -q --no-deps --no-build-isolation -w .whl "$ds"
ls .whl
du -sh .whl
