"""A stand-in for `python -m deepspeed.checkpoint.ds_to_universal` (training/universal.py runs it as
`python -c <_CHILD> MODULE --input_folder SRC --output_folder OUT ...`): first the signals a Slurm step's processes
get mid-run, to itself (FAKE_SIGNALS, e.g. "USR1 USR2" or "TERM"), then, if it lives, the model-states file copied
into OUT as ds_to_universal copies it."""

import os
import shutil
import signal
import sys

if __name__ == "__main__":
    for name in os.environ.get("FAKE_SIGNALS", "").split():
        os.kill(os.getpid(), getattr(signal, f"SIG{name}"))
    src, out = sys.argv[sys.argv.index("--input_folder") + 1], sys.argv[sys.argv.index("--output_folder") + 1]
    os.makedirs(out, exist_ok=True)
    model = "zero_pp_rank_0_mp_rank_00_model_states.pt"
    shutil.copy2(os.path.join(src, model), os.path.join(out, model))
