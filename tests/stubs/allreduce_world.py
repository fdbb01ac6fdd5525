"""Stand-in for train.py in launcher tests: join the world the launcher describes, all-reduce once.

Prints `world W rank R sum S` (S = W when every rank took part) and exits 0.
"""

import argparse

import deepspeed
import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=0)  # the deepspeed launcher passes it
parser.parse_known_args()
deepspeed.init_distributed(dist_backend="gloo")
try:  # as train.py does: drop DeepSpeed's CPU SHM all-reduce segment name (it would outlive the test in /dev/shm)
    from base.parallel import release_shm_buffer

    release_shm_buffer(dist.get_rank())
except ImportError:  # run from a launcher test without the repo on the path
    pass
t = torch.ones(1)
dist.all_reduce(t)
print(f"world {dist.get_world_size()} rank {dist.get_rank()} sum {int(t.item())}", flush=True)
dist.destroy_process_group()
