"""How scripts/prepare_data.py writes each document (audit B3): the separator after a text document of an instruct
tokenizer, special-token strings inside a text, pre-tokenized ids and the BOS, blank texts, a file two --input's name,
and the default number of workers. Small local tokenizers, one process: about a second each."""

from __future__ import annotations

import json
import os

import pytest

from data.prepare_data import main, prepare
from data.store import Prepared
from data.tokenizer import Tokenizer
from tests.unit.data.chat_fixtures import LLAMA3, build_tokenizer
from tests.unit.data.test_prepare_data import _bos_tokenizer, _write_jsonl

QUIET = {"workers": 0, "log": lambda _: None}


def _docs(folder) -> list[list[int]]:
    p = Prepared(str(folder))
    return [p.tokens.read(int(s), int(s) + int(n)).tolist() for s, n in zip(p.starts, p.lens)]


def _texts_and_a_chat(path, texts: list[str]) -> str:
    """A JSONL of text rows and one conversation after them."""
    src = _write_jsonl(path, texts, "text")
    with open(src, "a") as fh:
        fh.write(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}]})
                 + "\n")
    return src


def _llama3_instruct(root, base: bool = False) -> str:
    """Llama-3-Instruct's layout: BOS <|begin_of_text|> put before a text, EOS <|eot_id|> (its tokenizer_config), and
    <|end_of_text|> (128001, the base model's EOS) in the vocabulary. `base`: the base model's (Llama-3.2-1B,
    Meta-Llama-3-8B): EOS <|end_of_text|>, no chat template, the same special tokens."""
    from tokenizers import Tokenizer as Bpe
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    t = Bpe(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    t.train_from_iterator(["a quick brown fox jumps over the lazy dog user assistant"] * 10, trainer)
    t.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                     special_tokens=[("<|begin_of_text|>", 0)])
    tok = PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<|begin_of_text|>",
                                  eos_token="<|end_of_text|>" if base else "<|eot_id|>")
    if not base:
        tok.chat_template = LLAMA3
    tok.save_pretrained(str(root))
    return str(root)


@pytest.mark.parametrize("family", ["llama3", "qwen25"])
def test_text_documents_of_an_instruct_tokenizer_end_with_the_end_of_text_token(tmp_path, family):
    """Llama-3-Instruct's EOS is <|eot_id|>, Qwen2.5-Instruct's <|im_end|>: every text document ended with that chat
    end-of-turn, and --eos_id could not say otherwise. Now the family's end-of-text token (<|end_of_text|>,
    <|endoftext|>), said in a note and recorded as the manifest's eos_id; a conversation still ends with its template's
    end-of-turn; --eos_id chooses the separator."""
    path = _llama3_instruct(tmp_path / "tok") if family == "llama3" else build_tokenizer(str(tmp_path / "tok"), family)
    tok = Tokenizer(path)
    eot, eod = tok.eos_id, tok.hf.convert_tokens_to_ids("<|end_of_text|>" if family == "llama3" else "<|endoftext|>")
    assert tok.sep_id == eod != eot and tok.eos_id == tok.hf.eos_token_id  # eos_id itself unchanged (chat stops)
    src = _texts_and_a_chat(tmp_path / "t.jsonl", ["a quick brown fox", "the lazy dog"])
    lines = []
    m = prepare([src], str(tmp_path / "out"), path, workers=0, log=lines.append)
    a, b, chat = _docs(tmp_path / "out")
    assert a[-1] == b[-1] == eod and eot not in a + b and m["eos_id"] == eod and m["tokenizer"]["eos_id"] == eot
    assert eot in chat and eod not in chat
    assert len([x for x in lines if x.startswith("note: the tokenizer's EOS")]) == 1
    assert main(["--input", src, "--output", str(tmp_path / "o2"), "--tokenizer_name_or_path", path, "--workers", "0",
                 "--eos_id", str(eot)]) == 0
    assert [d[-1] for d in _docs(tmp_path / "o2")[:2]] == [eot, eot]


def test_a_base_or_sentencepiece_tokenizer_keeps_its_eos(tmp_path):
    """A tokenizer whose EOS is its end-of-text (Phi-3's <|endoftext|>, Gemma's <eos>, Mistral's </s>) or a
    sentencepiece model: the separator is its EOS, no note."""
    for family in ("phi3", "gemma", "mistral"):
        tok = Tokenizer(build_tokenizer(str(tmp_path / "tok"), family))
        assert tok.sep_id == tok.eos_id and tok.sep_note is None
    sp = Tokenizer("recipes/base/tiny_passkey256/tokenizer.model")
    assert sp.sep_id == sp.eos_id and sp.sep_note is None


