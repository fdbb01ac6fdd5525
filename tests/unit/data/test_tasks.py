"""Synthetic long-context tasks (data/tasks.py) and their evaluation (training/evaluation.py).

The metric itself is checked: a stub model that reads the answer out of the context (a regex oracle that
never sees the labels) scores 1.0 on every task, a random model 0, and a model that answers with a random
one of the values present in the text (ignoring which key or chain is asked for) about the chance level of
the task (1/4 needles, 1/2 chains). The mixture reaches its configured fractions, resumes exactly and gives
DP ranks disjoint samples; position-bucketed loss adds up to the plain loss under SP sharding."""

from __future__ import annotations

import json
import random
import re
import types

import numpy as np
import pytest
import torch

from base.parallel import ParallelDims
from data.sampler import ResumableSampler
from data.tasks import (
    TASKS,
    TaskMixDataset,
    TaskMixSampler,
    TooShort,
    _answer,
    check_tasks,
    make_sample,
    parse_tasks,
    trial_need,
)
from model_utils.tiled_loss import _stats
from training.evaluation import (
    DEFAULT_DEPTHS,
    check_passkey_fits,
    sample_stats,
    task_accuracy,
    task_seed,
    trial,
)


@pytest.fixture(scope="module")
def tok():
    from data.corpus import build_demo_corpus
    from data.tokenizer import Tokenizer

    return Tokenizer(build_demo_corpus()[1])


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("seq_len", [512, 1500])
def test_samples_have_the_length_and_labels_only_on_the_answer(tok, task, seq_len):
    a = make_sample(task, tok, seq_len, 0.3, random.Random(5))
    b = make_sample(task, tok, seq_len, 0.3, random.Random(5))
    assert all(np.array_equal(a[k], b[k]) for k in ("input_ids", "shift_labels", "position_ids"))  # deterministic
    ids, lab = a["input_ids"], a["shift_labels"]
    assert len(ids) == len(lab) == seq_len and np.array_equal(a["position_ids"], np.arange(seq_len))
    scored = np.flatnonzero(lab != -100)
    answer = lab[scored].tolist()
    assert scored.tolist() == list(range(seq_len - len(answer) - 1, seq_len - 1))  # the answer's tokens, nothing else
    assert answer == ids[-len(answer):].tolist() and tok.decode(answer).strip() == a["answer"]
    assert oracle(tok.decode(ids[: seq_len - len(answer)].tolist())) == a["answer"]
    # copyable token by token: the answer's tokens are the ones the needle holds (an answer encoded on its own
    # got a second lone "▁" from sentencepiece's dummy prefix, and nothing in the context to copy it from)
    context, got = ids[: seq_len - len(answer)].tolist(), lab[scored].tolist()
    if task in ("variable_tracking", "niah_multivalue", "common_words"):  # lists: each token is in the context
        assert all(t in context for t in got)
    else:
        assert any(context[i: i + len(got)] == got for i in range(len(context))), (got, a["answer"])


def test_depth_places_the_needle(tok):
    where = []
    for depth in (0.0, 0.5, 1.0):
        text = tok.decode(make_sample("passkey", tok, 2000, depth, random.Random(1))["input_ids"].tolist())
        where.append(text.index("The pass key is") / len(text))
    assert where[0] < 0.02 and 0.4 < where[1] < 0.6 and where[2] > 0.9, where


def oracle(prompt: str, guess: random.Random | None = None) -> str:
    """The answer read off the prompt's text (never the labels). With `guess`, a random one of the answers
    present in the text, ignoring which key / value the question asks for (a chance-level reader)."""
    if "pass key" in prompt:
        return re.search(r"The pass key is (\d+)\.", prompt).group(1)
    if "What are all the special magic numbers" in prompt:  # niah_multivalue: every value of the key, text order
        key = re.search(r"What are all the special magic numbers for (\w+) ", prompt).group(1)
        return " ".join(re.findall(rf"special magic numbers for {key} is: (\d+)\.", prompt.rsplit("What are", 1)[0]))
    if "most common words" in prompt:  # common_words: the most frequent words, in order of first appearance
        words = re.findall(r"(?:[bdfgklmnprstvz][aeiou]){3}", prompt.split("appear most often.", 1)[1].split("Question:", 1)[0])
        top = max(words.count(w) for w in words)
        return " ".join(dict.fromkeys(w for w in words if words.count(w) == top))
    if "special magic number" in prompt:
        pairs = dict(re.findall(r"special magic numbers for (\w+) is: (\d+)\.", prompt.rsplit("What is", 1)[0]))
        key = re.search(r"magic number for (\w+) mentioned", prompt).group(1)
        return guess.choice(sorted(pairs.values())) if guess else pairs[key]
    assign = re.findall(r"VAR (\w+) = (VAR \w+|\d+)\.", prompt)
    value = re.search(r"assigned the value (\d+) in the text", prompt).group(1)
    if guess:
        value = guess.choice(sorted(v for _, v in assign if v.isdigit()))
    chain, frontier = [], {value}
    for name, rhs in assign:  # statements appear in chain order
        if rhs.removeprefix("VAR ") in frontier:
            chain.append(name)
            frontier.add(name)
    return " ".join(chain)


