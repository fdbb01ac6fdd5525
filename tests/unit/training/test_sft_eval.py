"""Evaluating a fine-tuned (chat) model (issue 42): the retrieval tasks asked through a chat template and scored on
the assistant's reply (training/evaluation.py `trial`, scripts/evaluate.py `--chat`), an SFT stage's held-out
samples as whole conversations (`stage_heldout`, retention measured as the first stage measured it), and the
evaluation summary the demos end with (scripts/eval_summary.py). No launch: stand-in engines score the real
samples with the real `_stats`."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import types

import numpy as np
import pytest
import torch
import yaml

from base.parallel import ParallelDims
from data.chat import ChatEncoder, build_demo_chats
from data.tasks import TASKS, TaskMixDataset, make_sample
from data.tokenizer import Tokenizer
from model_utils.tiled_loss import _stats
from tests.unit.data.chat_fixtures import build_tokenizer
from training.evaluation import (
    check_trials_fit,
    evaluate_stage,
    stage_heldout,
    task_accuracy,
    task_seed,
    trial,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SP = os.path.join(ROOT, "recipes/base/tiny_passkey256/tokenizer.model")  # the demo's: no chat template
DIMS1 = ParallelDims(world=1, sp=1, rank=0, local_rank=0)
USER = {"qwen25": ("<|im_start|>user\n", "<|im_end|>"),
        "llama3": ("<|start_header_id|>user<|end_header_id|>\n\n", "<|eot_id|>")}


@pytest.mark.parametrize("family", ["qwen25", "llama3"])
def test_a_trial_is_a_user_turn_through_the_template(tmp_path, family):
    """The prompt is exactly the template's rendering of one user turn with its generation prompt; what is scored
    is the assistant's reply: the answer, then the end-of-turn token; the question is the plain trial's."""
    tok = Tokenizer(build_tokenizer(str(tmp_path), family))
    chat = ChatEncoder(tok, "assistant", "none")
    head, eot = USER[family]
    for task in TASKS:
        s = trial(task, tok, 1024, 0.5, random.Random(7), chat)
        scored = np.flatnonzero(s["shift_labels"] != -100)
        prompt = s["input_ids"][: scored[0] + 1].tolist()
        user = tok.hf.decode(prompt).split(head, 1)[1].rsplit(eot, 1)[0]
        rendered = tok.hf.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                              add_generation_prompt=True)
        assert prompt == tok.encode(rendered), task
        assert tok.hf.decode(s["shift_labels"][scored].tolist()) == s["answer"] + eot
        assert all(w in user for w in s["answer"].split()), task  # the context the answer is read from
        assert user.endswith({"passkey": "What is the pass key? The pass key is"}.get(task, ":"))  # then the question
    assert all(np.array_equal(trial("passkey", tok, 512, 0.5, random.Random(1))[k],
                              make_sample("passkey", tok, 512, 0.5, random.Random(1))[k])
               for k in ("input_ids", "shift_labels"))  # without a template: the plain trial, as before


def test_a_chat_trial_asks_the_plain_trials_question(tmp_path):
    """evalG: the chat trial built its plain trial from a draw of the cell's rng, another question than the plain
    trial's at the same cell (passkey 0.1 at 512: 38355 through the template, 87619 plainly): scripts/evaluate.py
    compared an SFT checkpoint (chat) with its base (plain) over unpaired questions. Now the same answer at every cell
    (common_words: the same words, its list filled to the shorter length, their order may differ), and the start-up
    check counts the trial asked. Training's chat samples are drawn as before (seeded by a draw of their rng), so a
    resumed run draws the samples it drew."""
    tok = Tokenizer(build_tokenizer(str(tmp_path), "qwen25"))
    chat = ChatEncoder(tok, "assistant", "none")
    for task in TASKS:
        cells = [(n, d, i) for n in (768, 1024) for d in (0.1, 0.5, 0.9) for i in range(2)]
        for n, d, i in cells:
            asked = trial(task, tok, n, d, task_seed(task, n, d, i), chat)["answer"]
            plain = trial(task, tok, n, d, task_seed(task, n, d, i))["answer"]
            if task == "common_words":
                asked, plain = sorted(asked.split()), sorted(plain.split())
            assert asked == plain, (task, n, d, i)
        check_trials_fit({task: 2}, [0.1, 0.5, 0.9], [768, 1024], tok, chat)
    data = TaskMixDataset([], ["passkey", "niah_multikey"], tok, 1024, 5, chat)  # a training stage's chat samples
    for k in range(4):
        rng = random.Random(f"5:{data.names[k % 2]}:{k // 2}")
        d = rng.random()
        assert data[k]["answer"] == make_sample(data.names[k % 2], tok, 2048, d, random.Random(rng.random()))["answer"]


class ReplyEngine:
    """A stand-in model that answers every trial right (teacher forcing: it predicts each scored token), and with
    `stops=False` never ends its turn (the end-of-turn token predicted wrong): scored with the real `_stats`."""

    device = torch.device("cpu")

    def __init__(self, eot: int, stops: bool):
        self.eot, self.stops = eot, stops

    def __call__(self, input_ids, position_ids, use_cache, tiled_loss_labels, eval_stats, eval_buckets=None):
        logits = torch.zeros(*input_ids.shape, 4096)
        rows, cols = torch.nonzero(tiled_loss_labels != -100, as_tuple=True)
        target = tiled_loss_labels[rows, cols]
        if not self.stops:
            target = torch.where(target == self.eot, (target + 1) % 4096, target)
        logits[rows, cols, target] = 100.0
        return _stats(lambda h: h, logits, tiled_loss_labels, 2, eval_buckets)


def test_chat_scoring_counts_the_reply_and_its_end_of_turn(tmp_path):
    """Asked through the template, a trial counts only when the model answers AND ends its turn; in plain text the
    same model (no turn to end) scores the answer alone."""
    tok = Tokenizer(build_tokenizer(str(tmp_path), "qwen25"))
    chat, eot = ChatEncoder(tok, "assistant", "none"), tok.hf.convert_tokens_to_ids("<|im_end|>")
    trials, depths = {"passkey": 2, "niah_multikey": 1}, [0.2, 0.8]

    def acc(stops, asked):
        return task_accuracy(ReplyEngine(eot, stops), DIMS1, 2, tok.pad_id, tok, trials, depths, 768, asked)

    ones = {t: {"0.2": 1.0, "0.8": 1.0} for t in trials}
    assert acc(True, chat) == ones and acc(False, None) == ones
    assert acc(False, chat) == {t: {"0.2": 0.0, "0.8": 0.0} for t in trials}


def _evaluate_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("evaluate_script", os.path.join(ROOT, "scripts", "evaluate.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_chat_mode_decision_and_refusal(tmp_path):
    """--chat auto asks a fine-tuned run's model through the template it trained with (its own, else the ChatML
    default), anything else in plain text; on / chatml / off force it; --chat on without a template: one line."""
    ev = _evaluate_module()
    own, bare = Tokenizer(build_tokenizer(str(tmp_path), "qwen25")), Tokenizer(SP)
    assert ev.sft_run({"data_kind": "sft"}) and ev.sft_run({"stages": [{"kind": "text"}, {"kind": "sft"}]})
    assert not ev.sft_run({"data_kind": "text", "stages": [{"name": "s"}]}) and not ev.sft_run({})
    cases = {("auto", own, True): "template", ("auto", bare, True): "chatml", ("auto", own, False): "plain",
             ("off", own, True): "plain", ("on", own, False): "template", ("chatml", own, False): "chatml",
             ("chatml", bare, False): "chatml"}
    for (flag, tok, sft), want in cases.items():
        assert ev.chat_mode(flag, tok, sft, "m") == want, (flag, tok.path, sft)
    with pytest.raises(ValueError, match=r"^m: --chat on: tokenizer .*tokenizer.model has no chat template: pass "
                                         r"--chat chatml .* or --chat off$"):
        ev.chat_mode("on", bare, True, "m")
    assert ev.chat_encoder(own, "plain") is None
    assert ev.chat_encoder(own, "template").kind == "prefix" and ev.chat_encoder(own, "chatml").default
    with pytest.raises(ValueError, match=r"argument --chat: invalid choice: 'yes'"):
        ev.parse_args(["m", "--lengths", "256", "--output_dir", "o", "--chat", "yes"])


def _stage(i, n, kind):
    return types.SimpleNamespace(index=i, name=f"s{i}", max_seq_length=n, eval={"heldout_samples": 2}, data=None,
                                 tasks={}, replay=None, kind=kind)


def test_sft_stage_heldout_is_whole_conversations(tmp_path):
    """An SFT stage is evaluated on held-out conversations packed whole (RunData.heldout sft=True), a text stage on
    the held-out documents packed as text; both with the loss on the assistant's tokens only."""
    from data.pipeline import open_run_data

    chats = build_demo_chats(str(tmp_path / "chats.jsonl"), 200, seed=2)
    data = open_run_data(chats, SP, Tokenizer(SP).vocab_size, [_stage(0, 256, "text"), _stage(1, 256, "sft")],
                         reset_position_ids=True)
    sft, text = stage_heldout(data, _stage(1, 256, "sft"), 2), stage_heldout(data, _stage(0, 256, "text"), 2)
    want_sft, want_text = data.heldout(256, 2, sft=True), data.heldout(256, 2)
    for got, want in ((sft, want_sft), (text, want_text)):
        assert len(got) == 2 and all(np.array_equal(g[k], w[k]) for g, w in zip(got, want)
                                     for k in ("input_ids", "shift_labels", "position_ids"))
    assert not np.array_equal(sft[0]["input_ids"], text[0]["input_ids"])  # the two packings differ here


