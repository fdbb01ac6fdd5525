"""Issue 43 item 1, the runtime side: pinned host memory held at its exact size (base/host_arena.py), not as torch's
caching host allocator holds it (each block rounded up to a power of two, cached for the run).

No CUDA here: a stand-in for cudaHostRegister / cudaHostUnregister that behaves as the CUDA runtime does (error codes,
no overlapping or double registration, no unregistering of what was not registered, nothing left registered at the
end) records every call, and the arena's bookkeeping runs on real pageable memory. The offload hook and the async
save's staging are driven down their GPU path with CPU tensors (their `_STAYS` / `_HOST` emptied). Each test < 1 s.
"""

from __future__ import annotations

import gc
import types

import pytest
import torch

from base import host_arena
from planner import memory_model
from planner.memory_model import GiB, estimate, load_shape, pinned_block_bytes

# cudaError_t values the stand-in returns where the CUDA runtime does
INVALID_VALUE, ALREADY_REGISTERED, NOT_REGISTERED, NOT_SUPPORTED = 1, 712, 713, 801


class StandInRegistrar:
    """cudaHostRegister / cudaHostUnregister as the runtime answers them: 0, or the error for a zero size, for a range
    overlapping one already registered (pages are the unit), for unregistering a pointer that is not a registration's
    start; `refuse`: every registration fails with that code (a platform without it)."""

    PAGE = 4096

    def __init__(self, refuse: int = 0):
        self.live: dict[int, int] = {}
        self.calls: list[tuple] = []
        self.refuse = refuse

    def register(self, ptr: int, nbytes: int) -> int:
        self.calls.append(("register", ptr, nbytes))
        if self.refuse:
            return self.refuse
        if nbytes <= 0:
            return INVALID_VALUE
        lo, hi = ptr // self.PAGE, -(-(ptr + nbytes) // self.PAGE)
        for p, n in self.live.items():
            if lo < -(-(p + n) // self.PAGE) and p // self.PAGE < hi:
                return ALREADY_REGISTERED
        self.live[ptr] = nbytes
        return 0

    def unregister(self, ptr: int) -> int:
        self.calls.append(("unregister", ptr))
        return 0 if self.live.pop(ptr, None) is not None else NOT_REGISTERED


@pytest.fixture
def reg(monkeypatch):
    """The stand-in in place of the CUDA runtime, and the module's process-wide state fresh for the test."""
    stand_in = StandInRegistrar()
    monkeypatch.setattr(host_arena, "REGISTRAR", stand_in)
    monkeypatch.setattr(host_arena, "STATS", dict.fromkeys(host_arena.STATS, 0))
    for name in ("_LOCKED", "_FALLBACK"):
        monkeypatch.setattr(host_arena, name, {})
    monkeypatch.setattr(host_arena, "_FAILED", [])
    yield stand_in


def _step(arena: host_arena.HostArena, shapes, dtype=torch.bfloat16) -> list[torch.Tensor]:
    """One step's checkpoints: each taken from the arena and held (as autograd holds them) until the caller drops
    the list (the backward consumed them)."""
    held = []
    for i, shape in enumerate(shapes):
        t = arena.take(shape, dtype)
        t.fill_(i)
        held.append(t)
    return held


def test_exact_bytes_for_checkpoint_sizes_where_torch_would_round(reg):
    """Checkpoints of [1, T/sp, h] for a sequence of lengths (the stages of a curriculum, one at a time): the arena
    holds exactly their bytes, each registered once at a page-aligned start with its exact size; torch's pinned
    blocks would hold each rounded up to a power of two (planner.memory_model.pinned_block_bytes)."""
    h, layers = 96, 3
    for tokens in (1000, 3000, 5000, 20_000):
        arena = host_arena.HostArena("activation checkpoints")
        held = _step(arena, [(1, tokens, h)] * layers)
        nbytes = tokens * h * 2
        assert arena.nbytes == layers * nbytes == host_arena.STATS["registered_bytes"]
        registered = [c for c in reg.calls if c[0] == "register"][-layers:]
        assert [c[2] for c in registered] == [nbytes] * layers
        assert all(c[1] % host_arena.PAGE == 0 for c in registered)
        assert layers * pinned_block_bytes(nbytes) > arena.nbytes  # what the old path held
        assert [t.is_contiguous() and t.dtype == torch.bfloat16 and t.shape == (1, tokens, h) for t in held] == \
            [True] * layers
        del held
        arena.release()
    assert host_arena.STATS["registered_bytes"] == 0 and not reg.live


def test_slots_are_reused_across_steps_and_never_grow(reg):
    """Three steps of the same shapes: the first registers one slot per checkpoint, the next two reuse the same
    memory (same addresses, no new registration); a checkpoint still held (a step whose backward has not dropped it)
    is never handed out again: a second slot of its size comes instead; two dtypes of one size share no slot."""
    arena = host_arena.HostArena("activation checkpoints")
    shapes = [(1, 700, 64)] * 4 + [(1, 350, 64)]
    first = _step(arena, shapes)
    ptrs = sorted(t.data_ptr() for t in first)
    size, n_reg = arena.nbytes, len(reg.calls)
    del first
    for _ in range(2):
        again = _step(arena, shapes)
        assert sorted(t.data_ptr() for t in again) == ptrs and arena.nbytes == size and len(reg.calls) == n_reg
        assert [int(t.flatten()[0]) for t in again] == list(range(len(shapes)))
        del again
    kept = arena.take((1, 350, 64), torch.bfloat16)  # held across the next step
    nxt = _step(arena, shapes)
    assert kept.data_ptr() not in {t.data_ptr() for t in nxt}
    assert arena.nbytes == size + 350 * 64 * 2 and len(reg.calls) == n_reg + 1
    other = arena.take((1, 700, 32), torch.float32)  # 700 * 64 * 2 bytes too, another dtype
    assert other.data_ptr() not in ptrs
    del kept, nxt, other
    arena.release()


def test_release_unregisters_everything_and_views_stay_valid(reg):
    """release() (and the arena's end with its model, at stage end) unregisters every slot; a tensor still viewing one
    keeps its values in plain pageable memory; the stand-in then holds nothing and a new arena registers afresh."""
    arena = host_arena.HostArena("activation checkpoints")
    held = _step(arena, [(2, 500, 32)] * 3)
    assert len(reg.live) == 3
    arena.release()
    assert not reg.live and host_arena.STATS["registered_bytes"] == 0 and arena.nbytes == 0
    assert [int(t[1, 499, 31]) for t in held] == [0, 1, 2]
    del held
    gone = host_arena.HostArena("activation checkpoints")  # dropped with its owner: released by its finalizer
    _ = _step(gone, [(1, 100, 32)] * 2)
    del _
    assert len(reg.live) == 2
    del gone
    gc.collect()
    assert not reg.live and host_arena.STATS["registered_bytes"] == 0


def test_registration_failure_falls_back_to_pinned_blocks_with_one_warning(reg, monkeypatch, capsys):
    """A platform that refuses cudaHostRegister: one warning line naming the failure and the cost, the old pinned
    path from then on (no second registration tried, no second line), and STATS / path() saying which path ran."""
    reg.refuse = NOT_SUPPORTED
    pinned = []

    def pin(nbytes):  # torch's pinned path (no CUDA here): recorded, pageable
        pinned.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    monkeypatch.setattr(host_arena, "_pinned", pin)
    arena = host_arena.HostArena("activation checkpoints")
    held = _step(arena, [(1, 300, 64)] * 3)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cudaHostRegister" in err[0] and f"cudaError {NOT_SUPPORTED}" in err[0] and "2x" in err[0]
    assert len([c for c in reg.calls if c[0] == "register"]) == 1 and not reg.live
    assert pinned == [300 * 64 * 2] * 3 and host_arena.path() == "pinned-fallback"
    assert host_arena.STATS["fallbacks"] == 3 and host_arena.STATS["fallback_pinned_bytes"] == 3 * 300 * 64 * 2
    del held
    assert [t.data_ptr() for t in _step(arena, [(1, 300, 64)] * 3)] and pinned == [300 * 64 * 2] * 3  # reused
    arena.release()
    assert host_arena.STATS["fallback_pinned_bytes"] == 0 and not reg.calls[1:]


def _model():
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=256, num_hidden_layers=3, tie_word_embeddings=False)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float().train()


