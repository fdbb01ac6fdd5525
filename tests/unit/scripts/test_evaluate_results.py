"""scripts/evaluate.py's results: eval.json strict (null, never a bare NaN, which jq and most readers refuse: a held-out
set's non-finite loss was written as NaN, as eval/stage{N}.json was before training/metrics.strict), and the line a
model's result is printed in rounded as summary.md rounds it (it printed `0.15999999999999998`); and the template a
checkpoint's chat trials and --heldout rows are rendered with: the one its run trained with."""

from __future__ import annotations

import json
import random

from training.eval_report import asked, said, write_results


def _result(loss: float) -> dict:
    return {"model": "m", "kind": "hf", "rope": None, "trials": {"passkey": 5}, "chat": "plain",
            "tasks": {"passkey": {"256": {"0.1": 0.2, "0.5": 0.12}}}, "task_mean": {"passkey": {"256": 0.15999999999999998}},
            "task_loss": {"passkey": {"256": {"0.1": float("nan"), "0.5": 1.5}}}, "heldout_chat_loss": loss,
            "heldout_chat_tokens": 10, "heldout_chat_conversations": 2, "heldout_chat_length": 256}


def test_eval_json_is_strict_and_the_printed_line_rounded(tmp_path):
    results = [_result(float("nan")), _result(2.5)]
    write_results(str(tmp_path), results, {"passkey": {"256": {"0.1": 0.0, "0.5": 0.0}}})

    def refuse(name):
        raise AssertionError(f"{name} in eval.json")

    got = json.loads((tmp_path / "eval.json").read_text(), parse_constant=refuse)
    assert got["models"][0]["heldout_chat_loss"] is None and got["models"][0]["heldout_chat_loss_nonfinite"] == "nan"
    assert got["models"][0]["task_loss"]["passkey"]["256"]["0.1"] is None and got["difference"]["passkey"]["256"] == {
        "0.1": 0.0, "0.5": 0.0}
    assert got["models"][1]["heldout_chat_loss"] == 2.5 and (tmp_path / "summary.md").is_file()
    assert results[0]["heldout_chat_loss"] != results[0]["heldout_chat_loss"]  # the results themselves untouched
    line = said(results[1])
    assert line == "passkey 256: 0.16, held-out conversation loss 2.5000", line
    assert said({"task_mean": {"passkey": {"256": 1.0, "512": 0.5}}}) == "passkey 256: 1.00 512: 0.50"


def test_a_checkpoint_is_asked_in_the_template_its_run_trained_with(tmp_path):
    """A run prepared with `--chat_template chatml` on a tokenizer that ships its own (Llama 3's headers): --chat auto
    asked its checkpoint's trials, and --heldout rendered its rows, in the tokenizer's own template, which the run never
    trained on (its in-run evaluation and its export use the ChatML default it trained with). Now trainer.json's
    `trained_template` decides for a checkpoint (the first trial token and the first held-out token <|im_start|>, not
    <|begin_of_text|>); a checkpoint from before it was recorded and an HF folder keep the tokenizer's own; a template
    the tokenizer does not have is asked in, as trained. Cheap: the checkpoint's JSON files only, no model."""
    from data.chat_stops import trained_template
    from data.tokenizer import Tokenizer
    from scripts.evaluate import chat_encoder, chat_modes, describe, parse_args
    from tests.unit.data.chat_fixtures import build_tokenizer
    from training.checkpoint_files import MANIFEST
    from training.evaluation import trial
    from training.heldout_chat import heldout_set

    path = build_tokenizer(str(tmp_path / "toks"), "llama3")
    tok = Tokenizer(path)
    rows = tmp_path / "chats.jsonl"
    rows.write_text(json.dumps({"messages": [{"role": "user", "content": "Say yes."},
                                             {"role": "assistant", "content": "yes"}]}) + "\n")

    def checkpoint(name: str, **trainer) -> str:
        ck = tmp_path / name / "checkpoints" / "step_000002"
        ck.mkdir(parents=True)
        (ck / MANIFEST).write_text("{}")
        (ck / "hf_config.json").write_text("{}")
        (ck / "trainer.json").write_text(json.dumps({"tokenizer": path, "config": {"data_kind": "sft"}, **trainer}))
        return str(ck)

    def first(ck: str, *flags: str) -> tuple[str, str, str]:
        a = parse_args([ck, "--lengths", "512", "--output_dir", str(tmp_path / "o"), "--heldout", str(rows), *flags])
        mode, template = chat_modes(a, tok, describe(ck, None), ck)
        s = trial("passkey", tok, 512, 0.5, random.Random(0), chat_encoder(tok, mode))
        held = heldout_set(str(rows), tok, template)
        return mode, tok.piece(int(s["input_ids"][0])), tok.piece(int(held["ids"][0]))

    chatml = checkpoint("chatml", trained_template=trained_template(path, "chatml"))  # what such a run records
    assert first(chatml) == ("chatml", "<|im_start|>", "<|im_start|>")
    assert first(chatml, "--chat", "off")[2] == "<|im_start|>"  # --heldout alone: as it trained too
    assert first(chatml, "--chat", "on") == ("template", "<|begin_of_text|>", "<|begin_of_text|>")  # asked for
    assert first(checkpoint("own", trained_template=None)) == ("template", "<|begin_of_text|>", "<|begin_of_text|>")
    assert first(checkpoint("old")) == ("template", "<|begin_of_text|>", "<|begin_of_text|>")  # from before the record
    # a template the tokenizer does not have (a --chat_template FILE's; another revision's): asked in it, as trained
    other = "{{ '<|im_start|>' }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert first(checkpoint("other", trained_template=other)) == (other, "<|im_start|>", "<|im_start|>")
    assert asked("chatml") == "chat (ChatML default)" and asked("tool_use") == "chat (its `tool_use` template)"
