"""ZeRO-3's pinned host buffers, byte for byte against a real DeepSpeed engine (issue 43).

On the H200 (2026-11-27) the caching host allocator held 12 GiB (blocks of 8 + 4 GiB) where the planner counted one
8 GiB block: with offload_optimizer.pin_memory, DeepSpeed pins its bf16 gradient-accumulation buffer as well as one
fp32 gradient buffer per optimizer sub-group, and forms the sub-groups parameter by parameter. Here a one-rank engine
(gloo, CPU) is built with both offloads pinned, the accelerator's pin_memory (a no-op on CPU) records every request,
and planner.memory_model.zero3_pinned_requests must list the same requests, in order. The old planner (one fp32
buffer of 4 n / world bytes, no per-parameter blocks) fails it.

The optimizer sub-groups have one model (planner/zero3_host.zero3_subgroups, parameter by parameter as DeepSpeed 0.19.8
forms them): it sizes the pinned gradient buffers, the async save's snapshot (fp32 master, Adam's m and v per
sub-group) and the optimizer step's fp32 copy. Checked fast against DeepSpeed's own formation function, and (slow) the
same engine's sub-groups and its optimizer state staged as the async save stages it.
"""

from __future__ import annotations

import socket

import pytest

from planner.memory_model import ModelShape, estimate, load_shape, pinned_block_bytes
from planner.zero3_host import zero3_partitions, zero3_subgroups


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_pinned_blocks_of_the_h200_run_are_the_planners():
    """The fast sibling: the planner's pinned blocks for the H200 run's own configuration (bench/results/gpu.json,
    its memory_choice record) are what torch.cuda.host_memory_stats held there, to the MiB (the bytes beyond are small
    pinned tensors of the step, not ZeRO-3's). The run of 2026-11-27 (no parameter offload) held 12 GiB (8 + 4), where
    the old planner said 8; the headline run of 2026-11-28 (parameters offloaded too: every partition pinned at
    zero.Init, then the flat block) held 18.91 GiB, predicted before it ran."""
    import json
    import os

    from bench.gpu_compare import planner_phases
    from tests.conftest import ROOT

    with open(os.path.join(ROOT, "bench", "results", "gpu.json")) as fh:
        run = json.load(fh)["headline"]
    shape = ModelShape(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=2, num_heads=32,
                       num_kv_heads=8, head_dim=128)
    held = run["host"]["pinned"]["stats"]["allocated_bytes.current"]
    assert 0 <= held - planner_phases(shape, run["length"], run["memory_choice"], "cuda")["pinned"] < 2**20


@pytest.mark.parametrize("model, world, size", [("llama3-8b", 8, None), ("llama3-8b", 64, None), ("llama3-8b", 8, 3 * 10**8),
                                               ("h200", 1, None), ("tiny", 1, 20_000), ("tiny", 1, 10**9)])
def test_subgroups_are_deepspeeds_own(model, world, size):
    """zero3_subgroups against DeepSpeed 0.19.8's own stage3._create_fp16_sub_groups, run on stand-in parameters with
    the model's partitions: several sub-groups (Llama-3-8B on 8 ranks: each closes past 1e9 on a parameter's boundary,
    not at 1e9 exactly as the old fixed model had it), one group (the H200 run's 1.487e9 elements on one GPU: 1e9 is
    first reached at the last parameter), the whole partition within sub_group_size, and the tiny engine's groups."""
    import types

    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    shape = {"llama3-8b": load_shape("llama3-8b"),
             "h200": ModelShape(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=2,
                                num_heads=32, num_kv_heads=8, head_dim=128),
             "tiny": ModelShape(vocab_size=512, hidden_size=64, intermediate_size=160, num_layers=2, num_heads=4,
                                num_kv_heads=2, head_dim=16)}[model]
    parts = zero3_partitions(shape, world)
    params = [types.SimpleNamespace(partition_numel=lambda n=n: n) for n in parts]
    owner = types.SimpleNamespace(sub_group_size=size or 10**9)  # DeepSpeed's default sub_group_size: 1e9
    theirs = DeepSpeedZeroOptimizer_Stage3._create_fp16_sub_groups(owner, params)
    assert zero3_subgroups(parts, size) == [sum(p.partition_numel() for p in g) for g in theirs]


