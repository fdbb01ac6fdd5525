"""Several optimizer steps of the real train.py against a plain oracle: the weights after every step.

tests/multiproc/test_parity.py compares one step's loss and gradients (and 3 steps' losses) under every sharding; what
comes after the gradient (gradient accumulation's sum, the global-norm clip, AdamW's moments and weight-decay groups,
the LR schedule and its re-warm at a stage change, the Adam state carried across the stage's checkpoint) had no check
past the first step. Here train.main runs in this process as a world of one (ZeRO-3 with CPU offload of parameters
and optimizer, gloo) over two stages: GA 2, a binding clip (0.05 against norms ~2), weight decay 0.1, a cosine then a
linear stage re-warmed at another peak, at another length; each step's global batch (before sharding) and full
weights are recorded. The oracle replays those batches through the Hugging Face model (document by document, as
document masking attends) with torch.optim.AdamW over the Hugging Face Trainer's decay groups
(transformers/trainer.py `get_decay_parameter_names`), torch's clip_grad_norm_ and transformers' schedule lambdas (with
this project's warmup, one step ahead: docs/curriculum.md). Audit optD ran the same at sp2 x dp2 with resume and a
RoPE change through real launches (~2e-6 everywhere); this is its one-process sibling, ~4 s of CPU.
"""

from __future__ import annotations

import signal
import socket
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import save_tiny_model, write_token_jsonl

STAGES = [dict(name="a", max_seq_length=64, max_steps=3, warmup_steps=2, peak=2e-3, floor=2e-4, kind="cosine"),
          dict(name="b", max_seq_length=128, max_steps=3, warmup_steps=1, peak=1e-3, floor=1e-4, kind="linear")]
CLIP, WD, BETAS, EPS = 0.05, 0.1, (0.9, 0.95), 1e-8  # the betas and eps: ds_configs/zero3_offload.json's
# the Hugging Face Trainer's no-decay names (transformers/trainer.py get_decay_parameter_names), written out here so
# that the oracle does not share the project's copy (training/engine.NO_DECAY)
HF_NO_DECAY = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def recipe(d, model: str, data: str) -> str:
    stages = "".join(f"  - {{name: {s['name']}, max_seq_length: {s['max_seq_length']}, max_steps: {s['max_steps']}, "
                     f"warmup_steps: {s['warmup_steps']}, learning_rate: {s['peak']}, min_lr: {s['floor']}, "
                     f"lr_scheduler: {s['kind']}}}\n" for s in STAGES)
    path = d / "r.yaml"
    path.write_text(f"model_name_or_path: {model}\ndataset_path: {data}\ndeepspeed: ds_configs/zero3_offload.json\n"
                    f"per_device_train_batch_size: 1\ngradient_accumulation_steps: 2\nweight_decay: {WD}\n"
                    f"max_grad_norm: {CLIP}\nsave_steps: 0\noutput_dir: {d / 'out'}\nreport_to: none\n"
                    f"export_hf: false\neval: false\nprogress_bar: false\nseed: 0\nstages:\n{stages}")
    return str(path)


def run_recorded(tmp_path, monkeypatch) -> tuple[str, list[dict]]:
    """train.main in this process (a world of one); per step: the global batch, the loss, the full weights after it,
    and at each engine's first step the weights it started from."""
    import deepspeed
    import torch.distributed as dist

    import train
    import training.stage as stage_mod
    from training.job import run_job

    model = save_tiny_model(str(tmp_path / "model"), "tiny-qwen2")  # Qwen2: q/k/v biases, RMSNorm gains, tied
    data = write_token_jsonl(str(tmp_path / "tokens.jsonl"), n_docs=60)
    monkeypatch.delenv("LAUNCH_EXIT_DIR", raising=False)  # no launcher's files: a world of one run by this process
    # one thread: on 2 busy cores torch's second one spun the tiny model's CPU time 10x (0.2 -> 2.9 s for the
    # oracle); set, OMP_NUM_THREADS also keeps host.check_cpu_placement from writing its share into this process
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "OMP_NUM_THREADS": "1",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(k, v)
    records, pending = [], []
    shard, step = stage_mod.shard, stage_mod.train_step

    def full(engine) -> dict[str, torch.Tensor]:
        named = list(engine.module.named_parameters())
        with deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=None):
            return {n: p.detach().float().clone() for n, p in named}

    def recording_shard(batch, *a, **kw):
        pending.append({k: v.clone() for k, v in batch.items()})
        return shard(batch, *a, **kw)

    def recording_step(engine, micro, world, **kw):
        start = full(engine) if not records or records[-1]["engine"] != id(engine) else None
        out = step(engine, micro, world, **kw)
        records.append({"engine": id(engine), "start": start, "batches": list(pending), "loss": out["loss"],
                        "params": full(engine)})
        pending.clear()
        return out

    monkeypatch.setattr(stage_mod, "shard", recording_shard)
    monkeypatch.setattr(stage_mod, "train_step", recording_step)
    handlers = {s: signal.getsignal(s) for s in SIGNALS}  # train.py's stop flag stays installed: put them back
    from deepspeed.utils import groups

    groups._release_process_group_references(None)  # an engine an earlier test of this process left behind
    try:
        code = run_job(lambda: train.main(["--config", recipe(tmp_path, model, data)]))  # train.py's last line
    finally:
        if dist.is_initialized():  # a failure: run_job told the abort channel, the group is still up
            dist.destroy_process_group()
        groups._release_process_group_references(None)  # (base/comm.shutdown does on success; a failure's too)
        for s, h in handlers.items():
            signal.signal(s, h)
    assert code == 0, code
    return model, records


