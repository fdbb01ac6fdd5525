"""A tokenizer and what it is paired with: the in-job preparation's lines (train.py's --dataset_path), a model folder
whose tokenizer outgrew its embedding, a template whose control strings are not tokens of the vocabulary."""

from __future__ import annotations

import json
import os

import pytest

from data import prepare as in_job
from data.tokenizer import Tokenizer
from tests.unit.data.chat_fixtures import QWEN15_SHAPE, build_tokenizer

TURNS = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
# reasoning SFT's custom format: the reply wrapped in plain-text tags, then the template's real end-of-turn (the EOS)
ANSWER_TAGS = ("{% for m in messages %}{% if m['role'] == 'user' %}{{ 'User: ' + m['content'] + '\\n' }}{% else %}"
               "{{ 'Assistant: <answer>' + m['content'] + '</answer>' + eos_token + '\\n' }}{% endif %}{% endfor %}"
               "{% if add_generation_prompt %}{{ 'Assistant: <answer>' }}{% endif %}")


def _rows(path, rows, key="messages") -> str:
    path.write_text("".join(json.dumps({key: r}) + "\n" for r in rows))
    return str(path)


def test_the_in_job_preparation_says_its_no_stop_warning(tmp_path, monkeypatch, capsys):
    """train.py's in-job preparation passed prepare_data a log that dropped every line: a template that never trains a
    stop token (Qwen1.5's shape) trained and exported without a word. Its summary and warnings now reach the output
    (rank 0 prepares alone), naming the folder trained on, not the private one it was written in."""
    monkeypatch.setattr(in_job, "CACHE", str(tmp_path / "cache"))
    path = build_tokenizer(str(tmp_path / "tok"), "qwen25")
    tok = Tokenizer(path)
    tok.hf.chat_template = QWEN15_SHAPE
    tok.hf.save_pretrained(path)
    src = _rows(tmp_path / "c.jsonl", [TURNS, TURNS + [{"role": "user", "content": "bye"}], TURNS])
    out, _ = in_job.prepare_in_job(src, path, Tokenizer(path).vocab_size)
    said = capsys.readouterr().out
    warn = [x for x in said.splitlines() if x.startswith("warning:")]
    assert len(warn) == 1 and "2 conversation(s) end with a reply trained with no end-of-turn" in warn[0]
    assert f"{out}: 3 documents" in said and ".tmp" not in said
    for reused in (src, out):  # a requeued run finds it cached; a run given the prepared folder: the warning again
        assert in_job.prepare_in_job(reused, path, Tokenizer(path).vocab_size)[0] == out
        again = capsys.readouterr().out.splitlines()
        assert again == warn, again  # the warning alone (the summary was said where it was prepared)


def test_a_model_tokenizer_larger_than_its_embedding_is_refused_in_one_line(tmp_path, monkeypatch):
    """No --tokenizer_name_or_path: the model folder's own tokenizer, with tokens added after the model's save, gave a
    bad row's error ("token id ... >= the vocabulary size ... --skip_bad_rows") for the first row holding one; now the
    refusal a named tokenizer gets (data/packing.vocab_refusal), before anything is prepared."""
    monkeypatch.setattr(in_job, "CACHE", str(tmp_path / "cache"))
    model = build_tokenizer(str(tmp_path / "model"), "qwen25")
    src = _rows(tmp_path / "c.jsonl", [TURNS])
    small = Tokenizer(model).vocab_size - 10
    with pytest.raises(ValueError, match=r"^tokenizer .* tokens but the model's vocab_size is \d+: .*"
                                         r"resize_token_embeddings") as e:
        in_job.prepare_in_job(src, None, small, model)
    assert "\n" not in str(e.value) and not os.path.isdir(tmp_path / "cache" / "prepared")
    folder, tok = in_job.prepare_in_job(src, None, small + 10, model)  # the model's own size: prepared as before
    assert tok == model and in_job.is_prepared(folder)


CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
          "'\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
MISTRAL_V01 = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}{{ '[INST] ' + "
               "message['content'] + ' [/INST]' }}{% else %}{{ message['content'] + eos_token + ' ' }}{% endif %}"
               "{% endfor %}")


def _base_tokenizer(root: str, template: str | None) -> str:
    """A Mistral-7B-v0.1-shaped base tokenizer (<unk> <s> </s>, no ChatML tokens), with `template` pasted in."""
    from tokenizers import Tokenizer as Raw
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    t = Raw(models.BPE())
    t.pre_tokenizer, t.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    t.train_from_iterator(["Probe question one? Probe answer one. hi hello bye"] * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>")
    if template:
        tok.chat_template = template
    tok.save_pretrained(root)
    return root


def test_a_template_whose_end_of_turn_is_no_token_of_the_vocabulary_is_refused(tmp_path):
    """A ChatML template pasted onto a base tokenizer without <|im_end|> (Mistral-7B-v0.1's, Llama 3's): its end-of-turn
    tokenized in pieces. Before, earlier replies went untrained, the last one trained a stop spelled in pieces, the
    export added none, and the no-stop warning blamed the template's last message. Now one line naming the string, the
    pieces and the fix; the ChatML default on the same vocabulary (it ends a reply with the EOS) and a template that
    ends replies with the EOS while its [INST] is in pieces (Mistral v0.1's own) are not refused."""
    from data.chat import ChatEncoder
    from data.prepare_data import prepare

    pasted = _base_tokenizer(str(tmp_path / "pasted"), CHATML)
    with pytest.raises(ValueError, match=r"ends a reply with '<\|im_end\|>', which tokenizer .* splits into \d+ pieces"
                                         r" .*resize_token_embeddings.*--chat_template chatml") as e:
        _ = ChatEncoder(Tokenizer(pasted)).eot
    assert "\n" not in str(e.value)
    src = _rows(tmp_path / "c.jsonl", [TURNS])
    with pytest.raises(ValueError, match="splits into"):
        prepare([src], str(tmp_path / "out"), pasted, workers=0, log=lambda _: None)
    m = prepare([src], str(tmp_path / "default"), pasted, workers=0, log=lambda _: None, chat_template="chatml")
    assert (m["chat_docs"], m["no_stop_rows"]) == (1, 0)
    for template in (None, MISTRAL_V01, ANSWER_TAGS):  # an <answer>...</answer> wrapper before the EOS: the reply's
        tok = Tokenizer(_base_tokenizer(str(tmp_path / f"ok{hash(template)}"), template))  # text (was refused)
        assert ChatEncoder(tok).eot.tolist() == [tok.eos_id]


def test_an_older_manifest_is_said_again_without_a_crash(tmp_path, capsys):
    """said_again read counts older manifests lack (chat_docs before 2026-11-27, no_stop_rows before 2026-11-28) by
    key: a KeyError stopped rank 0 with a traceback at the start of a run on a folder that trained yesterday."""
    from data.prepare_data import prepare
    from data.store import MANIFEST

    tok = build_tokenizer(str(tmp_path / "tok"), "qwen25")
    out = str(tmp_path / "p")
    prepare([_rows(tmp_path / "c.jsonl", [TURNS])], out, tok, workers=0, log=lambda _: None)
    m = json.load(open(os.path.join(out, MANIFEST)))
    for k in ("chat_docs", "no_stop_rows", "supervised_tokens", "untrained_turns", "dropped_reasoning"):
        m.pop(k, None)
    json.dump(m, open(os.path.join(out, MANIFEST), "w"))
    in_job.said_again(out)
    assert capsys.readouterr().out == ""
