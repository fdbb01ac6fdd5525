"""Which tokenizer a run uses (data/run_tokenizer.py pick_tokenizer): an explicit --tokenizer_name_or_path checked
against the model's, a recorded one gone from this machine, a recorded folder edited since the preparation, and a
tokenizer folder with custom code (data/tokenizer.py)."""

from __future__ import annotations

import json
import shutil
import types

import pytest

WORDS = ["<unk>", "</s>", "apple", "river", "stone", "cloud"]
STAGES = [types.SimpleNamespace(index=0, name="s0", max_seq_length=16, eval={"heldout_samples": 1}, data=None,
                                tasks={}, replay=None, kind="text")]


def _word_tokenizer(path, words: list[str]) -> str:
    from tokenizers import Tokenizer as Raw
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Raw(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>", unk_token="<unk>").save_pretrained(str(path))
    return str(path)


def _prepared(tmp_path, tok: str) -> str:
    """Text documents prepared with `tok` (in-process, no worker)."""
    from data.prepare_data import prepare

    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": " ".join(WORDS[2 + (i + j) % 4] for j in range(12))}) + "\n"
                           for i in range(40)))
    out = tmp_path / "prepared"
    prepare([str(src)], str(out), tok, workers=0, log=lambda _: None)
    return str(out)


def test_an_explicit_tokenizer_is_checked_against_the_models_own(tmp_path):
    """Data prepared with tokenizer A, a model folder shipping B (same size, other ids), and --tokenizer_name_or_path
    A: the check of the model's tokenizer ran only without the flag, so A's ids trained on B's embeddings without a
    word. Refused now in one line that names no flag as an override; a model shipping A plus an added token passes."""
    from data.pipeline import open_run_data

    a = _word_tokenizer(tmp_path / "A", WORDS)
    folder = _prepared(tmp_path, a)
    model = _word_tokenizer(tmp_path / "model", ["<unk>", "</s>", "river", "apple", "stone", "cloud"])
    for given in (None, a):
        with pytest.raises(ValueError, match=r"ships another one \(6 tokens, other ids\)") as e:
            open_run_data(folder, given, 64, STAGES, reset_position_ids=True, model_path=model)
        assert "\n" not in str(e.value) and "no flag overrides" in str(e.value)
    added = _word_tokenizer(tmp_path / "added", [*WORDS, "<|im_start|>"])
    assert open_run_data(folder, a, 64, STAGES, reset_position_ids=True, model_path=added).tokenizer.path == a


def test_a_recorded_tokenizer_gone_from_this_machine_is_the_models_where_the_same(tmp_path, capsys):
    """Prepared on a login node with a tokenizer under /home, trained where that path is not: the run had no
    tokenizer (no stops, template or tokenizer in the export, no passkey) without a word, even with the model folder
    shipping the same files. The model's is used now, with a note; text data beside a model shipping another trains
    without one, with a note; chat data or a stage's tasks are refused in one line naming the flag."""
    from data.pipeline import open_run_data

    login = _word_tokenizer(tmp_path / "login", WORDS)
    folder = _prepared(tmp_path, login)
    model = tmp_path / "model"
    shutil.copytree(login, model)
    shutil.rmtree(login)
    data = open_run_data(folder, None, 64, STAGES, reset_position_ids=True, model_path=str(model))
    assert data.tokenizer is not None and data.tokenizer.path == str(model)
    assert "is not on this machine; the model" in capsys.readouterr().out
    other = _word_tokenizer(tmp_path / "other", ["<unk>", "</s>", "river", "apple", "stone", "cloud"])
    data = open_run_data(folder, None, 64, STAGES, reset_position_ids=True, model_path=other)
    assert data.tokenizer is None and "this run has none" in capsys.readouterr().out
    from data.run_tokenizer import pick_tokenizer  # chat data and tasks, decided from the manifest and stages

    m = json.loads((tmp_path / "prepared" / "manifest.json").read_text())
    chat = {**m, "chunks": [{**m["chunks"][0], "mask": "mask-s00000-c000000.bin"}]}
    tasks = [types.SimpleNamespace(**{**vars(STAGES[0]), "tasks": {"passkey": 0.1}})]
    for manifest, stages, what in ((chat, STAGES, "chat documents"), (m, tasks, "tasks")):
        with pytest.raises(ValueError, match=rf"{what}.* need it: pass --tokenizer_name_or_path") as e:
            pick_tokenizer(folder, manifest, None, other, stages)
        assert "\n" not in str(e.value)