def _grads(model, sl=48):
    ids = torch.randint(0, 256, (1, sl), generator=torch.Generator().manual_seed(3))
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out.loss.item(), grads


def test_offloaded_checkpoints_go_to_the_models_arena(reg, monkeypatch):
    """--offload_activations down its GPU path (CPU tensors treated as device tensors): every checkpointed layer's
    saved input goes to an exact-size registered slot of the model's arena, the loss and gradients are the plain
    model's, the second step registers nothing new, and the model's end releases the slots. On the old code the hook
    pinned each through torch's caching host allocator (rounded) and the model had no arena."""
    from model_utils import memory

    monkeypatch.setattr(memory, "_STAYS", ())
    opts = types.SimpleNamespace(tiled_mlp=False, tiled_logits=False, gradient_checkpointing=True, checkpoint_every=0,
                                 offload_activations=True, lean_rmsnorm=False, keep_attention=False, lean_mlp=False)
    plain_loss, plain = _grads(_model())
    model = _model()
    memory.apply_memory_features(model, opts)
    packed = []
    real = memory._to_host
    monkeypatch.setattr(memory, "_to_host", lambda t, arena=None: packed.append(t.nbytes) or real(t, arena))
    loss, grads = _grads(model)
    arena = model._host_arena
    assert loss == plain_loss and all(torch.equal(grads[n], g) for n, g in plain.items())
    assert len(packed) >= 3 and 48 * 64 * 4 in packed  # at least each layer's hidden-state input, fp32
    assert arena.nbytes == sum(packed) == host_arena.STATS["registered_bytes"] and len(reg.live) == len(packed)
    n_reg, first = len(reg.calls), list(packed)
    packed.clear()
    assert _grads(model)[0] == plain_loss and packed == first  # the same checkpoints again ...
    assert len(reg.calls) == n_reg and arena.nbytes == sum(first)  # ... in the same slots
    del model, arena
    gc.collect()
    assert not reg.live and host_arena.STATS["registered_bytes"] == 0


