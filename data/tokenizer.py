"""Tokenizers behind one small interface: a sentencepiece `.model` file or a Hugging Face tokenizer folder."""

from __future__ import annotations

import os
import re

from base.log import cause

# How a Hugging Face tokenizer folder is loaded, here and by the export (model_utils/export.py). mistral_format=False:
# with mistral-common installed (vLLM brings it) and a tekken.json in the folder (Mistral Nemo, Small 3.x, Devstral,
# Magistral), transformers 5 picks MistralCommonBackend whatever else is there: no jinja chat template (rows would get
# the ChatML default) and another API (a traceback). The Hugging Face tokenizer gives the same ids, renders the folder's
# template, and is converted from tekken.json where the folder has no tokenizer.json. trust_remote_code=False: a folder's
# own Python (auto_map: Kimi-K2, Qwen-1, GLM-4, InternLM2) is never run; without it transformers 5 asked on stdin (a
# job hung on it), and run, that code looped in prepare_data's forked workers (its refusal names the auto_map)
HF_TOKENIZER = {"mistral_format": False, "trust_remote_code": False}

# Text that exercises whitespace, digits, unicode and code: the direct fast path must give the same ids on it.
_PROBE = ["  Hello world!\n\tdef f(x):  return x**2  # café 東京 1234567 ", "", "a\r\nb   c\u00a0d 🙂"]

# A text document's separator where the tokenizer's EOS is a chat end-of-turn token: the family's end-of-text token,
# which pretraining put between documents (ProLong, trained from Llama-3-8B-Instruct, packs with <|end_of_text|>).
# Read in shipped configs (copies in public repositories, not guessed): Meta-Llama-3-8B-Instruct's tokenizer_config
# has eos_token <|eot_id|> and bos <|begin_of_text|> (openvino.genai's tokenizer_configs.py; vLLM's
# test_get_llama3_eos_token: eos_token_id 128009, generation_config [128001, 128009]; Llama-3.1-Instruct's stop ids
# [128001, 128008, 128009], chujiezheng/chat_templates), the base model's (llama-3-70b-instruct-awq lists it too)
# <|end_of_text|>, 128001; Qwen2-7B-Instruct: eos <|im_end|>, pad <|endoftext|> (Qwen1.5 base: eos <|endoftext|>;
# stop ids [151643, 151645]); Phi-3-mini-4k-instruct ends turns with <|end|> and its end-of-text is <|endoftext|>
# (its tokenizer_config's eos; code setting eos_token "<|end|>" by hand for Phi-3); gemma-2-*-it ships eos <eos> and
# code sets <end_of_turn> by hand (gemma-2-2b-it, id 107). Qwen2.5/Qwen3/SmolLM2 (ChatML), Phi-4-mini and OLMo-2/3
# were not read here: the table maps by token, so a folder whose EOS is one of these and whose vocabulary holds the
# end-of-text token gets it; any other keeps its EOS. <|end_of_text|> second for <|im_end|>: ChatML over Llama 3's
# vocabulary (SmolLM3's layout, not checked).
END_OF_TEXT = {"<|eot_id|>": ("<|end_of_text|>",), "<|im_end|>": ("<|endoftext|>", "<|end_of_text|>"),
               "<|end|>": ("<|endoftext|>",), "<end_of_turn>": ("<eos>",),
               "<|return|>": ("<|endoftext|>",)}  # gpt-oss: eos <|return|> (Harmony's end of a final message), pad
# <|endoftext|> (its shipped tokenizer_config.json, read in a review)


