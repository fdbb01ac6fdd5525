"""prepare_data's inputs as users bring them, continued: a folder's file spellings, hidden copies and nested datasets
folders; shards that saw different inputs; pre-tokenized tables with labels; a document ending with its own EOS; lone
surrogates; a file rewritten at its size; pre-tokenized data with no separator; a sentencepiece model's BOS; a BOM."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import os
import shutil

import numpy as np
import pytest

from data.discover import discover
from data.prepare_data import main, merge, prepare
from data.store import Prepared
from tests.unit.data.test_prepare_data import _SP, _all, _bos_tokenizer, _write_jsonl

QUIET = {"workers": 0, "log": lambda _: None}


def _docs(folder) -> list[list[int]]:
    p = Prepared(str(folder))
    return [p.tokens.read(int(s), int(s + n)).tolist() for s, n in zip(p.starts, p.lens)]


def test_a_folder_reads_every_jsonl_spelling_skips_hidden_copies_and_names_what_it_cannot_read(tmp_path, capsys):
    """Only `.jsonl[.gz|.zst]` / `.json` / `.parquet` spelt in lower case were read: `.ndjson`, `.JSONL`, `.jsonl.bz2`
    and `.jsonl.xz` were dropped without a word, a notebook's `.ipynb_checkpoints/` copy was read (a file trained
    twice) and a save_to_disk folder inside was read as JSONL rows of its state.json. Files that look like data but
    that nothing reads are refused by name."""
    import datasets

    corpus = tmp_path / "corpus"
    (corpus / ".ipynb_checkpoints").mkdir(parents=True)
    rows = {"a.jsonl": [[1]], "b.ndjson": [[2]], "c.JSONL": [[3]], "d.jsonl.bz2": [[4]], "e.jsonl.xz": [[5]],
            "f.jsonl.gzip": [[6]], ".ipynb_checkpoints/a-checkpoint.jsonl": [[1]]}
    openers = {".bz2": bz2.open, ".xz": lzma.open, "gzip": gzip.open}
    for name, docs in rows.items():
        _write_jsonl(corpus / name, docs, opener=next((o for e, o in openers.items() if name.endswith(e)), open))
    datasets.Dataset.from_dict({"input_ids": [[7], [8]]}).save_to_disk(str(corpus / "web"))
    units = discover(str(corpus))
    assert [(u.kind, os.path.basename(u.path)) for u in units] == [
        ("jsonl", "a.jsonl"), ("jsonl", "b.ndjson"), ("jsonl", "c.JSONL"), ("jsonl", "d.jsonl.bz2"),
        ("jsonl", "e.jsonl.xz"), ("jsonl", "f.jsonl.gzip"), ("hf_disk", "web")] and {u.name for u in units} == {"corpus"}
    prepare([str(corpus)], str(tmp_path / "out"), vocab_size=100, eos_id=0, **QUIET)
    assert _docs(tmp_path / "out") == [[i, 0] for i in range(1, 9)]
    for junk in ("x.arrow", "sub/y.jsonl.lz4", "z.zip"):
        os.makedirs(os.path.dirname(corpus / junk), exist_ok=True)
        (corpus / junk).write_bytes(b"\x00")
    capsys.readouterr()  # datasets' progress bars
    assert main(["--input", str(corpus), "--output", str(tmp_path / "o2"), "--vocab_size", "100", "--workers", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "cannot read ['sub/y.jsonl.lz4', 'x.arrow', 'z.zip']" in err, err


def test_shards_that_saw_different_inputs_are_not_merged(tmp_path):
    """Each shard assigns files from its own view of the inputs: a file still growing when shard 0 ran and complete
    when shard 1 did moved files between shards (read twice or never) and the merge wrote the index regardless."""
    files = [_write_jsonl(tmp_path / f"p{i}.jsonl", [[i + 1] * (10 + 30 * i)]) for i in range(3)]
    out = str(tmp_path / "out")
    prepare(files, out, vocab_size=100, shard=(0, 2), **QUIET)
    _write_jsonl(tmp_path / "p0.jsonl", [[1] * 400])  # now the largest: shard 1 takes p2 too (read twice), none p0
    prepare(files, out, vocab_size=100, shard=(1, 2), **QUIET)
    with pytest.raises(ValueError, match=r"shards \[0\] vs \[1\] saw different inputs .*read by several: \[.*p2.jsonl'"
                                         r"\]\): once the inputs are final, run every shard again with --overwrite"):
        merge(out, log=lambda _: None)


def test_a_pretokenized_table_with_labels_trains_its_labelled_tokens(tmp_path, capsys):
    """axolotl's preprocess / LLaMA-Factory's tokenized output / TRL's processed rows (input_ids, attention_mask,
    labels -100 over the prompt) were prepared from their input_ids alone (the prompt trained, without a word), then
    refused: now the labels are the loss mask (data/ids_rows.py), the tokens labelled -100 not trained."""
    import datasets

    ids, labels = [[5, 6, 7, 8, 3]], [[-100, -100, 7, 8, 3]]
    datasets.Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * 5], "labels": labels}).save_to_disk(
        str(tmp_path / "axo"))
    (tmp_path / "axo.jsonl").write_text(json.dumps({"input_ids": ids[0], "labels": labels[0]}) + "\n")
    capsys.readouterr()  # datasets' progress bars
    for src in (tmp_path / "axo", tmp_path / "axo.jsonl"):
        manifest = prepare([str(src)], str(tmp_path / f"o_{src.name}"), vocab_size=100, eos_id=3, **QUIET)
        assert manifest["supervised_tokens"] == 3 and manifest["chat_docs"] == 1
    # labels equal to the ids (run_clm's group_texts: result["labels"] = result["input_ids"].copy()) hide nothing:
    # every token trains, as before the refusal (the review: such a table was refused whole)
    datasets.Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * 5], "labels": ids}).save_to_disk(
        str(tmp_path / "clm"))
    (tmp_path / "clm.jsonl").write_text(json.dumps({"input_ids": ids[0], "labels": ids[0]}) + "\n")
    for src in (tmp_path / "clm", tmp_path / "clm.jsonl"):
        prepare([str(src)], str(tmp_path / f"o_{src.name}"), vocab_size=100, eos_id=3, **QUIET)
        assert _docs(tmp_path / f"o_{src.name}") == ids


def test_a_document_ending_with_its_eos_gets_no_second_one(tmp_path):
    """The EOS was appended whatever the ids ended with: `<s>a quick brown fox</s>` became [..., </s>, </s>]."""
    src = _write_jsonl(tmp_path / "ids.jsonl", [[5, 6, 1], [7, 8]])
    prepare([src], str(tmp_path / "o1"), vocab_size=100, eos_id=1, **QUIET)
    assert _docs(tmp_path / "o1") == [[5, 6, 1], [7, 8, 1]]
    tok = _bos_tokenizer(tmp_path / "tok")
    text = _write_jsonl(tmp_path / "t.jsonl", ["<s>a quick brown fox</s>", "the lazy dog"], key="text")
    prepare([text], str(tmp_path / "o2"), tok, **QUIET)
    own, plain = _docs(tmp_path / "o2")
    assert own[-1] == plain[-1] and own[-2] != own[-1] and own.count(own[-1]) == 1


def test_a_lone_surrogate_is_a_bad_row_not_a_traceback(tmp_path, capsys):
    """`{"text": "bad \\ud800 x"}` (a web crawl's cut emoji) reached the tokenizer: a TypeError traceback from a
    worker process, with --skip_bad_rows too. A chat row's strings the same; a pair (an emoji) is fine."""
    src = tmp_path / "a.jsonl"
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x \ud83d"}]}
    src.write_text("\n".join(json.dumps(r) for r in ({"text": "ok \ud83d\ude00"}, {"text": "bad \ud800 x"}, chat)) + "\n")
    args = ["--input", str(src), "--tokenizer_name_or_path", _SP, "--workers", "0"]
    assert main([*args, "--output", str(tmp_path / "o1")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {src}:2: a lone UTF-16 surrogate") and "\n" not in err, err
    assert main([*args, "--output", str(tmp_path / "o2"), "--skip_bad_rows"]) == 0
    m = Prepared(str(tmp_path / "o2")).manifest
    assert m["bad_rows"] == 2 and m["n_docs"] == 1 and m["bad_examples"][1].startswith(f"{src}:3: a lone")


def test_a_file_rewritten_at_its_size_is_not_taken_as_prepared(tmp_path):
    """A finished --output was kept for an input rewritten at the same size (the identity was kind + path + size):
    the old tokens stayed and the log read as prepared."""
    src = _write_jsonl(tmp_path / "a.jsonl", [[1, 2, 3]])
    out = str(tmp_path / "out")
    prepare([src], out, vocab_size=100, **QUIET)
    _write_jsonl(tmp_path / "a.jsonl", [[4, 5, 6]])
    st = os.stat(src)
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(ValueError, match=r"holds shard 0 of another preparation \(differs in \['units'\]\)"):
        prepare([src], out, vocab_size=100, **QUIET)
    prepare([src], out, vocab_size=100, overwrite=True, **QUIET)
    assert _all(out).tolist() == [4, 5, 6]
    # the same bytes with a new mtime (cp without -p, a re-staging to node-local scratch at a requeue) is the same
    # input: prepared, kept (by mtime, the review found, a half-done preparation was refused and started over)
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 5 * 10**9))
    prepare([src], out, vocab_size=100, **QUIET)
    assert _all(out).tolist() == [4, 5, 6]
    (tmp_path / "job2").mkdir()  # and staged again to another job's scratch folder (the second review)
    moved = shutil.copy(src, tmp_path / "job2" / "a.jsonl")
    prepare([str(moved)], out, vocab_size=100, **QUIET)
    assert _all(out).tolist() == [4, 5, 6]


def test_notes_pretokenized_data_with_no_separator_and_a_sentencepiece_models_unwritten_bos(tmp_path):
    """Pre-tokenized documents with neither a tokenizer nor --eos_id ran into each other without a word; a
    sentencepiece .model writes no BOS (the same model as a Hugging Face folder does), without a word either. The
    demo's data is built with its .model and no BOS, so it is said, not changed."""
    from data.tokenizer import Tokenizer

    said: list[str] = []
    src = _write_jsonl(tmp_path / "a.jsonl", [[1, 2], [3]])
    prepare([src], str(tmp_path / "o1"), vocab_size=100, workers=0, log=said.append)
    assert any(s.startswith("note: no EOS appended between the 2 pre-tokenized documents") and "--eos_id" in s
               for s in said), said
    said.clear()
    text = _write_jsonl(tmp_path / "t.jsonl", ["def f(x):"], key="text")
    prepare([text], str(tmp_path / "o2"), _SP, workers=0, log=said.append)
    tok = Tokenizer(_SP)
    assert tok.bos_id is None and tok.file_bos == 2 and _all(tmp_path / "o2").tolist() == tok.encode("def f(x):") + [3]
    assert [s for s in said if "without its BOS (id 2)" in s and "Hugging Face tokenizer folder" in s], said


def test_loader_text_drops_a_utf8_bom(tmp_path):
    """--loader text kept a Windows tool's BOM (U+FEFF) as the first trained character of every such file."""
    from data.tokenizer import Tokenizer

    (tmp_path / "a.txt").write_bytes("\ufeffdef f(x):\n    return x".encode())
    prepare([str(tmp_path / "a.txt")], str(tmp_path / "out"), _SP, loader="text", **QUIET)
    tok = Tokenizer(_SP)
    assert np.array_equal(_all(tmp_path / "out"), tok.encode("def f(x):\n    return x") + [tok.eos_id])


@pytest.mark.parametrize("mark,text", [("RUN_LOCK", "host"), ("checkpoints/LATEST", "step_3"),
                                       ("metrics.jsonl", '{"step": 1, "loss": 2.5}\n'),  # a finished run: lock gone
                                       ("manifest.json", '{"format": "ulysses-longtrain/prepared-v1", "n_docs": 2}'),
                                       ("shard-00000-of-00001.json", '{"chunks": [], "n_docs": 0}'),
                                       ("plan-s00000.json", '{"units": [], "inputs": "x"}')])
def test_a_run_or_prepared_folder_inside_the_data_folder_is_skipped_and_said_once(tmp_path, monkeypatch, capsys, mark,
                                                                                  text):
    """`train.py --dataset_path D --output_dir D/run` worked once; every later start (a requeue) read the run's own
    metrics.jsonl, checkpoints/*/MANIFEST.json and eval/*.json as rows and exited 2 (not valid JSON). A subfolder
    that is a run's output folder or a prepared folder is skipped, said once; one that merely holds files of those
    names (Beam's shard-00000-of-00001.json rows, an export's manifest.json) is data (the third review)."""
    from data import prepare as in_job

    monkeypatch.setattr(in_job, "CACHE", str(tmp_path / "cache"))
    data = tmp_path / "D"
    (data / "run" / "checkpoints" / "step_3").mkdir(parents=True)
    (data / "run" / "eval").mkdir()
    _write_jsonl(data / "a.jsonl", [[1, 2], [3]])
    (data / "run" / mark).write_text(text)
    (data / "run" / "checkpoints" / "step_3" / "MANIFEST.json").write_text('{"files": {}}')
    (data / "run" / "eval" / "stage0.json").write_text('{"loss": 1.0}')
    if mark != "metrics.jsonl":
        (data / "run" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.5}\n')
        (data / "run" / "eval" / "stage0.json").unlink()
        (data / "run" / "eval").rmdir()
        (data / "run" / "checkpoints" / "step_3" / "MANIFEST.json").unlink()
        (data / "run" / "checkpoints" / "step_3").rmdir()
        if mark != "checkpoints/LATEST":
            (data / "run" / "checkpoints").rmdir()
    for _ in range(2):
        assert [u.path for u in discover(str(data), flag="--dataset_path")] == [str(data / "a.jsonl")]
    out, _ = in_job.prepare_in_job(str(data), None, 100)
    assert Prepared(out).manifest["n_docs"] == 2
    said = [ln for ln in capsys.readouterr().out.splitlines() if "skipping run/" in ln]
    assert len(said) == 1 and said[0].startswith(f"--dataset_path {data}: skipping run/"), said
    # --loader's own walk (a folder of .txt books with the run inside) leaves it out too
    (data / "book.txt").write_text("a book")
    assert sorted(u.path for u in discover(str(data), loader="text")) == [str(data / "a.jsonl"), str(data / "book.txt")]


def test_files_named_as_ours_in_a_data_folder_are_data(tmp_path):
    """Beam / TF write `shard-00000-of-00002.json` rows, export tools a manifest.json beside their data: read."""
    data = tmp_path / "D"
    for sub in ("ocr", "chat"):
        (data / sub).mkdir(parents=True)
    _write_jsonl(data / "ocr" / "shard-00000-of-00002.json", [[1, 2]])
    _write_jsonl(data / "ocr" / "shard-00001-of-00002.json", [[4]])  # the whole split (one alone: refused, missing)
    _write_jsonl(data / "chat" / "train.jsonl", [[3]])
    (data / "chat" / "manifest.json").write_text('{"files": ["train.jsonl"]}')
    got = [u.path for u in discover(str(data), flag="--dataset_path")]
    assert {str(data / "chat" / "train.jsonl"), str(data / "ocr" / "shard-00000-of-00002.json")} <= set(got), got


def test_an_output_inside_an_input_folder_is_refused(tmp_path, capsys):
    """`--input pd/sub --output pd/sub/prepared`: the second run read the first one's files as rows and was refused;
    --overwrite then deleted the finished preparation and failed. Refused in one line, before anything is written."""
    sub = tmp_path / "pd" / "sub"
    sub.mkdir(parents=True)
    _write_jsonl(sub / "a.jsonl", [[1, 2], [3]])
    for inp, out in ((sub, sub / "prepared"), (f"docs={sub}", sub / "prepared"), (sub, sub), (tmp_path, sub / "o")):
        assert main(["--input", str(inp), "--output", str(out), "--vocab_size", "100", "--workers", "0"]) == 2
        err = capsys.readouterr().err.strip()
        assert err == (f"error: --output {out} is inside --input {inp} (a later run would read this one's files as "
                       "rows): give an --output outside the input folder"), err
        assert not os.path.exists(sub / "prepared")
    assert main(["--input", str(sub), "--output", str(tmp_path / "pd" / "p"), "--vocab_size", "100", "--workers",
                 "0"]) == 0


def test_a_bad_row_in_job_names_a_fix_train_py_takes(tmp_path, monkeypatch, capsys):
    """train.py's in-job preparation refused a bad row with "(--skip_bad_rows skips and counts such rows)", a flag
    train.py rejects. It names prepare_data's command and --dataset_path instead; prepare_data keeps its wording."""
    from data import prepare as in_job

    monkeypatch.setattr(in_job, "CACHE", str(tmp_path / "cache"))
    src = tmp_path / "d.jsonl"
    src.write_text('{"input_ids": [1, 2]}\n{"input_ids": [3\n')
    with pytest.raises(ValueError) as e:
        in_job.prepare_in_job(str(src), None, 100)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{src}:2: ") and "(--skip_bad_rows skips" not in msg, msg
    assert msg.endswith(f"(to skip and count such rows: python scripts/prepare_data.py --input {src} --output DIR "
                        "--vocab_size 100 --skip_bad_rows, then pass --dataset_path DIR)"), msg
    assert main(["--input", str(src), "--output", str(tmp_path / "o"), "--vocab_size", "100", "--workers", "0"]) == 2
    reason = msg.split(" (to skip")[0]
    assert capsys.readouterr().err.strip() == f"error: {reason} (--skip_bad_rows skips and counts such rows)"
    assert main(["--input", str(src), "--output", str(tmp_path / "o2"), "--vocab_size", "100", "--workers", "0",
                 "--skip_bad_rows"]) == 0
