"""A preparation inside the job that fails (a full cache disk, a bad row) leaves no `<key>.tmp<pid>` behind: a
requeue has another pid, so nothing removed it, and each failed attempt kept its partial tokens for good."""

from __future__ import annotations

import errno
import json
import os

import pytest


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "No space left on device"), ValueError("a bad row")])
def test_a_failed_in_job_preparation_leaves_no_partial_folder(tmp_path, monkeypatch, error):
    from data import prepare as in_job
    from data import store

    monkeypatch.setattr(in_job, "CACHE", str(tmp_path / "cache"))
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"input_ids": list(range(1, 50))}) + "\n" for _ in range(20)))

    def full(path, arr):
        raise error

    monkeypatch.setattr(store, "save_npy_atomic", full)
    with pytest.raises(type(error)) as raised:
        in_job.prepare_in_job(str(rows), None, 1000)
    assert os.listdir(tmp_path / "cache" / "prepared") == []
    if isinstance(error, OSError):  # named for the one-line refusal (training/job.py): the write named no file
        assert ".tmp" in raised.value.filename
