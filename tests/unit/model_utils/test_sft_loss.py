"""The loss over supervised tokens only, under sequence parallelism (issue 42), in one process.

SP x DP ranks are simulated by threads, each running the real `train_step` on its shards (data/sharding.py's collate
and shard) with a stand-in engine over a per-token model (embedding -> linear: a token's logits depend on that token
alone, so a shard's loss is exactly its part of the whole sample's) and a stand-in all-reduce that sums over the
threads. DeepSpeed's own step is emulated as it works (step.py): the gradients of every rank and micro-step summed,
divided by world x GA. The oracle is the mean over the whole global batch's supervised tokens (or of each
conversation's mean), computed on the unsharded samples; the wrong answers (a mean of per-rank, per-micro-batch or
per-sample means) are checked to be far from it. Attention across shards is the multi-process parity test's
(tests/multiproc/test_parity.py, the `sft_*` cases).
"""

from __future__ import annotations

import copy
import threading
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from data.sharding import collate, conversation_weights, segment_ids, shard, shifted_labels
from model_utils import tiled_loss
from model_utils.tiled_loss import loss_sum, tiled_loss_sum
from training import step as step_mod

VOCAB, SL = 50, 24


def sample(n: int, spans: list[tuple[int, int]], docs: list[int] | None = None, seed: int = 0) -> dict:
    """n random tokens; the tokens in `spans` ([a, b) token indices) are supervised; `docs`: document lengths
    (position ids restart at each)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB, n)
    mask = np.zeros(n, np.uint8)
    for a, b in spans:
        mask[a:b] = 1
    pos = np.concatenate([np.arange(d) for d in (docs or [n])])
    return {"input_ids": ids, "loss_mask": mask, "position_ids": pos}


# ---- labels shifted on the whole sample, before sharding ----------------------------------------------------

@pytest.mark.parametrize("sp, cp", [(2, 1), (3, 1), (4, 1), (2, 2), (4, 2)])
def test_labels_shifted_before_sharding(sp, cp):
    """A supervised token at every shard (and zigzag chunk) start: its label sits on the last position of the shard
    before it (the token that predicts it), and the shards' labels are exactly the whole sample's shifted labels."""
    n = 48
    chunk = n // (sp * (2 if cp > 1 else 1))
    starts = list(range(chunk, n, chunk))
    s = sample(n, [(a, a + 1) for a in starts] + [(n - 3, n)])  # and the sample's last tokens
    batch = collate([s], sp * (2 if cp > 1 else 1), 0)
    want = np.full(n, -100)
    want[:-1] = np.where(s["loss_mask"][1:] == 1, s["input_ids"][1:], -100)
    assert batch["shift_labels"][0].tolist() == want.tolist()
    got = torch.full((n,), -7)
    for r in range(sp):  # put every rank's labels back where its tokens came from (positions travel with them)
        part = shard({**batch, "where": torch.arange(n)[None]}, sp, r, cp)
        got[part["where"][0]] = part["shift_labels"][0]
    assert got.tolist() == want.tolist()
    for a in starts:  # the boundary's predicting token holds the first token of the next shard as its label
        assert got[a - 1].item() == s["input_ids"][a]


def test_hf_labels_and_masks_shift_alike_without_crossing_documents():
    """`labels` (HF convention, aligned with input_ids) and a `loss_mask` give the packer's `shift_labels`; the last
    token of a document never predicts the next document's first token, even when that one is supervised."""
    s = sample(12, [(2, 5), (7, 9)], docs=[7, 5])
    labels = np.where(s["loss_mask"] == 1, s["input_ids"], -100)
    a = shifted_labels(s)
    b = shifted_labels({**{k: v for k, v in s.items() if k != "loss_mask"}, "labels": labels})
    ids = s["input_ids"]
    assert a.tolist() == b.tolist() == [-100, ids[2], ids[3], ids[4], -100, -100, -100, ids[8], -100, -100, -100,
                                        -100]
    assert segment_ids(s["position_ids"]).tolist() == [0] * 7 + [1] * 5


