"""The memory planner against measured memory: planner.memory_model.predict_peak_bytes within 20% of the
measured per-rank peak of real train.py runs on CPU (the full sweep: scripts/bench_memory.py --calibration).

predict_peak_bytes counts tensor bytes only, so the measurement is the rank's peak RSS minus a runtime
baseline, defined as: the peak RSS of the same layout at a tiny length (256 tokens) minus what the model
predicts for that tiny run (its ZeRO-3 model states and a few MB of activations). What is left is what the
model leaves out on purpose: the interpreter, torch / DeepSpeed / transformers code and buffers, gloo.
Every rank runs with MALLOC_MMAP_THRESHOLD_=64 KiB so that glibc hands freed blocks of 64 KiB or more
back at once and peak RSS follows live tensors. With glibc's default (a threshold that rises to 32 MiB as
blocks are freed) freed activations stay in the heap and peak RSS was 20-80% above the tensor bytes; at
1 MiB the tiled-MLP sets still measured 30-45 MB over the model (predicted/measured 0.77-0.85), because
TiledMLP's per-tile tensors ([~h, I] fp32, 704 KiB here) are under 1 MiB and their freed blocks stayed in
the heap; at 64 KiB the same runs measured 0.94-0.95. That is the allocator, not the model.
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from tests.distributed import ROOT, run

pytestmark = pytest.mark.dist

_spec = importlib.util.spec_from_file_location("bench_memory", os.path.join(ROOT, "scripts", "bench_memory.py"))
bm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bm)

SP, STEPS, TINY, LONG = 2, 2, 256, 8192
MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(64 * 2**10)}


def _peak_gb(tmp_path, model: str, data: str, seq_len: int, features: tuple[str, ...]) -> float:
    out = tmp_path / f"L{seq_len}_{'-'.join(features) or 'none'}"
    cfg = tmp_path / "noeval.yaml"
    cfg.write_text(bm.NO_EVAL)
    args = ["--config", str(cfg), "--model_name_or_path", model, "--dataset_path", data, "--max_seq_length",
            str(seq_len), "--sequence_parallel_size", str(SP), "--max_steps", str(STEPS), "--output_dir", str(out),
            "--report_to", "none", "--no-export_hf", "--resume", "none", "--no-progress_bar",
            *[f"--{f}" for f in features]]
    run(os.path.join(ROOT, "train.py"), args, SP, str(out / "launch"), timeout=300, extra_env=MALLOC)
    return bm.summarize_steps(bm.read_steps(str(out)))["peak_mem_gb"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The bench model, 3 documents of 9k token ids (enough for STEPS samples of LONG tokens) and the runtime
    baseline: the peak of a TINY-token run minus what the model predicts for it."""
    tmp = tmp_path_factory.mktemp("calibration")
    model = bm.bench_model(root=str(tmp))  # hidden 256, 2 layers: activations dominate at 8k tokens
    data = tmp / "tokens.jsonl"
    with open(data, "w") as fh:
        for d in range(3):
            fh.write(json.dumps({"input_ids": [4 + (d * 7919 + i * 104729) % 2000 for i in range(9000)]}) + "\n")
    base = _peak_gb(tmp, model, str(data), TINY, ())
    runtime = base - bm.predicted_gb(model, TINY, SP, (), "cpu")
    assert 0.2 < runtime < 2.0, f"runtime baseline {runtime:.3f} GiB is not a plausible interpreter+libraries size"
    return tmp, model, str(data), runtime


@pytest.mark.parametrize("features", [(), ("gradient_checkpointing",), bm.FEATURE_SETS["alst"]],
                         ids=["none", "ckpt", "alst"])
def test_predicted_peak_within_20_percent(setup, features):
    tmp, model, data, runtime = setup
    measured = _peak_gb(tmp, model, data, LONG, features) - runtime
    pred = bm.predicted_gb(model, LONG, SP, features, "cpu")
    report = (f"{'+'.join(features) or 'none'}: predicted {pred:.3f} GiB, measured {measured:.3f} GiB "
              f"(peak - runtime {runtime:.3f}), predicted/measured {pred / measured:.2f}")
    print(report)
    assert 0.8 <= pred / measured <= 1.2, report
