"""The training machinery: config tree, parallel layout, DeepSpeed config, step, checkpoints, stages, metrics.

Importing it points DeepSpeed's JIT-built ops (CPU Adam, the shared-memory comm op) at this checkout's own
`.cache/torch_extensions` unless TORCH_EXTENSIONS_DIR is set: torch serializes JIT builds with a `lock` file
and waits for it to disappear with no time limit, so one process killed mid-build in the shared
`~/.cache/torch_extensions` (or another checkout rebuilding there with its own include paths) would stall
every later launch on the machine. `scripts/setup.sh` builds the ops there once.
"""

import os

EXTENSIONS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache", "torch_extensions")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", EXTENSIONS_DIR)