def test_conversation_weights_are_one_over_each_conversations_count():
    """LongAlign: 1/N_i on conversation i's supervised positions (by the predicting token's document), 0 elsewhere;
    a document without a supervised token adds nothing; padding weighs 0."""
    s = sample(14, [(1, 4), (6, 7), (12, 14)], docs=[5, 2, 4, 3])  # N = 3, 1, 0, 2
    lab = shifted_labels(s)
    w = conversation_weights(lab, s["position_ids"])
    assert w.tolist() == pytest.approx([1 / 3] * 3 + [0, 0] + [1, 0] + [0] * 4 + [0.5, 0.5, 0])
    batch = collate([s], 4, 0, "conversation")
    assert batch["loss_weights"].shape == (1, 16) and batch["loss_weights"][0, 14:].tolist() == [0, 0]
    assert batch["loss_weights"].sum().item() == pytest.approx(3.0)  # the conversations with a supervised token
    with pytest.raises(ValueError, match="--loss_weighting 'turn': use token or conversation"):
        collate([s], 4, 0, "turn")


# ---- the step over simulated ranks ------------------------------------------------------------------------------

class PerToken(torch.nn.Module):
    """logits[t] = f(input_ids[t]) only: sharding a sample changes no token's loss."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(VOCAB, 16)
        self.head = torch.nn.Linear(16, VOCAB)
        with torch.no_grad():
            self.head.weight.mul_(8.0)  # peaked: the per-token losses differ a lot

    def forward(self, input_ids, position_ids=None, use_cache=False):
        return types.SimpleNamespace(logits=self.head(torch.tanh(self.emb(input_ids))))


class Engine:
    """What train_step uses of a DeepSpeed engine, for one rank: forward, backward (accumulating), step."""

    def __init__(self, model):
        self.module, self.device, self.steps = model, torch.device("cpu"), 0

    def __call__(self, **kw):
        return self.module(**kw)

    def backward(self, loss):
        loss.backward()

    def step(self):
        self.steps += 1


def run_ranks(model, batches, sp: int, cp: int = 1, weighting: str = "token", loss_fn=loss_sum, engines=None):
    """batches[dp_rank][micro_step] = samples. Every (dp, sp) rank in a thread runs train_step on its shards; the
    all-reduce sums over the threads. Returns (rank 0's result, every rank's result, gradients as DeepSpeed
    makes them: the sum over ranks / (world x GA); 0 where none). `engines`: each rank's own, kept across calls."""
    dp, ga = len(batches), len(batches[0])
    world = dp * sp
    barrier, box, lock = threading.Barrier(world), [], threading.Lock()

    def all_reduce(values, op="sum", group=None):
        t = values if torch.is_tensor(values) else torch.tensor(values, dtype=torch.float64)
        with lock:
            box.append(t.detach().clone())
        barrier.wait()
        total = torch.stack(box).sum(0)
        barrier.wait()
        with lock:
            box.clear()
        barrier.wait()
        return total

    models = [e.module for e in engines] if engines else [copy.deepcopy(model) for _ in range(world)]
    results = [None] * world
    errors = []

    def rank(r):
        try:
            d, s = divmod(r, sp)
            mult = sp * (2 if cp > 1 else 1)
            micro = [shard(collate(mb, mult, 0, weighting), sp, s, cp) for mb in batches[d]]
            engine = engines[r] if engines else Engine(models[r])
            results[r] = step_mod.train_step(engine, micro, world, loss_fn=loss_fn)
        except BaseException as e:  # noqa: BLE001 - surfaced below
            errors.append(e)
            barrier.abort()

    orig = step_mod.comm.all_reduce
    step_mod.comm.all_reduce = all_reduce
    try:
        threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        step_mod.comm.all_reduce = orig
    if errors:
        raise errors[0]
    grads = {n: sum(m.get_parameter(n).grad if m.get_parameter(n).grad is not None else torch.zeros_like(p)
                    for m in models) / (world * ga) for n, p in model.named_parameters()}
    return results[0], results, grads