def test_async_save_staging_of_gpu_states_is_registered_at_exact_size(reg, monkeypatch):
    """Staging of GPU-resident states (their storages treated as device ones): one registered buffer of each
    storage's exact size, reused by the next snapshot of the same shapes (no registration), a storage whose size
    changed gets a new one and the old is unregistered; the staged bytes equal the state's. On the old code each
    buffer was pin_memory()'d through torch's caching host allocator (rounded; on this CPU-only torch, an error)."""
    from training import async_save

    monkeypatch.setattr(async_save, "_HOST", ())
    state = {"master": torch.arange(3000, dtype=torch.float32), "m": torch.ones(3000), "v": torch.zeros(1000)}
    staging = async_save.Staging()
    snap = async_save.stage(state, staging)
    sizes = [12000, 12000, 4000]
    assert [c[2] for c in reg.calls if c[0] == "register"] == sizes and staging.nbytes == sum(sizes)
    assert host_arena.STATS["registered_bytes"] == sum(sizes) and all(torch.equal(snap[k], state[k]) for k in state)
    staging.reset()
    state["master"] += 1
    snap = async_save.stage(state, staging)
    assert len(reg.calls) == 3 and torch.equal(snap["master"], state["master"])
    staging.reset()
    state["v"] = torch.zeros(2000)
    async_save.stage(state, staging)
    assert reg.calls[3][::2] == ("register", 8000) and reg.calls[4:] == [("unregister", reg.calls[2][1])]
    assert host_arena.STATS["registered_bytes"] == 12000 * 2 + 8000 == sum(reg.live.values())


def test_the_plan_counts_the_arena_and_8_gpus_pass_the_host_bound(monkeypatch):
    """The planner counts the arena's exact bytes (HOST_ARENA): Llama-3-8B at 5M tokens on 8 GPUs holds 32 x 4.77 GiB
    of checkpoints per rank, not 32 x 8; the rank's async-save copy of GPU states is exact too; and plan.py --compare's
    8-GPU row, capped by the 2 TiB node at 4,194,304 tokens under pinned blocks, now goes past it."""
    import importlib.util
    import os

    llama = load_shape("llama3-8b")
    alst = memory_model.Features(offload_optimizer=True, tiled_mlp=True, tiled_logits=True, checkpoint_every=1,
                                 offload_activations=True, lean_rmsnorm=True, lean_mlp=True)
    hid = memory_model.tokens_per_rank(5_000_000, 8) * llama.hidden_size * 2
    est = estimate(llama, 5_000_000, 8, 8, alst, gpus_per_node=8)
    assert est.cpu_per_rank["activation checkpoints"] == 32 * hid < 32 * 8 * GiB and est.cpu_per_node < 2048 * GiB
    gpu_states = memory_model.Features(tiled_mlp=True, tiled_logits=True, checkpoint_every=1)
    groups = memory_model.zero3_subgroups(memory_model.zero3_partitions(llama, 8))
    snap = estimate(llama, 65536, 8, 8, gpu_states, async_save=True).cpu_per_rank
    assert snap["async save: host copy of the rank's checkpoint"] == 3 * 4 * sum(groups)
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), *[os.pardir] * 3))
    spec = importlib.util.spec_from_file_location("plan", os.path.join(root, "scripts", "plan.py"))
    plan = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plan)
    eight = next(r for r in plan.compare() if r["gpus"] == 8)
    assert eight["host_used_gib"] <= eight["host_gib_per_node"]
    assert eight["longest"] > 4_194_304, eight
    monkeypatch.setattr(memory_model, "HOST_ARENA", False)  # as pinned blocks (the fallback): the node's bound again
    assert next(r for r in plan.compare() if r["gpus"] == 8)["longest"] <= 4_194_304


def test_release_engine_unregisters_the_models_arena_while_the_model_lives(reg):
    """A stage's end (training.engine.release_engine) unregisters the offloaded checkpoints' slots at once, even where
    something still holds the model (a caller's reference, a cycle not yet collected): on the old code they stayed
    page-locked until the model's collection, 153 GiB a rank at 5M tokens on 8 GPUs. The step's metrics then name the
    path (training.stage_records._host_fields): the registered bytes while the slots live, nothing after the release."""
    from training.engine import release_engine
    from training.stage_records import _host_fields

    model = torch.nn.Linear(2, 2)
    arena = model.__dict__.setdefault("_host_arena", host_arena.HostArena("activation checkpoints"))
    held = _step(arena, [(1, 256, 64)] * 2)
    del held
    assert _host_fields() == {"host_registered_gb": round(2 * 256 * 64 * 2 / 2**30, 3),
                              "host_fallback_pinned_gb": 0.0, "host_fallbacks": 0}
    engine = types.SimpleNamespace(module=model, destroy=lambda: None)
    release_engine(engine)
    assert model._host_arena is arena  # the model is still alive ...
    assert not reg.live and host_arena.STATS["registered_bytes"] == 0  # ... and nothing of it is page-locked
    assert _host_fields() == {}