class StubEngine:
    """Stands in for the DeepSpeed engine in evaluation: eval_stats calls it with the tiled-loss keywords; it
    builds logits ([bs, sl, vocab]) from `predict` and scores them with the real `_stats` (identity head)."""

    device = torch.device("cpu")

    def __init__(self, tok, mode: str, seed: int = 0):
        self.tok, self.mode, self.rng, self.vocab = tok, mode, random.Random(seed), 2048

    def eval(self):
        pass

    def train(self):
        pass

    def __call__(self, input_ids, position_ids, use_cache, tiled_loss_labels, eval_stats, eval_buckets=None):
        logits = torch.randn(*input_ids.shape, self.vocab,
                             generator=torch.Generator().manual_seed(self.rng.randrange(2**31)))
        if self.mode != "random":
            for row in range(input_ids.shape[0]):
                scored = torch.nonzero(tiled_loss_labels[row] != -100).flatten().tolist()
                if not scored:
                    continue
                prompt = self.tok.decode(input_ids[row, : scored[0] + 1].tolist())
                answer = oracle(prompt, self.rng if self.mode == "guess" else None)
                tail = self.tok.decode(input_ids[row, max(0, scored[0] - 40): scored[0] + 1].tolist())
                for p, t in zip(scored, _answer(self.tok, tail, answer)[1]):  # tokenized as it follows the question
                    logits[row, p, t] = 100.0  # teacher forcing: position p predicts answer token k
        return _stats(lambda h: h, logits, tiled_loss_labels, 2, eval_buckets)


DIMS1 = ParallelDims(world=1, sp=1, rank=0, local_rank=0)  # sample_stats reads seq_multiple and cp too


def test_oracle_scores_one_random_model_zero_guesser_chance(tok):
    trials = {t: 3 for t in TASKS}  # exact scores: 3 trials per depth show them (12 cost ~80 s more)
    depths = [0.0, 0.5, 1.0]
    exact = task_accuracy(StubEngine(tok, "oracle"), DIMS1, 2, tok.pad_id, tok, trials, depths, 1024)
    assert exact == {t: {"0": 1.0, "0.5": 1.0, "1": 1.0} for t in TASKS}
    noise = task_accuracy(StubEngine(tok, "random"), DIMS1, 2, tok.pad_id, tok, trials, depths, 1024)
    assert noise == {t: {"0": 0.0, "0.5": 0.0, "1": 0.0} for t in TASKS}  # chance of a 5+ token exact match ~ 0
    guess = task_accuracy(StubEngine(tok, "guess", seed=3), DIMS1, 3, tok.pad_id, tok,
                          {"niah_multikey": 40, "variable_tracking": 40}, depths, 768)
    mean = {t: sum(a.values()) / len(a) for t, a in guess.items()}
    assert abs(mean["niah_multikey"] - 0.25) < 0.12 and abs(mean["variable_tracking"] - 0.5) < 0.15, mean