class LabelEngine(ReplyEngine):
    def __init__(self):
        super().__init__(-1, True)


def test_retention_is_measured_as_the_first_stage_measured(tmp_path):
    """heldout_loss_first_len of an SFT stage after a text stage at the same length is the text packing's (the
    first stage's number, comparable), and after an SFT first stage the conversations' (sft=True)."""
    calls = []

    def heldout_at(seq_len, n, **kw):
        calls.append((seq_len, n, kw))
        return [{"input_ids": np.arange(8), "shift_labels": np.r_[np.arange(1, 8), -100],
                 "position_ids": np.arange(8)}] * n

    metrics = types.SimpleNamespace(log_eval=lambda *a: None, log_table=lambda *a, **k: None)
    held = heldout_at(8, 2)
    calls.clear()
    engine = LabelEngine()
    engine.eval = engine.train = lambda: None
    text0, sft1 = _stage(0, 8, "text"), _stage(1, 8, "sft")
    for st in (text0, sft1):
        st.eval = {"heldout_samples": 2, "position_buckets": 0}
    r = evaluate_stage(engine, sft1, DIMS1, held, None, metrics, 5, 1, 0, [text0, sft1], heldout_at)
    assert calls == [(8, 2, {})] and "heldout_loss_first_len" in r  # the text packing, as stage 0 measured it
    calls.clear()
    sft0, sft1 = _stage(0, 4, "sft"), _stage(1, 8, "sft")
    for st in (sft0, sft1):
        st.eval = {"heldout_samples": 2, "position_buckets": 0}
    evaluate_stage(engine, sft1, DIMS1, held, None, metrics, 5, 1, 0, [sft0, sft1], heldout_at)
    assert calls == [(4, 2, {"sft": True})]
    calls.clear()
    evaluate_stage(engine, sft1, DIMS1, held, None, metrics, 5, 1, 0, [_stage(0, 8, "sft"), sft1], heldout_at)
    assert calls == []  # same length, same packing: the stage's own number