# The strings a conversation rendered with a shipped chat template starts with (after its BOS): how rendered_start
# tells a render from web text or code for a tokenizer without a chat template (a base model's: Llama-3.2-1B/3B and
# Meta-Llama-3-8B base ship none, their vocabulary still has <|start_header_id|> / <|eot_id|> as special tokens),
# counted only where the string is a special token of that vocabulary. Read by rendering every family of
# data/chat_templates/families.json (user-first, system-first, with and without a tool list; the test
# test_turn_starts_cover_every_shipped_template renders them again): <|im_start|> (qwen2/15/25/3/3_coder, smollm2,
# olmo3, phi4(_reasoning), lfm2, hermes_tool_use, chatml_generation), <|start_header_id|> (llama3/31: Llama 3.x),
# <|header_start|> (llama4), <start_of_turn> (gemma2/3), <|turn> (gemma4), <|system|> / <|user|> (phi3, phi4_mini),
# [INST] / [AVAILABLE_TOOLS] (mistral_v03), [SYSTEM_PROMPT] (mistral_small32), <|start|> (gpt_oss),
# <|START_OF_TURN_TOKEN|> (command_r, command_r7b), <|start_of_role|> (granite3/4), <｜User｜> (deepseek_v3/v31),
# [gMASK] (glm46/47), ]~b] (minimax_m2), <SPECIAL_10> (nemotron_nano2), <|system_start|> (apertus), <|begin_system|>
# (apriel16: it always writes a system turn first), <|im_system|> (kimi_k2*: a default system turn first),
# <|begin_of_sentence|> (ernie45), [|system|] / [|user|] (exaone4). Not here: Llama 2 /
# Mistral v0.1-v0.2 / Vicuna / Zephyr / OLMo 2 (turns in plain text: [INST], <|user|> are not special there),
# Seed-OSS (<seed:bos> is its BOS, then `user`), DeepSeek with a system prompt first (plain text after the BOS),
# Hunyuan-A13B (<|startoftext|> is its BOS, then plain text).
TURN_STARTS = ("<|im_start|>", "<|start_header_id|>", "<|header_start|>", "<start_of_turn>", "<|turn>", "<|system|>",
               "<|user|>", "[INST]", "[AVAILABLE_TOOLS]", "[SYSTEM_PROMPT]", "<|start|>", "<|START_OF_TURN_TOKEN|>",
               "<|start_of_role|>", "<｜User｜>", "[gMASK]", "]~b]", "<SPECIAL_10>", "<|system_start|>",
               "<|begin_system|>", "<|im_system|>", "<|begin_of_sentence|>", "[|system|]", "[|user|]")
# --text_specials (data/prepare_args.py): how special-token strings in a text document are read (frame_texts)
SPECIALS_MODES = ("auto", "text", "parse")


def transformers_misreads(found: str | None = None) -> str | None:
    """Why the installed transformers cannot be trusted to read a tokenizer folder, None where it can. transformers
    5.0-5.22 read a folder with only `tokenizer.model` (Llama-2's layout) as a Unigram without its Metaspace: every
    space became <unk> (82 of a 228-token document, prepare_data exiting 0); 4.x (which prepare_data runs under, its
    export checked against) and the floor of base/versions.RANGES (5.23) read it as sentencepiece does. Cost: one
    metadata read."""
    import importlib.metadata

    from base.versions import RANGES, release, spec

    try:
        found = found or importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return None
    have, low = release(found) or (), release(RANGES["transformers"][0])
    if have[:1] == low[:1] and have < low:
        return (f"transformers {found} is not trusted to read tokenizer folders (5.0-5.22 read a Llama-2 "
                f"sentencepiece folder's spaces as <unk>); install '{spec('transformers')}'")
    return None


