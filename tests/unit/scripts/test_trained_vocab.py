"""scripts/export_hf.py and scripts/evaluate.py read a checkpoint through the tokenizer it recorded (or --tokenizer):
only the path was checked (that it exists), so another revision put at the same path (a new cluster's /models, two
pieces of a sentencepiece model swapped) was exported beside the weights / scored, its ids other tokens, without a
word, while a resume refuses it. Now both compare its vocabulary with trainer.json's `tokenizer_vocab`
(data/run_tokenizer.check_trained_vocab) and refuse in one line naming the path and --tokenizer PATH."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil

import pytest

from data.store import vocab_identity

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SP = os.path.join(ROOT, "recipes/base/tiny_passkey256/tokenizer.model")  # the demo's sentencepiece model


def _replaced(tmp_path) -> tuple[str, str, str]:
    """(the recorded path, now holding another revision: two pieces swapped; a copy of the trained one; its identity)"""
    from sentencepiece import sentencepiece_model_pb2

    good = tmp_path / "copy" / "tokenizer.model"
    good.parent.mkdir()
    shutil.copy(SP, good)
    trained = vocab_identity(str(good))
    m = sentencepiece_model_pb2.ModelProto()
    m.ParseFromString(good.read_bytes())
    a, b = m.pieces[300], m.pieces[301]
    a.piece, b.piece = b.piece, a.piece
    moved = tmp_path / "models" / "tokenizer.model"
    moved.parent.mkdir()
    moved.write_bytes(m.SerializeToString())
    assert vocab_identity(str(moved)) != trained
    return str(moved), str(good), trained


def test_export_refuses_a_tokenizer_that_is_not_the_one_it_trained_with(tmp_path, monkeypatch, capsys):
    recorded, good, trained = _replaced(tmp_path)
    spec = importlib.util.spec_from_file_location("export_hf", os.path.join(ROOT, "scripts", "export_hf.py"))
    export = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(export)
    ck = tmp_path / "run" / "checkpoints" / "step_000002"
    ck.mkdir(parents=True)
    (ck / "MANIFEST.json").write_text("{}")
    seen = {}
    monkeypatch.setattr(export.Checkpointer, "verify", lambda self, path: None)
    monkeypatch.setattr(export.Checkpointer, "read_trainer", staticmethod(lambda path: {
        "tokenizer": recorded, "tokenizer_vocab": trained, "config": {}}))
    monkeypatch.setattr(export, "export_hf", lambda path, out, tok, **kw: seen.update(tok=tok) or out)
    monkeypatch.setattr(export, "manifest_sha256", lambda path: "x")
    for given in ([], ["--tokenizer", recorded]):  # recorded, or given: the same refusal
        assert export.main([str(ck), *given]) == 2 and not seen
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and recorded in err[0] and "--tokenizer PATH" in err[0] and "trained with" in err[0], err
        assert ("--tokenizer " + recorded in err[0]) is bool(given)
    assert export.main([str(ck), "--tokenizer", good]) == 0 and seen == {"tok": good}  # the one it trained with
    assert export.main([str(ck), "--tokenizer", "none"]) == 0 and seen == {"tok": None}
    monkeypatch.setattr(export.Checkpointer, "read_trainer", staticmethod(lambda path: {  # before it was recorded
        "tokenizer": recorded, "config": {}}))
    assert export.main([str(ck)]) == 0 and seen == {"tok": recorded}


def test_evaluate_refuses_a_tokenizer_that_is_not_the_one_it_trained_with(tmp_path):
    from scripts.evaluate import describe

    recorded, good, trained = _replaced(tmp_path)
    ck = tmp_path / "run" / "checkpoints" / "step_000002"
    ck.mkdir(parents=True)
    (ck / "MANIFEST.json").write_text("{}")
    (ck / "hf_config.json").write_text(json.dumps({"model_type": "llama"}))
    (ck / "trainer.json").write_text(json.dumps({"step": 2, "tokenizer": recorded, "tokenizer_vocab": trained}))
    for given in (None, recorded):
        with pytest.raises(ValueError) as e:
            describe(str(ck), given)
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(f"{ck}: ") and recorded in msg and "--tokenizer PATH" in msg, msg
    assert describe(str(ck), good)["tokenizer"] == good
