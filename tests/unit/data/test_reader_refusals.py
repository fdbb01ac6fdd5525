"""What a folder or a row holds that was read wrong without a word: raw text files beside JSONL (dropped), a file beside
its own compressed copy (read twice), a compressed input past the in-job limit (tokenized on rank 0 while the GPUs
waited) and a row whose text lies under another field (The Stack's `content`: the fix named dropped every row)."""

from __future__ import annotations

import gzip
import json
import lzma
import shlex

import pytest

from data.discover import discover
from data.prepare_data import main, prepare
from tests.unit.data.test_data import _word_tokenizer
from tests.unit.data.test_prepare_data import _write_jsonl

ARGS = ["--vocab_size", "100", "--workers", "0"]


def _err(capsys, argv: list[str]) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err, err
    return err


def test_a_folders_text_files_beside_jsonl_are_refused_by_name(tmp_path, capsys):
    """corpus/ with book0.txt, notes.md, page.html and extra.jsonl prepared extra.jsonl's one row: the books were
    dropped without a word. They are refused by name (a snapshot's LICENSE.txt / README.md are not); a folder of only
    .txt keeps its line; --loader text reads them all, a file a document."""
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    for name in ("book0.txt", "notes.md", "sub/page.html", "LICENSE.txt", "README.md", "CITATION.md"):
        (corpus / name).write_text("The quick brown fox. " * 20)
    _write_jsonl(corpus / "extra.jsonl", [[1, 2]])
    for name in ("README_zh.md", "LICENSE-CODE.md", "SHA256SUMS.txt", "CONTRIBUTING.md", "docs/usage.md"):
        (corpus / name).parent.mkdir(exist_ok=True)  # a snapshot's papers (a review: each refused the folder)
        (corpus / name).write_text("# about\n")
    err = _err(capsys, ["--input", str(corpus), "--output", str(tmp_path / "o"), *ARGS])
    # a snapshot's papers pass (docs/, README_zh.md, ...); a document in a sibling folder is named (a review: it was
    # passed over after this morning's first fix), as changelings.txt is (no paper's name, only its start)
    assert "cannot read ['book0.txt', 'notes.md', 'sub/page.html']: " in err and "--loader BUILDER (text:" in err, err
    (corpus / "changelings.txt").write_text("a story")
    assert "changelings.txt" in _err(capsys, ["--input", str(corpus), "--output", str(tmp_path / "o"), *ARGS])
    (corpus / "changelings.txt").unlink()
    assert sorted(u.path.split("/")[-1] for u in discover(str(corpus), loader="text")) == sorted([
        "CITATION.md", "LICENSE.txt", "book0.txt", "extra.jsonl", "notes.md", "page.html", "README_zh.md",
        "LICENSE-CODE.md", "SHA256SUMS.txt", "CONTRIBUTING.md", "usage.md"])
    (corpus / "extra.jsonl").unlink()  # only text files: as before, no file named
    err = _err(capsys, ["--input", str(corpus), "--output", str(tmp_path / "o"), *ARGS])
    assert err.endswith("folder has no .jsonl, .ndjson, .json or .parquet files (or use --loader for other formats "
                        "datasets.load_dataset reads)"), err


def test_a_file_beside_its_compressed_copy_is_refused_naming_both(tmp_path, capsys):
    """web.jsonl beside web.jsonl.gz (a `gunzip -k`): both were read, 10 documents of 5."""
    d = tmp_path / "c"
    d.mkdir()
    _write_jsonl(d / "web.jsonl", [[i + 1] for i in range(5)])
    _write_jsonl(d / "web.jsonl.gz", [[i + 1] for i in range(5)], opener=gzip.open)
    _write_jsonl(d / "more.jsonl.gz", [[9]], opener=gzip.open)  # another stem: read
    err = _err(capsys, ["--input", str(d), "--output", str(tmp_path / "o"), *ARGS])
    assert "c: web.jsonl and web.jsonl.gz are copies of one file" in err and "docs/data.md" in err, err
    (d / "web.jsonl").unlink()
    assert prepare([str(d)], str(tmp_path / "o"), vocab_size=100, workers=0, log=lambda _: None)["n_docs"] == 6


