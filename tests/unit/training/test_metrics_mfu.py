"""Each step's model TFLOP/s per GPU and MFU (training/stage_records._flop_fields), counted as the GPU page counts them
(planner/flops.flops_per_sequence x the job's sequences, over step time x world), and the one peak table bench and
training share (planner/peaks.py). There was no per-step MFU anywhere. A replay micro-step counts its short sequences
(data/replay.py), not one sequence of the stage's length. One process, hand-computed values."""

from __future__ import annotations

import json
import types

import pytest
import torch

from training import stage_records
from training.metrics import MetricsLogger

# A shape small enough to count by hand (planner/shapes.ModelShape.from_config reads it; llama: no biases, no q/k norm)
TINY = dict(model_type="llama", vocab_size=10, hidden_size=4, intermediate_size=8, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=2)
# head_dim 4 / 2 = 2. One layer: attention 4*2*(2 + 2*2) + 2*2*4 = 64, MLP 3*4*8 = 96, norms 2*4 = 8: 168.
# matmul weights 1*168 + the LM head 10*4 = 208. At s = 8: 6*208*8 = 9,984 (matmuls) + 6*1*2*2*8^2 = 1,536 (causal
# attention, once) = 11,520 FLOPs a sequence.
SEQ_FLOPS = 11_520
# dp 2 x accumulation 1 x micro-batch 3 = 6 sequences a step (48 tokens), sp 2: world 4, step 0.5 s
# -> 6 * 11,520 / (0.5 * 4) = 34,560 FLOP/s per GPU = 3.456e-8 TFLOP/s; on an H100 (989): MFU 3.456e-8 / 989
TFLOPS = 6 * SEQ_FLOPS / (0.5 * 4) / 1e12


class Config:
    """An HF config's to_dict, counted: the shape is read once per stage length, not per step."""

    def __init__(self):
        self.reads = 0

    def to_dict(self) -> dict:
        self.reads += 1
        return dict(TINY)


def _steps(monkeypatch, device: str, outs: list[dict], config=None, accumulation: int = 1):
    """training/stage_records._log_step as the stage loop calls it, on `device` (torch's name), for each of `outs`:
    the logged records."""
    monkeypatch.setattr(stage_records, "_device_name", lambda: device)
    logged = []
    run = stage_records.Run(cfg=types.SimpleNamespace(gradient_accumulation_steps=accumulation,
                                                      per_device_train_batch_size=3),
                            dims=None, data=None, ckpt=None, metrics=types.SimpleNamespace(log=logged.append),
                            preempt=types.SimpleNamespace(deadline=types.SimpleNamespace(record_step=lambda s: None)),
                            base_config=config or Config(), attn="sdpa", bf16=True)
    st = types.SimpleNamespace(step=0, tokens=0)
    for out in outs:
        st.step += 1
        stage_records._log_step(run, types.SimpleNamespace(index=0, max_seq_length=8),
                                types.SimpleNamespace(dp=2, sp=2, cp=1), st, {"label_tokens": 8, **out}, 1e-3,
                                types.SimpleNamespace(source_shares=dict))
    return logged


def test_a_steps_tflops_per_gpu_and_mfu_are_the_hand_counted_ones(monkeypatch):
    config = Config()
    logged = _steps(monkeypatch, "NVIDIA H100 80GB HBM3", [{"loss": 1.0, "step_time": 0.5}] * 2
                    + [{"loss": 1.0, "step_time": 0.25}], config)
    assert logged[0]["tokens"] == 48
    assert logged[0]["model_tflops_per_gpu"] == pytest.approx(3.456e-8, rel=1e-12) == TFLOPS
    assert logged[0]["mfu"] == pytest.approx(3.456e-8 / 989, rel=1e-12)
    assert logged[2]["model_tflops_per_gpu"] == pytest.approx(2 * 3.456e-8, rel=1e-12)  # half the time: twice
    assert config.reads == 1  # the stage's shape and peak, once: not per step


# F(s) = 6*208*s + 6*1*2*2*s^2 = 1,248 s + 24 s^2 (the count above): a sequence of 2 is 2,592 FLOPs
SEQ2_FLOPS = 2_592


