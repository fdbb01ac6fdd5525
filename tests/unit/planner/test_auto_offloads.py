"""ZeRO-3 offloads under `memory_features: auto` (planner/auto_features.py: offload_seconds, choose(free_offloads)):
offload only where it is needed or pays, the choice reaching the stage's DeepSpeed overrides, a pinned offload and
the JSON's ceiling, and the plan lines saying which and why. The chooser's other features: test_auto_features.py."""

from __future__ import annotations

from dataclasses import replace

import pytest

from planner import auto_features as af
from planner.memory_model import Features, GiB, logits_tile_bytes
from tests.unit.planner.test_auto_features import OFF, SHAPE, SL, WORLD, budget_for, cands
from training.config import Config, StageConfig
from training.curriculum import resolve_stages
from training.engine import stage_config

FREE = ("offload_params", "offload_optimizer")
LEAN = Features(lean_rmsnorm=True, lean_mlp=True)  # no ZeRO offload: what auto starts from when both are free


def lean_peak(offloads: Features, sp: int = 2) -> int:
    """The leanest candidate's predicted peak with these ZeRO offloads, just under the budget that peak needs: head
    chunk counts included, and tiled logits in the tiles choose sizes from that budget (with the norms' outputs
    recomputed, the logits phase binds the leanest sets at some budgets, so the tile size moves the peak)."""
    peak = min(af.peak_bytes(SHAPE, SL, sp, WORLD, f, offloads, "bf16", "cuda") for f in cands(sp))
    for _ in range(4):  # the tile follows the budget, the budget the peak: a fixed point in a step or two
        tile = logits_tile_bytes(budget_for(peak) - 2**20) // 2**20
        peak = min(af.peak_bytes(SHAPE, SL, sp, WORLD, replace(f, logits_tile_mb=tile) if f.tiled_logits else f,
                                 offloads, "bf16", "cuda") for f in cands(sp))
    return peak


def pick_free(budget: int, **kw) -> af.Choice:
    return af.choose(SHAPE, SL, WORLD, budget, sp=2, sp_max=8, offloads=replace(OFF, lean_rmsnorm=True, lean_mlp=True),
                     free_offloads=FREE, **kw)


def test_offload_cost_model_by_hand():
    """Optimizer offload: CPU Adam over the rank's N/W parameters (28 + b bytes each, the node's CPU Adam
    throughput shared by its ranks) + the gradient partition to the host every micro-step + the updated parameters
    back; parameter offload: the partition to the device for forward, backward and the recompute of the
    checkpointed layers' share; nothing on a CPU run."""
    n, b, pcie, rpn = SHAPE.num_params() / WORLD, 2, af.PCIE_BYTES_PER_S, 8
    adam = n * (28 + b) / (af.CPU_ADAM_BYTES_PER_S / rpn)
    opt = Features(offload_optimizer=True)
    assert af.offload_seconds(SHAPE, WORLD, opt) == pytest.approx(adam + n * b / pcie + n * b / pcie)
    assert af.offload_seconds(SHAPE, WORLD, opt, accum=4) == pytest.approx(adam + 4 * n * b / pcie + n * b / pcie)
    prm = Features(offload_params=True, checkpoint_every=2)  # 16 of 32 layers recomputed: 2.5 passes
    assert af.offload_seconds(SHAPE, WORLD, prm) == pytest.approx(2.5 * n * b / pcie + n * b / pcie)
    both = Features(offload_params=True, offload_optimizer=True)  # Adam writes the parameters on the host
    assert af.offload_seconds(SHAPE, WORLD, both) == pytest.approx(adam + n * b / pcie + 2 * n * b / pcie)
    assert af.offload_seconds(SHAPE, WORLD, both, device="cpu") == 0.0
    assert 0.3 < adam < 1.0  # ~0.6 s per step for Llama-3-8B on 32 ranks, 8 per node (the estimate's order)
    t = af.step_seconds(SHAPE, SL, 2, Features(offload_optimizer=True), world=WORLD)
    assert t["total"] == pytest.approx(t["compute"] + t["offload"]) and t["compute"] == t["base"] > 20  # FLOP model
    speed = af.relative_speed(SHAPE, SL, 2, opt, world=WORLD)
    assert speed == pytest.approx(t["base"] / t["total"]) and speed < 1.0
    assert af.relative_speed(SHAPE, SL, 2, opt, device="cpu", world=WORLD) == 1.0


