"""Which tokenizer a run uses, and the checks that it is the one the data's ids mean (rank 0, once, at start-up).

data/pipeline.open_run_data asks `pick_tokenizer` on rank 0 (run_on_main) before any rank opens the data:
- `check_model_tokenizer`: a model folder that ships a tokenizer of another vocabulary than the run's (the data's,
  or --tokenizer_name_or_path) is refused in one line, compared by the token of every id both have (`_added_ids`:
  renamed reserved slots are not the vocabulary), since Mistral's and Llama 2's tokenizers both have 32000 tokens;
- `same_tokenizer`: how a tokenizer folder is the one the data was prepared with (its files, or for text-only data
  its vocabulary and EOS; either with the BOS it put before a text, which the same files may not under another
  transformers major: refused, `bos_refusal`);
- `pick_tokenizer`: the given one, else the recorded one, else the model folder's where that is the same one, else
  none for text (a note) and a refusal for chat data or a stage's `tasks`;
- `check_trained_vocab`: a checkpoint's tokenizer (scripts/export_hf.py, scripts/evaluate.py) is the vocabulary it
  trained on (trainer.json `tokenizer_vocab`, its files; else `tokenizer_pieces`, its tokens by id), as a resume
  checks (data/pipeline.open_run_data).
Cost: a hash of the tokenizer files, and two tokenizers loaded where the model folder ships another (~1 s), once.
"""

from __future__ import annotations

import hashlib
import os

from base.log import print0
from data.prepare import ships_tokenizer
from data.store import read_json, tokenizer_identity, vocab_identity
from data.tokenizer import Tokenizer


def check_model_tokenizer(folder: str, m: dict, model_path: str | None, tokenizer_path: str | None = None) -> None:
    """A ValueError (one line) where the model folder ships a tokenizer whose vocabulary is not the run's: the one
    `folder` was prepared with (its manifest `m`), or `tokenizer_path` (--tokenizer_name_or_path: it was trusted, and
    A's ids trained on B's embeddings): the ids would be read as other tokens, every step trained on garbage, without
    a word (Mistral's and Llama 2's tokenizers both have 32000 tokens). Compared by the token of every id both have
    (OpenHermes-2.5-Mistral's 32002 tokens are Mistral's 32000 and two added ones: the same ids); not compared where
    the model folder ships none, the run's is not on this machine (its size alone says nothing of its ids) or the
    files are the same; ids that are added or special tokens on either side are not compared (renamed reserved slots).
    Cost: two tokenizers loaded on rank 0, once (~1 s)."""
    prepared = m.get("tokenizer") or {}
    ours = tokenizer_path or prepared.get("path", "")
    if not (ours and ships_tokenizer(model_path) and os.path.exists(ours) and tokenizer_identity(model_path)
            != (tokenizer_identity(ours) if tokenizer_path else prepared.get("sha256"))):
        return
    try:
        own = Tokenizer(model_path)
    except ValueError:  # the model folder's tokenizer does not load: nothing to compare
        return
    other = Tokenizer(ours)
    mine, theirs = own.pieces(), other.pieces()
    skip = _added_ids(own) | _added_ids(other)  # renamed reserved slots (Llama 3's, a distill's <think>): not the vocabulary
    if any(a != b for i, (a, b) in enumerate(zip(mine, theirs)) if i not in skip):
        what = f"--tokenizer_name_or_path {ours}" if tokenizer_path else \
            f"--dataset_path {folder} was prepared with tokenizer {ours}"
        raise ValueError(f"{what} ({len(theirs)} tokens), and the model {model_path} ships another one ({len(mine)} "
                         "tokens, other ids): its embeddings would read these ids as other tokens, and no flag "
                         f"overrides this: prepare the data again with the model's tokenizer (--tokenizer_name_or_path "
                         f"{model_path}), or, where the model folder's tokenizer files are not the ones its weights "
                         "were trained with, replace them")


def _added_ids(tok: Tokenizer) -> set[int]:
    """Ids of added / special / control tokens: a fine-tune renames such slots while every regular id stays (Llama 3's
    reserved tokens as <|im_start|>, Qwen2.5 as DeepSeek-R1-Distill-Qwen's <think>, Gemma's <unusedN>)."""
    if tok.kind == "sentencepiece":
        sp = tok._sp
        return {i for i in range(tok.vocab_size) if sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i)}
    return set(getattr(tok.hf, "added_tokens_decoder", {}) or {})


