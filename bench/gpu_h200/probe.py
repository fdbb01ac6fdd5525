"""GPU probe of 2026-11-24 on the device machine (one H200), from the repo root (it ran then as
`python3 bench/gpu_h200/probe.py`, importing the benchmarks from scripts/):

    OUT=/some/folder python3 -m bench.gpu_h200.probe [pair] [tile16k] [nooff_tm] [nooff_tl] [leaf_tm] [nooff_tl_err] [nooff_tl_arch]

The tiled-MLP cost under ZeRO-3 param offload, ZeRO-3 without offload, and more paired rounds of the
same-memory comparison at 65536 tokens (cap 32 GiB). Writes $OUT/probe.json after every launch.
`probe_site/sitecustomize.py` (on PYTHONPATH of every launch) lets a case override the MLP tile size and
switch the ZeRO-3 leaf marking of the tiled MLP off, without a product flag for either.
"""

import json
import os
import sys
import time

from bench import harness as bm
from bench import peers as bp

L = 65536
WORK = "/tmp/probe"
AUTO = ("--memory_features", "auto", "--gpu_mem_gb", "32")


def main() -> None:
    out = os.environ["OUT"]
    os.makedirs(WORK, exist_ok=True)
    model = bm.bench_model(1024, 8, 16, 8, 32000)
    os.environ["PYTHONPATH"] = os.path.join(bm.ROOT, "bench", "gpu_h200", "probe_site")
    res = []

    def save(name, rec):
        rec = {k: v for k, v in rec.items() if k != "log_tail" or not rec.get("ok")} | {"name": name}
        res.append(rec)
        said = (f"{rec['tokens_per_s']:.0f} tok/s peak {rec['peak_mem_gb']:.3f}" if rec.get("ok")
                else f"FAILED {rec.get('error', '')[:300]}")
        print(f"[{time.strftime('%X')}] {name:<40} {said}", flush=True)
        with open(f"{out}/probe.json", "w") as fh:
            json.dump(res, fh, indent=1)

    def ours(name, feats, extra=(), env=None):
        save(name, bm.train_point(model, L, 1, feats, 4, "cuda", WORK, nproc=1, timeout=200, extra_args=extra,
                                  env=env))

    def hf(name):
        save(name, bp.hf_point(model, L, 4, "cuda", WORK, 200, {}, gradient_checkpointing=True, nproc=1, sp=1))

    which = sys.argv[1:] or ["pair", "tile16k", "nooff_tm", "nooff_tl"]
    offload, no_offload = ("--deepspeed", "ds_configs/zero3_offload.json"), ("--deepspeed", "ds_configs/zero3.json")
    if "leaf_tm" in which:
        ours("leaf: tl+tm default tiles", ("tiled_logits", "tiled_mlp"))
    if "nooff_tl_err" in which:
        ours("tl, zero3.json (no offload)", ("tiled_logits",), no_offload)
    if "nooff_tl_arch" in which:
        ours("tl, zero3.json, TORCH_CUDA_ARCH_LIST=9.0", ("tiled_logits",), no_offload, {"TORCH_CUDA_ARCH_LIST": "9.0"})
    if "pair" in which:
        hf("pair round 2 (BA): hf grad-ckpt")
        ours("pair round 2 (BA): ours auto", (), AUTO)
        ours("pair round 3 (AB): ours auto", (), AUTO)
        hf("pair round 3 (AB): hf grad-ckpt")
    if "tile16k" in which:
        ours("tl+tm tiles of 16384 tokens", ("tiled_logits", "tiled_mlp"), offload, {"PROBE_MLP_TILE_TOKENS": "16384"})
    if "nooff_tm" in which:
        ours("tl+tm, zero3.json (no offload)", ("tiled_logits", "tiled_mlp"), no_offload)
    if "nooff_tl" in which:
        ours("tl, zero3.json (no offload)", ("tiled_logits",), no_offload)


if __name__ == "__main__":
    main()
