"""A resume of a checkpoint that does not record which in-job prepared folder it trained on (its held-out record
without `prepared`: written before 2026-11-30) on a version that prepares the same JSONL into another folder (today's
cache key and tokenization rules): an upgrade audit saw the losses differ from the first resumed step on, the sample
count the same, and nothing said. Now one note says the tokens may differ and how to keep the old ones
(data/prepared_again.unrecorded_note, said by data/pipeline.open_run_data)."""

from __future__ import annotations

import glob
import json
import os
import shutil
import types

from data import prepare as in_job
from data.pipeline import open_run_data

NOTE = "does not record which preparation of --dataset_path"


def _stages():
    return [types.SimpleNamespace(index=i, name=f"s{i}", max_seq_length=n, eval={"heldout_samples": 2}, data=None,
                                  tasks={}) for i, n in enumerate((64, 128))]


def _older(folder: str, src: str) -> None:
    """Make `folder`'s plan read as the version before 2026-11-30 wrote it: its units `kind:path:size`, no rules."""
    shard = sorted(glob.glob(os.path.join(folder, "shard-*-of-*.json")))[0]
    with open(shard) as fh:
        rec = json.load(fh)
    rec["plan"]["units"] = [f"jsonl:{os.path.abspath(src)}:{os.path.getsize(src)}"]
    rec["plan"].pop("rules", None)
    with open(shard, "w") as fh:
        json.dump(rec, fh)


def test_a_checkpoint_without_the_record_of_its_folder_is_told_how_to_keep_its_tokens(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(in_job, "CACHE", str(tmp_path / "cache"))
    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps({"input_ids": [100 * d + j % 97 for j in range(60 + 40 * d)]}) + "\n"
                           for d in range(12)))
    other = tmp_path / "other" / "rows2.jsonl"  # another input's folder in the same cache: never named
    other.parent.mkdir()
    other.write_text(json.dumps({"input_ids": list(range(1, 200))}) + "\n")
    key = in_job.cache_key
    monkeypatch.setattr(in_job, "cache_key", lambda *a: "0123456789abcdef")  # the older version's key
    old, _ = in_job.prepare_in_job(str(src), None, 2048)
    _older(old, str(src))
    monkeypatch.setattr(in_job, "cache_key", lambda *a: "fedcba9876543210")
    in_job.prepare_in_job(str(other), None, 2048)
    monkeypatch.setattr(in_job, "cache_key", key)
    first = open_run_data(str(src), None, 2048, _stages(), reset_position_ids=False).heldout_split
    recorded_before = {k: v for k, v in first.items() if k not in ("prepared", "input", "docs")}
    capsys.readouterr()

    data = open_run_data(str(src), None, 2048, _stages(), reset_position_ids=False, heldout=recorded_before)
    out = capsys.readouterr().out
    folder = first["prepared"]  # today's in-job folder (the first open's)
    assert data.heldout_split["prepared"] == folder != old and NOTE in out, out
    assert f"this start's, {folder}, may tokenize it otherwise" in out
    assert f"to keep the old tokens pass --dataset_path {old} (the one other folder" in out, out
    assert "fedcba9876543210" not in out

    # two older folders of the same input: which one it trained on is not known, so none is named
    shutil.copytree(old, old.replace("0123456789abcdef", "00000000000000aa"))
    open_run_data(str(src), None, 2048, _stages(), reset_position_ids=False, heldout=recorded_before)
    out = capsys.readouterr().out
    assert NOTE in out and "pass the folder it trained on as --dataset_path, if it is still in" in out, out

    # a checkpoint that records its folder: the existing notes only; a fresh start: nothing
    open_run_data(str(src), None, 2048, _stages(), reset_position_ids=False, heldout=first)
    open_run_data(str(src), None, 2048, _stages(), reset_position_ids=False)
    assert NOTE not in capsys.readouterr().out


def test_a_folder_prepared_under_older_rules_is_said_when_a_run_opens_it(tmp_path, monkeypatch, capsys):
    """A folder prepared by scripts/prepare_data.py, then a git pull whose rules (data/packing.RULES) changed how some
    rows tokenize: a fresh run trained the old rows without a word. It is said where a step changed rows the folder
    holds (by its manifest's counts; an older manifest: by its shards' plans), not where it holds none of them."""
    from data import packing
    from data.prepare_data import main

    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps({"input_ids": [1 + (7 * d + j) % 90 for j in range(50)]}) + "\n"
                           for d in range(12)))
    out = str(tmp_path / "prep")
    assert main(["--input", str(src), "--output", out, "--vocab_size", "100", "--workers", "0"]) == 0
    capsys.readouterr()
    open_run_data(out, None, 100, _stages(), reset_position_ids=False)
    assert "prepared under tokenization rules" not in capsys.readouterr().out  # today's rules: nothing
    today = packing.RULES
    monkeypatch.setattr(packing, "RULES", today.replace("chat12", "chat13"))  # a chat step: rows it holds none of
    monkeypatch.setitem(packing.RULE_ROWS, "chat13", "chat")
    open_run_data(out, None, 100, _stages(), reset_position_ids=False)
    assert "prepared under tokenization rules" not in capsys.readouterr().out
    monkeypatch.setattr(packing, "RULES", today.replace("doc11", "doc12"))  # a step of every row
    open_run_data(out, None, 100, _stages(), reset_position_ids=False)
    said = capsys.readouterr().out
    assert f"--dataset_path {out} was prepared under tokenization rules {today}, today's are" in said, said
    assert "doc12 (text or any rows) read rows it holds differently" in said and "with --overwrite" in said, said
    manifest = os.path.join(out, "manifest.json")  # a manifest from before it recorded the rules: the shards' plans
    m = json.load(open(manifest))
    del m["rules"]
    json.dump(m, open(manifest, "w"))
    open_run_data(out, None, 100, _stages(), reset_position_ids=False)
    assert f"was prepared under tokenization rules {today}" in capsys.readouterr().out