def _records(out, rows):
    os.makedirs(out / "eval", exist_ok=True)
    for r in rows:
        (out / "eval" / f"stage{r['stage']}.json").write_text(json.dumps(r))


def test_eval_summary_prints_before_and_after(tmp_path, capsys):
    """scripts/eval_summary.py prints the run's evaluation (the first evaluated stage -> the last, then the tables
    of eval/summary.md); a folder without records is refused in one line, exit 2."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("eval_summary", os.path.join(ROOT, "scripts", "eval_summary.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "run"
    mean = [{"passkey": {"256": 1.0}}, {"passkey": {"256": 0.7333}}]
    _records(out, [{"stage": i, "stage_name": n, "step": s, "seq_len": 512, "heldout_loss": h,
                    "heldout_loss_first_len": h, "heldout_first_len_samples": 2, "first_len": 512, "task_mean": m,
                    "tasks": {"passkey": {"256": {"0.5": m["passkey"]["256"]}}}}
                   for i, (n, s, h, m) in enumerate([("before", 1, 7.4737, mean[0]), ("sft", 101, 1.7419, mean[1])])])
    assert script.main([str(out)]) == 0
    got = capsys.readouterr().out
    assert ("stage 0 (before) -> stage 1 (sft): held-out loss at 512: 7.4737 -> 1.7419; passkey at 256: "
            "1.00 -> 0.73") in got
    assert "| 1 | sft | 101 | 512 | 1.7419 | 1.7419 |" in got and "| 1 | 512 | 0.73 |" in got
    # a record from before 2026-11-30 (its trials seeded per task and length: other questions) beside today's
    (out / "eval" / "stage1.json").write_text(json.dumps({**json.loads((out / "eval" / "stage1.json").read_text()),
                                                          "task_seeds": "task:length:depth:trial"}))
    assert script.main([str(out)]) == 0
    assert "passkey at 256: 1.00 and 0.73 (other questions: one record's trials were seeded another way" in \
        capsys.readouterr().out
    assert script.main([str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "no evaluation records" in err


@pytest.mark.parametrize("target, recipe", [("demo", "recipes/tiny_cpu_extend.yaml"),
                                            ("demo-sft", "recipes/tiny_cpu_sft.yaml")])
def test_demos_end_by_printing_their_evaluation(target, recipe):
    """`make demo` and `make demo-sft` end with the summary of the run they just made (its output_dir)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}  # under `make test`
    p = subprocess.run(["make", "--no-print-directory", "-n", target], cwd=ROOT, capture_output=True, text=True,
                       timeout=60, env=env)
    with open(os.path.join(ROOT, recipe)) as fh:
        out = yaml.safe_load(fh)["output_dir"]
    assert p.returncode == 0 and p.stdout.strip().splitlines()[-1] == f".venv/bin/python scripts/eval_summary.py {out}"


