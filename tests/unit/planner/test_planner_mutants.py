"""The planner's blind spots found by mutation (stop 71: 64 one-line mutants of planner/ and scripts/plan.py; 3
survived every test and 11 were killed only by checks comparing the planner with a saved copy of its own output,
which `scripts/doc_figures.py` makes pass again). Each expectation here is hand arithmetic from Llama-3-8B's shape,
not the planner's: the host memory bounded per node, not per rank; the page-locked column; tokens/s per GPU at sp > 1;
the recompute term that sets the 1-GPU headline length (at 32 chunks and unchunked); Hugging Face's norm backward; the
step's FLOPs at a fixed MFU and the checkpoint copies; the all-to-all launches. Each failed on its mutants in a
scratch clone (the audit's run). One process, < 1 s."""
import importlib.util
import os

import pytest

from planner import auto_features as af
from planner.auto_features import head_chunk_seconds, step_seconds
from planner.memory_model import Features, GiB, layer_phase_terms, load_shape

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), *[os.pardir] * 3))
_spec = importlib.util.spec_from_file_location("plan", os.path.join(ROOT, "scripts", "plan.py"))
plan = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plan)
LLAMA = load_shape("llama3-8b")
h, I, V, L, nh, nkv, d = 4096, 14336, 128256, 32, 32, 8, 128  # noqa: E741 (the intermediate size, as in the papers)


def test_recompute_of_a_checkpointed_layer_by_hand():
    T, b = 2**20, 2
    u = T * h * b
    # 32 chunks at sp 1: a chunk projects 1 q head and its 1 KV head (k and v): T*3*d*b, and their RoPE'd copies
    pre = T * 3 * d * b
    got = layer_phase_terms(LLAMA, T, 1, b, True, True, True, chunks=32, flash=True, checkpointed=True)["recompute"]
    assert got == u + 2 * u + 2 * pre  # incoming grad + attention's input/output + one chunk's projections x2
    # unchunked: the tiled MLP's forward: input+output, a tile (h rows) of gate, up, act, product and 3 [rows, h]
    got = layer_phase_terms(LLAMA, T, 1, b, True, True, True, chunks=1, flash=True, checkpointed=True)["recompute"]
    assert got == u + 2 * u + 4 * h * I * b + 3 * h * h * b


def test_hf_norm_backward_by_hand():
    T, b = 131072, 2
    u = T * h * b
    # Hugging Face's RMSNorm backward: 5 fp32 [T, h] temporaries beside the 3 [T, h] gradients (tiled MLP: none saved)
    assert layer_phase_terms(LLAMA, T, 1, b, True, False, True)["norm"] == 3 * u + 5 * T * h * 4


def test_compare_rows_by_hand():
    for r in plan.compare():
        rpn = r["gpus"] // r["nodes"]
        T = r["longest"] // r["sp"]
        ckpt = rpn * L * T * h * 2 / GiB  # every layer's checkpoint, offloaded in the arena, page-locked, per node
        assert ckpt <= r["page_locked_gib_per_node"] <= r["host_used_gib"]
        assert r["sp"] == r["gpus"]  # one SP group: tokens/s per GPU = length / step / GPUs
        assert r["measured_tokens_per_sec_per_gpu"] * r["step_s"] * r["gpus"] == pytest.approx(r["longest"])


def test_host_bounds_the_node_not_the_rank():
    # 8 GPUs, 1 TiB a node: the node's 8 ranks hold 32 layers' checkpoints of L/8 tokens each: L*32*h*2 B < 1 TiB
    rep = plan.plan(["--model", "llama3-8b", "--seq_len", "1M", "--alst", "--gpus_per_node", "8", "--cpu_mem_gb",
                     "1024", "--attention_head_chunks", "max", "--sp", "8"])
    longest = rep["plans"][0]["candidates"][0]["longest_fitting_seq_len"]
    assert 0 < longest < 1024 * GiB // (L * h * 2) == 4_194_304


def test_head_chunk_launches_by_hand(monkeypatch):
    f = Features(checkpoint_every=1, attention_head_chunks=4)
    s = 2**22
    with_launch = head_chunk_seconds(LLAMA, s, 8, f)
    monkeypatch.setattr(af, "A2A_LAUNCH_S", 0.0)
    # per layer 6n - 4 launches more (n = 4), + 2(n - 1) in each of the 32 checkpointed layers' recompute
    assert with_launch - head_chunk_seconds(LLAMA, s, 8, f) == pytest.approx((32 * 20 + 32 * 6) * 30e-6)


def test_step_seconds_counts_the_recompute_by_hand():
    s, m, peak = 2**20, 0.5, 989e12
    f = Features(tiled_mlp=True, tiled_logits=True, checkpoint_every=1, offload_activations=True, lean_rmsnorm=True,
                 lean_mlp=True, attention_head_chunks=32)
    layer = h * d * (nh + 2 * nkv) + nh * d * h + 3 * h * I + 2 * h
    model = 6 * (L * layer + V * h) * s + 6 * L * nh * d * s * s  # MFU's FLOPs, causal
    recompute = L * 2 * layer * s + L * 2 * nh * d * s * s  # every layer's forward again, its attention too
    recompute += L * 2 * 3 * h * I * s + 2 * V * h * s  # the tiled MLP's forward in backward, tiled logits' forward
    chunks = L * (2 * s * h * d * (nh + 2 * 32 * 1) + 3 * 2 * s * h * d * 2 * (32 - nkv))  # q/k/v again, extra KV heads
    t = step_seconds(LLAMA, s, 1, f, mfu=m, world=1, ranks_per_node=1)
    assert t["compute"] == pytest.approx((model + recompute + chunks) / (m * peak), rel=1e-9)
    assert t["copies"] == pytest.approx(2 * L * s * h * 2 / 25e9)  # each checkpoint to the host and back