def test_position_buckets_add_up_under_sp_sharding(tok):
    """Per-bucket CE sums and counts over SP shards (each rank its slice) equal the whole sample's, and their
    total is the plain [CE, tokens] pair: the bucketed output only adds columns."""
    rng = np.random.default_rng(0)
    sl = 301  # padded to 302 at SP=2
    samples = [{"input_ids": rng.integers(0, 2000, sl), "position_ids": np.arange(sl),
                "shift_labels": np.where(rng.random(sl) < 0.8, rng.integers(0, 2000, sl), -100)} for _ in range(3)]
    eng = StubEngine(tok, "random")
    plain = sample_stats(eng, samples, DIMS1, 2, 0)
    eng.rng = random.Random(0)
    whole = sample_stats(eng, samples, DIMS1, 2, 0, buckets=8)
    parts = []
    for r in range(2):
        eng.rng = random.Random(0)
        parts.append(sample_stats(eng, samples, ParallelDims(world=2, sp=2, rank=r, local_rank=r), 2, 0, 8))
    assert whole.shape == (3, 19) and plain.shape == (3, 3)
    assert torch.allclose(whole[:, 3:11].sum(1), whole[:, 0]) and torch.equal(whole[:, 11:].sum(1), whole[:, 1])
    expect = [[int(((s["shift_labels"] != -100) & (np.arange(sl) * 8 // sl == b)).sum()) for b in range(8)] for s in samples]
    assert whole[:, 11:].tolist() == expect
    sharded = parts[0] + parts[1]
    assert torch.equal(sharded[:, 11:], whole[:, 11:]) and torch.equal(sharded[:, 1], whole[:, 1])


def test_mixture_reaches_fractions_resumes_and_splits_dp(tok):
    fractions = parse_tasks({"passkey": 0.2, "niah_multikey": 0.1, "variable_tracking": 0.1})
    base = list(range(40))  # stand-in for the stage's packed samples

    def make(dp_rank):
        ds = TaskMixDataset(base, list(fractions), tok, 512, seed=7)
        return ds, TaskMixSampler(ResumableSampler(40, 2, dp_rank, 2, seed=7), ds, fractions, 2, dp_rank, 2)

    (ds, s0), (_, s1) = make(0), make(1)
    seen = {t: 0 for t in ("base", *fractions)}
    synthetic = set()
    for n in range(1, 201):
        b0, b1 = s0.next_batch(), s1.next_batch()
        assert not set(b0) & set(b1)  # DP ranks never read the same sample
        for i in b0 + b1:
            if i >= len(ds):
                sample = ds[i]
                seen[sample["task"]] += 1
                synthetic.add(tok.decode(sample["input_ids"][-12:].tolist()))
            else:
                seen["base"] += 1
        shares = s0.source_shares()
        for t, f in fractions.items():
            assert abs(shares[f"task:{t}"] - f) <= 1.0 / n + 1e-12  # within one micro-step at every point
    assert seen == {"base": 480, "passkey": 160, "niah_multikey": 80, "variable_tracking": 80}  # 800 samples
    assert len(synthetic) > 300  # a fresh question every time, not a few repeated ones
    state = json.loads(json.dumps(s0.state_dict()))
    ref = [s0.next_batch() for _ in range(30)]
    _, again = make(0)
    again.load_state_dict(state)
    assert [again.next_batch() for _ in range(30)] == ref
    assert all(np.array_equal(ds[i]["input_ids"], make(0)[0][i]["input_ids"]) for r in ref for i in r if i >= 40)


def test_stage_view_wraps_the_stage_stream_and_bad_tasks_are_refused(tok):
    from data.pipeline import open_run_data
    from training.config import config_from_dict
    from training.curriculum import resolve_stages

    cfg = config_from_dict({"max_seq_length": 512, "max_steps": 4, "stages": [
        {"name": "a", "max_seq_length": 512, "tasks": {"passkey": 0.5}}]})
    stages = resolve_stages(cfg, dp_of_sp=lambda sp: 1)
    data = open_run_data(None, None, 2048, stages, False)
    ds, sampler = data.stage_view(stages[0], 1, 0, 1, seed=0)
    tasks = [ds[sampler.next_batch()[0]].get("task", "text") for _ in range(10)]
    assert tasks.count("passkey") == 5 and sampler.source_shares() == {"stream": 0.5, "task:passkey": 0.5}
    for bad, msg in (({"passkey": 0.7, "niah_multikey": 0.4}, "sum to at most 1"), ({"needle": 0.1}, "unknown task"),
                     ({"variable_tracking": 0.1}, "too short for a variable_tracking trial")):
        short = {"max_seq_length": 256, "max_steps": 1, "stages": [{"name": "b", "max_seq_length": 256, "tasks": bad}]}
        with pytest.raises(ValueError, match=msg):
            open_run_data(None, None, 2048, resolve_stages(config_from_dict(short), dp_of_sp=lambda sp: 1), False)


def test_eval_tables_and_plot(tmp_path):
    from scripts.plot_metrics import plot_eval
    from training.eval_tables import eval_tables

    evals = []
    for s, n in enumerate([1024, 2048]):
        acc = {str(m): {"0.1": float(m <= n), "0.9": 0.5} for m in (1024, 2048)}
        evals.append({"event": "eval", "stage": s, "stage_name": f"s{s}", "step": 10 * (s + 1), "seq_len": n,
                      "heldout_loss": 3.0 - s, "heldout_loss_first_len": 3.1, "first_len": 1024,
                      "heldout_loss_by_position": [3.5, 3.0, 2.8, 2.7], "tasks": {"passkey": acc},
                      "task_mean": {"passkey": {m: sum(a.values()) / 2 for m, a in acc.items()}},
                      "passkey_accuracy": acc[str(n)], "passkey_mean": 0.75,
                      **({"position_by": "document"} if s else {})})  # stage 0: an evaluation from before today
    md = "\n".join(eval_tables(evals))
    assert "| 0 | 1024 | 0.75 | 0.25 |" in md and "| 1 | 2048 | 0.75 | 0.75 |" in md, md
    assert "heldout_loss@1024" in md and "| 1 | 2048 | 3.500 | 3.000 | 2.800 | 2.700 |" in md
    assert "| 0* | 1024 | 3.500 |" in md  # bucketed by offset in the sample then: marked
    plot_eval(evals, str(tmp_path / "e.png"))
    assert (tmp_path / "e.png").stat().st_size > 10_000



def test_eval_lengths_and_task_trials():
    from training.evaluation import eval_lengths, task_trials

    stages = [types.SimpleNamespace(index=i, name=f"s{i}", max_seq_length=n, eval=e) for i, (n, e) in enumerate(
        [(1024, {"lengths": "all"}), (2048, {}), (4096, {"lengths": [1024, 4096, 9999]})])]
    assert [eval_lengths(s, stages) for s in stages] == [[1024, 2048, 4096], [1024, 2048], [1024, 4096, 9999]]
    assert eval_lengths(stages[1], None) == [2048]
    assert task_trials({}, object()) == {"passkey": 2} and task_trials({}, None) == {}
    assert task_trials({"tasks": ["passkey", "variable_tracking"], "passkey_trials": 3}, object()) == {
        "passkey": 3, "variable_tracking": 3}
    assert task_trials({"tasks": {"niah_multikey": 4, "passkey": 0}}, object()) == {"niah_multikey": 4}
    with pytest.raises(ValueError, match="unknown task"):
        task_trials({"tasks": ["ruler"]}, object())

# --- the demo (slow: the whole recipes/tiny_cpu.yaml through the deepspeed launcher, SP=2 on CPU) ---


def run_recipe(out, recipe: str, port: int, stages: int, timeout: float = 3600):
    """recipes/<recipe> through the deepspeed launcher (2 ranks), then plot_metrics; each stage's eval JSON."""
    import os
    import subprocess

    from tests.distributed import ROOT

    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", WANDB_MODE="offline")
    cmd = [os.path.join(ROOT, ".venv/bin/deepspeed"), "--num_gpus", "2", "--master_port", str(port), "train.py",
           "--config", f"recipes/{recipe}", "--output_dir", str(out), "--report_to", "none", "--no-export_hf"]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    plot = subprocess.run([os.path.join(ROOT, ".venv/bin/python"), "scripts/plot_metrics.py", str(out / "metrics.jsonl"),
                           "-o", str(out / "metrics.png")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert plot.returncode == 0, plot.stderr
    return out, [json.loads((out / "eval" / f"stage{i}.json").read_text()) for i in range(stages)]


def assert_extends_passkey(ev: list[dict], final_len: int, short_len: int) -> None:
    """The issue's three criteria on a 4-stage run's evaluations (passkey mean over depths per length)."""
    final, first = ev[3]["task_mean"]["passkey"], ev[0]["task_mean"]["passkey"]
    assert final[str(final_len)] >= 0.9  # after the curriculum, at the final length
    assert first[str(final_len)] <= final[str(final_len)] - 0.3  # stage 1 alone at the final length: clearly lower
    assert final[str(short_len)] >= first[str(short_len)] - 0.1  # short-context retention


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    return run_recipe(tmp_path_factory.mktemp("demo_tasks") / "run", "tiny_cpu.yaml", 29733, 4)


@pytest.mark.slow
@pytest.mark.dist
def test_demo_evaluates_every_stage_at_its_lengths(demo_run):
    out, ev = demo_run
    assert [r["seq_len"] for r in ev] == [1024, 2048, 4096, 8192]
    assert sorted(ev[0]["task_mean"]["passkey"], key=int) == ["1024", "8192"] == sorted(ev[3]["task_mean"]["passkey"], key=int)
    assert sorted(ev[2]["task_mean"]["passkey"], key=int) == ["1024", "2048", "4096"]  # earlier lengths: retention
    assert set(ev[3]["tasks"]) == {"passkey", "niah_multikey", "variable_tracking"} and all(set(a) == {"0.1", "0.5", "0.9"} for a in ev[3]["tasks"]["passkey"].values())
    for r in ev:
        assert len(r["heldout_loss_by_position"]) == 8 and r["first_len"] == 1024
        assert abs(r["heldout_loss_first_len"] - ev[0]["heldout_loss"]) < 2.0  # retention measured at 1024 every stage
    # context lowers the loss: the last bucket some held-out document reaches (positions are a token's place in its
    # document since 2026-11-29: the demo's held-out documents end before the 8192-token stage's last quarter)
    pos = [x for x in ev[3]["heldout_loss_by_position"] if x is not None and x == x]  # null (NaN before): no token
    assert len(pos) >= 4 and pos[-1] < pos[0]
    assert "**passkey** accuracy" in (out / "eval" / "summary.md").read_text()
    assert (out / "metrics_eval.png").stat().st_size > 20_000


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.xfail(strict=True, reason="not reached yet: measured passkey 0.00 at every stage, length and depth on "
                   "the tiny 2-layer model; probes need ~19k passkey samples at 256 tokens for 1.00 and do not carry "
                   "over to 4x that length (docs/results/curriculum.md); the effect in 5 minutes is "
                   "test_extension_demo_extends_passkey_retrieval (a base that retrieves, extended); strict: fails "
                   "once it passes")
def test_demo_curriculum_extends_passkey_retrieval(demo_run):
    _, ev = demo_run
    assert_extends_passkey(ev, final_len=8192, short_len=1024)


@pytest.mark.slow
@pytest.mark.dist
def test_long_recipe_extends_passkey_retrieval(tmp_path):
    """The issue's criteria on recipes/tiny_cpu_long.yaml (~20 min on 2 cores; measured once: 0.96 at 2048 after
    the curriculum, 0.00 after stage 1, 0.94 vs 1.00 at 256; docs/results/curriculum.md). 50 trials per cell:
    about +-0.04."""
    _, ev = run_recipe(tmp_path / "run", "tiny_cpu_long.yaml", 29734, 4, timeout=2 * 3600)
    assert_extends_passkey(ev, final_len=2048, short_len=256)


@pytest.mark.slow
@pytest.mark.dist
def test_extension_demo_extends_passkey_retrieval(tmp_path):
    """Issue 27's criteria in about 6 minutes (`make demo`): recipes/tiny_cpu_extend.yaml extends the short-context
    base recipes/base/tiny_passkey256 (stage 1 of the long recipe, exported) 256 -> 2048 with YaRN and short-context
    replay: >= 0.9 at 2048, <= 0.1 there after stage 1, 256 at most 0.05 below its stage-1 value; measured on 5 seeds
    x both RMSNorms by bench/extend_seeds.py (docs/results/curriculum.md)."""
    from bench.extend_seeds import criteria

    _, ev = run_recipe(tmp_path / "run", "tiny_cpu_extend.yaml", 29735, 4, timeout=1800)
    got = criteria(ev, final_len=2048, short_len=256)
    assert got["ok"], got


def test_a_trial_starts_with_the_tokenizers_bos_as_documents_do(tmp_path):
    """With a tokenizer that puts a BOS before a text, a synthetic trial starts with it (as every prepared text
    document does, data/prepare_data.py) and still fits its length; rendered as chat, the BOS is the template's, not
    a token's text inside the user turn."""
    from data.chat import ChatEncoder
    from data.tasks import chat_sample
    from data.tokenizer import Tokenizer
    from tests.unit.data.test_prepare_data import _bos_tokenizer

    tok = Tokenizer(_bos_tokenizer(tmp_path / "tok"))
    s = make_sample("passkey", tok, 256, 0.5, random.Random(0))
    assert s["input_ids"][0] == tok.bos_id and len(s["input_ids"]) == 256
    assert "<s>" not in tok.decode(s["input_ids"][1:])
    c = chat_sample("passkey", tok, ChatEncoder(tok), 512, 0.5, random.Random(0))
    assert tok.decode(c["input_ids"]).count("<s>") == 0  # the ChatML default writes no BOS; no BOS text in the turn


@pytest.mark.parametrize("task", TASKS)
def test_a_byte_level_bpe_gets_its_segments_spaced(tmp_path, task):
    """Segments rely on sentencepiece's dummy prefix for the space between them: a byte-level BPE without one
    (Llama 3, Qwen) ran them together (`again.The grass`), and common_words' list was one string of letters
    (`danodipunosegupelu...`) no model can count. The words of the answer are whole words in the context now, and the
    answer's tokens are the context's tokens of them."""
    from data.tokenizer import Tokenizer
    from tests.unit.data.chat_fixtures import build_tokenizer

    bpe = Tokenizer(build_tokenizer(str(tmp_path), "qwen25"))
    s = make_sample(task, bpe, 1024, 0.5, random.Random(1))
    first = int(np.flatnonzero(s["shift_labels"] != -100)[0]) + 1
    context = bpe.decode(s["input_ids"][:first].tolist())
    assert all(re.search(rf"(^|\s){re.escape(w)}\b", context) for w in s["answer"].split()), (context[:300], s["answer"])


@pytest.mark.parametrize("task", TASKS)
def test_a_trials_need_is_the_shortest_length_that_holds_it(tok, task):
    """trial_need counts a trial without building it (the length checks below rely on it): the trial of the same
    draws fits that length and not one token less, whatever the seed and depth."""
    for k in range(12):
        d = random.Random(k).random()
        need = trial_need(task, tok, d, random.Random(f"need:{k}"))
        assert len(make_sample(task, tok, need, d, random.Random(f"need:{k}"))["input_ids"]) == need
        with pytest.raises(TooShort):
            make_sample(task, tok, need - 1, d, random.Random(f"need:{k}"))


def test_every_evaluation_trial_is_checked_at_start_up_not_one(tok):
    """The audit's recipe: variable_tracking x 10 trials at 307 tokens. The check built one trial (Random(0), depth
    0.5: 307 tokens, it fit) while the stage's own trials, seeded `eval:{task}:{length}:{depth}:{trial}`, need up to
    315: the run trained, saved its checkpoint, then stopped at its evaluation. Now refused before training, naming
    the trial; a length that holds every trial is accepted, and every trial of it builds."""
    stage = types.SimpleNamespace(index=0, name="a", max_seq_length=307, eval={"tasks": {"variable_tracking": 10}})
    with pytest.raises(ValueError, match=r"^stage 'a': max_seq_length=307 is too short for a variable_tracking trial "
                                         r"\(needs 315 tokens: trial 2 at depth 0\.5\): raise max_seq_length"):
        check_passkey_fits([stage], tok)
    stage.max_seq_length = 314  # its own seeds (the length is in them): every one fits
    check_passkey_fits([stage], tok)
    for d in DEFAULT_DEPTHS:
        for i in range(10):
            trial("variable_tracking", tok, 314, d, task_seed("variable_tracking", 314, d, i))


def test_a_training_stage_needs_room_for_its_largest_draw(tok):
    """A stage's synthetic samples are drawn from their own seeds (TaskMixDataset): at 310 tokens the check's one
    trial (307) fit while 15 of the first 300 variable_tracking draws did not (each raised mid-stage). Refused now
    below the most of TRAIN_PROBES draws plus TRAIN_SLACK tokens, and above it no draw of the stage fails."""
    ds = TaskMixDataset([], ["variable_tracking"], tok, 310, seed=0)
    failed = 0
    for k in range(300):
        try:
            ds[ds.index(0, k)]
        except TooShort:
            failed += 1
    assert failed == 15
    stage = types.SimpleNamespace(index=2, name="vt", max_seq_length=310, tasks={"variable_tracking": 0.1})
    with pytest.raises(ValueError, match=r"^stage 2 \(vt\): max_seq_length=310 is too short for a variable_tracking "
                                         r"trial \(needs 351 tokens: the most of 256 draws plus 32 of slack\): raise "
                                         r"max_seq_length or drop variable_tracking$"):
        check_tasks(stage, tok)
    stage.max_seq_length = 351
    assert check_tasks(stage, tok) == {"variable_tracking": 0.1}
    ds = TaskMixDataset([], ["variable_tracking"], tok, 351, seed=0)
    assert all(len(ds[ds.index(0, k)]["input_ids"]) == 351 for k in range(300))
