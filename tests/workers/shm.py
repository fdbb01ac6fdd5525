"""Worker for tests/multiproc/test_shm_cleanup.py: DeepSpeed's CPU shared-memory all-reduce before and after
base.parallel.release_shm_buffer unlinks this rank's segment name. Prints one JSON line per rank."""

import json
import os

import deepspeed
import deepspeed.comm as ds_comm
import torch
import torch.distributed as dist

from base.parallel import release_shm_buffer, shm_buffer_path

if __name__ == "__main__":
    deepspeed.init_distributed(dist_backend=None, auto_mpi_discovery=False)
    rank, world = dist.get_rank(), dist.get_world_size()
    path = shm_buffer_path(rank)
    created = os.path.exists(path)
    released = release_shm_buffer(rank)
    t = torch.full((4096,), float(rank + 1))
    ds_comm.inference_all_reduce(t)  # the SHM kernel: reads every rank's segment through its mapping
    dist.barrier()
    print(json.dumps({"rank": rank, "path": path, "created": created, "released": released,
                      "exists_after": os.path.exists(path), "again": release_shm_buffer(rank),
                      "sum_ok": bool(torch.all(t == world * (world + 1) / 2))}), flush=True)
