"""Worker for tests/unit/base/test_comm.py: a stage's SP groups are destroyed when the next stage unregisters Ulysses
(the process-group registry shrinks back), and the next stage's new groups then work."""

import json
import os
import sys

import torch.distributed as dist
from deepspeed.runtime.sequence_parallel import parallel_state_sp

from base import comm
from base.parallel import init_distributed
from model_utils import ulysses
from tests.distributed import DIST_TIMEOUT_S

dims = init_distributed(1, timeout_s=DIST_TIMEOUT_S)
live = lambda: len(dist.distributed_c10d._world.pg_map)  # noqa: E731
before = live()
parallel_state_sp.initialize_sequence_parallel(2)
during = live()
destroyed = ulysses.unregister()
after = live()
parallel_state_sp.initialize_sequence_parallel(2)  # the next stage registers its own
ok = comm.all_reduce([1.0], group=parallel_state_sp._SEQUENCE_PARALLEL_GROUP).item() == 2.0
with open(os.path.join(sys.argv[1], f"result{dims.rank}.json"), "w") as fh:
    json.dump({"before": before, "during": during, "after": after, "destroyed": destroyed, "ok": ok}, fh)
comm.barrier()