def test_a_recorded_tokenizer_edited_since_says_so(tmp_path, capsys):
    """The recorded folder's tokenizer_config.json edited after preparing (model_max_length), no flag given: refused
    as "--tokenizer_name_or_path X is not the tokenizer ... (X): pass that one", a flag not passed and the same path
    twice. Text data: its vocabulary and EOS / BOS are the recorded ones, so it is used with a note; chat data (whose
    template and special tokens are in those files) is refused saying the files changed."""
    from data.pipeline import open_run_data

    tok = _word_tokenizer(tmp_path / "tok", WORDS)
    folder = _prepared(tmp_path, tok)
    cfg = tmp_path / "tok" / "tokenizer_config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "model_max_length": 131072}))
    assert open_run_data(folder, None, 64, STAGES, reset_position_ids=True).tokenizer.path == tok
    assert "files are not those --dataset_path" in capsys.readouterr().out
    from data.run_tokenizer import pick_tokenizer

    m = json.loads((tmp_path / "prepared" / "manifest.json").read_text())
    chat = {**m, "chunks": [{**m["chunks"][0], "mask": "mask-s00000-c000000.bin"}]}
    with pytest.raises(ValueError, match=r"was prepared with tokenizer .*tok, whose files changed since") as e:
        pick_tokenizer(folder, chat, None, None, STAGES)
    assert "--tokenizer_name_or_path" not in str(e.value)


def test_the_same_files_putting_another_bos_are_refused_in_one_line(tmp_path):
    """A folder prepared under another transformers major: DeepSeek-R1-Distill-Qwen's tokenizer (LlamaTokenizerFast,
    `add_bos_token: true`, no BOS in tokenizer.json's post-processor) puts a BOS before each text under 4.x and none
    under 5.x, from the same files. same_tokenizer said "files" (the BOS compared on the "vocab" path only), so the
    documents trained with a BOS the run's tasks, evaluation and export did not have. Now the recorded BOS is compared
    wherever the tokenizer is taken as the same: one line naming both, for the recorded path and for the model
    folder's copy; the recorded one passes as before."""
    from data.run_tokenizer import pick_tokenizer, same_tokenizer

    tok = _word_tokenizer(tmp_path / "tok", WORDS)  # puts no BOS here (this transformers)
    folder = _prepared(tmp_path, tok)
    m = json.loads((tmp_path / "prepared" / "manifest.json").read_text())
    assert m["bos_id"] is None and same_tokenizer(m, tok) == "files"
    other = {**m, "bos_id": 1}  # as a preparation that put </s>'s id before each text recorded it
    assert same_tokenizer(other, tok) == "bos"
    want = r"^--dataset_path .*prepared was prepared with a BOS before each text \(id 1\), and tokenizer .*tok here puts none"
    with pytest.raises(ValueError, match=want + r" \(its files read under another transformers major") as e:
        pick_tokenizer(folder, other, None, None, STAGES)
    assert "\n" not in str(e.value) and "prepare the data again" in str(e.value)
    model = tmp_path / "model"  # the recorded path gone, the model folder shipping the same files
    shutil.copytree(tok, model)
    gone = {**other, "tokenizer": {**other["tokenizer"], "path": str(tmp_path / "gone")}}
    with pytest.raises(ValueError, match=r"^--dataset_path .*and tokenizer .*model here puts none"):
        pick_tokenizer(folder, gone, None, str(model), STAGES)
    assert pick_tokenizer(folder, m, None, None, STAGES) == tok


