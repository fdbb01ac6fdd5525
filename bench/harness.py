"""What the benchmarks share: where the checkout is, where results go, launching ranks (plain subprocesses with
torch.distributed's environment, or the deepspeed launcher), the bench model, reading a run's metrics, writing
JSON and printing tables. tests/distributed.py takes its rank launcher from here (tests may import bench; bench
never imports tests).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")  # the committed JSON/PNG that docs/ cites (.gitignore keeps the rest out)
GiB = 2**30
# The collective timeout of every multi-process run started by spawn (train.py's --dist_timeout_s, the tests'
# workers' init): low, so a rank left waiting in a collective for another's long solo work fails a test or a
# benchmark here instead of a cluster job.
DIST_TIMEOUT_S = 60
NO_EVAL = "stages:\n  - {name: bench, eval: {passkey_trials: 0, heldout_samples: 0}}\n"


def result_path(name: str) -> str:
    """bench/results/<name>: the default output of a benchmark."""
    return os.path.join(RESULTS, name)


def read_json(path: str, flag: str, what: str):
    """A saved result's JSON for a --render / --report / --merge style `flag`; ValueError (one line, `what` naming the
    file to give) where it cannot be read, is not UTF-8 or not JSON: before any output is written."""
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError) as e:  # ValueError: not JSON, or not UTF-8
        raise ValueError(f"{flag} {path}: not a readable JSON file ({type(e).__name__}): {what}") from None


def write_json(path: str, obj) -> None:
    """`obj` as indented JSON at `path`, its folder made first."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(obj, fh, indent=1)


def format_table(header: list[str], rows: list[list], widths: list[int] | None = None) -> str:
    """Columns right-aligned to `widths` (default: the widest cell), the first left-aligned; floats as given
    by the caller (pass strings for a fixed format)."""
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = widths or [max(len(r[i]) for r in cells) + (2 if i else 0) for i in range(len(header))]
    return "\n".join("".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in cells)


# --- ranks as plain subprocesses (what scripts/launch.sh does; a caller can signal or kill one rank) ----------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(script: str, args: list[str], nproc: int, log_dir: str, extra_env: dict | None = None) -> list[subprocess.Popen]:
    """`nproc` ranks of `script` (a file, or a module name such as "bench.eval_memory", run with -m) on this
    machine over gloo, each logging to log_dir/rank<r>.log. Each rank has RANK / WORLD_SIZE / MASTER_* set, the
    environment the deepspeed launcher gives its children."""
    from base.env import EXTENSIONS_DIR

    port = free_port()
    procs = []
    if script.endswith("train.py") and not any(a.startswith("--dist_timeout_s") for a in args):
        args = [*args, "--dist_timeout_s", str(DIST_TIMEOUT_S)]
    entry = [script] if script.endswith(".py") else ["-m", script]
    os.makedirs(log_dir, exist_ok=True)
    for rank in range(nproc):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
                   PYTHONPATH=ROOT, WANDB_MODE="offline")
        env.setdefault("TORCH_EXTENSIONS_DIR", EXTENSIONS_DIR)  # the checkout's built ops (base/env.py)
        env.update(extra_env or {})  # PYTHONPATH included (a stub folder in front of the repo)
        log = open(os.path.join(log_dir, f"rank{rank}.log"), "w")
        procs.append(subprocess.Popen([sys.executable, *entry, *args], cwd=ROOT, env=env, stdout=log,
                                      stderr=subprocess.STDOUT))
    return procs


def wait(procs: list[subprocess.Popen], log_dir: str, timeout: float = 600) -> list[int]:
    codes = []
    try:
        for p in procs:
            codes.append(p.wait(timeout=timeout))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return codes


