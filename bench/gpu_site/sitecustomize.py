"""On PYTHONPATH of bench.gpu's train.py launches only: caps the CUDA caching allocator of each rank at
BENCH_GPU_CAP_GIB, so an H200 (141 GB) answers the length question as an 80 GB H100 would. A measurement knob,
not a product flag. The launcher processes (no LOCAL_RANK) are left alone."""

import os

if os.environ.get("BENCH_GPU_CAP_GIB") and "LOCAL_RANK" in os.environ:
    # train.py sets this allocator setting itself (model_utils/memory.py), but only after this file has started CUDA
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    import torch

    if torch.cuda.is_available():
        dev = int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count()
        total = torch.cuda.get_device_properties(dev).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, float(os.environ["BENCH_GPU_CAP_GIB"]) * 2**30 / total), dev)

if os.environ.get("BENCH_GPU_PHASES") and "LOCAL_RANK" in os.environ:
    # bench.gpu's long-length sections: per-phase peaks, host memory (bench/gpu_probe.py); before transformers is
    # imported, which binds torch.utils.checkpoint.checkpoint at import
    from bench.gpu_probe import install

    install(f"{os.environ['BENCH_GPU_PHASES']}.rank{os.environ['LOCAL_RANK']}")

if os.environ.get("BENCH_GPU_KERNELS") and "LOCAL_RANK" in os.environ and not os.environ.get("BENCH_GPU_PHASES"):
    # bench.gpu's ladder: which attention kernels its steps dispatched to (SDPA's backend, flash-attn's function),
    # written at exit; no phase hooks (they would cost the rungs' timing)
    import atexit
    import json

    from bench.gpu_probe import KERNELS, wrap_sdpa

    wrap_sdpa()
    _out = f"{os.environ['BENCH_GPU_KERNELS']}.rank{os.environ['LOCAL_RANK']}.json"
    atexit.register(lambda: open(_out, "w").write(json.dumps(KERNELS)))
