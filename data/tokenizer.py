"""Tokenizers behind one small interface: a sentencepiece `.model` file or a Hugging Face tokenizer folder."""

from __future__ import annotations

import os

from base.log import cause

# How a Hugging Face tokenizer folder is loaded, here and by the export (model_utils/export.py). mistral_format=False:
# with mistral-common installed (vLLM brings it) and a tekken.json in the folder (Mistral Nemo, Small 3.x, Devstral,
# Magistral), transformers 5 picks MistralCommonBackend whatever else is there: no jinja chat template (rows would get
# the ChatML default) and another API (a traceback). The Hugging Face tokenizer gives the same ids, renders the folder's
# template, and is converted from tekken.json where the folder has no tokenizer.json.
HF_TOKENIZER = {"mistral_format": False}

# Text that exercises whitespace, digits, unicode and code: the direct fast path must give the same ids on it.
_PROBE = ["  Hello world!\n\tdef f(x):  return x**2  # café 東京 1234567 ", "", "a\r\nb   c\u00a0d 🙂"]


class Tokenizer:
    """`encode(text) -> list[int]`, `encode_batch(texts)`, `vocab_size`, `eos_id`, `pad_id`, `bos_id`, `decode(ids)`.

    `bos_id`: the token the tokenizer itself puts before a text (`tokenizer(text)` as Hugging Face calls it: Llama 3's
    <|begin_of_text|>, Mistral's <s>, Gemma's <bos>), None where it adds none (Qwen, OLMo, a sentencepiece model
    called plainly). A text document is written BOS + text + EOS (data/prepare_data.py), as the model was pretrained
    and as transformers, TRL and torchtitan tokenize; encode() itself adds nothing (chat templates write their own)."""

    bos_id: int | None = None
    # a sentencepiece .model's own BOS, which encode() never adds and bos_id leaves None (the demo's model, trained with
    # bos_id=2, writes none: its data, tasks and caches are built so); prepare_data says so in a note
    file_bos: int | None = None

    direct = False  # a Hugging Face fast tokenizer called through its Rust encode_batch_fast

    def __init__(self, path: str):
        if not os.path.exists(path):
            raise ValueError(f"--tokenizer_name_or_path {path}: no such file or folder "
                             "(a sentencepiece .model file or a Hugging Face tokenizer folder)")
        self.path = path
        if os.path.isfile(path):
            import sentencepiece as spm

            try:
                self._sp = spm.SentencePieceProcessor(model_file=path)
            except Exception as e:  # noqa: BLE001 (sentencepiece's RuntimeError on a file that is no model)
                raise ValueError(f"--tokenizer_name_or_path {path}: not a sentencepiece .model file ({e}); give one, or "
                                 "a Hugging Face tokenizer folder") from None
            self.vocab_size = self._sp.get_piece_size()
            self.eos_id = self._sp.eos_id()
            self.file_bos = self._sp.bos_id() if self._sp.bos_id() >= 0 else None
            pad = self._sp.pad_id()
            self.pad_id = pad if pad >= 0 else self.eos_id
            self._encode = lambda t: self._sp.encode(t)
            # one thread: parallelism comes from prepare_data's worker processes, one core each
            self._encode_batch = lambda ts: self._sp.encode(ts, num_threads=1)
            self.kind = "sentencepiece"
            self.hf = None  # no chat template: chat rows get the documented ChatML default (data/chat.py)
            self._decode = lambda ids: self._sp.decode(ids)
        else:
            from transformers import AutoTokenizer

            try:
                tok = AutoTokenizer.from_pretrained(path, **HF_TOKENIZER)
            except Exception as e:  # noqa: BLE001 (no tokenizer files, a broken tokenizer.json, ...)
                raise ValueError(f"--tokenizer_name_or_path {path}: not a Hugging Face tokenizer folder "
                                 f"({cause(e)}); give one "
                                 "(tokenizer.json / tokenizer_config.json), or a sentencepiece .model file") from None
            self.vocab_size = len(tok)
            self.eos_id = tok.eos_token_id
            self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else self.eos_id
            self._encode = lambda t: tok(t, add_special_tokens=False)["input_ids"]
            self._encode_batch = lambda ts: tok(ts, add_special_tokens=False)["input_ids"]
            fast = getattr(getattr(tok, "backend_tokenizer", None), "encode_batch_fast", None)
            if fast is not None:  # the Rust tokenizer without offsets: 1.5x faster here (same ids, checked below)
                direct = lambda ts: [e.ids for e in fast(ts, add_special_tokens=False)]  # noqa: E731
                if direct(_PROBE) == self._encode_batch(_PROBE):
                    self._encode_batch, self.direct = direct, True
            self.kind = "hf"
            self.hf = tok  # its chat template renders conversations (data/chat.py)
            if not tok.chat_template:
                tok.chat_template = _processor_template(path)
            plain, full = tok("a", add_special_tokens=False)["input_ids"], tok("a")["input_ids"]
            if len(full) > len(plain) and full[1:1 + len(plain)] == plain:  # a token put before the text: its BOS
                self.bos_id = full[0]
            self._decode = lambda ids: tok.decode(ids)
        if self.eos_id is None or self.eos_id < 0:
            raise ValueError(f"tokenizer {path} has no end-of-sequence token; documents cannot be separated")

    def encode(self, text: str) -> list[int]:
        return self._encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Encode many documents in one call (no special tokens added)."""
        return self._encode_batch(texts)

    def decode(self, ids) -> str:
        return self._decode(list(ids))

    def pieces(self) -> list[str]:
        """Every id's token string, in id order: two tokenizers with the same pieces give the same ids (Llama 3.1's
        base and Instruct tokenizers do, their EOS aside; Mistral's and Llama 2's, both 32000 tokens, do not)."""
        if self.kind == "sentencepiece":
            return [self._sp.id_to_piece(i) for i in range(self.vocab_size)]
        return self.hf.convert_ids_to_tokens(list(range(self.vocab_size)))


def _processor_template(path: str):
    """The chat template a model folder ships beside its tokenizer in `chat_template.json` (a multimodal model's
    processor file; Mistral-Small-3.1-24B-Instruct-2503 has its only template there: llama.cpp PR 12460), which
    AutoTokenizer (transformers 5.23 here) does not read: without it a chat row would be rendered with the ChatML
    default, a format the model never saw. None where there is none."""
    f = os.path.join(path, "chat_template.json")
    if not os.path.isfile(f):
        return None
    import json

    try:
        with open(f) as fh:
            value = json.load(fh).get("chat_template")
    except (ValueError, AttributeError) as e:
        raise ValueError(f"{f}: not a JSON object with a chat_template ({cause(e)}): fix it, or delete it") from None
    if isinstance(value, list):  # named templates, as tokenizer_config.json lists them
        value = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
    if not (isinstance(value, str) and value.strip() or isinstance(value, dict) and value
            and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())):
        raise ValueError(f"{f}: chat_template is {type(value).__name__}, not a template (a string, or named ones): "
                         "fix it, or delete it")
    return value