def test_special_token_strings_in_a_text_are_text_and_chat_rows_keep_theirs(tmp_path):
    """`Price: <s>$20</s> now` (HTML) gave Mistral's BOS and EOS mid-document, `<|endoftext|>` in code Qwen's
    separator: control tokens from a page's text. Now they are encoded as text (counted, a note), a text that starts
    with the BOS string keeps one real BOS, and a conversation's template tokens are still parsed."""
    path = build_tokenizer(str(tmp_path / "tok"), "qwen25")
    tok = Tokenizer(path)
    ids = {t: tok.hf.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>")}
    texts = ["joined with <|endoftext|> and chats use <|im_start|>user", "a plain one"]
    src = _texts_and_a_chat(tmp_path / "t.jsonl", texts)
    lines = []
    m = prepare([src], str(tmp_path / "out"), path, workers=0, log=lines.append)
    special, plain, chat = _docs(tmp_path / "out")
    assert special[:-1] == tok.hf(texts[0], add_special_tokens=False, split_special_tokens=True)["input_ids"]
    assert not set(special[:-1]) & set(ids.values()) and special[-1] == ids["<|endoftext|>"]
    assert ids["<|im_start|>"] in chat and ids["<|im_end|>"] in chat
    assert m["special_text_docs"] == 1 and len([x for x in lines if "hold a special-token string" in x]) == 1
    assert tok.direct and tok.encode("<|im_end|>") == [ids["<|im_end|>"]]  # the Rust switch was put back
    # a text that writes its own BOS (Mistral-like, <s> put before a text) keeps one; `<s>` inside is text
    path = _bos_tokenizer(tmp_path / "bos")
    tok = Tokenizer(path)
    src = _write_jsonl(tmp_path / "b.jsonl", ["<s>a quick <s>brown</s> fox"], "text")
    prepare([src], str(tmp_path / "out2"), path, **QUIET)
    (doc,) = _docs(tmp_path / "out2")
    assert doc.count(tok.bos_id) == 1 and doc[0] == tok.bos_id and doc.count(tok.eos_id) == 1 and doc[-1] == tok.eos_id


def test_pre_tokenized_ids_get_the_bos_a_text_gets(tmp_path):
    """{"text": "a quick brown fox"} was [BOS, ..., EOS] and the same document's ids [..., EOS]: now both start with
    the BOS (ids that start with it keep one), counted and said in a note."""
    path = _bos_tokenizer(tmp_path / "tok")
    tok = Tokenizer(path)
    body = tok.encode("a quick brown fox")
    src = tmp_path / "mix.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in ({"text": "a quick brown fox"}, {"input_ids": body},
                                                     {"input_ids": [tok.bos_id, *body]})) + "\n")
    lines = []
    m = prepare([str(src)], str(tmp_path / "out"), path, workers=0, log=lines.append)
    text, ids, own = _docs(tmp_path / "out")
    assert text == ids == own == [tok.bos_id, *body, tok.eos_id] and m["ids_given_bos"] == 1
    assert len([x for x in lines if "pre-tokenized document(s) given the tokenizer's BOS" in x]) == 1


def test_blank_text_documents_are_dropped_and_counted(tmp_path):
    """A whitespace-only text was trained as BOS + whitespace + EOS and not counted; now it is an empty document."""
    path = _bos_tokenizer(tmp_path / "tok")
    src = _write_jsonl(tmp_path / "t.jsonl", ["a quick brown fox", "  \n\t ", ""], "text")
    m = prepare([src], str(tmp_path / "out"), path, **QUIET)
    assert (m["n_docs"], m["empty_docs"]) == (1, 2)


def test_a_file_two_inputs_read_is_refused_in_one_line(tmp_path, capsys):
    """--input web.jsonl twice, or a folder and a file in it, or a link to it: the documents were prepared twice,
    unsaid. Refused naming the file; a deliberate repeat is a stage's weight or upsample."""
    d = tmp_path / "web"
    d.mkdir()
    f = _write_jsonl(d / "web.jsonl", [[1, 2]], "input_ids")
    os.symlink(f, tmp_path / "link.jsonl")
    for pair in ([f, f], [f"web={d}", f], [f, str(tmp_path / "link.jsonl")]):
        args = [a for p in pair for a in ("--input", p)]
        assert main([*args, "--output", str(tmp_path / "out"), "--vocab_size", "10", "--workers", "0"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"both read {f}" in err[0] and "upsample" in err[0], err


def test_default_workers_follow_this_process_cpus_not_the_node(monkeypatch, tmp_path):
    """os.cpu_count() - 1 is the node's: 127 workers (~58 GB of tokenizers) in an `srun -c 8` job on a 128-CPU node.
    Now the process's affinity - 1, at most 32."""
    src = _write_jsonl(tmp_path / "a.jsonl", [[1, 2]], "input_ids")
    got = []
    monkeypatch.setattr("data.prepare_data.prepare", lambda *a, **k: got.append(a[4]))
    monkeypatch.setattr(os, "cpu_count", lambda: 128)
    for cpus, want in ((8, 7), (128, 32), (1, 1)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda _, n=cpus: set(range(n)), raising=False)
        assert main(["--input", src, "--output", str(tmp_path / "o")]) == 0 and got.pop() == want


def test_ids_ending_with_the_tokenizers_own_eos_get_no_separator_after_it(tmp_path):
    """Pre-tokenized ids made as tokenizer(text) + [eos_token_id] with an instruct tokenizer end with <|eot_id|>: since
    the separator became <|end_of_text|> they got a second terminator (a review of the day's change); the in-job stream
    the same."""
    from data.packing import build_token_stream

    path = _llama3_instruct(tmp_path / "tok")
    tok = Tokenizer(path)
    eot, bos = tok.eos_id, tok.bos_id
    src = tmp_path / "ids.jsonl"
    src.write_text(json.dumps({"input_ids": [bos, 5, 6, eot]}) + "\n" + json.dumps({"input_ids": [bos, 7]}) + "\n")
    prepare([str(src)], str(tmp_path / "out"), path, **QUIET)
    assert _docs(tmp_path / "out") == [[bos, 5, 6, eot], [bos, 7, tok.sep_id]]
    t, s = build_token_stream(str(src), tok, tok.vocab_size, str(tmp_path / "c"))
    import numpy as np

    assert np.load(t).tolist() == [bos, 5, 6, eot, bos, 7, tok.sep_id]