@pytest.mark.parametrize("kind", ["sft", "text"])
def test_the_stage_loop_evaluates_an_sft_stage_on_conversations(monkeypatch, kind):
    """training/stage.py's real loop (test_stop_window's stand-ins: simulated clock, checkpointer, no engine) hands
    its evaluation the held-out samples asked with sft=True for an SFT stage, by length only for a text stage, and
    whether the run restarts positions (RunData.reset_position_ids: its position buckets' meaning, said)."""
    from tests.unit.training.test_stop_window import Clock, SimCheckpointer, stub_data, stub_stage
    from training import preemption
    from training import stage as stage_mod
    from training.checkpoint import TrainState
    from training.preemption import Deadline, PreemptionFlag

    clock, asked, given = Clock(), [], []
    monkeypatch.setattr(stage_mod, "time", clock)
    monkeypatch.setattr(preemption, "time", clock)
    monkeypatch.delenv("SLURM_JOB_END_TIME", raising=False)
    module = torch.nn.Linear(1, 1, bias=False)
    stub_stage(monkeypatch, module, heldout_samples=lambda e: 3,
               evaluate_stage=lambda engine, stage, dims, heldout, *a: given.append((heldout, a[-1])))
    data = stub_data(heldout=lambda *a, **k: asked.append((a, k)) or ["held"])
    data.reset_position_ids = kind == "sft"  # (--reset_position_ids no: a text run's own)
    cfg = types.SimpleNamespace(seed=0, per_device_train_batch_size=1, gradient_accumulation_steps=1, save_steps=0,
                                async_save=True, loss_weighting=None, output_dir="/unused")
    run = stage_mod.Run(cfg, ParallelDims(world=1, sp=1, rank=0, local_rank=0), data, SimCheckpointer(clock),
                        types.SimpleNamespace(log=lambda r: None, run_id=None, home=None, begin_stage=lambda end, start=None: None),
                        PreemptionFlag(None, Deadline(0.0, now=clock.t), save_every_s=0), types.SimpleNamespace(),
                        "sdpa", False)
    st = types.SimpleNamespace(index=0, name="s", max_steps=2, sp=1, cp=1, max_seq_length=64, rope=None, kind=kind,
                               deepspeed_overrides=None, reset_optimizer=False, eval=None, memory_choice=None,
                               steps_from="steps")
    stage_mod.train_stage(run, st, [st], TrainState())
    assert given == [(["held"], kind == "sft")] and asked == [((64, 3), {"sft": True} if kind == "sft" else {})]


