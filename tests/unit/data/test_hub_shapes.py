"""Hub datasets' shapes that were prepared wrong without a word (audit 68): KTO and ranking rows in chat form (a
label-false reply trained, `chosen` dropped), RAG `documents` beside the messages (dropped), a Hugging Face cache
folder of two snapshots (every row twice), a split missing a shard (trained without it), Mosaic MDS folders (index.json
read as a row, the shards ignored), OpenAssistant's message tables (every token trained) and the hints for lmsys /
ultrachat / Capybara / oasst2 trees. data/chat_rows.py, data/discover.py, data/jsonl.py, data/readers.py,
data/row_errors.py."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data.chat_rows import RowError, normalize
from data.discover import Unit, discover
from data.readers import Fields, iter_rows, parse_item

_U = lambda c: {"role": "user", "content": c}  # noqa: E731
_A = lambda c: {"role": "assistant", "content": c}  # noqa: E731
_PAIR = [_U("Tell me about water"), _A("Water is wet.")]


def _refused(row: dict) -> str:
    with pytest.raises(RowError) as e:
        normalize(row)
    assert "\n" not in str(e.value)
    return str(e.value)


def _table_rows(path, table: dict) -> list:
    pq.write_table(pa.table(table), path)
    return [parse_item(item, Fields()) for _, item in iter_rows(Unit("t", "parquet", str(path)), Fields())]


def _one_line(fn, *args) -> str:
    with pytest.raises(ValueError) as e:
        fn(*args)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_a_kto_row_in_chat_form_is_refused_jsonl_and_parquet(tmp_path):
    """LLaMA-Factory's kto_en_demo.json: {"messages": [...], "label": false} trained the label-false reply (the label
    was refused beside prompt / completion only)."""
    for row in ({"messages": _PAIR, "label": False}, {"conversations": [{"from": "human", "value": "Hi"},
                {"from": "gpt", "value": "Yo"}], "label": True}, {"instruction": "Hi", "output": "Yo", "label": False}):
        assert "boolean label" in _refused(row) and "an unpaired preference (KTO) row" in _refused(row)
    (value, _, err), = _table_rows(tmp_path / "k.parquet", {"messages": [_PAIR], "label": [False]})
    assert err is None and "an unpaired preference (KTO) row" in _refused(value)
    assert normalize({"messages": _PAIR, "label": 3})[1] == _PAIR  # a class label, not KTO's: read as before


def test_a_ranking_row_in_chat_form_is_refused_unless_its_conversation_is_the_chosen_one(tmp_path):
    """LLaMA-Factory's ranking rows (conversations ending on a human turn, chosen / rejected as {from, value}): the
    history's reply was trained and `chosen` dropped. ultrafeedback_binarized's `messages` (its `chosen`) still reads."""
    row = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"},
                             {"from": "human", "value": "A fact?"}],
           "chosen": {"from": "gpt", "value": "Paris is in France."}, "rejected": {"from": "gpt", "value": "No."}}
    err = _refused(row)
    assert err.startswith("chosen and rejected beside the conversations: a preference row") and "as messages" in err
    assert "a preference row" in _refused({"messages": _PAIR, "rejected": [_PAIR[0], _A("Fire.")]})
    chosen = {"prompt": "Tell me about water", "messages": _PAIR, "chosen": _PAIR, "rejected": [_PAIR[0], _A("Dry.")]}
    assert normalize(chosen)[1] == _PAIR
    assert normalize({"messages": _PAIR, "chosen": "Water is wet.", "rejected": "Dry."})[1] == _PAIR
    (value, _, err), = _table_rows(tmp_path / "r.parquet", {"messages": [_PAIR[:1]], "chosen": [[_A("Wet.")]],
                                                             "rejected": [[_A("Dry.")]]})
    assert err is None and "a preference row" in _refused(value)


def test_rag_documents_beside_the_messages_are_refused_unless_held(tmp_path):
    """apply_chat_template's `documents` beside the messages was dropped: the reply trained without its source."""
    docs = [{"title": "t", "text": "The sky on planet X is green."}]
    row = {"messages": [_U("What colour is the sky?"), _A("Green.")], "documents": docs}
    assert "'documents' beside the messages is not read here" in _refused(row)
    held = {"messages": [_U("The sky on planet X is green. Its colour?"), _A("Green.")], "documents": docs}
    assert normalize(held)[1] == held["messages"]
    (value, _, err), = _table_rows(tmp_path / "d.parquet", {"messages": [row["messages"]], "documents": [docs]})
    assert err is None and "'documents'" in _refused(value)


