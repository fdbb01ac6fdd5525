"""Worker for tests/multiproc/test_context_parallel.py::test_ring_in_bf16_matches_dense_attention_and_holds_the_planned_bytes:
the ring alone (model_utils/ring_attention.py, no model) in bf16 on cp = world ranks. Every rank builds the same
q, k, v, dO of the whole sequence (seed 0), keeps its zigzag chunks, runs the ring forward and backward and saves its
output, gradients, the most bytes the ring held and its shifts' (shape, dtype) log. argv: out dir, JSON config."""

import json
import os
import sys

import torch

from base import comm
from base.parallel import init_distributed
from model_utils import attention, ring_attention
from model_utils import context_parallel as cpm
from tests.distributed import DIST_TIMEOUT_S

out_dir, case = sys.argv[1], json.loads(sys.argv[2])
dims = init_distributed(1, timeout_s=DIST_TIMEOUT_S)
cp, me, sl, d = dims.world, dims.rank, case["sl"], case["d"]
group = comm.subgroups([list(range(cp))])
torch.manual_seed(0)
q, k, v, do = (torch.randn(1, h, sl, d).to(torch.bfloat16) for h in (case["hq"], case["hkv"], case["hkv"], case["hq"]))
bounds = case["bounds"]
pos = torch.cat([torch.arange(e - s) for s, e in zip(bounds[:-1], bounds[1:])])[None]
docs = attention.Documents(pos, 1)
ranges = [cpm.local_ranges(sl, cp, c) for c in range(cp)]
mine = torch.cat([torch.arange(a, b) for a, b in ranges[me]])
ql, kl, vl = (x[:, :, mine].clone().requires_grad_() for x in (q, k, v))
spec = ring_attention.Spec(group, cp, me, ranges, docs, case["window"], d ** -0.5)
ring_attention.STATS.update(peak_bytes=0, calls=0, log=[])
out = ring_attention.ring_attention(ql, kl, vl, spec)  # [1, T, hq, d]
out.backward(do[:, :, mine].transpose(1, 2))
torch.save({"idx": mine, "out": out.detach(), "dq": ql.grad, "dk": kl.grad, "dv": vl.grad,
            "peak": ring_attention.STATS["peak_bytes"], "log": ring_attention.STATS["log"]},
           os.path.join(out_dir, f"rank{me}.pt"))
comm.barrier()
