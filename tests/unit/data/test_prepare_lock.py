"""Two prepare_data.py runs into one --output (srun of one command on N tasks without --shard, a second terminal):
the second one "resumed" the first one's unfinished shard, deleted its open chunk and in-flight tmp files, and both
wrote the same chunk names (FileNotFoundError tracebacks, a manifest over a partial chunk). One writer per shard now
(data/output_lock.py), released by the kernel when its process dies."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys

import pytest

from data import output_lock, packing
from data.prepare_data import _resume_point, merge, prepare

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _rows(tmp_path) -> str:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"input_ids": list(range(1, 20 + i))}) + "\n" for i in range(10)))
    return str(path)


def test_a_second_writer_of_the_same_shard_is_refused_until_the_first_one_dies(tmp_path):
    rows, out = _rows(tmp_path), tmp_path / "prep"
    out.mkdir()
    open_chunk = out / "tokens-s00000-c000000.bin"  # the first writer's chunk, not committed yet
    open_chunk.write_bytes(b"\1" * 64)
    first = subprocess.Popen(  # another process writing shard 0 of the folder
        [sys.executable, "-c", "import sys; from data import output_lock; h = output_lock.hold(sys.argv[1], 0, 1); "
         "print('held', flush=True); sys.stdin.read()", str(out)],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline().strip() == "held"
        with pytest.raises(ValueError) as e:
            prepare([rows], str(out), vocab_size=100, workers=0, eos_id=0, log=lambda _: None)
        msg = str(e.value)
        assert f"--output {out} is being written by another process" in msg and f":{first.pid}, started" in msg
        assert "--shard i/N" in msg and "\n" not in msg
        assert open_chunk.read_bytes() == b"\1" * 64  # its files untouched
        # another shard of the same folder is not that writer's: shards of one preparation run at once
        out2 = tmp_path / "prep2"
        held = output_lock.hold(str(out2), 0, 2)
        assert output_lock.hold(str(out2), 1, 2) is not held
        assert output_lock.hold(str(out2), 0, 2) is held  # this process' own: taken again, not refused
    finally:
        first.stdin.close()
        first.wait(timeout=10)
    # its process gone (however it ended), the lock is gone with it: the same command resumes and finishes
    m = prepare([rows], str(out), vocab_size=100, workers=0, eos_id=0, log=lambda _: None)
    assert m["n_docs"] == 10
    assert prepare([rows], str(out), vocab_size=100, workers=0, eos_id=0, log=lambda _: None)["n_docs"] == 10


@pytest.mark.parametrize("code", [errno.ENOLCK, errno.EINVAL, errno.EACCES])  # EACCES: another user's lock file
def test_where_files_cannot_be_locked_the_run_goes_on_with_one_note(tmp_path, monkeypatch, code):
    def no_locks(fd, op):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(output_lock.fcntl, "flock", no_locks)
    notes = []
    m = prepare([_rows(tmp_path)], str(tmp_path / "prep"), vocab_size=100, workers=0, eos_id=0, log=notes.append)
    assert m["n_docs"] == 10
    assert [n for n in notes if "cannot be locked" in n] and len([n for n in notes if "cannot be locked" in n]) == 1


def test_a_resume_leaves_tmp_files_alone(tmp_path):
    """An atomic write's tmp of another writer (where locks are unsupported) is not an uncommitted chunk to delete,
    and its name (host gpu-c01) is not parsed for a chunk number (int('01.77.') crashed)."""
    tmp = tmp_path / "tokens-s00000-c000000.npy.tmp.gpu-c01.77.5a1f.npy"
    tmp.write_bytes(b"x")
    stale = tmp_path / "tokens-s00000-c000000.bin"  # an uncommitted chunk: removed, as before
    stale.write_bytes(b"x")
    assert _resume_point(str(tmp_path), 0) == []
    assert tmp.exists() and not stale.exists()


def test_a_shard_begun_under_other_rules_is_not_continued_silently(tmp_path):
    """A preparation killed on yesterday's code and continued on today's mixed both days' tokenization rules in one
    shard (a chat row's system_prompt dropped in its first chunks, kept in the rest: an upgrade audit), and so did a
    merge of shards from two checkouts. The rules' version is in the plan: an unfinished shard under another one is
    refused (where a step between the versions changed rows it holds: bos2 changed text and ids rows), one begun
    before it was recorded is said; a finished shard is said, never refused (a review: the same command re-run after a
    rules change was refused); a merge refuses known versions that differ, naming the shard."""
    out = tmp_path / "prep"
    run = lambda log=lambda _: None: prepare([_rows(tmp_path)], str(out), vocab_size=100, workers=0, eos_id=0, log=log)  # noqa: E731
    run()
    plan = out / "plan-s00000.json"
    p = json.loads(plan.read_text())
    assert p["rules"] == packing.RULES
    plan.write_text(json.dumps({**p, "rules": "bos1:chat6:eos2:doc6"}))
    notes = []
    run(notes.append)  # finished: said
    assert any("was prepared by an older version" in n for n in notes), notes
    for f in ("shard-00000-of-00001.json", "manifest.json"):
        (out / f).unlink()
    with pytest.raises(ValueError, match=r"begun under other tokenization rules \(bos1:chat6.*\(bos2 \(text or any"):
        run()
    plan.write_text(json.dumps({k: v for k, v in p.items() if k != "rules"}))
    notes = []
    run(notes.append)  # unfinished, begun before the version was recorded: said
    assert any("was begun by an older version" in n and "--overwrite" in n for n in notes), notes
    notes = []
    output_lock.check_rules("o", [{"plan": {"rules": None}}, {"plan": {"rules": packing.RULES}}], notes.append)
    assert notes and "shard(s) [0]" in notes[0]
    with pytest.raises(ValueError, match=r"shard\(s\) \[1\] hold rows .*redo them with --overwrite"):
        output_lock.check_rules("o", [{"plan": {"rules": packing.RULES}}, {"plan": {"rules": "bos1:chat6:eos2:doc6"}}])


YESTERDAY = "bos2:chat9:eos2:doc8"  # (abe4933, the last of 2026-11-30) chat10-12 changed conversations only, doc9
# texts ending with the EOS string (counted in special_text_docs), doc10 ids rows with columns beside, doc11 texts
# starting with a new turn start (special_text_docs too)


def test_a_rules_step_refuses_only_shards_holding_the_rows_it_changed(tmp_path):
    """A review: a text-only preparation whose shards straddled a bump of chat9 / doc7 (rows it never held) was refused
    at its merge, and its shard begun yesterday refused its continuation. Only steps that changed rows a shard holds
    (packing.RULE_ROWS against its record's counts) refuse; the others are a note, and a record without the count
    (written before it) names the steps and their rows."""
    for k in range(2):
        (tmp_path / f"in{k}").mkdir()
        _rows(tmp_path / f"in{k}")
    out = tmp_path / "prep"
    for k in range(2):
        prepare([str(tmp_path / "in0"), str(tmp_path / "in1")], str(out), vocab_size=100, workers=0, eos_id=0,
                shard=(k, 2), log=lambda _: None)
    rec_path = out / "shard-00000-of-00002.json"
    rec = json.loads(rec_path.read_text())
    assert rec["chat_docs"] == rec["ids_beside_rows"] == rec["special_text_docs"] == 0
    rec_path.write_text(json.dumps({**rec, "plan": {**rec["plan"], "rules": YESTERDAY}}))
    notes = []
    assert merge(str(out), notes.append)["n_docs"] == 20
    assert any(f"shard(s) [0] were prepared under tokenization rules {YESTERDAY}, merged" in n
               and "changed only rows they hold none of" in n for n in notes), notes
    today = {"plan": {"rules": packing.RULES}}
    none = {"chat_docs": 0, "ids_beside_rows": 0, "special_text_docs": 0}
    for held, match in (({"chat_docs": 3}, r"\(chat10, chat11, chat12 \(conversations\)\): redo"),
                        ({"ids_beside_rows": 1}, r"\(doc10 \(pre-tokenized rows with"),
                        ({"special_text_docs": 3}, r"\(doc9, doc11 \(text documents holding a special-token string\)\): redo")):
        with pytest.raises(ValueError, match=r"shard\(s\) \[0\] hold rows today's .*" + match):
            output_lock.check_rules("o", [{"plan": {"rules": YESTERDAY}, **none, **held}, today])
    notes = []  # a text-only shard of yesterday, none of its texts holding a special-token string: merged, said
    output_lock.check_rules("o", [{"plan": {"rules": YESTERDAY}, **none}, today], notes.append)
    assert "chat10, chat11, chat12 (conversations); doc9, doc11 (text documents holding a special-token string); doc10 (pre-tokenized" \
           " rows with loss-mask, packing or attention_mask columns) changed only rows they hold none of" in notes[0], notes
    notes = []
    output_lock.check_rules("o", [{"plan": {"rules": YESTERDAY}, "chat_docs": 0}, today], notes.append)
    assert "doc9, doc11 (text documents holding a special-token string); doc10 (pre-tokenized rows with loss-mask, packing " \
           "or attention_mask columns) changed rows its record does not count" in notes[0], notes
    # continuing a shard begun yesterday: refused only where its committed chunks hold rows a step changed
    for k, (row, refused) in enumerate((({}, False), ({"assistant_masks": [0, 1, 1]}, True))):
        src = tmp_path / f"c{k}.jsonl"
        src.write_text("".join(json.dumps({"input_ids": [5, 6, 7], **row}) + "\n" for _ in range(20)))
        o = tmp_path / f"cont{k}"
        run = lambda log=lambda _: None, src=src, o=o: prepare(  # noqa: E731
            [str(src)], str(o), vocab_size=100, workers=0, eos_id=2, chunk_tokens=10, batch_docs=2, log=log)
        run()
        for f in ("shard-00000-of-00001.json", "manifest.json", "chunk-s00000-c000003.json"):
            (o / f).unlink()
        plan = o / "plan-s00000.json"
        plan.write_text(json.dumps({**json.loads(plan.read_text()), "rules": YESTERDAY}))
        notes = []
        if refused:
            with pytest.raises(ValueError,
                               match=r"holds rows they read differently \(chat10, chat11, chat12 \(conversations\); doc10"):
                run()
            continue
        assert run(notes.append)["n_docs"] == 20
        assert any("continued under today's" in n for n in notes), notes
        assert json.loads(plan.read_text())["rules"] == packing.RULES
    # chunks committed by yesterday's code hold no count of the rows doc7/doc8 changed: they may be there, and a
    # continuation would mix both readings in one shard (a review: pads kept in the first chunks, stripped after)
    o = tmp_path / "cont0"  # the text-like shard that continued above, killed again and its chunks made yesterday's
    for f in ("shard-00000-of-00001.json", "manifest.json", "chunk-s00000-c000003.json"):
        (o / f).unlink()
    chunk = o / "chunk-s00000-c000002.json"
    chunk.write_text(json.dumps({k: v for k, v in json.loads(chunk.read_text()).items() if k != "ids_beside_rows"}))
    plan = o / "plan-s00000.json"
    plan.write_text(json.dumps({**json.loads(plan.read_text()), "rules": YESTERDAY}))
    with pytest.raises(ValueError, match=r"doc10 \(pre-tokenized .* if its chunks hold any: their record cannot"):
        prepare([str(tmp_path / "c0.jsonl")], str(o), vocab_size=100, workers=0, eos_id=2, chunk_tokens=10,
                batch_docs=2, log=lambda _: None)


def test_a_shard_begun_by_an_older_version_is_refused_as_that(tmp_path):
    """An upgrade audit: a preparation killed on the code of 2026-11-29 and resumed by the same command today was
    refused as "another preparation (differs in ['inputs', 'text_specials', 'units'])": keys this version records and
    the older plan lacks, and its inputs named the older way (kind:/abs/path:size). Still refused (whether it read the
    rows alike cannot be told), now as an older version's shard, with --overwrite; another command is another
    preparation, as before."""
    out = tmp_path / "prep"
    rows = _rows(tmp_path)
    prepare([rows], str(out), vocab_size=100, workers=0, eos_id=0, log=lambda _: None)
    for f in ("shard-00000-of-00001.json", "manifest.json"):
        (out / f).unlink()
    plan = out / "plan-s00000.json"
    p = json.loads(plan.read_text())
    kind, _, size, _ = p["units"][0].split(":")
    older = {**{k: v for k, v in p.items() if k not in ("inputs", "text_specials", "rules", "clock")},
             "units": [f"{kind}:{os.path.abspath(rows)}:{size}"]}
    plan.write_text(json.dumps(older))
    with pytest.raises(ValueError) as e:
        prepare([rows], str(out), vocab_size=100, workers=0, eos_id=0, log=lambda _: None)
    msg = str(e.value)
    assert "was begun by an older version of prepare_data" in msg and "['inputs', 'text_specials']" in msg, msg
    assert "names its inputs the older way" in msg and "--overwrite" in msg and "another preparation" not in msg, msg
    plan.write_text(json.dumps({**older, "chunk_tokens": 7}))  # another command's shard: as before
    with pytest.raises(ValueError, match=r"holds shard 0 of another preparation \(differs in \['chunk_tokens'"):
        prepare([rows], str(out), vocab_size=100, workers=0, eos_id=0, log=lambda _: None)
    plan.write_text(json.dumps(older))
    m = prepare([rows], str(out), vocab_size=100, workers=0, eos_id=0, overwrite=True, log=lambda _: None)
    assert m["n_docs"] == 10


# packing.RULES -> sha256 of data/tokenizer.TURN_STARTS under it: which texts read as a rendered conversation
TURN_STARTS_UNDER = {"bos2:chat12:eos2:doc11": "564b18924d269a10"}


def test_a_change_of_the_turn_starts_is_a_rules_step():
    """A TURN_STARTS string a template-less tokenizer has as a special token makes a text starting with it read as a
    rendered conversation (data/tokenizer.rendered_start): its ids change, so a shard continued or merged across the
    change would hold both readings. 1abc775 added four under doc10 (a review measured 21 ids -> 8 for a text starting
    with `[|system|]` under EXAONE 4's tokenizer without its template): now doc11. Change TURN_STARTS, bump packing.RULES."""
    import hashlib

    from data.packing import RULE_ROWS, RULES
    from data.tokenizer import TURN_STARTS

    got = hashlib.sha256("\n".join(TURN_STARTS).encode()).hexdigest()[:16]
    assert TURN_STARTS_UNDER.get(RULES) == got, f"TURN_STARTS changed under {RULES}: bump its doc step in data/packing.py"
    assert RULE_ROWS[RULES.split(":")[-1]] == "special"  # counted in a shard's special_text_docs
