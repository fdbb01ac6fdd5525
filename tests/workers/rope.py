"""Worker for tests/multiproc/test_rope.py: build the engine under ZeRO-3 for each stage RoPE setting and report,
from every rank, the rotary embedding's inverse frequencies and attention factor. Each engine is ended as a stage
ends it (training.engine.release_engine); the worker also records whether its model and optimizer were freed then,
as a stage's must be before the next stage builds its own."""

import copy
import gc
import json
import os
import sys
import warnings
import weakref

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")

from base.parallel import init_distributed  # noqa: E402
from model_utils.build import load_hf_config  # noqa: E402
from model_utils.rope import apply_rope  # noqa: E402
from tests.distributed import DIST_TIMEOUT_S  # noqa: E402
from training.config import config_from_dict  # noqa: E402
from training.engine import build_engine, release_engine  # noqa: E402

if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    results, released = {}, []
    for name, rope in spec["cases"].items():
        cfg = config_from_dict({"model_name_or_path": spec["model"], "sequence_parallel_size": 2, "max_steps": 1,
                                "deepspeed": spec["deepspeed"], "report_to": "none"})
        dims = init_distributed(2, timeout_s=DIST_TIMEOUT_S)
        hf = copy.deepcopy(load_hf_config(cfg.model_name_or_path))
        apply_rope(hf, rope, 4096)
        engine = build_engine(cfg, dims, hf, "sdpa", bf16=False, seed=0)
        rot = engine.module.model.rotary_emb
        mine = {"inv_freq": rot.inv_freq.double().tolist(), "attention_scaling": float(rot.attention_scaling),
                "rope_type": engine.module.config.rope_parameters.get("rope_type", "default")}
        gathered = [None] * dims.world
        dist.all_gather_object(gathered, mine)
        results[name] = gathered
        alive = [weakref.ref(engine.module), weakref.ref(engine.optimizer)]
        if os.environ.get("ROPE_WORKER_DESTROY_ONLY"):  # what stages did before release_engine: the test fails
            engine.destroy()
        else:
            release_engine(engine)
        del engine, rot
        gc.collect()
        released.append([r() is None for r in alive])
    results["_released"] = released
    if dist.get_rank() == 0:
        torch.save(results, spec["out"])