def same_tokenizer(m: dict, path: str) -> str | None:
    """How the tokenizer at `path` is the one the data of manifest `m` was prepared with: "files" (tokenizer_identity,
    what the manifest records: every file, the chat template and special tokens too, which a chat row was rendered
    and ended with and the export carries), "vocab" for text-only data (the vocabulary files, vocab_identity as a
    resume compares, and the EOS id is the recorded one: an edited model_max_length changes no id of its documents nor
    of a passkey sample), else None; "bos" where it is so but does not put the BOS the manifest recorded (`bos_id`)
    before a text: a refusal (pick_tokenizer's line), as another EOS is. The same files read under another
    transformers major frame a text otherwise: DeepSeek-R1-Distill-Qwen's LlamaTokenizerFast (`add_bos_token: true`,
    no BOS in tokenizer.json's post-processor) adds one under 4.x, none under 5.x, so a folder prepared under one and
    trained under the other had its documents framed unlike the run's tasks, evaluation and export (add_bos_token is
    what the run's tokenizer adds: model_utils/export_tokenizer.legacy_tokenizer). Cost: a hash of the tokenizer
    files and one load (~1-2 s at 128k tokens, once on rank 0; a folder prepared before `bos_id` was recorded: the
    hash alone for "files")."""
    rec = m["tokenizer"]
    files = tokenizer_identity(path) == rec.get("sha256")
    if not files and (any(c.get("mask") for c in m.get("chunks", ())) or not rec.get("vocab")
                      or vocab_identity(path) != rec["vocab"]):
        return None  # (a folder prepared before its vocabulary was recorded: the files only)
    if files and "bos_id" not in m:
        return "files"
    try:
        tok = Tokenizer(path)
    except ValueError:
        return None
    if not files and tok.eos_id != rec.get("eos_id"):
        return None
    return "bos" if tok.bos_id != m.get("bos_id", tok.bos_id) else "files" if files else "vocab"


def bos_refusal(folder: str, m: dict, path: str) -> str:
    """The line refusing tokenizer `path` for --dataset_path `folder` (manifest `m`) where same_tokenizer says "bos"."""
    def said(i):
        return "none" if i is None else f"id {i}"

    return (f"--dataset_path {folder} was prepared with a BOS before each text ({said(m.get('bos_id'))}), and tokenizer "
            f"{path} here puts {said(Tokenizer(path).bos_id)} (its files read under another transformers major, whose "
            "BOS rule differs: 4.x's LlamaTokenizerFast adds one from tokenizer_config.json's add_bos_token, 5.x from "
            "tokenizer.json's post-processor; or its config edited): prepare the data again in this environment, or "
            "train under the transformers it was prepared with")


def check_trained_vocab(path: str | None, trainer: dict, checkpoint: str, given: bool = False,
                        other: str = "") -> None:
    """A one-line ValueError where the tokenizer at `path` (the one `checkpoint` recorded, or `given` by --tokenizer
    for it) is not the vocabulary it trained on (its trainer.json `trainer`): another revision put at the same path (a
    new cluster's /models), or its ids edited. Its ids would be read as other tokens (an export ships it beside the
    weights, an evaluation scores through it) without a word. The same files (`tokenizer_vocab`,
    data/store.vocab_identity) pass; other bytes pass where what they mean is the same (`tokenizer_pieces`,
    Tokenizer.pieces_identity: a folder re-saved, the run's own export, whose save_pretrained rewrote tokenizer.json);
    a checkpoint from before that was recorded accepts this run's own export (`_own_export`), with a note. `other`:
    the caller's further way out (", or --tokenizer none ..."). Not checked where either is missing (a run without a
    tokenizer, a checkpoint from before it was recorded, a path not there: the callers refuse that in their own
    words). Cost: a hash of the vocabulary files (Llama 3's tokenizer.json: 9 MB); where they differ, one load
    (~1-2 s at 128k tokens)."""
    trained_on, pieces = trainer.get("tokenizer_vocab"), trainer.get("tokenizer_pieces")
    if not (path and trained_on and os.path.exists(path)) or vocab_identity(path) == trained_on:
        return
    what = f"--tokenizer {path}" if given else f"the run's tokenizer {path}"
    if pieces:
        try:
            if Tokenizer(path).pieces_identity() == pieces:
                return  # the same ids in other bytes
        except ValueError:
            pass  # refused below: it does not load, so it is not the one it trained with
        raise ValueError(f"{what} is not the one the run trained with (its tokens by id are not those the checkpoint "
                         "recorded: another revision at that path, or edited since; its ids would read as other "
                         f"tokens): give --tokenizer PATH with the tokenizer the run trained with{other}")
    if _own_export(path, checkpoint):
        print0(f"note: {what}: its files are not those the checkpoint recorded (a checkpoint from before the tokens "
               "by id were recorded), but it is this run's own export (its export.json names a checkpoint of this "
               "run): using it")
        return
    raise ValueError(f"{what} is not the one the run trained with (its vocabulary files are not those the checkpoint "
                     "recorded: another revision at that path, edited or re-saved since; its ids may read as other "
                     "tokens): give --tokenizer PATH with the tokenizer the run trained with (the same files), or "
                     f"this run's own export (RUN/hf_model, scripts/export_hf.py){other}")


