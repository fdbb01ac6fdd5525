"""scripts/evaluate.py's command line takes what the launchers append to it."""

from __future__ import annotations

import pytest

from scripts.evaluate import parse_args


@pytest.mark.parametrize("argv", [["--local-rank=1"], ["--local-rank", "1"], ["--local_rank=1"]])
def test_torch_distributed_launch_local_rank_is_taken(argv):
    """`python -m torch.distributed.launch --nproc_per_node 2 scripts/evaluate.py ...` appends `--local-rank=N` (its
    spelling since torch 2.0): every rank exited 2, "unrecognized arguments: --local-rank=0" (train.py takes it too:
    training/config.py). The deepspeed launcher's --local_rank=N as before; LOCAL_RANK is what is read."""
    a = parse_args(["model", "--lengths", "256", "--output_dir", "out", *argv])
    assert a.local_rank == 1 and a.lengths == "256"
