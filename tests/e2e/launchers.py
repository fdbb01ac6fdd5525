"""What the launcher tests share: the scripts' paths, an environment without a launcher's or SLURM's variables,
and the CPU-set helpers of the placement tests."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from base.env import EXTENSIONS_DIR

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), *[os.pardir] * 2))
STUBS = os.path.join(ROOT, "tests", "stubs")
LAUNCH = os.path.join(ROOT, "scripts", "launch.sh")
SBATCH_SCRIPT = os.path.join(ROOT, "scripts", "slurm.sbatch")
DS = os.path.join(ROOT, ".venv", "bin", "deepspeed")
TRAIN = os.path.join(ROOT, "train.py")


def clean_env(**kw: str) -> dict:
    """This environment without the variables a launcher or SLURM would have set, with the checkout's JIT-op cache,
    plus kw."""
    drop = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "DS_ACCELERATOR", "PYTHONPATH",
            "DS_ENV_FILE", "LAUNCH_CMD", "TRAIN_SCRIPT", "OUTPUT_DIR", "CUDA_VISIBLE_DEVICES", "LAUNCH_EXPORT")
    drop += ("BIND_CORES", "KMP_AFFINITY", "TORCH_EXTENSIONS_DIR")
    prefixes = ("SLURM_", "NCCL_", "WANDB_", "HF_", "TRANSFORMERS_", "TORCH_NCCL_", "FAKE_", "GLOO_", "FI_", "UCX_")
    e = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith(prefixes)}
    # DeepSpeed's JIT ops from the checkout's cache (scripts/setup.sh built them, train.py loads them there): a stand-in
    # rank that starts DeepSpeed without base.env.configure (allreduce_world.py) would otherwise build them in
    # ~/.cache/torch_extensions, which every clone shares and rebuilds with its own paths (90 s inside a test)
    e["TORCH_EXTENSIONS_DIR"] = EXTENSIONS_DIR
    e.update({"OMP_NUM_THREADS": "1", "BIND_CORES": "0", **kw})  # core binding: only where a test asks for it
    return {k: v for k, v in e.items() if v is not None}  # kw NAME=None: leave NAME unset


def launch(args: list[str], cwd, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([LAUNCH, *args], cwd=cwd, capture_output=True, text=True, timeout=60,
                          env=clean_env(**env))


def wait_for(cond, timeout: float, what: str) -> None:
    t0 = time.time()
    while not cond():
        if time.time() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.1)


def requeues(tmp_path) -> list[str]:
    log = tmp_path / "scontrol.log"
    return log.read_text().splitlines() if log.exists() else []


NUMA_STUB = os.path.join(STUBS, "numa")  # a numactl stand-in: logs its options, runs the command


def cpu_set(ranges: str) -> list[int]:
    """"0-2,5" -> [0, 1, 2, 5] (the Cpus_allowed_list form)."""
    return [c for part in ranges.split(",") for a, _, b in [part.partition("-")] for c in range(int(a), int(b or a) + 1)]


def allowed_cpus() -> str:
    with open("/proc/self/status") as fh:
        return next(line.split()[1] for line in fh if line.startswith("Cpus_allowed_list:"))


needs_2_cpus = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a CPU-placement test needs 2 CPUs")

# the interface variables a cluster sets for NCCL/gloo/EFA/UCX (and a JIT cache): every rank must get them
INTERFACES = {"GLOO_SOCKET_IFNAME": "eth1", "NCCL_SOCKET_IFNAME": "eth1", "NCCL_IB_HCA": "mlx5_0,mlx5_1",
              "FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "UCX_TLS": "rc,sm", "TORCH_EXTENSIONS_DIR": "/x/ext"}
