"""data/run_tokenizer.check_trained_vocab compared the SHA-256 of a tokenizer's files' bytes only: the same vocabulary
re-serialised was refused (the run's own hf_model, whose save_pretrained rewrote a pre-0.20 `tokenizers` merges format
or gave a sentencepiece-only folder a tokenizer.json; the recorded folder re-saved in place), and scripts/evaluate.py
had no way out. Now other bytes pass where every id's token and the EOS id are the same (trainer.json
`tokenizer_pieces`); a checkpoint from before that was recorded accepts this run's own export, with a note; another
vocabulary (two pieces swapped) is still refused in one line."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest

from data.run_tokenizer import check_trained_vocab
from data.store import vocab_identity
from data.tokenizer import Tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SP = os.path.join(ROOT, "recipes/base/tiny_passkey256/tokenizer.model")  # the demo's sentencepiece model
CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, this is a test of the tokenizer"] * 20


def _old_merges_folder(root) -> str:
    """A byte-level BPE folder whose tokenizer.json holds its merges as "a b" strings (tokenizers < 0.20 wrote them
    so; save_pretrained writes pairs)."""
    from tokenizers import Tokenizer as Raw
    from tokenizers import decoders, models, pre_tokenizers, trainers

    out = root / "tok_old"
    out.mkdir()
    t = Raw(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                                      show_progress=False,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    t.save(str(out / "tokenizer.json"))
    d = json.loads((out / "tokenizer.json").read_text())
    d["model"]["merges"] = [" ".join(m) if isinstance(m, list) else m for m in d["model"]["merges"]]
    (out / "tokenizer.json").write_text(json.dumps(d, indent=2))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "<s>",
                                                           "tokenizer_class": "PreTrainedTokenizerFast"}))
    return str(out)


def _sp_folder(root) -> str:
    """A sentencepiece-only Hugging Face folder (tokenizer.model, no tokenizer.json: Llama 2's first releases)."""
    out = root / "tok_sp"
    out.mkdir()
    shutil.copy(SP, out / "tokenizer.model")
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>",
                                                           "eos_token": "</s>", "unk_token": "<unk>"}))
    return str(out)


def _trained(path: str, pieces: bool = True) -> dict:
    """trainer.json's record of a run that trained with the tokenizer at `path` (`pieces`: today's, with its tokens)."""
    return {"tokenizer_vocab": vocab_identity(path),
            **({"tokenizer_pieces": Tokenizer(path).pieces_identity()} if pieces else {})}


def _checkpoint(root):
    ck = root / "run" / "checkpoints" / "step_000002"
    ck.mkdir(parents=True)
    (ck / "MANIFEST.json").write_text('{"files": {}}')
    return ck


@pytest.mark.parametrize("make", [_old_merges_folder, _sp_folder])
def test_its_export_passes_and_another_vocabulary_is_refused(tmp_path, make):
    from model_utils.export_tokenizer import export_tokenizer

    folder = make(tmp_path)
    out = tmp_path / "run" / "hf_model"
    export_tokenizer(folder, str(out), None, None)
    assert vocab_identity(str(out)) != vocab_identity(folder)  # other bytes (the false refusal's cause)
    ck = _checkpoint(tmp_path)
    for given in (False, True):
        check_trained_vocab(str(out), _trained(folder), str(ck), given)  # the same ids: passes
    swapped = tmp_path / "swapped"
    shutil.copytree(out, swapped)
    d = json.loads((swapped / "tokenizer.json").read_text())
    vocab = d["model"]["vocab"]
    if isinstance(vocab, dict):  # BPE: token -> id
        a, b = sorted(vocab, key=vocab.get)[300 - 40:300 - 38]
        vocab[a], vocab[b] = vocab[b], vocab[a]
    else:  # Unigram: [piece, score] by id
        vocab[300][0], vocab[301][0] = vocab[301][0], vocab[300][0]
    (swapped / "tokenizer.json").write_text(json.dumps(d))
    with pytest.raises(ValueError) as e:
        check_trained_vocab(str(swapped), _trained(folder), str(ck), True)
    msg = str(e.value)
    assert "\n" not in msg and f"--tokenizer {swapped}" in msg and "--tokenizer PATH" in msg, msg


def test_a_folder_re_saved_in_place_passes(tmp_path):
    folder = _old_merges_folder(tmp_path)
    trained = _trained(folder)
    Tokenizer(folder).hf.save_pretrained(folder)  # re-saved where it was recorded
    assert vocab_identity(folder) != trained["tokenizer_vocab"]
    check_trained_vocab(folder, trained, str(_checkpoint(tmp_path)))


def test_an_older_checkpoint_accepts_its_own_export_of_a_moved_run(tmp_path, capsys):
    """No tokenizer_pieces (before it was recorded): this run's export passes with a note, by real path or, the run
    moved since, by the manifest's SHA-256 of the checkpoint of that name here; another folder is refused, naming the
    run's own export as the way out; so does scripts/evaluate.describe, which has no --tokenizer none."""
    from model_utils.export_tokenizer import export_tokenizer
    from scripts.evaluate import describe

    folder = _old_merges_folder(tmp_path)
    ck = _checkpoint(tmp_path)
    (ck / "hf_config.json").write_text(json.dumps({"model_type": "llama"}))
    (ck / "trainer.json").write_text(json.dumps({"step": 2, "tokenizer": folder, **_trained(folder, pieces=False)}))
    out = tmp_path / "run" / "hf_model"
    export_tokenizer(folder, str(out), None, None)
    sha = hashlib.sha256((ck / "MANIFEST.json").read_bytes()).hexdigest()
    for was in (str(ck), "/old/place/run/checkpoints/step_000002"):  # here, or where the run was when it exported
        (out / "export.json").write_text(json.dumps({"checkpoint": was, "manifest_sha256": sha}))
        assert describe(str(ck), str(out))["tokenizer"] == str(out)
        said = capsys.readouterr().out
        assert "this run's own export" in said and said.count("\n") == 1, said
    (out / "export.json").write_text(json.dumps({"checkpoint": "/other/run/checkpoints/step_000002",
                                                 "manifest_sha256": "0" * 64}))  # another run's export
    with pytest.raises(ValueError) as e:
        describe(str(ck), str(out))
    msg = str(e.value)
    assert "\n" not in msg and f"--tokenizer {out}" in msg and "own export" in msg, msg