def _snapshot_repo(root) -> str:
    """A hub cache repo folder: one blob, two snapshots linking to it (a re-download keeps the older one)."""
    repo = os.path.join(root, "datasets--HuggingFaceH4--ultrachat_200k")
    os.makedirs(os.path.join(repo, "blobs"))
    os.makedirs(os.path.join(repo, "refs"))
    with open(os.path.join(repo, "refs", "main"), "w") as fh:
        fh.write("bbbb")
    pq.write_table(pa.table({"messages": [_PAIR]}), os.path.join(repo, "blobs", "0123abcd"))
    for sha in ("aaaa", "bbbb"):
        os.makedirs(os.path.join(repo, "snapshots", sha, "data"))
        os.symlink("../../../blobs/0123abcd", os.path.join(repo, "snapshots", sha, "data",
                                                            "train_sft-00000-of-00001.parquet"))
    return repo


def test_a_hub_cache_folder_of_two_snapshots_is_refused_naming_refs_main(tmp_path):
    """datasets--ORG--NAME/ with snapshots/<old>/ and snapshots/<new>/ (links to the same blob) read every snapshot:
    each row twice. Refused naming the snapshot refs/main names (as several splits are); one snapshot reads; two files
    of a glob that are one file are refused."""
    repo = _snapshot_repo(tmp_path)
    for path in (repo, str(tmp_path), os.path.join(repo, "snapshots")):
        err = _one_line(discover, path)
        assert "a Hugging Face cache folder of 2 snapshots" in err, err
        assert err.endswith(f"e.g. --input {repo}/snapshots/bbbb (refs/main's)"), err
    assert [u.kind for u in discover(os.path.join(repo, "snapshots", "bbbb"))] == ["parquet"]
    err = _one_line(discover, f"{repo}/snapshots/*/data/*.parquet")
    assert "are one file (links to" in err and "every row twice" in err, err
    os.remove(os.path.join(repo, "snapshots", "aaaa", "data", "train_sft-00000-of-00001.parquet"))
    os.rmdir(os.path.join(repo, "snapshots", "aaaa", "data"))
    os.rmdir(os.path.join(repo, "snapshots", "aaaa"))
    assert [os.path.basename(u.path) for u in discover(repo)] == ["train_sft-00000-of-00001.parquet"]  # not blobs/


def test_two_links_to_one_file_in_a_folder_are_refused(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "a b"}) + "\n")
    os.symlink("a.jsonl", tmp_path / "b.jsonl")
    assert "are one file (links to" in _one_line(discover, str(tmp_path))


def test_a_split_missing_a_shard_is_refused_naming_it(tmp_path):
    """train-00000-of-00003 and -00002 alone (a download cut short) trained without -00001 as a folder: refused; a
    glob too where it would name the missing shard (`train-*`, what the several-splits refusal suggests: a review),
    not where it names the files present on purpose (`train-0000[0]-*`)."""
    os.makedirs(tmp_path / "part" / "data")
    for k in (0, 2):
        pq.write_table(pa.table({"messages": [_PAIR]}), tmp_path / "part" / "data" / f"train-0000{k}-of-00003.parquet")
    err = _one_line(discover, str(tmp_path / "part"))
    assert "shard data/train-00001-of-00003.parquet of its split is missing" in err and "download it again" in err
    assert "train-00001-of-00003.parquet of its split is missing" in _one_line(
        discover, str(tmp_path / "part" / "data" / "train-*.parquet"))
    assert len(discover(str(tmp_path / "part" / "data" / "train-0000[0]-*.parquet"))) == 1
    pq.write_table(pa.table({"messages": [_PAIR]}), tmp_path / "part" / "data" / "train-00001-of-00003.parquet")
    assert len(discover(str(tmp_path / "part"))) == 3
    for k in (1, 3):  # numbered from 1 (safetensors' way): the count is a shard's number
        (tmp_path / "one" / f"c4-train.0000{k}-of-00003.jsonl").parent.mkdir(exist_ok=True)
        (tmp_path / "one" / f"c4-train.0000{k}-of-00003.jsonl").write_text(json.dumps({"text": "a b"}) + "\n")
    assert "shard c4-train.00002-of-00003.jsonl of its split is missing" in _one_line(discover, str(tmp_path / "one"))


