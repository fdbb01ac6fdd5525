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
t = torch.ones(1)
dist.all_reduce(t)
print(f"world {dist.get_world_size()} rank {dist.get_rank()} sum {int(t.item())}", flush=True)
dist.destroy_process_group()
