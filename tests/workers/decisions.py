"""Worker for tests/multiproc/test_same_decision.py: every decision that changes control flow or what is loaded, taken on
two ranks whose views of the shared file system (and memory budgets, and node sizes) differ: rank 1 runs with
tests/stubs/stale_view (see there); DECISIONS_NODE_SIZES ("8,4") gives each rank its own launcher's node size
(LOCAL_WORLD_SIZE, as uneven hostfile slots 8/4/4 do) before the process group. Each rank writes
result<rank>.json with what it decided and, for contrast, what its own view alone would have said. Then, in the same
launch, decisions one rank's own event must not make alone (the `one_*` fields): a stop asked on rank 1 only (SIGUSR1;
SIGTERM under a launcher: the kill window), a background save whose write is held on rank 1 (committed by no rank,
then by every rank at one poll), and each rank's load of its own state file."""

import json
import os
import signal
import sys
import threading
import time
from types import SimpleNamespace

import torch

import training.async_save as async_save
from base import comm
from base.host import ranks_per_node
from base.parallel import init_distributed
from data.prepare import prepare_in_job
from data.store import is_prepared
from tests.distributed import DIST_TIMEOUT_S
from training import curriculum
from training.checkpoint import Checkpointer
from training.config import Config
from training.curriculum import agreed_budget, check_stages, gpus_per_node, resolve_stages
from training.metrics import MetricsLogger
from training.preemption import PreemptionFlag

out, folder = sys.argv[1], sys.argv[2]
sizes = os.environ.get("DECISIONS_NODE_SIZES")
if sizes:  # this rank's launcher says its node has this many ranks (the 8-slot node for rank 0, a 4-slot one for 1)
    os.environ["LOCAL_WORLD_SIZE"] = sizes.split(",")[int(os.environ["RANK"])]
dims = init_distributed(1, timeout_s=DIST_TIMEOUT_S)
r: dict = {}

# the Ulysses x cp split of SP 16 for Llama-3-8B (32 heads, 8 KV) in a 16-rank job, as start-up lays it out
cfg = Config(model_name_or_path="llama3-8b", deepspeed="ds_configs/zero3_offload.json", bf16=True,
             max_seq_length=131072, sequence_parallel_size=16)
stages = resolve_stages(cfg, lambda sp: 16 // sp)
r["own_node_size"] = ranks_per_node()
r["own_layout"] = [(s.sp // s.cp, s.cp) for s in check_stages(stages, 16, 32, 8, None, ranks_per_node())]
r["node_size"] = gpus_per_node(cfg)
r["layout"] = [(s.sp // s.cp, s.cp) for s in check_stages(stages, 16, 32, 8, None, gpus_per_node(cfg))]

ck = Checkpointer(out, keep=3)
r["own_tags"] = ck.tags()
resume = ck.find_resume("auto")
r["resume"] = os.path.basename(resume)
r["trainer_step"] = Checkpointer.read_trainer(resume)["step"]

metrics = MetricsLogger(out, dims.is_main, "none", "p", None, {}, 1, False)
r["own_evaluated"] = [i for i in range(2) if metrics.has_eval(i)]
r["evaluated"] = sorted(metrics.evaluated(2))

stop_file = os.path.join(out, "PREEMPT")
r["own_stop_file"] = os.path.exists(stop_file)
r["stop"] = PreemptionFlag(stop_file).agreed()

# a save by time: only rank 0's clock counts (rank 1's interval has passed, rank 0's not; then the other way)
for key, every in (("save_due_rank1_clock", (3600.0, 1e-9)), ("save_due_rank0_clock", (1e-9, 3600.0))):
    flag = PreemptionFlag(None, save_every_s=every[dims.rank])
    time.sleep(0.01)
    flag.agreed()
    r[key] = flag.save_due

# each rank's own reading of its memory: 1 GiB more per rank (another process holding memory on a GPU)
curriculum.device_budget = lambda gpu, cap: ("cpu", (1 + dims.rank) * 2**30)
r["own_budget"] = curriculum.device_budget(0, 0)[1]
r["budget"] = agreed_budget(SimpleNamespace(gpu_mem_gb=0.0, mem_cap_gb=4.0))()[1]

r["own_prepared"] = is_prepared(folder)
r["data"] = prepare_in_job(folder, None, 2048)[0]

# --- one rank's event, every rank's decision (another folder: the stale view above hides nothing of it) ---
# a save asked on rank 1 alone (SIGUSR1): every rank stops; a SIGTERM on rank 1 alone: every rank stops, inside the
# kill window
flag = PreemptionFlag(None)
if dims.rank == 1:
    flag._handler(signal.SIGUSR1, None)
r["one_stop"] = flag.agreed()
flag = PreemptionFlag(None)
if dims.rank == 1:
    flag._handler(signal.SIGTERM, None)
r["one_term_stop"] = flag.agreed()
r["one_term_window"] = flag.window_left_s is not None  # the launcher's SIGKILL KILL_WINDOW_S after rank 1's TERM


class _Engine:  # saves a live tensor through DeepSpeed's torch checkpoint engine, as ZeRO-3's save does
    def __init__(self):
        from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

        self.checkpoint_engine = TorchCheckpointEngine.__new__(TorchCheckpointEngine)
        self.checkpoint_engine.zipfile_serialization = True
        self.w = torch.full((1024,), float(dims.rank))

    def save_checkpoint(self, root, tag, save_latest):
        self.checkpoint_engine.save({"fp32": self.w},
                                    os.path.join(root, tag, f"zero_pp_rank_{dims.rank}_mp_rank_00_optim_states.pt"))


class _HFConfig:
    def to_json_string(self):
        return "{}"


commit = os.path.join(os.path.dirname(out), "commit")
ck, engine = Checkpointer(commit, keep=3), _Engine()
ck.save(engine, 1, {"step": 1}, {"rank": dims.rank}, _HFConfig())
# a background save whose write is held on rank 1: no rank commits it at a poll, then every rank at one poll
opened, held_at = threading.Event(), threading.Event()
if dims.rank == 1:
    write = async_save.write_durable

    def held(path, data):
        held_at.set()
        assert opened.wait(120)
        return write(path, data)

    async_save.write_durable = held
ck.save(engine, 2, {"step": 2}, {"rank": dims.rank}, _HFConfig(), background=True)
if dims.rank == 1:
    held_at.wait(120)
else:
    ck.pending.snapshot.wait()  # this rank's write is durable, rank 1's is not
r["one_held_poll"] = ck.poll()
r["one_next_collective"] = comm.all_gather_object(dims.rank)  # every rank reaches it, none is inside a commit
opened.set()
ck.pending.snapshot.wait()
comm.barrier()
got = ck.poll()
r["one_committed"] = os.path.basename(got[0]) if got else None
# a same-world load: each rank gets its own data position and RNG (its own state file)
loading = SimpleNamespace(_config=SimpleNamespace(load_universal_checkpoint=False), lr_scheduler=None,
                          optimizer=SimpleNamespace(state={}, param_groups=[]),
                          load_checkpoint=lambda d, tag, **k: (os.path.join(d, tag), {}))
r["one_loaded_rank"] = ck.load(loading, os.path.join(commit, "checkpoints", "step_000002"))["rank"]

with open(os.path.join(os.path.dirname(out), f"result{dims.rank}.json"), "w") as fh:
    json.dump(r, fh)
comm.barrier()
