"""How long a checkpoint save blocks training, synchronous vs asynchronous, how long a resume takes, measured, and
what that means at Llama-3-8B on 32 ranks.

The deepspeed launcher answers SIGTERM by terminating its children and SIGKILLing them after a grace
period (see docs/launch.md), and SLURM's `--signal=B:USR1@N` warns N seconds ahead: the preemption save
must fit. This runs real 2-rank trainings on CPU for a model of the given size, side by side: one saving
synchronously at steps 2 and 4 (every byte written, CRC32 on the way, fsynced, committed before step 3 starts), one with
`--async_save` (the step loop waits only for the snapshot: each rank's state copied into host memory; a thread
serializes and writes it; the commit comes at a later step boundary). It reports the blocked time and the total time (save start
to commit) of each, their ratio (goal <= 0.25), the snapshot's host memory per rank, and projects the blocked
time and the write of a bigger model. It then resumes the asynchronous run (a third job, one step more) and
measures the resume (from step 6): verification of every file's CRC32 (dealt to ranks by bytes) and DeepSpeed's load.

    python -m bench.checkpoint [--hidden 1024 --layers 16] [--project llama3-8b --world 32 --per_node 8]

bench/preempt.py measures the synchronous save inside a preempted run, with the stop-to-exit time around it.
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
    p.add_argument("--layers", type=int, default=16)
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
        env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")

        def train(out: str, steps: int, *extra: str) -> str:
            cmd = [os.path.join(ROOT, ".venv/bin/deepspeed"), "--num_gpus", "2", "train.py", "--model_name_or_path",
                   os.path.join(tmp, "model"), "--max_seq_length", "256", "--sequence_parallel_size", "2",
                   "--max_steps", str(steps), "--save_steps", "2", "--output_dir", out, "--report_to", "none",
                   "--no-export_hf", *extra]
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
            if proc.returncode:
                raise RuntimeError(proc.stdout[-3000:] + proc.stderr[-3000:])
            return proc.stdout

        def number(pattern: str, text: str) -> float:
            m = re.search(pattern, text)
            if not m:
                raise RuntimeError(f"no line matching {pattern!r} in:\n{text[-3000:]}")
            return float(m.group(1))

        # saves at steps 2 and 4 are mid-stage (the ones --async_save makes asynchronous; step 4's is measured: the
        # snapshot's host memory is reused from step 2's, as in a long run), step 6 ends the stage
        sync_out, async_out = os.path.join(tmp, "sync"), os.path.join(tmp, "async")
        try:
            sync_log = train(sync_out, 6, "--no-async_save")  # explicit: the default (auto) is on for a GPU run
            async_log = train(async_out, 6, "--async_save")
        except RuntimeError as e:
            print(e)
            return 1
        sync_s = number(r"saved \S+step_000004 in ([0-9.]+)s", sync_log)
        first_blocked_s = number(r"snapshot of step 2 in ([0-9.]+)s", async_log)
        blocked_s = number(r"snapshot of step 4 in ([0-9.]+)s", async_log)
        async_total_s = number(r"saved \S+step_000004 in ([0-9.]+)s", async_log)
        snapshot_gib = number(r"snapshot of step 4 in \S+ \(([0-9.]+) GiB of host memory", async_log)
        copy_s = number(r"snapshot of step 4 in .*copied in ([0-9.]+)s", async_log)
        ck = os.path.join(async_out, "checkpoints", "step_000004")
        total = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(ck) for f in fs)
        try:
            again = train(async_out, 7, "--async_save")  # the requeued job: verify, load, one more step
        except RuntimeError as e:
            print(e)
            return 1
        verify_s = number(r"verified \S+ in ([0-9.]+)s", again)
        load_s = number(r"loaded \S+ in ([0-9.]+)s", again)
    per_rank = total / 2
    rate = per_rank / sync_s  # bytes per second per rank, both ranks writing at once on one disk
    snap_rate = per_rank / blocked_s  # bytes per second per rank snapshot into host memory, both ranks at once
    big = load_shape(a.project).num_params()
    bytes_per_param = total / n_params  # bf16/fp32 weights + fp32 master + Adam moments as DeepSpeed saves them
    rank_bytes = big * bytes_per_param / a.world
    node_bytes = rank_bytes * a.per_node
    resume_rate = per_rank / (verify_s + load_s)  # every byte read twice: once verified, once loaded
    result = {"params": n_params, "bytes_total": total, "bytes_per_param": round(bytes_per_param, 2),
              "save_seconds": sync_s, "per_rank_MBps": round(rate / 2**20, 1), "node_MBps": round(2 * rate / 2**20, 1),
              "async": {"blocked_seconds": blocked_s, "first_save_blocked_seconds": first_blocked_s,
                        "copy_seconds": copy_s, "deepspeed_state_seconds": round(blocked_s - copy_s, 2),
                        "total_seconds": async_total_s,
                        "blocked_over_sync": round(blocked_s / sync_s, 3),
                        "snapshot_host_GiB_per_rank": snapshot_gib,
                        "snapshot_per_rank_MBps": round(snap_rate / 2**20, 1)},
              "resume_verify_seconds": verify_s, "resume_load_seconds": load_s,
              "resume_node_MBps": round(2 * resume_rate / 2**20, 1),
              "projection": {"model": a.project, "params": big, "world": a.world, "per_node": a.per_node,
                             "bytes_per_node": node_bytes,
                             "seconds_at_this_node_bandwidth": round(node_bytes / (2 * rate), 1),
                             "async_blocked_seconds_at_this_snapshot_rate": round(rank_bytes / snap_rate, 1),
                             "async_snapshot_host_GiB_per_node": round(node_bytes / 2**30, 1),
                             "resume_seconds_at_this_node_bandwidth": round(node_bytes / (2 * resume_rate), 1)}}
    write_json(a.out, result)
    pr = result["projection"]
    print(f"measured: {n_params / 1e6:.0f}M params, {total / 2**30:.2f} GiB per save, {bytes_per_param:.1f} bytes/param")
    print(f"synchronous save: {sync_s:.2f}s blocked = total ({result['node_MBps']} MB/s for the node)")
    print(f"asynchronous save: {blocked_s:.2f}s blocked (snapshot, {snapshot_gib:.2f} GiB of host memory per rank; "
          f"copy into host memory {copy_s:.2f}s, the rest DeepSpeed's state assembly; the run's first: "
          f"{first_blocked_s:.2f}s), "
          f"{async_total_s:.1f}s to its commit; blocked / synchronous = {blocked_s / sync_s:.3f}")
    print(f"resume: verify {verify_s:.2f}s + load {load_s:.2f}s ({result['resume_node_MBps']} MB/s for the node)")
    print(f"projected: {a.project} on {a.world} ranks, {node_bytes / 2**30:.1f} GiB per node -> synchronous save "
          f"{pr['seconds_at_this_node_bandwidth']}s, asynchronous blocked {pr['async_blocked_seconds_at_this_snapshot_rate']}s "
          f"({pr['async_snapshot_host_GiB_per_node']} GiB of host memory per node), resume "
          f"{pr['resume_seconds_at_this_node_bandwidth']}s; wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