def per_token(model, samples) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole samples' per-position cross-entropy (0 where unsupervised) and supervised mask, [n, sl]."""
    batch = collate(samples, 1, 0)
    logits = model(batch["input_ids"]).logits
    ce = F.cross_entropy(logits.transpose(1, 2), batch["shift_labels"], ignore_index=-100, reduction="none")
    return ce, batch["shift_labels"] != -100


def oracle(model, samples, weighting: str = "token"):
    """Loss and gradients of the whole global batch at once: the mean over its supervised tokens (or of each
    conversation's mean)."""
    m = copy.deepcopy(model)
    ce, sup = per_token(m, samples)
    if weighting == "token":
        loss = ce.sum() / sup.sum()
    else:
        w = torch.stack([torch.from_numpy(conversation_weights(shifted_labels(s), s["position_ids"])) for s in samples])
        loss = (ce * w).sum() / w.sum()
    loss.backward()
    return loss.item(), {n: p.grad for n, p in m.named_parameters()}


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


LONG = sample(SL, [(19, 22)], seed=1)  # a long prompt, a 3-token answer near the end: SP 2/3/4's first ranks hold none
BOUNDARY = sample(SL, [(6, 7), (11, 13), (16, 18)], seed=2)  # answers starting at SP 4, ending at SP 2, at SP 3 bounds
PACKED = sample(SL, [(3, 5), (8, 14), (22, 23)], docs=[7, 9, 8], seed=3)  # 3 conversations, N = 2, 6, 1
EMPTY = sample(SL, [], seed=4)  # nothing supervised


@pytest.mark.parametrize("sp, cp, batches", [
    (2, 1, [[[LONG]]]), (3, 1, [[[LONG]]]), (4, 1, [[[LONG, BOUNDARY]]]),  # most ranks without a label
    (2, 2, [[[BOUNDARY, PACKED]]]),  # zigzag chunks
    (2, 1, [[[LONG], [BOUNDARY, PACKED]]]),  # GA 2, the second micro-step with two rows
    (2, 1, [[[LONG]], [[EMPTY]]]),  # DP 2: a whole SP group without a supervised token
    (3, 1, [[[EMPTY, LONG], [PACKED, EMPTY]], [[BOUNDARY, EMPTY], [EMPTY, EMPTY]]]),  # DP 2 x GA 2 x mb 2
], ids=["sp2_long", "sp3_long", "sp4_mb2", "u2cp2", "ga2_mb2", "dp2_group_empty", "sp3_dp2_ga2_mb2"])
def test_loss_is_mean_over_global_supervised_tokens(sp, cp, batches):
    model = PerToken()
    samples = [s for d in batches for mb in d for s in mb]
    ref_loss, ref_grads = oracle(model, samples)
    got, every, grads = run_ranks(model, batches, sp, cp)
    assert all(abs(r["loss"] - got["loss"]) == 0 and r["label_tokens"] == got["label_tokens"] for r in every)
    assert got["label_tokens"] == sum(int(collate([s], 1, 0)["shift_labels"].ne(-100).sum()) for s in samples)
    assert abs(got["loss"] - ref_loss) / ref_loss < 1e-6, (got["loss"], ref_loss)
    for n, g in ref_grads.items():
        assert torch.isfinite(grads[n]).all() and rel(grads[n], g) < 1e-5, n