def oracle_lr(st: dict, s: int) -> float:
    """transformers' lambdas (transformers/optimization.py), this project's warmup: step s < w at their s + 1;
    decaying to the floor (cosine_with_min_lr's shape; the linear one's likewise)."""
    from transformers import optimization as hf

    w, total = st["warmup_steps"], st["max_steps"]
    lam = (partial(hf._get_linear_schedule_with_warmup_lr_lambda, num_warmup_steps=w, num_training_steps=total)
           if st["kind"] == "linear" else partial(hf._get_cosine_schedule_with_warmup_lr_lambda, num_warmup_steps=w,
                                                  num_training_steps=total, num_cycles=0.5))
    return st["peak"] * lam(s + 1) if s < w else st["floor"] + (st["peak"] - st["floor"]) * lam(s)


def document_loss_sum(model, ids, labels, pos) -> torch.Tensor:
    """Summed CE of one packed row, each document (positions restarting) its own forward: document masking."""
    cut = [0] + [i for i in range(1, len(pos)) if pos[i] != pos[i - 1] + 1] + [len(pos)]
    total = torch.zeros(())
    for a, b in zip(cut[:-1], cut[1:]):
        logits = model(input_ids=ids[None, a:b], position_ids=pos[None, a:b], use_cache=False).logits.float()
        total = total + F.cross_entropy(logits[0], labels[a:b], ignore_index=-100, reduction="sum")
    return total


def replay(model_dir: str, records: list[dict]) -> list[dict]:
    """The plain model + torch AdamW over the recorded global batches: per step, its loss and weights."""
    from transformers import AutoModelForCausalLM
    from transformers.trainer_pt_utils import get_parameter_names

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    named = dict(model.named_parameters())
    decay = set(get_parameter_names(model, [torch.nn.LayerNorm], HF_NO_DECAY))
    opt = torch.optim.AdamW([{"params": [p for n, p in named.items() if n in decay], "weight_decay": WD},
                             {"params": [p for n, p in named.items() if n not in decay], "weight_decay": 0.0}],
                            lr=1.0, betas=BETAS, eps=EPS)
    out, stage, k = [], -1, 0
    for rec in records:
        if rec["start"] is not None:  # a new engine: the next stage, its schedule from its step 0
            stage, k = stage + 1, 0
        tokens = sum(int((b["shift_labels"] != -100).sum()) for b in rec["batches"])
        opt.zero_grad(set_to_none=True)
        loss = sum(document_loss_sum(model, b["input_ids"][r], b["shift_labels"][r], b["position_ids"][r])
                   for b in rec["batches"] for r in range(b["input_ids"].shape[0])) / tokens
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(list(named.values()), CLIP).item()
        for g in opt.param_groups:
            g["lr"] = oracle_lr(STAGES[stage], k)
        opt.step()
        out.append({"loss": loss.item(), "norm": norm, "stage": stage,
                    "params": {n: p.detach().clone() for n, p in named.items()}})
        k += 1
    return out


def compare(tmp_path, monkeypatch) -> None:
    model_dir, records = run_recorded(tmp_path, monkeypatch)
    assert [r["start"] is not None for r in records] == [True, False, False, True, False, False]
    start = records[0]["start"]
    want = replay(model_dir, records)
    assert all(w["norm"] > 10 * CLIP for w in want)  # the clip binds at every step
    for i, (got, w) in enumerate(zip(records, want)):
        assert got["loss"] == pytest.approx(w["loss"], rel=1e-5), (i, got["loss"], w["loss"])
        if got["start"] is not None and i:  # the next stage starts from the weights the last one ended with
            assert max((got["start"][n] - want[i - 1]["params"][n]).abs().max().item() for n in start) < 2e-5, i
        # each tensor's distance to the oracle against the distance it moved since the start: ~1e-5 measured
        for n, p in w["params"].items():
            moved = (p - start[n]).norm().item()
            off = (got["params"][n] - p).norm().item()
            assert off <= 2e-3 * moved + 1e-6, (i, n, off, moved)


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_six_steps_over_two_stages_match_the_plain_oracle(tmp_path, monkeypatch, one_thread):
    compare(tmp_path, monkeypatch)
