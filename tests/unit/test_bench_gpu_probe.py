"""bench/gpu_probe.py's Probe on its own events (no model): a phase whose closing event never came (what the dry
run's intermittent failure looks like: a stage without its `between` records) is named in the records' errors at the
next step's start and closed there, so the next step is measured whole; every record says which phases are open."""

from __future__ import annotations

import json

from bench.gpu_probe import Probe


def test_a_phase_left_open_is_named_and_closed_at_the_next_steps_start(tmp_path):
    path = tmp_path / "phases.jsonl"
    probe = Probe(str(path))
    step = [("open", "forward", 0), ("close", "forward", 0), ("open", "mlp_backward", 0), ("close", "mlp_backward", 0),
            ("open", "attention_backward", 0), ("close", "attention_backward", 0)]
    for ev in step[:3] + [("open", "mlp_backward", 0)] + step[3:]:  # one extra open: one close never comes
        probe.event(*ev)
    for ev in step:
        probe.event(*ev)
    probe.event("close", "exit", -1)
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    assert any("left open at a step's start: mlp_backward L0" in e for e in probe.errors), probe.errors
    second = recs[[i for i, r in enumerate(recs) if r["phase"] == "forward"][1]:]  # the second step's records
    assert [r["phase"] for r in second if r["phase"] == "between"] == ["between"] * 3  # its segments, and the exit's
    assert all(r["open"] == [] for r in second if r["phase"] == "between")
    assert recs[0]["open"] == [] and any(r["open"] == ["mlp_backward L0"] for r in recs)


def _stand_in_flash_attn(monkeypatch):
    """A `flash_attn` package laid out like 2.8.3: flash_attn_interface defines the functions, the package's
    __init__ re-exports the public ones (so `from flash_attn import flash_attn_func` binds the originals)."""
    import sys
    import types

    import torch

    fai = types.ModuleType("flash_attn.flash_attn_interface")
    fai.flash_attn_func = lambda q, k, v, *a, **kw: q
    fai.flash_attn_varlen_func = lambda q, k, v, *a, **kw: q
    fai._flash_attn_varlen_forward = lambda **kw: (kw["q"], torch.zeros(kw["q"].shape[1], kw["q"].shape[0]), None, None)
    pkg = types.ModuleType("flash_attn")
    pkg.__path__, pkg.__version__, pkg.flash_attn_interface = [], "2.8.3", fai
    pkg.flash_attn_func, pkg.flash_attn_varlen_func = fai.flash_attn_func, fai.flash_attn_varlen_func
    monkeypatch.setitem(sys.modules, "flash_attn", pkg)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", fai)


def test_flash_attn_calls_are_counted_by_every_name_they_are_imported_by(monkeypatch):
    """transformers imports FA2 from the package (`from flash_attn import flash_attn_varlen_func`,
    modeling_flash_attention_utils), the ring imports the private varlen op from flash_attn_interface at each call:
    all three are counted once per call."""
    import torch
    import torch.nn.functional as F

    from bench import gpu_probe
    from model_utils import ring_attention

    _stand_in_flash_attn(monkeypatch)
    monkeypatch.setattr(F, "scaled_dot_product_attention", F.scaled_dot_product_attention)  # undone after the test
    monkeypatch.setattr(gpu_probe, "KERNELS", {})
    gpu_probe.wrap_sdpa()  # what sitecustomize does before transformers is imported
    from flash_attn import flash_attn_func, flash_attn_varlen_func  # as transformers does

    q = torch.zeros(6, 2, 4)
    flash_attn_varlen_func(q, q, q)
    flash_attn_func(q[None], q[None], q[None])
    ring_attention._fa_forward(q, q, q, None, None, 6, 6, 0.5, True, -1)  # the ring's flash block call
    gpu_probe.wrap_sdpa()  # a second wrap counts nothing twice
    flash_attn_varlen_func(q, q, q)
    got = {k: v["calls"] for k, v in gpu_probe.KERNELS.items()}
    assert got == {"flash_attn:flash_attn_varlen_func": 2, "flash_attn:flash_attn_func": 1,
                   "flash_attn:_flash_attn_varlen_forward": 1}, got
    assert gpu_probe.KERNELS["flash_attn:_flash_attn_varlen_forward"]["first"] == [[6, 2, 4]] * 3 + ["float32"]