def test_a_folder_of_mostly_text_says_its_sft_stage_has_few_held_out_conversations(tmp_path, capsys):
    """Issue 47's residual: the held-out documents are spread over the whole folder, so text and chats prepared
    together (docs/sft.md's recipe) give the SFT stage's held-out conversation loss the chats' share of them, here
    none: a warning names the count and where to score held-out chats instead (before: nothing said; the loss was
    reported as none). A folder of chats alone says nothing."""
    from data.pipeline import open_run_data
    from data.prepare_data import prepare

    (tmp_path / "text.jsonl").write_text("".join(json.dumps({"text": f"plain text number {i} " * 6}) + "\n"
                                                 for i in range(300)))
    chats = build_demo_chats(str(tmp_path / "chats.jsonl"), 3, seed=2)
    mixed = str(tmp_path / "mixed")
    prepare([str(tmp_path / "text.jsonl"), chats], mixed, SP, workers=0, log=lambda _: None)
    stages = [_stage(0, 256, "text"), _stage(1, 256, "sft")]
    data = open_run_data(mixed, SP, Tokenizer(SP).vocab_size, stages, reset_position_ids=True)
    out = capsys.readouterr().out
    got = len(data.heldout(256, 2, sft=True))
    assert got < 2 and re.search(rf"warning: stage 1 \(s1\) kind sft: {got} of the 2 held-out conversation samples its "
                                 rf"eval asks at 256 \(the \d+ held-out documents, spread over the whole folder, hold "
                                 rf"\d+ conversation\(s\)\): its held-out conversation loss is "
                                 rf"{'none' if not got else f'over {got} sample'}.*scripts/evaluate\.py RUN --heldout",
                                 out), out
    many = build_demo_chats(str(tmp_path / "many.jsonl"), 200, seed=2)
    open_run_data(many, SP, Tokenizer(SP).vocab_size, stages, reset_position_ids=True)
    assert "held-out conversation samples" not in capsys.readouterr().out