def test_a_tokenizer_with_custom_code_is_refused_without_running_it(tmp_path):
    """auto_map AutoTokenizer (Kimi-K2, Qwen-1, GLM-4, InternLM2): transformers 5 asked on stdin whether to run the
    folder's code (a job waited), and run, it looped in prepare_data's forked workers; without a terminal the refusal
    was "not a Hugging Face tokenizer folder (ValueError: ...)". One line now, the code never imported; a model type
    transformers reads natively whatever its auto_map (Qwen2's) still loads."""
    from data.tokenizer import Tokenizer

    folder = tmp_path / "kimi"
    _word_tokenizer(folder, WORDS)  # a tokenizer.json too: transformers still asks for the custom class
    (folder / "tokenization_kimi.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    c = json.loads((folder / "tokenizer_config.json").read_text())
    c.update(auto_map={"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}, tokenizer_class="TikTokenTokenizer")
    (folder / "tokenizer_config.json").write_text(json.dumps(c))
    with pytest.raises(ValueError, match=r"custom tokenizer code is not run here \(auto_map AutoTokenizer "
                                         r"tokenization_kimi.TikTokenTokenizer in tokenizer_config.json\)") as e:
        Tokenizer(str(folder))
    assert "\n" not in str(e.value) and not (tmp_path / "ran").exists()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert Tokenizer(str(folder)).vocab_size == len(WORDS) and not (tmp_path / "ran").exists()


def test_a_hub_id_given_to_prepare_data_names_what_to_pass(tmp_path, monkeypatch):
    """prepare_data reads local files only: `--tokenizer_name_or_path meta-llama/Meta-Llama-3-8B` said "no such file
    or folder" and nothing of how to get one. It says to pass the snapshot folder `hf download` prints."""
    from data.tokenizer import Tokenizer

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"no such file or folder .*`hf download meta-llama/Meta-Llama-3-8B` prints"):
        Tokenizer("meta-llama/Meta-Llama-3-8B")
    with pytest.raises(ValueError) as e:
        Tokenizer(str(tmp_path / "nothing"))
    assert "hf download" not in str(e.value)


def test_renamed_reserved_slots_are_the_same_vocabulary(tmp_path):
    """An SFT tokenizer that renames the model's reserved special slots (Llama 3's <|reserved_special_token_N|> as
    <|im_start|>, Qwen2.5 as DeepSeek-R1-Distill-Qwen's <think>) keeps every regular id: a review found it refused
    the same day, with no override left. Added / special ids are not compared; a regular id that differs still is."""
    from transformers import AutoTokenizer

    from data.pipeline import open_run_data

    def with_specials(path, words, specials):
        tok = AutoTokenizer.from_pretrained(_word_tokenizer(path, words))
        tok.add_special_tokens({"additional_special_tokens": specials})
        tok.save_pretrained(str(path))
        return str(path)

    sft = with_specials(tmp_path / "sft", WORDS, ["<|im_start|>", "<|im_end|>"])
    folder = _prepared(tmp_path, sft)
    model = with_specials(tmp_path / "model", WORDS, ["<|reserved_0|>", "<|reserved_1|>"])
    assert open_run_data(folder, sft, 64, STAGES, reset_position_ids=True, model_path=model).tokenizer.path == sft
    swapped = with_specials(tmp_path / "swapped", ["<unk>", "</s>", "river", "apple", "stone", "cloud"],
                            ["<|reserved_0|>", "<|reserved_1|>"])
    with pytest.raises(ValueError, match="other ids"):
        open_run_data(folder, sft, 64, STAGES, reset_position_ids=True, model_path=swapped)


def test_a_transformers_that_misreads_sentencepiece_folders_is_refused_before_reading(tmp_path, monkeypatch):
    """transformers 5.0-5.22 read a Llama-2-layout folder (tokenizer.model only) with every space as <unk>, and
    prepare_data (which checks no versions: it runs under 4.x) wrote it so, exit 0; now one line naming the range."""
    import importlib.metadata

    from data import tokenizer as tk

    assert "spaces as <unk>" in tk.transformers_misreads("5.0.0") and "transformers>=5.23" in tk.transformers_misreads(
        "5.22.2")
    assert tk.transformers_misreads("5.23.0") is None and tk.transformers_misreads("4.57.6") is None
    path = _word_tokenizer(tmp_path / "tok", ["alpha", "beta"])
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda n: "5.0.0" if n == "transformers" else real(n))
    with pytest.raises(ValueError) as e:
        tk.Tokenizer(path)
    assert "\n" not in str(e.value) and str(e.value).startswith(f"--tokenizer_name_or_path {path}: transformers 5.0.0")