def test_experts_a_token_does_not_use_add_no_recompute_time():
    """A checkpointed MoE layer's recompute runs each token through its routed experts, as its first forward did:
    gpt-oss-20b with 32 or 128 experts (4 routed per token) computes the same but for the router's wider output
    (0.05%), only the offloads grow. Before, step_seconds charged every expert's weights to the recompute: 10.5 s of
    compute at 128 experts against 5.7 at 32."""
    from planner.memory_model import ModelShape
    from planner.presets import PRESETS

    f = Features(checkpoint_every=1, keep_attention=True, offload_optimizer=True)
    times = [af.step_seconds(ModelShape.from_config(dict(PRESETS["gpt-oss-20b"], num_local_experts=n)), 131072, 8, f,
                             world=8) for n in (32, 128)]
    assert times[0]["compute"] == pytest.approx(times[1]["compute"], rel=1e-3), times
    assert times[0]["compute"] > times[0]["base"] and times[1]["offload"] > times[0]["offload"]


def test_offload_only_when_needed_or_it_pays(monkeypatch):
    roomy = budget_for(af.peak_bytes(SHAPE, SL, 2, WORLD, Features(), LEAN, "bf16", "cuda"))
    c = pick_free(roomy)  # the plain step fits without offload: nothing offloaded, nothing recomputed
    assert (c.features, c.offload_params, c.offload_optimizer) == (Features(), False, False)
    assert c.offload_why.startswith("fits: ") and c.offload_step_s == 0.0 and c.relative_speed == 1.0
    # 1 MiB short of the leanest set without offload: an offload is needed, and the choice fits
    without = lean_peak(LEAN)
    c = pick_free(budget_for(without) - 2**20)
    assert c.offload_params or c.offload_optimizer
    assert c.offload_why.startswith(f"needed: {without / GiB:.1f} GiB without") and c.offload_step_s > 0
    assert c.peak_bytes <= c.budget_bytes * (1 - af.HEADROOM)
    with pytest.raises(ValueError, match="nothing fits"):  # below the leanest with both offloads
        pick_free(budget_for(lean_peak(replace(LEAN, offload_params=True, offload_optimizer=True))) - 2**20)
    # 40 GB: without offload only full recompute fits; the optimizer's 3.5 GiB let checkpointing keep the
    # attention output, which saves more than CPU Adam costs, even counted twice
    mid = 38 * GiB
    c = pick_free(mid)
    c0 = af.choose(SHAPE, SL, WORLD, mid, sp=2, offloads=LEAN, ranks_per_node=8)  # offload not allowed
    assert c.offload_optimizer and not c.offload_params and c.offload_why.startswith("pays: ")
    assert c.relative_speed > c0.relative_speed and not (c0.offload_params or c0.offload_optimizer)
    assert f"{c0.relative_speed:.3f} without" in c.offload_why
    # a CPU Adam slow enough that the offload saves 1/4 of the recompute time it lets auto drop: still faster on
    # the estimate, but not if the offload took twice as long: not taken (the margin for the estimate)
    compute_with, compute_without = c.step_s - c.offload_step_s, c0.step_s
    adam = SHAPE.num_params() / WORLD * 30 / (af.CPU_ADAM_BYTES_PER_S / 8)
    slower = (0.75 * (compute_without - compute_with) - (c.offload_step_s - adam)) / adam  # CPU Adam's new time / old
    monkeypatch.setattr(af, "CPU_ADAM_BYTES_PER_S", af.CPU_ADAM_BYTES_PER_S / slower)
    nominal = af.relative_speed(SHAPE, SL, 2, replace(c.features, offload_optimizer=True), world=WORLD)
    assert nominal > c0.relative_speed
    slow = pick_free(mid)
    assert not (slow.offload_params or slow.offload_optimizer) and slow.features == c0.features
    assert slow.offload_why.startswith("fits: ")


