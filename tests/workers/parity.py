"""Worker for tests/multiproc/test_parity.py (and, through run_case, tests/workers/memory.py): `max_steps` optimizer
steps through the real engine, per case, with the loss function train.py would use for the case's config.

For each case it records the first step's loss, the sample indices every rank used and the full gradients
(gathered from ZeRO-3 before the optimizer step, and the names of any left in .grad unreduced), and every step's
loss. Run under tests.distributed.spawn.

A supervised fine-tuning case ("sft_samples": a torch.save'd list of samples with a per-token `loss_mask` and
position ids restarting per conversation; "sft_batches"[dp_rank][micro_step]: the sample indices of each micro-batch)
trains on those samples instead of the token stream, at its own SP degree and context-parallel factor (a launch's
world may hold several layouts: cases run one after the other), through the loss weighting of its config.
"""

import json
import sys
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")

from base.parallel import check_layout, init_distributed  # noqa: E402
from data.packing import PackedDataset, build_token_stream  # noqa: E402
from data.sampler import ResumableSampler  # noqa: E402
from data.sharding import collate, shard  # noqa: E402
from model_utils.build import load_hf_config  # noqa: E402
from model_utils.memory import make_loss_fn  # noqa: E402
from tests.distributed import DIST_TIMEOUT_S  # noqa: E402
from training.config import config_from_dict  # noqa: E402
from training.engine import build_engine, features_of  # noqa: E402
from training.step import train_step  # noqa: E402


def run_case(case: dict, dims_sp: int) -> dict:
    cfg = config_from_dict({k: v for k, v in case.items() if k not in ("out", "cache", "sft_samples", "sft_batches")})
    hf = load_hf_config(cfg.model_name_or_path)
    cp = cfg.context_parallel_size if isinstance(cfg.context_parallel_size, int) else 1
    dims = init_distributed(cfg.sequence_parallel_size, timeout_s=DIST_TIMEOUT_S, cp=cp)
    t = hf.get_text_config()
    check_layout(dims.world, dims.sp, t.num_attention_heads, t.num_key_value_heads, cfg.max_seq_length, cp)
    if "sft_samples" in case:
        ds, plan = torch.load(case["sft_samples"], weights_only=False), iter(case["sft_batches"][dims.dp_rank])
        next_batch = lambda: next(plan)  # noqa: E731
    else:
        tokens, starts = build_token_stream(cfg.dataset_path, None, t.vocab_size, case["cache"])
        ds = PackedDataset(tokens, starts, cfg.max_seq_length, reset_position_ids=False)
        next_batch = ResumableSampler(len(ds), dims.dp, dims.dp_rank, cfg.per_device_train_batch_size,
                                      cfg.seed).next_batch
    engine = build_engine(cfg, dims, hf, "sdpa", bf16=False, seed=cfg.seed)
    import cpuinfo  # build_engine made DeepSpeed's CPU asks one per process (base/env.ask_cpu_once: ~1.1 CPU-s each)
    assert getattr(cpuinfo.get_cpu_info, "asked_once", False), "build_engine did not install base/env.ask_cpu_once"
    indices, grads, losses, leftover = [], {}, [], []

    def batches():
        micro = []
        for _ in range(cfg.gradient_accumulation_steps):
            idx = next_batch()
            indices.append(idx)
            micro.append(shard(collate([ds[i] for i in idx], dims.seq_multiple, 0, cfg.loss_weighting), dims.sp,
                               dims.sp_rank, dims.cp))
        return micro

    def grab(engine):
        from deepspeed.utils import safe_get_full_grad

        for name, p in engine.module.named_parameters():
            if p.grad is not None:  # ZeRO-3 reduces every gradient into its partition and drops .grad
                leftover.append(name)
            g = safe_get_full_grad(p)
            if dims.is_main:
                grads[name] = g.detach().clone().cpu()

    out = train_step(engine, batches(), dims.world, loss_fn=make_loss_fn(features_of(cfg)), before_step=grab)
    losses.append(out["loss"])
    first = list(indices)
    for _ in range(cfg.max_steps - 1):  # later steps: their losses only (what the first step's update changed)
        losses.append(train_step(engine, batches(), dims.world, loss_fn=make_loss_fn(features_of(cfg)))["loss"])
    indices = first
    all_indices = [None] * dims.world
    dist.all_gather_object(all_indices, {"dp_rank": dims.dp_rank, "indices": indices})
    if dims.is_main:
        torch.save({"loss": out["loss"], "losses": losses, "leftover": leftover, "indices": all_indices, "grads": grads,
                    "label_tokens": out["label_tokens"], "label_weight": out.get("label_weight")}, case["out"])
    engine.destroy()
    return out


if __name__ == "__main__":
    for case in json.loads(sys.argv[1]):
        run_case(case, case["sequence_parallel_size"])
        dist.barrier()
