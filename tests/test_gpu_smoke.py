"""The GPU path in one command, for the first person with a CUDA GPU (skipped without one):

    .venv/bin/pytest -q -m gpu tests/test_gpu_smoke.py

2 optimizer steps of train.py on 1 GPU: NCCL process group (so every collective of base/comm.py runs with
tensors on the GPU), bf16, ZeRO-3 + CPU offload, evaluation and export; for each attention backend present
(sdpa, flash_attention_2 when flash-attn is installed) the step-1 loss equals the plain Hugging Face model's on
the same sample within bf16 tolerance; and once more with checkpointing that keeps the attention output
(`--keep_attention`), which must find that backend's kernel. `--attn_implementation auto`'s probe times each
backend's real call (model_utils/attention_pick.py, whose CPU tests use a stand-in timer).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import save_tiny_model, write_token_jsonl
from tests.distributed import ROOT

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
SEQ = 512


def backends() -> list[str]:
    try:
        import flash_attn  # noqa: F401

        return ["sdpa", "flash_attention_2"]
    except ImportError:
        return ["sdpa"]


@pytest.mark.parametrize("keep", [False, True], ids=["", "ckpt-keep_attention"])
@pytest.mark.parametrize("attn", backends())
def test_two_steps_on_one_gpu_match_the_plain_model(tmp_path, attn, keep):
    model_dir = save_tiny_model(str(tmp_path / "model"), "tiny-llama", initializer_range=0.3)
    data = write_token_jsonl(str(tmp_path / "data.jsonl"), n_docs=80)
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("DS_ACCELERATOR", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    cmd = [sys.executable, "train.py", "--model_name_or_path", model_dir, "--dataset_path", data, "--max_seq_length",
           str(SEQ), "--max_steps", "2", "--bf16", "--attn_implementation", attn, "--output_dir", str(out),
           "--report_to", "none", "--learning_rate", "1e-3", "--seed", "0", "--dist_timeout_s", "120",
           *(["--gradient_checkpointing", "--keep_attention"] if keep else [])]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))  # keep a user's own entries
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    if keep:  # the backend's kernel (SDPA's CUDA kernels, flash-attn's registered op) was found and kept
        assert "attention outputs kept so far" in p.stdout + p.stderr, (p.stdout + p.stderr)[-4000:]
    recs = [json.loads(x) for x in open(out / "metrics.jsonl") if x.strip()]
    steps = [r for r in recs if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2] and (out / "COMPLETE").exists() and (out / "hf_model").is_dir()

    # the plain model on the sample step 1 trained on (the run's own data view, one process)
    from transformers import AutoModelForCausalLM

    from data.pipeline import open_run_data
    from model_utils.attention import resets_positions
    from training.config import config_from_dict
    from training.curriculum import resolve_stages

    cfg = config_from_dict({"model_name_or_path": model_dir, "dataset_path": data, "max_seq_length": SEQ,
                            "max_steps": 2})
    stages = resolve_stages(cfg, dp_of_sp=lambda sp: 1)
    run_data = open_run_data(data, None, 2048, stages, reset_position_ids=resets_positions("auto", attn))
    dataset, sampler = run_data.stage_view(stages[0], 1, 0, 1, 0)
    sample = dataset[sampler.next_batch()[0]]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation=attn).cuda()
    ids = torch.from_numpy(sample["input_ids"])[None].cuda()
    labels = torch.from_numpy(sample["shift_labels"])[None].cuda()
    pos = torch.from_numpy(sample["position_ids"])[None].cuda()
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits.float()  # HF masks by positions
    ref = torch.nn.functional.cross_entropy(logits[0], labels[0], ignore_index=-100).item()
    assert abs(steps[0]["loss"] - ref) / ref < 2e-2, (steps[0]["loss"], ref)


def test_auto_probe_times_each_backend_on_this_gpu():
    """The probe `auto` runs at start-up (model_utils/attention_pick.time_call), at a GQA call of 4 query heads on 1
    KV head: a time per backend present, the pick one of them."""
    from model_utils import attention_pick as ap

    shape = {"heads": 4, "kv_heads": 1, "head_dim": 128, "tokens": 4096}
    choice, times = ap.pick(backends(), shape, torch.bfloat16)
    assert set(times) == set(backends()) if len(backends()) > 1 else times == {}
    assert all(t > 0 for t in times.values()) and choice in backends()
    assert ap.time_call("sdpa", shape, torch.bfloat16) > 0


@pytest.mark.parametrize("window", [None, 7])
def test_context_parallel_flash_chunks_match_dense_attention(window):
    """Context parallelism's flash-attention path (model_utils/context_parallel.py `_flash_chunk`: each query chunk
    [a, b) against its documents' keys, separate cu_seqlens, bottom-right causal) on the GPU, one process (no
    collective needed: the chunk function takes the gathered K/V): equals one dense document-and-window mask."""
    try:
        from transformers.integrations.flash_attention import flash_attention_forward
    except ImportError:
        pytest.skip("flash-attn not installed")
    pytest.importorskip("flash_attn")
    from model_utils import attention
    from model_utils import context_parallel as cpm
    from tests.multiproc.test_doc_masking import BOUNDS, dense_reference

    class Attn(torch.nn.Module):
        num_key_value_groups, is_causal, training = 2, True, True

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, h, 300, 64, device="cuda", dtype=torch.bfloat16) for h in (4, 2, 2))
    pos = torch.stack([torch.cat([torch.arange(e - s) for s, e in zip(b[:-1], b[1:])]) for b in BOUNDS]).cuda()
    docs = attention.Documents(pos, 2)
    want = dense_reference(q.float().cpu(), k.float().cpu(), v.float().cpu(), docs.doc.cpu(), window)
    for cp in (2, 3):
        for c in range(cp):
            for a, b in cpm.local_ranges(300, cp, c):
                got = cpm._flash_chunk(flash_attention_forward, Attn(), q[:, :, a:b], k, v, docs, a, b, window,
                                       {"sliding_window": window})
                assert (got.float().cpu() - want[:, a:b]).abs().max() < 2e-2, (cp, c, a, b)


# (bounds per row, sequence length, cp degrees, window): the doc-masking layouts; issue 49's [0, 10, 48] at cp 2 with
# a window of 8 (flash's implicit right limit left queries 12..14 with no key: NaN in the merge) and two more
# layouts where a document starts a few keys before a query chunk under a window longer than that
RING_CASES = [(None, 300, (2, 3), None), (None, 300, (2, 3), 7), ([[0, 10, 48]], 48, (2,), 8),
              ([[0, 11, 48], [0, 23, 48]], 48, (2,), 12), ([[0, 11, 48], [0, 23, 48]], 48, (4,), 6)]


@pytest.mark.parametrize("bounds,sl,cps,window", RING_CASES)
def test_ring_flash_kernel_matches_the_math_kernel(bounds, sl, cps, window):
    """ring_attention's flash_attention_2 block kernel (model_utils/ring_attention.py `flash_forward` / `flash_backward`:
    flash-attn's varlen forward with softmax_lse and its backward from a given out / lse) on the GPU, one process (the
    kernels take one block pair; the ring is tested on CPU): equals the math kernel on every zigzag chunk pair, and the
    pairs merged as the ring merges them equal one dense document / window mask (no NaN)."""
    pytest.importorskip("flash_attn")
    from model_utils import attention
    from model_utils import context_parallel as cpm
    from model_utils import ring_attention as ra
    from tests.multiproc.test_doc_masking import BOUNDS, dense_reference

    bounds = bounds or BOUNDS
    bs = len(bounds)
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(bs, h, sl, 64, device="cuda", dtype=torch.bfloat16) for h in (4, 2, 2, 4))
    pos = torch.stack([torch.cat([torch.arange(e - s) for s, e in zip(b[:-1], b[1:])]) for b in bounds]).cuda()
    docs = attention.Documents(pos, bs)
    dense = dense_reference(q.float().cpu(), k.float().cpu(), v.float().cpu(), docs.doc.cpu(), window)  # [bs, sl, hq, d]
    for cp in cps:
        ranges = [cpm.local_ranges(sl, cp, c) for c in range(cp)]
        math, flash = (ra.Spec(None, cp, 0, ranges, docs, window, 0.125, b) for b in ("sdpa", "flash_attention_2"))
        chunks = [r for rank in ranges for r in rank]
        for qr in chunks:
            qs = slice(*qr)
            acc = torch.zeros(bs, 4, qr[1] - qr[0], 64, device="cuda")
            merged = torch.full(acc.shape[:3], float("-inf"), device="cuda")
            for kr in chunks:
                if math.reaches(qr, kr):
                    ks = slice(*kr)
                    o, lo = ra.math_forward(math, q[:, :, qs], k[:, :, ks], v[:, :, ks], qr, kr)
                    fo, flo = ra.flash_forward(flash, q[:, :, qs], k[:, :, ks], v[:, :, ks], qr, kr)
                    assert torch.equal(torch.isinf(lo), torch.isinf(flo)), (cp, qr, kr)
                    fin = ~torch.isinf(lo)
                    assert (flo[fin] - lo[fin]).abs().max() < 2e-2 and (fo - o).abs().max() < 2e-2, (cp, qr, kr)
                    ra._merge(acc, merged, fo, flo)
                    lse = torch.where(fin, lo, 0.0)  # a finite lse for every query (backward's formula)
                    out = o.to(q.dtype)
                    args = (do[:, :, qs], q[:, :, qs], k[:, :, ks], v[:, :, ks], out, lse, qr, kr)
                    nq, nk = qr[1] - qr[0], kr[1] - kr[0]
                    want, got = ([torch.zeros(bs, h, n, 64, device="cuda") for h, n in ((4, nq), (2, nk), (2, nk))]
                                 for _ in range(2))
                    ra.math_backward(math, *args, *want)  # each adds into (dq, dk, dv)
                    ra.flash_backward(flash, *args, *got)
                    for w, g in zip(want, got):
                        assert (g - w).abs().max() < 5e-2 * max(1.0, w.abs().max().item()), (cp, qr, kr)
            assert not acc.isnan().any(), (cp, qr)
            assert (acc.transpose(1, 2).cpu() - dense[:, qs]).abs().max() < 2e-2, (cp, qr)
