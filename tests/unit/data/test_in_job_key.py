"""The in-job prepared folder (data/prepare.prepare_in_job: train.py --dataset_path given raw JSONL) is keyed by its
input's content (data/discover.Unit.identity: name, size, a hash of each file's first and last 64 KiB), as
prepare_data's own plan is, not by its path and mtime: an input re-staged to node-local scratch at each requeue
(/tmp/slurm-$JOBID/..., `cp` without -p) was prepared again by rank 0 into another folder while every GPU waited, the
old folder kept, and the resume's note blamed "today's rules" naming the old folder to pass instead."""

from __future__ import annotations

import json
import os
import shutil

from data import prepare as in_job
from data import prepare_data
from data.pipeline import again_note


def _rows(path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"input_ids": list(range(1, 30 + i))}) + "\n" for i in range(10)))
    return str(path)


def _restage(src: str, to: str) -> None:
    """`cp` without -p onto `to` (a temp then os.replace, as a staging script does): the same bytes, a new mtime."""
    os.makedirs(os.path.dirname(to), exist_ok=True)
    shutil.copyfile(src, to + ".part")
    st = os.stat(src)
    os.utime(to + ".part", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    os.replace(to + ".part", to)


def test_a_restaged_input_is_not_prepared_again(tmp_path, monkeypatch):
    monkeypatch.setattr(in_job, "CACHE", str(tmp_path / "cache"))
    real, calls = prepare_data.prepare, []
    monkeypatch.setattr(prepare_data, "prepare", lambda *a, **kw: calls.append(a[1]) or real(*a, **kw))
    src = _rows(tmp_path / "slurm-1" / "rows.jsonl")
    out, _ = in_job.prepare_in_job(src, None, 1000)
    _restage(src, src)  # the requeue's staging, same path
    assert in_job.prepare_in_job(src, None, 1000, resumed=True)[0] == out
    other = str(tmp_path / "slurm-2" / "rows.jsonl")  # another node's scratch
    _restage(src, other)
    assert in_job.prepare_in_job(other, None, 1000, resumed=True)[0] == out
    assert len(calls) == 1 and os.listdir(tmp_path / "cache" / "prepared") == [os.path.basename(out)]
    # another content at the same size (and mtime) is another input: never the old folder's tokens
    st = os.stat(src)
    with open(src, "r+b") as fh:
        fh.seek(len('{"input_ids": ['))
        fh.write(b"2")  # the first id 1 -> 2
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert in_job.prepare_in_job(src, None, 1000, resumed=True)[0] != out and len(calls) == 2


def test_the_resume_note_after_the_key_upgrade_says_the_tokens_are_the_same(tmp_path, monkeypatch):
    """A folder an earlier version keyed by path and mtime is prepared once more after the upgrade: the note says it
    holds the same tokens (its plan and today's agree) instead of blaming today's rules; where they differ it names
    what differs."""
    monkeypatch.setattr(in_job, "CACHE", str(tmp_path / "cache"))
    src = _rows(tmp_path / "rows.jsonl")
    key = in_job.cache_key
    monkeypatch.setattr(in_job, "cache_key", lambda *a: "0123456789abcdef")  # the earlier rule's key
    first, _ = in_job.prepare_in_job(src, None, 1000)
    monkeypatch.setattr(in_job, "cache_key", key)
    folder, _ = in_job.prepare_in_job(src, None, 1000, resumed=True)
    note = again_note(src, folder, first)
    assert folder != first and "so it holds the same tokens" in note and f"{first} may be removed" in note, note
    assert "today's" not in note and "may differ" not in note
    other = in_job.prepare_in_job(src, None, 2000, resumed=True)[0]  # another vocabulary bound
    note = again_note(src, other, first)
    assert "the vocabulary bound differ from its first preparation's" in note and "its input" not in note, note
    assert f"to keep them pass --dataset_path {first}" in note
    shutil.rmtree(first)
    assert "since removed): today's tokenization rules" in again_note(src, folder, first)


def test_a_same_size_edit_inside_the_input_is_another_input(tmp_path, monkeypatch):
    """One answer `003000` -> `003001` in the middle of a 392 KB JSONL: the same name, size, first and last 64 KiB
    (Unit.identity's sample), so the old folder's tokens were reused without a word. The in-job key hashes every byte;
    a re-staged copy keeps its key."""
    monkeypatch.setattr(in_job, "CACHE", str(tmp_path / "cache"))
    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps({"input_ids": [1, 2, 3], "answer": f"{i:06d}"}) + "\n" for i in range(8000)))
    assert os.path.getsize(src) > 4 * 65536
    out, _ = in_job.prepare_in_job(str(src), None, 1000)
    _restage(str(src), str(tmp_path / "slurm-2" / "rows.jsonl"))
    assert in_job.prepare_in_job(str(tmp_path / "slurm-2" / "rows.jsonl"), None, 1000, resumed=True)[0] == out
    text = src.read_text()
    assert text.count('"003000"') == 1 and text.index('"003000"') > 65536 < len(text) - text.index('"003000"')
    src.write_text(text.replace('"003000"', '"003001"'))
    assert in_job.prepare_in_job(str(src), None, 1000, resumed=True)[0] != out
