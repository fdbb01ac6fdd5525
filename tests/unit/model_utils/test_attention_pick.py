"""`--attn_implementation auto` on a GPU picks the attention kernel measured fastest there, not the package that is
installed (issue 49; model_utils/attention_pick.py, training/startup.settle_attention). No GPU here: the probe's
timer is a stand-in, the decision logic and its route through rank 0 are the real ones."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from model_utils import attention_pick as ap
from model_utils.build import preset_config
from model_utils.families import check_config

LLAMA = preset_config("llama3-8b")


def test_the_candidates():
    """sdpa alone without flash-attn; both where it imports; FA2 alone for the ring or a sliding window; a family
    FA2 cannot run (its check raises) keeps sdpa."""
    from transformers import MistralConfig

    assert ap.candidates(LLAMA, 1, False, False, check_config) == ["sdpa"]
    assert ap.candidates(LLAMA, 1, False, True, check_config) == ["sdpa", ap.FA2]
    assert ap.candidates(LLAMA, 1, True, True, check_config) == [ap.FA2]
    windowed = MistralConfig(sliding_window=4096, num_hidden_layers=2)
    assert ap.windowed(windowed) and not ap.windowed(LLAMA)
    assert ap.candidates(windowed, 1, False, True, check_config) == [ap.FA2]

    def no_flash(config, attn, chunks):
        if attn == ap.FA2:
            raise ValueError("attention sinks: flash-attention refused")

    assert ap.candidates(LLAMA, 1, False, True, no_flash) == ["sdpa"]


def test_the_probe_shape_is_one_call_of_the_run():
    """Llama-3-8B (32 query heads, 8 KV, head dim 128): SP 8 in 4 head chunks is one query head a call, SP 4 with
    cp 2 (ulysses 2) in 2 chunks is 8; the length capped at PROBE_TOKENS."""
    a = LLAMA
    assert ap.call_shape(a, 8, 1, 4, 1 << 20) == {"heads": 1, "kv_heads": 1, "head_dim": 128,
                                                  "tokens": ap.PROBE_TOKENS}
    assert ap.call_shape(a, 4, 2, 2, 4096) == {"heads": 8, "kv_heads": 2, "head_dim": 128, "tokens": 4096}


def test_the_fastest_measured_kernel_wins():
    times = {"sdpa": 0.010, ap.FA2: 0.016}
    calls = []

    def timer(backend, shape, dtype):
        calls.append(backend)
        return times[backend]

    assert ap.pick(["sdpa", ap.FA2], {}, None, timer) == ("sdpa", times) and calls == ["sdpa", ap.FA2]
    times[ap.FA2] = 0.004
    assert ap.pick(["sdpa", ap.FA2], {}, None, timer)[0] == ap.FA2
    assert ap.pick([ap.FA2], {}, None, timer) == (ap.FA2, {})  # one option: no probe

    def fa2_fails(backend, shape, dtype):
        if backend == ap.FA2:
            raise RuntimeError("FlashAttention only supports Ampere GPUs or newer")
        return 1.0

    assert ap.pick(["sdpa", ap.FA2], {}, None, fa2_fails) == ("sdpa", {"sdpa": 1.0})


class _Stage:
    def __init__(self, ring=False, sp=8, cp=1, chunks=4, length=1 << 20):
        self.ring_attention, self.sp, self.cp, self.attention_head_chunks, self.max_seq_length = ring, sp, cp, chunks, length


@pytest.fixture
def gpu(monkeypatch):
    """A GPU run with flash-attn importable, as load_run_config sees it (auto -> flash_attention_2, provisional),
    rank 0's probe a stand-in, and comm.run_on_main a stand-in for the broadcast: it runs `fn` as rank 0 would, or
    hands back `rank0[0]` (what rank 0 decided on its node) when a test sets it."""
    from training import startup

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    said, rank0 = [], []

    def run_on_main(fn, long=False):
        said.append(fn)
        return rank0[0] if rank0 else fn()

    monkeypatch.setattr(ap.comm, "run_on_main", run_on_main)
    monkeypatch.setattr(ap, "print0", lambda line: said.append(line))
    times = {"sdpa": 0.010, ap.FA2: 0.016}  # the H200's order: cuDNN through SDPA ahead of FlashAttention-2
    monkeypatch.setattr(ap, "time_call", lambda backend, shape, dtype, rounds=3: times[backend])
    from training.config import parse_config

    model = startup.Model(LLAMA, ap.FA2, True)
    return startup, parse_config(["--model_name_or_path", "llama3-8b"]), model, said, times, rank0


def test_auto_runs_the_faster_kernel_and_every_rank_takes_rank_0s_pick(gpu):
    """Before, auto ran FA2 whenever flash-attn imported (settle_attention did not exist: this is the line that
    failed); now the faster measured call, decided inside comm.run_on_main (rank 0's probe, one decision)."""
    startup, cfg, model, said, times, rank0 = gpu
    settled = startup.settle_attention(cfg, model, [_Stage()])
    assert settled.attn == "sdpa" and dataclasses.replace(settled, attn=ap.FA2) == model
    assert callable(said[0]) and said[1].startswith("attention: auto runs sdpa, the fastest on this GPU")
    assert "sdpa 10.0 ms, flash_attention_2 16.0 ms" in said[1] and "1 head(s) of 128" in said[1]
    times[ap.FA2] = 0.004
    assert startup.settle_attention(cfg, model, [_Stage()]).attn == ap.FA2
    # a rank whose own probe would say otherwise takes rank 0's pick (the broadcast's result, not its own clock)
    rank0.append(("sdpa", {"sdpa": 0.01, ap.FA2: 0.02}, ap.call_shape(LLAMA, 8, 1, 4, 1 << 20)))
    assert startup.settle_attention(cfg, model, [_Stage()]).attn == "sdpa"


def test_every_gpu_rank_joins_the_decision_and_a_node_without_flash_attn_is_one_line(gpu):
    """Control flow is the same on every GPU rank: a rank whose node lacks flash-attn (load_run_config chose sdpa
    there) still joins rank 0's broadcast (else rank 0 would wait in it), and takes sdpa when rank 0 does; told FA2, it
    stops in one line naming its host."""
    startup, cfg, model, said, _, rank0 = gpu
    no_flash = dataclasses.replace(model, attn="sdpa")
    assert startup.settle_attention(cfg, no_flash, [_Stage()]) == no_flash and callable(said[0])
    rank0.append((ap.FA2, {"sdpa": 0.02, ap.FA2: 0.01}, ap.call_shape(LLAMA, 8, 1, 4, 1 << 20)))
    with pytest.raises(ValueError, match=r"rank 0 runs flash_attention_2, but flash-attn does not import on .*: "
                                         r"install it on every node, or pass --attn_implementation sdpa"):
        startup.settle_attention(cfg, no_flash, [_Stage()])


def test_no_probe_where_the_choice_is_made_already(gpu, monkeypatch):
    """An explicit backend stays (no broadcast); a stage with the ring keeps FA2, unprobed; no GPU: unchanged."""
    startup, cfg, model, said, _, _ = gpu
    from training.config import parse_config

    explicit = parse_config(["--model_name_or_path", "llama3-8b", "--attn_implementation", ap.FA2])
    assert startup.settle_attention(explicit, model, [_Stage()]) is model and said == []
    assert startup.settle_attention(cfg, model, [_Stage(), _Stage(ring=True, cp=2)]).attn == ap.FA2
    fp32 = dataclasses.replace(model, bf16=False)  # flash-attn has no fp32 kernel (the old auto ran FA2 there too)
    assert startup.settle_attention(cfg, fp32, [_Stage()]).attn == "sdpa"
    assert [x for x in said if isinstance(x, str)] == []  # decided, not probed: no timing line
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    n = len(said)
    assert startup.settle_attention(cfg, model, [_Stage()]) is model and len(said) == n  # CPU: no broadcast


def test_sdpa_forced_to_cudnn_is_a_candidate_and_its_pick_runs_cudnn_first(gpu):
    """A build whose SDPA dispatch prefers its flash kernel runs ~1.7x slower than SDPA forced to cuDNN (the H200's
    kernel probe: 302 / 328 against 500 / 578 TFLOP/s); before, auto timed only SDPA's dispatch and FA2. Now SDPA
    forced to cuDNN is timed too (not for the ring or a window, whose kernel is FA2), the fastest measured wins, and a
    cuDNN pick runs as sdpa with cuDNN first in SDPA's priority order (every rank: the broadcast's result)."""
    from torch.nn.attention import SDPBackend

    startup, cfg, model, said, times, rank0 = gpu
    assert ap.candidates(LLAMA, 1, False, True, check_config, cudnn=True) == ["sdpa", ap.CUDNN, ap.FA2]
    assert ap.candidates(LLAMA, 1, False, False, check_config, cudnn=True) == ["sdpa", ap.CUDNN]
    assert ap.candidates(LLAMA, 1, True, True, check_config, cudnn=True) == [ap.FA2]
    before = torch._C._get_sdp_priority_order()
    times[ap.CUDNN] = 0.006  # sdpa 10 ms, FA2 16 ms
    try:
        settled = startup.settle_attention(cfg, model, [_Stage()])
        assert settled.attn == "sdpa" and torch._C._get_sdp_priority_order()[0] == int(SDPBackend.CUDNN_ATTENTION)
        assert "auto runs sdpa with cuDNN preferred (sdpa_cudnn)" in said[-1] and "sdpa_cudnn 6.0 ms" in said[-1]
        # without flash-attn on rank 0 too (sdpa's dispatch against SDPA forced to cuDNN)
        assert startup.settle_attention(cfg, dataclasses.replace(model, attn="sdpa"), [_Stage()]).attn == "sdpa"
        assert torch._C._get_sdp_priority_order()[0] == int(SDPBackend.CUDNN_ATTENTION)
        times[ap.CUDNN] = 0.030  # slower than both: FA2 loses to sdpa's own dispatch, the order is torch's again
        assert startup.settle_attention(cfg, model, [_Stage()]).attn == "sdpa" and "sdpa 10.0 ms" in said[-1]
        assert torch._C._get_sdp_priority_order() == before
        rank0.append((ap.CUDNN, {}, {}))  # a rank takes rank 0's cuDNN pick, not its own clock's
        assert startup.settle_attention(cfg, model, [_Stage()]).attn == "sdpa"
        assert torch._C._get_sdp_priority_order()[0] == int(SDPBackend.CUDNN_ATTENTION)
    finally:
        ap.prefer("sdpa")
    assert torch._C._get_sdp_priority_order() == before