class Tokenizer:
    """`encode(text) -> list[int]`, `encode_batch(texts)`, `vocab_size`, `eos_id`, `pad_id`, `bos_id`, `decode(ids)`.

    `bos_id`: the token the tokenizer itself puts before a text (`tokenizer(text)` as Hugging Face calls it: Llama 3's
    <|begin_of_text|>, Mistral's <s>, Gemma's <bos>), None where it adds none (Qwen, OLMo, a sentencepiece model
    called plainly). A text document is written BOS + text + `sep_id` (frame_texts), as the model was pretrained
    and as transformers, TRL and torchtitan tokenize; encode() itself adds nothing (chat templates write their own).

    `sep_id`: what ends a text document: `eos_id`, or the family's end-of-text token where `eos_id` is a chat
    end-of-turn (END_OF_TEXT; `sep_note` says so). `eos_id` stays the tokenizer's (chat templates whose stop is the EOS
    use it). `encode_text_batch`: special-token strings in the text are text (`<s>` in HTML, `<|endoftext|>` in code),
    as Meta's Llama 3 reference tokenizer encodes (allowed_special=set()); encode() parses them (rendered templates).
    frame_texts reads a text that starts as a rendered conversation (`rendered_start`) with them parsed (--text_specials
    auto, the default), every text so (parse) or none (text)."""

    bos_id: int | None = None
    # a sentencepiece .model's own BOS, which encode() never adds and bos_id leaves None (the demo's model, trained with
    # bos_id=2, writes none: its data, tasks and caches are built so); prepare_data says so in a note
    file_bos: int | None = None

    direct = False  # a Hugging Face fast tokenizer called through its Rust encode_batch_fast
    sep_note: str | None = None
    specials: tuple[str, ...] = ()  # special-token strings a text may hold (counted; encoded as text)
    _starts: tuple | None = None  # rendered_start's strings, built on first use
    _special_rx = None  # _holding_specials' pattern, built on first use (False: no special strings)

    run_template: str | None = None  # a --chat_template FILE's text (prepare_worker): its turn starts are renders too

    def __init__(self, path: str):
        if not os.path.exists(path):
            hub = re.fullmatch(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*", path)  # org/name: not read from the hub
            raise ValueError(f"--tokenizer_name_or_path {path}: no such file or folder "
                             "(a sentencepiece .model file or a Hugging Face tokenizer folder)" + (
                                 f"; a hub id is read here from a local folder only: `hf download {path}` prints its "
                                 "snapshot folder in the local cache, pass that" if hub else ""))
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
            # control symbols (<s>, </s>) are never read from text: already plain (user-defined ones are: no switch)
            self._plain_batch = self._encode_batch
            self.kind = "sentencepiece"
            self.hf = None  # no chat template: chat rows get the documented ChatML default (data/chat.py)
            self._decode = lambda ids: self._sp.decode(ids)
        else:
            from transformers import AutoTokenizer

            misreads = transformers_misreads()
            if misreads:
                raise ValueError(f"--tokenizer_name_or_path {path}: {misreads}")
            try:
                tok = AutoTokenizer.from_pretrained(path, **HF_TOKENIZER)
            except Exception as e:  # noqa: BLE001 (no tokenizer files, a broken tokenizer.json, ...)
                if custom_code(path):  # (a model type transformers 5 reads natively loads: Qwen2's, InternLM2's)
                    raise ValueError(f"--tokenizer_name_or_path {path}: custom tokenizer code is not run here "
                                     f"({custom_code(path)}): give a folder with a tokenizer.json and no auto_map "
                                     "(the model's -hf / transformers-native release)") from None
                raise ValueError(f"--tokenizer_name_or_path {path}: not a Hugging Face tokenizer folder "
                                 f"({cause(e)}); give one "
                                 "(tokenizer.json / tokenizer_config.json), or a sentencepiece .model file") from None
            self.vocab_size = len(tok)
            self.eos_id = tok.eos_token_id
            self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else self.eos_id
            self._encode = lambda t: tok(t, add_special_tokens=False)["input_ids"]
            self._encode_batch = lambda ts: tok(ts, add_special_tokens=False)["input_ids"]
            backend = getattr(tok, "backend_tokenizer", None)
            # transformers sets the backend's encode_special_tokens to the call's split_special_tokens and leaves it
            # so: put back after each text batch, or a later direct (Rust) call of a chat row read its special tokens
            # as text (a review of the day's change)
            self._plain_batch = lambda ts: _restoring(backend, lambda: tok(ts, add_special_tokens=False,
                                                                           split_special_tokens=True)["input_ids"])
            fast = getattr(backend, "encode_batch_fast", None)
            if fast is not None:  # the Rust tokenizer without offsets: 1.5x faster here (same ids, checked below)
                direct = lambda ts: [e.ids for e in fast(ts, add_special_tokens=False)]  # noqa: E731
                if direct(_PROBE) == self._encode_batch(_PROBE):
                    self._encode_batch, self.direct = direct, True
            self.specials = tuple(t.content for t in getattr(tok, "added_tokens_decoder", {}).values() if t.special)
            if self.direct:  # the same switch on the Rust path, checked on the probe with every special string in it
                split = lambda ts: _split_specials(backend, self._encode_batch, ts)  # noqa: E731
                probe = _PROBE + [" ".join(self.specials[:64])]
                if split(probe) == self._plain_batch(probe):
                    self._plain_batch = split
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
        self.sep_id = self.eos_id
        if self.hf is not None:
            for name in END_OF_TEXT.get(self.hf.eos_token, ()):
                i = self.hf.convert_tokens_to_ids(name)
                if isinstance(i, int) and 0 <= i < self.vocab_size and self.hf.convert_ids_to_tokens(i) == name:
                    self.sep_id = i
                    self.sep_note = (f"the tokenizer's EOS {self.hf.eos_token} ends a chat turn: text documents end "
                                     f"with {name} (id {i}), the end-of-text token its family was pretrained with; "
                                     "--eos_id ID chooses another")
                    break

    def piece(self, i: int) -> str:
        """Token `i`'s string (`<|end_of_text|>`, `</s>`)."""
        return self._sp.id_to_piece(i) if self.kind == "sentencepiece" else self.hf.convert_ids_to_tokens(i)

    def encode_text_batch(self, texts: list[str]) -> list[list[int]]:
        """Encode documents with special-token strings read as text (no control token from a document's content);
        nothing added."""
        return self._plain_batch(texts)

    def rendered_start(self, text: str) -> str | None:
        """The special-token string `text` starts with, after any whitespace, the BOS string and whitespace, where it
        is one a conversation rendered with a chat template starts with: such a text is a render (TRL's and
        `tokenizer(text)` read its tokens as control tokens), not web text or code; None for any other text.

        The strings: the special tokens the tokenizer's chat template writes (and the run's `--chat_template FILE`,
        `run_template`: a text in the format the run trains is a render too), or, for a tokenizer without one (a base
        model's: Llama-3.2-1B base has <|start_header_id|> special and no template), the TURN_STARTS that are special
        tokens of its vocabulary; never the BOS, unk, pad or mask token (WikiText's lines start with <unk>). Why the
        start: every shipped template with control tokens writes one first, after the BOS, while a page or a source
        file rarely starts with one (a template's own test file does: ollama's template/testdata/chatml.gotmpl/user
        is a render, and is read as one); in the middle of a text they are what the text is about (`<s>` in HTML,
        `<|endoftext|>` in tokenizer code) and stay text. Not caught (their turns start in plain text after the BOS):
        Llama 2 / Mistral v0.1-v0.2 / Vicuna / Zephyr, DeepSeek's and Seed-OSS's renders with a system prompt first.
        Decided per document, never by a share of a corpus: every shard and the in-job path decide alike. Cost: one
        bounded slice and one C `startswith` over the strings per document."""
        if self._starts is None:  # once: the BOS strings, the others longest first (the whole token named)
            named = self.hf.special_tokens_map if self.hf is not None else {}
            # the BOS tokenizer(text) puts, and the bos_token of a folder whose tokenizer(text) puts none (a template
            # writes it: a Llama 3 folder without its post-processor)
            bos = tuple(sorted({self.piece(self.bos_id) if self.bos_id is not None else None, named.get("bos_token")}
                               - {None}, key=len, reverse=True))
            tpl = getattr(self.hf, "chat_template", None) if self.hf is not None else None
            tpl = "\n".join(tpl.values()) if isinstance(tpl, dict) else (tpl or "")
            never = {*bos, *(named.get(k) for k in ("unk_token", "pad_token", "mask_token"))}
            pool = [s for s in self.specials if s in tpl] if tpl else [s for s in TURN_STARTS if s in self.specials]
            pool += [s for s in self.specials if s in (self.run_template or "")]  # --chat_template FILE: the run's
            self._starts = bos, tuple(sorted({s for s in pool if s and s not in never}, key=len, reverse=True))
        bos, starts = self._starts
        if not starts:  # a sentencepiece model: none
            return None
        head = text[:256].lstrip()  # a bounded slice: a long document is not copied
        if bos and head.startswith(bos):
            head = head[len(next(b for b in bos if head.startswith(b))):].lstrip()
        return next((s for s in starts if head.startswith(s)), None) if head.startswith(starts) else None

    def _holding_specials(self, texts) -> int:
        """How many of `texts` hold a special-token string: one regex scan a text (an alternation of them all, built
        once). A substring test per special string cost 14 ms for a 10 KB HTML page under a Gemma-like set of 6,000
        (<unusedN>: every "<u" of "<ul>" matched the prefilter), 6x its tokenization; the regex 0.45 ms."""
        if self._special_rx is None:
            alts = sorted((s for s in self.specials if s), key=len, reverse=True)
            self._special_rx = re.compile("|".join(map(re.escape, alts))) if alts else False
        return sum(self._special_rx.search(t) is not None for t in texts) if self._special_rx else 0

    def frame_texts(self, texts: list[str], sep: int | None,
                    specials: str = "auto") -> tuple[list[list[int]], int, int, int]:
        """Text documents as written between documents (data/prepare_data.py; the caller appends `sep` after ids that
        do not end with it): (ids of each, how many hold a special-token string kept as text, how many were read with
        theirs as control tokens, how many end with the tokenizer's EOS string read as their end). `specials`
        (--text_specials): `auto` reads a text that starts as a rendered conversation (`rendered_start`) as
        `tokenizer(text)` and TRL read it, every other text as text; `text` every text as text; `parse` every text as
        control tokens.

        As text: the BOS where the tokenizer puts one, then the text with any special-token string in it encoded as
        text (`<s>` in an HTML page, `<|endoftext|>` in tokenizer code: they were control tokens); a text starting
        with the BOS string gets that one real BOS (a text that writes its own), one ending with `sep`'s string that
        real one (`...</s>`: no second one after it), one ending with the tokenizer's EOS string (`doc +
        tokenizer.eos_token`, the common form, which TRL's add_eos also reads as ended: trl/trainer/sft_trainer.py
        `_prepare_dataset`) `sep` once in its place: an Instruct tokenizer's <|eot_id|> / <|im_end|> was spelled out
        as ~10 text pieces before the separator, in every document (the model learnt to write it). Parsed: every special-token string its control token, the BOS
        put first where the ids do not start with it. An empty or whitespace-only text gives [] (dropped and counted
        as empty; it was trained as BOS + whitespace + EOS). Each text is encoded whole, ~120 bytes of memory per byte
        of it: data/readers.MAX_DOC_BYTES bounds its length before it gets here (and says why not in pieces)."""
        if specials not in SPECIALS_MODES:
            raise ValueError(f"--text_specials {specials!r}: use auto, text or parse")
        kept = [k for k, t in enumerate(texts) if t and not t.isspace()]  # isspace(): a C scan, no copy
        if specials == "auto":
            parsed = [k for k in kept if self.rendered_start(texts[k]) is not None]
        else:
            parsed = kept if specials == "parse" else []
        read = set(parsed)
        as_text = [k for k in kept if k not in read] if parsed else kept
        out: list[list[int]] = [[] for _ in texts]
        bos = self.bos_id
        for k, ids in zip(parsed, self.encode_batch([texts[k] for k in parsed]) if parsed else []):
            out[k] = list(ids) if bos is None or not ids or ids[0] == bos else [bos, *ids]
        bos_s = self.piece(bos) if bos is not None else None
        sep_s = self.piece(sep) if sep is not None and 0 <= sep < self.vocab_size else None
        sep_s = sep_s if sep_s in self.specials else None  # a sentencepiece model never read </s> from text: unchanged
        eos_s = self.piece(self.eos_id) if sep is not None else None
        eos_s = eos_s if eos_s in self.specials and eos_s != sep_s else None
        bodies, ends, eos_ends = [], [], 0
        for k in as_text:
            t = texts[k]
            head = bos_s is not None and t.startswith(bos_s)
            end = next((s for s in (sep_s, eos_s) if s is not None and t.endswith(s)), None)  # (neither ends the other)
            tail = end is not None and len(t) >= (len(bos_s) if head else 0) + len(end)
            bodies.append(t[len(bos_s) if head else 0:len(t) - len(end) if tail else len(t)])
            ends.append(tail)
            eos_ends += tail and end == eos_s
        for k, ids, tail in zip(as_text, self.encode_text_batch(bodies) if bodies else [], ends):
            out[k] = ([bos] if bos is not None else []) + list(ids) + ([sep] if tail else [])
        return out, self._holding_specials(bodies), self._holding_specials([texts[k] for k in parsed]), eos_ends

    def with_bos(self, ids) -> tuple[list[int], bool]:
        """Pre-tokenized ids with the BOS in front where the tokenizer puts one and the ids do not start with it (a text
        gets it: the two were framed differently); whether it was added."""
        if self.bos_id is None or not len(ids) or int(ids[0]) == self.bos_id:
            return ids, False
        return [self.bos_id, *ids], True

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

    def pieces_identity(self) -> str:
        """SHA-256 of what a trained model's ids mean: every id's token (pieces) and the EOS id, not the files' bytes
        (a re-saved folder, an export's tokenizer.json: the same ids in other bytes). The pad id is not in it (masked
        from the loss; a .model file's export names none). Cost: ~0.1 s at 128k tokens, once per tokenizer."""
        if not hasattr(self, "_pieces_sha"):
            import hashlib
            import json

            self._pieces_sha = hashlib.sha256(json.dumps([self.pieces(), self.eos_id]).encode()).hexdigest()
        return self._pieces_sha


def _restoring(backend, call, split: bool | None = None):
    """`call()` (with the backend's encode_special_tokens set to `split` first, unless None) and that switch put back
    as it was afterwards: it is the tokenizer's own state (chat rows in the same worker parse their special tokens;
    transformers leaves it at its last call's split_special_tokens)."""
    was = getattr(backend, "encode_special_tokens", None)
    if split is not None:
        backend.encode_special_tokens = split
    try:
        return call()
    finally:
        if was is not None:
            backend.encode_special_tokens = was


def _split_specials(backend, direct, texts: list[str]) -> list[list[int]]:
    """The Rust path with special-token strings read as text, the switch put back at once."""
    return _restoring(backend, lambda: direct(texts), split=True)


def custom_code(path: str) -> str | None:
    """What names a folder's own tokenizer class (`auto_map AutoTokenizer tokenization_kimi.TikTokenTokenizer in
    tokenizer_config.json`), which transformers loads only by running the folder's Python (trust_remote_code); None
    where nothing does. Read where transformers 5.23 reads it (its config.json's auto_map is not)."""
    import json

    try:
        with open(os.path.join(path, "tokenizer_config.json")) as fh:
            amap = json.load(fh).get("auto_map")
    except (OSError, ValueError, AttributeError):  # no file, not JSON, not an object: AutoTokenizer said so
        return None
    pair = amap.get("AutoTokenizer") if isinstance(amap, dict) else amap  # [slow, fast], or the older form: the pair
    named = [pair] if isinstance(pair, str) else [x for x in pair if x] if isinstance(pair, (list, tuple)) else []
    return f"auto_map AutoTokenizer {named[-1]} in tokenizer_config.json" if named else None


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
