"""Each device's dense bf16 peak TFLOP/s: what an MFU divides by (the GPU check's, bench/gpu.py and bench/gpu_long.py,
and each training step's `mfu` in metrics.jsonl, training/stage_records.py). One table, matched on the name
torch.cuda.get_device_name gives (ROCm's too: "AMD Instinct MI300X").

Dense, not the 2:4-sparsity figures the data sheets print first (half of those): a training step's matmuls are dense.
A name no entry matches (a card not listed, a CPU run) has no peak, so no MFU: never a guessed one. A MIG slice has a
share of the card's SMs (CUDA names it "NVIDIA A100-SXM4-40GB MIG 1g.5gb"): no peak either.

planner/auto_features.PEAK_TFLOPS (989, an H100's) is the plan's assumed device, not a reading of the one a run has.
"""

from __future__ import annotations

# (a part of the device name, dense bf16 TFLOP/s), the first one the name contains wins: a variant before its family
# (GH200 and H200 NVL before H200, H100 NVL and PCIe before H100, GB200 before B200), matched case-insensitively
DENSE_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("GH200", 989.0),  # NVIDIA GH200 Grace Hopper Superchip data sheet: FP16/BF16 Tensor Core 1,979 TFLOPS (sparsity)
    ("H200 NVL", 835.0),  # NVIDIA H200 Tensor Core GPU data sheet: H200 NVL, BF16 Tensor Core 1,671 TFLOPS (sparsity)
    ("H200", 989.0),  # the same data sheet: H200 SXM, BF16 Tensor Core 1,979 TFLOPS (sparsity)
    ("H100 NVL", 835.0),  # NVIDIA H100 Tensor Core GPU data sheet: H100 NVL, BF16 Tensor Core 1,671 TFLOPS (sparsity)
    ("H100 PCIe", 756.0),  # the same data sheet (2022 edition): H100 PCIe, BF16 Tensor Core 1,513 TFLOPS (sparsity)
    ("H100", 989.0),  # the same data sheet: H100 SXM ("NVIDIA H100 80GB HBM3"), BF16 Tensor Core 1,979 (sparsity)
    ("A100", 312.0),  # NVIDIA A100 Tensor Core GPU data sheet: BF16 Tensor Core 312 TFLOPS (624 sparsity), SXM and PCIe
    ("GB200", 2500.0),  # NVIDIA GB200 NVL72 specifications: per GPU FP16/BF16 Tensor Core 5 PFLOPS (sparsity)
    ("B200", 2250.0),  # NVIDIA HGX B200 specifications: per GPU FP16/BF16 Tensor Core 4.5 PFLOPS (sparsity)
    ("L40S", 362.0),  # NVIDIA L40S data sheet: BF16 Tensor Core 362.05 TFLOPS (733 sparsity)
    ("MI300X", 1307.4),  # AMD Instinct MI300X data sheet: peak BF16 1,307.4 TFLOPS (2,614.9 with sparsity)
)


def device_peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of the device torch names `device_name`; None where none is known (module docstring)."""
    name = device_name.upper()
    if " MIG " in f"{name} ":
        return None
    return next((tflops for part, tflops in DENSE_BF16_TFLOPS if part.upper() in name), None)