def test_the_in_job_limit_counts_decompressed_bytes_and_its_command_runs(tmp_path, monkeypatch, capsys):
    """A .jsonl.gz was measured by its compressed bytes: 7x the limit's JSONL tokenized on rank 0. The size is read
    from gzip's trailer and zstd's frame header, Parquet's footer (at least 2x stored), else RATIO x stored. The
    refusal's command lacked the tokenizer the run would use (the model folder's own): run as written, it failed."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    from data import prepare as in_job

    monkeypatch.setattr(in_job, "CACHE", str(tmp_path / "cache"))
    text = (json.dumps({"text": "river apple stone " * 40}) + "\n").encode() * 200  # ~144 KB, compresses ~100x
    files = {"a.jsonl.gz": gzip.compress(text), "b.jsonl.zst": zstandard.ZstdCompressor().compress(text),
             "c.jsonl.xz": lzma.compress(text)}
    for name, blob in files.items():
        (tmp_path / name).write_bytes(blob)
    stream = zstandard.ZstdCompressor().stream_writer(open(tmp_path / "d.jsonl.zst", "wb"))  # no size in its header
    stream.write(text)
    stream.close()
    pq.write_table(pa.table({"text": ["river apple stone " * 40] * 200}), tmp_path / "e.parquet")
    sizes = {n: in_job.input_bytes(str(tmp_path / n)) for n in (*files, "d.jsonl.zst", "e.parquet")}
    assert sizes["a.jsonl.gz"] == sizes["b.jsonl.zst"] == len(text), sizes
    stored = {n: (tmp_path / n).stat().st_size for n in sizes}
    assert sizes["c.jsonl.xz"] == in_job.RATIO * stored["c.jsonl.xz"], sizes
    assert sizes["d.jsonl.zst"] == in_job.RATIO * stored["d.jsonl.zst"], sizes
    # its footer counts the repeated row once: PARQUET_RATIO x stored (RATIO refused an Alpaca-sized set: a review)
    assert sizes["e.parquet"] == in_job.PARQUET_RATIO * stored["e.parquet"], sizes
    uniq = pa.table({"text": [f"river {i} apple stone " * 40 for i in range(200)]})
    pq.write_table(uniq, tmp_path / "f.parquet")  # unique rows: the footer's uncompressed bytes, above 2x stored
    footer = pq.ParquetFile(tmp_path / "f.parquet").metadata.row_group(0).total_byte_size
    assert in_job.input_bytes(str(tmp_path / "f.parquet")) == max(footer, 2 * (tmp_path / "f.parquet").stat().st_size)

    model = _word_tokenizer(tmp_path / "model", ["<unk>", "</s>", "apple", "river", "stone"])
    monkeypatch.setattr(in_job, "MAX_IN_JOB_BYTES", len(text) // 2)  # above the .gz's bytes, below its JSONL's
    assert stored["a.jsonl.gz"] < in_job.MAX_IN_JOB_BYTES
    with pytest.raises(ValueError, match="too much to tokenize inside the job") as e:
        in_job.prepare_in_job(str(tmp_path / "a.jsonl.gz"), None, 5, model)
    command = str(e.value).split("`")[1].replace("DIR", str(tmp_path / "prepared"))
    assert f"--tokenizer_name_or_path {model}" in command, command
    assert shlex.split(command)[:2] == ["python", "scripts/prepare_data.py"]
    assert main([*shlex.split(command)[2:], "--workers", "0"]) == 0, capsys.readouterr().err
    # a set prepared in the job before (another limit, an earlier version) is used, not refused by today's estimate
    monkeypatch.setattr(in_job, "MAX_IN_JOB_BYTES", len(text) * 10)
    done, _ = in_job.prepare_in_job(str(tmp_path / "a.jsonl.gz"), None, 5, model)
    monkeypatch.setattr(in_job, "MAX_IN_JOB_BYTES", len(text) // 2)
    assert in_job.prepare_in_job(str(tmp_path / "a.jsonl.gz"), None, 5, model)[0] == done
    # a resumed run whose input passed yesterday's estimate (its cache key since changed): prepared again, not refused
    # at its requeue (an upgrade audit: a .jsonl.xz run exited 2 for good)
    monkeypatch.setattr(in_job, "MAX_IN_JOB_BYTES", 5 * stored["c.jsonl.xz"])  # below its 10x estimate
    with pytest.raises(ValueError, match="or estimated at 10x a compressed file of unstated size"):
        in_job.prepare_in_job(str(tmp_path / "c.jsonl.xz"), None, 5, model)
    assert in_job.is_prepared(in_job.prepare_in_job(str(tmp_path / "c.jsonl.xz"), None, 5, model, resumed=True)[0])


def test_a_row_with_its_text_under_another_field_names_that_field(tmp_path, capsys, monkeypatch):
    """{"content": ...} (The Stack) was refused with "--skip_bad_rows skips and counts such rows": every row dropped.
    The line names the string fields and `--text_field content`; a nested text says nested fields are not read (an
    object under "text" was read as a chat row: "chat row: not a chat row"); in the job, no --skip_bad_rows."""
    from data import prepare as in_job

    monkeypatch.setattr(in_job, "CACHE", str(tmp_path / "cache"))
    rows = {"stack": {"content": "def f(): pass", "lang": "py"}, "nested": {"meta": {"id": 1}, "data": {"text": "hi"}},
            "object": {"text": {"en": "hi"}}}
    for name, row in rows.items():
        (tmp_path / f"{name}.jsonl").write_text(json.dumps(row) + "\n")
    err = _err(capsys, ["--input", str(tmp_path / "stack.jsonl"), "--output", str(tmp_path / "o"), *ARGS])
    assert "string fields here: ['content', 'lang']; name the one with the text: --text_field content" in err, err
    for name, holder in (("nested", "'data' holds an object, keys ['text']"), ("object", "'text' holds an object")):
        err = _err(capsys, ["--input", str(tmp_path / f"{name}.jsonl"), "--output", str(tmp_path / name), *ARGS])
        assert f"nested fields are not read ({holder}" in err and "chat row: not" not in err, err
    with pytest.raises(ValueError) as e:
        in_job.prepare_in_job(str(tmp_path / "stack.jsonl"), None, 100)
    assert str(e.value).endswith(f"--text_field content (python scripts/prepare_data.py --input {tmp_path}/stack.jsonl "
                                 "--output DIR --vocab_size 100 --text_field content, then pass --dataset_path DIR)")
    with pytest.raises(ValueError) as e:
        in_job.prepare_in_job(str(tmp_path / "nested.jsonl"), None, 100)
    assert "skip" not in str(e.value) and str(e.value).endswith("(the text a top-level string field)"), str(e.value)