def _gpu_stages(ds: str, budget: int, overrides: dict | None = None, device: str = "cuda", **kw):
    cfg = Config(model_name_or_path="llama3-8b", deepspeed=f"ds_configs/{ds}", bf16=True, max_seq_length=SL,
                 sequence_parallel_size=2, memory_features="auto", gpus_per_node=8,
                 stages=[StageConfig(name="a", max_steps=1, deepspeed_overrides=overrides or {})], **kw)
    return cfg, resolve_stages(cfg, lambda sp: WORLD // sp, budget=lambda: (device, budget))


def test_offload_choice_reaches_the_stage_overrides_and_deepspeed():
    """The choice is the stage's deepspeed_overrides (merged into the user's own), which build_ds_config turns into
    the engine's config: DeepSpeed parses offload "none" as off; memory_choice records what and why."""
    from deepspeed.runtime.config import DeepSpeedConfig

    from base.parallel import ParallelDims
    from training.ds_config import _OneReplica, build_ds_config

    roomy = budget_for(af.peak_bytes(SHAPE, SL, 2, WORLD, Features(), LEAN, "bf16", "cuda"))
    user = {"zero_optimization": {"stage3_max_live_parameters": 100000000}}
    cfg, (st,) = _gpu_stages("zero3_offload.json", roomy, user)
    assert st.deepspeed_overrides == {"zero_optimization": {"stage3_max_live_parameters": 100000000,
                                                            "offload_param": {"device": "none"},
                                                            "offload_optimizer": {"device": "none"}}}
    c = st.memory_choice
    assert (c["offload_params"], c["offload_optimizer"], c["offload_step_s"]) == (False, False, 0.0)
    assert c["offload_why"].startswith("fits: ") and c["offload_auto"] == list(FREE)
    ds = build_ds_config(stage_config(cfg, st), ParallelDims(world=WORLD, sp=2, rank=0, local_rank=0), True,
                         SHAPE.hidden_size, st.deepspeed_overrides, planning=True, quiet=True)
    zc = DeepSpeedConfig({**ds, "train_batch_size": 1}, mpu=_OneReplica()).zero_config
    assert (zc.offload_param.device, zc.offload_optimizer.device) == ("none", "none")
    assert zc.max_live_parameters == 100000000  # the user's override survives the merge
    _, (tight,) = _gpu_stages("zero3_offload.json", budget_for(lean_peak(LEAN)) - 2**20)
    zero = tight.deepspeed_overrides["zero_optimization"]
    t = tight.memory_choice
    assert {zero["offload_param"]["device"], zero["offload_optimizer"]["device"]} >= {"cpu"}
    assert zero["offload_optimizer"]["device"] == ("cpu" if t["offload_optimizer"] else "none")
    assert zero["offload_param"]["device"] == ("cpu" if t["offload_params"] else "none")
    assert t["offload_why"].startswith("needed: ") and t["offload_step_s"] > 0


def test_pinned_offload_and_the_json_ceiling():
    """An offload a stage's deepspeed_overrides names stays as written; an offload the JSON leaves off is never
    added (a budget that needs one fails in one line); a CPU run keeps the config's setting untouched."""
    roomy = budget_for(af.peak_bytes(SHAPE, SL, 2, WORLD, Features(), LEAN, "bf16", "cuda"))
    pin = {"zero_optimization": {"offload_optimizer": {"device": "cpu", "pin_memory": True}}}
    _, (st,) = _gpu_stages("zero3_offload.json", roomy, pin)
    assert st.memory_choice["offload_optimizer"] and not st.memory_choice["offload_params"]  # pinned on, room left
    assert st.deepspeed_overrides["zero_optimization"] == {"offload_optimizer": {"device": "cpu", "pin_memory": True},
                                                           "offload_param": {"device": "none"}}
    assert st.memory_choice["offload_auto"] == ["offload_params"]
    assert "optimizer pinned to cpu by the stage's deepspeed_overrides" in st.memory_choice["offload_why"]
    # the JSON without offload: auto may not add one, even where only an offload would fit
    need = budget_for(lean_peak(LEAN)) - 2**20
    with pytest.raises(ValueError, match="stage 0 .*nothing fits"):
        _gpu_stages("zero3.json", need)
    _, (plain,) = _gpu_stages("zero3.json", roomy)
    assert plain.deepspeed_overrides == {} and "does not offload params or optimizer" in plain.memory_choice["offload_why"]
    # a CPU run: the config's offloads, no override, whatever the budget
    for ds, on in (("zero3_offload.json", True), ("zero3.json", False)):
        _, (cpu,) = _gpu_stages(ds, 4 * roomy, device="cpu")
        assert cpu.deepspeed_overrides == {}
        assert (cpu.memory_choice["offload_params"], cpu.memory_choice["offload_optimizer"]) == (on, on)
        assert "CPU run" in cpu.memory_choice["offload_why"] and cpu.memory_choice["offload_step_s"] == 0.0


def test_plan_lines_say_which_offloads_and_why():
    from training.summary import plan_lines

    roomy = budget_for(af.peak_bytes(SHAPE, SL, 2, WORLD, Features(), LEAN, "bf16", "cuda"))
    usable = roomy * (1 - af.HEADROOM) / GiB
    cfg, stages = _gpu_stages("zero3_offload.json", roomy)
    text = "\n".join(plan_lines(cfg, stages, WORLD, 8, True))
    peak_gb = stages[0].memory_choice["predicted_peak_gb"]
    assert f"      offload: none (fits: {peak_gb:.1f} of {usable:.1f} GiB usable)" in text
    assert " 0 GiB CPU per node" in text  # the memory plan follows the choice: nothing offloaded
    need = budget_for(lean_peak(LEAN)) - 2**20
    cfg, stages = _gpu_stages("zero3_offload.json", need)
    c = stages[0].memory_choice
    line = [ln for ln in plan_lines(cfg, stages, WORLD, 8, True) if "offload: " in ln]
    on = af.describe_offloads(c["offload_params"], c["offload_optimizer"])
    assert len(line) == 1 and line[0].startswith(f"      offload: {on} (needed: {lean_peak(LEAN) / GiB:.1f} GiB "
                                                 "without")
    assert f"> {need * (1 - af.HEADROOM) / GiB:.1f} GiB usable; costs {c['offload_step_s']:.2f} s of a " in line[0]
    cfg, stages = _gpu_stages("zero3_offload.json", roomy, device="cpu")
    assert "offload: params, optimizer (the DeepSpeed config's: a CPU run moves nothing between memories)" in \
        "\n".join(plan_lines(cfg, stages, WORLD, 8, True))


def test_the_agreed_host_budget_reaches_the_chooser():
    """Start-up gives memory_features auto the host memory a rank's offloads may take (training/curriculum.agreed_budget:
    the job's available memory on the node over its ranks, less 2 GiB of runtime, the minimum over ranks), as plan.py
    gives its own: a stage whose GPU budget needs the ZeRO offloads is refused in one line where the host cannot hold
    them, and planned where it can. Before, start-up never passed a host budget (the stage was planned either way)."""


    tight = budget_for(lean_peak(LEAN)) - 2**20  # the offloads are needed

    def with_host(host):
        b = lambda: ("cuda", tight)  # noqa: E731
        b.host_bytes = lambda: host
        cfg = Config(model_name_or_path="llama3-8b", deepspeed="ds_configs/zero3_offload.json", bf16=True,
                     max_seq_length=SL, sequence_parallel_size=2, memory_features="auto", gpus_per_node=8,
                     stages=[StageConfig(name="a", max_steps=1)])
        return resolve_stages(cfg, lambda sp: WORLD // sp, budget=b)

    (st,) = with_host(None)
    assert st.memory_choice["offload_why"].startswith("needed: ")
    (st,) = with_host(1 << 50)
    assert st.memory_choice["offload_why"].startswith("needed: ")
    with pytest.raises(ValueError, match="nothing fits"):
        with_host(2**20)

def test_the_host_budget_is_the_nodes_own_on_a_gpu_run_only(monkeypatch):
    """agreed_budget reads the job's host memory on a real GPU run (the node it plans for: available // ranks per node
    - 2 GiB), and not on a dry run or a GPU plan made on a machine without a GPU: there this machine's memory would
    bound the target's offloads (the Llama-3-8B recipe's dry run at --gpu_mem_gb 24 on a 24 GiB CPU box was refused
    'nothing fits' with 7.09 of 19.8 GiB needed)."""
    from types import SimpleNamespace

    import torch

    from base import host
    from training.curriculum import agreed_budget

    monkeypatch.setattr(host, "job_memory_available", lambda: 100 * 2**30)
    cfg = SimpleNamespace(gpu_mem_gb=80.0, mem_cap_gb=0.0, gpus_per_node=8, dry_run=False, attn_implementation="sdpa")
    b = agreed_budget(cfg)  # one process: no collective
    assert b()[0] == "cuda" and b.host_bytes() is None  # no GPU here: not the node it plans for
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    b = agreed_budget(cfg)
    from planner.cluster import RUNTIME_HOST_GIB

    assert b.host_bytes() == 100 * 2**30 // 8 - int(RUNTIME_HOST_GIB * 2**30)  # the measured runtime per rank
    b = agreed_budget(SimpleNamespace(**{**vars(cfg), "dry_run": True}))
    assert b.host_bytes() is None


def test_whether_every_rank_runs_flash_is_agreed(monkeypatch):
    """The ring's kernel is flash-attn: a node without it (another container or venv) planned no ring while the
    others planned one (other cp groups: a hang, or a refusal on the nodes that have it). Whether every rank has it is
    the minimum over ranks, taken with the memory budget."""
    from types import SimpleNamespace

    import torch

    from base import comm
    from training import curriculum

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(curriculum, "_gpu_without_flash", lambda cfg: False)  # this rank has flash-attn
    cfg = SimpleNamespace(gpu_mem_gb=80.0, mem_cap_gb=0.0, gpus_per_node=8, dry_run=True, attn_implementation="auto")
    assert curriculum.agreed_budget(cfg).without_flash() is False
    monkeypatch.setattr(comm, "all_reduce", lambda vals, op: torch.tensor([*vals[:2], 0.0]))  # another rank has none
    assert curriculum.agreed_budget(cfg).without_flash() is True