def run(script: str, args: list[str], nproc: int, log_dir: str, timeout: float = 600, expect: int | None = 0,
        extra_env: dict | None = None) -> list[int]:
    """Run to completion; on an unexpected exit code fail with the tail of every rank's log."""
    codes = wait(spawn(script, args, nproc, log_dir, extra_env), log_dir, timeout)
    if expect is not None and any(c != expect for c in codes):
        tails = []
        for r in range(nproc):
            with open(os.path.join(log_dir, f"rank{r}.log")) as fh:
                tails.append(f"--- rank{r} ---\n" + "".join(fh.readlines()[-25:]))
        raise AssertionError(f"exit codes {codes} (expected {expect})\n" + "\n".join(tails))
    return codes


# --- the bench model and train.py launches through the deepspeed launcher ----------------------------------

def bench_model(hidden: int = 256, layers: int = 2, heads: int = 4, kv_heads: int = 2, vocab: int = 2048,
                root: str | None = None) -> str:
    """A tiny-llama variant saved once with save_pretrained (seed 0); returns its folder."""
    path = os.path.join(root or os.path.join(ROOT, ".cache", "bench_models"),
                        f"llama_h{hidden}_l{layers}_nh{heads}_kv{kv_heads}_v{vocab}")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    import torch
    from transformers import AutoModelForCausalLM

    from model_utils.build import preset_config

    torch.manual_seed(0)
    cfg = preset_config("tiny-llama", hidden_size=hidden, intermediate_size=round(hidden * 2.6875),
                        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                        vocab_size=vocab)
    tmp = path + f".tmp{os.getpid()}"
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(tmp)
    os.replace(tmp, path)  # another run may have written it meanwhile: same seed, same weights
    return path


def bench_env(device: str, extra: dict | None = None) -> dict:
    """Environment of every launch: this checkout's DeepSpeed ops (set by importing `training`) also for the
    peer scripts, which do not import it; on CPU one thread per rank (the ranks share the cores), on a GPU the
    threads the launcher gives (CPU Adam of the offloaded optimizer runs on them)."""
    from base.env import EXTENSIONS_DIR

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
               WANDB_MODE="offline", **(extra or {}))
    env.setdefault("TORCH_EXTENSIONS_DIR", EXTENSIONS_DIR)
    if device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
        env["OMP_NUM_THREADS"] = "1"
    return env


def launcher() -> list[str]:
    """The deepspeed launcher: this checkout's .venv one, else the running interpreter's DeepSpeed (a GPU
    machine whose Python already holds torch)."""
    exe = os.path.join(ROOT, ".venv", "bin", "deepspeed")
    return [exe] if os.path.exists(exe) else [sys.executable, "-m", "deepspeed.launcher.runner"]


def launch(cmd: list[str], env: dict, log_path: str, timeout: float) -> tuple[int, float]:
    """Run a launcher command in its own process group; on timeout end that group. (exit code, seconds)."""
    t0 = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the group of the launcher started here, ranks included
            proc.wait()
            code = -9
    return code, time.time() - t0


def launch_failure(log_path: str, tail: int = 30) -> dict:
    """What a failed launch's record keeps, from one read of its log: `error`, the line that says why
    (train.py's one-line `error: ...`, else the last exception), and `log_tail`, its last `tail` lines
    (the run folders are temporary)."""
    with open(log_path, errors="replace") as fh:
        lines = [ln.rstrip() for ln in fh]
    return {"error": _error_line(lines)[:500], "log_tail": [ln[:300] for ln in lines[-tail:]]}


def _error_line(lines: list[str]) -> str:
    # ranks' lines may carry the launcher's "[N]:" or torch's "[rankN]:" prefix; the launcher's own lines
    # ("[date] [INFO|ERROR] [launch.py:...]") only say that a rank exited, so they are the last resort
    bare = [re.sub(r"^\[(rank)?\d+\]:?\s*", "", ln) for ln in lines]
    for pat in (r"^error: ", r"^[\w.]*(Error|Exception|Interrupt)\b", r"Killed|Segmentation fault|core dumped"):
        hits = [b for b in bare if re.search(pat, b)]
        if hits:
            return hits[-1]
    own = [b for b in bare if b and "launch.py:" not in b]
    codes = re.findall(r"exits with return code = (-?\d+)", "\n".join(bare))
    if codes:
        return f"a rank exited with return code {codes[-1]}; its last output: {own[-1] if own else 'none'}"
    return own[-1] if own else lines[-1] if lines else "no output"