def test_a_replay_micro_step_counts_its_short_sequences(monkeypatch):
    """A step of accumulation 2 at length 8: one micro-step of the stage's own samples (dp 2 x 3 = 6 sequences of 8:
    69,120 FLOPs) and one replay micro-step at length 2 (its 48 tokens are 24 sequences of 2, attention masked
    between them: 24 x 2,592 = 62,208), so 131,328 FLOPs over 0.5 s x 4 = 6.5664e-8 TFLOP/s. The old count took
    both micro-steps as sequences of 8: 12 x 11,520 = 138,240 FLOPs, 6.912e-8. The shape is read once per length."""
    config = Config()
    recs = _steps(monkeypatch, "NVIDIA H100 80GB HBM3", [{"loss": 1.0, "step_time": 0.5, "micro_lengths": [8, 2]},
                                                         {"loss": 1.0, "step_time": 0.5, "micro_lengths": [8, 8]}],
                  config, accumulation=2)
    assert recs[0]["tokens"] == 96 and 6 * SEQ_FLOPS + 24 * SEQ2_FLOPS == 131_328
    assert recs[0]["model_tflops_per_gpu"] == pytest.approx(131_328 / (0.5 * 4) / 1e12, rel=1e-12)
    assert recs[0]["mfu"] == pytest.approx(6.5664e-8 / 989, rel=1e-12)
    assert recs[1]["model_tflops_per_gpu"] == pytest.approx(2 * TFLOPS, rel=1e-12)  # no replay: as before
    assert config.reads == 2  # lengths 8 and 2, each once


def test_the_stage_loop_hands_its_replay_micro_steps_to_the_record(tmp_path, monkeypatch):
    """The real training/stage.train_stage (test_stop_window's stand-ins) over data/replay.ReplaySampler at length 64
    with {16: 0.5}: each step of accumulation 2 draws one micro-batch of its own samples and one of 4 samples of 16
    (indices `(16, (i, ..., i+3))`), and its record counts them: F(64) = 79,872 + 98,304 = 178,176 and 4 x F(16) =
    4 x (19,968 + 6,144) = 104,448, 282,624 FLOPs in the step's 1 s on one rank. Before: 2 x 178,176 = 356,352."""
    from base.parallel import ParallelDims
    from data.replay import ReplaySampler
    from tests.unit.training.test_stage_loss_weighting import _config, _stages
    from tests.unit.training.test_stop_window import Clock, SimCheckpointer, stub_data, stub_stage
    from training import preemption
    from training import stage as stage_mod
    from training.checkpoint import TrainState
    from training.preemption import Deadline, PreemptionFlag

    cfg = _config(tmp_path, {"max_seq_length": 64, "max_steps": 2}, "--gradient_accumulation_steps", "2")
    (stage,) = _stages(cfg)
    clock, drawn, logged = Clock(), [], []
    for mod in (stage_mod, preemption):
        monkeypatch.setattr(mod, "time", clock)
    monkeypatch.delenv("SLURM_JOB_END_TIME", raising=False)
    monkeypatch.setattr(stage_records, "_device_name", lambda: "NVIDIA H100 80GB HBM3")
    stub_stage(monkeypatch, torch.nn.Linear(1, 1, bias=False),
               collate=lambda samples, multiple, pad, weighting: drawn.append(samples))
    own = types.SimpleNamespace(next_batch=lambda: [0], source_shares=dict, state_dict=dict)
    short = types.SimpleNamespace(next_batch=lambda: [1, 2, 3, 4], state_dict=dict)
    sampler = ReplaySampler(own, {16: short}, {16: 0.5}, 64, micro_batch=1)
    data = stub_data(heldout=lambda *a, **k: [])
    data.stage_view = lambda *a: (_Samples(), sampler)
    run = stage_mod.Run(cfg, ParallelDims(world=1, sp=1, rank=0, local_rank=0), data, SimCheckpointer(clock),
                        types.SimpleNamespace(log=logged.append, run_id=None, home=None,
                                              begin_stage=lambda end, start=None: None, record_stage=lambda *a: None),
                        PreemptionFlag(None, Deadline(0.0, now=clock.t), save_every_s=0), Config(), "sdpa", True)
    stage_mod.train_stage(run, stage, [stage], TrainState())
    assert drawn == [[0], [(16, (1, 2, 3, 4))]] * 2  # own, replay: each step
    steps = [r for r in logged if "model_tflops_per_gpu" in r]
    assert len(steps) == 2 and steps[0]["tokens"] == 128
    for rec in steps:
        assert rec["model_tflops_per_gpu"] == pytest.approx(282_624 / 1e12, rel=1e-12)
        assert rec["mfu"] == pytest.approx(282_624 / 1e12 / 989, rel=1e-12)


