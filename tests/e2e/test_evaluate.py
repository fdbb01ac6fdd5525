"""scripts/evaluate.py against the in-run evaluation: a short run of the shipped base (recipes/base/tiny_passkey256,
2 steps at 256 tokens under a YaRN stage RoPE, SP=2 on 2 ranks) evaluates its stage at 256, 512 and 768 tokens; then
evaluate.py, also SP=2 on 2 ranks, scores the exported model and the run's checkpoint side by side: both must
score exactly what the run scored, cell by cell (same tasks, depths, trials and seeds; the checkpoint with its
stage's RoPE; the run folder resolves to it). User errors are refused in one line before any model is built."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
import yaml

from tests.distributed import ROOT, run
from tests.runs import TRAIN

pytestmark = pytest.mark.dist
EVALUATE = os.path.join(ROOT, "scripts", "evaluate.py")
ROPE = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 256}
TASKS = {"passkey": 3, "niah_multivalue": 1, "common_words": 1}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    d = tmp_path_factory.mktemp("evaluate")
    recipe = d / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "model_name_or_path": os.path.join(ROOT, "recipes/base/tiny_passkey256"),
        "deepspeed": os.path.join(ROOT, "ds_configs/zero3_offload.json"), "report_to": "none", "seed": 0,
        "per_device_train_batch_size": 2, "learning_rate": 1e-4, "stages": [
            {"name": "s256", "max_seq_length": 256, "sequence_parallel_size": 2, "max_steps": 2, "rope": ROPE,
             "tasks": {"passkey": 0.5},
             "eval": {"tasks": TASKS, "depths": [0.1, 0.9], "lengths": [256, 512, 768], "heldout_samples": 0}}]}))
    out = d / "run"
    run(TRAIN, ["--config", str(recipe), "--output_dir", str(out)], 2, str(d / "logs_train"))
    return d, out


@pytest.mark.slow  # ~100 s: a training run then the tool; its refusals and checkpoint reading stay fast
def test_evaluate_scores_what_the_run_scored(trained):
    d, out = trained
    in_run = json.loads((out / "eval" / "stage0.json").read_text())
    report = d / "report"
    run(EVALUATE, [str(out / "hf_model"), "--compare", str(out), "--lengths", "256,512,768",  # the run: its newest checkpoint
                   "--tasks", ",".join(f"{t}:{n}" for t, n in TASKS.items()), "--depths", "0.1,0.9",
                   "--sequence_parallel_size", "2", "--context_parallel_size", "2",  # the run used Ulysses: same scores
                   "--micro_batch", "2", "--output_dir", str(report), "--dist_timeout_s", "60"], 2, str(d / "logs_eval"))
    got = json.loads((report / "eval.json").read_text())
    exported, checkpoint = got["models"]
    assert set(in_run["tasks"]) == set(TASKS) and set(in_run["tasks"]["passkey"]) == {"256", "512", "768"}
    assert exported["tasks"] == in_run["tasks"] and checkpoint["tasks"] == in_run["tasks"]  # every cell, exactly
    assert exported["task_mean"] == in_run["task_mean"] == checkpoint["task_mean"]
    # the answer tokens' mean loss per cell: the very same questions (other ones would not agree to 1e-4; only the
    # summation order differs: the run's Ulysses split vs this (ulysses, cp) = (1, 2))
    cells = [(t, n, dd) for t, lens in in_run["task_loss"].items() for n, by_d in lens.items() for dd in by_d]
    assert len(cells) == len(TASKS) * 3 * 2
    for r in (exported, checkpoint):
        assert [r["task_loss"][t][n][dd] for t, n, dd in cells] == pytest.approx(
            [in_run["task_loss"][t][n][dd] for t, n, dd in cells], rel=1e-4)
    assert in_run["task_mean"]["passkey"]["256"] > 0.5  # the base retrieves: the equality is not only of zeros
    # and at 768 (3x its training length) only some trials: cells that other questions would score differently
    assert any(0 < a < 1 for a in in_run["tasks"]["passkey"]["768"].values()), in_run["tasks"]["passkey"]
    assert (exported["kind"], checkpoint["kind"], checkpoint["step"]) == ("hf", "checkpoint", 2)
    assert checkpoint["model"] == str(out / "checkpoints" / "step_000002")
    for r in (exported, checkpoint):  # the stage's RoPE: carried by the export, read from the checkpoint
        assert {k: r["rope"][k] for k in ROPE} == ROPE and (r["sp"], r["cp"], r["world"]) == (2, 2, 2)
    assert all(v == 0 for lens in got["difference"].values() for acc in lens.values() for v in acc.values())
    summary = (report / "summary.md").read_text()
    assert "**common_words** accuracy" in summary and "| compare - model | +0.00 | +0.00 | +0.00 |" in summary
    assert (report / "heatmaps.png").stat().st_size > 20_000


def test_the_plainest_run(tmp_path):
    """The tool as a user first runs it: a model, its lengths, an output folder, no optional flag, one process (~13 s):
    it evaluates and writes its report (the held-out conversation loss once broke this: KeyError without --heldout)."""
    p = subprocess.run([sys.executable, EVALUATE, os.path.join(ROOT, "recipes/base/tiny_passkey256"), "--lengths", "256",
                        "--output_dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    (model,) = json.loads((tmp_path / "eval.json").read_text())["models"]
    assert set(model["tasks"]) == {"passkey"} and "heldout_chat_loss" not in model
    assert "evaluated " in p.stdout + p.stderr and (tmp_path / "summary.md").is_file()


def test_compare_frees_the_first_model_before_building_the_second(tmp_path, monkeypatch):
    """--compare in this process (a world of one, ~8 s): the first model's engine, model and optimizer are dead when
    the second is built and after the run. destroy() alone left them on DeepSpeed's module stack and in its
    coordinator's cache (training/engine.release_engine): the second model was built next to the first's host state."""
    import gc
    import socket
    import weakref

    import training.engine as te
    from scripts import evaluate

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}.items():
        monkeypatch.setenv(k, v)
    refs, alive_at_build, build = [], [], te.build_engine

    def watched(*args, **kwargs):
        gc.collect()
        alive_at_build.append([r() is not None for r in refs])
        engine = build(*args, **kwargs)
        refs.extend(weakref.ref(o) for o in (engine, engine.module, engine.optimizer))
        return engine

    monkeypatch.setattr(te, "build_engine", watched)
    from deepspeed.utils import logger as ds_logger

    from base import log

    loggers = {lg: list(lg.handlers) for lg in (log._RANK_LOG, ds_logger)}  # main opens this rank's log file on them
    monkeypatch.setattr(log._RANK_LOG, "propagate", log._RANK_LOG.propagate)
    base = os.path.join(ROOT, "recipes/base/tiny_passkey256")
    try:
        assert evaluate.main([base, "--compare", base, "--lengths", "256", "--tasks", "passkey:1", "--depths", "0.5",
                              "--output_dir", str(tmp_path)]) == 0
    finally:
        for lg, kept in loggers.items():
            for h in [h for h in lg.handlers if h not in kept]:
                lg.removeHandler(h)
                h.close()
    gc.collect()
    assert alive_at_build == [[], [False] * 3] and len(refs) == 6
    assert [r() is not None for r in refs] == [False] * 6
    assert len(json.loads((tmp_path / "eval.json").read_text())["models"]) == 2


@pytest.mark.parametrize("args, message", [
    (["missing_model", "--lengths", "256"], "MODEL missing_model: not a local folder, a preset, nor in the local "
                                            "Hugging Face cache"),  # as train.py says it: a name may be a hub id
    (["recipes/base/tiny_passkey256", "--lengths", "256,huge"], "--lengths '256,huge': use"),
    (["recipes/base/tiny_passkey256", "--lengths", "256", "--tasks", "passkey:0"], "--tasks passkey:0: no task has a "
                                                                                  "trial"),  # it evaluated nothing, 0
])
def test_user_errors_are_one_line(tmp_path, args, message):
    p = subprocess.run([sys.executable, EVALUATE, *args, "--output_dir", str(tmp_path)], cwd=ROOT, capture_output=True,
                       text=True, timeout=120, env=dict(os.environ, DS_ACCELERATOR="cpu"))
    assert p.returncode == 2, p.stderr[-2000:]
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in p.stderr, p.stderr[-2000:]


def test_refusals_before_any_model_is_built(tmp_path):
    """What main() checks before building: flags (settings), then each model (check_source, on every rank)."""
    from model_utils.build import load_hf_config
    from scripts.evaluate import check_source, describe, parse_args, settings

    base = os.path.join(ROOT, "recipes/base/tiny_passkey256")

    def refused(*args, world=2):
        a = parse_args([base, *args, "--output_dir", str(tmp_path)])
        s = settings(a)
        src = {**describe(base, None), "hf_config": load_hf_config(base), "attn": "sdpa", "bf16": False}
        check_source(src, a, s, world, s["ropes"][0])

    for args, message in [(["--lengths", "256", "--depths", "0.5,2"], "--depths '0.5,2': use depths"),
                          (["--lengths", "256", "--rope", "{rope_type: dynamic, factor: 2.0}", "--sequence_parallel_size",
                            "2"], "--rope: rope_type dynamic scales"),
                          (["--lengths", "256", "--sequence_parallel_size", "8", "--context_parallel_size", "1"],
                           "leaves a Ulysses factor of 8, which must divide the 4 query heads"),
                          (["--lengths", "200,256", "--tasks", "niah_multivalue"],
                           "--lengths 200: max_seq_length=200 is too short for a niah_multivalue trial"),
                          # every trial it asks, by its seed: Random(0) at depth 0.5 fit 307 (the old check), trial 2
                          # at 0.5 needs 315 (was refused after the engine build, at its evaluation)
                          (["--lengths", "307", "--tasks", "variable_tracking:10"],
                           "--lengths 307: max_seq_length=307 is too short for a variable_tracking trial (needs 315 "
                           "tokens: trial 2 at depth 0.5)"),
                          (["--lengths", "256", "--compare_rope", "{rope_type: linear, factor: 2.0}"],
                           "--compare_rope without --compare"),
                          (["--lengths", "256", "--chat", "on"],  # the demo's sentencepiece tokenizer has no template
                           "--chat on: tokenizer " + os.path.join(base, "tokenizer.model") + " has no chat template: "
                           "pass --chat chatml"),
                          # a mapping flag's bad YAML (was yaml's ParserError traceback) and a timeout <= 0 (was taken)
                          (["--lengths", "256", "--rope", "{rope_type: yarn, factor: 4"], "--rope '{rope_type: yarn, "
                           "factor: 4': not valid YAML at line 1"),
                          (["--lengths", "256", "--dist_timeout_s", "0"], "--dist_timeout_s 0.0: use seconds > 0")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            refused(*args, world=8 if "8" in args else 2)
    refused("--lengths", "256,512", "--tasks", "passkey:2,common_words:1")  # a valid request passes


@pytest.mark.slow  # ~40 s after the run above; fast siblings: tests/unit/training/test_sft_eval.py (rendering, scoring,
# the --chat decision) and test_refusals_before_any_model_is_built (--chat on without a template)
def test_evaluate_asks_through_the_chat_template(trained):
    """--chat chatml on 2 ranks (SP 2): the same tasks asked as one ChatML user turn, scored on the reply and its
    end-of-turn; the report says how they were asked. A base never fine-tuned on chat answers in plain text, not in
    the chat layout: its answer tokens' loss rises against the plain-text cells of the same run (other samples).
    With --heldout, the held-out conversation loss equals the plain Hugging Face model's mean loss over the assistant's
    tokens, each conversation alone, its ChatML rendering written out by hand (tests/unit/training/test_heldout_chat.py,
    the fast sibling, checks the same against a stand-in model)."""
    from transformers import AutoModelForCausalLM

    from data.tokenizer import Tokenizer
    from tests.unit.training.test_heldout_chat import ROWS, oracle

    d, out = trained
    in_run = json.loads((out / "eval" / "stage0.json").read_text())
    report, chats = d / "report_chat", d / "chats.jsonl"
    chats.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    run(EVALUATE, [str(out), "--lengths", "256,512", "--tasks", "passkey:3", "--depths", "0.1,0.9", "--chat", "chatml",
                   "--heldout", str(chats), "--sequence_parallel_size", "2", "--output_dir", str(report),
                   "--dist_timeout_s", "60"], 2, str(d / "logs_eval_chat"))
    (model,) = json.loads((report / "eval.json").read_text())["models"]
    hf = AutoModelForCausalLM.from_pretrained(str(out / "hf_model"), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        want, n = oracle(Tokenizer(str(out / "hf_model" / "tokenizer.model")),
                         lambda ids: hf(input_ids=ids[None]).logits[0], ROWS)
    assert (model["heldout_chat_tokens"], model["heldout_chat_conversations"]) == (n, len(ROWS))
    assert model["heldout_chat_loss"] == pytest.approx(want, rel=1e-4), (model["heldout_chat_loss"], want)
    assert "**held-out conversation loss**" in (report / "summary.md").read_text()
    assert model["chat"] == "chatml" and set(model["tasks"]["passkey"]) == {"256", "512"}
    chat_loss = [model["task_loss"]["passkey"][n][dd] for n in ("256", "512") for dd in ("0.1", "0.9")]
    plain_loss = [in_run["task_loss"]["passkey"][n][dd] for n in ("256", "512") for dd in ("0.1", "0.9")]
    assert chat_loss != pytest.approx(plain_loss, rel=1e-3)  # other samples than the plain trials
    assert "| model |" in (report / "summary.md").read_text() and "chat (ChatML default)" in (
        report / "summary.md").read_text()


def test_a_checkpoint_brings_its_stage_rope_and_tokenizer(trained):
    from scripts.evaluate import describe

    _, out = trained
    src = describe(str(out / "checkpoints" / "step_000002"), None)
    assert (src["kind"], src["step"], src["stage"]) == ("checkpoint", 2, "s256")
    assert {k: src["config"]["rope_parameters"][k] for k in ROPE} == ROPE  # the stage's, not the base's default
    assert src["tokenizer"] and os.path.isfile(src["tokenizer"])
    exported = describe(str(out / "hf_model"), None)
    assert exported["kind"] == "hf" and exported["tokenizer"] == str(out / "hf_model" / "tokenizer.model")