def test_older_push_to_hub_shards_with_a_fingerprint_each_are_one_split(tmp_path):
    """HuggingFaceH4/ultrachat_200k: `train_sft-00000-of-00003-a3ecf92756993583.parquet`, a fingerprint per shard:
    grouped by the whole suffix, every complete download was refused (folder and glob). One missing is named `-*`."""
    data = tmp_path / "uc" / "data"
    data.mkdir(parents=True)
    for k, fp in enumerate(("a3ecf92756993583", "0a1804bcb6ae68c6", "ee46ed25cfae92c6")):
        pq.write_table(pa.table({"messages": [_PAIR]}), data / f"train_sft-0000{k}-of-00003-{fp}.parquet")
    assert len(discover(str(tmp_path / "uc"))) == 3
    assert len(discover(str(data / "train_sft-*.parquet"), flag="--dataset_path")) == 3
    os.remove(data / "train_sft-00001-of-00003-0a1804bcb6ae68c6.parquet")
    err = _one_line(discover, str(tmp_path / "uc"))
    assert "shard data/train_sft-00001-of-00003-*.parquet of its split is missing" in err, err
    pq.write_table(pa.table({"messages": [_PAIR]}), data / "test_sft-00000-of-00001-1234567890abcdef.parquet")
    assert "e.g. --input '" + str(data / "train_sft-*.parquet") + "'" in _one_line(discover, str(tmp_path / "uc"))


def test_a_subset_of_a_sharded_corpus_reads_with_a_note(tmp_path, capsys):
    """C4's en/c4-train.0000[0-2]-of-01024.json.gz (fetched with --include: the-stack, wikipedia, cosmopedia alike)
    trained, then was refused as a folder and as its prefix glob. A glob reads; a folder with fewer than half its
    split's shards reads, saying how many are there."""
    en = tmp_path / "c4" / "en"
    en.mkdir(parents=True)
    for k in range(3):
        (en / f"c4-train.0000{k}-of-01024.jsonl").write_text(json.dumps({"text": "a b"}) + "\n")
    assert len(discover(str(en / "c4-train.0000*-of-01024.jsonl"))) == 3
    assert len(discover(str(tmp_path / "c4"), flag="--dataset_path")) == 3
    out = capsys.readouterr().out
    assert "3 of the 1024 shards of en/c4-train.*-of-01024.jsonl are here: reading those" in out, out


def test_a_mosaic_mds_folder_is_refused_by_name(tmp_path):
    """princeton-nlp/prolong-data: index.json was read as a row (wrong hint), shard.*.mds[.zstd] ignored: with
    --skip_bad_rows the data was gone without a word."""
    mds = tmp_path / "prolong" / "ultrachat"
    mds.mkdir(parents=True)
    (mds / "index.json").write_text(json.dumps({"shards": [{"format": "mds"}], "version": 2}))
    (mds / "shard.00000.mds").write_bytes(b"\0" * 64)
    (mds / "shard.00001.mds.zstd").write_bytes(b"\0" * 64)
    (tmp_path / "prolong" / "chat.jsonl").write_text(json.dumps({"messages": _PAIR}) + "\n")
    for path in (tmp_path / "prolong", mds / "index.json"):
        err = _one_line(discover, str(path))
        assert "Mosaic streaming (MDS) shards" in err and err.endswith("convert them to JSONL / Parquet"), err
    (mds / "index.json").unlink()
    assert "shard.00001.mds.zstd" in _one_line(discover, str(tmp_path / "prolong"))  # refused by name, not ignored