@pytest.mark.slow  # ~90 s (DeepSpeed's engine on CPU); fast siblings: test_pinned_blocks_of_the_h200_run_are_the_planners,
# test_subgroups_are_deepspeeds_own
@pytest.mark.parametrize("sub_group_size", [20_000])
def test_planner_lists_zero3_pinned_requests_as_deepspeed_makes_them(monkeypatch, sub_group_size):
    import deepspeed
    import torch
    from deepspeed.accelerator import get_accelerator
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}.items():
        monkeypatch.setenv(k, v)
    acc = get_accelerator()
    seen: list[int] = []
    real = acc.pin_memory

    def pin(tensor, *a, **kw):
        seen.append(tensor.numel() * tensor.element_size())
        return real(tensor, *a, **kw)

    monkeypatch.setattr(acc, "pin_memory", pin)
    cfg = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=160, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=512, num_hidden_layers=2, tie_word_embeddings=False)
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
          "zero_force_ds_cpu_optimizer": False,
          "zero_optimization": {"stage": 3, "sub_group_size": sub_group_size,
                                "offload_param": {"device": "cpu", "pin_memory": True},
                                "offload_optimizer": {"device": "cpu", "pin_memory": True}}}
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    try:
        handle = HfDeepSpeedConfig(ds)  # noqa: F841  (transformers builds the model under zero.Init through it)
        model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds)
        requests = list(seen)  # the engine's own; then one step, so that Adam's m and v exist, as at any save
        ids = torch.randint(0, 512, (1, 16))
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        # the snapshot of the rank's optimizer states as the async save takes it (training/async_save.stage)
        from training.async_save import Staging, stage

        staging = Staging()
        stage(engine.optimizer.state_dict(), staging)
        groups = [int(n) for n in engine.optimizer.fp16_partitioned_groups_flat_numel]
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    from planner.memory_model import zero3_pinned_requests

    shape = ModelShape.from_config(cfg.to_dict())
    planned = zero3_pinned_requests(shape, 1, 2, True, True, sub_group_size=sub_group_size)
    assert requests == planned
    # one model of the sub-groups: DeepSpeed's, the snapshot's (fp32 master, Adam's m and v of each, and nothing else
    # above a few bytes) and the plan's async-save term
    parts = zero3_partitions(shape, 1)
    assert groups == zero3_subgroups(parts, sub_group_size) and len(groups) > 1
    big = sorted(b.nbytes() for b in staging.buffers if b.nbytes() > 64)
    assert big == sorted(4 * g for g in groups for _ in range(3)), (big, groups)
    # the plan's host terms hold these blocks as the caching host allocator rounds them
    from dataclasses import replace

    import planner.zero3_host as zh
    from planner.memory_model import Features

    monkeypatch.setattr(zh, "ZERO_SUBGROUP", sub_group_size)
    est = estimate(shape, 64, 1, 1, replace(Features(), offload_params=True, offload_optimizer=True), "bf16",
                   async_save=True)
    pinned = est.cpu_per_rank["params (partition)"] + est.cpu_per_rank["grads fp32 (partition)"]
    assert pinned == sum(pinned_block_bytes(n) for n in requests)
    assert est.cpu_per_rank["async save: host copy of the rank's checkpoint"] == sum(big)


def test_chooser_counts_the_pinned_blocks_the_plan_table_counts():
    """memory_features auto's host figure (planner.auto_features._peaks, which bounds the ZeRO and checkpoint offloads
    by host_bytes_per_rank) holds ZeRO-3's pinned buffers as scripts/plan.py's table does (pinned_offloads: rounded
    blocks). Before, the chooser's estimate counted them as bytes (seen failing on the old tree: Llama-3-8B on 8 ranks,
    48.83 GiB of host per rank where the table counted 49.22, its 1.87 + 3.74 GiB ZeRO buffers held as 2 + 4)."""
    from planner.auto_features import _peaks
    from planner.memory_model import Features, load_shape

    shape = load_shape("llama3-8b")
    off = Features(offload_params=True, offload_optimizer=True, lean_rmsnorm=True, lean_mlp=True)
    f = Features(tiled_mlp=True, tiled_logits=True, checkpoint_every=1, offload_activations=True)
    _, host = _peaks(shape, 1 << 20, 8, 8, f, off, "bf16", "cuda")
    both = Features(tiled_mlp=True, tiled_logits=True, checkpoint_every=1, offload_activations=True,
                    offload_params=True, offload_optimizer=True, lean_rmsnorm=True, lean_mlp=True)
    table = estimate(shape, 1 << 20, 8, 8, both, "bf16", pinned_offloads=True, grad_accum="fp32")  # the Planner's
    assert host == sum(table.cpu_per_rank.values())
