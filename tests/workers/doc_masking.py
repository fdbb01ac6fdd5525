"""Worker for tests/multiproc/test_doc_masking.py: one step through the real engine on packed samples whose position ids
restart at every document (reset_position_ids), per case.

Every case counts the `attention.Documents` builds (one per micro-batch, however many layers and
recomputes) and the attention calls. A case with "grads" runs `train_step` and records the loss and the full
gradients (gathered from ZeRO-3 before the optimizer step); without (flex_attention on CPU: torch has no flex
backward there) it records the forward loss only. Every case then runs `check_routed`. Run under
tests.distributed.spawn.
"""

import json
import sys
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")

from base.parallel import init_distributed  # noqa: E402
from data.packing import PackedDataset, build_token_stream  # noqa: E402
from data.sharding import collate, shard  # noqa: E402
from model_utils import attention, ring_attention, rmsnorm, ulysses  # noqa: E402
from model_utils.build import load_hf_config  # noqa: E402
from model_utils.tiled_loss import loss_sum  # noqa: E402
from tests.distributed import DIST_TIMEOUT_S  # noqa: E402
from training.config import config_from_dict  # noqa: E402
from training.engine import build_engine  # noqa: E402
from training.step import train_step  # noqa: E402

CASE_KEYS = ("out", "cache", "samples", "grads", "bypass", "eval", "ring_bytes")


def run_case(case: dict) -> None:
    cfg = config_from_dict({k: v for k, v in case.items() if k not in CASE_KEYS})
    hf = load_hf_config(cfg.model_name_or_path)
    cp = cfg.context_parallel_size if isinstance(cfg.context_parallel_size, int) else 1
    dims = init_distributed(cfg.sequence_parallel_size, timeout_s=DIST_TIMEOUT_S, cp=cp)
    tokens, starts = build_token_stream(cfg.dataset_path, None, hf.get_text_config().vocab_size, case["cache"])
    ds = PackedDataset(tokens, starts, cfg.max_seq_length, reset_position_ids=True)
    engine = build_engine(cfg, dims, hf, cfg.attn_implementation, bf16=False, seed=cfg.seed)
    if case.get("bypass"):  # the first layer's attention never goes through ALL_ATTENTION_FUNCTIONS
        from tests.multiproc.test_doc_masking import bypass_attention

        bypass_attention(engine.module.model.layers[0].self_attn)
    stats = None
    if case.get("eval"):  # the evaluation's per-sample statistics on the same samples, before any update
        from training.evaluation import sample_stats

        stats = sample_stats(engine, [ds[i] for i in case["samples"]], dims, len(case["samples"]), 0, buckets=4)
    builds = []

    class Counted(attention.Documents):
        def __init__(self, *args, **kwargs):
            builds.append(args[0].shape)
            super().__init__(*args, **kwargs)

    attention.Documents = Counted
    mb = shard(collate([ds[i] for i in case["samples"]], dims.seq_multiple, 0), dims.sp, dims.sp_rank, dims.cp)
    grads = {}

    def grab(engine):
        from deepspeed.utils import safe_get_full_grad

        for name, p in engine.module.named_parameters():
            g = safe_get_full_grad(p)
            if dims.is_main and g is not None:  # None: a parameter the step did not reach (an unrouted expert)
                grads[name] = g.detach().clone().cpu()

    ring_attention.STATS.update(peak_bytes=0, calls=0, log=[])  # the ring's buffers and shifts (ring_attention cases)
    if case["grads"]:
        loss = train_step(engine, [mb], dims.world, loss_fn=loss_sum, before_step=grab)["loss"]
    else:
        with torch.no_grad():
            local = loss_sum(engine, {k: v.to(engine.device) for k, v in mb.items()})
        sums = torch.tensor([local.item(), float((mb["shift_labels"] != -100).sum())], dtype=torch.float64)
        dist.all_reduce(sums)
        loss = (sums[0] / sums[1]).item()
    attention.Documents = Counted.__mro__[1]
    calls = attention._STATE["calls"]
    try:
        ulysses.check_routed(engine.module)
        error = None
    except ValueError as err:
        error = str(err)
    norms = [m for m in engine.module.modules() if type(m).__name__.endswith("RMSNorm")]
    lean = [m for m in norms if getattr(m.forward, "__func__", None) is rmsnorm._lean_forward]
    ring = {"peak_bytes": ring_attention.STATS["peak_bytes"], "calls": ring_attention.STATS["calls"],
            "log": ring_attention.STATS["log"]}
    rings = [None] * dist.get_world_size()
    dist.all_gather_object(rings, ring)  # every rank's shifts: what each sends, its peer must expect
    ring_attention.STATS["log"] = None
    if dims.is_main:
        torch.save({"ring": rings, "loss": loss, "grads": grads, "error": error, "norms": (len(lean), len(norms)),
                    "builds": len(builds), "calls": calls, "eval": stats}, case["out"])
    engine.destroy()


if __name__ == "__main__":
    for case in json.loads(sys.argv[1]):
        run_case(case)
        dist.barrier()
