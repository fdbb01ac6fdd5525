"""A container's small /dev/shm (Docker's default 64 MiB) under a GPU run of several ranks a node: NCCL's shared memory
fails to start there (ncclShmOpen; NVIDIA's NCCL guide, troubleshooting: --shm-size=1g). preflight checked memory,
memlock and build locks, not /dev/shm. Now each node's first rank warns in one line before the process group (NCCL
starts inside it), naming --shm-size and --ipc=host. The decision with a fake statvfs; CPU runs (gloo) are not warned."""

from __future__ import annotations

import os
import types

import pytest

from training import preflight

MiB, GiB = 2**20, 2**30


@pytest.mark.parametrize("size, ranks, gpu, warned", [
    (64 * MiB, 8, True, True),  # Docker's default under an 8-GPU node
    (64 * MiB, 2, True, True),
    (64 * MiB, 1, True, False),  # one rank a node: no peer on the node to share memory with
    (64 * MiB, 0, True, False),  # no launcher says how many share the node
    (64 * MiB, 8, False, False),  # a CPU run: gloo, and DeepSpeed's shm op trained with 64 MiB
    (2 * GiB, 8, True, False),  # --shm-size=2g, or --ipc=host (the host's /dev/shm)
    (None, 8, True, False),  # no /dev/shm to read
])
def test_a_small_dev_shm_under_a_gpu_node_of_several_ranks_is_one_warning(size, ranks, gpu, warned):
    line = preflight.shm_warning(size, ranks, gpu, "gpu07")
    assert (line is not None) == warned
    if line:
        assert "\n" not in line and line.startswith("warning: /dev/shm on gpu07 holds 64 MiB for its")
        assert "--shm-size=1g" in line and "--ipc=host" in line


def test_each_nodes_first_rank_says_it_before_the_process_group(monkeypatch, capsys):
    monkeypatch.setattr(os, "statvfs", lambda path: types.SimpleNamespace(f_blocks=16384, f_frsize=4096))  # 64 MiB
    monkeypatch.setattr(preflight, "no_gpu", lambda: False)
    monkeypatch.setattr(preflight, "network_problem", lambda *a: None)
    for var in ("WORLD_SIZE", "CROSS_SIZE", "LOCAL_WORLD_SIZE", "GLOO_SOCKET_IFNAME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("LOCAL_SIZE", "4")  # the deepspeed launcher's ranks on this node
    for local, said in (("0", 1), ("1", 0)):
        monkeypatch.setenv("LOCAL_RANK", local)
        preflight.check_network()
        err = capsys.readouterr().err
        assert err.count("warning: /dev/shm on") == said and (not said or "for its 4 ranks" in err)
