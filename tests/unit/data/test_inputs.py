"""prepare_data's inputs as users bring them: JSON arrays, damaged compressed files, datasets folders and --loader
folders, hive-style paths, train.py's --dataset_path folders, a snapshot's several splits, --source_field."""

from __future__ import annotations

import gzip
import io
import json
import os

import numpy as np
import pytest

from data import store
from data.prepare_data import main, prepare
from data.readers import Fields
from data.store import Prepared
from tests.unit.data.test_prepare_data import DOCS, _all, _reference, _write_jsonl


def test_a_json_array_is_read_element_by_element_and_a_broken_one_refused_in_one_line(tmp_path, capsys, monkeypatch):
    """A file holding one array of rows (Stanford Alpaca's and LLaMA-Factory's `.json` files) was read as JSONL: its
    first line `[` refused the whole file as "not valid JSON". Elements stream through a small buffer (the chunk
    shrunk here so every element crosses a read); a bad element is named by its index; a cut or malformed array is
    one line; a snapshot's dataset_info.json beside the data is not a row."""
    from data import jsonl

    monkeypatch.setattr(jsonl, "ARRAY_CHUNK", 16)
    # a number the buffer cuts (`12.` of `12.5`) is read whole, whatever the chunk
    numbers = b'[12.5e3, -7, 0.25, {"a": 1}, "s"]'
    for chunk in (1, 2, 3, 5):
        assert [json.loads(x) for x in jsonl.array_elements(io.BytesIO(numbers), chunk)] == [12500.0, -7, 0.25, {"a": 1}, "s"]
    folder = tmp_path / "snap"
    folder.mkdir()
    rows = [{"input_ids": d} for d in DOCS]
    (folder / "data.json").write_text(json.dumps(rows, indent=2))
    (folder / "dataset_info.json").write_text(json.dumps({"description": "x", "features": {}}, indent=2))
    m = prepare([str(folder)], str(tmp_path / "out"), vocab_size=100, workers=0, log=lambda _: None)
    ref, _ = _reference(tmp_path, DOCS)
    assert m["n_docs"] == len(DOCS) and np.array_equal(_all(tmp_path / "out"), ref)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([rows[0], {"other": 1}, rows[1]]))
    assert main(["--input", str(bad), "--output", str(tmp_path / "o2"), "--vocab_size", "100", "--workers", "0"]) == 2
    assert capsys.readouterr().err.startswith(f"error: {bad}[1]: expected")
    for text, why in ((json.dumps(rows)[:-40], "the file ends inside it"), (json.dumps(rows)[:-1], "ends inside the array"), ('[{"input_ids": [1]} {}]', "expected ','"),
                      ('[{"input_ids": [1]}, {"input_ids": [2, }]', "element 1: not valid JSON")):
        bad.write_text(text)
        assert main(["--input", str(bad), "--output", str(tmp_path / "o3"), "--vocab_size", "100", "--workers", "0",
                     "--overwrite"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: {bad}: ") and why in err and "\n" not in err, err


def test_a_truncated_or_damaged_compressed_file_is_one_line_and_never_a_short_corpus(tmp_path, capsys):
    """A .jsonl.zst cut short (a download interrupted) ended early without a word (the half of it lost; with
    --skip_bad_rows one "bad row"); a cut .gz, a file named .gz that is not gzip and a damaged .zst were tracebacks.
    Several zstd frames (pzstd, cat'ed files) are one file."""
    import zstandard

    text = "".join(json.dumps({"input_ids": d}) + "\n" for d in DOCS * 50).encode()
    z, g = zstandard.ZstdCompressor().compress(text), gzip.compress(text)
    cases = {"cut.jsonl.zst": z[: len(z) // 2], "cut.jsonl.gz": g[: len(g) // 2], "notgz.jsonl.gz": b"hello\n",
             "bad.jsonl.zst": z[:8] + b"garbage" * 20}
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        code = main(["--input", str(tmp_path / name), "--output", str(tmp_path / "o"), "--vocab_size", "100",
                     "--workers", "0", "--skip_bad_rows", "--overwrite"])
        err = capsys.readouterr().err.strip()
        assert code == 2 and err.startswith(f"error: {tmp_path / name}: cannot be read (") and "\n" not in err, err
    (tmp_path / "two.jsonl.zst").write_bytes(z + z)
    m = prepare([str(tmp_path / "two.jsonl.zst")], str(tmp_path / "o2"), vocab_size=100, workers=0, log=lambda _: None)
    assert m["n_docs"] == 2 * 50 * len(DOCS)


def test_a_source_field_no_row_has_is_said_and_one_per_row_is_refused(tmp_path, monkeypatch):
    """--source_field with a typo gave every document its file's name without a word (now a note at the end: a
    mixture whose first file lacks the field is fine); a per-row id as the source made the merge quadratic (40,000
    rows: 20 s; 1M: hours): refused past MAX_SOURCES. A folder of many files, each its own source, is not."""
    src = tmp_path / "d.jsonl"
    src.write_text("".join(json.dumps({"input_ids": d, "subset": "a", "id": i}) + "\n" for i, d in enumerate(DOCS)))
    said = []
    prepare([str(src)], str(tmp_path / "o1"), vocab_size=100, workers=0, fields=Fields(source="subsett"),
            log=said.append)
    assert any("--source_field 'subsett': no row of shard 0 has it" in x for x in said), said
    web = tmp_path / "web.jsonl"  # no `subset`: its documents take its name, the others theirs
    web.write_text("".join(json.dumps({"input_ids": d}) + "\n" for d in DOCS[:3]))
    m = prepare([str(web), str(src)], str(tmp_path / "o4"), vocab_size=100, workers=0, fields=Fields(source="subset"),
                log=lambda _: None)
    assert sorted(m["sources"]) == ["a", "web"]
    monkeypatch.setattr(store, "MAX_SOURCES", 5)
    with pytest.raises(ValueError, match=r"^more than 5 sources \('5' and the others"):
        prepare([str(src)], str(tmp_path / "o2"), vocab_size=100, workers=0, fields=Fields(source="id"),
                log=lambda _: None)
    files = []
    for i in range(7):  # seven files, seven sources (each file its own, as the in-job path names them)
        files.append(_write_jsonl(tmp_path / f"f{i}.jsonl", DOCS[i:i + 1]))
    assert len(prepare(files, str(tmp_path / "o3"), vocab_size=100, workers=0, log=lambda _: None)["sources"]) == 7

def test_datasets_folder_and_loader(tmp_path, monkeypatch):
    import datasets

    datasets.Dataset.from_dict({"input_ids": DOCS, "src": ["a", "b"] * 6}).save_to_disk(str(tmp_path / "hf"))
    m = prepare([str(tmp_path / "hf")], str(tmp_path / "o1"), vocab_size=100, workers=0,
                fields=Fields(source="src"), log=lambda _: None)
    assert m["sources"] == ["a", "b"] and m["per_source"]["a"]["docs"] == 6
    ref, _ = _reference(tmp_path, DOCS)
    assert np.array_equal(_all(tmp_path / "o1"), ref)
    csv = tmp_path / "t.csv"
    csv.write_text("body\nhello world\ndef f():\n")
    from data.corpus import build_demo_corpus

    _, model = build_demo_corpus()
    m = prepare([f"web={csv}"], str(tmp_path / "o2"), model, workers=0, loader="csv", fields=Fields(text="body"),
                log=lambda _: None)
    assert m["n_docs"] == 2 and m["sources"] == ["web"]
    book = tmp_path / "book.txt"  # --loader text: a file is one document (it was one a line, blank lines dropped)
    book.write_text("Chapter 1\n\nIt was a dark night.\nThe end.\n")
    m = prepare([str(book)], str(tmp_path / "o3"), model, workers=0, loader="text", log=lambda _: None)
    assert m["n_docs"] == 1 and m["empty_docs"] == 0
    from data import readers

    monkeypatch.setattr(readers, "TEXT_DOC_MAX", 10)  # a file too large to read whole as one document: one line
    with pytest.raises(ValueError, match=r"book.txt: row 0: 0 MB read as one document .*give JSONL.*--skip_bad_rows"):
        prepare([str(book)], str(tmp_path / "o4"), model, workers=0, loader="text", log=lambda _: None)


def test_a_loader_leaves_the_inputs_it_is_not_for_as_they_are(tmp_path):
    """`--input books=DIR_OF_TXT --loader text --input chat.jsonl` (docs/data.md's mix): the loader read every input,
    the chat JSONL too, as one raw-text document of JSON syntax, every token trained, without a word. A JSONL, JSON,
    Parquet file or a datasets folder is read as such whatever --loader says; the loader takes the rest."""
    from data.discover import discover

    books = tmp_path / "books"
    books.mkdir()
    (books / "a.txt").write_text("Chapter 1\n")
    _write_jsonl(books / "extra.jsonl", DOCS[:2])  # a JSONL inside the loader's folder: native too
    (books / "package.json").write_text('{\n  "name": "x"\n}\n')  # a source tree's .json: the loader's (code)
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
                    + "\n")
    units = [u for spec in (f"books={books}", str(chat)) for u in discover(spec, "text")]
    assert [(u.name, os.path.basename(u.path), u.kind) for u in units] == [
        ("books", "a.txt", "hf_load:text"), ("books", "extra.jsonl", "jsonl"), ("books", "package.json", "hf_load:text"),
        ("chat", "chat.jsonl", "jsonl")]


def test_a_loader_folder_and_a_hive_path_are_read_as_the_other_inputs_are(tmp_path):
    """--loader over a folder read every file: a README (refused: "no column 'text'"), a snapshot's .cache, and the
    test split beside the train split (trained on). It now skips metadata and hidden files, refuses several splits,
    and names the source after the folder. A hive-style folder (`lang=en`) was split at its last `=` as `name=PATH`."""
    from data.discover import discover

    folder = tmp_path / "csvs"
    (folder / ".cache" / "huggingface").mkdir(parents=True)
    (folder / ".cache" / "huggingface" / "x.lock").write_text("")
    (folder / "README.md").write_text("---\nlicense: mit\n---\n")
    (folder / "train.csv").write_text("text\nhello\n")
    assert [(u.name, os.path.basename(u.path)) for u in discover(str(folder), "csv")] == [("csvs", "train.csv")]
    (folder / "test.csv").write_text("text\nheld out\n")
    with pytest.raises(ValueError, match="several splits"):
        discover(str(folder), "csv")
    hive = tmp_path / "lang=en"
    hive.mkdir()
    _write_jsonl(hive / "part-0.jsonl", DOCS[:2])
    assert [u.name for u in discover(f"web={hive}")] == ["web"]
    assert [os.path.basename(u.path) for u in discover(f"{hive}/*.jsonl")] == ["part-0.jsonl"]


def test_a_dataset_path_folder_reads_what_prepare_data_reads(tmp_path, monkeypatch):
    """train.py --dataset_path FOLDER (the in-job path) read only its .jsonl / .json files: a .jsonl.gz or a Parquet
    file beside them was dropped without a word. It now reads what prepare_data reads there, one source named after
    the folder, as prepare_data names it (each file was its own source: a stage's `data:` naming the folder found
    none)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from data import prepare as in_job

    monkeypatch.setattr(in_job, "CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "mixed"
    folder.mkdir()
    _write_jsonl(folder / "a.jsonl", DOCS[:4])
    _write_jsonl(folder / "b.jsonl.gz", DOCS[4:8], opener=gzip.open)
    pq.write_table(pa.table({"input_ids": DOCS[8:]}), str(folder / "c.parquet"))
    out, _ = in_job.prepare_in_job(str(folder), None, 100)
    m = Prepared(out).manifest
    assert m["n_docs"] == len(DOCS) and m["sources"] == ["mixed"], m
    with pytest.raises(ValueError, match=r"^--dataset_path \S+: no such file or folder$"):
        in_job.prepare_in_job(str(tmp_path / "none"), None, 100)


def test_a_dataset_snapshot_with_several_splits_is_refused_and_one_split_is_read(tmp_path):
    """A Hugging Face dataset repo's snapshot (`data/train_sft-00000-of-00002.parquet`, `data/test_sft-...`): read
    whole, its test split was trained on, without a word. Refused in one line naming the splits and a pattern for
    one; the pattern reads that split alone (prepare_data's --input and train.py's --dataset_path alike); files
    naming no split beside one that does are one corpus, as before."""
    from data.discover import discover
    from data.jsonl import list_files

    snap = tmp_path / "ultrachat" / "data"
    snap.mkdir(parents=True)
    for f in ("train_sft-00000-of-00002", "train_sft-00001-of-00002", "test_sft-00000-of-00001"):
        _write_jsonl(snap / f"{f}.jsonl", DOCS[:1], "text")
    root = str(tmp_path / "ultrachat")
    for call, flag in ((lambda p: discover(p), "--input"), (list_files, "--dataset_path")):
        with pytest.raises(ValueError, match=rf"{flag} .*ultrachat: its files belong to several splits \(test_sft, "
                                             rf"train_sft, .*\), so the evaluation splits would be trained on: give one split's files, e.g. {flag} "
                                             r"'.*data/train_sft-\*\.jsonl'") as e:
            call(root)
        assert "\n" not in str(e.value)
    pattern = f"{root}/data/train_sft-*.jsonl"
    assert [os.path.basename(u.path) for u in discover(pattern)] == ["train_sft-00000-of-00002.jsonl",
                                                                     "train_sft-00001-of-00002.jsonl"]
    assert {u.name for u in discover(pattern)} == {"train_sft"} and len(list_files(pattern)) == 2
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for f in ("train", "more"):
        _write_jsonl(corpus / f"{f}.jsonl", DOCS[:1], "text")
    assert len(discover(str(corpus))) == 2 and len(list_files(str(corpus))) == 2