def test_wrong_means_are_far_from_the_oracle():
    """A mean of per-rank means (SP 4), of per-micro-batch means (GA 2) or of per-sample means misses the oracle by
    far more than the tolerances above: those tests can fail."""
    model = PerToken()
    ref, _ = oracle(model, [LONG, BOUNDARY])
    ce, sup = per_token(model, [LONG, BOUNDARY])
    ce, sup = ce.detach(), sup.float()
    q = SL // 4
    ranks = [(ce[:, r * q:(r + 1) * q].sum() / sup[:, r * q:(r + 1) * q].sum()) for r in range(4)
             if sup[:, r * q:(r + 1) * q].sum() > 0]
    wrong = {"per_rank": torch.stack(ranks).mean().item(),
             "per_sample": (ce.sum(1) / sup.sum(1)).mean().item()}
    for name, w in wrong.items():
        assert abs(w - ref) / ref > 1e-2, (name, w, ref)


def test_nothing_supervised_anywhere_gives_zero_not_nan():
    """No supervised token in the whole global batch: loss 0, gradients 0, label_tokens 0 (the old step reported
    1), at SP 1 and SP 4 alike; the step is skipped on every rank."""
    for sp in (1, 4):
        got, every, grads = run_ranks(PerToken(), [[[EMPTY, EMPTY]]], sp)
        assert got["loss"] == 0.0 and got["label_tokens"] == 0, got
        assert all(r["skipped"] for r in every)
        assert all(torch.equal(g, torch.zeros_like(g)) for g in grads.values())


class AdamEngine(Engine):
    """A rank's engine whose step is AdamW's (weight decay, momentum) and an LR schedule's, as DeepSpeed's is."""

    def __init__(self, model):
        super().__init__(model)
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: 1.0 / (1 + s))

    def step(self):
        super().step()
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad()


def test_a_batch_without_supervised_token_does_not_step_the_optimizer():
    """Issue 47 item 10: after a supervised step (AdamW now has momentum), a global batch without any supervised
    token (SP 2 x DP 2, GA 2, threads as ranks; one DP group's shards supervised on no rank) leaves the weights, the
    optimizer's state and the LR schedule where they were, on every rank alike, and says `skipped`. On the old step
    the weights moved (weight decay and momentum) and the schedule advanced."""
    engines = [AdamEngine(copy.deepcopy(PerToken())) for _ in range(4)]
    first, _, _ = run_ranks(engines[0].module, [[[PACKED], [LONG]], [[BOUNDARY], [EMPTY]]], 2, engines=engines)
    assert not first.get("skipped") and all(e.steps == 2 for e in engines)
    before = [({n: p.detach().clone() for n, p in e.module.named_parameters()},
               [st["exp_avg"].clone() for st in e.opt.state.values()], e.sched.last_epoch, e.opt.param_groups[0]["lr"])
              for e in engines]
    got, every, _ = run_ranks(engines[0].module, [[[EMPTY], [EMPTY]], [[EMPTY, EMPTY], [EMPTY]]], 2, engines=engines)
    assert all(r["skipped"] and r["loss"] == 0.0 and r["label_tokens"] == 0 for r in every), every
    for e, (params, moments, epoch, lr) in zip(engines, before):
        assert all(torch.equal(p, params[n]) for n, p in e.module.named_parameters())
        assert all(torch.equal(st["exp_avg"], m) for st, m in zip(e.opt.state.values(), moments))
        assert (e.sched.last_epoch, e.opt.param_groups[0]["lr"], e.steps) == (epoch, lr, 2)
    again, _, _ = run_ranks(engines[0].module, [[[PACKED]], [[LONG]]], 2, engines=engines)  # a supervised batch steps again
    assert not again.get("skipped") and all(e.steps == 3 for e in engines)
    for e in engines:  # fp16's overflow: DeepSpeed skipped the update; the step says so (it was logged as trained)
        e.was_step_applied = lambda: False
    over, _, _ = run_ranks(engines[0].module, [[[PACKED]], [[LONG]]], 2, engines=engines)
    assert over.get("overflow") and not again.get("overflow")


