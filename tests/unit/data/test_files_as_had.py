"""Input files as users had them (an audit of data preparation): a linked subfolder (dropped without a word), a
datasets cache folder under --loader arrow (every row twice), train.py's --dataset_path pattern and `name=PATH`
(refused), in-job source names (a file each), a save_to_disk folder saved with a format (a traceback), one document
too long to tokenize (an OOM kill naming nothing), a truncated Parquet file or a git-lfs pointer (no file named), a
`zstd --long=30` file (called damaged), a code repository or books under --loader text (refused as several splits), a
null text, CSV's NA strings, a TSV and a latin-1 text. data/discover.py, data/readers.py, data/jsonl.py,
data/prepare.py, training/config.py."""

from __future__ import annotations

import json
import os

import pytest

from data.discover import discover
from data.prepare_data import prepare
from data.readers import Fields, iter_rows, parse_item
from tests.unit.data.test_data import _word_tokenizer
from tests.unit.data.test_prepare_data import DOCS, _write_jsonl

QUIET = {"workers": 0, "log": lambda _: None}


def _one_line(fn, *args, **kw) -> str:
    with pytest.raises(ValueError) as e:
        fn(*args, **kw)
    assert "\n" not in str(e.value), e.value
    return str(e.value)


def test_a_linked_subfolder_and_a_linked_datasets_folder_are_read_and_a_loop_walked_once(tmp_path, capsys):
    """corpus/books -> /shared/books (os.walk without followlinks): the books were dropped without a word, and so was
    a linked save_to_disk folder. Links to folders are followed; one back up to the corpus is walked once, said."""
    import datasets

    real = tmp_path / "shared" / "books"
    real.mkdir(parents=True)
    _write_jsonl(real / "b.jsonl", DOCS[:2])
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    _write_jsonl(corpus / "web.jsonl", DOCS[2:4])
    datasets.Dataset.from_dict({"input_ids": DOCS[4:6]}).save_to_disk(str(tmp_path / "hf"))
    os.symlink(real, corpus / "books")
    os.symlink(tmp_path / "hf", corpus / "hf")
    os.symlink(corpus, real / "loop")  # a loop: books/loop/books/loop/...
    units = discover(str(corpus))
    assert sorted((u.kind, os.path.relpath(u.path, corpus)) for u in units) == [
        ("hf_disk", "hf"), ("jsonl", "books/b.jsonl"), ("jsonl", "web.jsonl")]
    assert "skipping books/loop/" in capsys.readouterr().out
    m = prepare([str(corpus)], str(tmp_path / "out"), vocab_size=100, **QUIET)
    assert m["n_docs"] == 6 and m["sources"] == ["corpus"]


def test_loader_arrow_on_a_datasets_cache_folder_refuses_its_cache_files(tmp_path):
    """datasets' cache folder holds the split (`json-train.arrow`) and a map's results (`cache-<fingerprint>.arrow`):
    `--loader arrow` on the folder read both, every row twice. Refused naming the cache file; a pattern reads."""
    import datasets

    src = _write_jsonl(tmp_path / "s.jsonl", [f"row {i}" for i in range(5)], "text")
    ds = datasets.load_dataset("json", data_files=[src], split="train", cache_dir=str(tmp_path / "hfc"))
    ds.map(lambda r: {"text": r["text"].upper()})
    folder = os.path.dirname(next(str(p) for p in (tmp_path / "hfc").rglob("*-train.arrow")))
    err = _one_line(discover, folder, "arrow")
    assert "cache-" in err and "is a datasets cache file" in err and "json-train.arrow" in err, err
    assert [os.path.basename(u.path) for u in discover(f"{folder}/*-train.arrow", "arrow")] == ["json-train.arrow"]


def test_dataset_path_takes_a_pattern_and_name_path_and_refuses_a_pattern_naming_nothing(tmp_path):
    """docs/data.md and the several-splits refusal offer `--dataset_path 'DIR/train-*.jsonl'`; the config refused it
    (os.path.exists), and `books=DIR` too."""
    from training.config import parse_config

    for k in range(2):
        _write_jsonl(tmp_path / f"train-0000{k}-of-00002.jsonl", DOCS[:1])
    out = ["--output_dir", str(tmp_path / "run")]
    assert parse_config(["--dataset_path", f"{tmp_path}/train-*.jsonl", *out]).dataset_path.endswith("train-*.jsonl")
    assert parse_config(["--dataset_path", f"books={tmp_path}", *out]).dataset_path == f"books={tmp_path}"
    err = _one_line(parse_config, ["--dataset_path", f"{tmp_path}/test-*.jsonl", *out])
    assert err == f"--dataset_path {tmp_path}/test-*.jsonl: the pattern names no file", err
    err = _one_line(parse_config, ["--dataset_path", str(tmp_path / "none"), *out])
    assert err == f"--dataset_path {tmp_path / 'none'}: no such file or folder"


