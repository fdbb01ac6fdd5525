"""ZeRO-3's gradient partition buffer in the accumulation dtype (data_types.grad_accum_dtype: fp32 by default under
bf16, training/ds_config.build_ds_config): +2 B per parameter / world on the GPU (Llama-3-8B on 32 ranks: +0.5 GB a
rank), on the host with the optimizer offloaded. Before: the planner counted it in the model's dtype whatever the key
said, so a plan of a run with fp32 accumulation was ~0.5 GB a rank short (8B, 32 ranks; 3 GiB on one GPU's 2-layer)."""

from __future__ import annotations

import importlib.util
import os

from planner import auto_features as af
from planner.memory_model import GRAD_ACCUM_DEFAULT, Features, estimate, load_shape
from planner.zero3_host import zero3_partitions

LLAMA = load_shape("llama3-8b")
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), *[os.pardir] * 3))


def test_the_gradient_partition_is_counted_in_the_accumulation_dtype():
    f = Features(tiled_mlp=True, tiled_logits=True, gradient_checkpointing=True)
    bf16 = estimate(LLAMA, 1 << 20, 8, 32, f, "bf16", grad_accum="bf16")
    fp32 = estimate(LLAMA, 1 << 20, 8, 32, f, "bf16", grad_accum="fp32")
    n = LLAMA.num_params()
    assert fp32.gpu["grads (partition)"] - bf16.gpu["grads (partition)"] == 4 * n // 32 - 2 * n // 32
    assert 0.45e9 < fp32.gpu_peak - bf16.gpu_peak < 0.55e9  # ~0.5 GB a rank
    assert estimate(LLAMA, 1 << 20, 8, 32, f, "bf16").gpu["grads (partition)"] == bf16.gpu["grads (partition)"]
    # optimizer offloaded: the flat accumulation buffer is the host's (pinned blocks rounded; pageable here)
    off = Features(offload_optimizer=True, gradient_checkpointing=True)
    host = {a: estimate(LLAMA, 1 << 16, 1, 1, off, "bf16", device="cpu", grad_accum=a).cpu_per_rank for a in ("bf16", "fp32")}
    assert host["fp32"]["grads fp32 (partition)"] - host["bf16"]["grads fp32 (partition)"] == 2 * sum(zero3_partitions(LLAMA, 1))


def test_what_plans_a_run_counts_the_default():
    assert GRAD_ACCUM_DEFAULT == "fp32"
    f = Features(tiled_mlp=True, tiled_logits=True, gradient_checkpointing=True)
    want = estimate(LLAMA, 1 << 20, 8, 32, f, "bf16", grad_accum="fp32").gpu_peak
    assert af.peak_bytes(LLAMA, 1 << 20, 8, 32, f, Features(), "bf16", "cuda") == want  # memory_features auto
    spec = importlib.util.spec_from_file_location("plan", os.path.join(ROOT, "scripts", "plan.py"))
    plan = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plan)
    args = plan.build_parser().parse_args(["--model", "llama3-8b", "--seq_len", "1M", "--nodes", "4", "--no-offload_params",
                                           "--no-offload_optimizer"])
    pl = plan.Planner(args, LLAMA, Features.of(f))
    assert pl.evaluate(1 << 20, 8, f)[0].gpu["grads (partition)"] == 4 * LLAMA.num_params() // 32  # plan.py


def test_start_up_reads_the_key_of_the_built_config():
    """training/preflight's host and device checks pass the stage's DeepSpeed config's key (grad_accum_dtype)."""
    from planner.memory_model import grad_accum_dtype

    assert grad_accum_dtype({"data_types": {"grad_accum_dtype": "fp32"}}) == "fp32" and grad_accum_dtype({}) is None


def test_the_tiled_backwards_fp32_gradient_sums_are_counted_where_they_live():
    """model_utils/tiled_loss.TileGradSum: 4 B per weight of the head in `logits + loss` (Llama-3: 1.96 GiB), of the
    lean tiled MLP's gate / up / down in its backward (0.66 GiB); nothing for one tile or fp32 weights."""
    import math

    from planner.memory_model import layer_phase_terms, logits_bytes, logits_tiles, norm_saved

    h, vocab, inter, tokens = LLAMA.hidden_size, LLAMA.vocab_size, LLAMA.intermediate_size, 1 << 20
    rows = math.ceil(tokens / logits_tiles(tokens, vocab))
    plain = rows * vocab * 12 + norm_saved(tokens, h, 2, True) + tokens * h * 2
    assert logits_bytes(LLAMA, tokens, 2, True, True) - plain == 4 * vocab * h  # was 0
    assert logits_bytes(LLAMA, 64, 2, True, True) == 64 * vocab * 12 + norm_saved(64, h, 2, True) + 64 * h * 2
    lean = layer_phase_terms(LLAMA, tokens, 1, 2, True, lean_norm=True, lean_mlp=True)["mlp"]
    hf_norm = layer_phase_terms(LLAMA, tokens, 1, 2, True, lean_norm=False, lean_mlp=True)["mlp"]  # DeepSpeed's TiledMLP
    rows_mlp = math.ceil(tokens / math.ceil(tokens / max(h, 1024)))  # one tile of planner.memory_model.mlp_tiles
    assert lean - hf_norm == 3 * rows_mlp * h * 2 + 4 * 3 * h * inter


def test_deepspeeds_other_spellings_of_the_dtype_are_planned():
    """DeepSpeed's DtypeEnum takes "float32", "bfloat16", "torch.float32": the planner refused them as unreadable, and
    the start-up device-fit and host checks were skipped for such a config (a review found it)."""
    from planner.zero3_host import grad_accum_dtype

    for name, want in (("float32", "fp32"), ("torch.float32", "fp32"), ("float", "fp32"), ("bfloat16", "bf16"),
                       ("half", "fp16"), ("fp32", "fp32")):
        assert grad_accum_dtype({"data_types": {"grad_accum_dtype": name}}) == want
    assert grad_accum_dtype({}) is None
