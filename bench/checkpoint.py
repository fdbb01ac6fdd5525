"""How long a checkpoint save and a resume take, measured, and what that means at Llama-3-8B on 32 ranks.

The deepspeed launcher answers SIGTERM by terminating its children and SIGKILLing them after a grace
period (see docs/launch.md), and SLURM's `--signal=B:USR1@N` warns N seconds ahead: the preemption save
must fit. This runs a real 2-rank save on CPU for a model of the given size, reports the bytes written per
rank and the throughput (write with CRC32 computed on the way + fsync), and projects the save time of a
bigger model on the same storage. It then resumes the run (a second job, one step more) and measures the resume:
verification of every file's CRC32 (dealt to ranks by bytes) and DeepSpeed's load, and projects both the same way.

    python -m bench.checkpoint [--hidden 1024 --layers 8] [--project llama3-8b --world 32 --per_node 8]

bench/preempt.py measures the same save inside a preempted run, with the stop-to-exit time around it.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

from bench.harness import ROOT, result_path, write_json


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--project", default="llama3-8b", help="preset whose save time to project")
    p.add_argument("--world", type=int, default=32)
    p.add_argument("--per_node", type=int, default=8)
    p.add_argument("--out", default=result_path("checkpoint.json"))
    a = p.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from model_utils.build import preset_config
    from planner.memory_model import load_shape

    with tempfile.TemporaryDirectory() as tmp:
        cfg = preset_config("tiny-llama", hidden_size=a.hidden, intermediate_size=int(a.hidden * 2.6875),
                            num_hidden_layers=a.layers, num_attention_heads=8, num_key_value_heads=8,
                            vocab_size=2048)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        n_params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(os.path.join(tmp, "model"))
        del model
        out = os.path.join(tmp, "run")
        env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
        cmd = [os.path.join(ROOT, ".venv/bin/deepspeed"), "--num_gpus", "2", "train.py", "--model_name_or_path",
               os.path.join(tmp, "model"), "--max_seq_length", "256", "--sequence_parallel_size", "2",
               "--max_steps", "1", "--output_dir", out, "--report_to", "none", "--no-export_hf"]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        m = re.search(r"saved \S+ in ([0-9.]+)s", proc.stdout)
        if proc.returncode or not m:
            print(proc.stdout[-3000:], proc.stderr[-3000:])
            return 1
        seconds = float(m.group(1))
        ck = os.path.join(out, "checkpoints", "step_000001")
        total = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(ck) for f in fs)
        cmd[cmd.index("--max_steps") + 1] = "2"  # the requeued job: verify, load, one more step
        again = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        v = re.search(r"verified \S+ in ([0-9.]+)s", again.stdout)
        ld = re.search(r"loaded \S+ in ([0-9.]+)s", again.stdout)
        if again.returncode or not (v and ld):
            print(again.stdout[-3000:], again.stderr[-3000:])
            return 1
        verify_s, load_s = float(v.group(1)), float(ld.group(1))
    per_rank = total / 2
    rate = per_rank / seconds  # bytes per second per rank, both ranks writing at once on one disk
    big = load_shape(a.project).num_params()
    bytes_per_param = total / n_params  # bf16/fp32 weights + fp32 master + Adam moments as DeepSpeed saves them
    node_bytes = big * bytes_per_param / a.world * a.per_node
    resume_rate = per_rank / (verify_s + load_s)  # every byte read twice: once verified, once loaded
    result = {"params": n_params, "bytes_total": total, "bytes_per_param": round(bytes_per_param, 2),
              "save_seconds": seconds, "per_rank_MBps": round(rate / 2**20, 1),
              "node_MBps": round(2 * rate / 2**20, 1),
              "resume_verify_seconds": verify_s, "resume_load_seconds": load_s,
              "resume_node_MBps": round(2 * resume_rate / 2**20, 1),
              "projection": {"model": a.project, "params": big, "world": a.world, "per_node": a.per_node,
                             "bytes_per_node": node_bytes,
                             "seconds_at_this_node_bandwidth": round(node_bytes / (2 * rate), 1),
                             "resume_seconds_at_this_node_bandwidth": round(node_bytes / (2 * resume_rate), 1)}}
    write_json(a.out, result)
    print(f"measured: {n_params / 1e6:.0f}M params, {total / 2**30:.2f} GiB in {seconds:.2f}s "
          f"({result['node_MBps']} MB/s for the node, {bytes_per_param:.1f} bytes/param)")
    print(f"resume: verify {verify_s:.2f}s + load {load_s:.2f}s ({result['resume_node_MBps']} MB/s for the node)")
    print(f"projected: {a.project} on {a.world} ranks, {node_bytes / 2**30:.1f} GiB per node -> save "
          f"{result['projection']['seconds_at_this_node_bandwidth']}s, resume "
          f"{result['projection']['resume_seconds_at_this_node_bandwidth']}s at the same bandwidth; wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
