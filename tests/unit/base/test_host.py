"""base/host.py: the node size every launcher reports (one reading for the curriculum, start-up, preflight and
evaluate.py), and the CPU placement verdict from every rank's usable CPUs."""

from __future__ import annotations

import pytest

from base.host import ADAM_THREADS, cpu_placement, cpu_ranges, ranks_per_node, threads_per_rank

LAUNCHER_VARS = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "WORLD_SIZE", "SLURM_NTASKS",
                 "SLURM_STEP_NUM_TASKS", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE",
                 "SLURM_GPUS_ON_NODE")


@pytest.mark.parametrize("env, expect", [
    ({"LOCAL_WORLD_SIZE": "8", "WORLD_SIZE": "32"}, 8),  # torchrun
    ({"LOCAL_SIZE": "8", "CROSS_SIZE": "4", "WORLD_SIZE": "32"}, 8),  # the deepspeed launcher (launch.py)
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "4", "WORLD_SIZE": "8"}, 4),  # deepspeed --launcher openmpi
    ({"SLURM_STEP_NUM_TASKS": "32", "SLURM_STEP_TASKS_PER_NODE": "8(x4)", "WORLD_SIZE": "32"}, 8),  # srun, a rank/task
    # slurm.sbatch: srun starts one launch.sh per node (1 task per node) and the deepspeed launcher the ranks
    ({"SLURM_STEP_NUM_TASKS": "4", "SLURM_NTASKS_PER_NODE": "1", "SLURM_GPUS_ON_NODE": "8", "LOCAL_SIZE": "8",
      "WORLD_SIZE": "32"}, 8),
    ({"SLURM_STEP_NUM_TASKS": "4", "SLURM_NTASKS_PER_NODE": "1", "WORLD_SIZE": "32"}, 0),  # ranks not srun's tasks
    ({"SLURM_NTASKS": "2", "SLURM_TASKS_PER_NODE": "1(x2)"}, 0),  # the batch shell (a dry run there): no ranks yet
    ({}, 0),  # no launcher: unknown
])
def test_ranks_per_node_under_every_launcher(env, expect):
    assert ranks_per_node(env) == expect


def test_deepspeed_launcher_keeps_ulysses_inside_a_node(monkeypatch):
    """Llama-3-8B (32 heads, 8 KV heads) at SP=16 on 4 nodes x 8 GPUs started by the deepspeed launcher (launch.sh,
    slurm.sbatch), no gpus_per_node in the recipe: Ulysses 8 inside the node, cp 2 across (it was Ulysses 16:
    an all-to-all over InfiniBand in every layer, LOCAL_WORLD_SIZE being torchrun's variable only)."""
    from training.config import Config
    from training.curriculum import check_stages, gpus_per_node, resolve_stages

    for k in LAUNCHER_VARS:
        monkeypatch.delenv(k, raising=False)
    for k, v in {"LOCAL_SIZE": "8", "CROSS_SIZE": "4", "WORLD_SIZE": "32", "RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    cfg = Config(model_name_or_path="llama3-8b", deepspeed="ds_configs/zero3_offload.json", bf16=True,
                 max_seq_length=131072, sequence_parallel_size=16)
    stages = check_stages(resolve_stages(cfg, lambda sp: 32 // sp), 32, 32, 8, None, gpus_per_node(cfg))
    assert [(s.sp // s.cp, s.cp) for s in stages] == [(8, 2)]
    assert gpus_per_node(cfg) == 8


@pytest.mark.parametrize("readings, gpu, verdict, words", [
    # slurm.sbatch's step bound to one CPU (no --cpus-per-task): 8 GPU ranks on CPU 0
    ([("n0", [0])] * 8, True, "refuse", "8 ranks on node n0 may run on 1 CPU(s) (0): fewer cores than ranks"),
    ([("n0", [0])] * 2, False, "warn", "fewer cores than ranks"),  # the CPU accelerator: slow, allowed
    ([("n0", list(range(16)))] * 8, True, "warn", f"2 per rank, CPU Adam (ZeRO optimizer offload) wants {ADAM_THREADS}"),
    ([("n0", [0, 1])] * 2, False, "ok", "1 per rank"),  # the CPU accelerator: the ranks are the compute
    # each rank bound to its own 12 cores (numactl -C): the node's cores are their union
    ([("n0", list(range(12 * r, 12 * r + 12))) for r in range(8)], True, "ok", "may run on 96 CPU(s) (0-95): 12 per"),
    # the worst node decides: n1's ranks share 2 cores
    ([("n0", list(range(96)))] * 8 + [("n1", [0, 1])] * 8, True, "refuse", "node n1 may run on 2 CPU(s) (0-1)"),
])
def test_cpu_placement_verdict(readings, gpu, verdict, words):
    got, line = cpu_placement(readings, gpu)
    assert got == verdict and words in line, line
    if verdict != "ok":
        assert "srun --cpus-per-task" in line and "\n" not in line


def test_cpu_ranges():
    assert cpu_ranges([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8" and cpu_ranges([3]) == "3" and cpu_ranges([]) == ""


def test_threads_per_rank_is_the_share_of_the_nodes_cores():
    node = [("n0", list(range(128)))] * 8 + [("n1", list(range(64)))] * 8
    assert threads_per_rank(node, "n0", list(range(128))) == 16 and threads_per_rank(node, "n1", list(range(64))) == 8
    bound = [("n0", list(range(4 * r, 4 * r + 4))) for r in range(8)]
    assert threads_per_rank(bound, "n0", [0, 1, 2, 3]) == 4  # within its own CPUs
    assert threads_per_rank([("n0", [0])] * 8, "n0", [0]) == 1  # at least one
