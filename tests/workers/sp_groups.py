"""Worker for tests/unit/base/test_comm.py: a stage's SP groups are destroyed when the next stage unregisters Ulysses
(the process-group registry shrinks back), and the next stage's new groups then work."""

import json
import os
import sys

import torch
import torch.distributed as dist
from deepspeed.runtime.sequence_parallel import parallel_state_sp
from deepspeed.utils import groups

from base import comm
from base.parallel import init_distributed
from model_utils import ulysses
from tests.distributed import DIST_TIMEOUT_S

dims = init_distributed(1, timeout_s=DIST_TIMEOUT_S)
live = lambda: len(dist.distributed_c10d._world.pg_map)  # noqa: E731
before = live()
parallel_state_sp.initialize_sequence_parallel(2)
during = live()
# every group takes the run's timeout (DeepSpeed's SP groups set none: the backend's default, NCCL's 10 min)
def timeout(g) -> float:
    return g._get_backend(torch.device("cpu")).options._timeout.total_seconds()


timeouts = {timeout(parallel_state_sp._SEQUENCE_PARALLEL_GROUP), timeout(parallel_state_sp._SEQUENCE_DATA_PARALLEL_GROUP)}
groups.mpu = parallel_state_sp  # as deepspeed.initialize leaves it after an SP stage
destroyed = ulysses.unregister()
after = live()
sdp = groups._get_sequence_data_parallel_group()  # an SP-1 stage's engine asks for it: the world's, not a released one
ours = comm.subgroups([[0, 1]])  # context parallelism's and Ulysses' own groups
timeouts = sorted(timeouts | {timeout(ours)})
comm.destroy_groups([ours])
parallel_state_sp.initialize_sequence_parallel(2)  # the next stage registers its own
ok = comm.all_reduce([1.0], group=parallel_state_sp._SEQUENCE_PARALLEL_GROUP).item() == 2.0
with open(os.path.join(sys.argv[1], f"result{dims.rank}.json"), "w") as fh:
    json.dump({"before": before, "during": during, "after": after, "destroyed": destroyed, "ok": ok,
               "timeouts": timeouts, "sdp_size": dist.get_world_size(sdp)}, fh)
comm.barrier()