def read_metrics(out_dir: str) -> list[dict]:
    """Every record of a run's metrics.jsonl ([] when it wrote none)."""
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        return list(map(json.loads, filter(str.strip, fh)))


def read_steps(out_dir: str, records: list[dict] | None = None) -> list[dict]:
    return [r for r in (read_metrics(out_dir) if records is None else records) if "tokens_per_s" in r]


def summarize_steps(steps: list[dict]) -> dict:
    """Median tokens/s after the first step (start-up and first-touch allocations) and the max peak. A skipped step
    (no supervised token: tokens_per_s null, training/stage.py) ran nothing and is left out."""
    steps = [r for r in steps if r.get("tokens_per_s") is not None]
    later = steps[1:] or steps
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in later),
            "peak_mem_gb": max(r["peak_mem_gb"] for r in steps),
            "step_tokens_per_s": [round(r["tokens_per_s"], 1) for r in steps],
            "step_peak_mem_gb": [r["peak_mem_gb"] for r in steps]}


def train_point(model: str, seq_len: int, sp: int, features: tuple[str, ...], steps: int, device: str,
                work: str, nproc: int | None = None, timeout: float = 900, extra_args: tuple[str, ...] = (),
                env: dict | None = None) -> dict:
    """One train.py launch on `nproc` ranks (default sp; DP = nproc / sp). Returns the point's record;
    `ok` False with `error` when the launch failed (e.g. a feature that is not available)."""
    nproc = nproc or sp
    tag = f"L{seq_len}_sp{sp}_n{nproc}_{'-'.join(features) or 'none'}"
    if extra_args:  # a folder of its own per argument set (they may hold paths)
        tag += "_" + hashlib.sha1(" ".join(extra_args).encode()).hexdigest()[:8]
    out = os.path.join(work, tag)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    cfg = os.path.join(out, "noeval.yaml")
    with open(cfg, "w") as fh:
        fh.write(NO_EVAL)
    cmd = [*launcher(), "--num_gpus", str(nproc), "--master_port",
           str(free_port()), "train.py", "--config", cfg, "--model_name_or_path", model, "--max_seq_length",
           str(seq_len), "--sequence_parallel_size", str(sp), "--max_steps", str(steps), "--output_dir", out,
           "--report_to", "none", "--no-export_hf", "--save_steps", "0", "--resume", "none", "--no-progress_bar",
           "--learning_rate", "1e-4", *feature_flags(features), *extra_args]
    load0 = os.getloadavg()[0]
    code, wall = launch(cmd, bench_env(device, env), os.path.join(out, "launch.log"), timeout)
    rec = {"seq_len": seq_len, "sp": sp, "nproc": nproc, "features": list(features), "device": device,
           "wall_s": round(wall, 1), "load_before": round(load0, 2), "load_after": round(os.getloadavg()[0], 2)}
    records = read_metrics(out)
    steps_done = read_steps(out, records)
    choice = next((r for r in records if r.get("event") == "memory_choice"), None)  # what memory_features auto chose
    if choice:
        rec["memory_choice"] = choice
    if code != 0 or len(steps_done) < steps:
        return (rec | {"ok": False, "exit_code": code, "steps_logged": len(steps_done)}
                | launch_failure(os.path.join(out, "launch.log")))
    return rec | {"ok": True} | summarize_steps(steps_done)


def feature_flags(features: tuple[str, ...]) -> list[str]:
    """("tiled_mlp", "checkpoint_every=2") -> ["--tiled_mlp", "--checkpoint_every", "2"]."""
    return [a for f in features for a in (["--" + f.split("=")[0], f.split("=")[1]] if "=" in f else ["--" + f])]