class _Samples:
    """A dataset whose sample is its index (collate is stood in for: it records them)."""

    def __getitem__(self, i):
        return i


@pytest.mark.parametrize("device", ["cpu", "NVIDIA GeForce GTX 1080", "NVIDIA A100-SXM4-40GB MIG 1g.5gb"])
def test_without_a_known_peak_the_tflops_alone(monkeypatch, device):
    """A CPU run, a card the table lacks, a MIG slice (a share of the SMs): the TFLOP/s, no mfu key (the docs say so
    once; not a null each step)."""
    (rec,) = _steps(monkeypatch, device, [{"loss": 1.0, "step_time": 0.5}])
    assert rec["model_tflops_per_gpu"] == pytest.approx(3.456e-8, rel=1e-12) and "mfu" not in rec


def test_a_skipped_step_has_both_null_and_an_overflow_step_both_figures(monkeypatch):
    """A skipped step (no supervised token) ran nothing: null, as tokens_per_s. DeepSpeed's skipped update (overflow)
    ran its forward and backward: its figures stand."""
    skipped, overflow = _steps(monkeypatch, "NVIDIA H100 80GB HBM3",
                               [{"loss": 0.0, "label_tokens": 0, "skipped": True, "step_time": 0.001},
                                {"loss": 1.0, "overflow": True, "step_time": 0.5}])
    assert skipped["model_tflops_per_gpu"] is None and skipped["mfu"] is None and skipped["tokens_per_s"] is None
    assert overflow["mfu"] == pytest.approx(3.456e-8 / 989, rel=1e-12)


def test_a_config_the_planner_cannot_read_gives_null_tflops(monkeypatch):
    """A stand-in without an HF config (or one lacking the planner's keys): null, never a crash of the step."""
    bad = types.SimpleNamespace(to_dict=lambda: {"model_type": "llama"})
    (rec,) = _steps(monkeypatch, "NVIDIA H100 80GB HBM3", [{"loss": 1.0, "step_time": 0.5}], bad)
    assert rec["model_tflops_per_gpu"] is None and rec["mfu"] is None


def test_the_step_line_says_the_mfu_where_known(tmp_path, capsys):
    m = MetricsLogger(str(tmp_path), True, "none", None, None, {}, 10, False)
    m.log({"step": 3, "stage": 0, "loss": 2.0, "lr": 1e-4, "tokens_per_s": 320.0, "peak_mem_gb": 1.0,
           "model_tflops_per_gpu": 366.0, "mfu": 0.3701})
    m.log({"step": 4, "stage": 0, "loss": 2.0, "lr": 1e-4, "tokens_per_s": 320.0, "peak_mem_gb": 1.0,
           "model_tflops_per_gpu": 1e-6})  # a CPU run: no mfu, the line as before
    first, second = capsys.readouterr().out.splitlines()[-2:]
    assert "mem 1.00GB mfu 37%" in first, first
    assert "mfu" not in second and second.startswith("step 4/10 stage 0 loss 2.0000 lr 1.00e-04 tok/s 320 mem 1.00GB")
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["mfu"] == 0.3701
    m.close()


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.0), ("NVIDIA H200 NVL", 835.0), ("NVIDIA GH200 480GB", 989.0),
    ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA A100-PCIE-40GB", 312.0), ("NVIDIA B200", 2250.0),
    ("NVIDIA GB200", 2500.0), ("NVIDIA L40S", 362.0), ("AMD Instinct MI300X", 1307.4),
    ("cpu", None), ("NVIDIA H100 80GB HBM3 MIG 3g.40gb", None)])
def test_bench_and_training_read_one_peak_table(name, peak):
    """bench/gpu.py's default peak is the table training divides by: a variant is not its family's (an H100 PCIe is
    not the SXM's 989, a GB200 not a B200)."""
    from bench.gpu import peak_tflops
    from planner.peaks import device_peak_tflops

    assert device_peak_tflops(name) == peak and peak_tflops(name, None) == peak
    assert peak_tflops(name, 500.0) == 500.0  # --peak_tflops given
