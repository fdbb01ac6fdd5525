"""The Ulysses and cp subgroups (model_utils/ulysses._subgroup_ranks) agree with the layout every other module reads
from base.parallel.ParallelDims and data.sharding.shard, at world 8 with both factors above 1 (pure arithmetic).

torch.distributed.new_group sorts its ranks, so a rank's place in the sorted list is its rank in the group: in its
Ulysses group it must be its ulysses rank (sp_rank % u: the all-to-all stacks the group's sequence shards in group
order), in its cp group its cp_rank (context_parallel attends as local_ranges(cp_rank) and gathers K/V in cp-group
order; the ring sends to the next group rank). Groups strided across the SP group instead of consecutive passed
every test, all of which run world <= 4 with u or cp equal to 1 there (mutation audit mutA: M20)."""

from __future__ import annotations

import pytest
import torch

from base.parallel import ParallelDims
from data.sharding import shard
from model_utils import context_parallel as cpm
from model_utils.ulysses import _subgroup_ranks


@pytest.mark.parametrize("world,sp,cp", [(8, 4, 2), (8, 8, 2), (8, 8, 4)])
def test_subgroups_are_the_ranks_parallel_dims_and_shard_put_together(world, sp, cp):
    ulysses_groups, cp_groups = _subgroup_ranks(world, sp, cp)
    dims = [ParallelDims(world=world, sp=sp, rank=r, local_rank=r, cp=cp) for r in range(world)]
    u = dims[0].ulysses
    assert u > 1 and cp > 1
    for groups, size in ((ulysses_groups, u), (cp_groups, cp)):  # each a partition of the world
        assert sorted(r for g in groups for r in g) == list(range(world)) and {len(g) for g in groups} == {size}
    sl = 2 * sp * 3
    batch = {"input_ids": torch.arange(sl)[None]}
    for r, d in enumerate(dims):
        (mine_u,) = [sorted(g) for g in ulysses_groups if r in g]
        (mine_cp,) = [sorted(g) for g in cp_groups if r in g]
        assert mine_u == [s for s in range(world) if (dims[s].dp_rank, dims[s].cp_rank) == (d.dp_rank, d.cp_rank)]
        assert mine_u.index(r) == d.sp_rank % u, (r, mine_u)
        assert mine_cp == [s for s in range(world) if (dims[s].dp_rank, dims[s].sp_rank % u) == (d.dp_rank,
                                                                                                 d.sp_rank % u)]
        assert mine_cp.index(r) == d.cp_rank, (r, mine_cp)
        # the Ulysses all-to-all stacks the group's shards in group order: the cp rank's two zigzag chunks
        held = torch.cat([shard(batch, sp, dims[s].sp_rank, cp)["input_ids"][0] for s in mine_u])
        assert torch.equal(held, torch.cat([torch.arange(a, b) for a, b in cpm.local_ranges(sl, cp, d.cp_rank)]))