def _own_export(path: str, checkpoint: str) -> bool:
    """Whether `path` is an export of a checkpoint of `checkpoint`'s run (model_utils/export.py's export.json names
    one under its checkpoints/ folder by real path, or one of the same name there with the recorded manifest SHA-256:
    the run folder moved since), as model_utils/export._exported_here reads it (data does not import model_utils)."""
    try:
        got = read_json(os.path.join(path, "export.json"))
        was, sha = got.get("checkpoint"), got.get("manifest_sha256")
    except (OSError, ValueError, AttributeError):
        return False
    if not isinstance(was, str) or not was:
        return False
    here = os.path.realpath(os.path.dirname(os.path.abspath(checkpoint.rstrip(os.sep))))
    if os.path.realpath(was).startswith(here + os.sep):
        return True
    try:
        with open(os.path.join(here, os.path.basename(was.rstrip(os.sep)), "MANIFEST.json"), "rb") as fh:
            return bool(sha) and hashlib.sha256(fh.read()).hexdigest() == sha
    except OSError:
        return False


def pick_tokenizer(folder: str, m: dict, given: str | None, model_path: str | None, stages,
                   user: bool = True) -> str | None:
    """The run's tokenizer (rank 0): `given` (--tokenizer_name_or_path) or the one `folder` was prepared with, checked
    against the model's (check_model_tokenizer) and the manifest `m`. A recorded one that is not on this machine
    (prepared on a login node under /home, trained from /scratch) is the model folder's where that is the same
    (same_tokenizer: its files, or for text its vocabulary), with a note; another BOS rule is refused (bos_refusal);
    else chat data or a stage's `tasks` are
    refused (the reply stops, template and padding, the synthetic samples need it), and text trains without one, with
    a note (no passkey or task evaluation, an export without tokenizer files; padding is never used there). `user`:
    `given` is the user's flag (else the in-job preparation's choice, checked as the one the data was prepared with)."""
    if given and not os.path.exists(given):
        Tokenizer(given)  # its one line: no such file or folder
    check_model_tokenizer(folder, m, model_path, given if user else None)
    rec = m.get("tokenizer")
    path = given or (rec and rec["path"])
    if not rec or not path:
        return path or None
    if os.path.exists(path):
        how = same_tokenizer(m, path)
        if how == "bos":
            raise ValueError(bos_refusal(folder, m, path))
        if how is None and given and os.path.realpath(given) != os.path.realpath(rec["path"]):
            raise ValueError(f"--tokenizer_name_or_path {given} is not the tokenizer {folder} was prepared with "
                             f"({rec['path']}): pass that one, or prepare the data again")
        if how is None:
            raise ValueError(f"--dataset_path {folder} was prepared with tokenizer {path}, whose files changed since "
                             "(their SHA-256 is another): put them back, or prepare the data again with it")
        if how == "vocab":
            print0(f"note: tokenizer {path}'s files are not those --dataset_path {folder} was prepared with (changed "
                   "since?); its vocabulary and EOS / BOS are, so its text's ids are the same: using it")
        return path
    here = f"the tokenizer {path} --dataset_path {folder} was prepared with is not on this machine"
    how = same_tokenizer(m, model_path) if ships_tokenizer(model_path) else None
    if how == "bos":
        raise ValueError(bos_refusal(folder, m, model_path))
    if how:
        print0(f"note: {here}; the model {model_path} ships the same one: using it")
        return model_path
    model = (f"the model {model_path} ships " + ("another" if ships_tokenizer(model_path) else "none")) if model_path \
        else "no model folder ships one"
    tasks = [f"stage {s.index} ({s.name})'s tasks" for s in stages if getattr(s, "tasks", None)]
    need = (["its chat documents (reply stops, template, padding)"] if any(c.get("mask") for c in m.get("chunks", ()))
            else []) + tasks
    if need:
        raise ValueError(f"{here} and {model}: {', '.join(need)} need it: pass --tokenizer_name_or_path with a copy "
                         "of it (the same files)")
    print0(f"note: {here} and {model}: this run has none (no passkey or task evaluation, an export without tokenizer "
           "files); pass --tokenizer_name_or_path with a copy of it (the same files) to have them")
    return None