@pytest.mark.parametrize("sp, cp, batches", [
    (2, 1, [[[PACKED]]]), (4, 1, [[[PACKED, LONG]]]), (2, 2, [[[PACKED], [BOUNDARY]], [[EMPTY], [PACKED]]]),
], ids=["sp2", "sp4_mb2", "u2cp2_dp2_ga2"])
def test_conversation_weighting_is_mean_of_conversation_means(sp, cp, batches):
    """LongAlign's weighting: the mean over the global batch's conversations of each one's mean loss, whatever the
    layout (N_i counted on the whole sample before sharding); the step reports the conversations as label_weight."""
    model = PerToken()
    samples = [s for d in batches for mb in d for s in mb]
    ref_loss, ref_grads = oracle(model, samples, "conversation")
    tok_loss, _ = oracle(model, samples, "token")
    assert abs(tok_loss - ref_loss) / ref_loss > 1e-2  # the two weightings differ here: the test can tell them apart
    got, _, grads = run_ranks(model, batches, sp, cp, "conversation")
    n_conv = sum(float(conversation_weights(shifted_labels(s), s["position_ids"]).sum()) for s in samples)
    assert got["label_weight"] == pytest.approx(n_conv)
    assert abs(got["loss"] - ref_loss) / ref_loss < 1e-6, (got["loss"], ref_loss)
    for n, g in ref_grads.items():
        assert rel(grads[n], g) < 1e-5, n


# ---- the tiled loss equals the plain one with masks and weights -------------------------------------------------