def test_in_job_sources_are_named_as_prepare_data_names_them(tmp_path, monkeypatch):
    """The in-job path passed each file to prepare_data as an input of its own: a folder's files became sources `a`,
    `b` where prepare_data writes `corpus` (a stage's `data: {corpus: 1}` found none), `books=DIR` lost its name. The
    key of such an input moves (its old folder holds the old names: reused only by a run resumed on it); a single
    file's stays."""
    from data import prepare as in_job
    from data.packing import cache_key

    monkeypatch.setattr(in_job, "CACHE", str(tmp_path / "cache"))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    _write_jsonl(corpus / "a.jsonl", DOCS[:2])
    _write_jsonl(corpus / "b.jsonl", DOCS[2:4])

    def sources(spec):
        out, _ = in_job.prepare_in_job(spec, None, 100)
        with open(os.path.join(out, "manifest.json")) as fh:
            return out, json.load(fh)["sources"]

    assert sources(str(corpus))[1] == prepare([str(corpus)], str(tmp_path / "pd"), vocab_size=100, **QUIET)["sources"]
    assert sources(str(corpus))[1] == ["corpus"]
    assert sources(f"books={corpus}")[1] == ["books"]
    assert sources(f"{corpus}/*.jsonl")[1] == ["corpus"]
    old = lambda spec: cache_key(in_job.content_identity(discover(spec)), None, 100)  # noqa: E731 (the key before)
    assert os.path.basename(sources(str(corpus))[0]) != old(str(corpus))
    assert os.path.basename(sources(str(corpus / "a.jsonl"))[0]) == old(str(corpus / "a.jsonl"))
    # a run resumed across the upgrade, whose first preparation made the old folder (sources a, b), keeps it: its
    # sources and data order as they were; a new run prepares the input as given
    legacy = tmp_path / "legacy"
    prepare([str(corpus / "a.jsonl"), str(corpus / "b.jsonl")], str(legacy), vocab_size=100, **QUIET)
    os.rename(legacy, tmp_path / "cache" / "prepared" / old(str(corpus)))
    out, _ = in_job.prepare_in_job(str(corpus), None, 100, resumed=True)
    assert os.path.basename(out) == old(str(corpus))
    new = in_job.prepare_in_job(str(corpus), None, 100)[0]
    assert os.path.basename(new) != old(str(corpus))
    # a run started since on the new folder, requeued: its recorded folder, not the old one still in the cache
    assert in_job.prepare_in_job(str(corpus), None, 100, resumed=True, first=new)[0] == new
    assert os.path.basename(in_job.prepare_in_job(str(corpus), None, 100, resumed=True,
                                                  first=str(tmp_path / "cache" / "prepared" / old(str(corpus))))[0]) \
        == old(str(corpus))
    inside = tmp_path / "cache" / "data"  # the cache inside the input folder: one line, not prepare_data's
    inside.mkdir()
    _write_jsonl(inside / "x.jsonl", DOCS[:1])
    monkeypatch.setattr(in_job, "CACHE", str(inside / "cache"))
    assert "lies inside it: set ULYSSES_CACHE" in _one_line(in_job.prepare_in_job, str(inside), None, 100)


def test_a_save_to_disk_folder_saved_with_a_format_is_read(tmp_path):
    """Dataset.with_format("pandas" / "arrow" / "numpy").save_to_disk keeps the format: its batches came as frames or
    tables (a traceback in readers.py)."""
    import datasets

    for fmt in ("pandas", "arrow", "numpy"):
        datasets.Dataset.from_dict({"input_ids": DOCS[:3]}).with_format(fmt).save_to_disk(str(tmp_path / fmt))
        m = prepare([str(tmp_path / fmt)], str(tmp_path / f"out-{fmt}"), vocab_size=100, **QUIET)
        assert m["n_docs"] == 3, fmt


def test_a_text_document_too_long_to_tokenize_is_refused_naming_its_row(tmp_path, monkeypatch):
    """The Rust tokenizer holds ~120 bytes per byte of a text while it encodes it: a 200 MB line allowed in-job was an
    OOM kill naming nothing. A text over MAX_DOC_BYTES is handed on refused, its text dropped by the reader (never a
    worker's); a long row of ids is not (its JSON is long, its text none)."""
    from data import readers
    from data.discover import Unit

    monkeypatch.setattr(readers, "MAX_DOC_BYTES", 400)
    f = tmp_path / "a.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in ({"text": "short"}, {"input_ids": list(range(200))},
                                                          {"text": "é" * 150}, {"text": "word " * 100})))
    rows = list(iter_rows(Unit("a", "jsonl", str(f)), Fields()))
    assert [isinstance(item, readers.Refused) for _, item in rows] == [False, False, False, True]  # é: 2 bytes, 300
    err = parse_item(rows[3][1], Fields())[2]
    assert err.startswith("a text document of 0 MB, over the 0 MB tokenized as one") and "split it into" in err, err
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["short", "word " * 100]}), tmp_path / "t.parquet")
    (_, short), (row, long) = iter_rows(Unit("t", "parquet", str(tmp_path / "t.parquet")), Fields())
    assert short == ("short", None) and row == 1 and parse_item(long, Fields())[2].startswith("a text document")


