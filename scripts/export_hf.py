"""Convert a saved run (or one checkpoint) to a Hugging Face folder loadable by AutoModelForCausalLM.

    python scripts/export_hf.py checkpoints/RUN [--checkpoint checkpoints/RUN/checkpoints/step_000300] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import sys

from model_utils.export import export_hf
from training.checkpoint import Checkpointer


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir")
    p.add_argument("--checkpoint", default=None, help="a given checkpoint (default: newest valid)")
    p.add_argument("--out", default=None, help="output folder (default: RUN/hf_model)")
    a = p.parse_args(argv)
    ckpt = Checkpointer(a.run_dir, keep=2)
    path = a.checkpoint or ckpt.find_resume("auto")
    why = "no such folder" if path and not os.path.isdir(path) else ckpt.verify(path) if path else None
    if a.checkpoint and why:  # the checkpoint named, and why it is not one (not a message about the run folder)
        print(f"error: --checkpoint {a.checkpoint}: not a complete checkpoint ({why})", file=sys.stderr)
        return 2
    if path is None or why:
        print(f"error: no complete checkpoint under {a.run_dir}/checkpoints", file=sys.stderr)
        return 2
    tok = Checkpointer.read_trainer(path).get("tokenizer")
    out = export_hf(path, a.out or os.path.join(a.run_dir, "hf_model"), tok)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
