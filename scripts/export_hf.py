"""Convert a saved run (or one checkpoint) to a Hugging Face folder loadable by AutoModelForCausalLM.

    python scripts/export_hf.py checkpoints/RUN [--checkpoint checkpoints/RUN/checkpoints/step_000300] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import sys

from model_utils.export import export_hf
from training.checkpoint import Checkpointer


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir")
    p.add_argument("--checkpoint", default=None, help="a given checkpoint (default: newest valid)")
    p.add_argument("--out", default=None, help="output folder (default: RUN/hf_model)")
    a = p.parse_args()
    ckpt = Checkpointer(a.run_dir, keep=2)
    path = a.checkpoint or ckpt.find_resume("auto")
    if path is None or ckpt.verify(path):
        print(f"error: no complete checkpoint under {a.run_dir}/checkpoints", file=sys.stderr)
        return 2
    tok = Checkpointer.read_trainer(path).get("tokenizer")
    out = export_hf(path, a.out or os.path.join(a.run_dir, "hf_model"), tok)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