def test_a_row_too_long_to_tokenize_is_a_bad_row(tmp_path, monkeypatch):
    """A text over MAX_DOC_BYTES was refused by the reader, past --skip_bad_rows: a 1 TB preparation ended at one 33
    MB row among 100M, the only way out to split the file. It is a bad row like the others: refused in one line
    naming its file:row and --skip_bad_rows, or with it skipped and counted, the other rows prepared; its text never
    reaches the tokenizer (JSONL, Parquet, --loader text's file a document)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from data import readers
    from data.tokenizer import Tokenizer

    monkeypatch.setattr(readers, "MAX_DOC_BYTES", 400)
    monkeypatch.setattr(readers, "TEXT_DOC_MAX", 400)
    tok = _word_tokenizer(tmp_path / "tok", ["<unk>", "</s>", "hello", "world"])
    seen, frame = [], Tokenizer.frame_texts
    monkeypatch.setattr(Tokenizer, "frame_texts", lambda self, texts, *a: seen.extend(texts) or frame(self, texts, *a))
    f = tmp_path / "a.jsonl"
    f.write_text("".join(json.dumps({"text": t}) + "\n" for t in ("hello", "world " * 100, "hello world", "world")))
    pq.write_table(pa.table({"text": ["hello", "world " * 100, "world"]}), tmp_path / "t.parquet")
    (tmp_path / "books").mkdir()
    (tmp_path / "books" / "a.txt").write_text("hello world")
    (tmp_path / "books" / "b.txt").write_text("world " * 100)
    for path, loader, where, docs in ((f, None, f"{f}:2", 3), (tmp_path / "t.parquet", None, "t.parquet: row 1", 2),
                                      (tmp_path / "books", "text", "b.txt: row 0", 1)):
        err = _one_line(prepare, [str(path)], str(tmp_path / f"no-{path.name}"), tok, loader=loader, **QUIET)
        assert where in err and ("a text document of 0 MB" in err or "0 MB read as one document" in err), err
        assert err.endswith("(--skip_bad_rows skips and counts such rows)"), err
        m = prepare([str(path)], str(tmp_path / f"out-{path.name}"), tok, loader=loader, skip_bad_rows=True, **QUIET)
        assert m["n_docs"] == docs and m["bad_rows"] == 1 and where in m["bad_examples"][0], m
    assert seen and not any(len(t) > 400 for t in seen)  # the long texts never tokenized


def test_a_truncated_parquet_file_is_named(tmp_path):
    """pyarrow's "Parquet magic bytes not found in footer" named no file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = tmp_path / "d"
    d.mkdir()
    pq.write_table(pa.table({"input_ids": DOCS}), d / "good.parquet")
    data = (d / "good.parquet").read_bytes()
    (d / "cut.parquet").write_bytes(data[: len(data) // 2])
    err = _one_line(prepare, [str(d / "cut.parquet")], str(tmp_path / "o1"), vocab_size=100, **QUIET)
    assert err.startswith(f"{d / 'cut.parquet'}: cannot be read (") and "truncated or damaged" in err, err


def test_a_git_lfs_pointer_is_named_with_its_fix(tmp_path):
    """A dataset repo cloned without `git lfs pull` holds ~130-byte pointers: a Parquet one named no file, a JSONL one
    was three bad rows ("not valid JSON"), skipped with --skip_bad_rows."""
    pointer = b"version https://git-lfs.github.com/spec/v1\noid sha256:" + b"0" * 64 + b"\nsize 123456\n"
    for name in ("lfs.parquet", "lfs.jsonl", "lfs.jsonl.gz"):
        (tmp_path / name).write_bytes(pointer)
        err = _one_line(prepare, [str(tmp_path / name)], str(tmp_path / f"o-{name}"), vocab_size=100,
                        skip_bad_rows=True, **QUIET)
        assert err.startswith(f"{tmp_path / name}: cannot be read (") and "git lfs pull" in err, err


def test_a_zstd_long_window_file_is_read(tmp_path):
    """`zstd --long=30` (a 1 GiB window, large corpora compress so) was over zstandard's default 128 MiB limit:
    "cannot be read ... a truncated or damaged file?"."""
    import zstandard

    raw = "".join(json.dumps({"input_ids": d}) + "\n" for d in DOCS).encode()
    params = zstandard.ZstdCompressionParameters.from_level(3, window_log=30, enable_ldm=True)
    c = zstandard.ZstdCompressor(compression_params=params).compressobj()
    (tmp_path / "a.jsonl.zst").write_bytes(c.compress(raw) + c.flush())
    assert prepare([str(tmp_path / "a.jsonl.zst")], str(tmp_path / "out"), vocab_size=100, **QUIET)["n_docs"] == 12


def test_a_code_repository_and_books_under_loader_text_name_no_splits(tmp_path):
    """`proj/scripts/train.py` beside `proj/tests/test_model.py`, and books named `the_last_train_home.txt` and
    `a_test_of_courage.txt`, were refused as a dataset's train and test splits. A split is named where a dataset repo
    names it (a shard, a folder, a data file's first or last word); the refusal names the way to read every file."""
    for f in ("proj/scripts/train.py", "proj/tests/test_model.py", "proj/src/model.py", "proj/scripts/eval.py"):
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text("x = 1\n")
    assert len(discover(str(tmp_path / "proj"), "text")) == 4
    (tmp_path / "books").mkdir()
    for f in ("the_last_train_home.txt", "a_test_of_courage.txt", "moby_dick.txt"):
        (tmp_path / "books" / f).write_text("A story.\n")
    assert len(discover(str(tmp_path / "books"), "text")) == 3
    (tmp_path / "snap").mkdir()
    for f in ("train.jsonl", "test_data.jsonl"):  # a dataset's splits: still refused
        _write_jsonl(tmp_path / "snap" / f, DOCS[:1])
    err = _one_line(discover, str(tmp_path / "snap"))
    assert "several splits (test, train" in err and f"every file: --input '{tmp_path / 'snap'}/**/*.jsonl'" in err, err


def test_a_null_text_is_said_to_be_null():
    """{"text": null} was "expected {"text": str} ... got keys ['text']", a table's null cell "got NoneType"."""
    assert parse_item(b'{"text": null}', Fields())[2] == "'text' is null (a row with no text): fill it, or drop the row"
    assert "is null" in parse_item((None, None), Fields())[2]


TEXTS = ["hello", "NA", "null", "nan", "hello hello"]


def test_loader_csv_reads_na_strings_as_text(tmp_path):
    """--loader csv read the texts NA, null, nan and an empty cell as missing values (pandas' defaults): bad rows."""
    tok = _word_tokenizer(tmp_path / "tok", ["<unk>", "</s>", "hello", "NA", "null"])
    (tmp_path / "a.csv").write_text("id,text\n" + "".join(f"{i},{t}\n" for i, t in enumerate(TEXTS)) + "5,\n")
    m = prepare([str(tmp_path / "a.csv")], str(tmp_path / "o1"), tok, loader="csv", **QUIET)
    assert (m["n_docs"], m["bad_rows"], m["empty_docs"]) == (5, 0, 1), m


def test_loader_csv_reads_a_tsv_by_its_tabs(tmp_path):
    """A .tsv under --loader csv was one column `id\\ttext`: "no column 'text'"."""
    tok = _word_tokenizer(tmp_path / "tok", ["<unk>", "</s>", "hello", "NA", "null"])
    (tmp_path / "a.tsv").write_text("id\ttext\n" + "".join(f"{i}\t{t}\n" for i, t in enumerate(TEXTS)))
    assert prepare([str(tmp_path / "a.tsv")], str(tmp_path / "o2"), tok, loader="csv", **QUIET)["n_docs"] == 5


def test_a_latin1_text_is_told_to_be_re_encoded(tmp_path):
    """A latin-1 file under --loader text was told to use another builder (csv, json, ...): it is not UTF-8."""
    tok = _word_tokenizer(tmp_path / "tok", ["<unk>", "</s>", "hello"])
    (tmp_path / "latin.txt").write_bytes("café au lait\n".encode("latin-1"))
    err = _one_line(prepare, [str(tmp_path / "latin.txt")], str(tmp_path / "o3"), tok, loader="text", **QUIET)
    assert f"--loader text: {tmp_path / 'latin.txt'} is not UTF-8 text" in err and "re-encode it as UTF-8" in err, err
    rows = b"".join(b"%d,hello\n" % i for i in range(12000))  # past datasets' first 10,000-row chunk: read later
    (tmp_path / "late.csv").write_bytes(b"id,text\n" + rows + "12000,café\n".encode("latin-1"))
    assert "is not UTF-8 text" in _one_line(prepare, [str(tmp_path / "late.csv")], str(tmp_path / "o4"), tok,
                                            loader="csv", **QUIET)