@pytest.mark.parametrize("weighting", ["token", "conversation"])
def test_tiled_loss_equals_plain_with_masks(monkeypatch, weighting):
    """tiled_logits' loss (5 tiles, some without a supervised token) and the plain loss agree, value and gradients,
    on masked labels (and per-conversation weights)."""
    from transformers import AutoModelForCausalLM

    from model_utils.build import preset_config

    torch.manual_seed(0)
    cfg = preset_config("tiny-llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                        num_key_value_heads=1, initializer_range=0.3)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    mb = collate([PACKED, LONG], 1, 0, weighting)
    monkeypatch.setattr(tiled_loss, "LOGITS_TILE_BYTES", 2 * 5 * VOCAB * 4)  # 5 tokens x 2 rows per tile
    plain = copy.deepcopy(model)
    with torch.no_grad():  # what both must compute: sum of w_t CE_t (w = 1 on supervised tokens without weights)
        logits = model(input_ids=mb["input_ids"], position_ids=mb["position_ids"], use_cache=False).logits
        ce = F.cross_entropy(logits.transpose(1, 2), mb["shift_labels"],
                             ignore_index=-100, reduction="none")
        want = (ce * mb.get("loss_weights", torch.ones_like(ce))).sum().item()
    a = loss_sum(plain, mb)
    a.backward()
    tiled_loss.install_loss_forward(model)
    b = tiled_loss_sum(model, mb)
    b.backward()
    assert abs(a.item() - want) / want < 1e-6 and abs(b.item() - want) / want < 1e-6, (a.item(), b.item(), want)
    for (n, p), q in zip(plain.named_parameters(), model.parameters()):
        assert rel(q.grad, p.grad) < 1e-5, n


# ---- the metrics report the supervised tokens of every step -----------------------------------------------------

def log_steps(outs: list[dict], sp: int = 2, seq_len: int = SL, shares: dict | None = None):
    """training/stage_records._log_step as the stage loop calls it (GA 2, micro-batch 1, dp 1) for each step's
    `outs`, from step 3: (the logged records, the step times the deadline recorded, the state)."""
    from training import stage_records

    logged, timed = [], []
    run = types.SimpleNamespace(
        cfg=types.SimpleNamespace(gradient_accumulation_steps=2, per_device_train_batch_size=1),
        preempt=types.SimpleNamespace(deadline=types.SimpleNamespace(record_step=timed.append)),
        metrics=types.SimpleNamespace(log=logged.append))
    st = types.SimpleNamespace(step=3, tokens=0)
    for i, out in enumerate(outs):
        st.step = 3 + i
        stage_records._log_step(run, types.SimpleNamespace(index=0, max_seq_length=seq_len),
                                types.SimpleNamespace(dp=1, sp=sp, cp=1), st, out, 1e-3,
                                types.SimpleNamespace(source_shares=lambda: shares or {}))
    return logged, timed, st


def test_metrics_report_supervised_tokens_per_step():
    logged, _, _ = log_steps([{"loss": 1.5, "label_tokens": 23, "step_time": 0.5},
                              {"loss": 1.5, "label_tokens": 23, "label_weight": 4.0, "step_time": 0.5}])
    assert logged[0]["label_tokens"] == 23 and "label_weight" not in logged[0]
    assert logged[1]["label_weight"] == 4.0


def test_a_skipped_step_logs_no_loss_and_no_tokens():
    """A step without a supervised token in the global batch trains nothing: it logged loss 0.0, its tokens and
    tokens / ~1 ms (5e8 tokens/s at 128k), which the charts drew and averaged in. Now null, 0 and total_tokens
    unchanged; it still says so (optimizer_skipped) and its supervised-token count (0)."""
    (trained, skipped), timed, st = log_steps([{"loss": 1.5, "label_tokens": 23, "step_time": 0.5},
                                               {"loss": 0.0, "label_tokens": 0, "skipped": True, "step_time": 0.001}])
    assert trained["loss"] == 1.5 and trained["tokens"] == 2 * SL and trained["tokens_per_s"] == 4 * SL
    assert skipped["optimizer_skipped"] is True and skipped["label_tokens"] == 0 and skipped["step"] == 4
    assert skipped["loss"] is None and skipped["tokens"] == 0 and skipped["tokens_per_s"] is None, skipped
    assert skipped["total_tokens"] == trained["total_tokens"] == st.tokens == 2 * SL and timed == [0.5]


@pytest.mark.parametrize("argv, match", [
    (["--loss_weighting", "turn"], r"--loss_weighting 'turn': use token or conversation"),
    (["--loss_weighting", "conversation", "--reset_position_ids", "no"], r"where position ids restart"),
])
def test_bad_loss_weighting_is_one_line(argv, match):
    from training.config import parse_config

    with pytest.raises(ValueError, match=match) as e:
        parse_config(argv)
    assert "\n" not in str(e.value)
    assert parse_config(["--loss_weighting", "conversation"]).loss_weighting == "conversation"


@pytest.mark.parametrize("model_type, scaled", [
    ("cohere", {"logit_scale": 0.25}), ("granite", {"logits_scaling": 4.0}), ("minicpm3", {"dim_model_base": 8}),
    ("hyperclovax", {"logits_scaling": 4.0}), ("llama", {}),
])
def test_the_tiled_loss_scales_logits_as_the_models_forward_does(model_type, scaled):
    """Cohere multiplies its logits by logit_scale (0.0625 for Command-R), Granite and MiniCPM3 divide by
    logits_scaling (16 for Granite 8B; MiniCPM3's is hidden_size / dim_model_base), HyperCLOVA X multiplies by it:
    the tiled loss (every evaluation; training with --tiled_logits) scored the LM head's logits unscaled, held-out
    losses ~9x HF's. Its loss and evaluation statistics equal the model's own loss now."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=2, vocab_size=64, pad_token_id=0,
                               bos_token_id=1, eos_token_id=2, **scaled)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)  # peaked logits: a missing scale is far from the oracle
        ids = torch.randint(3, 64, (1, 24))
        want = model(input_ids=ids, labels=ids).loss.item()
        tiled_loss.install_loss_forward(model)
        labels, pos = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], 1), torch.arange(24)[None]
        summed = model(input_ids=ids, position_ids=pos, use_cache=False, tiled_loss_labels=labels).item()
        stats = model(input_ids=ids, position_ids=pos, use_cache=False, tiled_loss_labels=labels, eval_stats=True)
    assert summed / 23 == pytest.approx(want, rel=1e-4) and stats[0, 0].item() / 23 == pytest.approx(want, rel=1e-4)
