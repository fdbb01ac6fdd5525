"""The lean RMSNorm (model_utils/rmsnorm.py) against Hugging Face's LlamaRMSNorm: time of one forward + backward
and the exact tensor bytes live at the peak, per dtype and shape.

    python -m bench.rmsnorm                   # bench/results/rmsnorm.json + a table
    python -m bench.rmsnorm --rows 65536 --hidden 1024 --repeats 5

Times are the median of --repeats runs after one warm-up, interleaved (HF, lean, HF, lean, ...) so that load on
the shared machine hits both alike; quote the ratio, not the absolute times. Peak bytes come from the torch
profiler's allocation events (the CPU counterpart of max_memory_allocated), above what was live before the call,
while the output is kept alive until backward as a layer's next projection keeps it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from bench.harness import result_path, write_json


def _norms(h: int, dtype):
    import torch
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from model_utils.rmsnorm import use_lean_rmsnorm

    hf, lean = LlamaRMSNorm(h, eps=1e-5).to(dtype), LlamaRMSNorm(h, eps=1e-5).to(dtype)
    assert use_lean_rmsnorm(lean) == 1
    with torch.no_grad():
        hf.weight.normal_(1.0, 0.3)
        lean.weight.copy_(hf.weight)
    return hf, lean


def _step(norm, x, dy):
    xx = x.detach().requires_grad_()
    norm(xx).backward(dy)


def _peak_bytes(norm, x, dy) -> int:
    from training.metrics import profiled_peak_bytes

    return profiled_peak_bytes(lambda: _step(norm, x, dy))


def measure(rows: int, h: int, dtype_name: str, repeats: int) -> dict:
    import torch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    torch.manual_seed(0)
    hf, lean = _norms(h, dtype)
    x, dy = torch.randn(1, rows, h).to(dtype), torch.randn(1, rows, h).to(dtype)
    times: dict[str, list[float]] = {"hf": [], "lean": []}
    for norm in (hf, lean):
        _step(norm, x, dy)  # warm-up
    for _ in range(repeats):
        for name, norm in (("hf", hf), ("lean", lean)):
            t = time.perf_counter()
            _step(norm, x, dy)
            times[name].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    peak = {"hf": _peak_bytes(hf, x, dy), "lean": _peak_bytes(lean, x, dy)}
    return {"rows": rows, "hidden": h, "dtype": dtype_name, "repeats": repeats,
            "ms_hf": 1e3 * med["hf"], "ms_lean": 1e3 * med["lean"], "speedup": med["hf"] / med["lean"],
            "peak_mib_hf": peak["hf"] / 2**20, "peak_mib_lean": peak["lean"] / 2**20,
            "peak_ratio": peak["lean"] / peak["hf"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=16384, help="tokens (rows of the norm)")
    p.add_argument("--hidden", default="256,1024", help="comma list of hidden sizes")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default=result_path("rmsnorm.json"))
    args = p.parse_args(argv)
    try:
        hs = [int(h) for h in args.hidden.split(",")]
    except ValueError:
        p.error(f"--hidden {args.hidden!r}: a comma list of integers, e.g. 256,1024")
    if args.rows < 1 or args.repeats < 1 or min(hs) < 1:
        p.error("--rows, --repeats and every --hidden must be positive")
    results = [measure(args.rows, h, d, args.repeats) for h in hs for d in args.dtypes.split(",")]
    print(f"{'rows':>7} {'hidden':>6} {'dtype':>5} {'HF ms':>8} {'lean ms':>8} {'speed-up':>8} "
          f"{'HF peak MiB':>11} {'lean peak MiB':>13} {'lean/HF':>7}")
    for r in results:
        print(f"{r['rows']:>7} {r['hidden']:>6} {r['dtype']:>5} {r['ms_hf']:>8.1f} {r['ms_lean']:>8.1f} "
              f"{r['speedup']:>8.2f} {r['peak_mib_hf']:>11.1f} {r['peak_mib_lean']:>13.1f} {r['peak_ratio']:>7.2f}")
    write_json(args.out, {"command": " ".join(["python -m bench.rmsnorm", *(argv or sys.argv[1:])]),
                          "torch_threads": __import__("torch").get_num_threads(), "results": results})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