def test_an_openassistant_message_table_is_refused(tmp_path):
    """oasst1 / oasst2 (a row a message: text, role, parent_id, message_tree_id) was read as plain text, every
    token trained, the prompter's too."""
    table = {"message_id": ["a", "b"], "parent_id": [None, "a"], "text": ["Capital of France?", "Paris."],
             "role": ["prompter", "assistant"], "message_tree_id": ["a", "a"]}
    pq.write_table(pa.table(table), tmp_path / "train-00000-of-00001.parquet")
    err = _one_line(lambda: list(iter_rows(Unit("t", "parquet", str(tmp_path / "train-00000-of-00001.parquet")),
                                           Fields())))
    assert "a message-per-row tree (OpenAssistant's" in err and "build conversations as `messages`" in err, err
    row = {k: v[1] for k, v in table.items()}
    assert "a message-per-row tree" in parse_item(json.dumps(row).encode(), Fields())[2]
    assert parse_item(json.dumps({"text": "a b", "role": "x"}).encode(), Fields())[0] == "a b"


def test_hints_name_the_chat_format_parquet_too_and_offer_no_id_field(tmp_path):
    """lmsys-chat-1m in Parquet listed only its columns (JSONL named the format); stingning/ultrachat's `data` list of
    strings was hinted `--text_field id`, Capybara's [{input, output}] `--text_field source`; an oasst2 tree was told
    to "flatten the rows"."""
    pq.write_table(pa.table({"conversation_id": ["x"], "conversation": [_PAIR], "model": ["vicuna"]}),
                   tmp_path / "l.parquet")
    err = _one_line(lambda: list(iter_rows(Unit("l", "parquet", str(tmp_path / "l.parquet")), Fields())))
    assert err.endswith("(its turns in 'conversation'): convert its rows to `messages` (docs/sft.md)"), err
    rows = {"ultrachat": {"id": "0", "data": ["How can cross training help runners?", "It helps in many ways."]},
            "capybara": {"source": "airoboros", "conversation": [{"input": "Hi there", "output": "Hello you"}]}}
    for name, row in rows.items():
        err = parse_item(json.dumps(row).encode(), Fields())[2]
        assert "--text_field" not in err and "a chat dataset in a format not read here (its turns in" in err, (name, err)
    err = parse_item(json.dumps({"id": "0", "lang": "en"}).encode(), Fields())[2]
    assert "--text_field" not in err and err.endswith("none of them a text"), err
    tree = {"message_tree_id": "a", "prompt": {"message_id": "a", "text": "Q?", "role": "prompter", "replies": []}}
    err = parse_item(json.dumps(tree).encode(), Fields())[2]
    assert "'prompt' holds a message tree (OpenAssistant's" in err and "flatten" not in err, err
    stack = {"content": "def f(): pass", "licenses": ["MIT License", "Apache License"], "id": "abc"}  # not a chat
    assert parse_item(json.dumps(stack).encode(), Fields())[2].endswith("--text_field content")


def test_a_split_spread_over_sub_folders_is_one_split(tmp_path):
    """A complete split whose shards sit in two folders (a/ 0-4, b/ 5-9) was refused as missing half of them, as a
    folder and as a glob (`*/train-*`): shards grouped by folder (a review)."""
    for k in range(10):
        sub = tmp_path / "g" / ("a" if k < 5 else "b")
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"train-{k:05d}-of-00010.jsonl").write_text(json.dumps({"text": "a b"}) + "\n")
    assert len(discover(str(tmp_path / "g"))) == 10
    assert len(discover(str(tmp_path / "g" / "*" / "train-*.jsonl"))) == 10


def test_configs_in_folders_of_their_own_are_judged_each(tmp_path):
    """A dataset's configs in folders of their own (`en/`, `fr/`: Hugging Face's multi-config layout) with the same
    shard counts: fr lacking its shard 1 was covered by en's when shards were grouped across folders (a review)."""
    for lang, ks in (("en", (0, 1)), ("fr", (0,))):
        (tmp_path / "ds" / lang).mkdir(parents=True)
        for k in ks:
            (tmp_path / "ds" / lang / f"train-{k:05d}-of-00002.jsonl").write_text(json.dumps({"text": "a b"}) + "\n")
    assert "shard fr/train-00001-of-00002.jsonl of its split is missing" in _one_line(discover, str(tmp_path / "ds"))