def test_a_resume_on_another_tokenizers_ids_is_refused(tmp_path):
    """A resume whose data is tokenized by another tokenizer than the one the checkpoint trained on (a second
    sentencepiece model, a new --tokenizer_name_or_path on the same JSONL) trained on the new ids under the old
    weights without a word. Checkpoints record their ids' tokenizer (its SHA-256); open_run_data refuses another in
    one line, and takes the same one or pre-tokenized ids (no tokenizer to compare)."""
    import shutil

    from data.pipeline import open_run_data
    from data.store import vocab_identity

    chats = build_demo_chats(str(tmp_path / "chats.jsonl"), 60, seed=2)
    stages = [_stage(0, 256, "text")]
    data = open_run_data(chats, SP, Tokenizer(SP).vocab_size, stages, reset_position_ids=True,
                         trained_on=vocab_identity(SP))
    assert data.tokenizer_vocab == vocab_identity(SP)
    with pytest.raises(ValueError, match=r"--dataset_path .*: tokenized with .*tokenizer.model, whose vocabulary is not "
                                         r"the one the resumed checkpoint trained on"):
        open_run_data(chats, SP, Tokenizer(SP).vocab_size, stages, reset_position_ids=True, trained_on="0" * 64)
    # a HF folder whose chat template was fixed since is the same vocabulary: no refusal
    hf = build_tokenizer(str(tmp_path / "t"), "qwen25")
    before = vocab_identity(hf)
    cfg = os.path.join(hf, "tokenizer_config.json")
    shutil.copy(cfg, cfg + ".bak")
    with open(cfg, "a") as fh:
        fh.write("\n")
    assert vocab_identity(hf) == before


def test_a_chat_runs_data_names_the_stop_its_export_adds(tmp_path):
    """train.py's export takes the end-of-turn the run's chat documents trained (RunData.reply_stops): the template's
    <|im_end|> for a Qwen-shaped tokenizer whose EOS is another token; nothing for text-only data."""
    from data.pipeline import open_run_data

    path = build_tokenizer(str(tmp_path), "qwen25")
    tok = Tokenizer(path)
    chats = build_demo_chats(str(tmp_path / "chats.jsonl"), 60, seed=2)
    data = open_run_data(chats, path, tok.vocab_size, [_stage(0, 256, "sft")], reset_position_ids=True)
    assert data.reply_stops() == [tok.hf.convert_tokens_to_ids("<|im_end|>")]
    assert data.trained_template() is None  # its own template: the export's tokenizer carries it already
    text = open_run_data(None, None, 2048, [_stage(0, 256, "text")], reset_position_ids=True)
    assert text.reply_stops() == [] and text.trained_template() is None


@pytest.mark.parametrize("bos_id", [None, 5])
def test_a_save_records_the_bos_its_texts_were_framed_with(monkeypatch, bos_id):
    """trainer.json `bos_id` (Tokenizer.bos_id: an id, or null for none) is what the export writes as add_bos_token
    (model_utils/export.trained_bos): the export worked it out again under its own transformers, whose rule for the
    same files may be another major's (DeepSeek-R1-Distill-Qwen: a BOS under 4.x, none under 5.x). A run without a
    tokenizer records nothing (an export given --tokenizer then reads the rule there, as before)."""
    import training.stage as stage_mod
    from training.checkpoint import TrainState

    monkeypatch.setattr(stage_mod, "model_hash", lambda c: "h")
    monkeypatch.setattr(stage_mod, "to_dict", lambda c: {})
    saved = []
    ckpt = types.SimpleNamespace(pending=None, written_s=0.0,
                                 save=lambda e, step, meta, *a, **k: saved.append(meta) or "/ck/step_000000")
    preempt = types.SimpleNamespace(stopping=False, saved=lambda *a, **k: None, committed=lambda s: None,
                                    deadline=types.SimpleNamespace(record_save=lambda s: None))
    st = types.SimpleNamespace(index=0, name="s", max_steps=4, steps_from="steps", sp=1)
    for tok in (types.SimpleNamespace(path="/tok", bos_id=bos_id, pieces_identity=lambda: "p"), None):
        data = types.SimpleNamespace(heldout_split=None, tokenizer=tok, tokenizer_vocab=None, reply_stops=lambda: [],
                                     trained_template=lambda: None)
        run = stage_mod.Run(types.SimpleNamespace(async_save=False), DIMS1, data, ckpt,
                            types.SimpleNamespace(run_id=None, home=None), preempt, None, "sdpa", False)
        stage_mod._save(run, None, [st], st, None, TrainState(), types.SimpleNamespace(state_dict=lambda: {}), True)
    assert saved[0]["bos_id"] == bos_id and "bos_id" in saved[0] and "bos_id" not in saved[1]
